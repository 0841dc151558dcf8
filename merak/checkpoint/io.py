"""Merak checkpoints: every rank writes its own part; a checkpoint appears only when complete.

Layout of ``<output_dir>/checkpoint-<step>/``:

- ``model/``: the weights (parameters and persistent buffers) under the user's model's names,
  one logical tensor each, on torch.distributed.checkpoint: every rank writes the boxes it
  holds (replicas once) and a load in any layout reads the slices it needs
  (`merak.checkpoint.model_state`).
- ``optimizer/``: the optimizer's state (unless ``no_save_optim``) under the same names, on
  torch.distributed.checkpoint too (`merak.checkpoint.optimizer_state`).
- ``rank<r>.pt``: scheduler, RNG states (unless ``no_save_rng``) and the trainer state (step,
  epoch, log history; the data position follows from the step, since the data order is
  deterministic).
- ``merak.json``: the layout, step and global batch, written last.

Writing goes to ``checkpoint-<step>.partial``; after every rank has written, rank 0 writes the
marker and renames the directory into place, keeping an existing checkpoint of the same step
valid until then (`merak.checkpoint.dirs`: listing, atomic replacement, recovery after a
kill). Readers check the metadata and that every file the layout implies is there
(`merak.checkpoint.files`).
"""

from __future__ import annotations

import copy as copy_module
import json
import os
import pickle
import random
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from merak.checkpoint.background import BackgroundSaves
from merak.checkpoint.dirs import (  # noqa: F401 - the trainer's names for them
    PARTIAL,
    complete_checkpoints,
    install,
    remove_step,
    repair,
    resolve,
    rotate,
)
from merak.checkpoint.files import (  # noqa: F401 - read_layout: for its users
    MARKER,
    MODEL_DIR,
    PREFIX,
    CheckpointError,
    IncompleteCheckpointError,
    Layout,
    check_files,
    check_model_tensors,
    read_layout,
)
from merak.checkpoint.model_state import (  # noqa: F401 - persistent_buffers: for export
    load_model_state,
    model_entries,
    persistent_buffers,
    read_whole_tensors,
    write_model_state,
)
from merak.checkpoint.optimizer_state import (  # noqa: F401 - the trainer's names for them
    OPTIMIZER_DIR,
    load_optimizer_state,
    optimizer_entries,
    save_optimizer_state,
    write_optimizer_state,
)
from merak.distributed.parallel_context import ParallelContext


def rng_states(model=None) -> dict:
    """Python, numpy, torch (CPU and CUDA) generators, and the TP per-rank stream of `model`."""
    states = {"python": random.getstate(), "numpy": np.random.get_state(),
              "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    tp_rng = getattr(model, "merak_tp_rng", None)
    if tp_rng is not None:
        states["tp_own"] = tp_rng.own
    return states


def set_rng_states(states: dict, model=None) -> None:
    random.setstate(states["python"])
    np.random.set_state(states["numpy"])
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
    tp_rng = getattr(model, "merak_tp_rng", None)
    if tp_rng is not None and "tp_own" in states:
        tp_rng.own = states["tp_own"]


def _barrier(group=None) -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)


def save_checkpoint(output_dir: str | Path, step: int, ctx: ParallelContext, stage, state: dict,
                    *, save_total_limit: int | None = None, config=None,
                    name_prefix: str = "", keep: str | Path | None = None,
                    before_marker: Callable[[Path], None] | None = None,
                    optimizer: torch.optim.Optimizer | None = None,
                    background: BackgroundSaves | None = None,
                    timeout_s: float | None = None, global_batch: int | None = None) -> Path:
    """Write this rank's part of ``checkpoint-<step>`` (collective: every rank calls it), then
    keep at most `save_total_limit` checkpoints (`rotate`; `keep` is the best one).
    `before_marker(dir)`: rank 0 writes more files (a LoRA adapter) before the checkpoint is
    complete, so they are never missing from one that looks complete (with `background`, on
    this thread: they are the step's). `optimizer`: its state is saved too
    (`save_optimizer_state`). `background`: stage the save into host memory here and write and
    publish it on the writer thread (`merak.checkpoint.background`; its
    group's collectives time out after `timeout_s`); the save before it is finished first.
    `global_batch`: the rows per step the run trains with, recorded for a resume elsewhere."""
    final = Path(output_dir) / f"{PREFIX}{step}"
    if background is not None:
        background.wait()
    if ctx.rank == 0:
        begin_save(final)
    _barrier()
    partial = final.with_name(final.name + PARTIAL)
    copy = background is not None
    files = stage_rank_files(ctx, stage, state, copy=copy)
    entries = None if optimizer is None else optimizer_entries(optimizer, stage, copy=copy)
    layout = Layout(step, ctx.dp, ctx.tp, ctx.pp, name_prefix, ctx.cp, global_batch)
    if copy and before_marker is not None:  # its files (a LoRA adapter read from the live
        if ctx.rank == 0:                   # model) are this step's: written now, still
            before_marker(partial)          # before the marker
        before_marker = None

    def write(group=None) -> None:
        write_rank_files(partial, files)
        write_model_state(partial / MODEL_DIR, files["model"], group)
        if entries is not None:
            write_optimizer_state(partial / OPTIMIZER_DIR, entries, group)
        _barrier(group)
        if ctx.rank == 0:
            finish_save(final, layout, config=config, before_marker=before_marker)
            rotate(output_dir, save_total_limit, keep)
        _barrier(group)

    if background is None:
        write()
    else:
        group = background.group(timeout_s)  # (a collective on its first use: made here)
        background.submit(final.name, lambda: write(group))
    return final


