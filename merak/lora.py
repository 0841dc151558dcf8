"""LoRA fine-tuning through peft, on any (dp, tp, pp) layout.

The adapters are peft's own layers (`peft.get_peft_model`; not a copy): Merak only places them.

- Wrapping (`wrap`): ``MerakArguments(lora_config="lora.json", adapter_name=...)`` wraps the
  user's model before the 3D build; a model the user wrapped with `get_peft_model` is used as
  it is. A meta-built model is wrapped inside its own init record
  (`init_empty_weights(record)`), so each rank initializes its adapters exactly as the
  single-process peft model would (peft draws A after the model's draws).
- Tensor parallelism (`merak.tensor_parallel.layers.lora_adapters`, called by
  `apply_tensor_parallel` for each LoRA layer the plan names): the base layer gets the plan's style;
  a column-parallel layer's B is column-parallel too (output rows split, its input's gradient summed
  over TP ranks), a row-parallel layer's A is row-parallel (input columns split, the rank-r product
  summed over TP before B). The sum is the unsharded peft model's output, exactly.
- Frozen base weights: peft sets ``requires_grad=False``; the pipeline, the dp gradient
  all-reduce and the optimizer skip them (they only ever see trainable parameters).
- Export (`adapter_tensors`, `merged_tensors`): a PEFT directory ``PeftModel.from_pretrained``
  loads, or, merged, plain HF weights.
"""

from __future__ import annotations

import contextlib
import copy
import json
import sys
from pathlib import Path

import torch
from torch import nn

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # a peft model's parameter names start so


def load_lora_config(source: str | Path):
    """A peft `LoraConfig` from a JSON file (its fields: ``r``, ``lora_alpha``,
    ``lora_dropout``, ``target_modules``, ...), a directory holding adapter_config.json, or
    the JSON text itself."""
    from peft import LoraConfig

    text = str(source).strip()
    path = Path(source)
    if text.startswith("{"):
        try:
            fields = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"lora_config={text!r} is not valid JSON: {error}") from error
    elif path.is_dir() and (path / ADAPTER_CONFIG).exists():  # as peft saved it
        return LoraConfig.from_pretrained(str(path))
    else:
        if not path.exists():
            raise ValueError(f"lora_config: no such file {path} (give a JSON file of peft "
                             f"LoraConfig fields, e.g. {{\"r\": 8, \"target_modules\": "
                             f"[\"q_proj\", \"v_proj\"]}})")
        fields = json.loads(path.read_text())
    fields.pop("peft_type", None)
    try:
        return LoraConfig(**fields)
    except TypeError as error:
        raise ValueError(f"lora_config {text}: {error}; its keys must be peft LoraConfig "
                         f"fields") from error


def is_peft_model(model: nn.Module) -> bool:
    peft = sys.modules.get("peft")  # a model is only a peft model if peft was imported
    return peft is not None and isinstance(model, peft.PeftModel)


def is_lora_layer(module: nn.Module) -> bool:
    lora = sys.modules.get("peft.tuners.lora")
    return lora is not None and isinstance(module, lora.LoraLayer)


def base_layer(module: nn.Module) -> nn.Module:
    """The layer a LoRA layer adapts (the module itself otherwise): what the TP plan shards."""
    return module.get_base_layer() if is_lora_layer(module) else module


@contextlib.contextmanager
def adapters_disabled(module: nn.Module):
    """Inside: every LoRA layer of `module` computes its base layer alone (peft's own switch,
    which also stops the adapters' gradients); yields a function that switches them off again
    (for code inside that turns them back on, as TRL's reference forwards do on exit);
    enabled again on exit."""
    layers = [m for m in module.modules() if is_lora_layer(m) and not m.disable_adapters]

    def off() -> None:
        for layer in layers:
            layer.enable_adapters(False)

    off()
    try:
        yield off
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def wrap(model: nn.Module, lora_config, adapter_name: str = "default",
         seed: int | None = None) -> nn.Module:
    """`model` with peft LoRA adapters (`lora_config`: a `LoraConfig` or a path for
    `load_lora_config`). A meta model's adapters join its init record. With `seed`, the
    adapters are made right after ``transformers.set_seed(seed)`` (recorded as a reseed, so
    every layout initializes them as single-process peft would after that call)."""
    from peft import get_peft_model
    from transformers import set_seed

    from merak.materialize.meta import init_empty_weights, record_of

    if is_peft_model(model):
        raise ValueError("the model is already a peft model (get_peft_model); leave "
                         "lora_config unset, or pass the model before wrapping it")
    config = lora_config if not isinstance(lora_config, (str, Path)) \
        else load_lora_config(lora_config)
    if getattr(config, "use_dora", False):
        raise ValueError("lora_config: use_dora=True (DoRA) is not supported by Merak's "
                         "tensor-parallel LoRA; set use_dora=False")
    record = record_of(model) if any(p.is_meta for p in model.parameters()) else None

    def make():
        if seed is not None:
            set_seed(seed)
        return get_peft_model(model, config, adapter_name=adapter_name)

    try:
        if record is None or record.recording:  # (already recorded by the build around us)
            return make()
        with init_empty_weights(record):
            return make()
    except ValueError as error:
        if "not found in the base model" not in str(error):
            raise
        linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                          if isinstance(m, nn.Linear)})
        raise ValueError(f"lora_config: target_modules {config.target_modules} match no module "
                         f"of {type(model).__name__}; its linear layers are named "
                         f"{linears}") from error


