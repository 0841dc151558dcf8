"""Merak checkpoints: every rank writes its own shard; a checkpoint appears only when complete.

Layout of ``<output_dir>/checkpoint-<step>/``:

- ``model-pp<p>-tp<t>.safetensors``: the stage's parameters under their original names, as
  this (pp, tp) rank holds them, written by dp rank 0; each tensor's `ShardSpec` (if any) is in
  the file metadata.
- ``rank<r>.pt``: optimizer state (unless ``no_save_optim``), scheduler, RNG states (unless
  ``no_save_rng``) and the trainer state (step, epoch, log history; the data position follows
  from the step, since the data order is deterministic).
- ``merak.json``: the layout and step, written last.

Writing goes to ``checkpoint-<step>.partial``; after every rank has written, rank 0 renames it.
A crash mid-save therefore leaves only a ``.partial`` directory, which resuming skips with a
warning, and the previous checkpoint intact.
"""

from __future__ import annotations

import json
import random
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from merak.distributed.parallel_context import ParallelContext

PREFIX, PARTIAL, MARKER = "checkpoint-", ".partial", "merak.json"


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


def model_file(ctx: ParallelContext) -> str:
    return f"model-pp{ctx.stage_id}-tp{ctx.tp_rank}.safetensors"


def save_checkpoint(output_dir: str | Path, step: int, ctx: ParallelContext, stage, state: dict,
                    *, save_total_limit: int | None = None) -> Path:
    """Write this rank's part of ``checkpoint-<step>`` (collective: every rank calls it)."""
    final = Path(output_dir) / f"{PREFIX}{step}"
    partial = final.with_name(final.name + PARTIAL)
    if ctx.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    if ctx.dp_rank == 0:
        tensors = {n: p.detach().contiguous().cpu() for n, p in stage.named_parameters()}
        specs = {n: json.dumps(asdict(p.tp_shard)) for n, p in stage.named_parameters()
                 if getattr(p, "tp_shard", None) is not None}
        save_file(tensors, partial / model_file(ctx), metadata=specs)
    torch.save(state, partial / f"rank{ctx.rank}.pt")
    dist.barrier()
    if ctx.rank == 0:
        (partial / MARKER).write_text(json.dumps({"step": step, "dp": ctx.dp, "tp": ctx.tp,
                                                  "pp": ctx.pp}))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        if save_total_limit:
            for old in complete_checkpoints(output_dir)[:-save_total_limit]:
                shutil.rmtree(old)
    dist.barrier()
    return final


def complete_checkpoints(output_dir: str | Path) -> list[Path]:
    """Complete checkpoints in `output_dir`, oldest first; warns about half-written ones."""
    root = Path(output_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        if path.name.startswith(PREFIX) and path.name.endswith(PARTIAL):
            warnings.warn(f"ignoring the half-written checkpoint {path} (a save was interrupted)",
                          stacklevel=2)
        elif path.name.startswith(PREFIX) and (path / MARKER).exists():
            found.append(path)
    return sorted(found, key=lambda p: int(p.name[len(PREFIX):]))


def resolve(resume_from_checkpoint: str | bool, output_dir: str | Path) -> Path:
    if resume_from_checkpoint is True:
        found = complete_checkpoints(output_dir)
        if not found:
            raise FileNotFoundError(f"resume_from_checkpoint=True but {output_dir} has no "
                                    f"complete Merak checkpoint")
        return found[-1]
    path = Path(resume_from_checkpoint)
    if not (path / MARKER).exists():
        raise FileNotFoundError(f"{path} is not a complete Merak checkpoint (no {MARKER}; "
                                f"a half-written save ends in {PARTIAL})")
    return path


def load_checkpoint(path: Path, ctx: ParallelContext, stage) -> dict:
    """Load this rank's weights into `stage` in place; return its saved state."""
    layout = json.loads((path / MARKER).read_text())
    if (layout["dp"], layout["tp"], layout["pp"]) != (ctx.dp, ctx.tp, ctx.pp):
        raise NotImplementedError(
            f"{path} was saved with dp={layout['dp']} tp={layout['tp']} pp={layout['pp']}; "
            f"loading it into dp={ctx.dp} tp={ctx.tp} pp={ctx.pp} (resharding) is not "
            f"supported yet")
    tensors = load_file(path / model_file(ctx))
    with torch.no_grad():
        for name, param in stage.named_parameters():
            if name not in tensors:
                raise KeyError(f"{path / model_file(ctx)} has no tensor {name}")
            param.copy_(tensors[name])
    return torch.load(path / f"rank{ctx.rank}.pt", weights_only=False)
