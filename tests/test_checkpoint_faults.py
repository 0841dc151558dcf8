"""A kill at every point of a save, a re-save and an export: nothing lost.

The scenario of the fault-injection probe: a run saved checkpoints 2 and 4, was resumed from
2, and now saves step 4 again (replacing it) and then step 6 (rotating 2 away,
``save_total_limit=2``). Every file-system operation of those saves (directory creation, file
writes, renames, each unlink and rmdir inside a directory removal) is a kill point: at the k-th
one the operation does not happen (a write leaves a file cut short) and `Killed` unwinds
everything, as a SIGKILL would stop the process there. After each kill:

- the newest checkpoint resolves (`resolve(True)`) to the newest save whose marker was written,
  whole: every file there and readable, every tensor and rank state of that one save;
- exporting it writes exactly that save's weights;
- the job restarted from it saves its next step cleanly: no ``.partial`` / ``.replaced`` /
  ``.deleting`` left, the resumed checkpoint kept beside the new one, both whole.

Each kill point is tried with synchronous saves and with saves in the background
(``save_async``: staged on the training thread, written and published on the writer thread).
"""

from __future__ import annotations

import os
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from checkpoint_fixtures import save, values, version_of
from safetensors.torch import load_file
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from merak.checkpoint import io as checkpoint
from merak.checkpoint.background import BackgroundSaves
from merak.cli import main as merak_main


class Killed(BaseException):
    """The process died here (a BaseException: no `except Exception` may swallow it)."""


OS_OPS = ("mkdir", "rename", "replace", "unlink", "rmdir")


@contextmanager
def kill_at(monkeypatch, k: int | None, log: list):
    """Count file-system operations (appending (op, path) to `log` for each one done) and
    raise `Killed` at the `k`-th (None: never)."""
    def counted(op, real, is_write=False, applies=lambda *args: True):
        def wrapper(*args, **kwargs):
            if not applies(*args):  # (a read, or a write into an open stream)
                return real(*args, **kwargs)
            target = str(args[1] if op in ("rename", "replace") or is_write else args[0])
            if k is not None and len(log) + 1 == k:
                if is_write:  # killed mid-write: a file cut short
                    Path(target).write_bytes(b"\0" * 3)
                raise Killed(f"killed at operation {k}: {op} {target}")
            result = real(*args, **kwargs)
            log.append((op, target))
            return result
        return wrapper

    with monkeypatch.context() as patch:
        for op in OS_OPS:
            patch.setattr(os, op, counted(op, getattr(os, op)))
        patch.setattr(FileSystem, "create_stream",  # DCP's files: the data and its metadata
                      counted("dcp write", FileSystem.create_stream, True,
                              lambda fs, path, mode: "w" in mode))
        patch.setattr(torch, "save", counted("torch.save", torch.save, True,
                                             lambda obj, f, *rest: isinstance(f, (str, Path))))
        yield


def killed_by(error: BaseException) -> BaseException:
    """The error under what the save raised: the writer thread's (raised by the next wait as
    the cause of a RuntimeError) and DCP's (a CheckpointException holding each rank's)."""
    if isinstance(error, RuntimeError) and error.__cause__ is not None:
        error = error.__cause__
    if isinstance(error, CheckpointException):
        error = next(iter(error.failures.values()))[0]
    return error


def scenario(root: Path, background: BackgroundSaves | None = None) -> None:
    save(root, 4, 1, limit=2, background=background)  # resumed from 2: step 4 saved again
    save(root, 6, 1, limit=2, background=background)  # the next one, rotating checkpoint-2 away
    if background is not None:
        background.wait()  # (a kill in the writer thread is raised here)


def committed(log: list) -> tuple[int, int]:
    """(step, version) of the newest save whose marker rename happened."""
    newest = (4, 0)  # the template's
    for op, target in log:
        if op == "replace" and target.endswith("merak.json"):
            newest = (int(Path(target).parent.name.split("-")[1].split(".")[0]), 1)
    return newest


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("template")
    save(root, 2, 0, limit=2)
    save(root, 4, 0, limit=2)
    return root


@pytest.fixture(scope="module")
def total_ops(template, tmp_path_factory) -> int:
    root = tmp_path_factory.mktemp("count") / "run"
    shutil.copytree(template, root)
    log: list = []
    with pytest.MonkeyPatch.context() as monkeypatch, kill_at(monkeypatch, None, log):
        scenario(root)
    assert committed(log) == (6, 1)
    return len(log)


MAX_POINTS = 40  # the scenario has 37 operations today; points past its end are skipped


def test_there_are_enough_kill_points(total_ops):
    """At least 20, and none past MAX_POINTS left untried."""
    assert 20 <= total_ops <= MAX_POINTS, total_ops


@pytest.mark.parametrize("k", range(1, MAX_POINTS + 1))
@pytest.mark.parametrize("mode", ["sync", "background"])
def test_a_kill_at_any_point_leaves_the_newest_complete_checkpoint(
        mode, k, template, total_ops, tmp_path, monkeypatch):
    """In the background mode the saves are staged on the calling thread and written and
    published on the writer thread (``save_async``), where most kill points then are."""
    if k > total_ops:
        pytest.skip(f"the scenario has {total_ops} operations")
    root = tmp_path / "run"
    shutil.copytree(template, root)
    log: list = []
    with pytest.raises((Killed, RuntimeError, CheckpointException)) as raised, \
            kill_at(monkeypatch, k, log):
        scenario(root, BackgroundSaves() if mode == "background" else None)
    assert isinstance(killed_by(raised.value), Killed), raised.value
    step, version = committed(log)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the listing warns about what it skips)
        latest = checkpoint.resolve(True, root)
    assert version_of(latest, step) == version, (k, latest, log[-3:])

    out = tmp_path / "exported"
    assert merak_main(["export", str(latest), str(out)]) == 0
    exported, expected = load_file(out / "model.safetensors"), values(step, version)
    assert sorted(exported) == sorted(expected)
    for name in expected:
        torch.testing.assert_close(exported[name], expected[name], msg=name)

    save(root, step + 2, 2, limit=2)  # the job restarted from `latest` saves its next step
    assert sorted(p.name for p in root.iterdir()) == [f"checkpoint-{step}",
                                                     f"checkpoint-{step + 2}"]
    assert checkpoint.resolve(True, root).name == f"checkpoint-{step + 2}"
    assert version_of(root / f"checkpoint-{step + 2}", step + 2) == 2
    assert version_of(root / f"checkpoint-{step}", step) == version
