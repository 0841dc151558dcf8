"""Per-rank loading of expert-parallel stages (merak/engine/parallelize.py, then
merak/materialize/safetensors.py), in one process for each ep rank: a model written by
`save_pretrained`, built under `init_empty_weights`, its experts cut to ep rank r's on the meta
device (`shard_experts`), materialized and loaded. Every file read of the loader is counted by
byte range and mapped back to the checkpoint's tensors: each rank reads exactly 1/ep of every
experts tensor's bytes (Mixtral's and Qwen3-MoE's per-expert Hub tensors, merged on load through
transformers' conversion; GPT-OSS's fused tensors and biases, by row range), every other tensor
once, no byte twice, and allocates 1/ep of the experts; the loaded tensors equal this rank's
slice of transformers' own whole-model `from_pretrained`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import transformers as tf
from ep_parity import _config
from ep_reads import bytes_per_tensor, counting_reads, is_expert

import merak
import merak.materialize.safetensors as loader
from merak.expert_parallel import experts_modules, shard_experts
from merak.materialize.conversion import CheckpointLayout
from merak.materialize.meta import materialize_

EP = 2


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_each_ep_rank_reads_and_holds_only_its_experts(family, tmp_path):
    torch.manual_seed(0)
    tf.AutoModelForCausalLM.from_config(_config(family)).save_pretrained(tmp_path)
    whole = dict(tf.AutoModelForCausalLM.from_pretrained(tmp_path).named_parameters())
    files = {path for path in loader.checkpoint_index(tmp_path).values()}
    sizes = {name: info["data_offsets"][1] - info["data_offsets"][0]
             for path in files for name, info in loader.read_header(path)[1].items()}
    assert any(map(is_expert, sizes)), sorted(sizes)
    held_total = 0
    for rank in range(EP):
        with merak.init_empty_weights():
            model = tf.AutoModelForCausalLM.from_pretrained(tmp_path)
        layout = CheckpointLayout(model)
        kept = shard_experts(model, SimpleNamespace(ep=EP, ep_rank=rank, ep_group=None))
        assert kept and all(first == rank * count for first, count in kept.values()), kept
        materialize_(model, "cpu", initialize=False)
        with counting_reads() as log:
            loader.load_safetensors_(model, tmp_path, layout=layout)
        read = bytes_per_tensor(log)
        for name, size in sizes.items():
            want = size // EP if is_expert(name) else size
            # per-expert Hub tensors: this rank's whole, the others' not at all
            if is_expert(name) and family != "gpt_oss":
                first, count = next(iter(kept.values()))
                index = int(name.split(".experts.")[1].split(".")[0])
                want = size if first <= index < first + count else 0
            assert read.get(name, 0) == want, (rank, name, read.get(name), size)
        expert_bytes = sum(read.get(n, 0) for n in sizes if is_expert(n))
        assert expert_bytes * EP == sum(s for n, s in sizes.items() if is_expert(n))
        held = 0
        for module_name, module in experts_modules(model).items():
            for pname, param in module.named_parameters(recurse=False):
                name = f"{module_name}.{pname}"
                assert param.numel() * EP == whole[name].numel(), name
                assert torch.equal(param, param.ep_shard.take(whole[name])), name
                held += param.numel() * param.element_size()
        held_total += held
        for name, param in model.named_parameters():  # the rest: the whole model's
            if getattr(param, "ep_shard", None) is None:
                assert torch.equal(param, whole[name]), name
    # the ranks together held every expert exactly once
    assert held_total == sum(p.numel() * p.element_size() for n, p in whole.items()
                             if ".experts." in n)
