"""While a model is traced for training: no materialized causal mask where HF's eager forward
would let SDPA apply causality itself.

HF's SDPA mask builder (`transformers.masking_utils.sdpa_mask`) returns no mask when nothing is
padded and queries and keys have the same length, so SDPA runs with ``is_causal=True`` and
picks its fastest kernels. It refuses to do so while anything is traced, because an exported
graph would then hard-code ``is_causal`` for the example's shapes, which is wrong when the
graph is later run with a query of one token against a cache. Merak's stage graphs are never
run that way: they are traced for a training forward (no cache; queries and keys are the
micro-batch's own tokens at every sequence length) and generation runs the model's own forward
(merak/generation/stage_view.py). So without this, every Merak stage passed a materialized
(batch, 1, seq, seq) mask that eager HF never builds: on one H200, a 1.1 B Llama's SDPA backward
took 2.3x as long (the flash kernel cannot take a mask) and the run reached 0.89x HF Trainer's
tokens/s (bench/results/single_gpu_profile_h200.log).

`skip_unpadded_causal_mask(inputs)` makes HF's decisions as in eager mode for exactly that
case, where the traced batch's inputs decide them for every batch:
- no ``position_ids`` input: the model numbers positions 0..seq-1 itself, so no row holds
  packed sequences; HF still derives a packed-sequence mask from those positions while tracing
  (it cannot read them), which forbids the skip. Here that derivation answers None, as it does
  in eager mode for such positions. With ``position_ids`` given (padding-free packing,
  `DataCollatorWithFlattening`) the derivation is traced as HF traces it.
- no ``attention_mask`` input: nothing is padded, so the mask is skipped as in eager mode, except
  for sliding-window layers (eager HF skips theirs only while the sequence is shorter than the
  window, which the traced batch's length cannot decide for every later batch). A batch
  with an ``attention_mask`` keeps the materialized mask (HF eager drops it only after reading
  that it is all ones, which a traced graph cannot do per batch).
transformers' tracing checks are by name in `masking_utils` (5.17: ``is_tracing``; 5.24:
``is_torchdynamo_exporting`` too); they are replaced for the duration of one decision, only when
the padding mask is None.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

_TRACING_CHECKS = ("is_tracing", "is_torchdynamo_exporting", "is_torchdynamo_compiling")


@contextlib.contextmanager
def skip_unpadded_causal_mask(inputs):
    """For the duration: HF's SDPA mask builder decides as in eager mode for batches with the
    keys of `inputs` (a no-op where transformers lacks the helpers this relies on, or where the
    inputs carry an attention mask)."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    decide = getattr(masking_utils, "_ignore_causal_mask_sdpa", None)
    find_packed = getattr(masking_utils, "find_packed_sequence_indices", None)
    if decide is None or find_packed is None or "attention_mask" in inputs:
        yield
        return

    signature = inspect.signature(decide)

    @functools.wraps(decide)
    def as_in_eager_mode(padding_mask, *args, **kwargs):
        window = signature.bind(padding_mask, *args, **kwargs).arguments.get(
            "local_attention_size")
        if padding_mask is not None or window is not None:
            # a sliding window: eager HF skips its mask only while the sequence is shorter than
            # the window, which the traced batch's length cannot decide for every batch
            return decide(padding_mask, *args, **kwargs)
        saved = {name: getattr(masking_utils, name) for name in _TRACING_CHECKS
                 if hasattr(masking_utils, name)}
        for name in saved:
            setattr(masking_utils, name, lambda *_: False)
        try:
            return decide(padding_mask, *args, **kwargs)
        finally:
            for name, check in saved.items():
                setattr(masking_utils, name, check)

    masking_utils._ignore_causal_mask_sdpa = as_in_eager_mode
    if "position_ids" not in inputs:
        masking_utils.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        masking_utils._ignore_causal_mask_sdpa = decide
        masking_utils.find_packed_sequence_indices = find_packed
