"""Merak checkpoints: every rank writes its own shard; a checkpoint appears only when complete.

Layout of ``<output_dir>/checkpoint-<step>/``:

- ``model-pp<p>-tp<t>.safetensors``: the stage's parameters under their original names, as
  this (pp, tp) rank holds them, written by dp rank 0; each tensor's `ShardSpec` (if any) is in
  the file metadata.
- ``optimizer/``: the optimizer's state (unless ``no_save_optim``), one logical tensor per
  parameter and state, on torch.distributed.checkpoint: resharded on load into any layout
  (`merak.checkpoint.optimizer_state`).
- ``rank<r>.pt``: scheduler, RNG states (unless ``no_save_rng``) and the trainer state (step,
  epoch, log history; the data position follows from the step, since the data order is
  deterministic).
- ``merak.json``: the layout and step, written last.

Writing goes to ``checkpoint-<step>.partial``; after every rank has written, rank 0 writes the
marker and renames the directory into place, keeping an existing checkpoint of the same step
valid until then (`checkpoint_dirs`: listing, atomic replacement, recovery after a kill). Readers
check the metadata and that every file the layout implies is there (`checkpoint_files`).
"""

from __future__ import annotations

import copy as copy_module
import json
import os
import pickle
import random
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

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
    PREFIX,
    CheckpointError,
    IncompleteCheckpointError,
    Layout,
    check_files,
    check_model_tensors,
    read_layout,
)
from merak.checkpoint.optimizer_state import (  # noqa: F401 - the trainer's names for them
    OPTIMIZER_DIR,
    load_optimizer_state,
    optimizer_entries,
    save_optimizer_state,
    write_optimizer_state,
)
from merak.data_parallel.shards import is_sharded, local, this_ranks_part, whole
from merak.distributed.parallel_context import ParallelContext
from merak.tensor_parallel.layers import ShardSpec


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
    return f"model-pp{ctx.pp_rank}-tp{ctx.tp_rank}.safetensors"


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


def persistent_buffers(stage: nn.Module) -> dict[str, torch.Tensor]:
    """The stage's buffers that a state_dict (and so HF's save_pretrained) holds, by name:
    DeepSeek-V3's ``mlp.gate.e_score_correction_bias``. Non-persistent ones (rotary
    ``inv_freq``) are rebuilt by the model and stay out. Saved and loaded beside the
    parameters (never sharded by ZeRO)."""
    params = dict(stage.named_parameters(remove_duplicate=False))
    return {n: t for n, t in stage.state_dict(keep_vars=True).items() if n not in params}


def stage_rank_files(ctx: ParallelContext, stage, state: dict, copy: bool = False) -> dict:
    """What `write_rank_files` writes for this rank: its (pp, tp) weights and persistent
    buffers (dp rank 0; under ZeRO-2/3 every dp rank gathers them, a collective) with their
    shard specs, and its state. `copy`: host copies no later step changes (a background
    save)."""
    params = dict(stage.named_parameters())
    if any(is_sharded(p) for p in params.values()):  # ZeRO-2/3: every dp rank gathers
        params = {n: whole(p) for n, p in params.items()}
    params.update(persistent_buffers(stage))
    staged = {"rank": ctx.rank, "state": copy_module.deepcopy(state) if copy else state}
    if ctx.dp_rank == 0 and ctx.cp_rank == 0:  # (one copy of each (pp, tp) shard)
        staged["model_file"] = model_file(ctx)
        staged["tensors"] = {n: p.detach().to("cpu", copy=copy).contiguous()
                             for n, p in params.items()}
        staged["specs"] = {n: json.dumps(asdict(p.tp_shard)) for n, p in stage.named_parameters()
                           if getattr(p, "tp_shard", None) is not None}
    return staged


