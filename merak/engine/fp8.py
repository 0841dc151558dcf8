"""fp8 training through torchao's float8 linears (`PrecisionOptions.fp8`, `MerakArguments.fp8`).

`build_engine` converts each rank's stage after the split and TP and before the optimizer is
made: every plain `nn.Linear` of the stage becomes a torchao `Float8Linear` (its matmuls in
float8 with dynamic scales, ``tensorwise`` or ``rowwise``), except the layers kept in high
precision, which are listed with their reason (`Float8Report`):

- the LM head (``lm_head``, or a linear whose weight is an embedding's, tied): the logits feed a
  softmax over the whole vocabulary, whose range fp8 does not keep;
- MoE routers (a module named ``router``, or ``gate`` as a whole name part, the HF routers'
  name; Llama's ``gate_proj`` is an MLP projection and is converted): a top-k choice flips
  under fp8 rounding;
- layers whose in or out features do not divide by 16 (fp8 GEMMs need multiples of 16);
- subclasses of `nn.Linear` with their own forward (converting would drop it);
- the user's ``fp8_exclude`` patterns;
- peft's LoRA adapters (``lora_A``, ``lora_B``): a LoRA layer's ``base_layer`` is converted,
  its trained low-rank matrices stay in high precision.

The layer is converted in place (its class is swapped, torchao's attributes added, its
`weight` and `bias` parameters kept), so the stage's graphs, tied-weight groups and the
checkpoint's names (the HF names) see the same modules and parameters: a checkpoint saves the
high-precision weights and resumes with or without fp8.

Without an fp8-capable GPU (CPU, or CUDA below compute capability 8.9) torchao emulates the fp8
matmuls (``emulate=True``): the same casts and scales, the products in high precision.

In a pipeline stage only the blocks are modules; what lies outside them (the embedding, the final
norm, the LM head) the split's graph runs as traced ops, which stay in high precision: the LM
head is listed as kept all the same.

Under tensor parallelism Merak's column- and row-parallel linears become their float8 classes
(`merak.engine.fp8_tp`), whose casts all-reduce the amax over the TP group where a shard's own
would differ from the full tensor's: every rank scales as one process would. Under context
parallelism the casts over the tokens reduce their amax over the cp group likewise.

Under ZeRO-2/3 with ``tensorwise`` FSDP2 all-gathers the plain float8 linears' weights in
float8 (torchao's ``enable_fsdp_float8_all_gather``, `gathers_in_float8`), with their scales
computed after each optimizer step (`Float8WeightScales`); ``rowwise`` gathers in high
precision. What fp8 does not compose with is refused by `merak.rules` before anything is built.
"""

from __future__ import annotations

import dataclasses
import fnmatch
from dataclasses import dataclass, field

import torch
from torch import nn

from merak import lora
from merak.runtime.hooks import InstructionHook
from merak.tensor_parallel.layers.megatron import ColumnParallelLinear, RowParallelLinear

RECIPES = ("tensorwise", "rowwise")
HEAD = "the LM head (the logits' softmax needs more range than fp8)"
ADAPTER = "a LoRA adapter (the trained low-rank matrices stay in high precision)"
# the linears converted: plain ones, and Merak's tensor-parallel ones (`merak.engine.fp8_tp`)
CONVERTED = (nn.Linear, ColumnParallelLinear, RowParallelLinear)


def check_recipe(recipe: str | None, owner: str = "fp8") -> None:
    """A ValueError naming `owner` unless `recipe` is None or one of `RECIPES`."""
    if recipe is not None and recipe not in RECIPES:
        raise ValueError(f"{owner}={recipe!r} is not one of {[None, *RECIPES]}")


