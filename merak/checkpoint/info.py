"""`merak checkpoint info DIR`: what a checkpoint holds, read from its metadata only (DCP's
``.metadata`` of the weights and the optimizer state, ``merak.json``): no tensor is loaded, no
process group made."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from merak.checkpoint.files import MODEL_DIR, CheckpointError, missing_files, read_layout
from merak.checkpoint.model_state import tensor_shapes
from merak.checkpoint.optimizer_state import OPTIMIZER_DIR


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def describe(path: str | Path) -> str:
    """The report `merak checkpoint info` prints for `path` (a ``checkpoint-<step>``)."""
    path = Path(path)
    lines = [f"{path}"]
    try:
        layout = read_layout(path)
    except CheckpointError as error:
        return f"{path}: not a complete Merak checkpoint: {error}"
    missing = missing_files(path, layout)
    layout_text = f"dp={layout.dp} tp={layout.tp} pp={layout.pp}" + \
        (f" cp={layout.cp}" if layout.cp > 1 else "") + \
        (f", global batch {layout.global_batch} rows" if layout.global_batch else "")
    lines.append(f"  step {layout.step}, saved at {layout_text}; "
                 f"{_size(path) / 2**20:.1f} MiB on disk")
    lines.append("  complete" if not missing else f"  INCOMPLETE: missing {', '.join(missing)}")
    try:
        tensors = {name: (str(dtype).removeprefix("torch."), list(shape))
                   for name, (dtype, shape) in tensor_shapes(path / MODEL_DIR).items()}
    except CheckpointError:
        tensors = {}
    total = sum(_numel(shape) for _, shape in tensors.values())
    dtypes = Counter(dtype for dtype, _ in tensors.values())
    lines.append(f"  weights: {len(tensors)} tensors, {total:,} elements "
                 f"({', '.join(f'{n} {d}' for d, n in dtypes.items())})")
    for key in list(tensors)[:5]:
        lines.append(f"    {key} {tensors[key][0]} {tensors[key][1]}")
    if len(tensors) > 5:
        lines.append(f"    ... and {len(tensors) - 5} more")
    lines += _optimizer_lines(path / OPTIMIZER_DIR)
    return "\n".join(lines)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _optimizer_lines(path: Path) -> list[str]:
    if not path.is_dir():
        return ["  optimizer state: none (saved with no_save_optim or save_only_model)"]
    if not (path / ".metadata").is_file():
        return ["  optimizer state: INCOMPLETE (no .metadata)"]
    from torch.distributed.checkpoint import FileSystemReader

    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    kinds = Counter(key.rsplit(".", 1)[-1] for key in saved)
    params = {key.removeprefix("state.").rsplit(".", 1)[0] for key in saved}
    return [f"  optimizer state: {len(params)} parameters; "
            + ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))]
