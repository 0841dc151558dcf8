"""What the planner and the batch-size probe hold in memory while they measure (on a
GPU these ran out of memory, or leaked memory outside the caching allocator, where a CPU run
saw nothing wrong): one block-cost probe alive at a time and no full-vocabulary logits outside
the head's own probe; dry runs that leave no process group behind; the batch-size probe that
counts the optimizer state the first step will allocate."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers as tf
from dist_harness import scenario_result

from merak.strategy import costs

WORKER, WORLD_SIZES = "plan_dry_runs.py", (2,)  # pooled: launches(world_size), see conftest.py
VOCAB = 101  # no other width of the tiny model's outputs is this


def tiny_llama() -> tf.LlamaConfig:
    return tf.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=160,
                          num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2)


def test_block_cost_probes_are_built_one_at_a_time_and_only_the_head_probe_has_logits(
        monkeypatch):
    monkeypatch.setattr(costs, "MIN_SAMPLE_S", 0.0)
    built, alive_at_build, vocab_wide = [], [], []
    init = costs._Probe.__init__

    def tracked(self, config, layers, *args, **kwargs):
        gc.collect()
        alive_at_build.append(sum(ref() is not None for ref in built))
        init(self, config, layers, *args, **kwargs)
        built.append(weakref.ref(self.model))
        kind = (layers, bool(kwargs.get("with_head")))

        def record(module, inputs, output):
            if isinstance(output, torch.Tensor) and output.shape[-1] == VOCAB:
                vocab_wide.append(kind)
        for module in self.model.modules():
            module.register_forward_hook(record)

    monkeypatch.setattr(costs._Probe, "__init__", tracked)
    measured = costs.measure_costs(tiny_llama(), 2, 8, torch.device("cpu"), repeats=1)
    gc.collect()
    assert len(built) == 3 and alive_at_build == [0, 0, 0], alive_at_build
    assert all(ref() is None for ref in built), "a probe model outlived measure_costs"
    assert vocab_wide and set(vocab_wide) == {(1, True)}, set(vocab_wide)
    assert measured.activation_bytes > 0 and measured.head_activation_bytes > 0
    assert measured.optimizer_s_per_param > 0


def _figures(launches, scenario: str) -> list[dict]:
    figures = scenario_result(*launches(2), scenario)
    assert len(figures) == 2 and all(figures), figures
    return figures


def test_the_dry_run_and_the_trainer_build_one_engine_from_one_options_object(launches):
    """The planner measures the engine the trainer runs (MerakTrainer's engine options,
    unchanged by the dry run): the same step losses, and it learned."""
    for rank, ours in enumerate(_figures(launches, "dry-run-trains-as-the-trainer")):
        assert ours["same_options"] and ours["options_unchanged"], f"rank {rank}"
        trained, measured = ours["trainer_losses"], ours["dry_run_losses"]
        assert len(trained) == len(measured) == 4, (trained, measured)
        torch.testing.assert_close(torch.tensor(measured), torch.tensor(trained),
                                   rtol=1e-5, atol=1e-6)
        assert trained[-1] < trained[0], trained


def test_dry_runs_leave_no_process_group_behind(launches):
    for rank, ours in enumerate(_figures(launches, "dry-runs-free-their-groups")):
        before = ours["groups_before"]
        assert [label for label, *_ in ours["measured"]] == [
            "dp1 tp1 pp2 mb1x2 1f1b rc:off zero0", "dp2 tp1 pp1 mb1x2 1f1b rc:off zero1",
            "dp1 tp2 pp1 mb1x2 1f1b rc:off zero0"], ours["measured"]
        assert all(step_s > 0 and peak > 0 for _, step_s, peak in ours["measured"]), ours
        assert all(n > before for n in ours["groups_inside"]), ours  # each run made groups
        assert ours["groups_after"] == [before] * 3, f"rank {rank}: {ours}"
        assert ours["default_context_kept"], f"rank {rank}"


def test_an_online_plan_leaves_the_same_groups_whatever_its_number_of_dry_runs(launches):
    for rank, ours in enumerate(_figures(launches, "online-plan-frees-its-groups")):
        assert ours["measured"] == ours["dry_runs"], f"rank {rank}: {ours}"
        left = ours["groups_left"]  # only the final default layout's groups, whatever count
        assert left[0] == left[1], f"rank {rank}: {ours}"


def test_online_plans_search_context_parallelism_and_its_dry_runs_train_like_cp1(launches):
    """cp in the online planner; a cp=2 dry run's losses are a pp=2 dry run's."""
    for ours in _figures(launches, "online-plan-dry-runs-cp"):
        losses = ours["losses"]
        assert len(losses) == 3, losses
        first, *others = losses.values()
        for other in others:
            torch.testing.assert_close(torch.tensor(other), torch.tensor(first), rtol=1e-5,
                                       atol=1e-6, msg=lambda text, at=losses: f"{at}: {text}")
        assert 2 in ours["searched_cp"], ours
        measured = ours["only_cp_measured"]
        assert len(measured) == 2 and all(" cp2:" in label and seconds > 0
                                          for label, seconds in measured.items()), measured
        assert ours["only_cp_chosen_cp"] == 2, ours


def test_online_plans_dry_run_expert_parallel_layouts_like_ep1_and_free_their_groups(
        launches):
    """ep in the online planner (what auto_parallel runs): a dp2 ep2 dry run of an MoE model
    steps the losses of dp2 ep1 on the same rows and, like the plan, leaves no group behind."""
    for ours in _figures(launches, "online-plan-dry-runs-ep"):
        (ep1, first), (ep2, second) = ours["losses"].items()
        assert " ep2" in ep2 and " ep2" not in ep1 and len(first) == 3, ours["losses"]
        torch.testing.assert_close(torch.tensor(second), torch.tensor(first), rtol=1e-5,
                                   atol=1e-6)
        # each dry run none; the ep plan as many as the same plan at ep1 (its final layout's)
        assert ours["groups_left"][:2] == [0, 0] and len(set(ours["groups_left"][2:])) == 1, ours
        measured = ours["only_ep_measured"]
        assert len(measured) == 1 and all(" ep2" in label and seconds > 0
                                          for label, seconds in measured.items()), measured
        assert ours["only_ep_chosen_ep"] == 2, ours


def test_a_dry_run_on_cuda_counts_the_memory_outside_the_caching_allocator(monkeypatch):
    """NCCL's communicators and the CUDA context take device memory the allocator never sees;
    a candidate is judged by its peak reservation plus that."""
    from merak.dryrun.run import device_peak_bytes

    gib = 2**30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 40 * gib)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 45 * gib)
    # 50 GiB used on the device, 40 of them the allocator's: 10 outside it
    assert device_peak_bytes(torch.device("cuda", 0)) == 55 * gib


def test_optimizer_state_the_first_step_allocates_is_counted_until_it_exists():
    from merak.runtime.memory_probe import pending_optimizer_state_bytes

    model = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)  # frozen: never stepped, never given state
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    adamw = torch.optim.AdamW(model.parameters())
    assert pending_optimizer_state_bytes(adamw) == 2 * 4 * trainable  # two fp32 moments
    assert pending_optimizer_state_bytes(torch.optim.Adam(model.parameters(), amsgrad=True)) \
        == 3 * 4 * trainable
    assert pending_optimizer_state_bytes(torch.optim.SGD(model.parameters(), lr=0.1)) == 0
    model(torch.ones(1, 8)).sum().backward()
    adamw.step()
    assert pending_optimizer_state_bytes(adamw) == 0  # it exists now, in the live tensors


def test_the_batch_size_probe_holds_the_optimizer_state_beside_the_step(monkeypatch):
    """`fits_in_memory` runs the stage's forwards and backwards with a block the size of the
    AdamW state (not there before the first step) alive, so a GPU runs out of memory in the
    probe rather than at the second step."""
    import merak
    from merak.models.gpt import GPT, GPTConfig, gpt_pieces
    from merak.runtime import memory_probe

    ctx = merak.init(dp=1, tp=1, pp=1)
    torch.manual_seed(0)
    model = GPT(GPTConfig(num_layers=2))
    split = merak.manual_split(model, gpt_pieces(model), num_stages=1)
    stage = merak.PipelineStage(model, split, 0)
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.AdamW(stage.parameters()),
                                       num_microbatches=2)
    expected = 8 * sum(p.numel() for p in stage.parameters())
    held = []
    alone = memory_probe._stage_alone

    def spied(runner, *args):
        gc.collect()
        held.append(sum(t.numel() for t in gc.get_objects() if type(t) is torch.Tensor
                        and t.dtype == torch.uint8 and t.numel() == expected))
        alone(runner, *args)

    monkeypatch.setattr(memory_probe, "_stage_alone", spied)
    ids = torch.randint(0, 256, (4, 16))
    assert memory_probe.fits_in_memory(engine, {"input_ids": ids, "labels": ids}, 2)
    assert held == [expected]
    assert all(p.grad is None for p in stage.parameters()) and not engine.optimizer.state


def test_zero1_sets_aside_only_this_ranks_shard_of_the_state(launches):
    """This rank's shard of AdamW's two fp32 moments; the ranks' shares sum to the whole."""
    for rank, ours in enumerate(_figures(launches, "zero1-pending-state-is-the-shard")):
        assert 0 < ours["mine"] < ours["total"], f"rank {rank}: {ours}"
        assert ours["pending"] == 8 * ours["mine"], f"rank {rank}: {ours}"
        assert ours["summed"] == 8 * ours["total"], f"rank {rank}: {ours}"


