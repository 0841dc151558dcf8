"""fp8 training through torchao's float8 linears (`merak.engine.fp8`, emulated on CPU):
through `build_engine` at (dp1 pp2), (dp2 pp1), (dp2 pp2), and with tensor parallelism at
(tp2), (tp2 + sequence parallelism), (tp2 pp2) and (dp2 tp2 pp2), under ZeRO-2/3 at (dp2) and
(dp2 pp2), with LoRA and with compiled blocks at (pp2), with context parallelism at (pp2 cp2)
and (tp2 cp2), and (the model alone) at cp2, ring and Ulysses, against one process on whole
rows, and 20
steps against the fp32 run at each tp layout (workers/fp8_parity.py); which casts reduce their
amax over the TP group (`merak.engine.fp8_tp`); in one process, Merak's conversion against
torchao's own, what stays in high precision, the checkpoint's names, 20 steps against the fp32
run; the argument checks and refusals."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from dist_harness import assert_like_reference, scenario_result
from fp8_parity import RECIPES, make_llama, scenario_names
from torch import nn

from merak import rules
from merak.engine.fp8 import convert_, float8_config, gathers_in_float8
from merak.rules import NotSupportedYetError
from merak.trainer.arguments import MerakArguments

torchao_float8 = pytest.importorskip("torchao.float8")

# pooled: launches(world_size), see conftest.py
WORKER, WORLD_SIZES = "fp8_parity.py", (2, 4, 8)
# the pipeline's losses, gradients and final weights against one process's, converted the same
# way and trained on the same micro-batches (measured: pp2 equal, bf16 autocast included; dp2,
# tp2 and their compositions within 2.4e-7 of the reference's largest entry: the dp all-reduce's
# and the tp partial sums' rounding; under cp one gradient within 4.8e-5 of its largest entry,
# elsewhere 7e-7: a float8 rounding of the ring attention's key gradient flipped by its sum order)
RTOL, ATOL = 1e-5, 1e-6
TWENTY = "twenty-steps"
CP_CASTS = ["grad_output", "grad_output_for_grad_weight", "input", "input_for_grad_weight"]


@pytest.mark.parametrize("world_size,scenario", [
    (w, s) for w in WORLD_SIZES for s in scenario_names(w) if not s.endswith(TWENTY)])
def test_fp8_trains_like_one_process(launches, world_size, scenario):
    figures = scenario_result(*launches(world_size), scenario)
    assert assert_like_reference(figures, rtol=RTOL, atol=ATOL, grad_atol_of_max=1e-6) > 0
    if "-zero" in scenario:  # the shards saved, read whole, loaded back (the worker checks)
        assert all(f["checkpoint"] > 0 for f in figures), [f.get("checkpoint") for f in figures]
    if "cp2" in scenario and "float8_classes" in figures[0]:  # through build_engine
        classes = (["Float8ColumnParallelLinear", "Float8RowParallelLinear"] if "tp2" in scenario
                   else ["Float8SequenceShardLinear"])
        assert all(f["float8_classes"] == classes for f in figures), figures[0]["float8_classes"]
        # every cast of x and dy (the token shards) takes its amax over cp: apply_fp8's group
        assert all(f["cp_casts"] == CP_CASTS for f in figures), [f["cp_casts"] for f in figures]
    gaps = [(a - e).abs().max().item() / max(e.abs().max().item(), 1e-30)
            for f in figures if f.get("tensors")
            for kind in torch.load(f["tensors"]).values() for a, e in kind.values()]
    print(f"{scenario}: {len(gaps)} tensor pairs, max difference / reference's max "
          f"{max(gaps):.2g}")


@pytest.mark.parametrize("world_size,scenario", [
    (w, s) for w in WORLD_SIZES for s in scenario_names(w) if s.endswith(TWENTY)])
def test_twenty_tensor_parallel_fp8_steps_stay_within_one_percent_of_fp32(
        launches, world_size, scenario):
    for rank, figures in enumerate(scenario_result(*launches(world_size), scenario)):
        losses = figures["losses"]
        fp32 = losses["None"]
        assert len(fp32) == 20 and fp32[-1] < 0.8 * fp32[0], (rank, fp32)  # it learns
        for recipe in RECIPES:
            gaps = [abs(a - b) / b for a, b in zip(losses[recipe], fp32)]
            print(f"{scenario} rank {rank} {recipe}: fp32 {fp32[-1]:.4f} fp8 "
                  f"{losses[recipe][-1]:.4f} max gap {max(gaps):.4%}")
            assert 0 < max(gaps) < 0.01, (rank, recipe, gaps)


def _rows(seed: int, count: int = 4, seq: int = 16) -> dict:
    ids = torch.randint(2, 128, (count, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone()}


def _loss_and_grads(model: nn.Module, data: dict):
    model.zero_grad(set_to_none=True)
    loss = model(**data).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                           if p.grad is not None}


@pytest.mark.parametrize("recipe", RECIPES)
def test_merak_conversion_equals_torchaos_own(recipe):
    torch.manual_seed(0)
    model = make_llama()
    theirs = copy.deepcopy(model)
    report = convert_(model, recipe, emulate=True)
    torchao_float8.convert_to_float8_training(
        theirs, config=float8_config(recipe, emulate=True),
        module_filter_fn=lambda module, name: name != "lm_head")
    assert report.kept == {"lm_head": report.kept["lm_head"]} and len(report.converted) == 14
    assert [type(m) for m in model.modules()] == [type(m) for m in theirs.modules()]
    data = _rows(1)
    loss, grads = _loss_and_grads(model, data)
    their_loss, their_grads = _loss_and_grads(theirs, data)
    assert loss == their_loss
    for name, grad in grads.items():
        torch.testing.assert_close(grad, their_grads[name], rtol=0, atol=0, msg=name)


class _Moe(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(128, 64)
        self.gate = nn.Linear(64, 16, bias=False)       # an HF MoE router's name
        self.router = nn.Linear(64, 16)
        self.gate_proj = nn.Linear(64, 128)             # an MLP projection: converted
        self.odd = nn.Linear(64, 40)                    # 40 does not divide by 16
        self.down_proj = nn.Linear(128, 64)
        self.head = nn.Linear(64, 128, bias=False)
        self.head.weight = self.embed.weight            # tied output embedding


def test_what_stays_in_high_precision_and_why():
    model = _Moe()
    report = convert_(model, "tensorwise", exclude=("down_*",), emulate=True)
    assert report.converted == ["gate_proj"]
    assert set(report.kept) == {"gate", "router", "odd", "down_proj", "head"}
    for name, words in (("gate", "MoE router"), ("router", "MoE router"), ("odd", "by 16"),
                        ("down_proj", "fp8_exclude 'down_*'"), ("head", "LM head")):
        assert words in report.kept[name], report.kept[name]
    assert all(type(getattr(model, n)) is nn.Linear for n in report.kept)
    assert "kept head: the LM head" in "\n".join(report.lines())


def test_checkpoints_keep_high_precision_weights_and_hf_names():
    """A float8 model's state dict has the plain model's names and fp32 tensors, and loads
    either way: a checkpoint resumes with or without fp8."""
    torch.manual_seed(0)
    plain = make_llama()
    fp8 = copy.deepcopy(plain)
    convert_(fp8, "rowwise", emulate=True)
    saved = fp8.state_dict()
    assert list(saved) == list(plain.state_dict())
    assert {t.dtype for t in saved.values()} == {torch.float32}
    with torch.no_grad():
        for p in fp8.parameters():
            p.add_(0.01)
    plain.load_state_dict(fp8.state_dict())  # fp8 -> plain
    back = make_llama()
    convert_(back, "rowwise", emulate=True)
    back.load_state_dict(plain.state_dict())  # plain -> fp8
    for name, tensor in back.state_dict().items():
        assert torch.equal(tensor, fp8.state_dict()[name]), name


def test_twenty_fp8_steps_stay_within_one_percent_of_fp32():
    data = [_rows(100 + i % 4, count=8) for i in range(20)]
    losses = {}
    for recipe in (None, *RECIPES):
        torch.manual_seed(0)
        model = make_llama().train()
        if recipe is not None:
            convert_(model, recipe, emulate=True)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        losses[recipe] = []
        for rows in data:
            loss = model(**rows).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses[recipe].append(loss.item())
    assert losses[None][-1] < 0.8 * losses[None][0], losses[None]  # it learns
    for recipe in RECIPES:
        gaps = [abs(a - b) / b for a, b in zip(losses[recipe], losses[None])]
        print(f"{recipe}: fp32 {losses[None][-1]:.4f} fp8 {losses[recipe][-1]:.4f} "
              f"max gap {max(gaps):.4%}")
        assert 0 < max(gaps) < 0.01, (recipe, gaps)


# ---- arguments and refusals (no process group)
def test_bad_recipe_and_stray_exclusions_are_named():
    with pytest.raises(ValueError, match=r"MerakArguments.fp8='e4m3' is not one of"):
        MerakArguments(output_dir="out", fp8="e4m3")
    with pytest.raises(ValueError, match="fp8_exclude only applies with fp8"):
        MerakArguments(output_dir="out", fp8_exclude=["lm_head"])
    args = MerakArguments(output_dir="out", fp8="rowwise", fp8_exclude=["layers.0.*"])
    precision = args.engine_options(pp=1).precision
    assert (precision.fp8, precision.fp8_exclude) == ("rowwise", ("layers.0.*",))


@pytest.mark.parametrize("fields,named", [
    ({"fp16": True}, "fp16=True"),
])
def test_refused_with_fp8_naming_the_field_and_the_way_out(fields, named):
    with pytest.raises(NotSupportedYetError, match=f"fp8='tensorwise' with {named}.*; "):
        MerakArguments(output_dir="out", fp8="tensorwise", **fields)


@pytest.mark.parametrize("fields,words", [
    ({"tp_overlapping_level": 1}, "tp_overlapping_level=0 with fp8"),
])
def test_rules_refuse_what_fp8_does_not_compose_with(fields, words):
    found = rules.refusal(rules.Choices(fp8="rowwise", **fields))
    assert found is not None and words in found.message
    assert isinstance(found.error(), NotSupportedYetError)
    assert rules.refusal(rules.Choices(**fields)) is None  # fp8 is what refuses it
    assert rules.refusal(rules.Choices(fp8="rowwise", zero_stage=1)) is None


@pytest.mark.parametrize("recipe", RECIPES)
def test_zero_2_3_lora_compile_and_cp_are_accepted(recipe):
    """ZeRO-2/3, LoRA, torch_compile and cp compose with fp8; LoRA with ZeRO-2/3 stays refused,
    by ZeRO's rule."""
    for stage in (2, 3):
        MerakArguments(output_dir="out", fp8=recipe, zero_stage=stage)
        assert rules.refusal(rules.Choices(fp8=recipe, zero_stage=stage, tp=2)) is None
    assert rules.refusal(rules.Choices(fp8=recipe, lora=True)) is None
    MerakArguments(output_dir="out", fp8=recipe, torch_compile=True)
    assert rules.refusal(rules.Choices(fp8=recipe, cp=2)) is None
    assert rules.refusal(rules.Choices(fp8=recipe, cp=2, tp=2)) is None
    found = rules.refusal(rules.Choices(fp8=recipe, lora=True, zero_stage=3))
    assert found is not None and found.field == "zero_stage" and "fp8" not in found.message


