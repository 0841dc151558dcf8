"""Automatic partitioning: parity of meta-built auto splits in real pipelines, and the split's
data, errors and stage assignment in one process."""

from __future__ import annotations

import contextlib

import pytest
import torch
import transformers as tf
from auto_split_parity import scenario_names
from dist_harness import assert_like_reference, scenario_result
from hf_models import FAMILIES, CustomMLP, batch

import merak
from merak.partition import capture
from merak.partition.auto import auto_split
from merak.partition.taps import recorded_submodules
from merak.stages import assign

WORKER = "auto_split_parity.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = (2, 4)
# every loss, gradient and final parameter against the single-process model's:
# torch.testing.assert_close(ours, reference, rtol=RTOL, atol=ATOL)
RTOL, ATOL = 1e-4, 1e-5


@pytest.mark.parametrize("world_size,scenario",
                         [(w, s) for w in WORLD_SIZES for s in scenario_names(w)])
def test_meta_built_auto_split_trains_like_the_model(launches, world_size, scenario):
    figures = scenario_result(*launches(world_size), scenario)
    assert assert_like_reference(figures, rtol=RTOL, atol=ATOL, grad_atol_of_max=0.0) > 0
    for rank, ours in enumerate(figures):
        assert ours["params"] and ours["params_without_grad"] == [], f"rank {rank}: {ours}"


@pytest.mark.parametrize("family", ["llama", "t5"])
def test_calling_the_split_returns_what_the_model_returns(family):
    torch.manual_seed(0)
    model = FAMILIES[family]()
    inputs = batch(family, 0, 2)
    split = auto_split(model, inputs, 2)
    expected, actual = model(**inputs), split(**inputs)
    assert type(actual) is type(expected)
    torch.testing.assert_close(actual.loss, expected.loss)
    torch.testing.assert_close(actual.logits, expected.logits)
    actual.loss.backward()  # differentiable
    assert model.get_submodule(split.blocks_of_stage[0][0]).training is True


def test_decoder_boundaries_carry_one_tensor_and_only_edge_stages_load_data():
    with merak.init_empty_weights():
        model = FAMILIES["llama"]()
    split = auto_split(model, batch("llama", 0, 2), 4)
    assert [len(keys) for keys in split.transfers.values()] == [1, 1, 1]
    assert split.batch_inputs(0) == ["input_ids"]
    assert split.batch_inputs(1) == [] and split.batch_inputs(2) == []
    assert split.batch_inputs(3) == ["labels"]
    text = split.describe()
    assert "stage 3: model.layers.3" in text and "receives model_layers_2" in text


def test_tied_weights_are_found_and_can_be_turned_off():
    with merak.init_empty_weights():
        model = FAMILIES["gpt2"]()
    split = auto_split(model, batch("gpt2", 0, 2), 2)
    assert [t.names for t in split.tied_weights] == [
        ((0, "transformer.wte.weight"), (1, "transformer.wte.weight"))]
    assert auto_split(model, batch("gpt2", 0, 2), 2, no_tie_modules=True).tied_weights == ()


@pytest.mark.parametrize("depth,num_stages", [(5, 4), (30, 4), (7, 3)])
@pytest.mark.parametrize("method", ["uniform", "uniform_floor", "parameters"])
def test_no_block_is_dropped(depth, num_stages, method):
    with merak.init_empty_weights():
        model = CustomMLP(depth=depth)
    split = auto_split(model, batch("mlp", 0, 2), num_stages, partition_method=method)
    owned = [b for blocks in split.blocks_of_stage for b in blocks]
    assert owned == [f"blocks.{i}" for i in range(depth)]
    assert all(split.blocks_of_stage)


