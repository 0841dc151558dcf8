"""examples/hf_run_clm.py: HF's run_clm flow trained by MerakTrainer, differing from
the plain HF Trainer script (examples/hf_run_clm_reference.py) only by lines naming merak.

One launch: the Merak script on 4 ranks at dp=1 x tp=2 x pp=2 and the HF script in one process
with the same arguments (dp=1: the same global batch), on the shipped tiny Llama, tokenizer and
text (examples/data)."""

from __future__ import annotations

import difflib
import json
import math
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
DATA = EXAMPLES / "data"
MERAK_SCRIPT, HF_SCRIPT = EXAMPLES / "hf_run_clm.py", EXAMPLES / "hf_run_clm_reference.py"
BLOCK, EVAL_SAMPLES, EVAL_BATCH = 32, 10, 4  # 10 blocks: the last eval batch is a partial one
ARGS = ["--config_name", DATA / "tiny-llama", "--tokenizer_name", DATA / "tokenizer",
        "--train_file", DATA / "train.txt", "--validation_file", DATA / "validation.txt",
        "--block_size", BLOCK, "--max_eval_samples", EVAL_SAMPLES,
        "--do_train", "--do_eval", "--max_steps", 4, "--learning_rate", 3e-3,
        "--per_device_train_batch_size", 2, "--gradient_accumulation_steps", 2,
        "--per_device_eval_batch_size", EVAL_BATCH, "--train_sampling_strategy", "sequential",
        "--eval_strategy", "steps", "--eval_steps", 2, "--save_strategy", "steps",
        "--save_steps", 2, "--save_total_limit", 1, "--load_best_model_at_end",
        # the best checkpoint is the one of the *highest* eval loss, the first (the loss falls):
        # loading it back at the end changes the final evaluation, so the test sees it happen
        "--metric_for_best_model", "loss", "--greater_is_better", "true",
        "--logging_steps", 1, "--seed", 3, "--use_cpu", "--report_to", "none",
        "--disable_tqdm", "true"]


def _diff() -> tuple[list[str], list[str], int]:
    """unified_diff of the HF script -> the Merak script: the lines only in the Merak script
    ('+'), those only in the HF script ('-'; the '+++'/'---' headers excluded), and the lines
    that differ as a reader counts them (per hunk, max(added, removed): a replaced line once)."""
    diff = list(difflib.unified_diff(HF_SCRIPT.read_text().splitlines(),
                                     MERAK_SCRIPT.read_text().splitlines(), lineterm="", n=0))
    added = [line[1:] for line in diff if line.startswith("+") and not line.startswith("+++")]
    removed = [line[1:] for line in diff if line.startswith("-") and not line.startswith("---")]
    differing, plus, minus = 0, 0, 0
    for line in diff + ["@@"]:
        if line.startswith("@@"):
            differing, plus, minus = differing + max(plus, minus), 0, 0
        elif line.startswith("+") and not line.startswith("+++"):
            plus += 1
        elif line.startswith("-") and not line.startswith("---"):
            minus += 1
    return added, removed, differing


def test_merak_script_is_the_hf_script_plus_five_merak_lines():
    added, removed, differing = _diff()
    # 5 lines differ: 3 added (import merak, merak.init, @merak.init_empty_weights()) and 2
    # replaced (TrainingArguments -> merak.MerakArguments, Trainer -> merak.MerakTrainer), so
    # unified_diff shows 5 '+' and 2 '-' lines (7 in all)
    assert differing <= 5, (added, removed)
    assert len(added) <= 5 and len(added) + len(removed) <= 7, (added, removed)
    assert all(re.search("merak", line, re.IGNORECASE) for line in added), added
    # what the Merak lines replace: HF's TrainingArguments and Trainer, nothing else
    assert all(re.search(r"transformers\.(Trainer|TrainingArguments)\b", line)
               for line in removed), removed


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf_run_clm")
    args = [str(a) for a in ARGS]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
               HF_DATASETS_OFFLINE="1", HF_DATASETS_CACHE=str(out / "datasets-cache"))
    merak = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4",
         f"--master_port={_free_port()}", str(MERAK_SCRIPT), *args,
         "--output_dir", str(out / "merak")],
        env=dict(env, DP="1", TP="2", PP="2"), capture_output=True, text=True, timeout=600,
        check=False, cwd=ROOT)
    assert merak.returncode == 0, (merak.stdout + merak.stderr)[-6000:]
    hf = subprocess.run([sys.executable, str(HF_SCRIPT), *args, "--output_dir", str(out / "hf")],
                        env=env, capture_output=True, text=True, timeout=600, check=False,
                        cwd=ROOT)
    assert hf.returncode == 0, (hf.stdout + hf.stderr)[-6000:]
    return out, merak.stdout + merak.stderr


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