def begin_save(final: Path) -> None:
    """Rank 0: settle what interrupted saves left (`repair`), then an empty ``.partial``."""
    final.parent.mkdir(parents=True, exist_ok=True)
    repair(final.parent)
    final.with_name(final.name + PARTIAL).mkdir()  # (repair left no .partial behind)


def stage_rank_files(ctx: ParallelContext, stage, state: dict, copy: bool = False) -> dict:
    """What this rank writes of a save: its part of the weights (`model_entries`: every rank
    describes what it holds, DCP writes each box once) and its state. `copy`: host copies no
    later step changes (a background save)."""
    return {"rank": ctx.rank, "state": copy_module.deepcopy(state) if copy else state,
            "model": model_entries(stage, copy=copy)}


def write_rank_files(partial: Path, staged: dict) -> None:
    """Write `stage_rank_files`' state into `partial` (the weights are a collective:
    `write_model_state`)."""
    torch.save(staged["state"], partial / f"rank{staged['rank']}.pt")


def finish_save(final: Path, layout: Layout, *, config=None,
                before_marker: Callable[[Path], None] | None = None) -> None:
    """Rank 0, once every rank has written: the config, the marker (atomically: the
    checkpoint is complete from this rename on) and the rename into place (`install`)."""
    partial = final.with_name(final.name + PARTIAL)
    if config is not None:  # for `merak export`: a plain HF directory needs the config
        config.save_pretrained(partial)
    if before_marker is not None:
        before_marker(partial)
    check_files(partial, layout)  # every rank's file is there before it may count as complete
    if (partial / OPTIMIZER_DIR).exists() and not (partial / OPTIMIZER_DIR / ".metadata").is_file():
        raise IncompleteCheckpointError(f"{partial}: the optimizer state was not completed")
    fields = {"step": layout.step, "dp": layout.dp, "tp": layout.tp, "pp": layout.pp,
              "name_prefix": layout.name_prefix, **({"cp": layout.cp} if layout.cp > 1 else {}),
              **({"global_batch": layout.global_batch} if layout.global_batch else {})}
    (partial / (MARKER + ".tmp")).write_text(json.dumps(fields))
    os.replace(partial / (MARKER + ".tmp"), partial / MARKER)
    install(partial, final)


def full_tensors(path: Path, names=None) -> dict[str, torch.Tensor]:
    """Whole tensors of a checkpoint's weights, read in this process (no collective).
    `names`: only these (default: all, and then the checkpoint must be whole: every file its
    layout implies and every parameter its config's model has, or `IncompleteCheckpointError`
    names what is missing; what `merak export` reads, so it never writes part of a model)."""
    path = Path(path)
    layout = check_files(path, rank_states=False)
    tensors = read_whole_tensors(path / MODEL_DIR, names)
    if names is None:
        check_model_tensors(path, tensors, layout)
    return tensors


def load_checkpoint(path: Path, ctx: ParallelContext, stage) -> tuple[dict, bool]:
    """Load this rank's weights into `stage` in place (a collective of every rank: DCP reads
    for each just the slices it holds, from a checkpoint of any layout). Returns (its saved
    state, whether the layout matched): from another (dp, tp, pp, cp) layout the state is rank
    0's. Every file it reads must be there (errors name the missing ones)."""
    path = Path(path)
    layout = check_files(path, rank_states=False)
    same = (layout.dp, layout.tp, layout.pp, layout.cp) == (ctx.dp, ctx.tp, ctx.pp, ctx.cp)
    state_file = state_file_of(path, ctx, same)
    if not state_file.is_file():
        raise IncompleteCheckpointError(f"{path} is incomplete: it has no {state_file.name}")
    load_model_state(path / MODEL_DIR, stage)
    return load_rank_state(state_file), same


def state_file_of(path: Path, ctx: ParallelContext, same_layout: bool) -> Path:
    """The rank state a resume reads: its own in the same layout, else rank 0's."""
    return Path(path) / f"rank{ctx.rank if same_layout else 0}.pt"


def _safe_globals():
    """The non-tensor types a rank's state holds besides plain containers and numbers: numpy's
    RNG state (an array of uint32), as HF Trainer allows them for its RNG files."""
    core = getattr(np, "_core", None) or np.core
    return torch.serialization.safe_globals([core.multiarray._reconstruct, np.ndarray, np.dtype,
                                             type(np.dtype(np.uint32))])


def load_rank_state(file: Path) -> dict:
    """A rank's optimizer, scheduler, RNG and trainer state, unpickled with ``weights_only=True``
    (tensors, plain containers and numbers, numpy RNG arrays): a checkpoint from elsewhere cannot
    run code. Loaded on CPU (the file may come from another device index or a GPU-less job; the
    optimizer moves its state onto the parameters when it loads it)."""
    try:
        with _safe_globals():
            return torch.load(file, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        lines = str(error).splitlines()
        culprit = next((ln.strip() for ln in lines if "GLOBAL" in ln or "Unsupported" in ln),
                       lines[0] if lines else "")
        raise pickle.UnpicklingError(
            f"refusing to load {file}: it holds objects other than tensors, numbers and plain "
            f"containers, which unpickling could run code for (Merak loads checkpoint states "
            f"with torch.load(weights_only=True)); only resume from checkpoints you trust that "
            f"Merak wrote. ({culprit})") from None
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{file} is missing") from None
    except (EOFError, RuntimeError, OSError) as error:  # cut short or overwritten
        raise CheckpointError(f"{file}: not a readable torch.save file ({error})") from None

