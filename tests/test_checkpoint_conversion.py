"""Checkpoints that transformers converts on load: `save_pretrained` of a Mixtral,
Qwen2/3-MoE, OLMoE, PhiMoE or DeepSeek-V3 writes the Hub's per-expert tensors, which
`from_pretrained` stacks into fused experts. Merak's per-rank loader derives a stage's tensors
from just the checkpoint tensors they are made of, with transformers' own conversions, and
equals `from_pretrained`; its HF export writes what `save_pretrained` writes. The same through
MerakTrainer at dp1 x tp2 x pp2 (Mixtral, Qwen3-MoE) against HF Trainer:
workers/checkpoint_conversion.py; all six families at dp1 and dp2 x tp2 x pp2 with

    MERAK_TEST_MATRIX=full .venv/bin/python -m pytest tests/test_checkpoint_conversion.py -k trainer
"""

from __future__ import annotations

import pytest
import torch
from checkpoint_conversion import (  # workers/: the trainer checks
    DP_OF_WORLD,
    hub_tensors,
)
from checkpoint_conversion import FAMILIES as TRAINED
from dist_harness import check
from transformers import AutoConfig, AutoModelForCausalLM

from merak.checkpoint.export import save_hf_directory
from merak.coverage.shrink import small_config
from merak.engine.parallelize import tied_aliases
from merak.materialize import safetensors as st
from merak.materialize.conversion import CheckpointLayout, meta_model_for, to_hub_layout
from merak.tensor_parallel.layers.megatron import ShardSpec

WORKER = "checkpoint_conversion.py"  # pooled: launches(world_size), see conftest.py
WORLD_SIZES = tuple(DP_OF_WORLD)
FAMILIES = ("mixtral", "qwen3_moe", "qwen2_moe", "olmoe", "phimoe", "deepseek_v3")
LAYER = 2  # the "stage": decoder layer 2 and the head (deepseek_v3's layer 0 is dense)


def save_small(family: str, path, **save) -> None:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(small_config(family)).save_pretrained(path, **save)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """family -> a save_pretrained directory of its small model (Hub layout)."""
    root = tmp_path_factory.mktemp("hub")
    for family in FAMILIES:
        save_small(family, root / family)
    return root


def empty_model(path):
    """The model of `path`'s config with uninitialized CPU storage (as a stage to be loaded)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path))
    return model.to_empty(device="cpu")


def stage_names(model) -> list[str]:
    return [n for n, _ in model.named_parameters(remove_duplicate=False)
            if f".layers.{LAYER}." in n or n.startswith(("lm_head", "model.norm"))]


def load_reading(monkeypatch, *args, **kwargs) -> set[str]:
    """`load_safetensors_(*args, **kwargs)`; returns the checkpoint names it read."""
    read = set()
    whole, into = st._read_whole, st._read_into
    monkeypatch.setattr(st, "_read_whole", lambda file, key, headers: (
        read.add(key), whole(file, key, headers))[1])
    monkeypatch.setattr(st, "_read_into", lambda f, start, info, tensor, name, file: (
        read.update(k for k, v in st.read_header(file)[1].items()
                    if v["data_offsets"] == info["data_offsets"]),
        into(f, start, info, tensor, name, file))[1])
    st.load_safetensors_(*args, **kwargs)
    return read


@pytest.mark.parametrize("family", FAMILIES)
def test_a_stage_loads_the_tensors_from_pretrained_gives(saved, family, monkeypatch):
    path = saved / family
    stored = set(st.checkpoint_index(path))
    assert any(".experts.0." in n for n in stored), "save_pretrained wrote fused experts"
    model = empty_model(path)
    layout = CheckpointLayout(model)
    names = stage_names(model)
    assert any("experts" in n and ".experts.0." not in n for n in names)  # fused in memory
    read = load_reading(monkeypatch, model, path, names=names, layout=layout,
                        aliases=tied_aliases(model))
    assert read and all(f".layers.{LAYER}." in k or not k.startswith("model.layers.")
                        for k in read), f"read other layers: {sorted(read)}"
    reference = dict(AutoModelForCausalLM.from_pretrained(path).named_parameters())
    params = dict(model.named_parameters())
    for name in names:
        torch.testing.assert_close(params[name], reference[name], rtol=0, atol=0, msg=name)


def test_a_sharded_bf16_checkpoint_loads_tensor_parallel_slices(tmp_path):
    """Several files (model.safetensors.index.json), bf16 on disk into fp32 parameters, and a
    tensor-parallel shard of a fused expert tensor taken from the derived whole."""
    path = tmp_path / "mixtral"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("mixtral")).to(torch.bfloat16)
    model.save_pretrained(path, max_shard_size="100KB")
    assert (path / st.INDEX_FILE).exists()
    target = empty_model(path).float()
    experts = target.model.layers[LAYER].mlp.experts
    full = experts.gate_up_proj
    inter = full.shape[1] // 2  # rank 1 of 2 holds half of gate and half of up
    spec = ShardSpec(dim=1, rank=1, size=2, chunks=(inter, inter), full_shape=tuple(full.shape))
    experts.gate_up_proj = torch.nn.Parameter(torch.empty(full.shape[0], inter, full.shape[2]))
    experts.gate_up_proj.tp_shard = spec
    names = stage_names(target)
    st.load_safetensors_(target, path, names=names, layout=CheckpointLayout(target))
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    want = dict(reference.named_parameters())
    for name, param in target.named_parameters():
        if name in names:
            expect = want[name] if name != f"model.layers.{LAYER}.mlp.experts.gate_up_proj" \
                else spec.take(want[name])
            assert param.dtype == torch.float32
            torch.testing.assert_close(param, expect, rtol=0, atol=0, msg=name)


def test_a_tied_head_loads_from_the_embedding_it_is_stored_as(tmp_path):
    """The last stage's LM head of a tied Qwen3-MoE: the checkpoint stores only the embedding."""
    torch.manual_seed(0)
    config = small_config("qwen3_moe")
    config.tie_word_embeddings = True
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    assert "lm_head.weight" not in st.checkpoint_index(tmp_path)
    model = empty_model(tmp_path)
    names = stage_names(model)
    assert "lm_head.weight" in names
    # (to_empty unties the copy; tied_aliases of the meta model name the same pair)
    st.load_safetensors_(model, tmp_path, names=names, layout=CheckpointLayout(model),
                         aliases={"lm_head.weight": ["model.embed_tokens.weight"]})
    reference = AutoModelForCausalLM.from_pretrained(tmp_path)
    torch.testing.assert_close(model.lm_head.weight, reference.model.embed_tokens.weight,
                               rtol=0, atol=0)


