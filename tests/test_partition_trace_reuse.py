"""Trace reuse (merak/partition/trace_cache.py): a second build of a structurally identical
model reuses the first build's capture, bound to the second model's own tensors and modules,
and computes exactly what a fresh trace computes; anything that differs is a miss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers as tf
from hf_models import FAMILIES, CustomMLP, batch

import merak
from merak.partition.auto import auto_split
from merak.partition.trace_cache import TraceCache
from merak.partition.trace_key import trace_key

OPTIONS = ("export", False, ("blocks.0", "blocks.1"), ())


def _llama(seed: int):
    torch.manual_seed(seed)
    return FAMILIES["llama"]()


def _tensor_ids(module: torch.nn.Module) -> set[int]:
    return {id(t) for _, t in [*module.named_parameters(remove_duplicate=False),
                               *module.named_buffers(remove_duplicate=False)]}


def test_second_build_reuses_the_trace_and_trains_its_own_parameters():
    cache, inputs = TraceCache(), batch("llama", 0, 2)
    first, second = _llama(0), _llama(1)
    auto_split(first, inputs, 2, trace_cache=cache)
    assert (cache.hits, cache.misses, len(cache)) == (0, 1, 1)
    before = {n: p.detach().clone() for n, p in first.named_parameters()}
    split = auto_split(second, inputs, 2, trace_cache=cache)
    assert (cache.hits, cache.misses) == (1, 1)
    # the stages hold the second model's tensors and modules, none of the first's
    held = _tensor_ids(split.container)
    assert held and held <= _tensor_ids(second) and not held & _tensor_ids(first)
    assert not {id(m) for m in split.container.modules()} & {id(m) for m in first.modules()}
    start = {n: p.detach().clone() for n, p in second.named_parameters()}
    optimizer = torch.optim.SGD(second.parameters(), lr=0.1)
    split(**inputs).loss.backward()
    optimizer.step()
    assert all(p.grad is None for p in first.parameters())
    moved = [n for n, p in second.named_parameters() if not torch.equal(p, start[n])]
    assert len(moved) == len(start)
    assert all(torch.equal(p, before[n]) for n, p in first.named_parameters())


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_reused_trace_computes_what_a_fresh_trace_computes(family):
    cache, inputs = TraceCache(), batch(family, 1, 2)
    torch.manual_seed(4)
    fresh_model = FAMILIES[family]()
    torch.manual_seed(4)
    reused_model = FAMILIES[family]()
    fresh = auto_split(fresh_model, inputs, 2, trace_cache=cache)  # traced, and kept
    reused = auto_split(reused_model, inputs, 2, trace_cache=cache)
    assert (cache.hits, cache.misses) == (1, 1)
    assert reused.tied_weights == fresh.tied_weights
    want, got = fresh(**inputs), reused(**inputs)
    torch.testing.assert_close(got.loss, want.loss, rtol=0, atol=0)
    torch.testing.assert_close(got.logits, want.logits, rtol=0, atol=0)
    want.loss.backward()
    got.loss.backward()
    grads = dict(fresh_model.named_parameters())
    for name, p in reused_model.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=0, atol=0)


def test_meta_built_models_reuse_the_trace_with_their_own_meta_parameters():
    cache, inputs = TraceCache(), batch("llama", 0, 2)
    with merak.init_empty_weights():
        first, second = FAMILIES["llama"](), FAMILIES["llama"]()
    auto_split(first, inputs, 4, trace_cache=cache)
    split = auto_split(second, inputs, 2, trace_cache=cache)  # other stage count: same capture
    assert cache.hits == 1
    held = _tensor_ids(split.container)
    assert held <= _tensor_ids(second) and not held & _tensor_ids(first)
    assert all(p.is_meta for p in split.container.parameters())
    assert [len(keys) for keys in split.transfers.values()] == [1]


def test_models_loaded_from_pretrained_files_reuse_the_trace(tmp_path):
    """`from_pretrained` leaves its conversion mapping on the model (`_weight_conversions`,
    which no forward reads): two loads of the same files, under `init_empty_weights` as the
    trainer loads them, share one capture."""
    tf.MixtralForCausalLM(tf.MixtralConfig(  # per-expert tensors merged on load
        vocab_size=64, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, output_router_logits=True)).save_pretrained(tmp_path)
    cache, ids = TraceCache(), torch.randint(0, 64, (2, 8))
    inputs = {"input_ids": ids, "labels": ids}
    with merak.init_empty_weights():
        first, second = (tf.AutoModelForCausalLM.from_pretrained(tmp_path) for _ in range(2))
    assert first._weight_conversions
    auto_split(first, inputs, 2, trace_cache=cache)
    split = auto_split(second, inputs, 2, trace_cache=cache)
    assert (cache.hits, cache.misses) == (1, 1)
    assert _tensor_ids(split.container) <= _tensor_ids(second)


class ConstantGlue(CustomMLP):
    """A forward that makes a constant and a no_grad region outside its blocks: export lifts
    them into attributes the model lacks (``lifted_tensor_0``, ``submod_1``)."""

    def forward(self, x, labels):
        h = self.proj(x) * torch.tensor([0.5, 2.0]).repeat(16)
        with torch.no_grad():
            h = h + torch.ones(())
        for block in self.blocks:
            h = block(h)
        return F.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_lifted_constants_and_sub_graphs_are_fresh_copies():
    cache, inputs = TraceCache(), batch("mlp", 0, 2)
    splits = []
    for _ in range(2):
        torch.manual_seed(0)
        model = ConstantGlue()
        splits.append(auto_split(model, inputs, 2, trace_cache=cache))
        assert splits[-1](**inputs).item() == model(**inputs).item()
    assert cache.hits == 1
    first, second = (split.stage_graph(0) for split in splits)
    extras = [n.target for n in second.graph.nodes if n.op == "get_attr"
              and not n.target.startswith("proj.")]
    assert extras, "the capture lifted nothing: the test model no longer covers this"
    for target in extras:  # top-level attributes of the stage graph
        assert getattr(first, target) is not getattr(second, target)


def _key(model, inputs, options=OPTIONS):
    return trace_key(model, inputs, options)


def test_the_key_differs_with_config_shapes_dtypes_options_and_state():
    torch.manual_seed(0)
    model, inputs = CustomMLP(), batch("mlp", 0, 2)
    key = _key(model, inputs)
    assert key is not None and key == _key(CustomMLP(), batch("mlp", 5, 2))  # values: no part
    assert key != _key(CustomMLP(width=16), inputs)  # config
    assert key != _key(CustomMLP(depth=4), inputs)
    assert key != _key(model, batch("mlp", 0, 3))  # input shapes
    assert key != _key(model, {**inputs, "x": inputs["x"].double()})  # input dtypes
    assert key != _key(model, {"labels": inputs["labels"], "x": inputs["x"]})  # input order
    assert key != _key(model, inputs, ("dynamo", *OPTIONS[1:]))  # trace method
    assert key != _key(model, inputs, ("export", True, *OPTIONS[2:]))  # dynamic batch
    assert key != _key(model, inputs, ("export", False, ("blocks.0",), ()))  # blocks
    assert key != _key(model, inputs, (*OPTIONS[:3], ("head",)))  # leaf modules
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert key != _key(model, inputs)
    other = CustomMLP().eval()
    assert key != _key(other, inputs)  # training flag
    other = CustomMLP().double()
    assert key != _key(other, inputs)  # parameter dtypes
    other = CustomMLP()
    other.proj.weight.requires_grad_(False)
    assert key != _key(other, inputs)
    other = CustomMLP()
    other.proj.weight = torch.nn.Parameter(other.proj.weight.detach().t().contiguous().t())
    assert key != _key(other, inputs)  # strides
    other = CustomMLP()
    other.blocks[1].fc1.weight = other.blocks[0].fc1.weight
    assert key != _key(other, inputs)  # which names share one tensor
    other = CustomMLP()
    other.blocks[1].register_forward_hook(lambda module, args, out: out * 2)
    assert key != _key(other, inputs)  # hooks
    other = CustomMLP()
    other.blocks[0].norm.eps = 1e-3
    assert key != _key(other, inputs)  # plain attributes


def test_uncertain_attributes_make_no_key_and_nothing_is_cached():
    cache, inputs = TraceCache(), batch("mlp", 0, 2)
    model = CustomMLP()
    model.blocks[0].scale = torch.ones(())  # a tensor that is no parameter or buffer
    assert _key(model, inputs) is None
    model = CustomMLP()
    model.blocks[0].helper = object()  # an object the key cannot read
    assert _key(model, inputs) is None
    auto_split(model, inputs, 2, trace_cache=cache)
    auto_split(model, inputs, 2, trace_cache=cache)
    assert (len(cache), cache.hits, cache.misses) == (0, 0, 0)


def test_a_config_change_misses_and_the_cache_stays_bounded():
    cache = TraceCache(max_entries=1)
    auto_split(CustomMLP(), batch("mlp", 0, 2), 2, trace_cache=cache)
    auto_split(CustomMLP(width=16), batch("mlp", 0, 2), 2, trace_cache=cache)
    auto_split(CustomMLP(), batch("mlp", 0, 4), 2, trace_cache=cache)
    assert (cache.hits, cache.misses, len(cache)) == (0, 3, 1)
    auto_split(CustomMLP(), batch("mlp", 1, 4), 2, trace_cache=cache)  # the entry kept
    assert cache.hits == 1
    cache.clear()
    assert (len(cache), cache.hits, cache.misses) == (0, 0, 0)


def test_the_environment_turns_reuse_off(monkeypatch):
    monkeypatch.setenv("MERAK_TRACE_CACHE", "0")
    cache, inputs = TraceCache(), batch("mlp", 0, 2)
    auto_split(CustomMLP(), inputs, 2, trace_cache=cache)
    auto_split(CustomMLP(), inputs, 2, trace_cache=cache)
    assert (len(cache), cache.hits, cache.misses) == (0, 0, 0)


def test_trace_cache_argument_is_checked():
    with pytest.raises(TypeError, match="trace_cache"):
        auto_split(CustomMLP(), batch("mlp", 0, 2), 2, trace_cache="yes")