def test_only_tensorwise_gathers_in_float8_under_zero():
    ctx = SimpleNamespace(replicas=2)
    gathers = {(r, z): gathers_in_float8(SimpleNamespace(fp8=r, zero_stage=z), ctx)
               for r in RECIPES for z in (1, 2, 3)}
    assert {k for k, v in gathers.items() if v} == {("tensorwise", 2), ("tensorwise", 3)}
    assert not gathers_in_float8(SimpleNamespace(fp8="tensorwise", zero_stage=3),
                                 SimpleNamespace(replicas=1))  # FSDP2 not applied at dp1


def test_lora_base_layers_convert_and_adapters_stay():
    """peft's LoRA layers: the base linears become float8, the adapters (A of 64 -> 16, which
    divides by 16) stay nn.Linear; the wrapped model trains like one converted the same way
    with torchao's own filter."""
    from fp8_parity import lora_config
    from peft import get_peft_model

    from merak.engine.fp8 import ADAPTER

    torch.manual_seed(0)
    model = get_peft_model(make_llama(), lora_config())
    theirs = copy.deepcopy(model)
    report = convert_(model, "tensorwise", emulate=True)
    assert len(report.converted) == 14 and all(n.endswith(".base_layer")
                                               for n in report.converted)
    adapters = [n for n, why in report.kept.items() if why == ADAPTER]
    assert len(adapters) == 28 and all(".lora_A." in n or ".lora_B." in n for n in adapters)
    torchao_float8.convert_to_float8_training(
        theirs, config=float8_config("tensorwise", emulate=True),
        module_filter_fn=lambda module, name: name.endswith("base_layer"))
    assert [type(m) for m in model.modules()] == [type(m) for m in theirs.modules()]
    data = _rows(2)
    loss, grads = _loss_and_grads(model, data)
    their_loss, their_grads = _loss_and_grads(theirs, data)
    assert loss == their_loss
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trained == {n for n in grads if "lora_" in n}
    for name in trained:
        torch.testing.assert_close(grads[name], their_grads[name], rtol=0, atol=0, msg=name)


