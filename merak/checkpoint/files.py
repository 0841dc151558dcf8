"""What a whole Merak checkpoint is, checked before anything trusts one.

A checkpoint directory is only as good as its weakest file: an export that silently skips a
lost data file of the weights writes part of a model, which ``from_pretrained`` then fills with
random weights without a word; a resume from hand-edited metadata trains from step -3. So every
reader goes through here first:

- `read_layout`: ``merak.json`` parsed and validated (step, dp, tp, pp, name_prefix), errors
  naming the file and the field.
- `missing_files`: the weights' DCP metadata and every data file it points at
  (`missing_model_files`), and every rank's state file the layout implies.
- `missing_model_tensors`: every parameter the config's model has (``config.json``), so
  weights saved without a part of the model are caught too.
- `check_trainer_state`: the step, epoch and log history a resume would continue from.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

PREFIX, MARKER = "checkpoint-", "merak.json"
MODEL_DIR = "model"  # the weights, inside a checkpoint directory
NAME = re.compile(r"checkpoint-(\d+)")  # the listable name; any suffix marks a non-checkpoint


class CheckpointError(ValueError):
    """A checkpoint that cannot be used as it is: its message names the file and what is
    wrong with it."""


class IncompleteCheckpointError(CheckpointError, FileNotFoundError):
    """Files or tensors a checkpoint's layout or config implies are absent (also a
    `FileNotFoundError`, as the old "not a complete Merak checkpoint" error was)."""


def listed(names: list[str], shown: int = 8) -> str:
    """The first `shown` of `names`, comma-separated, and how many more there are: the names
    an error about missing tensors or state lists."""
    more = f" (and {len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


@dataclass(frozen=True)
class Layout:
    """The contents of ``merak.json``: the step and the (dp, tp, pp) layout it was saved in, its
    cp (the weight files do not depend on it: cp ranks hold the same weights) and the global
    batch in rows it trained with (None where not recorded), which a resume in another layout
    keeps."""

    step: int
    dp: int
    tp: int
    pp: int
    name_prefix: str = ""
    cp: int = 1
    global_batch: int | None = None

    def rank_files(self) -> list[str]:
        return [f"rank{r}.pt" for r in range(self.dp * self.cp * self.tp * self.pp)]


def step_of(name: str) -> int | None:
    """The step of a directory named exactly ``checkpoint-<int>`` (None for anything else:
    ``checkpoint-best``, ``checkpoint-4.partial``)."""
    match = NAME.fullmatch(name)
    return int(match.group(1)) if match else None


def _count(file: Path, fields: dict, key: str, minimum: int) -> int:
    if key not in fields:
        raise CheckpointError(f"{file}: field {key!r} is missing")
    value = fields[key]
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{file}: field {key!r} must be an integer >= {minimum}, got "
                              f"{value!r}")
    return value


def read_layout(path: str | Path) -> Layout:
    """``<path>/merak.json`` as a `Layout`; `CheckpointError` naming the file and the field
    when it is absent, not JSON, or holds a missing or impossible value."""
    file = Path(path) / MARKER
    try:
        fields = json.loads(file.read_text())
    except FileNotFoundError:
        raise IncompleteCheckpointError(f"{path} is not a complete Merak checkpoint (no "
                                        f"{MARKER}; a half-written save ends in .partial)"
                                        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file}: not readable JSON ({error})") from None
    if not isinstance(fields, dict):
        raise CheckpointError(f"{file}: expected a JSON object, got {type(fields).__name__}")
    prefix = fields.get("name_prefix", "")
    if not isinstance(prefix, str):
        raise CheckpointError(f"{file}: field 'name_prefix' must be a string, got {prefix!r}")
    return Layout(step=_count(file, fields, "step", 0), dp=_count(file, fields, "dp", 1),
                  tp=_count(file, fields, "tp", 1), pp=_count(file, fields, "pp", 1),
                  name_prefix=prefix,
                  cp=_count(file, fields, "cp", 1) if "cp" in fields else 1,
                  global_batch=_count(file, fields, "global_batch", 1)
                  if "global_batch" in fields else None)


def dcp_metadata(path: Path):
    """DCP's metadata of the directory `path` (errors name it: absent, or unreadable)."""
    from torch.distributed.checkpoint import FileSystemReader

    if not (path / ".metadata").is_file():
        raise IncompleteCheckpointError(f"{path.parent} is incomplete: it has no "
                                        f"{path.name}/.metadata (the weights were not all "
                                        f"written)")
    try:
        return FileSystemReader(str(path)).read_metadata()
    except Exception as error:  # noqa: BLE001 - DCP's errors do not name the file
        raise CheckpointError(f"{path / '.metadata'}: not readable DCP metadata "
                              f"({error!r})") from None


