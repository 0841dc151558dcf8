"""Point-to-point transfers of a rank's posting groups, as NCCL requires them.

NCCL ignores tags: between two ranks, messages pair up in posting order, a rank's transfers run
one after another on one stream, and only the transfers of one ``batch_isend_irecv`` call run
together. The schedule (`merak.schedule`) already orders every rank's sends and receives so that
this works (its validator proves it); this module posts each group exactly as listed, with no
tags, every buffer on the rank's device.

Shapes: a receiver must size its buffers before it posts a receive, and any extra message
posted outside the schedule's groups changes who waits on whom (a shape group before each data
group deadlocks interleaved evaluation and zero-bubble under NCCL's rules). So shapes are found
apart from the step: when the batch shapes change (`shapes_known`), the interpreter runs a
discovery pass, micro-batch 0's forward with one transfer per group, whose messages carry only
the metadata (dtype, requires-grad flag and shape of each value; `send_shapes`,
`recv_shapes`); the step then sizes every buffer from it. Inside the step each activation
message carries its metadata again, as one more tensor of the same transfer (same group, same
peer: the posting order is unchanged), which checks the shapes and brings the sender's
requires-grad flags.

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
        self._known: dict[object, dict[tuple[int, int], list[TensorMeta]]] = {}
        self._sending: list[tuple[list, list[torch.Tensor]]] = []  # sends not known finished

    def peer_rank(self, action: Action) -> int:
        return self.ctx.rank_of(pp_rank=action.peer)

    def shapes_known(self, key: object) -> bool:
        """Whether the shapes of batch-shape `key` were discovered; if so, use them."""
        if key in self._known:
            self.metas = {edge: list(metas) for edge, metas in self._known[key].items()}
            return True
        self.metas = {}
        return False

    def remember_shapes(self, key: object) -> None:
        self._known[key] = {edge: list(metas) for edge, metas in self.metas.items()}

    def send_shapes(self, action: Action, values: dict[ValueKey, torch.Tensor]) -> None:
        """Discovery: send the metadata of `action`'s values (one transfer, its own group)."""
        edge = self._edge(action)
        metas = [TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)
                 for t in (values[k] for k in self.transfers[edge])]
        self.metas[edge] = metas
        self._single(_Op(action, self.peer_rank(action), [_encode(metas, self.ctx.device)],
                         True))

    def recv_shapes(self, action: Action) -> dict[ValueKey, torch.Tensor]:
        """Discovery: receive the metadata of `action`'s values; returns zero tensors of those
        shapes to run the forward on."""
        edge = self._edge(action)
        buffer = torch.empty(len(self.transfers[edge]) * _META_WIDTH, dtype=torch.int64,
                             device=self.ctx.device)
        self._single(_Op(action, self.peer_rank(action), [buffer], False))
        self.metas[edge] = _decode(buffer)
        return {k: torch.zeros(m.shape, dtype=m.dtype, device=self.ctx.device)
                for k, m in zip(self.transfers[edge], self.metas[edge])}

    def exchange(self, action: Action, tensor: torch.Tensor, *, is_send: bool) -> None:
        """One message outside any schedule (generation's hidden states): `tensor` sent to, or
        received in place from, `action`'s peer, posted alone and complete on return. Both
        sides must know its shape and post their messages in the same order."""
        self._single(_Op(action, self.peer_rank(action), [tensor], is_send), what="hidden states")

    def _single(self, op: _Op, what: str = "shapes") -> None:
        works = self._post([op])
        if self.strict:
            self._complete_strictly([op], works, what=what)
        else:
            for work in works:
                self._wait(work, op, f" ({what})")

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
            tensors = op.tensors
            if op.action.kind is K.RECV_ACT:  # the metadata rode along: check, take the flags
                tensors = tensors[1:]
                self._check_metas(op, _decode(op.tensors[0]))
                for tensor, meta in zip(tensors, self.metas[self._edge(op.action)]):
                    tensor.requires_grad_(meta.requires_grad)  # a leaf where it needs one
            received[op.action] = dict(zip(self._keys(op.action), tensors))
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
        peer, edge = self.peer_rank(action), self._edge(action)
        if edge not in self.metas:
            raise RuntimeError(f"rank {self.ctx.rank}: {action} has no discovered shapes; the "
                               f"interpreter runs the shape discovery before the step")
        if values is not None:  # a send
            tensors = [values[k].detach().contiguous() for k in self._keys(action)]
            if action.kind is K.SEND_ACT:
                metas = [TensorMeta(tuple(t.shape), t.dtype, values[k].requires_grad)
                         for t, k in zip(tensors, self.transfers[edge])]
                self._check_metas(_Op(action, peer, [], True), metas)
                tensors = [_encode(metas, self.ctx.device)] + tensors
            return _Op(action, peer, tensors, True)
        metas = self.metas[edge]
        if action.kind is K.RECV_GRAD:
            metas = [m for m in metas if m.requires_grad]
        buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.ctx.device) for m in metas]
        if action.kind is K.RECV_ACT:
            buffers = [torch.empty(len(metas) * _META_WIDTH, dtype=torch.int64,
                                   device=self.ctx.device)] + buffers
        return _Op(action, peer, buffers, False)

    def _check_metas(self, op: _Op, metas: list[TensorMeta]) -> None:
        """Shapes and dtypes must be the discovered ones; requires-grad flags are the sender's
        (discovery runs without gradients)."""
        edge = self._edge(op.action)
        known = self.metas[edge]
        if [(m.shape, m.dtype) for m in metas] != [(m.shape, m.dtype) for m in known]:
            raise RuntimeError(
                f"rank {self.ctx.rank}: {op.action} carries values of shapes "
                f"{[(m.shape, str(m.dtype)) for m in metas]}, not the "
                f"{[(m.shape, str(m.dtype)) for m in known]} the shape discovery found for this "
                f"batch shape; a stage's output shapes must depend only on the batch shapes")
        self.metas[edge] = metas

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

    def wait_collective(self, work, what: str) -> None:
        """Wait for a collective of the pipeline ranks with the p2p timeout."""
        try:
            ok = work.wait() if self.nccl else work.wait(
                timeout=datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as error:
            ok, cause = False, f" ({error})"
        else:
            cause = ""
        if ok is False:
            raise P2PTimeoutError(f"rank {self.ctx.rank} waited {self.timeout_s:g}s in {what} "
                                  f"and gave up{cause}. Check that every rank of its pipeline "
                                  f"is alive and runs the same step.")

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