def write_rank_files(partial: Path, staged: dict) -> None:
    """Write `stage_rank_files`' weights (if this rank writes them) and state into `partial`."""
    if "tensors" in staged:
        save_file(staged["tensors"], partial / staged["model_file"], metadata=staged["specs"])
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
    """Whole tensors from every (pp, tp) file of a checkpoint: tensor-parallel shards are put
    back together (`ShardSpec.assemble`). `names`: only these (default: all, and then the
    checkpoint must be whole: every file its layout implies and every parameter its config's
    model has, or `IncompleteCheckpointError` names what is missing; what `merak export`
    reads, so it never writes part of a model)."""
    path = Path(path)
    layout = check_files(path, rank_states=False)
    shards: dict[str, list[tuple[ShardSpec | None, Path]]] = {}
    for file in (path / name for name in layout.model_files()):
        with _open(file) as f:
            meta = f.metadata() or {}
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if names is None or name in names:
                    spec = _spec(meta[name], file, name) if name in meta else None
                    shards.setdefault(name, []).append((spec, file))
    if names is None:
        check_model_tensors(path, shards, layout)
    out = {}
    for name, parts in shards.items():
        spec, file = parts[0]
        if spec is None:
            with _open(file) as f:
                out[name] = f.get_tensor(name)
            continue
        pieces = {}
        for part_spec, part_file in parts:
            with _open(part_file) as f:
                pieces[part_spec.rank] = f.get_tensor(name)
        if sorted(pieces) != list(range(spec.size)):
            raise IncompleteCheckpointError(f"{path}: tensor {name} has shards "
                                            f"{sorted(pieces)} of {spec.size}")
        out[name] = spec.assemble([pieces[r] for r in range(spec.size)])
    return out


def _open(file: Path):
    """`safe_open`, with an error naming the file when it is not a readable safetensors file
    (cut short, overwritten)."""
    try:
        return safe_open(file, framework="pt")
    except Exception as error:  # noqa: BLE001 - safetensors' errors do not name the file
        raise CheckpointError(f"{file}: not a readable safetensors file ({error})") from None


def _spec(text: str, file: Path, name: str) -> ShardSpec:
    try:
        args = json.loads(text)
        return ShardSpec(**{**args, "chunks": tuple(args["chunks"]),
                            "full_shape": tuple(args["full_shape"])})
    except (ValueError, TypeError, KeyError) as error:
        raise CheckpointError(f"{file}: the shard metadata of {name} is malformed "
                              f"({error!r})") from None


def load_checkpoint(path: Path, ctx: ParallelContext, stage) -> tuple[dict, bool]:
    """Load this rank's weights into `stage` in place. Returns (its saved state, whether the
    layout matched). From another (dp, tp, pp) layout the weights are resharded (whole tensors
    rebuilt from the saved shards, then cut for this rank) and the state is rank 0's. Every
    weight file and the state file it reads must be there (errors name the missing ones)."""
    path = Path(path)
    layout = check_files(path, rank_states=False)
    same = (layout.dp, layout.tp, layout.pp, layout.cp) == (ctx.dp, ctx.tp, ctx.pp, ctx.cp)
    state_file = state_file_of(path, ctx, same)
    if not state_file.is_file():
        raise IncompleteCheckpointError(f"{path} is incomplete: it has no {state_file.name}")
    params = {**dict(stage.named_parameters()), **persistent_buffers(stage)}
    if same:
        with _open(path / model_file(ctx)) as f:
            tensors = {n: f.get_tensor(n) for n in f.keys() if n in params}  # noqa: SIM118
    else:
        tensors = full_tensors(path, set(params))
    with torch.no_grad():
        for name, param in params.items():
            if name not in tensors:
                raise IncompleteCheckpointError(f"checkpoint {path} has no tensor {name}")
            value = tensors[name]
            spec = getattr(param, "tp_shard", None)
            if not same and spec is not None:
                value = spec.take(value)
            local(param).copy_(this_ranks_part(value, param))  # (ZeRO-2/3: the dp shard)
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

