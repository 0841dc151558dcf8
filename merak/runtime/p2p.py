"""Point-to-point transfers of a rank's posting groups, as NCCL requires them.

NCCL ignores tags: between two ranks, messages pair up in posting order, a rank's transfers run
one after another on one stream, and only the transfers of one ``batch_isend_irecv`` call run
together. The schedule (`merak.schedule`) already orders every rank's sends and receives so that
this works (its validator proves it); this module posts each group exactly as listed, with no
tags, every buffer on the rank's device.

Shapes: every activation message is preceded by a small metadata tensor (dtype, requires-grad
flag and shape of each value), posted as a group of its own right before the data group on both
sides, on the device and in the same ordered stream (as Megatron does for variable sequence
lengths), so the shape groups mirror the data groups the validator proved.
Gradients have the shapes of the activations they belong to and need none.

`nccl_rules` (`ParallelContext.nccl_p2p_rules`, on in the test suite) makes any backend behave as
NCCL does: each group completes before the next is posted, and every send completes only once
its receive has run (the receiver acknowledges it), so code that would hang or swap tensors on
NCCL hangs or fails on gloo too. Waits end after `timeout_s` with a message naming the rank, the
peer, the action and the micro-batch; on NCCL the process group's own timeout applies instead of
host-side polling.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from merak.runtime.split import PipelineSplit, ValueKey
from merak.schedule.actions import Action, ActionKind

K = ActionKind
_MAX_NDIM = 8
_META_WIDTH = 3 + _MAX_NDIM  # dtype code, requires_grad, ndim, dims
_ACK_TAG = 1  # the acknowledgements of the NCCL-rules emulation only; data goes untagged
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


@dataclass
class _Op:
    action: Action
    peer_rank: int
    tensors: list[torch.Tensor]
    is_send: bool


class StageTransfers:
    """The sends and receives of one rank's stages, group by group.

    Args:
        ctx: the parallel context (``ctx.device``, ranks of the pipeline peers).
        split: the split (which values cross which stage pair).
        timeout_s: longest wait on one group.
        nccl_rules: follow NCCL's rules on any backend (see the module doc).
    """

    def __init__(self, ctx, split: PipelineSplit, timeout_s: float, nccl_rules: bool):
        self.ctx, self.split, self.timeout_s = ctx, split, timeout_s
        self.nccl = ctx.backend == "nccl"
        self.strict = nccl_rules and not self.nccl
        self.transfers = split.transfers  # (src stage, dst stage) -> value keys
        self.metas: dict[tuple[int, int], list[TensorMeta]] = {}  # this step's, per edge
        self._sending: list[tuple[list, list[torch.Tensor]]] = []  # sends not known finished

    def peer_rank(self, action: Action) -> int:
        return self.ctx.rank_of(pp_rank=action.peer)

    def start_step(self) -> None:
        self.metas.clear()

    def finish_step(self) -> None:
        """Wait for every send of the step (their buffers are then free)."""
        for works, _ in self._sending:
            for work in works:
                self._wait(work, None, "the end of the step's sends")
        self._sending.clear()

    # -- one group ----------------------------------------------------------------------------
    def run_group(self, actions: Sequence[Action],
                  outgoing: Callable[[Action], dict[ValueKey, torch.Tensor]],
                  ) -> dict[Action, dict[ValueKey, torch.Tensor]]:
        """Post one group and wait for its receives.

        Args:
            actions: the group's sends and receives, in program order.
            outgoing: for a send, the values it carries (activations by key, or the gradients
                of the received activations by key).

        Returns:
            For each receive, the received tensors by value key (activations with their
            requires-grad flag set; gradients of the activations this stage sent).
        """
        values = {a: outgoing(a) for a in actions if a.kind in (K.SEND_ACT, K.SEND_GRAD)}
        self._exchange_metas(actions, values)
        ops = [self._op(a, values.get(a)) for a in actions]
        ops = [op for op in ops if op.tensors]
        works = self._post(ops)
        received: dict[Action, dict[ValueKey, torch.Tensor]] = {}
        if self.strict:
            self._complete_strictly(ops, works)
        else:
            self._release_finished_sends()
            index = 0
            sends = []
            for op in ops:
                mine = works[index:index + len(op.tensors)]
                index += len(op.tensors)
                if op.is_send:
                    sends += mine
                else:
                    for work in mine:
                        self._wait(work, op, "")
            if sends:
                self._sending.append((sends, [t for op in ops if op.is_send
                                              for t in op.tensors]))
        for op in ops:
            if op.is_send:
                continue
            if op.action.kind is K.RECV_ACT:  # a leaf of this stage's graph where it needs one
                for tensor, meta in zip(op.tensors, self.metas[self._edge(op.action)]):
                    tensor.requires_grad_(meta.requires_grad)
            received[op.action] = dict(zip(self._keys(op.action), op.tensors))
        for a in actions:  # a receive of nothing (no value of the edge needs a gradient)
            if a.kind in (K.RECV_ACT, K.RECV_GRAD):
                received.setdefault(a, {})
        return received

    def _edge(self, action: Action) -> tuple[int, int]:
        _, src, dst, _ = action.message
        return src, dst

    def _keys(self, action: Action) -> list[ValueKey]:
        """The values of the action's message, in the order they travel."""
        edge = self._edge(action)
        keys = self.transfers[edge]
        if action.kind in (K.SEND_GRAD, K.RECV_GRAD):
            keys = [k for k, m in zip(keys, self.metas[edge]) if m.requires_grad]
        return keys

    def _op(self, action: Action, values: dict[ValueKey, torch.Tensor] | None) -> _Op:
        peer = self.peer_rank(action)
        if values is not None:  # a send
            tensors = [values[k].detach().contiguous() for k in self._keys(action)]
            return _Op(action, peer, tensors, True)
        edge = self._edge(action)
        metas = self.metas[edge]
        if action.kind is K.RECV_GRAD:
            metas = [m for m in metas if m.requires_grad]
        buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.ctx.device) for m in metas]
        return _Op(action, peer, buffers, False)

    def _exchange_metas(self, actions: Sequence[Action],
                        values: dict[Action, dict[ValueKey, torch.Tensor]]) -> None:
        """Shapes of every activation message of the group, as a group of their own right
        before it. Every activation transfer has one, so the shape groups of two ranks mirror
        their data groups exactly (sending shapes only with a step's first message breaks the
        mirror: one side's shape group then waits on a peer that is still behind a data
        group, a deadlock seen with interleaved evaluation)."""
        ops, decode = [], []
        for a in actions:
            if a.kind not in (K.SEND_ACT, K.RECV_ACT):
                continue
            edge = self._edge(a)
            if a.kind is K.SEND_ACT:
                sent = [values[a][k] for k in self.transfers[edge]]
                metas = [TensorMeta(tuple(t.shape), t.dtype, t.requires_grad) for t in sent]
                self.metas[edge] = metas
                ops.append(_Op(a, self.peer_rank(a), [_encode(metas, self.ctx.device)], True))
            else:
                buffer = torch.empty(len(self.transfers[edge]) * _META_WIDTH, dtype=torch.int64,
                                     device=self.ctx.device)
                ops.append(_Op(a, self.peer_rank(a), [buffer], False))
                decode.append((edge, buffer))
        if not ops:
            return
        works = self._post(ops)
        if self.strict:
            self._complete_strictly(ops, works, what="shapes")
        else:
            for op, work in zip(ops, works):
                self._wait(work, op, " (shapes)")
        for edge, buffer in decode:
            self.metas[edge] = _decode(buffer)

    # -- posting and waiting ------------------------------------------------------------------
    def _post(self, ops: Sequence[_Op]) -> list:
        p2p = [dist.P2POp(dist.isend if op.is_send else dist.irecv, t, op.peer_rank)
               for op in ops for t in op.tensors]
        return dist.batch_isend_irecv(p2p) if p2p else []

    def _complete_strictly(self, ops: Sequence[_Op], works: list, what: str = "") -> None:
        """NCCL's rendezvous on any backend: each receive, once complete, acknowledges its
        message to the sender (in the group's order); each send waits for that
        acknowledgement. Returns when the whole group is done (the next group may only start
        then)."""
        acks_in = []
        for op in ops:
            if op.is_send:
                ack = torch.zeros(1, dtype=torch.int8, device=self.ctx.device)
                acks_in.append((op, dist.irecv(ack, op.peer_rank, tag=_ACK_TAG)))
        receives, sends, index = [], [], 0
        for op in ops:
            mine = works[index:index + len(op.tensors)]
            index += len(op.tensors)
            (sends.extend if op.is_send else lambda w, op=op: receives.append((op, w)))(mine)
        acks_out = []
        for op, mine in receives:  # acknowledge each message once it has arrived
            for work in mine:  # (gloo completes a receive only inside wait(); wait once)
                self._wait(work, op, f" {what}".rstrip())
            ack = torch.ones(1, dtype=torch.int8, device=self.ctx.device)
            acks_out.append(dist.isend(ack, op.peer_rank, tag=_ACK_TAG))
        for op, work in acks_in:
            self._wait(work, op, f" (acknowledgement{', ' + what if what else ''})")
        for work in sends + acks_out:
            work.wait()

    def _release_finished_sends(self) -> None:
        self._sending = [(works, tensors) for works, tensors in self._sending
                         if not all(w.is_completed() for w in works)]

    def _wait(self, work, op: _Op | None, what: str) -> None:
        try:
            ok = work.wait() if self.nccl else work.wait(
                timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            raise P2PTimeoutError(self._message(op, what, error)) from error
        if ok is False:
            raise P2PTimeoutError(self._message(op, what, None))

    def _message(self, op: _Op | None, what: str, error: Exception | None) -> str:
        cause = f" ({error})" if error is not None else ""
        if op is None:
            return (f"rank {self.ctx.rank} waited {self.timeout_s:g}s for {what} and gave "
                    f"up{cause}")
        a = op.action
        return (f"rank {self.ctx.rank} (stage {a.stage_id}) waited {self.timeout_s:g}s on rank "
                f"{op.peer_rank} (stage {a.peer_stage}) in {a.name}{what} of micro-batch "
                f"{a.microbatch_id} and gave up{cause}. Check that rank {op.peer_rank} is alive "
                f"and runs the same schedule and split.")


def _encode(metas: list[TensorMeta], device: torch.device) -> torch.Tensor:
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
    return torch.tensor(rows, dtype=torch.int64).to(device)


def _decode(flat: torch.Tensor) -> list[TensorMeta]:
    metas = []
    for row in flat.view(-1, _META_WIDTH).tolist():
        code, requires_grad, ndim, dims = row[0], row[1], row[2], row[3:]
        metas.append(TensorMeta(tuple(dims[:ndim]), _DTYPES[code], bool(requires_grad)))
    return metas
