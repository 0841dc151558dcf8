"""Expert parallelism with every pipeline schedule, recomputation, torch.compile, LoRA and bf16
(pooled worker ep_compose.py): a tiny Qwen3-MoE at dp2 ep2 (pp1 on 2 ranks, pp2 on 4) through
`build_engine`, 2 SGD steps of 2 micro-batches of padded rows, against the single-process model
(peft's with LoRA; under the same autocast with bf16): losses, gradients and parameters; and
every rank of an ep group ran the same token all-to-alls in the same order (the i-th exchange
of each rank sends each peer what that peer's i-th exchange receives from it)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from dist_harness import assert_like_reference, scenario_result
from ep_compose import MICRO, scenario_names
from ep_compose import _model as ep_compose_model
from peft import LoraConfig, get_peft_model

import merak
from merak.expert_parallel.shard import refuse_expert_adapters
from merak.rules import NotSupportedYetError

WORKER = "ep_compose.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4)
RTOL, ATOL, GRAD_ATOL_OF_MAX = 1e-4, 1e-5, 1e-4  # fp32, as test_expert_parallel
# bf16 autocast: the engine's gap to the model under autocast, the same at ep=1 (max 5e-4 of a
# loss near 5, gradients within 2% of their largest entry); ep=2 against ep=1: fp32 rounding
BF16_RTOL, BF16_ATOL, BF16_GRAD_ATOL_OF_MAX = 2e-2, 1e-3, 2e-2


# Merak's schedules that never recompute on the last pipeline stage
NO_RERUN_ON_LAST = ("last_no_recompute_1f1b", "shifted_critical_path")


def _exchanges_per_step(scenario: str, figures: dict) -> int:
    """Each micro-batch's MoE layer exchanges twice forward (tokens out, results back) and
    twice backward, twice more where its forward is rerun (recomputation)."""
    reruns = "recompute" in scenario and not (
        any(name in scenario for name in NO_RERUN_ON_LAST) and figures["last_stage"])
    return MICRO * len(figures["experts_modules"]) * (6 if reruns else 4)


def assert_exchanges_match(figures: list[dict], scenario: str) -> None:
    """The ranks of each ep group ran the same exchanges in the same order: the i-th exchange of
    rank a sends rank b what the i-th exchange of rank b receives from a; as many as expected."""
    for f in figures:
        group = f["ep_group"]
        calls = {r: figures[r]["exchanges"] for r in group}
        # the last step's (the first step's holds the runtime's shape discovery forwards too)
        expected = _exchanges_per_step(scenario, f)
        assert [figures[r]["exchanges_per_step"][-1] for r in group] == [expected] * 2, \
            (scenario, [figures[r]["exchanges_per_step"] for r in group])
        for a_index, a in enumerate(group):
            for b_index, b in enumerate(group):
                sent = [call[0][b_index] for call in calls[a]]
                received = [call[1][a_index] for call in calls[b]]
                assert sent == received, (scenario, a, b)
        assert any(call[0][1 - group.index(f["rank"])] for call in calls[f["rank"]]), \
            "no token left its rank: the exchange was not exercised"


@pytest.mark.parametrize("world_size,scenario", [(w, s) for w in WORLD_SIZES
                                                 for s in scenario_names(w)
                                                 if "-ep1-" not in s])
def test_expert_parallel_composes_like_the_model(launches, world_size, scenario):
    figures = scenario_result(*launches(world_size), scenario)
    bf16 = "bf16" in scenario
    assert assert_like_reference(
        figures, rtol=BF16_RTOL if bf16 else RTOL, atol=BF16_ATOL if bf16 else ATOL,
        grad_atol_of_max=BF16_GRAD_ATOL_OF_MAX if bf16 else GRAD_ATOL_OF_MAX) > 0
    print(f"{scenario}: max abs diff {max(f['max_abs_diff'] for f in figures):.2g}")
    assert_exchanges_match(figures, scenario)
    for f in figures:  # each rank holds half of each of its layers' experts tensors
        counts = f["expert_counts"]
        assert counts and len(counts) == 2 * len(f["experts_modules"]), counts
        assert all(mine * 2 == whole for mine, whole in counts.values()), counts
        # every trainable parameter got a gradient; LoRA: the adapters only, as peft's
        assert f["with_grad"] == f["trainable"] == f["reference_trainable"]
    if "lora" in scenario:
        assert all(".lora_" in n for n in figures[0]["trainable"]), figures[0]["trainable"]
        assert not any("experts" in n for n in figures[0]["trainable"])
    if "pp2" in scenario:  # 4 layers over the 2 pipeline ranks, each held by both replicas
        layers = sorted(m for f in figures for m in f["experts_modules"])
        assert layers == sorted(f"model.layers.{i}.mlp.experts" for i in range(4) for _ in "dp")
    if bf16:  # ep=2 computes what ep=1 does under autocast, to fp32 rounding
        gap = assert_like_ep1(figures, scenario_result(*launches(world_size),
                                                       scenario.replace("-ep2-", "-ep1-")))
        print(f"{scenario}: max abs diff from ep=1 {gap:.2g}")


def assert_like_ep1(ep2: list[dict], ep1: list[dict]) -> float:
    """Every loss, gradient and parameter of ep=2 is ep=1's (its experts: this ep rank's half)
    to fp32 rounding; returns the largest difference."""
    gap = 0.0
    for rank, (ours, theirs) in enumerate(zip(ep2, ep1)):
        torch.testing.assert_close(torch.tensor(ours["floats"]["losses"][0]),
                                   torch.tensor(theirs["floats"]["losses"][0]),
                                   rtol=1e-6, atol=1e-6)
        mine, whole = torch.load(ours["tensors"]), torch.load(theirs["tensors"])
        for kind in ("value", "grad"):
            for what, (actual, _) in mine[kind].items():
                other = whole[kind][what][0]
                if other.shape != actual.shape:  # an experts tensor: this ep rank's half
                    other = other.chunk(2)[ours["ep_rank"]]
                torch.testing.assert_close(actual, other, rtol=1e-5, atol=1e-6,
                                           msg=lambda m, w=what, r=rank: f"rank {r}: {w}: {m}")
                gap = max(gap, (actual - other).abs().max().item())
    return gap


@pytest.mark.parametrize("targets", [{"target_parameters": ["experts.gate_up_proj"]},
                                     {"target_modules": ["q_proj"],
                                      "target_parameters": ["experts.down_proj"]}])
def test_adapters_on_expert_weights_are_refused_before_the_build(targets):
    """peft's adapters over a layer's experts tensors are not split over the ep ranks: refused
    by name before tensor parallelism, the split or any materialization (attention adapters
    compose with ep: the lora scenarios above)."""
    with merak.init_empty_weights():
        model = get_peft_model(ep_compose_model(2), LoraConfig(
            r=2, **{"target_modules": [], **targets}))
    with pytest.raises(NotSupportedYetError, match=r"LoRA adapters on expert weights "
                       r"\(model\.layers\.0\.mlp\.experts, ParamWrapper\) with expert "
                       r"parallelism \(ep=2\).*target the attention"):
        merak.parallelize(model, {}, SimpleNamespace(ep=2))
    refuse_expert_adapters(model, 1)  # ep=1: peft's own


def test_merak_trainer_refuses_adapters_on_expert_weights_with_ep(monkeypatch):
    """`MerakTrainer` with ``lora_config`` targeting experts tensors at ep=2: refused once its
    adapters are made, before any engine is built."""
    import merak.rules as rules_module
    import merak.trainer.trainer as trainer_module

    with merak.init_empty_weights():
        model = ep_compose_model(2)
    context = SimpleNamespace(ep=2, tp=1, cp=1)
    monkeypatch.setattr(trainer_module, "get_context", lambda: context)
    monkeypatch.setattr(rules_module, "default_context", lambda: context)
    args = merak.MerakArguments(output_dir="out", use_cpu=True, report_to="none",
                                lora_config='{"r": 2, "target_modules": ["q_proj"], '
                                            '"target_parameters": ["experts.gate_up_proj"]}')
    with pytest.raises(NotSupportedYetError, match=r"LoRA adapters on expert weights.*ep=2"):
        merak.MerakTrainer(model=model, args=args)
