"""Sub-pipelined tensor parallelism (``tp_overlapping_level``): hide TP all-reduces behind compute.

A Megatron pair (column-parallel -> row-parallel) all-reduces once in forward (the row layer's
partial sums) and once in backward (the column layer's input gradient). Level 0 waits for each
where it happens. Here the micro-batch is cut into `num_sub_batches` sub-batches (equal slices
along `dim`, the batch by default) so that an all-reduce of one runs (``async_op=True``) while
the next one computes. What overlaps with what, honestly:

Level 1, inside each TP layer (every column and row layer of the model):
  * forward, row layer: the all-reduce of sub-batch k's partial product overlaps the matmul of
    sub-batch k+1; the last sub-batch's all-reduce is exposed.
  * backward, column layer (the backward of its input copy is the all-reduce of the input
    gradient): sub-batch k's input-gradient all-reduce overlaps sub-batch k+1's input-gradient
    matmul, and the last ones overlap the weight- and bias-gradient matmuls (over the whole
    micro-batch).
  * the column forward and the row backward have no communication; they run as at level 0.
  No random draws move, so level 1 equals level 0 even with dropout.

Level 2, across a block's attention and MLP (each repeated block that holds a row layer): the
block input is split into `num_sub_batches` sub-batches that run the block's own, unchanged
forward as coroutines; each yields right after launching a row layer's all-reduce. With two
sub-batches A and B of a Llama or GPT-2 block::

    A: norm, attention, o_proj partial -> all-reduce(A.attn) started, yield
    B: norm, attention, o_proj partial -> all-reduce(B.attn) started   [overlaps A.attn's]
    A: wait A.attn; residual, norm, MLP -> all-reduce(A.mlp) started   [overlaps B.attn's]
    B: wait B.attn; residual, norm, MLP -> all-reduce(B.mlp) started   [overlaps A.mlp's]
    A: wait A.mlp, residual; B: wait B.mlp (exposed), residual

  The backward is autograd's over the sub-batches' graphs: each column layer's input-gradient
  all-reduce overlaps its own weight-gradient matmul, not the other sub-batch's work. TP layers
  outside the blocks (a vocab-parallel LM head) behave as at level 1. Dropout inside a block
  draws its masks per sub-batch (same distribution, the same on every TP rank, but not the
  masks of level 0), so level 2 equals level 0 only without dropout; weight gradients are sums
  over sub-batches, equal to level 0's up to float rounding.

The sub-batches are coroutines on threads, one running at a time
(`merak.tensor_parallel.overlap.interleaver` says why and how): collectives, random draws and
autograd nodes are issued in the same order on every rank. A block called under saved-tensor hooks
(activation recomputation, the pipeline's memory meter, offload: those hooks are thread-local and
must see the block's saved tensors in one order) or with a KV cache (sub-batches cannot share one)
runs whole, its TP layers as at level 1; while tracing or compiling, everything runs as at level 0.

On CPU (gloo) the all-reduces run on gloo's own threads, which compete with compute for the same
cores: expect small gains there (``bench/tp_overlap.py`` measures them). Sequence parallelism is
not supported at levels 1 and 2.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import _pytree as pytree
from transformers.cache_utils import Cache
from transformers.pytorch_utils import Conv1D

from merak.tensor_parallel.layers.collectives import all_reduce_async, communicates, tracing
from merak.tensor_parallel.layers.megatron import ColumnParallel, RowParallel
from merak.tensor_parallel.overlap.interleaver import Interleaver

LEVELS = {0: "off", 1: "within each TP layer pair", 2: "across a block's attention and MLP"}
_NO_SEQUENCE_PARALLEL = ("tp overlap levels 1 and 2 do not support sequence parallelism yet; set "
                         "sequence_parallel=False or tp_overlapping_level=0")


# ------------------------------------------------------------------ the TP layers' autograd
def _compute_dtype(x: torch.Tensor) -> torch.dtype | None:
    device = x.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None


def _cast(t: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    return t if t is None or dtype is None or not t.is_floating_point() else t.to(dtype)


def _input_grad(grad: torch.Tensor, weight: torch.Tensor, transposed: bool) -> torch.Tensor:
    """dX = dY W for nn.Linear's weight [out, in]; Conv1D stores [in, out]."""
    return grad.matmul(weight.t() if transposed else weight)