def test_out_of_memory_in_the_collective_shape_discovery_is_raised_not_an_answer(monkeypatch):
    """The probe answers "does not fit" only for an out-of-memory error of the part each rank
    runs alone; one in the collective shape discovery is raised on that rank (its peers, inside
    the collective, then name it), never turned into an answer that would leave them waiting."""
    import merak
    from merak.models.gpt import GPT, GPTConfig, gpt_pieces
    from merak.runtime import memory_probe

    ctx = merak.init(dp=1, tp=1, pp=1)
    model = GPT(GPTConfig(num_layers=2))
    split = merak.manual_split(model, gpt_pieces(model), num_stages=1)
    stage = merak.PipelineStage(model, split, 0)
    engine = merak.PipelineInterpreter(stage, ctx, torch.optim.AdamW(stage.parameters()),
                                       num_microbatches=2)
    ids = torch.randint(0, 256, (4, 16))
    batch = {"input_ids": ids, "labels": ids}

    def out_of_memory(*args, **kwargs):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(memory_probe, "_stage_alone", out_of_memory)
    assert memory_probe.fits_in_memory(engine, batch, 2) is False  # alone: an answer
    monkeypatch.setattr(engine, "_begin", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        memory_probe.fits_in_memory(engine, batch, 2)


def test_the_tp_proof_raises_a_ranks_own_failure_instead_of_refusing_the_plan(monkeypatch):
    """A block's own error (every TP rank meets it) refuses the plan; an out-of-memory error or
    a failed wait (one rank's) is raised: refused, the rank would go on to the next collective
    while its peers wait in the block's."""
    from types import SimpleNamespace

    from torch import nn

    from merak.distributed.liveness import PeerFailureError
    from merak.tensor_parallel.tracing import proof
    from merak.tensor_parallel.tracing.proof import PlanRefused

    model = nn.Sequential(nn.Linear(2, 2))
    example = proof.Example(members=["0"], skeleton=nn.Linear(2, 2), inputs=None, read=[True])
    ctx = SimpleNamespace(tp_group=None, device=torch.device("cpu"))
    for error, expected in ((ValueError("view size is not compatible"), PlanRefused),
                            (torch.OutOfMemoryError("out of memory"), torch.OutOfMemoryError),
                            (PeerFailureError("rank 1 did not arrive"), PeerFailureError),
                            (RuntimeError("Timed out waiting 10000ms for recv"), RuntimeError)):
        def fail(*args, error=error):
            raise error

        monkeypatch.setattr(proof, "_prove_block", fail)
        with pytest.raises(expected) as raised:
            proof.prove_plan(model, [example], ctx)
        assert (raised.type is PlanRefused) == (expected is PlanRefused), raised.value
