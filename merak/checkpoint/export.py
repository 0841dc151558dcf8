"""HF-format model directories from Merak models: config.json + model.safetensors with whole
tensors, loadable by ``AutoModelForCausalLM.from_pretrained(dir)``, whatever (dp, tp, pp, cp,
ep) layout the weights were trained in.

- `export_checkpoint` (``merak export <checkpoint> <dir>``): from a Merak checkpoint on disk.
- `gather_full_tensors` + `save_hf_directory` (``MerakTrainer.save_model``): from the live
  stages of a job, gathered on global rank 0.

Both write the layout `save_pretrained` writes for the same model: tied copies dropped and
transformers' reverse conversions applied (`to_hub_layout`: a Mixtral's fused experts become the
Hub's per-expert tensors again), so the directory is what the Hub and other tools expect.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from merak import lora
from merak.checkpoint.io import MARKER, full_tensors, persistent_buffers
from merak.checkpoint.sharded import shard_spec
from merak.data_parallel.shards import is_sharded, whole
from merak.distributed.host_objects import receive_each
from merak.materialize.conversion import meta_model_for, to_hub_layout


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, merge: bool = False
                      ) -> Path:
    """An HF directory from a Merak checkpoint. A LoRA checkpoint (it holds
    adapter_config.json) becomes a PEFT adapter directory, or with `merge` the base model's HF
    directory with the adapter merged into its weights."""
    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not (checkpoint / MARKER).exists():
        raise FileNotFoundError(f"{checkpoint} is not a complete Merak checkpoint (no {MARKER})")
    if not (checkpoint / "config.json").exists():
        raise FileNotFoundError(f"{checkpoint} has no config.json (the model had no HF config), "
                                f"so it cannot become an HF directory")
    prefix = json.loads((checkpoint / MARKER).read_text()).get("name_prefix", "")
    tensors = {name[len(prefix):] if prefix and name.startswith(prefix) else name:
               tensor.contiguous() for name, tensor in full_tensors(checkpoint).items()}
    if (checkpoint / lora.ADAPTER_CONFIG).exists():
        config = lora.load_lora_config(checkpoint)
        adapter = lora.adapter_name_in(tensors)
        if not merge:
            return lora.save_adapter_directory(tensors, config, adapter,
                                               config.base_model_name_or_path, out_dir)
        tensors = lora.merged_tensors(tensors, config, adapter)
    elif merge:
        raise ValueError(f"--merge merges a LoRA adapter, but {checkpoint} has no "
                         f"{lora.ADAPTER_CONFIG} (it was not trained with LoRA)")
    out_dir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoConfig

    tensors = to_hub_layout(meta_model_for(AutoConfig.from_pretrained(checkpoint)), tensors)
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    shutil.copy(checkpoint / "config.json", out_dir / "config.json")
    return out_dir


def gather_full_tensors(stage: nn.Module, ctx, name_prefix: str = "") -> dict | None:
    """The whole model's parameters and persistent buffers under their original names
    (`name_prefix` removed), on global rank 0 (None elsewhere); a collective. Each (pp, tp)
    rank of dp rank 0 sends its stage's tensors as CPU tensors, and with expert parallelism
    the other ranks of its ep group their experts; tensor-parallel and expert-parallel shards
    are put back together (`ShardSpec.assemble`, `ExpertSlice.assemble`: experts split over
    both come from every (ep rank, tp rank) of replicas 0 .. ep-1).

    The shards travel through host memory over the job's host group (`ParallelContext.host_group`)
    and rank 0 takes them one rank at a time (`receive_each`): besides the model it assembles, it
    holds one rank's shard in flight. (torch's `gather_object` staged every rank's pickled shard on
    rank 0's GPU at once under NCCL; files in the output directory would need a file system shared
    by every node.)"""
    mine = None
    params = list(stage.named_parameters())
    gather = any(is_sharded(p) for _, p in params)  # ZeRO-2/3: every dp rank takes part
    tensors = [whole(p) if gather else p for _, p in params]
    buffers = persistent_buffers(stage)  # (what save_pretrained writes besides parameters)
    params += list(buffers.items())
    tensors += list(buffers.values())
    replica = ctx.dp_rank * ctx.cp + ctx.cp_rank
    # replica 0 sends every tensor; with ep > 1 replicas 1 .. ep-1 (the rest of its ep group)
    # send their experts too
    mine = [(name, shard_spec(p), t.detach().cpu()) for (name, p), t in zip(params, tensors)
            if replica == 0 or (replica < ctx.ep and getattr(p, "ep_shard", None) is not None)]
    mine = mine or None
    shards: dict[str, dict] = {}
    specs = {}

    def take(_rank: int, part) -> None:
        for name, spec, tensor in part or ():
            specs.setdefault(name, spec)
            shards.setdefault(name, {})[_part(spec)] = tensor

    if ctx.world_size > 1:
        receive_each(mine, take, dst=0)
    else:
        take(0, mine)
    if ctx.rank != 0:
        return None
    out = {}
    for name in list(shards):
        pieces, spec = shards.pop(name), specs[name]  # each shard freed once assembled
        if spec is None:
            full = pieces[0]
        else:
            count = getattr(spec, "parts", spec.size)
            if sorted(pieces) != list(range(count)):
                raise ValueError(f"tensor {name} has shards {sorted(pieces)} of {count}")
            full = spec.assemble([pieces[r] for r in range(count)])
        key = name[len(name_prefix):] if name_prefix and name.startswith(name_prefix) else name
        out[key] = full.contiguous()
    return out


def _part(spec) -> int:
    """Which piece of the whole tensor a rank's shard is: its tp rank (`ShardSpec`), its
    (ep rank, tp rank) piece (`ExpertSlice.part`), 0 when held whole."""
    return 0 if spec is None else getattr(spec, "part", spec.rank)


def save_hf_directory(tensors: dict[str, torch.Tensor], model: nn.Module,
                      output_dir: str | Path) -> Path:
    """`tensors` (whole, original names) as an HF `save_pretrained` directory, with `model`'s
    config and generation config (the user's model: its parameters may be on meta), in the
    layout `save_pretrained` writes (`to_hub_layout`)."""
    from huggingface_hub import save_torch_state_dict

    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = to_hub_layout(model, tensors)
    save_torch_state_dict(tensors, out, metadata={"format": "pt"})
    config = getattr(model, "config", None)
    if config is not None:
        config.save_pretrained(out)
    generation = getattr(model, "generation_config", None)
    can_generate = getattr(model, "can_generate", lambda: False)
    if generation is not None and can_generate():
        generation.save_pretrained(out)
    return out