def test_balanced_assignment_minimizes_the_slowest_stage():
    weights = [1, 1, 1, 1, 8, 1, 1, 1]
    stages = assign.balanced(weights, 3)
    assert max(assign.stage_loads(weights, stages)) == 8
    assert sorted(set(stages)) == [0, 1, 2] and stages == sorted(stages)
    assert assign.uniform(30, 4) == [0] * 9 + [1] * 8 + [2] * 7 + [3] * 8  # 8,8,7,7 + glue
    assert assign.uniform(30, 4, floor=True, num_before=0, num_after=0).count(3) == 8


@pytest.mark.parametrize("kwargs,message", [
    ({"num_stages": 9}, "cannot split 5 blocks into 9 stages"),
    ({"split_method": "layer_split", "custom_split_points": ["blocks.9"]}, "not blocks"),
    ({"split_method": "layer_split"}, "needs custom_split_points"),
    ({"partition_method": "custom"}, "needs custom_partition"),
    ({"partition_method": "balanced"}, "unknown partition_method"),
    ({"split_method": "nearest"}, "unknown split_method"),
    ({"trace_method": "jit"}, "unknown trace_method"),
    ({"input_names": ["pixels"]}, "not in example_inputs"),
])
def test_bad_options_raise_clear_errors(kwargs, message):
    with merak.init_empty_weights():
        model = CustomMLP()
    options = {"num_stages": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        auto_split(model, batch("mlp", 0, 2), **options)


def test_uncapturable_model_gets_guidance():
    class DataDependent(CustomMLP):
        def forward(self, x, labels):
            if x.sum() > 0:  # data-dependent control flow
                x = x * 2
            return super().forward(x, labels)

    with pytest.raises(RuntimeError, match="leaf_modules"):
        auto_split(DataDependent(), batch("mlp", 0, 2), 2)


@pytest.mark.parametrize("trace_method", ["export", "dynamo", "fx"])
def test_leaf_modules_stay_opaque_eager_calls(trace_method):
    torch.manual_seed(0)
    model, inputs = CustomMLP(), batch("mlp", 0, 2)
    split = auto_split(model, inputs, 2, trace_method=trace_method, leaf_modules=["head"])
    last = split.stage_graph(1)
    calls = [n.target for n in last.graph.nodes if n.op == "call_module"]
    assert "head" in calls and last.get_submodule("head") is model.head
    assert not any(n.op == "call_function" and "linear" in str(n.target)
                   for n in last.graph.nodes), "the leaf module was traced into"
    expected = model(**inputs)
    torch.testing.assert_close(split(**inputs), expected)


def test_fx_on_a_transformers_model_says_what_to_try():
    with merak.init_empty_weights():
        model = FAMILIES["llama"]()
    with pytest.raises(RuntimeError, match="trace_method='export'"):
        auto_split(model, batch("llama", 0, 2), 2, trace_method="fx")


class _Router(torch.nn.Module):
    """Returns data-dependent Python ints next to its logits, as JetMoE's router does."""

    def __init__(self, width):
        super().__init__()
        self.layer = torch.nn.Linear(width, 3, bias=False)

    def forward(self, x):
        logits = self.layer(x).float()
        counts = (logits > 0).long().sum((0, 1)).tolist()  # unbacked symbolic ints under export
        return counts, logits


class _Routed(torch.nn.Module):
    def __init__(self, width):
        super().__init__()
        self.router, self.mlp = _Router(width), torch.nn.Linear(width, width)

    def forward(self, h):
        _, logits = self.router(h)
        return h + self.mlp(h) * logits.softmax(-1)[..., :1]


class _Dense(torch.nn.Module):  # a second layer type in the same list
    def __init__(self, width):
        super().__init__()
        self.mlp = torch.nn.Linear(width, width)

    def forward(self, h):
        return h + torch.tanh(self.mlp(h))


class _RecordedAuxLoss(torch.nn.Module):
    """Mixed layer types in one list; the routers' logits are collected by forward hooks
    installed for the call (as transformers' OutputRecorder does) and feed an auxiliary loss
    computed after the last layer."""

    def __init__(self, width=16, vocab=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList([_Routed(width), _Dense(width), _Routed(width),
                                           _Dense(width)])
        self.head = torch.nn.Linear(width, vocab)

    def forward(self, input_ids, labels):
        seen = []
        hooks = [m.router.register_forward_hook(lambda m, a, out: seen.append(out[1]))
                 for m in self.layers if isinstance(m, _Routed)]
        try:
            h = self.embed(input_ids)
            for layer in self.layers:
                h = layer(h)
        finally:
            for hook in hooks:
                hook.remove()
        logits = self.head(h)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        return loss + 0.1 * sum(r.logsumexp(-1).pow(2).mean() for r in seen)


def test_recorded_router_outputs_and_mixed_layer_types_split_at_parity():
    """A value a block computes and the model reads after the blocks (router logits recorded
    by a hook) is tapped from the eager block call even when the router also returns
    data-dependent ints; a list of two layer types is the list of blocks."""
    torch.manual_seed(0)
    model = _RecordedAuxLoss()
    inputs = {"input_ids": torch.randint(0, 32, (2, 8)), "labels": torch.randint(0, 32, (2, 8))}
    split = auto_split(model, inputs, 2)
    assert split.blocks_of_stage == (("layers.0", "layers.1"), ("layers.2", "layers.3"))
    expected = model(**inputs)
    expected.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    actual = split(**inputs)
    actual.backward()
    torch.testing.assert_close(actual, expected)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], msg=name)


