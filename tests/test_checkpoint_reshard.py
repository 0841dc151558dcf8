"""A checkpoint resumed in another layout continues the run exactly: weights AND optimizer state
are resharded (the optimizer's on torch.distributed.checkpoint, `merak.checkpoint.
optimizer_state`). Pooled worker `workers/optim_reshard.py` (4 ranks): a 4-layer Llama trained
with AdamW at (dp, tp, pp) = (1, 2, 2) saves step 3 in the background; resumed at (1,1,4),
(2,2,1) under ZeRO-3 (keeping the global batch with fewer micro-batches), (4,1,1) under ZeRO-1
and (2,1,2) under interleaved 1F1B, steps 4-6 (loss, grad norm, learning rate) equal the
uninterrupted run's and single-process HF Trainer's, as do a Mixtral's loaded from its
save_pretrained checkpoint, saved at (1,2,2), resumed at (1,1,4). In one process: the boxes a
rank's part of a tensor is described by, a background save writing its step's values while the
next step changes them, and a resume that cannot keep the global batch."""

from __future__ import annotations

import json

import pytest
import torch
import transformers as tf
from dist_harness import check
from optim_reshard import MOE_RESUME, MOE_SOURCE, RESUMES, SAVED, SOURCE, fields
from trainer_common import DP, MICRO_BATCH, build, fine_tuning_set

WORKER = "optim_reshard.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (4,)


def _hf_run(tmp_path_factory, family: str) -> dict[int, dict]:
    """Single-process HF Trainer on the same rows, init and fields, uninterrupted."""
    torch.set_num_threads(1)
    args = tf.TrainingArguments(output_dir=str(tmp_path_factory.mktemp("reshard-reference")),
                                per_device_train_batch_size=MICRO_BATCH * DP,
                                save_strategy="no", **fields())
    trainer = tf.Trainer(model=build(family), args=args, train_dataset=fine_tuning_set())
    trainer.train()
    return {h["step"]: h for h in trainer.state.log_history if "loss" in h}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _hf_run(tmp_path_factory, "llama-deep")


def _steps(worker_pool, name: str) -> dict[int, dict]:
    found = json.loads((worker_pool.out_dir(WORKER, 4) / f"merak-{name}.json").read_text())
    return {step: {"loss": loss, "grad_norm": norm, "learning_rate": rate}
            for step, loss, norm, rate in zip(found["step"], found["loss"], found["grad_norm"],
                                               found["learning_rate"])}


@pytest.mark.parametrize("scenario", [*RESUMES, MOE_RESUME])
def test_a_resume_in_another_layout_continues_the_run(launches, worker_pool, tmp_path_factory,
                                                      reference, scenario):
    source = MOE_SOURCE if scenario == MOE_RESUME else SOURCE
    if scenario == MOE_RESUME:  # (its Hub checkpoint holds build("mixtral-deep")'s weights)
        reference = _hf_run(tmp_path_factory, "mixtral-deep")
    check(*launches(4), source)
    check(*launches(4), scenario)
    uninterrupted, resumed = _steps(worker_pool, source), _steps(worker_pool, scenario)
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
    from merak.tensor_parallel.layers.megatron import ShardSpec

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
    assert "step 3, saved at dp=1 tp=2 pp=2, global batch 8 rows" in out and "complete" in out
    assert "model.embed_tokens.weight float32 [128, 64]" in out  # the whole tensor's shape
    assert "optimizer state: 39 parameters; exp_avg x39, exp_avg_sq x39, step x39" in out
    broken = tmp_path / "checkpoint-3"
    shutil.copytree(saved, broken)
    parts = [f for f in (broken / "model").glob("*.distcp") if f.stat().st_size]
    assert len(parts) > 1  # (the ranks share the writing)
    lost = max(parts, key=lambda f: f.stat().st_size)
    lost.unlink()
    assert main(["checkpoint", "info", str(broken)]) == 1
    assert f"INCOMPLETE: missing model/{lost.name}" in capsys.readouterr().out


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


