"""`neftune_noise_alpha` for `MerakTrainer`: NEFTune (noisy embeddings for fine-tuning,
https://huggingface.co/papers/2310.05914), as HF's `neftune_post_forward_hook` computes it: in
training, the input embedding's output gets uniform noise in [-mag, mag] with
``mag = alpha / sqrt(seq_len * hidden)`` (``output.size(1) * output.size(2)``).

HF's hook draws the noise from the global RNG. Merak cannot use it as is:

- the tensor-parallel ranks of a group hold the same embedding output (a vocab-parallel
  embedding all-reduces it; a replicated one computes it alike) and must add the same noise, or
  their replicas of everything downstream diverge; the global stream is not guaranteed to be at
  the same point on them (the TP random state swaps streams, other stages draw differently);
- the noise must differ across data-parallel ranks (different rows) and must not shift the
  dropout stream the pipeline relies on to match a single-process run;
- a recomputed forward must see the same noise again.

So the noise comes from a `torch.Generator` of its own, on the embedding's device, seeded from
(``args.seed``, dp rank, training step, micro-batch, call within that micro-batch's forward):
the same on the TP ranks of a group, different across dp ranks, reproducible after a resume
(the step is the trainer's ``global_step``) and whatever the schedule's order of micro-batches.
The micro-batch comes from the interpreter's instructions (`NEFTune` is an `InstructionHook`):
a ``recompute`` of micro-batch m restarts its call count, so the rerun draws the same noise.

The embedding module is kept opaque by the pipeline split (a leaf module: the stage graph calls
the module itself, so its forward hook runs); the hook adds nothing in eval mode, without
gradients (the runtime's shape discovery) or while torch.export traces the model (the split).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable

import torch
from torch import nn

from merak.runtime.hooks import InstructionHook
from merak.schedule.actions import Action, ActionKind


def noise_seed(seed: int, dp_rank: int, step: int, microbatch: int, call: int) -> int:
    """The generator seed of one noisy embedding call (63 bits of a hash of the key)."""
    key = f"neftune:{seed}:{dp_rank}:{step}:{microbatch}:{call}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") >> 1


def neftune_noise(output: torch.Tensor, alpha: float, seed: int) -> torch.Tensor:
    """HF's NEFTune noise for embedding `output` ([batch, seq, hidden]), drawn from a generator
    seeded with `seed` on the output's device."""
    magnitude = alpha / math.sqrt(output.size(1) * output.size(2))
    generator = torch.Generator(device=output.device)
    generator.manual_seed(seed)
    return torch.empty_like(output).uniform_(-magnitude, magnitude, generator=generator)


def opaque_modules(model: nn.Module, embedding: nn.Module) -> tuple[str, ...]:
    """What the split must keep opaque for the hook to run: the qualified name of `embedding`
    in `model`, unless it lies inside a block (blocks run eagerly whole; a recomputed block
    reruns it, and the ``recompute`` instruction restarts the key, so the noise is the same)."""
    from merak.stages.blocks import find_blocks, within

    for name, module in model.named_modules():
        if module is embedding and name:
            return () if any(within(name, b) for b in find_blocks(model)) else (name,)
    raise ValueError(f"neftune_noise_alpha: the input embedding ({type(embedding).__name__}) "
                     f"is not a submodule of {type(model).__name__}")


def input_embedding(model: nn.Module) -> nn.Module:
    get = getattr(model, "get_input_embeddings", None)
    embedding = get() if callable(get) else None
    if not isinstance(embedding, nn.Module):
        raise ValueError(f"neftune_noise_alpha needs the model's input embedding: "
                         f"{type(model).__name__}.get_input_embeddings() returns none (HF "
                         f"models have one; define it on a custom model)")
    return embedding


class NEFTune(InstructionHook):
    """The noise hook on this rank's input embedding (if its stage holds it), keyed by the
    instruction being run.

    Args:
        alpha: ``neftune_noise_alpha``.
        seed: ``args.seed``.
        dp_rank: this rank's data-parallel rank.
        step: returns the training step being run (the trainer's ``state.global_step``).
    """

    def __init__(self, alpha: float, seed: int, dp_rank: int, step: Callable[[], int]):
        self.alpha, self.seed, self.dp_rank, self.step = alpha, seed, dp_rank, step
        self.microbatch, self.calls = 0, 0
        self.handle = None

    def attach(self, stage: nn.Module, embedding: nn.Module) -> bool:
        """Hook `embedding` if `stage` holds it; True if it does."""
        if not any(m is embedding for m in stage.modules()):
            return False
        self.handle = embedding.register_forward_hook(self._hook)
        return True

    def remove(self) -> None:
        if self.handle is not None:
            self.handle.remove()
            self.handle = None

    def on_instruction_begin(self, name: str, action: Action) -> None:
        if action.kind in (ActionKind.FORWARD, ActionKind.RECOMPUTE):
            self.microbatch, self.calls = action.microbatch_id, 0

    def _hook(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
        if not module.training or not torch.is_grad_enabled() or torch.compiler.is_exporting():
            return None  # evaluation, shape discovery, the split's trace
        seed = noise_seed(self.seed, self.dp_rank, self.step(), self.microbatch, self.calls)
        self.calls += 1
        return output + neftune_noise(output, self.alpha, seed)
