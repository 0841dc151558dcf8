"""`merak export <checkpoint> <dir>`: a Merak checkpoint as a plain HF `save_pretrained`
directory (config.json + model.safetensors with whole tensors), loadable by
``AutoModelForCausalLM.from_pretrained(dir)``, whatever (dp, tp, pp) layout it was saved with."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import save_file

from merak.trainer.checkpoint import MARKER, full_tensors


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path) -> Path:
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not (checkpoint / MARKER).exists():
        raise FileNotFoundError(f"{checkpoint} is not a complete Merak checkpoint (no {MARKER})")
    if not (checkpoint / "config.json").exists():
        raise FileNotFoundError(f"{checkpoint} has no config.json (the model had no HF config), "
                                f"so it cannot become an HF directory")
    prefix = json.loads((checkpoint / MARKER).read_text()).get("name_prefix", "")
    tensors = {name[len(prefix):] if prefix and name.startswith(prefix) else name:
               tensor.contiguous() for name, tensor in full_tensors(checkpoint).items()}
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(checkpoint / "config.json", out_dir / "config.json")
    return out_dir