def test_a_background_save_writes_its_steps_values_while_the_next_step_runs(tmp_path,
                                                                             monkeypatch):
    """`save_async`: the save is staged when it is called; the writer thread, held here until
    the next optimizer step has changed the weights and moments in place, writes the saved
    step's values, and the checkpoint is published only once written."""
    import threading
    from types import SimpleNamespace

    from torch import nn

    from merak.checkpoint import io as checkpoint
    from merak.checkpoint.background import BackgroundSaves

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(5, 4)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    step()
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    moments = {n: optimizer.state[p]["exp_avg"].clone() for n, p in model.named_parameters()}
    ctx = SimpleNamespace(rank=0, dp_rank=0, cp_rank=0, pp_rank=0, tp_rank=0,
                          dp=1, tp=1, pp=1, cp=1)
    release, real = threading.Event(), checkpoint.write_rank_files

    def held(*args):
        assert release.wait(30), "the test never released the writer"
        real(*args)

    monkeypatch.setattr(checkpoint, "write_rank_files", held)
    saves = BackgroundSaves()
    adapter = []  # what rank 0 writes before the marker (a LoRA adapter): on this thread

    def write_adapter(partial):
        adapter.append(threading.current_thread() is threading.main_thread())
        (partial / "adapter.txt").write_text(str(float(model[0].weight.sum())))

    path = checkpoint.save_checkpoint(tmp_path, 1, ctx, model, {"trainer": {"global_step": 1}},
                                      optimizer=optimizer, background=saves,
                                      before_marker=write_adapter)
    assert saves.busy and not path.exists()  # staged; written and published later
    assert adapter == [True]
    step()  # in place: parameters and AdamW's moments
    assert not torch.equal(model[0].weight, weights["0.weight"])
    release.set()
    saves.wait()
    assert checkpoint.complete_checkpoints(tmp_path) == [path]
    assert (path / "adapter.txt").read_text() == str(float(weights["0.weight"].sum()))
    written = checkpoint.full_tensors(path, set(weights))
    assert all(torch.equal(written[n], w) for n, w in weights.items())
    fresh = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 2))
    other = torch.optim.AdamW(fresh.parameters(), lr=0.1)
    checkpoint.load_optimizer_state(path / checkpoint.OPTIMIZER_DIR, other, fresh)
    for name, param in fresh.named_parameters():
        assert torch.equal(other.state[param]["exp_avg"], moments[name]), name


def test_a_failed_background_save_is_raised_by_the_next_wait(tmp_path, monkeypatch):
    from types import SimpleNamespace

    from torch import nn

    from merak.checkpoint import io as checkpoint
    from merak.checkpoint.background import BackgroundSaves

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(checkpoint, "write_rank_files", full_disk)
    ctx = SimpleNamespace(rank=0, dp_rank=0, cp_rank=0, pp_rank=0, tp_rank=0,
                          dp=1, tp=1, pp=1, cp=1)
    saves = BackgroundSaves()
    checkpoint.save_checkpoint(tmp_path, 2, ctx, nn.Linear(2, 2), {}, background=saves)
    with pytest.raises(RuntimeError, match="background save of checkpoint-2 failed: OSError"):
        saves.wait()
    with pytest.warns(UserWarning, match="half-written"):  # the .partial it left
        assert checkpoint.complete_checkpoints(tmp_path) == []
    saves.wait()  # reported once


def test_a_resume_that_cannot_keep_the_global_batch_says_how_to(tmp_path):
    """A checkpoint trained with 6 rows per step, resumed by a job making 4 rows per
    micro-batch step: refused before anything is built, naming both and the fixes."""
    import json

    from checkpoint_fixtures import config, save

    import merak

    saved = save(tmp_path, 3, 1)
    marker = saved / "merak.json"
    marker.write_text(json.dumps({**json.loads(marker.read_text()), "global_batch": 6}))
    merak.init()
    with merak.init_empty_weights():
        model = tf.LlamaForCausalLM(config())
    args = merak.MerakArguments(output_dir=str(tmp_path), per_device_train_batch_size=4,
                                max_steps=4, use_cpu=True, report_to="none")
    trainer = merak.MerakTrainer(model=model, args=args, train_dataset=fine_tuning_set())
    with pytest.raises(ValueError, match=r"global batch of 6 rows.*dp=1 x per_device_train_"
                                         r"batch_size=4 = 4 rows.*finetune=True"):
        trainer.train(resume_from_checkpoint=True)
    assert trainer.engine is None
