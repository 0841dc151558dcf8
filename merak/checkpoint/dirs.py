"""Checkpoint directories on disk: listing, atomic replacement and recovery after a kill.

A save writes ``checkpoint-<step>.partial`` and makes it ``checkpoint-<step>`` with a rename, so
a step's directory is never seen half written. Replacing a step that already exists (a run
resumed from an older checkpoint saves it again) must keep that promise too: deleting the old
directory before the rename, as a plain ``rmtree`` + ``rename`` does, leaves a half-deleted
directory that still holds ``merak.json`` if the job dies in between. So (`install`):

1. the old ``checkpoint-<step>`` is renamed aside to ``checkpoint-<step>.replaced``,
2. the complete ``.partial`` is renamed into place,
3. the aside copy is deleted (`discard`: renamed to ``...deleting`` first, then removed, so no
   listable directory is ever half deleted; rotation deletes the same way).

A kill can leave any of these states behind. Reading them needs no repair: for each step the
listing takes the first complete copy of ``.partial`` (the newest save, once its marker is
written), ``checkpoint-<step>``, ``.replaced`` (the copy whose replacement never landed), so
every rank resolves the same checkpoint without touching the disk. `repair`, on rank 0 at the
start of the next save, puts each step's chosen copy in place and removes the rest.
"""

from __future__ import annotations

import os
import shutil
import warnings
from pathlib import Path

from merak.checkpoint.files import (
    PREFIX,
    CheckpointError,
    IncompleteCheckpointError,
    check_files,
    step_of,
)

PARTIAL, ASIDE, TRASH = ".partial", ".replaced", ".deleting"


def copies(root: Path, step: int) -> tuple[Path, Path, Path]:
    """A step's possible directories, newest content first: (partial, final, aside)."""
    final = root / f"{PREFIX}{step}"
    return final.with_name(final.name + PARTIAL), final, final.with_name(final.name + ASIDE)


def _problem(path: Path, step: int) -> str | None:
    """Why `path` is not a complete checkpoint of `step` (None when it is)."""
    try:
        layout = check_files(path)
    except CheckpointError as error:
        return str(error)
    if layout.step != step:
        return f"{path}: merak.json's step is {layout.step}, not {step} as the name says"
    return None


def best_copy(root: Path, step: int, *, quiet: bool = True) -> Path | None:
    """The complete copy of `step` to resume from (see the module docstring), or None."""
    found, problems = None, []
    for path in copies(root, step):
        if not path.is_dir():
            continue
        problem = _problem(path, step)
        if problem is None:
            found = path
            break
        problems.append((path, problem))
    if not quiet:
        for path, problem in problems:
            if path.name.endswith(PARTIAL):
                warnings.warn(f"ignoring the half-written checkpoint {path} (a save was "
                              f"interrupted)", stacklevel=3)
            else:
                warnings.warn(f"ignoring {path}: {problem}", stacklevel=3)
        if found is not None and found.name.endswith((PARTIAL, ASIDE)):
            warnings.warn(f"{PREFIX}{step}: using its complete copy {found} (a save was "
                          f"interrupted while replacing it; the next save puts it in place)",
                          stacklevel=3)
    return found


def _steps(root: Path) -> set[int]:
    """Steps with any listable directory: ``checkpoint-<int>`` with no suffix, ``.partial``
    or ``.replaced``. Other names (``checkpoint-best``, ``...deleting``) are not ours."""
    steps = set()
    for path in root.iterdir():
        base, dot, suffix = path.name.partition(".")
        step = step_of(base)
        if step is not None and path.is_dir() and dot + suffix in ("", PARTIAL, ASIDE):
            steps.add(step)
    return steps


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """One complete checkpoint per step in `output_dir`, oldest first (the copy `best_copy`
    picks); warns about what it skips. Read-only, so every rank may call it."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    return [path for step in sorted(_steps(root))
            if (path := best_copy(root, step, quiet=False)) is not None]


def resolve(resume_from_checkpoint: str | bool, output_dir: str | Path) -> Path:
    """The checkpoint to resume from: the newest complete one for True, else the given path,
    as the listing reads it (when a save of that step was interrupted while replacing it, the
    copy `best_copy` picks: the new one once complete, else the old one)."""
    if resume_from_checkpoint is True:
        found = complete_checkpoints(output_dir)
        if not found:
            raise IncompleteCheckpointError(f"resume_from_checkpoint=True but {output_dir} "
                                            f"has no complete Merak checkpoint")
        return found[-1]
    path = Path(resume_from_checkpoint)
    step = step_of(path.name)
    if step is not None:
        found = best_copy(path.parent, step)
        if found is not None and found.name != path.name:
            warnings.warn(f"{path}: using its complete copy {found} (a save was interrupted "
                          f"while replacing it)", stacklevel=2)
        if found is not None:
            return found
    check_files(path)  # names what is missing or malformed
    return path


def discard(path: Path) -> None:
    """Delete a checkpoint directory without ever leaving it half deleted under a listable
    name: renamed to ``<name>.deleting`` (atomic), then removed."""
    trash = path.with_name(path.name + TRASH)
    if trash.exists():
        shutil.rmtree(trash)
    os.rename(path, trash)
    shutil.rmtree(trash)


def remove_step(root: Path, step: int) -> None:
    """Delete every directory of `step` (rotation, the best model's clean-up)."""
    for path in copies(root, step):
        if path.exists():
            discard(path)


def install(partial: Path, final: Path) -> None:
    """Make the complete `partial` the step's checkpoint, the old one (if any) staying valid
    until the new one is in place (the three renames of the module docstring)."""
    aside = final.with_name(final.name + ASIDE)
    if final.exists():
        if aside.exists():
            discard(aside)
        os.rename(final, aside)
    os.rename(partial, final)
    if aside.exists():
        discard(aside)


def repair(root: Path) -> None:
    """Rank 0, before a save: finish what interrupted saves left (each step's `best_copy`
    put in place, the other copies and half-deleted ``.deleting`` directories removed), so the
    save starts from plain ``checkpoint-<step>`` directories. Incomplete copies with no
    complete one beside them are left to be listed (and warned about), not deleted."""
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.name.startswith(PREFIX) and path.name.endswith(TRASH):
            shutil.rmtree(path, ignore_errors=True)
    for step in _steps(root):
        partial, final, aside = copies(root, step)
        best = best_copy(root, step)
        if best is None:
            if partial.exists():  # a dead half-written save; this save reuses the name
                discard(partial)
            continue
        if best == partial:
            install(partial, final)
        elif best == aside:
            if final.exists():
                discard(final)
            os.rename(aside, final)
        for other in (partial, aside):
            if other.exists():
                discard(other)


def rotate(output_dir: str | Path, save_total_limit: int | None,
           keep: str | Path | None = None) -> None:
    """HF's `rotate_checkpoints`: delete the oldest checkpoints until `save_total_limit` are
    left, never the newest (to resume from) nor `keep` (the best, with load_best_model_at_end
    or save_strategy='best'), so with both protected two may stay."""
    if not save_total_limit or save_total_limit <= 0:
        return
    root = Path(output_dir)
    found = complete_checkpoints(root)
    steps = [step_of(p.name.partition(".")[0]) for p in found]
    protected = set(steps[-1:])
    kept = step_of(Path(keep).name) if keep else None
    if kept is not None and Path(keep).parent.resolve() == root.resolve():
        protected.add(kept)
    remaining = len(found)
    for step in steps:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if step not in protected:
            remove_step(root, step)
            remaining -= 1
