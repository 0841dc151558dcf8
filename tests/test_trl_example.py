"""examples/trl_sft.py, examples/trl_dpo.py and examples/trl_reward.py: TRL's SFTTrainer,
DPOTrainer (its DPOConfig's-defaults setup, on a meta-built policy) and RewardTrainer
through Merak on 2 ranks at pp=2 log the losses of the same script's plain single-process TRL
run (``--reference``), on the shipped tiny Llama, tokenizer and text (examples/data); the reward
model's export, loaded by HF's AutoModelForSequenceClassification, scores held-out pairs as
plain TRL's trained model does."""

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
# run -> (script, its arguments); DPO in its `defaults` setup (the policy saved, then loaded on
# the meta device; TRL's reference: a copy loaded from the same directory)
RUNS = {"sft": ("trl_sft.py", ["--learning_rate", "3e-3", "--rows", "64"]),
        "dpo-defaults": ("trl_dpo.py", ["--setup", "defaults", "--learning_rate", "1e-2",
                                        "--rows", "32"]),
        "reward": ("trl_reward.py", ["--learning_rate", "1e-3", "--rows", "32"])}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _losses(out: Path) -> list[float]:
    state = json.loads((out / "trainer_state.json").read_text())
    return [h["loss"] for h in state["log_history"] if "loss" in h]


def _run_both(tmp_path: Path, script: str, args: list[str]) -> tuple[Path, Path]:
    """The script under torchrun (dp1 x tp1 x pp2) and with --reference: their output dirs."""
    args = [*ARGS, *args]
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
    return tmp_path / "merak", tmp_path / "trl"


@pytest.mark.parametrize("run", list(RUNS))
def test_the_example_logs_plain_trls_losses(tmp_path, run):
    ours_dir, theirs_dir = _run_both(tmp_path, *RUNS[run])
    ours, theirs = _losses(ours_dir), _losses(theirs_dir)
    print(f"{run}: merak {ours} trl {theirs}")
    assert len(ours) == len(theirs) == 3
    assert ours == pytest.approx(theirs, abs=2e-4)  # both log 4 digits
    assert theirs[0] != theirs[-1]  # it trained: the check can fail
    assert (ours_dir / "model.safetensors").exists()  # save_model: the HF directory
    if run == "reward":  # each export, loaded by HF's own class, scores the held-out pairs
        ours, theirs = (json.loads((d / "scores.json").read_text())
                        for d in (ours_dir, theirs_dir))
        print(f"reward scores: merak {ours} trl {theirs}")
        for column in ("chosen", "rejected"):
            assert len(ours[column]) == len(theirs[column]) == 8
            assert ours[column] == pytest.approx(theirs[column], rel=1e-4, abs=1e-5), column
        assert len(set(ours["chosen"])) > 1  # rows of different rewards: the check can fail