def inside_lora(name: str, lora_names: set[str]) -> bool:
    """Whether module `name` is part of a LoRA layer (its base layer, adapters, dropout)."""
    return any(name.startswith(n + ".") for n in lora_names)


def base_aliases(stage: nn.Module, aliases: dict[str, list[str]]) -> dict[str, list[str]]:
    """`aliases` plus, for each base weight of a LoRA layer (``...q_proj.base_layer.weight``),
    the name the base model's checkpoint stores it under (``...q_proj.weight``)."""
    out = {n: list(a) for n, a in aliases.items()}
    for name, _ in stage.named_parameters():
        if ".base_layer." in name:
            plain = [n.replace(".base_layer.", ".") for n in [name, *out.get(name, [])]]
            out[name] = [*out.get(name, []), *plain]
    return out


def base_names(stage: nn.Module, checkpoint, aliases: dict[str, list[str]]) -> list[str]:
    """What a base model's checkpoint fills in a LoRA stage: every parameter but the
    adapters', and the buffers it stores."""
    from merak.materialize.safetensors import checkpoint_index

    index = checkpoint_index(checkpoint)
    params = {n for n, _ in stage.named_parameters()}
    return [n for n in stage.state_dict() if ".lora_" not in n and (
        n in params or any(a in index for a in [n, *aliases.get(n, ())]))]


# ----------------------------------------------------------------------------- export
def _adapter_key(name: str, adapter: str) -> str | None:
    """peft's saved name of adapter parameter `name` (``...lora_A.<adapter>.weight`` ->
    ``...lora_A.weight``), or None for a parameter that is not one of `adapter`'s."""
    for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
        marker = f".{part}.{adapter}."
        if marker in name:
            return name.replace(marker, f".{part}.")
    return None


def adapter_name_in(tensors: dict[str, torch.Tensor]) -> str:
    """The adapter name in a gathered state's parameter names (``...lora_A.<name>.weight``)."""
    names = {n.split(".lora_A.", 1)[1].split(".", 1)[0] for n in tensors if ".lora_A." in n}
    if len(names) != 1:
        raise ValueError(f"expected the parameters of one LoRA adapter, found {sorted(names)}")
    return names.pop()


def adapter_tensors(tensors: dict[str, torch.Tensor], adapter: str) -> dict[str, torch.Tensor]:
    """The adapter's parameters of a gathered state (whole tensors, named as in the model
    peft wraps, or as in the peft model) under the names peft's `save_pretrained` uses."""
    out = {}
    for name, tensor in tensors.items():
        key = _adapter_key(name, adapter)
        if key is not None:
            out[key if key.startswith(PEFT_PREFIX) else PEFT_PREFIX + key] = tensor
    if not out:
        raise ValueError(f"no parameters of adapter {adapter!r} in the model")
    return out


def merged_tensors(tensors: dict[str, torch.Tensor], config, adapter: str
                   ) -> dict[str, torch.Tensor]:
    """The base model's weights with the adapter merged in (W + scaling * B @ A), under the
    base model's own names (what ``from_pretrained`` of the HF family loads)."""
    scaling = config.lora_alpha / (config.r ** 0.5 if config.use_rslora else config.r)
    out = {}
    for name, tensor in tensors.items():
        if _adapter_key(name, adapter) is not None or ".lora_" in name:
            continue
        base = name.removeprefix(PEFT_PREFIX)
        if ".base_layer." in base:
            layer = name.rsplit(".base_layer.", 1)[0]
            a = tensors.get(f"{layer}.lora_A.{adapter}.weight")
            b = tensors.get(f"{layer}.lora_B.{adapter}.weight")
            base = base.replace(".base_layer.", ".")
            if a is not None and b is not None and name.endswith(".weight"):
                delta = (b.float() @ a.float()) * scaling
                tensor = (tensor.float() + (delta.T if config.fan_in_fan_out else delta)
                          ).to(tensor.dtype)
        out[base] = tensor
    return out


def save_adapter_directory(tensors: dict[str, torch.Tensor], config, adapter: str,
                           base_name: str | None, out_dir: str | Path) -> Path:
    """A PEFT directory (adapter_config.json + adapter_model.safetensors) from a gathered
    state: ``PeftModel.from_pretrained(base_model, out_dir)`` loads it."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in adapter_tensors(tensors, adapter).items()},
              out / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    config = copy.copy(config)
    config.base_model_name_or_path = base_name
    config.save_pretrained(out)
    return out
