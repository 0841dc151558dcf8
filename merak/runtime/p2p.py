"""Point-to-point transfers of a rank's posting groups, as NCCL runs them.

NCCL ignores tags: between two ranks, messages pair up in posting order, a rank's transfers run
one after another on one stream, and only the transfers of one ``batch_isend_irecv`` call run
together. The schedule (`merak.schedule`) already orders every rank's sends and receives so that
this works (its validator proves it); this module posts each group exactly as listed, with no
tags, every buffer on the rank's device.

One path for every backend. ``batch_isend_irecv`` returns one `Work` for the whole group on
NCCL (its coalescing manager) and one per operation on gloo; this module never pairs a `Work`
with an operation: before any received tensor of a group is read, every `Work` the group
returned is waited, whatever their number. A group of sends only is waited later (its tensors
are kept alive until then): at the end of the step, or once it reports completion. On NCCL a
wait makes the compute stream wait, it does not block the host; waits end after the job's
timeout (`ddp_timeout`, `merak.init(timeout=)`), and the error names the rank, the peer, the
action, the micro-batch, the time waited and which rank did not arrive
(`merak.distributed.liveness`). The test suite runs this module over a test backend with
NCCL's contract (tests/nccl_contract), and plain gloo.

Shapes: a receiver must size its buffers before it posts a receive, and any extra message posted
outside the schedule's groups changes who waits on whom. So shapes are found apart from the
step: when the batch shapes change (`shapes_known`), the interpreter runs a discovery pass, the
forward of each micro-batch of new shapes with one transfer per group, whose messages carry only
the metadata (dtype, requires-grad flag and shape of each value; `send_shapes`, `recv_shapes`);
the step then sizes every buffer from it. Micro-batches may differ in shape (collated one by
one: padding-free rows of different flattened lengths): each micro-batch has the metadata of its
shape class (`shapes_known`'s `classes`), found once per step for each class. The first step of
each batch shape also sends each activation's metadata beside it (one more tensor of the same
transfer: the posting order is unchanged), which checks the shapes and brings the sender's
requires-grad flags (discovery runs without gradients). Later steps of that shape send no
metadata and read nothing on the host: the sender checks its outgoing values against the known
metadata (host-side attributes, no device sync).
"""

from __future__ import annotations

import datetime
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from merak.distributed import liveness
from merak.distributed.liveness import PeerFailureError
from merak.distributed.parallel_context import process_group_timeout_s
from merak.schedule.actions import Action, ActionKind
from merak.stages.split import PipelineSplit, ValueKey

K = ActionKind
_MAX_NDIM = 8
_META_WIDTH = 3 + _MAX_NDIM  # dtype code, requires_grad, ndim, dims
_DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64,
           torch.int32, torch.bool, torch.uint8, torch.int8, torch.int16]
_DTYPE_CODE = {dtype: code for code, dtype in enumerate(_DTYPES)}
Edge = tuple[int, int]
_KEPT_SHAPES = 256  # batch shapes whose metadata is kept (packed batches bring new ones often)


