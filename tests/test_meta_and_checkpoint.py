"""Meta-device build with exact initialization replay, stages materialized whole (parameters,
buffers, graph constants) on their device, and per-rank safetensors loading."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    GPT2Config,
    LlamaConfig,
    T5Config,
    T5ForConditionalGeneration,
)

from merak.materialize.meta import init_empty_weights, materialize_
from merak.materialize.safetensors import load_safetensors_
from merak.stages.stage import _attach

CONFIGS = {
    "llama": lambda: AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)),
    "gpt2": lambda: AutoModelForCausalLM.from_config(GPT2Config(
        vocab_size=128, n_embd=64, n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)),
    "bert": lambda: AutoModelForMaskedLM.from_config(BertConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128)),
    "t5": lambda: T5ForConditionalGeneration(T5Config(
        vocab_size=128, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)),
}


def _subset(model: nn.Module, names: list[str]) -> nn.Module:
    holder = nn.Module()
    params = dict(model.named_parameters())
    for i, name in enumerate(names):
        holder.register_parameter(f"p{i}", params[name])
    return holder


def test_parameters_created_from_real_values_keep_them():
    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.scale = nn.Parameter(torch.full((3,), 5.0))  # no init op writes it later
            self.bias = nn.Parameter(torch.zeros(4))
            nn.init.normal_(self.bias)  # overwritten whole: the zeros are not kept

    torch.manual_seed(0)
    reference = Scaled()
    torch.manual_seed(0)
    with init_empty_weights() as record:
        model = Scaled()
    assert sum(op is not None for op in record.ops) == 2  # the copy for `scale`, one normal_
    torch.empty(1 << 20).fill_(123.0)  # dirty memory the materialized tensors may reuse
    materialize_(model)
    torch.testing.assert_close(model.scale, reference.scale, rtol=0, atol=0)
    torch.testing.assert_close(model.bias, reference.bias, rtol=0, atol=0)


class _Repointed(nn.Module):
    """HF's `_adjust_bias` pattern: a parameter's data replaced by a (zero-)padded copy."""

    def __init__(self, unrelated: bool = False):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(128))
        nn.init.uniform_(self.bias)
        self.bias.data = (torch.empty(128, device=self.bias.device) if unrelated else
                          nn.functional.pad(self.bias.data, (0, 0)))


def test_a_parameter_repointed_to_a_copy_keeps_its_recorded_value():
    torch.manual_seed(0)
    reference = _Repointed()
    torch.manual_seed(0)
    with init_empty_weights() as record:
        model = _Repointed()
    recorded = {op.target_key for op in record.ops if op is not None and op.target_key}
    # the storage the parameter left stays alive: no new tensor may take its key (a collision
    # used to hand BERT's cls.predictions.bias somebody else's init ops, or none, at random)
    fresh = [torch.empty(128, device="meta") for _ in range(200)]
    assert not recorded & {t.untyped_storage()._cdata for t in fresh}
    materialize_(model)
    torch.testing.assert_close(model.bias, reference.bias, rtol=0, atol=0)


class _Reinitialized(nn.Module):
    def __init__(self):
        super().__init__()
        self.bias = nn.Parameter(torch.zeros(16))
        fresh = self.bias.data.clone()
        nn.init.normal_(fresh)  # the copy gets its own values before the parameter takes it
        self.bias.data = fresh


def test_a_parameter_repointed_to_a_rewritten_copy_takes_the_new_values():
    torch.manual_seed(0)
    reference = _Reinitialized()
    torch.manual_seed(0)
    with init_empty_weights():
        model = _Reinitialized()
    materialize_(model)
    torch.testing.assert_close(model.bias, reference.bias, rtol=0, atol=0)


def test_a_parameter_repointed_to_unknown_values_is_named():
    with init_empty_weights():
        model = _Repointed(unrelated=True)
    with pytest.raises(ValueError, match=r"no value was recorded for \['bias'\]"):
        materialize_(model)


def test_seeding_inside_the_context_is_honoured():
    torch.manual_seed(3)
    reference = CONFIGS["llama"]()
    torch.manual_seed(99)  # replaced by the seed inside the context, as in an eager build
    with init_empty_weights():
        torch.manual_seed(3)
        model = CONFIGS["llama"]()
    materialize_(model)
    for name, param in reference.named_parameters():
        torch.testing.assert_close(dict(model.named_parameters())[name], param, rtol=0, atol=0)


@pytest.mark.parametrize("family", sorted(CONFIGS))
def test_a_stage_materializes_with_the_eager_values(family):
    torch.manual_seed(7)
    reference = CONFIGS[family]()
    rng_after_build = torch.rand(4)
    torch.manual_seed(7)
    with init_empty_weights():
        model = CONFIGS[family]()
    assert all(p.is_meta for p in model.parameters())
    names = [n for n, _ in model.named_parameters()]
    part = names[len(names) // 3: 2 * len(names) // 3]  # a middle "stage"
    holder = _subset(model, part)
    assert materialize_(holder)
    expected = dict(reference.named_parameters())
    for i, name in enumerate(part):
        torch.testing.assert_close(getattr(holder, f"p{i}"), expected[name], rtol=0, atol=0,
                                   msg=lambda m, n=name: f"{family} {n}: {m}")
    torch.testing.assert_close(torch.rand(4), rng_after_build, rtol=0, atol=0)
    for name, buffer in model.named_buffers():  # non-persistent buffers (rotary inv_freq) are real
        torch.testing.assert_close(buffer, dict(reference.named_buffers())[name])


def test_materialize_without_record_asks_for_a_checkpoint():
    with torch.device("meta"):
        layer = nn.Linear(3, 3)
    with pytest.raises(ValueError, match="checkpoint"):
        materialize_(layer)


@pytest.mark.parametrize("shard", ["10GB", "20KB"])
def test_load_own_names_from_safetensors(tmp_path, shard):
    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         tie_word_embeddings=True)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    reference.save_pretrained(tmp_path, max_shard_size=shard)
    with init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    stage = nn.Module()  # the last "stage": layer 1, final norm, tied head, original names
    for name in ("model.layers.1", "model.norm", "lm_head"):
        _attach(stage, name, model.get_submodule(name))
    materialize_(stage, initialize=False)
    loaded = load_safetensors_(stage, tmp_path,
                               aliases={"lm_head.weight": ["model.embed_tokens.weight"]})
    assert "lm_head.weight" in loaded and "model.layers.1.mlp.up_proj.weight" in loaded
    expected = reference.state_dict()
    for name in loaded:
        torch.testing.assert_close(stage.state_dict()[name], expected[name], rtol=0, atol=0)


def test_missing_tensor_and_wrong_shape_are_named(tmp_path):
    from safetensors.torch import save_file

    save_file({"weight": torch.zeros(2, 3)}, tmp_path / "model.safetensors")
    layer = nn.Linear(3, 2)
    with pytest.raises(KeyError, match="bias"):
        load_safetensors_(layer, tmp_path)
    with pytest.raises(ValueError, match=r"shape \[2, 3\]"):
        load_safetensors_(nn.Linear(2, 3, bias=False), tmp_path)


# ----------------------------------------------------------------- stages move whole (auto split)
def _every_tensor(*roots: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(where, tensor): every parameter, buffer and tensor attribute of every module under
    `roots`."""
    found = []
    for r, root in enumerate(roots):
        for name, sub in root.named_modules(remove_duplicate=False):
            for attr, value in [*sub._parameters.items(), *sub._buffers.items(),
                                *vars(sub).items()]:
                if isinstance(value, torch.Tensor):
                    found.append((f"root {r} {type(root).__name__}: {name}.{attr}", value))
    return found