def test_tensor_parallel_layouts_are_accepted():
    """tp and sequence parallelism compose with fp8: the rules, a planner candidate."""
    for fields in ({"tp": 2}, {"tp": 2, "sequence_parallel": True}):
        assert rules.refusal(rules.Choices(fp8="tensorwise", **fields)) is None
    candidate = SimpleNamespace(micro_batch=1, microbatches=4, schedule="1f1b", zero=0,
                                sequence_parallel=True, recompute="off", chunks=1, tp=2, cp=1,
                                ep=1)
    assert rules.refusal(rules.Choices(fp8="tensorwise").with_candidate(candidate)) is None


@pytest.mark.parametrize("recipe,kind,reduced", [
    # tensorwise: every cast of a split operand (column: W and dy split; row: W and x)
    ("tensorwise", "column", {"weight", "weight_for_grad_input", "grad_output",
                              "grad_output_for_grad_weight"}),
    ("tensorwise", "row", {"input", "input_for_grad_weight", "weight",
                           "weight_for_grad_input"}),
    # rowwise: only the casts whose amax runs along the split features
    ("rowwise", "column", {"grad_output", "weight_for_grad_input"}),
    ("rowwise", "row", {"input", "weight"}),
    # context parallelism splits the tokens of x and dy: tensorwise, each of their casts;
    # rowwise, the two that reduce over the tokens (for the weight's gradient)
    ("tensorwise", "cp", {"input", "grad_output", "grad_output_for_grad_weight",
                          "input_for_grad_weight"}),
    ("rowwise", "cp", {"grad_output_for_grad_weight", "input_for_grad_weight"}),
])
def test_which_casts_take_the_full_tensors_amax(recipe, kind, reduced):
    from merak.engine.fp8_tp import reduced_casts

    assert set(reduced_casts(kind, float8_config(recipe, emulate=True))) == reduced


