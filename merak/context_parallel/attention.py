"""Attention across the context-parallel split for any HF family, through transformers'
attention-function registry (``transformers.AttentionInterface``).

`enable_context_parallel(model, group, mode)` registers a `ContextParallelAttention` under a
name of its own and makes it the model's ``config._attn_implementation``; it wraps the
implementation the model was asked to use before (eager, sdpa, flash_attention_*). Every HF
family whose attention calls the registry then runs context-parallel attention, with no change
to the model's code. transformers builds no mask for an implementation it does not know, so the
model's own (local) mask is never used: the causal structure across the split is the wrapper's.

- ``ulysses`` (`merak.context_parallel.ulysses`): an all-to-all gives each rank a 1/cp share of
  the heads over the whole row; the wrapped implementation runs on it (row put back in natural
  order; sdpa and flash causal by their flag, eager and windows over query blocks with block
  masks, never S x S); a second all-to-all returns the rank's tokens with every head. Needs the
  query heads on the rank divisible by cp; key/value heads are repeated where cp does not
  divide them.
- ``ring`` (`merak.context_parallel.ring`): K/V blocks go around the ring, each block on a
  fused attention kernel returning its log-sum-exp (the registry's implementations do not),
  merged by online softmax; any head count; its backward is written out.
"""

from __future__ import annotations

import itertools
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from merak.context_parallel.ring import ring_attention
from merak.context_parallel.ulysses import check_heads, ulysses_attention

MODES = ("ulysses", "ring")
PREFIX = "merak_context_parallel"
_names = itertools.count()
# the layer types whose attention the split keeps correct (the rest mix the sequence otherwise)
ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "attention")
# values that change what attention computes, which ring attention's own block math lacks
_RING_UNSUPPORTED = ("softcap", "s_aux", "sinks", "position_bias")


def _family(module_or_config) -> str:
    config = getattr(module_or_config, "config", module_or_config)
    return getattr(config, "model_type", None) or type(module_or_config).__name__


def unsupported_reason(model: nn.Module, mode: str) -> str | None:
    """Why `model`'s attention cannot be wrapped for context parallelism, or None."""
    if mode not in MODES:
        return f"cp_mode must be one of {MODES}, got {mode!r}"
    config = getattr(model, "config", None)
    name = type(model).__name__
    if config is None or not hasattr(config, "_attn_implementation"):
        return (f"{name} is not a transformers model: context parallelism wraps the attention "
                f"functions of transformers' registry, which {name} does not call")
    family = _family(config)
    if getattr(config, "is_encoder_decoder", False):
        return (f"the {family} family is an encoder-decoder: context parallelism splits one "
                f"causal sequence, not cross-attention between two")
    if getattr(config, "alibi", False) or getattr(config, "position_embedding_type",
                                                  None) == "alibi":
        return (f"the {family} family adds ALiBi biases through the attention mask, which the "
                f"context-parallel attention does not use")
    other = sorted({t for t in getattr(config, "layer_types", None) or ()
                    if t not in ATTENTION_LAYER_TYPES})
    if other:
        return (f"the {family} family has {', '.join(other)} layers, which carry state along "
                f"the sequence outside attention: the split would cut it")
    convs = [n for n, m in model.named_modules() if isinstance(m, nn.Conv1d)]
    if convs:
        return (f"the {family} family mixes neighbouring tokens with convolutions ({convs[0]}), "
                f"which the split would cut at every chunk boundary")
    if not getattr(type(model), "_supports_attention_backend", False):
        return (f"the {family} family computes attention (or its sequence mixing) in its own "
                f"code: {name} does not declare that it calls transformers' attention-function "
                f"registry (_supports_attention_backend), so Merak cannot wrap it")
    return None


