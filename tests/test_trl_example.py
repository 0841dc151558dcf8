"""examples/trl_sft.py and examples/trl_dpo.py: TRL's SFTTrainer and DPOTrainer through Merak
(the two classes of docs/trainer.md) on 2 ranks at pp=2 log the losses of the same script's plain
single-process TRL run (``--reference``), on the shipped tiny Llama, tokenizer and text
(examples/data)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["--max_steps", "3", "--per_device_train_batch_size", "4",
        "--gradient_accumulation_steps", "2", "--max_length", "48", "--logging_steps", "1",
        "--use_cpu", "--report_to", "none", "--bf16", "false", "--save_strategy", "no",
        "--disable_tqdm", "true"]
SCRIPTS = {"trl_sft.py": ["--learning_rate", "3e-3", "--rows", "64"],
           "trl_dpo.py": ["--learning_rate", "1e-2", "--rows", "32"]}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _losses(out: Path) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


@pytest.mark.parametrize("script", list(SCRIPTS))
def test_the_example_logs_plain_trls_losses(tmp_path, script):
    args = [*ARGS, *SCRIPTS[script]]
    script = ROOT / "examples" / script
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", DP="1", TP="1", PP="2")
    merak = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         f"--master_port={_free_port()}", str(script), *args, "--output_dir",
         str(tmp_path / "merak")], env=env, capture_output=True, text=True, timeout=600)
    assert merak.returncode == 0, merak.stdout[-3000:] + merak.stderr[-3000:]
    reference = subprocess.run(
        [sys.executable, str(script), "--reference", *args, "--output_dir",
         str(tmp_path / "trl")], env=env, capture_output=True, text=True, timeout=600)
    assert reference.returncode == 0, reference.stdout[-3000:] + reference.stderr[-3000:]
    ours, theirs = _losses(tmp_path / "merak"), _losses(tmp_path / "trl")
    assert len(ours) == len(theirs) == 3
    assert ours == pytest.approx(theirs, abs=2e-4)  # both log 4 digits
    assert (tmp_path / "merak" / "model.safetensors").exists()  # save_model: the HF directory
