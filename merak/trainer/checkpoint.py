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
import pickle
import random
import shutil
import warnings
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from merak.data_parallel.shards import is_sharded, local, this_ranks_part, whole
from merak.distributed.parallel_context import ParallelContext
from merak.tensor_parallel.layers import ShardSpec

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
                    *, save_total_limit: int | None = None, config=None,
                    name_prefix: str = "", keep: str | Path | None = None) -> Path:
    """Write this rank's part of ``checkpoint-<step>`` (collective: every rank calls it), then
    keep at most `save_total_limit` checkpoints (`rotate`; `keep` is the best one)."""
    final = Path(output_dir) / f"{PREFIX}{step}"
    partial = final.with_name(final.name + PARTIAL)
    if ctx.rank == 0:
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
    dist.barrier()
    params = dict(stage.named_parameters())
    if any(is_sharded(p) for p in params.values()):  # ZeRO-2/3: every dp rank gathers
        params = {n: whole(p) for n, p in params.items()}
    if ctx.dp_rank == 0:
        tensors = {n: p.detach().contiguous().cpu() for n, p in params.items()}
        specs = {n: json.dumps(asdict(p.tp_shard)) for n, p in stage.named_parameters()
                 if getattr(p, "tp_shard", None) is not None}
        save_file(tensors, partial / model_file(ctx), metadata=specs)
    torch.save(state, partial / f"rank{ctx.rank}.pt")
    dist.barrier()
    if ctx.rank == 0:
        if config is not None:  # for `merak export`: a plain HF directory needs the config
            config.save_pretrained(partial)
        (partial / MARKER).write_text(json.dumps({"step": step, "dp": ctx.dp, "tp": ctx.tp,
                                                  "pp": ctx.pp, "name_prefix": name_prefix}))
        if final.exists():
            shutil.rmtree(final)
        partial.rename(final)
        rotate(output_dir, save_total_limit, keep)
    dist.barrier()
    return final


def rotate(output_dir: str | Path, save_total_limit: int | None,
           keep: str | Path | None = None) -> None:
    """HF's `rotate_checkpoints`: delete the oldest checkpoints until `save_total_limit` are
    left, never the newest (to resume from) nor `keep` (the best, with load_best_model_at_end
    or save_strategy='best'), so with both protected two may stay."""
    if not save_total_limit or save_total_limit <= 0:
        return
    found = complete_checkpoints(output_dir)
    protected = {p.resolve() for p in found[-1:]} | ({Path(keep).resolve()} if keep else set())
    remaining = len(found)
    for old in found:
        if remaining <= max(save_total_limit, len(protected)):
            break
        if old.resolve() not in protected:
            shutil.rmtree(old)
            remaining -= 1


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


def full_tensors(path: Path, names=None) -> dict[str, torch.Tensor]:
    """Whole tensors from every (pp, tp) file of a checkpoint: tensor-parallel shards are put
    back together (`ShardSpec.assemble`). `names`: only these (default: all)."""
    shards: dict[str, list[tuple[ShardSpec | None, Path]]] = {}
    for file in sorted(path.glob("model-pp*-tp*.safetensors")):
        with safe_open(file, framework="pt") as f:
            meta = f.metadata() or {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if names is None or name in names:
                    spec = ShardSpec(**_spec_args(meta[name])) if name in meta else None
                    shards.setdefault(name, []).append((spec, file))
    out = {}
    for name, parts in shards.items():
        spec, file = parts[0]
        if spec is None:
            with safe_open(file, framework="pt") as f:
                out[name] = f.get_tensor(name)
            continue
        pieces = {}
        for part_spec, part_file in parts:
            with safe_open(part_file, framework="pt") as f:
                pieces[part_spec.rank] = f.get_tensor(name)
        if sorted(pieces) != list(range(spec.size)):
            raise ValueError(f"{path}: tensor {name} has shards {sorted(pieces)} of {spec.size}")
        out[name] = spec.assemble([pieces[r] for r in range(spec.size)])
    return out


def _spec_args(text: str) -> dict:
    args = json.loads(text)
    return {**args, "chunks": tuple(args["chunks"]), "full_shape": tuple(args["full_shape"])}


def load_checkpoint(path: Path, ctx: ParallelContext, stage) -> tuple[dict, bool]:
    """Load this rank's weights into `stage` in place. Returns (its saved state, whether the
    layout matched). From another (dp, tp, pp) layout the weights are resharded (whole tensors
    rebuilt from the saved shards, then cut for this rank) and the state is rank 0's."""
    layout = json.loads((path / MARKER).read_text())
    same = (layout["dp"], layout["tp"], layout["pp"]) == (ctx.dp, ctx.tp, ctx.pp)
    params = dict(stage.named_parameters())
    if same:
        tensors = load_file(path / model_file(ctx))
    else:
        tensors = full_tensors(path, set(params))
    with torch.no_grad():
        for name, param in params.items():
            if name not in tensors:
                raise KeyError(f"checkpoint {path} has no tensor {name}")
            value = tensors[name]
            spec = getattr(param, "tp_shard", None)
            if not same and spec is not None:
                value = spec.take(value)
            local(param).copy_(this_ranks_part(value, param))  # (ZeRO-2/3: the dp shard)
    state = load_rank_state(path / f"rank{ctx.rank if same else 0}.pt")
    return state, same


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