def missing_model_files(path: Path) -> list[str]:
    """What the weights at `path` (a checkpoint's ``model/``) lack: their ``.metadata``, or a
    data file it points at (absent, or shorter than the bytes it holds: cut short), each
    named relative to the checkpoint."""
    path = Path(path)
    try:
        metadata = dcp_metadata(path)
    except CheckpointError:
        return [f"{path.name}/.metadata"]
    needed: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        needed[info.relative_path] = max(needed.get(info.relative_path, 0),
                                         info.offset + info.length)
    missing = []
    for name, size in sorted(needed.items()):
        try:
            if (path / name).stat().st_size < size:
                missing.append(f"{path.name}/{name} (cut short)")
        except OSError:
            missing.append(f"{path.name}/{name}")
    return missing


def missing_files(path: str | Path, layout: Layout, *, rank_states: bool = True) -> list[str]:
    """The files `layout` implies that `path` lacks (or holds empty: a file cut short).
    `rank_states=False`: the weights only (what an export reads)."""
    path = Path(path)
    wanted = layout.rank_files() if rank_states else []
    missing = missing_model_files(path / MODEL_DIR)
    for name in wanted:
        try:
            if (path / name).stat().st_size == 0:
                missing.append(f"{name} (empty)")
        except OSError:
            missing.append(name)
    return missing


def check_files(path: str | Path, layout: Layout | None = None, *,
                rank_states: bool = True) -> Layout:
    """`read_layout` and `missing_files`; `IncompleteCheckpointError` naming every missing
    file. Returns the layout."""
    layout = layout or read_layout(path)
    missing = missing_files(path, layout, rank_states=rank_states)
    if missing:
        raise IncompleteCheckpointError(
            f"{path} is incomplete: its layout dp{layout.dp} x tp{layout.tp} x pp{layout.pp} "
            f"({Path(path) / MARKER}) implies files it lacks: {', '.join(missing)}")
    return layout


def is_complete(path: Path) -> bool:
    """Whether `path` is a checkpoint to resume from: valid metadata, every file present."""
    try:
        check_files(path)
    except CheckpointError:
        return False
    return True


def missing_model_tensors(path: str | Path, names, layout: Layout | None = None
                          ) -> list[str]:
    """Parameters of ``<path>/config.json``'s model that `names` (the checkpoint's tensor
    names) lacks. A tied group (embeddings and head) needs one of its names; a LoRA
    checkpoint's adapters are not asked for and its ``base_layer`` weights count as the base
    model's. Empty when there is no config or transformers cannot build its class (nothing to
    compare with)."""
    from merak.materialize.conversion import meta_model_for

    path = Path(path)
    if not (path / "config.json").exists():
        return []
    from transformers import AutoConfig

    model = meta_model_for(AutoConfig.from_pretrained(path))
    if model is None:
        return []
    prefix = (layout or read_layout(path)).name_prefix
    have = {n[len(prefix):] if prefix and n.startswith(prefix) else n for n in names}
    have |= {n.replace(".base_layer.", ".") for n in have if ".base_layer." in n}
    groups: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(param), []).append(name)
    return sorted(group[0] for group in groups.values() if not have.intersection(group))


def check_model_tensors(path: str | Path, names, layout: Layout | None = None) -> None:
    """`IncompleteCheckpointError` naming the config's parameters the checkpoint lacks."""
    missing = missing_model_tensors(path, names, layout)
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8
                                          else "")
        raise IncompleteCheckpointError(
            f"{path} is incomplete: {len(missing)} parameters of its config's model "
            f"({Path(path) / 'config.json'}) are not in its weights: {shown} (saved from a "
            f"model without them; parameters the training forward never ran, such as a vision "
            f"tower given text alone, are in no stage)")


def check_trainer_state(state, file: str | Path, step: int) -> dict:
    """The rank state's ``trainer`` entry (what a resume continues from), validated: a
    ``global_step`` that is not the checkpoint's `step` would train from the wrong place
    (from -3, or not at all from 1e9). `CheckpointError` naming the file and the field."""
    if not isinstance(state, dict):
        raise CheckpointError(f"{file}: expected a dict of states, got {type(state).__name__}")
    for key in ("scheduler", "trainer"):
        if not isinstance(state.get(key), dict):
            raise CheckpointError(f"{file}: field {key!r} is " + (
                "missing" if key not in state else f"not a dict ({type(state[key]).__name__})"))
    saved = state["trainer"]
    global_step = saved.get("global_step")
    if isinstance(global_step, bool) or not isinstance(global_step, int) or global_step < 0:
        raise CheckpointError(f"{file}: field 'trainer.global_step' must be an integer >= 0, "
                              f"got {global_step!r}")
    if global_step != step:
        raise CheckpointError(f"{file}: field 'trainer.global_step' is {global_step} but the "
                              f"checkpoint is of step {step} ({MARKER})")
    epoch = saved.get("epoch")  # (None, as HF's TrainerState before its first step)
    if epoch is not None and (isinstance(epoch, bool) or not isinstance(epoch, (int, float))
                              or not epoch >= 0):
        raise CheckpointError(f"{file}: field 'trainer.epoch' must be a number >= 0, got "
                              f"{epoch!r}")
    if not isinstance(saved.get("log_history"), list):
        raise CheckpointError(f"{file}: field 'trainer.log_history' must be a list, got "
                              f"{saved.get('log_history')!r}")
    return saved