def test_a_tied_llama_keeps_its_head():
    config = tf.LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                            num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=1,
                            tie_word_embeddings=True)
    model = tf.AutoModelForCausalLM.from_config(config)
    report = convert_(model, "tensorwise", emulate=True)
    assert "lm_head" in report.kept and type(model.lm_head) is nn.Linear


def test_a_trainer_checkpoint_saved_in_fp8_resumes_without_it(tmp_path):
    """MerakTrainer (one process) trains 2 steps in fp8 and saves; a trainer without fp8 resumes
    from that checkpoint: its step-3 loss is the plain model's on the saved weights."""
    from torchao.float8.float8_linear import Float8Linear
    from trainer_common import train_set
    from transformers import default_data_collator

    import merak

    merak.init(dp=1, tp=1, pp=1)

    def trainer(fp8: str | None, steps: int) -> merak.MerakTrainer:
        torch.manual_seed(0)
        with merak.init_empty_weights():
            model = make_llama()
        args = MerakArguments(output_dir=str(tmp_path), max_steps=steps, save_steps=2,
                              save_strategy="steps", per_device_train_batch_size=4,
                              learning_rate=1e-2, report_to="none", disable_tqdm=True,
                              use_cpu=True, train_sampling_strategy="sequential", fp8=fp8)
        return merak.MerakTrainer(model=model, args=args, train_dataset=train_set())

    first = trainer("tensorwise", 2)
    first.train()
    assert sum(isinstance(m, Float8Linear) for m in first.stage.modules()) == 14
    saved = {n: p.detach().clone() for n, p in first.stage.named_parameters()}
    resumed = trainer(None, 3)
    resumed.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    assert not any(isinstance(m, Float8Linear) for m in resumed.stage.modules())
    plain = make_llama()
    plain.load_state_dict(saved)  # the fp8 stage's parameter names are the HF model's
    rows = default_data_collator(train_set()[8:12])
    logged = [e["loss"] for e in resumed.state.log_history if "loss" in e]
    assert logged[-1] == pytest.approx(plain(**rows).loss.item(), rel=1e-5)
