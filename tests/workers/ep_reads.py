"""Counting what the safetensors loader (merak/materialize/safetensors.py) reads: every read of
a file it opens is logged by byte range, and mapped back to the checkpoint's tensors, so a test
sees how many bytes of each tensor a rank read (used by test_expert_parallel_load and
ep_trainer.py: a rank reads 1/ep of each experts tensor)."""

from __future__ import annotations

import io
from collections.abc import Iterator
from contextlib import contextmanager

import merak.materialize.safetensors as loader


class CountingFile(io.FileIO):
    """A file whose reads append (path, offset, bytes) to `log`."""

    def __init__(self, path, log: list):
        super().__init__(path, "r")
        self.log = log

    def read(self, size=-1):
        at = self.tell()
        data = super().read(size)
        self.log.append((self.name, at, len(data)))
        return data

    def readinto(self, buffer):
        at = self.tell()
        count = super().readinto(buffer)
        self.log.append((self.name, at, count))
        return count


@contextmanager
def counting_reads() -> Iterator[list[tuple[str, int, int]]]:
    """Inside: the loader's files log their reads into the yielded list."""
    log: list[tuple[str, int, int]] = []
    loader.open = lambda path, mode="rb": CountingFile(path, log)  # shadows the builtin there
    try:
        yield log
    finally:
        del loader.open


def bytes_per_tensor(log: list[tuple[str, int, int]]) -> dict[str, int]:
    """Checkpoint tensor name -> how many of its bytes the logged reads covered (a byte read
    twice counts twice)."""
    out: dict[str, int] = {}
    headers = {}
    for path, at, count in log:
        if path not in headers:
            headers[path] = loader.read_header(path)
        start, header = headers[path]
        for name, info in header.items():
            begin, end = (start + o for o in info["data_offsets"])
            overlap = min(end, at + count) - max(begin, at)
            if overlap > 0:
                out[name] = out.get(name, 0) + overlap
    return out


def is_expert(name: str) -> bool:
    """A checkpoint tensor of experts (the Hub's names: ``...experts.<i>.w1.weight``,
    ``...experts.gate_up_proj``)."""
    return ".experts." in name
