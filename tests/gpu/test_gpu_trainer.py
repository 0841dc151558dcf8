"""One GPU, world size 1, NCCL: MerakTrainer against HF Trainer through the examples' own
scripts (examples/hf_run_clm.py and its HF twin), in bf16 and fp16, and recomputation with
dropout against no recomputation."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"
STEPS = 20
COMMON = [
    "--config_name", str(DATA / "tiny-llama"), "--tokenizer_name", str(DATA / "tokenizer"),
    "--train_file", str(DATA / "train.txt"), "--block_size", "64", "--do_train",
    "--max_steps", str(STEPS), "--learning_rate", "3e-3", "--per_device_train_batch_size", "4",
    "--gradient_accumulation_steps", "2", "--train_sampling_strategy", "sequential",
    "--logging_steps", "1", "--report_to", "none", "--disable_tqdm", "true", "--seed", "1234",
    "--save_strategy", "no",
]


def _losses(output_dir: Path) -> list[float]:
    state = json.loads((output_dir / "trainer_state.json").read_text())
    return [entry["loss"] for entry in state["log_history"] if "loss" in entry]


def _hf(tmp_path: Path, *extra: str) -> list[float]:
    out = tmp_path / "hf"
    subprocess.run([sys.executable, str(ROOT / "examples" / "hf_run_clm_reference.py"),
                    *COMMON, *extra, "--output_dir", str(out)], check=True, cwd=ROOT)
    return _losses(out)


def _merak(tmp_path: Path, name: str, *extra: str) -> list[float]:
    out = tmp_path / name
    env = dict(os.environ, DP="1", TP="1", PP="1")
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                    str(ROOT / "examples" / "hf_run_clm.py"), *COMMON, *extra,
                    "--output_dir", str(out)], check=True, cwd=ROOT, env=env)
    return _losses(out)


@pytest.mark.parametrize("precision,rtol", [("bf16", 3e-2), ("fp16", 1e-2)])
def test_merak_trainer_on_one_gpu_matches_hf_trainer(tmp_path, precision, rtol):
    flag = [f"--{precision}", "true"]
    # fp16: both scalers start at 2^16 (Merak's default is DeepSpeed's initial_scale_power 16)
    # and neither grows within 20 steps (windows of 1000 and 2000); hysteresis 1 makes Merak
    # halve on every overflow as torch.amp.GradScaler does, so both skip the same steps
    scaler = ["--hysteresis", "1"] if precision == "fp16" else []
    reference, merak = _hf(tmp_path, *flag), _merak(tmp_path, "merak", *flag, *scaler)
    assert len(merak) == len(reference) == STEPS
    for step, (a, b) in enumerate(zip(merak, reference)):
        assert abs(a - b) <= rtol * abs(b), f"step {step}: merak {a} vs HF {b} ({precision})"
    assert merak[-1] < merak[0], "the loss did not fall"


def test_recomputation_with_dropout_equals_no_recomputation(tmp_path):
    dropout = ["--config_overrides", "attention_dropout=0.1", "--bf16", "true"]
    plain = _merak(tmp_path, "plain", *dropout)
    recomputed = _merak(tmp_path, "recompute", *dropout, "--activation_checkpointing", "true")
    assert plain == pytest.approx(recomputed, rel=1e-6, abs=0), "recomputation changed the loss"