class P2PTimeoutError(PeerFailureError):
    """A point-to-point wait failed: the job's timeout passed, or a peer died; the message
    names the peer ranks, the actions and micro-batches, the time waited and what to check."""


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
    """

    def __init__(self, ctx, split: PipelineSplit):
        self.ctx, self.split = ctx, split
        self.transfers = split.transfers  # (src stage, dst stage) -> value keys
        # this step's metadata per edge, for each shape class (its first micro-batch)
        self._by_class: dict[int, dict[Edge, list[TensorMeta]]] = {}
        self._classes: list[int] = [0]  # each micro-batch's shape class
        self._known: OrderedDict[object, dict[int, dict[Edge, list[TensorMeta]]]] = \
            OrderedDict()
        self._checked: set[object] = set()  # shape keys whose first step checked the metadata
        self._key: object = None
        self._sending: list[tuple[list, list[torch.Tensor]]] = []  # send groups not known done

    @property
    def carries_metadata(self) -> bool:
        """Whether this step's activation messages carry their metadata (the first step of a
        batch shape)."""
        return self._key not in self._checked

    def peer_rank(self, action: Action) -> int:
        return self.ctx.rank_of(pp_rank=action.peer)

    def shapes_known(self, key: object, classes: Sequence[int] = (0,)) -> bool:
        """Start a step of batch-shape `key` whose micro-batch ``mb`` has the shapes of
        micro-batch ``classes[mb]`` (its class: the first micro-batch of those shapes); whether
        its shapes were discovered (if not, the caller discovers each class's, then calls
        `remember_shapes`)."""
        self._key, self._classes = key, list(classes)
        if key in self._known:
            self._known.move_to_end(key)
            self._by_class = _copy(self._known[key])
            return True
        self._by_class = {}
        return False

    def remember_shapes(self, key: object) -> None:
        self._known[key] = _copy(self._by_class)
        while len(self._known) > _KEPT_SHAPES:
            self._checked.discard(self._known.popitem(last=False)[0])

    def metas(self, mb: int) -> dict[Edge, list[TensorMeta]]:
        """Micro-batch `mb`'s metadata per edge (its shape class's)."""
        return self._by_class.setdefault(self._classes[mb] if mb < len(self._classes) else mb,
                                         {})

    def send_shapes(self, action: Action, values: dict[ValueKey, torch.Tensor],
                    mb: int = 0) -> None:
        """Discovery of micro-batch `mb`'s shapes: send the metadata of `action`'s values (one
        transfer, its own group)."""
        edge = self._edge(action)
        metas = [TensorMeta(tuple(t.shape), t.dtype, t.requires_grad)
                 for t in (values[k] for k in self.transfers[edge])]
        self._by_class.setdefault(mb, {})[edge] = metas
        self._single(_Op(action, self.peer_rank(action), [_encode(metas, self.ctx.device)],
                         True), "shapes")

    def recv_shapes(self, action: Action, mb: int = 0) -> dict[ValueKey, torch.Tensor]:
        """Discovery of micro-batch `mb`'s shapes: receive the metadata of `action`'s values;
        returns zero tensors of those shapes to run the forward on."""
        edge = self._edge(action)
        buffer = torch.empty(len(self.transfers[edge]) * _META_WIDTH, dtype=torch.int64,
                             device=self.ctx.device)
        self._single(_Op(action, self.peer_rank(action), [buffer], False), "shapes")
        metas = self._by_class.setdefault(mb, {})[edge] = _decode(buffer)
        return {k: torch.zeros(m.shape, dtype=m.dtype, device=self.ctx.device)
                for k, m in zip(self.transfers[edge], metas)}

    def exchange(self, action: Action, tensor: torch.Tensor, *, is_send: bool) -> None:
        """One message outside any schedule (generation's hidden states): `tensor` sent to, or
        received in place from, `action`'s peer, posted alone and complete on return. Both
        sides must know its shape and post their messages in the same order."""
        self._single(_Op(action, self.peer_rank(action), [tensor], is_send), "hidden states")

    def _single(self, op: _Op, what: str) -> None:
        for work in self._post([op]):
            self._wait(work, [op], f" ({what})")

    def finish_step(self) -> None:
        """Wait for every send group of the step (their buffers are then free); the step's
        metadata is now checked for its batch shape."""
        for works, _ in self._sending:
            for work in works:
                self._wait(work, None, "the end of the step's sends")
        self._sending.clear()
        if self.carries_metadata and self._key is not None:
            self.remember_shapes(self._key)
            self._checked.add(self._key)

    # -- one group ----------------------------------------------------------------------------
    def run_group(self, actions: Sequence[Action],
                  outgoing: Callable[[Action], dict[ValueKey, torch.Tensor]],
                  ) -> dict[Action, dict[ValueKey, torch.Tensor]]:
        """Post one group; wait for it when it receives anything.

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
        if any(not op.is_send for op in ops):
            for work in works:  # every Work of the group, however many the backend returned
                self._wait(work, ops, "")
        elif works:
            self._sending.append((works, [t for op in ops for t in op.tensors]))
        self._sending = [(w, t) for w, t in self._sending if not all(x.is_completed() for x in w)]
        received: dict[Action, dict[ValueKey, torch.Tensor]] = {}
        for op in ops:
            if op.is_send:
                continue
            tensors = op.tensors
            if op.action.kind is K.RECV_ACT:
                if self.carries_metadata:  # the metadata rode along: check, take the flags
                    tensors = tensors[1:]
                    self._check_metas(op, _decode(op.tensors[0]))
                for tensor, meta in zip(tensors, self._metas(op.action)):
                    tensor.requires_grad_(meta.requires_grad)  # a leaf where it needs one
            received[op.action] = dict(zip(self._keys(op.action), tensors))
        for a in actions:  # a receive of nothing (no value of the edge needs a gradient)
            if a.kind in (K.RECV_ACT, K.RECV_GRAD):
                received.setdefault(a, {})
        return received

    def _edge(self, action: Action) -> Edge:
        _, src, dst, _ = action.message
        return src, dst

    def _metas(self, action: Action) -> list[TensorMeta]:
        """The metadata of the action's edge for its micro-batch."""
        return self.metas(action.microbatch_id)[self._edge(action)]

    def _keys(self, action: Action) -> list[ValueKey]:
        """The values of the action's message, in the order they travel."""
        keys = self.transfers[self._edge(action)]
        if action.kind in (K.SEND_GRAD, K.RECV_GRAD):
            keys = [k for k, m in zip(keys, self._metas(action)) if m.requires_grad]
        return keys

    def _op(self, action: Action, values: dict[ValueKey, torch.Tensor] | None) -> _Op:
        peer, edge = self.peer_rank(action), self._edge(action)
        if edge not in self.metas(action.microbatch_id):
            raise RuntimeError(f"rank {self.ctx.rank}: {action} has no discovered shapes; the "
                               f"interpreter runs the shape discovery before the step")
        if values is not None:  # a send
            tensors = [values[k].detach().contiguous() for k in self._keys(action)]
            if action.kind is K.SEND_ACT:
                metas = [TensorMeta(tuple(t.shape), t.dtype, values[k].requires_grad)
                         for t, k in zip(tensors, self.transfers[edge])]
                self._check_metas(_Op(action, peer, [], True), metas,
                                  flags=not self.carries_metadata)
                if self.carries_metadata:
                    tensors = [_encode(metas, self.ctx.device)] + tensors
            return _Op(action, peer, tensors, True)
        metas = self._metas(action)
        if action.kind is K.RECV_GRAD:
            metas = [m for m in metas if m.requires_grad]
        buffers = [torch.empty(m.shape, dtype=m.dtype, device=self.ctx.device) for m in metas]
        if action.kind is K.RECV_ACT and self.carries_metadata:
            buffers = [torch.empty(len(metas) * _META_WIDTH, dtype=torch.int64,
                                   device=self.ctx.device)] + buffers
        return _Op(action, peer, buffers, False)

    def _check_metas(self, op: _Op, metas: list[TensorMeta], flags: bool = False) -> None:
        """Shapes and dtypes must be the discovered ones; requires-grad flags are the sender's
        (discovery runs without gradients), and must stay what the batch shape's first step
        sent (`flags`): the receiver sizes the gradient message by them."""
        edge = self._edge(op.action)
        known = self.metas(op.action.microbatch_id)[edge]
        if [(m.shape, m.dtype) for m in metas] != [(m.shape, m.dtype) for m in known]:
            raise RuntimeError(
                f"rank {self.ctx.rank}: {op.action} carries values of shapes "
                f"{[(m.shape, str(m.dtype)) for m in metas]}, not the "
                f"{[(m.shape, str(m.dtype)) for m in known]} the shape discovery found for this "
                f"micro-batch's shapes; a stage's output shapes must depend only on the shapes "
                f"of its micro-batch")
        if flags and metas != known:
            raise RuntimeError(
                f"rank {self.ctx.rank}: {op.action} sends values whose requires-grad flags "
                f"{[m.requires_grad for m in metas]} differ from the "
                f"{[m.requires_grad for m in known]} of this batch shape's first step; freezing "
                f"or unfreezing parameters between steps needs a new engine")
        self.metas(op.action.microbatch_id)[edge] = metas

    # -- posting and waiting ------------------------------------------------------------------
    def _post(self, ops: Sequence[_Op]) -> list:
        p2p = [dist.P2POp(dist.isend if op.is_send else dist.irecv, t, op.peer_rank)
               for op in ops for t in op.tensors]
        return dist.batch_isend_irecv(p2p) if p2p else []

    def wait_collective(self, work, what: str) -> None:
        """Wait for a collective of the pipeline ranks, with the error of a p2p wait."""
        self._wait(work, None, what)

    def _wait(self, work, ops: Sequence[_Op] | None, what: str) -> None:
        """Wait for `work` at most the job's timeout: gloo's point-to-point waits are given it
        (a receive's own default is the timeout the group was created with, not the job's);
        on NCCL a wait only orders the stream, and the watchdog applies the group's timeout."""
        start = time.monotonic()
        try:
            if self.ctx.device.type == "cpu":
                seconds = process_group_timeout_s(self.ctx.device)
                ok = work.wait(datetime.timedelta(seconds=seconds)) if seconds else work.wait()
            else:
                ok = work.wait()
        except RuntimeError as error:
            raise P2PTimeoutError(self._message(ops, what, error, start)) from error
        if ok is False:
            raise P2PTimeoutError(self._message(ops, what, None, start))

    def _message(self, ops: Sequence[_Op] | None, what: str, error: Exception | None,
                 start: float) -> str:
        waited = time.monotonic() - start
        if not ops:
            return liveness.diagnose(f"{what} (the pipeline's point-to-point sends)", waited,
                                     error, None)
        peers = sorted({op.peer_rank for op in ops})
        actions = ", ".join(f"{op.action.name} of micro-batch {op.action.microbatch_id} "
                            f"(stage {op.action.stage_id} <-> rank {op.peer_rank}, stage "
                            f"{op.action.peer_stage})" for op in ops)
        return liveness.diagnose(f"{actions}{what}", waited, error, peers)


def _copy(by_class: dict[int, dict[Edge, list[TensorMeta]]]
          ) -> dict[int, dict[Edge, list[TensorMeta]]]:
    return {mb: {edge: list(metas) for edge, metas in edges.items()}
            for mb, edges in by_class.items()}


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
        if not 0 <= code < len(_DTYPES) or not 0 <= ndim <= _MAX_NDIM:
            raise RuntimeError(f"received metadata {row} that no sender wrote (a receive read "
                               f"before its transfer completed?)")
        metas.append(TensorMeta(tuple(dims[:ndim]), _DTYPES[code], bool(requires_grad)))
    return metas
