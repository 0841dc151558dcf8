"""Counting the aten ops a piece of code runs (each one a kernel launch on a GPU), for tests
that bound how many kernels a step launches whatever the number of parameters."""

from __future__ import annotations

from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    """The names of the aten ops run inside it, in order (``self.names``)."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))
