"""This rank's pipeline stage seen as the whole HF model, for `model.generate` with a KV cache.

Why not the stage graphs: they were captured for a training forward (no cache: positions and
masks span the micro-batch's own tokens), while decoding needs positions offset by the cache and
masks over past and new tokens. The model's own forward does all of that, so every rank runs the
model's own forward (through HF `generate`: padding, caches, logits processors, stopping) with:

- this rank's real tensors in place: the stage's parameters and buffers swapped into the user's
  (meta-built) model by name, for the duration (tied weights follow: every slot holding the
  meta parameter gets the real one);
- every module this rank does not hold (all its parameters on meta) *shadowed*: it runs on the
  meta device (shapes only, no memory or compute) and hands zeros of the right shape to the
  code after it. A shadowed attention layer still appends meta keys and values of the right
  length to its layer of the cache, so the cache's length, masks and positions are right on
  every rank, while real keys and values are held only by the stage that owns the layer;
- at each boundary between blocks of different pipeline ranks, the owner of the earlier block
  sends its output hidden states (one position per request in a decode step) and the owner of
  the later block receives them in place of the zeros: one message, posted alone, under NCCL's
  rules (`StageTransfers.exchange`);
- the logits the last block's owner computes are broadcast over the pipeline group (after its
  tensor-parallel rank 0 broadcast them to its TP peers), so every rank of the pipeline takes the
  same sampling decision from the same logits and the same seed.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.utils import _pytree as pytree

from merak.runtime.p2p import StageTransfers
from merak.schedule.actions import Action, ActionKind
from merak.stages.stage import stage_placement


def _held(module: nn.Module) -> bool | None:
    """True if every parameter of `module` is real here, False if every one is on meta, None
    if mixed (or none)."""
    params = list(module.parameters())
    if not params:
        return None
    meta = [p.is_meta for p in params]
    return False if all(meta) else (True if not any(meta) else None)


def _shadowed_modules(model: nn.Module) -> list[nn.Module]:
    """The outermost modules of `model` whose parameters are all on the meta device."""
    found: list[nn.Module] = []

    def visit(module: nn.Module) -> None:
        if _held(module) is False:
            found.append(module)
            return
        for child in module.children():
            visit(child)

    visit(model)
    return found


def _shadow_forward(module: nn.Module, device: torch.device):
    forward = module.forward

    def shadow(*args, **kwargs):
        args, kwargs = pytree.tree_map_only(torch.Tensor, lambda t: t.to("meta"), (args, kwargs))
        out = forward(*args, **kwargs)
        return pytree.tree_map_only(
            torch.Tensor, lambda t: torch.zeros(t.shape, dtype=t.dtype, device=device)
            if t.is_meta else t, out)

    return shadow


def _first_tensor(value) -> torch.Tensor:
    leaves = [v for v in pytree.tree_leaves(value) if isinstance(v, torch.Tensor)]
    if not leaves:
        raise TypeError(f"a pipeline block returned no tensor ({type(value).__name__}); "
                        f"generation passes a block's first tensor output to the next stage")
    return leaves[0]


class StageView:
    """While entered, `model` (the meta-built model this rank's `stage` was cut from) computes
    as the whole pipeline does, for `generate` (see the module doc).

    Args:
        model: the model given to `merak.parallelize` (TP already applied to it there).
        stage: this rank's `PipelineStage` or `InterleavedStage` of an automatic split.
        ctx: the parallel context.
        prefix: what the stage's names add to the model's (``"model."`` when `parallelize`
            was given the model wrapped with a custom loss).
    """

    def __init__(self, model: nn.Module, stage: nn.Module, ctx, prefix: str = ""):
        split = stage.split
        blocks = getattr(split, "blocks_of_stage", None)
        if not blocks:
            raise ValueError("generation needs a pipeline built by merak.parallelize / "
                             "auto_split (its blocks); a manual split has no model forward to "
                             "run")
        if getattr(getattr(model, "merak_tp", None), "sequence_parallel", False):
            raise ValueError("generation does not run with sequence_parallel=True (a decode "
                             "step has one position, which cannot be split over TP ranks); "
                             "build the model without sequence parallelism to generate")
        if any("tp_overlap" in vars(m) for m in model.modules()):
            raise ValueError("generation runs without sub-pipelined TP: train with "
                             "tp_overlapping_level=0, or call merak.set_tp_overlap(model, 0) "
                             "before generating")
        self.model, self.stage, self.ctx, self.prefix = model, stage, ctx, prefix
        # (block name in `model`, pipeline rank owning it, stage), in model order
        placement = stage_placement(stage, ctx.pp)  # round-robin, or a V
        self.blocks = [(b.removeprefix(prefix), placement[s], s) for s in range(split.num_stages)
                       for b in blocks[s]]
        self.end_rank = self.blocks[-1][1]
        self.transfers = StageTransfers(ctx, split)
        self.step = 0  # forwards run so far: the micro-batch id in transfer errors
        self._undo: list = []

    # -- entering and leaving -----------------------------------------------------------------
    def __enter__(self) -> StageView:
        try:
            self._swap_in_real_tensors()
            for module in _shadowed_modules(self.model):
                self._swap_buffers(module, lambda b: b.to("meta"))
                self._set(module.__dict__, "forward", _shadow_forward(module, self.ctx.device))
            self._hook_boundaries()
            self._hook(self.model.register_forward_hook(self._share_logits))
            self._train_flags = {m: m.training for m in self.model.modules()}
            self.model.eval()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc) -> None:
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        for module, training in getattr(self, "_train_flags", {}).items():
            module.training = training

    def _set(self, table: dict, key: str, value) -> None:
        had, old = key in table, table.get(key)
        table[key] = value
        self._undo.append(lambda: table.__setitem__(key, old) if had else table.pop(key, None))

    def _hook(self, handle) -> None:
        self._undo.append(handle.remove)

    def _swap_in_real_tensors(self) -> None:
        """Every slot of the model holding a tensor the stage holds under the same name gets
        the stage's (real, on the device); other real buffers move to the device."""
        stage = {name.removeprefix(self.prefix): tensor for name, tensor in [
            *self.stage.named_parameters(remove_duplicate=False),
            *self.stage.named_buffers(remove_duplicate=False)]}
        by_id: dict[int, torch.Tensor] = {}
        for name, tensor in [*self.model.named_parameters(remove_duplicate=False),
                             *self.model.named_buffers(remove_duplicate=False)]:
            if name in stage:
                by_id[id(tensor)] = stage[name]
        for module in self.model.modules():
            for table in (module._parameters, module._buffers):
                for key, value in list(table.items()):
                    if value is None:
                        continue
                    if id(value) in by_id:
                        self._set(table, key, by_id[id(value)])
                    elif table is module._buffers and not value.is_meta \
                            and value.device != self.ctx.device:
                        self._set(table, key, value.to(self.ctx.device))

    def _swap_buffers(self, module: nn.Module, convert) -> None:
        for sub in module.modules():
            for key, value in list(sub._buffers.items()):
                if value is not None and not value.is_meta:
                    self._set(sub._buffers, key, convert(value))

    # -- the pipeline ---------------------------------------------------------------------------
    def _hook_boundaries(self) -> None:
        me = self.ctx.pp_rank
        for (before, src, first), (after, dst, second) in zip(self.blocks, self.blocks[1:]):
            if src == dst:
                continue
            edge = (first, second)
            if src == me:
                self._hook(self.model.get_submodule(before).register_forward_hook(
                    lambda module, args, out, dst=dst, edge=edge: self._send(out, dst, edge)))
            if dst == me:
                self._hook(self.model.get_submodule(after).register_forward_pre_hook(
                    lambda module, args, kwargs, src=src, edge=edge:
                    self._receive(args, kwargs, src, edge), with_kwargs=True))

    def _action(self, kind: ActionKind, edge: tuple[int, int], peer: int) -> Action:
        mine, theirs = edge if kind is ActionKind.SEND_ACT else edge[::-1]
        return Action(kind, stage_id=mine, microbatch_id=self.step, peer=peer, peer_stage=theirs)

    def _send(self, out, dst: int, edge: tuple[int, int]) -> None:
        hidden = _first_tensor(out).detach().contiguous()
        self.transfers.exchange(self._action(ActionKind.SEND_ACT, edge, dst), hidden,
                                is_send=True)

    def _receive(self, args: tuple, kwargs: dict, src: int, edge: tuple[int, int]):
        placeholder = args[0] if args else kwargs.get("hidden_states")
        if not isinstance(placeholder, torch.Tensor):
            raise TypeError("generation replaces a block's first argument (its hidden states) "
                            "with the previous stage's output, but this block was called "
                            f"without one (kwargs {sorted(kwargs)})")
        hidden = torch.empty_like(placeholder, memory_format=torch.contiguous_format)
        self.transfers.exchange(self._action(ActionKind.RECV_ACT, edge, src), hidden,
                                is_send=False)
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    def _share_logits(self, module, args, out):
        """The end rank's logits, to every rank of the pipeline (TP rank 0's first)."""
        logits = out.logits.contiguous()
        if self.ctx.pp_rank == self.end_rank and self.ctx.tp > 1:
            dist.broadcast(logits, src=self.ctx.rank_of(tp_rank=0), group=self.ctx.tp_group)
        if self.ctx.pp > 1:
            dist.broadcast(logits, src=self.ctx.rank_of(pp_rank=self.end_rank),
                           group=self.ctx.pp_group)
        out.logits = logits
        self.step += 1
        return out