@pytest.mark.parametrize("router_logits", [True, False])
def test_an_moe_recording_its_router_logits_is_exported_once(monkeypatch, router_logits):
    """transformers' recorder hooks collect the routers' logits for the load-balancing loss:
    the first export already marks the routers (`taps.recorded_submodules`), so an MoE is
    exported once, as a dense model is, and its split computes the model's loss (auxiliary
    loss included) and gradients; the hand-written model above, which declares nothing,
    still takes the second export."""
    exports = []
    real = capture._export
    monkeypatch.setattr(capture, "_export", lambda *a: exports.append(1) or real(*a))
    torch.manual_seed(0)
    model = tf.MixtralForCausalLM(tf.MixtralConfig(
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=router_logits, router_aux_loss_coef=0.5))
    blocks = ["model.layers.0", "model.layers.1"]
    assert recorded_submodules(model, blocks) == (
        ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate"] if router_logits else [])
    ids = torch.randint(0, 64, (2, 8))
    split = auto_split(model, {"input_ids": ids, "labels": ids}, 2, trace_cache=False)
    assert len(exports) == 1
    expected = model(input_ids=ids, labels=ids).loss
    expected.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    actual = split(input_ids=ids, labels=ids)
    actual = actual["loss"] if isinstance(actual, dict) else actual.loss
    actual.backward()
    torch.testing.assert_close(actual, expected)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], msg=name)


class _Float32Head(torch.nn.Module):
    """Glue that switches autocast off as transformers' ``maybe_autocast(enabled=False)`` does
    (rotary embeddings in transformers 5.17, Nemotron's norm): a context only when autocast is
    on, so a trace taken without autocast records nothing of it."""

    def __init__(self, width, vocab):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(vocab, width) / width ** 0.5)

    def forward(self, h):
        off = torch.autocast(h.device.type, enabled=False) \
            if torch.is_autocast_enabled(h.device.type) else contextlib.nullcontext()
        with off:
            return h.float() @ self.weight.float().t()


