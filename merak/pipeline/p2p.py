"""Point-to-point transfer of named tensors between stages, with shape handshakes and timeouts.

Every message carries a tag derived from (micro-batch, direction, value slot), so sends and
receives match however the two stages order them, and skip edges (stage 0 -> 2) need no relay.
Activation shapes and dtypes travel once per step (with micro-batch 0) as a small metadata
tensor; gradients have the shape of the activation they belong to, so they need none.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass

import torch
import torch.distributed as dist

from merak.distributed.parallel_context import ParallelContext
from merak.pipeline.actions import ActionKind
from merak.pipeline.split import PipelineSplit, ValueKey

_MAX_NDIM = 8
_META_WIDTH = 3 + _MAX_NDIM  # dtype code, requires_grad, ndim, dims
_MAX_SLOTS = 4096
_META_TAG = 1 << 28
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}


class P2PTimeoutError(RuntimeError):
    """A point-to-point wait exceeded its timeout."""


@dataclass(frozen=True)
class TensorMeta:
    shape: tuple[int, ...]
    dtype: torch.dtype
    requires_grad: bool


def _tag(microbatch_id: int, is_grad: bool, slot: int) -> int:
    return (microbatch_id * 2 + int(is_grad)) * _MAX_SLOTS + slot + 1


@dataclass
class Pending:
    """Posted receives (or sends) of one action; `wait()` returns the received tensors."""

    works: list
    tensors: list[torch.Tensor]
    peer_ranks: list[int]
    what: str

    def wait(self, comm: StageComm) -> list[torch.Tensor]:
        for work, peer in zip(self.works, self.peer_ranks):
            comm.wait(work, peer, self.what)
        return self.tensors


class StageComm:
    """The sends and receives one stage makes, following `PipelineSplit.send_plan/recv_plan`."""

    def __init__(self, ctx: ParallelContext, split: PipelineSplit, stage_id: int,
                 timeout_s: float):
        self.ctx = ctx
        self.stage_id = stage_id
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.recv_plan = split.recv_plan(stage_id)
        self.send_plan = split.send_plan(stage_id)
        for keys in list(self.recv_plan.values()) + list(self.send_plan.values()):
            if len(keys) >= _MAX_SLOTS:
                raise ValueError(f"stage {stage_id} exchanges {len(keys)} tensors with one peer; "
                                 f"at most {_MAX_SLOTS - 1} are supported")
        self.recv_meta: dict[int, list[TensorMeta]] = {}   # src stage -> metas, this step
        self.send_meta: dict[int, list[TensorMeta]] = {}   # dst stage -> metas, this step
        self.pending_sends: list[Pending] = []

    # -- tags ---------------------------------------------------------------------------------
    def tag(self, peer_stage: int, microbatch_id: int, is_grad: bool, slot: int) -> int:
        """The tag of one tensor exchanged with `peer_stage`. Stages on different ranks need no
        more; a subclass widens it where one rank pair carries several stage pairs (interleaved
        virtual stages)."""
        return _tag(microbatch_id, is_grad, slot)

    def meta_tag(self, peer_stage: int) -> int:
        """The tag of the shape handshake with `peer_stage`."""
        return _META_TAG

    # -- waiting ------------------------------------------------------------------------------
    def wait(self, work, peer_rank: int, what: str) -> None:
        try:
            ok = work.wait(timeout=self.timeout)
        except RuntimeError as error:
            raise P2PTimeoutError(self._timeout_message(peer_rank, what, error)) from error
        if ok is False:
            raise P2PTimeoutError(self._timeout_message(peer_rank, what, None))

    def _timeout_message(self, peer_rank: int, what: str, error: Exception | None) -> str:
        peer_stage = peer_rank // (self.ctx.dp * self.ctx.tp)
        cause = f" ({error})" if error is not None else ""
        return (f"rank {self.ctx.rank} (stage {self.stage_id}) waited "
                f"{self.timeout.total_seconds():g}s on rank {peer_rank} (stage {peer_stage}) "
                f"in {what} and gave up{cause}. Check that rank {peer_rank} is alive and runs "
                f"the same schedule and split.")

    def start_step(self) -> None:
        self.recv_meta.clear()
        self.send_meta.clear()

    def finish_step(self) -> None:
        """Wait for every send of the step (their buffers are then free to reuse)."""
        for pending in self.pending_sends:
            pending.wait(self)
        self.pending_sends.clear()

    # -- activations --------------------------------------------------------------------------
    def send_activations(self, microbatch_id: int, values: dict[ValueKey, torch.Tensor]) -> None:
        ops, tensors, peers = [], [], []
        for dst, keys in self.send_plan.items():
            peer = self.ctx.stage_rank(dst)
            outgoing = [values[key].detach().contiguous() for key in keys]
            if dst not in self.send_meta:
                metas = [TensorMeta(tuple(t.shape), t.dtype, values[k].requires_grad)
                         for t, k in zip(outgoing, keys)]
                self.send_meta[dst] = metas
                meta = _encode_meta(metas)
                ops.append(dist.P2POp(dist.isend, meta, peer, tag=self.meta_tag(dst)))
                tensors.append(meta)
                peers.append(peer)
            for slot, tensor in enumerate(outgoing):
                ops.append(dist.P2POp(dist.isend, tensor, peer,
                                      tag=self.tag(dst, microbatch_id, False, slot)))
                tensors.append(tensor)
                peers.append(peer)
        self._post_sends(ops, tensors, peers, f"send_act of micro-batch {microbatch_id}")

    def shapes_known(self, kind: ActionKind) -> bool:
        """Whether receives of `kind` can be posted without a blocking shape handshake:
        activation shapes arrive with micro-batch 0, gradient shapes are those this stage sent."""
        if kind is ActionKind.RECV_ACT:
            return all(src in self.recv_meta for src in self.recv_plan)
        return all(dst in self.send_meta for dst in self.send_plan)

    def post_recv_activations(self, microbatch_id: int) -> Pending:
        what = f"recv_act of micro-batch {microbatch_id}"
        for src in self.recv_plan:
            if src not in self.recv_meta:
                meta = torch.empty(len(self.recv_plan[src]) * _META_WIDTH, dtype=torch.int64)
                peer = self.ctx.stage_rank(src)
                self.wait(dist.irecv(meta, peer, tag=self.meta_tag(src)), peer, what + " (shapes)")
                self.recv_meta[src] = _decode_meta(meta)
        ops, tensors, peers = [], [], []
        for src, metas in self.recv_meta.items():
            peer = self.ctx.stage_rank(src)
            for slot, meta in enumerate(metas):
                buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.ctx.device)
                ops.append(dist.P2POp(dist.irecv, buffer, peer,
                                      tag=self.tag(src, microbatch_id, False, slot)))
                tensors.append(buffer)
                peers.append(peer)
        return Pending(_post(ops), tensors, peers, what)

    def unpack_activations(self, tensors: list[torch.Tensor]) -> dict[ValueKey, torch.Tensor]:
        values, index = {}, 0
        for src, keys in self.recv_plan.items():
            for key, meta in zip(keys, self.recv_meta[src]):
                values[key] = tensors[index].requires_grad_(meta.requires_grad)
                index += 1
        return values

    # -- gradients ----------------------------------------------------------------------------
    def send_gradients(self, microbatch_id: int, grads: dict[ValueKey, torch.Tensor]) -> None:
        """Send the gradient of each received activation that requires grad to its producer."""
        ops, tensors, peers = [], [], []
        for src, keys in self.recv_plan.items():
            peer = self.ctx.stage_rank(src)
            for slot, (key, meta) in enumerate(zip(keys, self.recv_meta[src])):
                if meta.requires_grad:
                    grad = grads[key].contiguous()
                    ops.append(dist.P2POp(dist.isend, grad, peer,
                                          tag=self.tag(src, microbatch_id, True, slot)))
                    tensors.append(grad)
                    peers.append(peer)
        self._post_sends(ops, tensors, peers, f"send_grad of micro-batch {microbatch_id}")

    def post_recv_gradients(self, microbatch_id: int) -> Pending:
        ops, tensors, peers = [], [], []
        for dst, metas in self.send_meta.items():
            peer = self.ctx.stage_rank(dst)
            for slot, meta in enumerate(metas):
                if meta.requires_grad:
                    buffer = torch.empty(meta.shape, dtype=meta.dtype, device=self.ctx.device)
                    ops.append(dist.P2POp(dist.irecv, buffer, peer,
                                          tag=self.tag(dst, microbatch_id, True, slot)))
                    tensors.append(buffer)
                    peers.append(peer)
        return Pending(_post(ops), tensors, peers, f"recv_grad of micro-batch {microbatch_id}")

    def unpack_gradients(self, tensors: list[torch.Tensor]) -> dict[ValueKey, torch.Tensor]:
        """Output-gradient per sent value, summed over the stages that consumed it."""
        grads: dict[ValueKey, torch.Tensor] = {}
        index = 0
        for dst, metas in self.send_meta.items():
            for key, meta in zip(self.send_plan[dst], metas):
                if meta.requires_grad:
                    grad = tensors[index]
                    grads[key] = grads[key] + grad if key in grads else grad
                    index += 1
        return grads

    def _post_sends(self, ops, tensors, peers, what: str) -> None:
        if ops:
            self.pending_sends.append(Pending(_post(ops), tensors, peers, what))


def _post(ops: list) -> list:
    # batch_isend_irecv coalesces on NCCL; on gloo it posts each op non-blocking.
    return dist.batch_isend_irecv(ops) if ops else []


def _encode_meta(metas: list[TensorMeta]) -> torch.Tensor:
    rows = []
    for meta in metas:
        if len(meta.shape) > _MAX_NDIM:
            raise ValueError(f"cannot send a {len(meta.shape)}-d tensor between stages; at most "
                             f"{_MAX_NDIM} dimensions are supported")
        if meta.dtype not in _DTYPE_CODE:
            raise ValueError(f"cannot send dtype {meta.dtype} between stages; supported: "
                             f"{_DTYPES}")
        dims = list(meta.shape) + [0] * (_MAX_NDIM - len(meta.shape))
        rows += [_DTYPE_CODE[meta.dtype], int(meta.requires_grad), len(meta.shape)] + dims
    return torch.tensor(rows, dtype=torch.int64)


def _decode_meta(flat: torch.Tensor) -> list[TensorMeta]:
    metas = []
    for row in flat.view(-1, _META_WIDTH).tolist():
        code, requires_grad, ndim, dims = row[0], row[1], row[2], row[3:]
        metas.append(TensorMeta(tuple(dims[:ndim]), _DTYPES[code], bool(requires_grad)))
    return metas
