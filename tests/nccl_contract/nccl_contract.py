"""NCCL's point-to-point contract over gloo, for the CPU test suite.

Merak's users run on NCCL; this machine has gloo only. gloo differs from NCCL in exactly the
ways that let wrong pipeline code pass: it pairs messages by tag, buffers sends, lets every
operation progress on its own, and `batch_isend_irecv` returns one `Work` per operation. This
layer replaces torch.distributed's point-to-point functions in a test process so that they
present NCCL's contract instead (docs/testing.md):

- `batch_isend_irecv` returns ONE `Work` for the whole group (NCCL's coalescing manager);
- tags are ignored: every message travels on one channel per rank pair, so messages pair up
  in posting order;
- a process's groups run one after another, as on one CUDA stream: a thread per process runs
  them in posting order, each once the one before it completed, while the host goes on;
- a send completes only once its receive has been posted (rendezvous), not when gloo has
  buffered it;
- a received tensor holds its data only after the group's `Work` was waited: until then it is
  filled with NaN (or -1 for integers), so code that reads a buffer without waiting (which on
  NCCL races with the transfer) reads garbage here every time;
- plain `isend` / `irecv` / `send` / `recv` are groups of one.

Collectives, subgroups and `DeviceMesh` are gloo's own and keep working. The production code runs
unchanged: it takes the very branch it takes on NCCL (one `Work` per group, waited before any
receive is read). The module installs itself when imported, which ``sitecustomize.py`` beside it
does in every process of the suite once torch.distributed is imported (tests/conftest.py puts this
folder on PYTHONPATH); MERAK_TEST_BACKEND=gloo leaves plain gloo, for the runs that check it.
"""

from __future__ import annotations

import datetime
import os
import queue
import threading

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

ENV = "MERAK_TEST_BACKEND"  # "nccl-contract" (the suite's default), "gloo" or "native"
NAME = "nccl-contract"
_ACK_TAG = 0x4D52  # the emulation's own rendezvous messages; data always travels on tag 0
_ORIGINAL: dict[str, object] = {}


def default_backend() -> str:
    """The suite's backend: MERAK_TEST_BACKEND, "nccl-contract" unless set to "gloo" (plain
    gloo on CPU) or "native" (torch's own point-to-point: real NCCL on a GPU machine, which
    scripts/gpu_check.sh sets)."""
    backend = os.environ.get(ENV, NAME)
    if backend not in (NAME, "gloo", "native"):
        raise ValueError(f"{ENV}={backend!r}: use {NAME!r}, 'gloo' or 'native'")
    return "gloo" if backend == "native" else backend


def wanted() -> bool:
    return default_backend() == NAME


def installed() -> bool:
    return bool(_ORIGINAL)


class _Stream:
    """This process's one point-to-point stream: a thread that runs the posted groups in
    posting order, each only after the one before it completed. The host never waits for it
    when posting (as on NCCL, where posting only enqueues); `GroupWork.wait` does."""

    def __init__(self):
        self._groups: queue.Queue[GroupWork] = queue.Queue()
        self._failed: BaseException | None = None
        threading.Thread(target=self._run, name="nccl-contract-stream", daemon=True).start()

    def post(self, group: GroupWork) -> None:
        self._groups.put(group)

    def _run(self) -> None:
        while True:
            group = self._groups.get()
            try:
                if self._failed is not None:
                    raise RuntimeError(f"an earlier group on this stream failed: {self._failed}")
                group.run()
            except BaseException as error:  # noqa: BLE001 - handed to whoever waits
                self._failed = self._failed or error
                group.error = error
            group.done.set()


_stream: list[_Stream] = []  # created at the first post (after fork, in the rank's process)


def _timeout() -> datetime.timedelta:
    return c10d._get_default_group()._get_backend(torch.device("cpu")).options._timeout