class _AutocastGlue(torch.nn.Module):
    def __init__(self, width=16, vocab=32):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, width)
        self.layers = torch.nn.ModuleList([_Dense(width) for _ in range(4)])
        self.head = _Float32Head(width, vocab)

    def forward(self, input_ids, labels):
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        logits = self.head(h)
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_regions_the_model_runs_without_autocast_keep_float32_in_the_stages(dtype):
    """Traced under the run's autocast (`autocast_dtype`), a region the model runs with
    autocast off is recorded as such: the split's loss and gradients under autocast equal the
    eager model's bit for bit. (Traced without it, the region's matmul ran in `dtype` on the
    GPU machine's transformers 5.17, whose Llama rotary embedding is such a region, and its
    dtype guard stopped every bf16 and fp16 MerakTrainer run.)"""
    torch.manual_seed(0)
    model = _AutocastGlue()
    inputs = {"input_ids": torch.randint(0, 32, (2, 8)), "labels": torch.randint(0, 32, (2, 8))}
    split = auto_split(model, inputs, 2, autocast_dtype=dtype)
    with torch.autocast("cpu", dtype=dtype):
        expected = model(**inputs)
    expected.backward()
    want = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype):
        actual = split(**inputs)
    actual.backward()
    assert actual.dtype == torch.float32
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, want[name], rtol=0, atol=0, msg=name)
    # the same region traced without autocast runs its matmul in `dtype`: not the model's loss
    plain = auto_split(model, inputs, 2)
    with torch.autocast("cpu", dtype=dtype), torch.no_grad():
        assert plain(**inputs) != expected.detach()


def test_hf_llama_under_bf16_autocast_splits_at_parity():
    torch.manual_seed(0)
    model = FAMILIES["llama"]()
    inputs = batch("llama", 0, 2)
    split = auto_split(model, inputs, 2, autocast_dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        expected, actual = model(**inputs).loss, split(**inputs).loss
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)


def _block_masks(split) -> list:
    return [n.kwargs.get("attention_mask") for s in range(len(split.pieces))
            for n in split.stage_graph(s).graph.nodes
            if n.op == "call_module" and ".layers." in f".{n.target}"]


@pytest.mark.parametrize("keys,materialized", [
    ((), False),                   # eager HF: no mask, SDPA's is_causal (its flash kernels)
    (("attention_mask",), True),   # padding: the mask (eager HF reads it; a graph cannot)
    (("position_ids",), True),     # packed rows: HF's packed-sequence mask, traced
])
def test_the_causal_mask_is_built_only_where_eager_hf_builds_it(keys, materialized):
    """HF skips the causal mask of an unpadded, unpacked batch in eager mode but not while
    tracing; the stages are traced for training forwards only, so they skip it as eager HF does
    (with a mask, one H200 ran a 1.1 B Llama's SDPA backward 2.3x slower). The loss stays the
    model's at another sequence length."""
    torch.manual_seed(0)
    model = FAMILIES["llama"]()
    vocab = model.config.vocab_size

    def inputs(seq):
        ids = torch.randint(0, vocab, (2, seq))
        extra = {"attention_mask": torch.ones_like(ids),
                 "position_ids": torch.arange(seq).expand(2, seq)}
        return {"input_ids": ids, "labels": ids, **{k: extra[k] for k in keys}}

    split = auto_split(model, inputs(12), 2)
    masks = _block_masks(split)
    assert masks and all((mask is not None) == materialized for mask in masks), masks
    batch = inputs(20)
    with torch.no_grad():
        torch.testing.assert_close(split(**batch).loss, model(**batch).loss)


def test_a_sliding_window_keeps_its_mask_at_every_length():
    """Eager HF skips a sliding window's mask only while the sequence is shorter than the
    window; traced at 8 tokens with a window of 16, the stages keep the mask, so a batch of 40
    tokens still attends within the window as the model does."""
    import transformers as tf

    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(tf.MistralConfig(
        vocab_size=128, num_hidden_layers=2, hidden_size=64, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16))
    ids = torch.randint(0, 128, (2, 8))
    split = auto_split(model, {"input_ids": ids, "labels": ids}, 2)
    assert all(mask is not None for mask in _block_masks(split))
    ids = torch.randint(0, 128, (2, 40))
    with torch.no_grad():
        torch.testing.assert_close(split(input_ids=ids, labels=ids).loss,
                                   model(input_ids=ids, labels=ids).loss)