def test_a_tensor_nobody_can_derive_is_named_with_the_conversion_tried(saved, tmp_path):
    from safetensors.torch import save_file

    kept = {k: v for k, v in hub_tensors(saved / "mixtral").items()
            if not k.startswith(f"model.layers.{LAYER}.block_sparse_moe.experts.")}
    save_file(kept, tmp_path / "model.safetensors", metadata={"format": "pt"})
    model = empty_model(saved / "mixtral")
    with pytest.raises(KeyError, match=r"gate_up_proj \(tried: MergeModulelist"):
        st.load_safetensors_(model, tmp_path, names=stage_names(model),
                             layout=CheckpointLayout(model))


@pytest.mark.parametrize("family", [*FAMILIES, "gpt2"])
def test_the_export_writes_what_save_pretrained_writes(saved, family, tmp_path):
    """MoE families in the per-expert layout; GPT-2 without its tied LM head."""
    path = saved / family
    if family not in FAMILIES:
        save_small(family, path)
    model = AutoModelForCausalLM.from_pretrained(path)
    tensors = {n: p.detach().clone() for n, p in model.state_dict().items()}
    save_hf_directory(tensors, model, tmp_path)
    ours, theirs = hub_tensors(tmp_path), hub_tensors(path)
    assert sorted(ours) == sorted(theirs)
    for name, tensor in theirs.items():
        torch.testing.assert_close(ours[name], tensor, rtol=0, atol=0, msg=name)
    assert to_hub_layout(None, tensors) is tensors  # no model: names as they are


@pytest.mark.parametrize("world_size,family", [(w, f) for w in DP_OF_WORLD for f in TRAINED])
def test_merak_trainer_loads_and_exports_the_hub_layout(launches, worker_pool, world_size,
                                                        family, tmp_path):
    """dp x tp2 x pp2: the step losses equal HF Trainer's on the same directory; save_model
    (and `merak export` of its checkpoint, equal in the worker) writes what save_pretrained of
    HF's trained model writes."""
    import json

    from checkpoint_conversion import reference

    check(*launches(world_size), f"trainer-{family}")
    root = worker_pool.out_dir(WORKER, world_size) / family
    theirs, trained = reference(root / "hub", tmp_path, DP_OF_WORLD[world_size])
    ours = json.loads((root / "merak-losses.json").read_text())
    assert ours == pytest.approx(theirs, abs=2e-4)  # both trainers log 4 digits
    saved = hub_tensors(root / "saved")
    assert sorted(saved) == sorted(trained)
    for name, tensor in trained.items():
        # Adam divides by the gradient's root mean square: where an expert saw almost no
        # tokens, summation-order differences of ~1e-9 in its gradient move a weight by up to
        # ~1e-5 of the lr 1e-3 step (1 of 8192 elements of a Mixtral expert, seen on this
        # machine); a wrong layout or conversion differs by the weights' own scale, ~0.1
        torch.testing.assert_close(saved[name], tensor, rtol=1e-4, atol=5e-5, msg=name)


def test_an_export_without_a_model_builds_one_on_meta_from_the_config():
    """`merak export` has only config.json; one saved from a from_config model names no
    architecture, so the family's causal LM gives the conversions."""
    config = small_config("mixtral")
    assert not config.architectures
    model = meta_model_for(config)
    assert type(model).__name__ == "MixtralForCausalLM"
    assert all(p.is_meta for p in model.parameters())


def test_stages_save_the_buffers_the_models_state_dict_holds():
    """DeepSeek-V3's router bias (``mlp.gate.e_score_correction_bias``) is a persistent buffer
    save_pretrained writes; rotary ``inv_freq`` is not (fx copies it into the stage graphs as a
    persistent buffer, marked non-persistent again): the stages' checkpoints and exports hold
    exactly the model's."""
    from merak.checkpoint.io import persistent_buffers
    from merak.partition.auto import auto_split
    from merak.stages.stage import PipelineStage

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(small_config("deepseek_v3"))
    params = dict(model.named_parameters(remove_duplicate=False))
    expected = {n for n in model.state_dict() if n not in params}
    assert any("e_score_correction_bias" in n for n in expected)
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    split = auto_split(model, {"input_ids": ids, "labels": ids}, 2)
    found = [set(persistent_buffers(PipelineStage(split.container, split, s))) for s in range(2)]
    assert not found[0] & found[1] and found[0] | found[1] == expected, found