class GroupWork(dist.Work):
    """The one `Work` of a posted group; complete once the stream ran it: every group posted
    before it completed, its receives arrived, and every receive of its sends was reached by
    the receiver's stream. The received data reaches the caller's tensors in `wait`."""

    def __init__(self, receives, sends, acks_in, acks_out):
        super().__init__()
        self._receives = receives  # (caller's tensor, private buffer, gloo work)
        self._sends, self._acks_in = sends, acks_in  # gloo works
        self._acks_out = acks_out  # (peer, group) to tell when the stream reaches a receive
        self.done, self.error = threading.Event(), None

    def run(self) -> None:
        """On the stream: this group's receives are now reached; wait for the rest."""
        isend_ = _ORIGINAL["isend"]
        acks = [isend_(torch.ones(1, dtype=torch.int8), dst=peer, group=group, tag=_ACK_TAG)
                for peer, group in self._acks_out]
        timeout = _timeout()
        for work in self._acks_in + self._sends + [w for _, _, w in self._receives] + acks:
            work.wait(timeout)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        limit = timeout if timeout else _timeout()
        if not self.done.wait(limit.total_seconds()):
            raise RuntimeError(f"[nccl-contract] a point-to-point group did not complete "
                               f"within the timeout of {limit.total_seconds():g}s")
        if self.error is not None:
            raise RuntimeError(f"[nccl-contract] {self.error}") from self.error
        for tensor, buffer, _ in self._receives:  # the caller sees the data from its wait on
            tensor.copy_(buffer)
        self._receives = []
        return True

    def is_completed(self) -> bool:
        return self.done.is_set()

    def is_success(self) -> bool:
        return self.done.is_set() and self.error is None

    def exception(self):
        return self.error

    def source_rank(self) -> int:
        raise RuntimeError("NCCL's Work of a batched group has no source rank")


def _poison(tensor: torch.Tensor) -> None:
    tensor.fill_(float("nan") if tensor.is_floating_point() or tensor.is_complex() else -1)


def _peer(op: dist.P2POp) -> tuple[int, object]:
    """(global peer rank, group) of a P2POp."""
    group = op.group if op.group is not None else c10d._get_default_group()
    if op.peer is not None:
        return op.peer, group
    return dist.get_global_rank(group, op.group_peer), group


def _is_send(fn) -> bool:
    return fn in (_ORIGINAL.get("isend"), isend) or getattr(fn, "__name__", "") == "isend"


def batch_isend_irecv(p2p_op_list: list[dist.P2POp]) -> list[dist.Work]:
    """NCCL's `batch_isend_irecv`: the group is queued on this process's stream (it runs after
    every earlier group) and one `Work` is returned."""
    if not p2p_op_list or not all(isinstance(op, dist.P2POp) for op in p2p_op_list):
        raise ValueError("Invalid ``p2p_op_list``. Each op is expected to be of type "
                         "``torch.distributed.P2POp``.")
    if not _stream:
        _stream.append(_Stream())
    isend_, irecv_ = _ORIGINAL["isend"], _ORIGINAL["irecv"]
    receives, sends, acks_in, acks_out = [], [], [], []
    for op in p2p_op_list:
        peer, group = _peer(op)
        if op.tensor.device != torch.device("cpu"):
            raise RuntimeError(f"the NCCL-contract test backend runs on CPU tensors, got one on "
                               f"{op.tensor.device}")
        if _is_send(op.op):  # the data may travel now; the send completes at the rendezvous
            sends.append(isend_(op.tensor, dst=peer, group=group, tag=0))
            acks_in.append(irecv_(torch.zeros(1, dtype=torch.int8), src=peer, group=group,
                                  tag=_ACK_TAG))
        else:  # tags ignored: messages of a rank pair pair up in posting order
            buffer = torch.empty_like(op.tensor)
            _poison(op.tensor)
            receives.append((op.tensor, buffer, irecv_(buffer, src=peer, group=group, tag=0)))
            acks_out.append((peer, group))
    work = GroupWork(receives, sends, acks_in, acks_out)
    _stream[0].post(work)
    return [work]


def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
    return batch_isend_irecv([dist.P2POp(isend, tensor, dst, group, tag, group_dst)])[0]


def irecv(tensor, src=None, group=None, tag=0, group_src=None):
    return batch_isend_irecv([dist.P2POp(irecv, tensor, src, group, tag, group_src)])[0]


def send(tensor, dst=None, group=None, tag=0, group_dst=None) -> None:
    isend(tensor, dst, group, tag, group_dst).wait()


def recv(tensor, src=None, group=None, tag=0, group_src=None) -> int:
    irecv(tensor, src, group, tag, group_src).wait()
    return src if src is not None else dist.get_global_rank(group, group_src)


_REPLACED = {"batch_isend_irecv": batch_isend_irecv, "isend": isend, "irecv": irecv,
             "send": send, "recv": recv}


def install() -> None:
    """Replace torch.distributed's point-to-point functions in this process (idempotent)."""
    if installed():
        return
    for name, fn in _REPLACED.items():
        _ORIGINAL[name] = getattr(c10d, name)
        setattr(c10d, name, fn)
        setattr(dist, name, fn)


def uninstall() -> None:
    for name, fn in _ORIGINAL.items():
        setattr(c10d, name, fn)
        setattr(dist, name, fn)
    _ORIGINAL.clear()


if wanted():  # on import: here, from sitecustomize, or from conftest
    install()