def emulates(device: torch.device | str) -> bool:
    """Whether fp8 matmuls are emulated on `device`: anything but a CUDA GPU of compute
    capability 8.9 or above (Ada, Hopper and later)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return True
    return torch.cuda.get_device_capability(device) < (8, 9)


def float8_config(recipe: str, *, emulate: bool, fsdp_all_gather: bool = False):
    """torchao's `Float8LinearConfig` of `recipe`, emulated or not; `fsdp_all_gather`: FSDP2
    all-gathers the weights in float8 (torchao supports it for ``tensorwise`` only)."""
    from torchao.float8 import Float8LinearConfig

    check_recipe(recipe)
    return dataclasses.replace(Float8LinearConfig.from_recipe_name(recipe), emulate=emulate,
                               enable_fsdp_float8_all_gather=fsdp_all_gather)


def gathers_in_float8(precision, ctx) -> bool:
    """Whether ZeRO-2/3 all-gathers the float8 linears' weights in float8 (torchao's
    ``enable_fsdp_float8_all_gather``): ``tensorwise`` under ZeRO-2/3 over more than one
    replica. ``rowwise`` (one scale per row, which torchao's all-gather does not support) and
    Merak's tensor-parallel float8 linears (whose weight scales are reduced over tp as well)
    gather their high-precision weights (plain FSDP2) and cast after."""
    return precision.fp8 == "tensorwise" and precision.zero_stage >= 2 and ctx.replicas > 1 \
        and getattr(ctx, "cp", 1) == 1


def matches(name: str, pattern: str) -> bool:
    """Whether module name `name` matches an ``fp8_exclude`` pattern: a glob (fnmatch) found
    anywhere in the full name (``mlp.down_proj``, ``layers.0.*``, ``q_proj``)."""
    return fnmatch.fnmatchcase(name, pattern) or fnmatch.fnmatchcase(name, f"*{pattern}*")


def kept_reason(name: str, module: nn.Linear, exclude: tuple[str, ...] = (),
                embedding_weights: frozenset[int] = frozenset(),
                adapters: frozenset[int] = frozenset()) -> str | None:
    """Why the linear `name` stays in high precision, or None to convert it."""
    parts = name.split(".")
    found = [p for p in exclude if matches(name, p)]
    if found:
        return f"fp8_exclude {found[0]!r}"
    if id(module) in adapters:
        return ADAPTER
    if parts[-1] == "lm_head" or id(module.weight) in embedding_weights:
        return HEAD
    if parts[-1] in ("gate", "router") or "router" in parts[-1]:
        return "an MoE router (its top-k choice would flip under fp8 rounding)"
    if module.in_features % 16 or module.out_features % 16:
        return (f"features {module.in_features} -> {module.out_features} do not divide by 16 "
                f"(fp8 GEMMs need multiples of 16)")
    if type(module) not in CONVERTED:
        return f"a {type(module).__name__}, an nn.Linear subclass with its own forward"
    return None


@dataclass
class Float8Report:
    """What `convert_` did: the converted linears and the kept ones with their reasons."""

    recipe: str
    emulate: bool
    converted: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)

    def lines(self) -> list[str]:
        head = (f"fp8 ({self.recipe}{', emulated' if self.emulate else ''}): "
                f"{len(self.converted)} linear layers converted, {len(self.kept)} kept in high "
                f"precision")
        return [head, *(f"  kept {name}: {why}" for name, why in self.kept.items())]


def convert_(module: nn.Module, recipe: str, *, exclude: tuple[str, ...] = (),
             emulate: bool | None = None, fsdp_all_gather: bool = False,
             cp_group=None) -> Float8Report:
    """Convert the linears of `module` to torchao float8 linears in place (see the module's
    docstring); `emulate` defaults to `emulates` of the module's device; `fsdp_all_gather`
    wraps the plain linears' weights for FSDP2's float8 all-gather (`gathers_in_float8`);
    `cp_group`: context parallelism's group (each rank holds a share of the tokens), over which
    the casts of the token dimension reduce their amax (`merak.engine.fp8_tp`)."""
    from torchao.float8.float8_linear import Float8Linear

    if emulate is None:
        first = next(module.parameters(), None)
        emulate = emulates(first.device if first is not None else "cpu")
    config = float8_config(recipe, emulate=emulate)
    gathered = float8_config(recipe, emulate=emulate, fsdp_all_gather=True) \
        if fsdp_all_gather else config
    report = Float8Report(recipe, emulate)
    embedding_weights = frozenset(id(m.weight) for m in module.modules()
                                  if isinstance(m, nn.Embedding))
    adapters = lora_adapters(module)
    seen: set[int] = set()
    for name, linear in module.named_modules():
        if _traced_head(name, linear):
            report.kept[name] = f"{HEAD} (a traced op of the stage's graph)"
            continue
        if not isinstance(linear, nn.Linear) or isinstance(linear, Float8Linear) \
                or id(linear) in seen:
            continue
        seen.add(id(linear))
        why = kept_reason(name, linear, exclude, embedding_weights, adapters)
        if why is not None:
            report.kept[name] = why
            continue
        if type(linear) is nn.Linear and cp_group is None:
            to_float8_(linear, gathered, Float8Linear)
        else:
            from merak.engine.fp8_tp import to_float8_tp_

            to_float8_tp_(linear, config, to_float8_, cp_group)
        report.converted.append(name)
    return report


def lora_adapters(module: nn.Module) -> frozenset[int]:
    """The ids of the modules inside peft's LoRA layers' adapters (``lora_A``, ``lora_B``,
    ...): kept in high precision, while the layer's ``base_layer`` is converted."""
    return frozenset(id(sub) for layer in module.modules() if lora.is_lora_layer(layer)
                     for attr in layer.adapter_layer_names
                     for sub in getattr(layer, attr).modules())


def _traced_head(name: str, module: nn.Module) -> bool:
    """The LM head of a pipeline stage: outside the blocks, the split's graph runs it as a traced
    linear op on a plain holder of its weight, which no conversion reaches."""
    return type(module) is nn.Module and name.split(".")[-1] == "lm_head" \
        and "weight" in module._parameters


def to_float8_(linear: nn.Linear, config, float8_class: type, cls: type | None = None) -> None:
    """`linear` becomes a `Float8Linear` in place: torchao's own module is made from it (sharing
    its weight and bias) and lends it its attributes, and its class (or `cls`, a subclass).
    For FSDP2's float8 all-gather torchao wraps the weight in a new parameter (a
    `WeightWithDynamicFloat8CastTensor` over the same storage), which `linear` takes."""
    made = float8_class.from_float(linear, config=config)
    own = {"training", "in_features", "out_features"}
    for key, value in vars(made).items():
        if not key.startswith("_") and key not in own:
            setattr(linear, key, value)
    if made.weight is not linear.weight:
        linear.weight = made.weight
    linear.__class__ = cls or float8_class


def apply_fp8(stage: nn.Module, precision, ctx) -> Float8Report | None:
    """`build_engine`'s step: convert `stage` per `precision` (`PrecisionOptions`: ``fp8``,
    ``fp8_exclude``) and print what stayed in high precision, on the first rank of each
    pipeline stage (rank 0 for the first stage: each stage knows only its own layers)."""
    if precision.fp8 is None:
        return None
    report = convert_(stage, precision.fp8, exclude=tuple(precision.fp8_exclude),
                      emulate=emulates(ctx.device),
                      fsdp_all_gather=gathers_in_float8(precision, ctx),
                      cp_group=ctx.cp_group if getattr(ctx, "cp", 1) > 1 else None)
    first = all(getattr(ctx, f"{axis}_rank", 0) == 0 for axis in ("dp", "tp", "cp"))
    if first:
        where = f"stage {getattr(ctx, 'pp_rank', 0)}: "
        print("\n".join(where + line for line in report.lines()), flush=True)
    return report


class Float8WeightScales(InstructionHook):
    """Under FSDP2's float8 all-gather: after each optimizer step, every float8 weight's
    tensorwise scale from its updated shards, in one all-reduce over the replicas (torchao's
    `precompute_float8_dynamic_scale_for_fsdp`), so the step's all-gathers cast with it
    instead of each reducing its own amax. Before the first step the all-gathers compute it."""

    def __init__(self, stage: nn.Module):
        self.stage = stage

    def on_instruction_end(self, name: str, action) -> None:
        if name == "optimizer_step":
            from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

            precompute_float8_dynamic_scale_for_fsdp(self.stage)
