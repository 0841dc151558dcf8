"""A checkpoint resumed in another layout continues the run exactly: weights AND optimizer state
are resharded (the optimizer's on torch.distributed.checkpoint, `merak.checkpoint.
optimizer_state`). Pooled worker `workers/optim_reshard.py` (4 ranks): a 4-layer Llama trained
with AdamW at (dp, tp, pp) = (1, 2, 2) saves step 3; resumed at (1,1,4), (2,2,1) under ZeRO-3,
(4,1,1) under ZeRO-1 and (2,1,2) under interleaved 1F1B, steps 4-6 (loss,
grad norm, learning rate) equal the uninterrupted run's and single-process HF Trainer's; and in
one process, the boxes a rank's part of a tensor is described by."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from dist_harness import check
from optim_reshard import RESUMES, SAVED, SOURCE, fields
from trainer_common import DP, MICRO_BATCH, build, fine_tuning_set

WORKER = "optim_reshard.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (4,)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """Single-process HF Trainer on the same rows, init and fields, uninterrupted."""
    torch.set_num_threads(1)
    args = tf.TrainingArguments(output_dir=str(tmp_path_factory.mktemp("reshard-reference")),
                                per_device_train_batch_size=MICRO_BATCH * DP,
                                save_strategy="no", **fields())
    trainer = tf.Trainer(model=build("llama-deep"), args=args, train_dataset=fine_tuning_set())
    trainer.train()
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


def _steps(worker_pool, name: str) -> dict[int, dict]:
    found = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{name}.json").read_text())
    return {step: {"loss": loss, "grad_norm": norm, "learning_rate": rate}
            for step, loss, norm, rate in zip(found["step"], found["loss"], found["grad_norm"],
                                               found["learning_rate"])}


@pytest.mark.parametrize("scenario", list(RESUMES))
def test_a_resume_in_another_layout_continues_the_run(launches, worker_pool, reference,
                                                      scenario):
    check(*launches(4), SOURCE)
    check(*launches(4), scenario)
    uninterrupted, resumed = _steps(worker_pool, SOURCE), _steps(worker_pool, scenario)
    for step in range(1, 7):  # the uninterrupted Merak run is HF Trainer's
        for key in ("loss", "grad_norm", "learning_rate"):
            assert uninterrupted[step][key] == pytest.approx(reference[step][key], rel=1e-5,
                                                             abs=1e-7), (step, key)
    for step in range(SAVED + 1, 7):  # and so is the resumed one, step by step
        for key in ("loss", "grad_norm", "learning_rate"):
            assert resumed[step][key] == pytest.approx(uninterrupted[step][key], rel=1e-5,
                                                       abs=1e-7), (scenario, step, key)


def test_a_ranks_part_is_described_as_boxes_of_the_whole_tensor():
    """q, k and v fused in one weight, cut over tp=2 per part: rank 1 holds the second half of
    each part, three boxes of the whole tensor, and they tile it with rank 0's."""
    from merak.checkpoint.sharded import Pieces, boxes, pieces_of
    from merak.tensor_parallel.layers import ShardSpec

    whole = torch.arange(12 * 3.0).reshape(12, 3)
    covered = torch.zeros(12, 3)
    for rank in range(2):
        spec = ShardSpec(dim=0, rank=rank, size=2, chunks=(4, 4, 4), full_shape=(12, 3))
        local = spec.take(whole)
        shape, found = boxes(local, spec)
        assert shape == (12, 3) and len(found) == 3
        pieces = pieces_of(local, spec)
        assert isinstance(pieces, Pieces)
        for box in found:
            rows = slice(box.offsets[0], box.offsets[0] + box.sizes[0])
            index = type("I", (), {"offset": torch.Size(box.offsets), "fqn": "w"})()
            assert torch.equal(pieces.__get_tensor_shard__(index), whole[rows])
            covered[rows] += 1
    assert torch.equal(covered, torch.ones(12, 3))
    plain = torch.ones(4, 3)
    assert pieces_of(plain) is not None and boxes(plain)[1][0].offsets == (0, 0)


def test_merak_checkpoint_info_reads_the_metadata(launches, worker_pool, tmp_path, capsys):
    import shutil

    from merak.cli import main

    check(*launches(4), SOURCE)
    saved = worker_pool.out_dir(WORKER, 4) / SOURCE / f"checkpoint-{SAVED}"
    assert main(["checkpoint", "info", str(saved)]) == 0
    out = capsys.readouterr().out
    assert "step 3, saved at dp=1 tp=2 pp=2" in out and "complete" in out
    assert "model.embed_tokens.weight F32 [128, 64]" in out  # the whole tensor's shape
    assert "optimizer state: 39 parameters; exp_avg x39, exp_avg_sq x39, step x39" in out
    broken = tmp_path / "checkpoint-3"
    shutil.copytree(saved, broken)
    (broken / "model-pp1-tp0.safetensors").unlink()
    assert main(["checkpoint", "info", str(broken)]) == 1
    assert "INCOMPLETE: missing model-pp1-tp0.safetensors" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["AdamW", "Adafactor"])
def test_optimizer_state_round_trips_in_one_process(tmp_path, kind):
    """AdamW's moments (shaped like their parameters: boxes of the whole tensor) and
    Adafactor's factored ones (shaped otherwise: kept per rank) come back exactly."""
    from torch import nn

    from merak.checkpoint.optimizer_state import load_optimizer_state, save_optimizer_state

    def trained():
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
        optimizer = getattr(torch.optim, kind)(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(5, 4)).square().sum().backward()
            optimizer.step()
            optimizer.zero_grad()
        return model, optimizer

    model, optimizer = trained()
    save_optimizer_state(tmp_path / "optimizer", optimizer, model)
    torch.manual_seed(1)
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    fresh.load_state_dict(model.state_dict())
    other = getattr(torch.optim, kind)(fresh.parameters(), lr=0.1)
    load_optimizer_state(tmp_path / "optimizer", other, fresh)
    assert torch.equal(fresh[0].weight, model[0].weight)  # the zero-lr step changed nothing
    for mine, theirs in zip(fresh.parameters(), model.parameters()):
        saved, loaded = optimizer.state[theirs], other.state[mine]
        assert set(saved) == set(loaded)
        for key, value in saved.items():
            assert torch.equal(loaded[key], value), (kind, key)