@dataclass
class ContextParallelAttention:
    """The registered attention function: ``(module, query, key, value, attention_mask,
    **kwargs) -> (output (B, S_local, H, D), None)`` for this rank's load-balanced tokens."""

    group: dist.ProcessGroup
    mode: str
    inner: str  # the implementation the model was asked to use
    name: str = field(default_factory=lambda: f"{PREFIX}_{next(_names)}")
    calls: int = 0
    # Ulysses: the query rows per call of an implementation that needs a mask (eager, or sdpa
    # with a sliding window); the mask of each call is (block_size x the keys it sees)
    block_size: int = 1024

    @property
    def cp(self) -> int:
        return dist.get_world_size(self.group)

    # Dynamo (torch.compile) runs the wrapper eagerly, outside the graph: traced, the capture
    # branch below (fake tensors) would compile attention over the rank's own tokens alone
    @torch.compiler.disable
    def __call__(self, module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                 value: torch.Tensor, attention_mask: torch.Tensor | None,
                 scaling: float | None = None, dropout: float = 0.0, **kwargs):
        if _traced(query):  # Merak's capture runs blocks on fake tensors and keeps them eager:
            # only the shapes (this rank's tokens) matter here
            inner = _inner_function(module, self.inner)
            passed = {name: x for name, x in kwargs.items() if name not in _LOCAL_KWARGS}
            return inner(module, query, key, value, None, scaling=scaling, dropout=dropout,
                         **passed)
        self.calls += 1
        seq_len = query.shape[2] * self.cp
        causal = bool(getattr(module, "is_causal", True))
        window = kwargs.get("sliding_window", getattr(module, "sliding_window", None))
        window = window if isinstance(window, int) and window < seq_len else None
        scaling = scaling if scaling is not None else query.shape[-1] ** -0.5
        if self.mode == "ulysses":
            out = self._ulysses(module, query, key, value, scaling, dropout, causal, window,
                                kwargs)
        else:
            self._check_ring(module, dropout, window, seq_len, kwargs)
            out = ring_attention(query, key, value, self.group, scaling, causal)
            out = out.transpose(1, 2).contiguous()
        return out, None

    # -- Ulysses ------------------------------------------------------------------------------
    def _ulysses(self, module, query, key, value, scaling, dropout, causal, window, kwargs):
        check_heads(query.shape[1], self.cp, _family(module), type(module).__name__)
        if self.inner.startswith("flash"):
            kind = "flash"
        elif self.inner in ("eager", "sdpa"):
            kind = self.inner
        else:
            raise NotImplementedError(
                f"cp_mode='ulysses' wraps eager, sdpa and flash_attention_*; the model asked "
                f"for {self.inner!r}, whose mask Merak does not build: use one of those")
        passed = {name: x for name, x in kwargs.items() if name not in _LOCAL_KWARGS}
        return ulysses_attention(module, query, key, value, self.group,
                                 _inner_function(module, self.inner), kind, scaling, dropout,
                                 causal, window, passed, self.block_size)

    # -- ring -----------------------------------------------------------------------------------
    def _check_ring(self, module, dropout, window, seq_len, kwargs):
        family = _family(module)
        if window is not None:
            raise NotImplementedError(
                f"cp_mode='ring' cannot run the {family} family's sliding-window attention "
                f"(window {window} < the row's {seq_len} tokens): the split would cut the "
                f"window across ranks; use cp_mode='ulysses', or rows no longer than the "
                f"window")
        if dropout and module.training:
            raise NotImplementedError(
                f"cp_mode='ring' has no attention dropout (the {family} family's is "
                f"{dropout}): set the config's attention dropout to 0 or use cp_mode='ulysses'")
        used = [k for k in _RING_UNSUPPORTED if kwargs.get(k) is not None]
        if used:
            raise NotImplementedError(
                f"cp_mode='ring' cannot run the {family} family's attention: it passes "
                f"{', '.join(used)}, which ring attention's block math does not apply; use "
                f"cp_mode='ulysses'")


# values describing the rank's local tokens, wrong for the whole row the inner one sees
_LOCAL_KWARGS = ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                 "max_length_k", "is_causal")


def _traced(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is traced (fake or meta) rather than computed."""
    from torch._subclasses.fake_tensor import is_fake

    return tensor.is_meta or is_fake(tensor)


def _inner_function(module: nn.Module, inner: str):
    """The implementation `inner` of transformers' registry; "eager" is the family's own
    ``eager_attention_forward`` (in the attention module's modeling file)."""
    from transformers import AttentionInterface

    registry = AttentionInterface()
    if inner != "eager":
        return registry[inner]
    eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
    if eager is None:
        raise NotImplementedError(
            f"the {_family(module)} family's eager attention is not a module-level "
            f"eager_attention_forward that Merak can wrap; load the model with "
            f"attn_implementation='sdpa'")
    return eager


def enable_context_parallel(model: nn.Module, group: dist.ProcessGroup,
                            mode: str = "ulysses") -> ContextParallelAttention:
    """Make `model` (an HF model) attend across the context-parallel split over `group`: its
    config's attention implementation becomes a registered `ContextParallelAttention` wrapping
    the implementation it had. Its inputs must then be each rank's `split_batch` share.

    Raises:
        NotImplementedError: the family's attention cannot be wrapped (`unsupported_reason`).
    """
    from transformers import AttentionInterface

    target = model.get_base_model() if hasattr(model, "get_base_model") else model
    reason = unsupported_reason(target, mode)
    if reason is not None:
        raise NotImplementedError(f"context parallelism: {reason}")
    config = target.config
    inner = config._attn_implementation or "eager"
    current = active_attention(model)
    if current is not None:
        inner = current.inner
    attention = ContextParallelAttention(group, mode, inner)
    AttentionInterface.register(attention.name, attention)
    config._attn_implementation = attention.name
    return attention


def active_attention(model: nn.Module) -> ContextParallelAttention | None:
    """The `ContextParallelAttention` `model` runs, or None."""
    from transformers import AttentionInterface

    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None)
    if not isinstance(name, str) or not name.startswith(PREFIX):
        return None
    return AttentionInterface()[name]


def disable_context_parallel(model: nn.Module) -> None:
    """Give `model` back the attention implementation it had before."""
    attention = active_attention(model)
    if attention is not None:
        model.config._attn_implementation = attention.inner
