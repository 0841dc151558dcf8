"""Tensor parallelism for peft's LoRA layers: the adapters of a sharded layer are sharded the
matching way, and every adapter inside the blocks must sit on a layer the plan shards."""

from __future__ import annotations

from torch import nn

from merak.lora import is_lora_layer
from merak.tensor_parallel.layers import megatron


def shard_adapters(module: nn.Module, name: str, style: str, group, rank: int, tp: int, *,
                   chunks: tuple[int, ...] | None = None, gather_output: bool = False,
                   input_is_parallel: bool = True, cache: dict | None = None) -> None:
    """Make the adapters of LoRA layer `module` (whose base layer was just made `style`:
    'column' or 'row'; `chunks`: the fused parts of a column layer's output, e.g. GPT-2's
    q, k, v) tensor-parallel the matching way."""
    for adapter, lora_a in module.lora_A.items():
        lora_b = module.lora_B[adapter]
        if not (isinstance(lora_a, nn.Linear) and isinstance(lora_b, nn.Linear)):
            raise ValueError(f"{name}: tensor-parallel LoRA needs linear adapters, got "
                             f"{type(lora_a).__name__} / {type(lora_b).__name__}")
        if style == "column":
            megatron.make_column_parallel_(lora_b, f"{name}.lora_B.{adapter}", group, rank, tp,
                                         chunks=chunks, gather_output=gather_output,
                                         cache=cache)
        else:
            megatron.make_row_parallel_(lora_a, f"{name}.lora_A.{adapter}", group, rank, tp,
                                      cache=cache)
            lora_a.input_is_parallel = input_is_parallel


def check_tp_targets(named, converted: set[str]) -> None:
    """Every LoRA layer inside the blocks must adapt a layer the TP plan shards: the plan says
    nothing of whether an unlisted layer's input is whole or a per-rank part."""
    unknown = [n for n, m in named if is_lora_layer(m) and n not in converted]
    if unknown:
        raise ValueError(f"LoRA adapters on {unknown[:3]}{' ...' if len(unknown) > 3 else ''}, "
                         f"which the tensor-parallel plan does not shard: remove them from "
                         f"lora_config's target_modules, or give them a style with "
                         f"merak.set_tp_layer_lists")