def _weight_grad(grad: torch.Tensor, x: torch.Tensor, transposed: bool) -> torch.Tensor:
    g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
    return x2.t().mm(g2) if transposed else g2.t().mm(x2)


class _ColumnLinear(torch.autograd.Function):
    """The local linear map (no forward communication); backward all-reduces the input gradient
    sub-batch by sub-batch while computing the next sub-batch's and then the weight gradient."""

    @staticmethod
    def forward(ctx, x, weight, bias, linear, transposed, group, num_sub_batches, dim):
        dtype = _compute_dtype(x)
        ctx.save_for_backward(_cast(x, dtype), weight)
        ctx.dtype, ctx.transposed, ctx.group, ctx.num_sub_batches, ctx.dim = (
            dtype, transposed, group, num_sub_batches, dim)
        return linear(x)  # the layer's own forward, under the caller's autocast

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        w = _cast(weight, ctx.dtype)
        grad = _cast(grad, ctx.dtype)
        grad_x = grad_w = grad_b = None
        pending = []
        if ctx.needs_input_grad[0]:
            for g in grad.chunk(ctx.num_sub_batches, ctx.dim):
                pending.append(all_reduce_async(_input_grad(g, w, ctx.transposed), ctx.group))
        if ctx.needs_input_grad[1]:  # these matmuls overlap the all-reduces in flight
            grad_w = _weight_grad(grad, x, ctx.transposed).to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_b = grad.reshape(-1, grad.shape[-1]).sum(0).to(weight.dtype)
        if pending:
            for _, work in pending:
                work.wait()
            grad_x = torch.cat([buffer for buffer, _ in pending], ctx.dim).to(x.dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None


class _RowLinear(torch.autograd.Function):
    """Sum of the ranks' partial products, all-reduced sub-batch by sub-batch while the next
    sub-batch's product is computed (and, in a level-2 block, while the other sub-batches of the
    block run: `switch`). Backward has no communication."""

    @staticmethod
    def forward(ctx, x, weight, partial, transposed, group, num_sub_batches, dim, switch):
        dtype = _compute_dtype(x)
        ctx.save_for_backward(_cast(x, dtype), weight)
        ctx.dtype, ctx.transposed = dtype, transposed
        pending = [all_reduce_async(partial(sub_batch), group)
                   for sub_batch in x.chunk(num_sub_batches, dim)]
        if switch is not None:
            switch()
        for _, work in pending:
            work.wait()
        return torch.cat([buffer for buffer, _ in pending], dim)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad = _cast(grad, ctx.dtype)
        grad_x = grad_w = None
        if ctx.needs_input_grad[0]:
            grad_x = _input_grad(grad, _cast(weight, ctx.dtype), ctx.transposed).to(x.dtype)
        if ctx.needs_input_grad[1]:
            grad_w = _weight_grad(grad, x, ctx.transposed).to(weight.dtype)
        return grad_x, grad_w, None, None, None, None, None, None


# ------------------------------------------------------------------ per layer / per block
@dataclass(frozen=True)
class LayerOverlap:
    """How one TP layer sub-pipelines: `num_sub_batches` sub-batches along `dim`. In a level-2
    block (`interleaver` set): each call is already one of the block's sub-batches, so it runs
    whole and yields after starting its all-reduce while the block interleaves its sub-batches;
    `num_sub_batches` sub-batches (level 1) when the block runs whole."""

    num_sub_batches: int
    dim: int
    name: str
    interleaver: Interleaver | None = None

    def applies(self, group) -> bool:
        return communicates(group) and not torch.compiler.is_compiling()

    def _plan(self, x: torch.Tensor) -> tuple[int, Callable | None]:
        """(sub-batches, yield point or None) for this call; checks that `x` splits evenly."""
        if self.interleaver is not None and self.interleaver.running():
            return 1, self.interleaver.switch
        if not 0 <= self.dim < x.dim() - 1:
            raise ValueError(f"tp overlap splits dimension {self.dim} of the input of {self.name}"
                             f", which has shape {list(x.shape)}; choose dim=0 (batch) or a "
                             f"dimension before the features")
        if x.shape[self.dim] % self.num_sub_batches:
            raise ValueError(
                f"tp overlap cannot split dimension {self.dim} (size {x.shape[self.dim]}) of the "
                f"input of {self.name} into num_sub_batches={self.num_sub_batches} equal "
                f"sub-batches; use a micro-batch size divisible by {self.num_sub_batches} or a "
                f"num_sub_batches that divides {x.shape[self.dim]}")
        return self.num_sub_batches, None

    def column(self, module: nn.Module, x: torch.Tensor, linear: Callable) -> torch.Tensor:
        """The column layer's output: its own forward, input-gradient all-reduce per
        sub-batch."""
        num_sub_batches, _ = self._plan(x)  # its forward does not communicate: nothing to yield
        return _ColumnLinear.apply(x, module.weight, module.bias, linear,
                                   isinstance(module, Conv1D), module.tp_group, num_sub_batches,
                                   self.dim)

    def row(self, module: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """The row layer's partial products summed over the TP ranks (no bias), sub-batch by
        sub-batch."""
        num_sub_batches, switch = self._plan(x)
        return _RowLinear.apply(x, module.weight, module._partial, isinstance(module, Conv1D),
                                module.tp_group, num_sub_batches, self.dim, switch)


class _OverlappedBlock:
    """Mixin for a block class: level 2 (the module docstring). ``self.tp_overlap_block`` holds
    (num_sub_batches, name, interleaver)."""

    def forward(self, *args, **kwargs):
        num_sub_batches, name, interleaver = self.tp_overlap_block
        base = super().forward
        leaves, spec = pytree.tree_flatten((args, kwargs))
        hidden = args[0] if args else kwargs.get("hidden_states")
        if (tracing() or torch.compiler.is_compiling() or not isinstance(hidden, torch.Tensor)
                or any(isinstance(v, Cache) for v in leaves)
                or _saved_tensor_hooks_active()):
            return base(*args, **kwargs)  # its TP layers sub-pipeline as at level 1
        rows = hidden.shape[0]
        if rows % num_sub_batches:
            raise ValueError(f"tp overlap level 2 cannot split the batch (dim 0, size {rows}) "
                             f"of the input of block {name} into num_sub_batches="
                             f"{num_sub_batches} sub-batches; use a micro-batch size divisible "
                             f"by {num_sub_batches} or a num_sub_batches that divides {rows}")
        pieces = [x.chunk(num_sub_batches) if _batched(x, rows) else [x] * num_sub_batches
                  for x in leaves]
        calls = [pytree.tree_unflatten([p[i] for p in pieces], spec)
                 for i in range(num_sub_batches)]
        outs = interleaver.run(base, calls, hidden.device)
        flat = [pytree.tree_flatten(o) for o in outs]
        merged = [torch.cat(parts) if _batched(parts[0], rows // num_sub_batches) else parts[0]
                  for parts in zip(*(f[0] for f in flat), strict=True)]
        return pytree.tree_unflatten(merged, flat[0][1])


def _saved_tensor_hooks_active() -> bool:
    """True under `torch.autograd.graph.saved_tensors_hooks` (`torch.utils.checkpoint`, offload, the
    pipeline's recomputation or memory meter): those hooks are thread-local."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


def _batched(x: object, rows: int) -> bool:
    """Tensors split into sub-batches: at least 2-D with `rows` leading rows (1-D tensors such as
    cache positions and leading-1 broadcasts such as rotary tables are passed whole)."""
    return isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[0] == rows


# ------------------------------------------------------------------ the entry point
def _blocks(model: nn.Module) -> list[str]:
    """The outermost numbered modules (children of a ModuleList, e.g. ``model.layers.3``) that
    hold a row-parallel layer: the repeated blocks, in a model or in a `PipelineStage` (which
    keeps the original names)."""
    rows = [n for n, m in model.named_modules() if isinstance(m, RowParallel)]
    numbered = [n for n, _ in model.named_modules()
                if n.rsplit(".", 1)[-1].isdigit() and any(r.startswith(n + ".") for r in rows)]
    return [n for n in numbered if not any(n.startswith(o + ".") for o in numbered)]


def _restore(model: nn.Module) -> None:
    for module in model.modules():
        if "tp_overlap" in vars(module):
            del module.tp_overlap
        base = vars(module).pop("_tp_overlap_base_class", None)
        if base is not None:
            module.__class__ = base
            del module.tp_overlap_block


def check_overlap_args(level: int, num_sub_batches: int, dim: int = 0,
                       sequence_parallel: bool = False) -> None:
    """Raise ValueError for arguments `set_tp_overlap` rejects (before converting a model)."""
    if level not in LEVELS or isinstance(level, bool):
        raise ValueError(f"tp_overlapping_level must be one of {LEVELS} (level: meaning), got "
                         f"{level!r}")
    if not isinstance(num_sub_batches, int) or isinstance(num_sub_batches, bool) \
            or num_sub_batches < 2:
        raise ValueError(f"num_sub_batches is the number of sub-batches per micro-batch and must "
                         f"be an int >= 2, got {num_sub_batches!r}")
    if not isinstance(dim, int) or dim < 0 or (level == 2 and dim != 0):
        raise ValueError(f"dim={dim!r}: sub-batches split dim 0 (batch) or, at level 1 "
                         f"only, a later non-negative dimension such as the sequence (level 2 "
                         f"splits whole sequences: attention mixes positions)")
    if level and sequence_parallel:
        raise ValueError(_NO_SEQUENCE_PARALLEL)


def set_tp_overlap(model: nn.Module, level: int, num_sub_batches: int = 2, *,
                   dim: int = 0) -> None:
    """Sub-pipelined tensor parallelism (``tp_overlapping_level``) for a tensor-parallel model.

    Call it on a model that `apply_tensor_parallel` converted (before or after the pipeline
    split; the stage shares the model's modules), before any recomputation wrapper. Calling it
    again replaces the previous setting; level 0 restores the default layers and blocks.

    Args:
        model: the converted model (or its `PipelineStage`).
        level: 0 off; 1 every TP layer overlaps its all-reduces with the next sub-batch's
            matmuls; 2 each block interleaves its sub-batches across attention and MLP (the
            module docstring says what overlaps with what).
        num_sub_batches: sub-batches per micro-batch (>= 2); must divide the micro-batch size
            (or, at level 1 with ``dim=1``, the sequence length).
        dim: the dimension split into sub-batches: 0 (batch); level 1 also accepts the
            sequence dimension (linear layers act per token), level 2 only 0.

    Raises:
        ValueError: a level other than 0, 1, 2; num_sub_batches < 2; dim < 0 or level 2 with a dim
            other than 0; a model without TP layers (tp=1) or with sequence parallelism at
            levels 1-2; no block holding a row-parallel layer at level 2. At run time, a
            micro-batch whose split dimension `num_sub_batches` does not divide.
    """
    check_overlap_args(level, num_sub_batches, dim)
    _restore(model)
    layers = [(n, m) for n, m in model.named_modules()
              if isinstance(m, (ColumnParallel, RowParallel))]
    if level == 0:
        return
    if not layers:
        raise ValueError("tp overlap needs a tensor-parallel model (tp > 1) converted by "
                         "apply_tensor_parallel; found no column- or row-parallel layer. Use "
                         "tp_overlapping_level=0 with tp=1")
    if any(m.sequence_parallel for _, m in layers):
        raise ValueError(_NO_SEQUENCE_PARALLEL)
    blocks = _blocks(model) if level == 2 else []
    if level == 2 and not blocks:
        raise ValueError("tp overlap level 2 found no repeated block (a numbered module such as "
                         "model.layers.0) holding a row-parallel layer; use level 1")
    classes: dict[type, type] = {}
    for block_name in blocks:
        block, interleaver = model.get_submodule(block_name), Interleaver()
        cls = type(block)
        if cls not in classes:
            classes[cls] = type(f"TPOverlap{cls.__name__}", (_OverlappedBlock, cls), {})
        block._tp_overlap_base_class, block.__class__ = cls, classes[cls]
        block.tp_overlap_block = (num_sub_batches, block_name, interleaver)
        for name, module in block.named_modules(prefix=block_name):
            if isinstance(module, (ColumnParallel, RowParallel)):
                module.tp_overlap = LayerOverlap(num_sub_batches, 0, name, interleaver)
    for name, module in layers:
        if "tp_overlap" not in vars(module):  # level 1, or outside the level-2 blocks
            module.tp_overlap = LayerOverlap(num_sub_batches, dim, name)