def test_auto_split_llama_stages_materialize_whole_on_the_device():
    import merak

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    reference = AutoModelForCausalLM.from_config(config)
    torch.manual_seed(0)
    with merak.init_empty_weights():
        model = AutoModelForCausalLM.from_config(config)
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    inputs = {"input_ids": ids, "labels": ids}
    device = torch.device("cpu")
    split = merak.auto_split(model, inputs, 2, device=device)
    stages = [merak.PipelineStage(split.container, split, s) for s in range(2)]
    for stage in stages:
        assert merak.materialize_(stage, device)
    for s, stage in enumerate(stages):  # the stage graph itself is run, not registered
        tensors = _every_tensor(stage, split.stage_graph(s))
        assert any("inv_freq" in where for where, _ in tensors)
        for where, tensor in tensors:
            assert not tensor.is_meta, where
            assert tensor.device == device, f"{where} is on {tensor.device}"
    # parameters, buffers and graph constants kept their values: the model's loss
    torch.testing.assert_close(split(**inputs).loss, reference(**inputs).loss)


class _WithConstant(nn.Module):
    """Repeated blocks, and a tensor made in forward: a constant at the stage graph's root."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(12, 16)
        self.blocks = nn.ModuleList(nn.Linear(16, 16) for _ in range(2))
        self.head = nn.Linear(16, 7)

    def forward(self, x, labels):
        h = self.proj(x) * torch.tensor([0.25, 0.5]).sum()
        for block in self.blocks:
            h = torch.tanh(block(h))
        return nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def _unregistered_case(case: str):
    """A stage whose module tree misses tensors it runs with: the root constants of its flat
    graph piece, or the rotary table of an interleaved stage's second chunk. Returns the stage
    and the roots that hold everything it runs."""
    import merak

    with init_empty_weights():
        model = CONFIGS["llama"]() if case == "interleaved" else _WithConstant()
    if case == "interleaved":
        ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
        split = merak.auto_split(model, {"input_ids": ids, "labels": ids}, 2)
        chunks = [merak.PipelineStage(split.container, split, s) for s in range(2)]
        stage = merak.InterleavedStage(chunks)
        return stage, [stage, *chunks, split.stage_graph(0), split.stage_graph(1)]
    inputs = {"x": torch.randn(2, 6, 12), "labels": torch.randint(0, 7, (2, 6))}
    split = merak.auto_split(model, inputs, 2, trace_method=case)
    stage = merak.PipelineStage(split.container, split, 0)
    return stage, [stage, split.stage_graph(0)]


@pytest.mark.parametrize("case", ["interleaved", "export", "fx"])
def test_materialize_reaches_what_the_stage_runs_but_does_not_register(case):
    stage, roots = _unregistered_case(case)
    buffers = {id(b) for m in stage.modules() for b in m._buffers.values() if b is not None}
    hidden = [w for w, t in _every_tensor(*roots) if not isinstance(t, nn.Parameter)
              and id(t) not in buffers]
    assert hidden or case == "interleaved"  # interleaved: one tensor, two holders
    # a buffer or constant on the meta device shows whether materialize_ reached it
    for root in roots:
        for sub in root.modules():
            for name, buffer in list(sub._buffers.items()):
                sub._buffers[name] = buffer.to("meta")
    expected = "inv_freq" if case == "interleaved" else \
        "_tensor_constant0" if case == "fx" else "lifted_tensor_0"
    with pytest.raises(ValueError, match=expected):
        materialize_(stage)  # initialize: a meta buffer has no recorded value
    stage, roots = _unregistered_case(case)
    for root in roots:
        for sub in root.modules():
            for name, buffer in list(sub._buffers.items()):
                sub._buffers[name] = buffer.to("meta")
    materialize_(stage, "cpu", initialize=False)  # for a checkpoint: storage everywhere
    for where, tensor in _every_tensor(*roots):
        assert tensor.device == torch.device("cpu"), where