def test_trains_evaluates_and_reports_perplexity(runs):
    out, output = runs
    results = _json(out / "merak" / "eval_results.json")
    assert results["perplexity"] == pytest.approx(math.exp(results["eval_loss"]), rel=1e-12)
    assert results["eval_samples"] == EVAL_SAMPLES and 0.0 <= results["eval_accuracy"] <= 1.0
    every = _json(out / "merak" / "all_results.json")
    assert every["eval_loss"] == results["eval_loss"] and "train_loss" in every
    assert output.count("***** eval metrics *****") == 1  # printed once, by rank 0
    assert re.search(r"perplexity\s+=\s+[\d.]+", output) and re.search(r"eval_loss\s+=", output)
    assert (out / "merak" / "README.md").exists()  # create_model_card


def test_matches_the_hf_trainer_script(runs):
    """Same data, init and global batch: the same losses, evaluations and best checkpoint."""
    out, _ = runs
    ours, theirs = (_json(out / run / "all_results.json") for run in ("merak", "hf"))
    for key in ("train_loss", "eval_loss", "perplexity"):
        assert ours[key] == pytest.approx(theirs[key], rel=1e-4), key
    assert ours["eval_accuracy"] == pytest.approx(theirs["eval_accuracy"], abs=0.01)
    ours, theirs = (_json(out / run / "trainer_state.json") for run in ("merak", "hf"))
    for state in (ours, theirs):
        state["evals"] = [(h["step"], h["eval_loss"]) for h in state["log_history"]
                          if "eval_loss" in h]
    assert [s for s, _ in ours["evals"]] == [s for s, _ in theirs["evals"]] == [2, 4]
    assert [v for _, v in ours["evals"]] == pytest.approx([v for _, v in theirs["evals"]],
                                                          rel=1e-4)
    assert ours["evals"][0][1] > ours["evals"][1][1]  # the loss fell: step 2 is the "best"
    assert ours["best_global_step"] == theirs["best_global_step"] == 2
    assert Path(ours["best_model_checkpoint"]).name == "checkpoint-2"
    # save_total_limit=1 with load_best_model_at_end: only the best checkpoint is left
    for run in ("merak", "hf"):
        assert sorted(p.name for p in (out / run).glob("checkpoint-*")) == ["checkpoint-2"], run
    # load_best_model_at_end: the final evaluation is that of the best checkpoint's weights
    best = dict(ours["evals"])[2]
    assert _json(out / "merak" / "eval_results.json")["eval_loss"] == pytest.approx(best,
                                                                                    rel=1e-6)


def test_saved_model_loads_in_hf_and_gives_the_reported_eval_loss(runs):
    """save_model's directory, loaded by plain transformers in this process, scores the
    evaluation blocks (the first EVAL_SAMPLES blocks of validation.txt, batches of EVAL_BATCH,
    HF's per-sample mean of the batch losses) at the eval_loss the run reported."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, _ = runs
    model = AutoModelForCausalLM.from_pretrained(out / "merak").eval()
    tokenizer = AutoTokenizer.from_pretrained(out / "merak")
    lines = (DATA / "validation.txt").read_text().splitlines(keepends=True)  # keep_linebreaks
    ids = [i for line in lines for i in tokenizer(line)["input_ids"]]
    blocks = torch.tensor(ids[:EVAL_SAMPLES * BLOCK]).view(EVAL_SAMPLES, BLOCK)
    total = 0.0
    with torch.no_grad():
        for batch in blocks.split(EVAL_BATCH):
            total += model(input_ids=batch, labels=batch).loss.item() * len(batch)
    reported = _json(out / "merak" / "eval_results.json")["eval_loss"]
    assert total / EVAL_SAMPLES == pytest.approx(reported, rel=1e-5)
