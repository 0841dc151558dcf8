"""Inputs checked before anything is built: the datasets MerakTrainer is given (one process),
and the numbers and files of the command lines (exit status 2 with a one-line reason)."""

from __future__ import annotations

import json
import re

import pytest
import sft_common as sft
import torch

import merak
from merak.cli import main as merak_main


def _rows(n: int) -> list[dict]:
    return [{"input_ids": torch.arange(8), "labels": torch.arange(8)} for _ in range(n)]


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(_rows(8))


@pytest.fixture(scope="module")
def trainer_of():
    merak.init(dp=1, tp=1, pp=1)
    with merak.init_empty_weights():
        model = sft.model()

    def make(train, evaluation=None, **fields):
        args = merak.MerakArguments(output_dir="out", use_cpu=True, report_to="none",
                                    max_steps=1, **fields)
        return merak.MerakTrainer(model=model, args=args, train_dataset=train,
                                  eval_dataset=evaluation)
    return make


def test_datasets_are_checked_before_anything_is_built(trainer_of):
    with pytest.raises(ValueError, match="train_dataset is empty"):
        trainer_of([])
    with pytest.raises(merak.NotSupportedYetError,
                       match=r"train_dataset is an iterable dataset \(_Stream, no len\(\)\)"):
        trainer_of(_Stream())
    with pytest.raises(ValueError, match=r"eval_dataset\['b'\] is empty"):
        trainer_of(_rows(4), {"a": _rows(2), "b": []})
    small = trainer_of(_rows(5), per_device_train_batch_size=3, gradient_accumulation_steps=2)
    with pytest.raises(ValueError, match=r"has 5 items, fewer than one global batch: "
                                         r"per_device_train_batch_size 3 x "
                                         r"gradient_accumulation_steps 2 x dp 1 = 6"):
        small.train()  # (a trainer made only to evaluate may hold fewer)
    assert small.engine is None  # nothing was built
    with pytest.raises(ValueError, match="evaluation dataset is empty"):
        small.evaluate([])
    with pytest.raises(ValueError, match="activation_checkpoint_ratio has 3 values for 1"):
        trainer_of(_rows(4), activation_checkpointing=True,
                   activation_checkpoint_ratio=[0.5, 0.5, 0.5])


@pytest.mark.parametrize("argv,reason", [
    (["simulate", "--stages", "4", "--microbatches", "8", "--forward-cost", "-1"],
     "argument --forward-cost: must be finite numbers >= 0"),
    (["simulate", "--stages", "4", "--microbatches", "8", "--backward-cost", "nan"],
     "argument --backward-cost: must be finite"),
    (["simulate", "--stages", "4", "--microbatches", "8", "--recompute-cost", "inf"],
     "argument --recompute-cost: must be finite"),
    (["simulate", "--stages", "0", "--microbatches", "8"], "argument --stages: must be an int"),
    (["simulate", "--stages", "1000", "--microbatches", "1000"],
     "= 1,000,000 is more than the 16,384"),
    (["simulate", "--stages", "4", "--microbatches", "8", "--forward-cost", "1,2"],
     "--forward-cost has 2 values for 4 stages"),
    (["plan", "--model", "{cfg}", "--global-batch", "8", "--seq-len", "-5", "--cluster", "h100"],
     "argument --seq-len: must be an integer >= 1, got '-5'"),
    (["plan", "--model", "{cfg}", "--global-batch", "8", "--seq-len", "8", "--cluster", "h100",
      "--world-size", "0"], "argument --world-size/--gpus: must be an integer >= 1, got '0'"),
    (["plan", "--model", "{cfg}", "--global-batch", "8", "--seq-len", "8", "--cluster",
      "{tmp}/bad.json"], "the cluster file .*bad.json is not JSON: Expecting"),
    (["plan", "--model", "{cfg}", "--global-batch", "8", "--seq-len", "8", "--cluster",
      "{tmp}/nan.json"], "Cluster.peak_flops must be a finite number > 0"),
    (["plan", "--model", "{tmp}/missing", "--global-batch", "8", "--seq-len", "8", "--cluster",
      "h100"], "--model .*missing: no HF config there"),
    (["plan", "--model", "{cfg}", "--global-batch", "8", "--seq-len", "8", "--cluster", "h100",
      "--micro-batch-sizes", "1,0"], "argument --micro-batch-sizes: must be integers >= 1"),
    (["energy", "plan", "p.csv", "--stages", "-2", "--microbatches", "4"],
     "argument --stages: must be an integer >= 1"),
    (["energy", "serve", "--plan", "{tmp}/bad.json"], "is not JSON|cannot read the energy plan"),
    (["energy", "serve", "--plan", "{tmp}/plan.json", "--port", "70000"],
     "argument --port: must be a TCP port"),
    (["energy", "report", "{tmp}/missing.csv"], "missing.csv"),
])
def test_command_lines_refuse_bad_numbers_and_files_with_status_2(argv, reason, tmp_path,
                                                                  capsys, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    sft.model().config.save_pretrained(tmp_path / "cfg")
    (tmp_path / "bad.json").write_text('{"world_size": 4,')
    (tmp_path / "nan.json").write_text(json.dumps({
        "world_size": 4, "gpus_per_node": 4, "peak_flops": float("nan"), "memory_bytes": 1e9,
        "intra_bw": 1e9, "inter_bw": 1e9}))
    argv = [a.format(cfg=tmp_path / "cfg", tmp=tmp_path) for a in argv]
    try:
        status = merak_main(argv)
    except SystemExit as stop:  # argparse's refusal
        status = stop.code
    err = capsys.readouterr().err.strip()
    assert status == 2, err
    assert len(err.splitlines()) == 1, err
    assert err.startswith("merak ") and ": error: " in err, err
    assert re.search(reason, err), err
