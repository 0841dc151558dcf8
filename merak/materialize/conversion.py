"""Checkpoint layouts that transformers converts on load, read and written one stage at a time.

transformers 5 stores some models differently on disk and in memory: `save_pretrained` of a
Mixtral writes the Hub's per-expert tensors (``block_sparse_moe.experts.3.w1.weight``) and
`from_pretrained` merges them into fused parameters (``mlp.experts.gate_up_proj``) through the
model class's checkpoint conversion mapping (`WeightRenaming` / `WeightConverter` with
operations such as `MergeModulelist` and `Concatenate`). A per-rank loader that reads tensors by
parameter name finds none of them, so this module derives each parameter from its checkpoint
tensors with transformers' own mapping for the class (`get_model_conversion_mapping`, the list
`from_pretrained` applies) and transformers' own operations, never a table of ours: a family
transformers learns to convert converts here too. Only the sources of the wanted parameters are
read. The reverse (`to_hub_layout`) is transformers' `revert_weight_conversion`, what
`save_pretrained` applies, so Merak's HF exports are what `save_pretrained` writes.

A transformers without these modules (4.x) converts nothing on load; names are then read as
they are.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

try:  # transformers >= 5
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import (
        WeightConverter,
        WeightRenaming,
        dot_natural_key,
        rename_source_key,
        revert_weight_conversion,
    )
except ImportError:  # pragma: no cover - transformers 4.x stores what it holds
    get_model_conversion_mapping = None


def hf_model_in(model: nn.Module) -> nn.Module | None:
    """The HF `PreTrainedModel` whose names a checkpoint uses: `model` itself, or the first one
    it holds (a wrapper such as MerakTrainer's model-with-loss); None if there is none."""
    try:
        from transformers import PreTrainedModel
    except ImportError:  # pragma: no cover
        return None
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


@dataclass
class Derivation:
    """How checkpoint tensors become model tensors: `sources` (checkpoint name, the
    converter's source pattern it matched) and, for a conversion, the `converter` and the name
    of its first target (what transformers passes to ``convert``); `targets` it produces."""

    sources: list[tuple[str, str | None]]
    converter: object | None = None
    first: str = ""
    targets: list[str] = field(default_factory=list)

    def describe(self) -> str:
        if self.converter is None:
            return f"read from {self.sources[0][0]}"
        ops = ", ".join(map(repr, self.converter.operations))
        return f"{ops} of {[s for s, _ in self.sources][:4]}{' ...' * (len(self.sources) > 4)}"


class CheckpointLayout:
    """transformers' checkpoint conversions for one model (built before tensor parallelism
    changes its modules): which checkpoint tensors each model tensor is derived from, and the
    derivation itself.

    Args:
        model: the HF model (or a module holding one); its parameters may be on meta.
    """

    def __init__(self, model: nn.Module):
        self.model = hf_model_in(model)
        self.transforms = []
        if self.model is not None and get_model_conversion_mapping is not None:
            self.transforms = get_model_conversion_mapping(self.model)
        # the model's own names decide, as in from_pretrained, whether a base-model prefix is
        # added or dropped (a checkpoint saved from the base model)
        self.names = ({n: True for n in self.model.state_dict()} if self.model is not None
                      else {})

    @property
    def converts(self) -> bool:
        return bool(self.transforms)

    def derivations(self, checkpoint_names: Iterable[str]) -> dict[str, Derivation]:
        """Model tensor name -> its `Derivation` from `checkpoint_names`, renamed and grouped as
        transformers' ``convert_and_load_state_dict_in_model`` does (natural order of the names,
        so experts stack in index order)."""
        if not self.converts:
            return {n: Derivation([(n, None)], first=n, targets=[n]) for n in checkpoint_names}
        renamings = [t for t in self.transforms if isinstance(t, WeightRenaming)]
        converters = [t for t in self.transforms if isinstance(t, WeightConverter)]
        by_pattern = {p: c for c in converters for p in c.source_patterns}
        prefix = getattr(self.model, "base_model_prefix", None) or None
        table: dict[str, Derivation] = {}
        groups: dict[str, Derivation] = {}  # a converter's first target -> its derivation
        for key in sorted(checkpoint_names, key=dot_natural_key):
            name, pattern = rename_source_key(key, renamings, converters, prefix, self.names)
            if name not in self.names and key in self.names:  # stored as the model names it
                name, pattern = rename_source_key(key, [], [], prefix, self.names)
            if pattern is None:
                table[name] = Derivation([(key, None)], first=name, targets=[name])
                continue
            group = groups.get(name)
            if group is None:
                converter = by_pattern[pattern]
                first, targets = converter.target_patterns[0], converter.target_patterns
                group = groups[name] = Derivation(
                    [], converter, name, [name.replace(first, t) for t in targets])
                table.update(dict.fromkeys(group.targets, group))
            group.sources.append((key, pattern))
        return table

    def derive(self, derivation: Derivation, read: Callable[[str], torch.Tensor]
               ) -> dict[str, torch.Tensor]:
        """The model tensors `derivation` makes, its sources read with `read(name)` (once each,
        when the converter asks for them)."""
        if derivation.converter is None:
            return {derivation.first: read(derivation.sources[0][0])}
        converter = copy.deepcopy(derivation.converter)  # it collects state while converting
        for key, pattern in derivation.sources:
            converter.add_tensor(derivation.first, key, pattern, lambda key=key: read(key))
        out = converter.convert(derivation.first, model=self.model,
                                config=getattr(self.model, "config", None))
        return {n: t[0] if isinstance(t, list) else t for n, t in out.items()}

    def tried(self, name: str) -> str:
        """What would have made model tensor `name`: the conversion whose targets match it (its
        operations and the checkpoint names it reads), else a plain read under `name`."""
        for transform in self.transforms:
            if not isinstance(transform, WeightConverter):
                continue
            try:
                reverse = transform.reverse_transform()
            except (ValueError, NotImplementedError):  # an operation without a reverse
                continue
            if reverse.rename_source_key(name)[1] is not None:
                ops = ", ".join(map(repr, transform.operations))
                return f"{ops} of checkpoint tensors {transform.source_patterns}"
        return "a tensor stored under this name"


def to_hub_layout(model: nn.Module | None, tensors: dict[str, torch.Tensor]
                  ) -> dict[str, torch.Tensor]:
    """`tensors` (whole, the model's names) as `save_pretrained` writes them: tied copies
    dropped (the names the model declares as tied, when their source is there too), then
    transformers' reverse conversions applied (`revert_weight_conversion`), so a Mixtral
    exports per-expert tensors again."""
    hf = hf_model_in(model) if model is not None else None
    if hf is None:
        return tensors
    tied = getattr(hf, "all_tied_weights_keys", None) or {}
    tensors = {n: t for n, t in tensors.items() if not (n in tied and tied[n] in tensors)}
    if get_model_conversion_mapping is None:
        return tensors
    # split tensors are views of one storage, which safetensors refuses to write as such
    return {n: t.clone() if t._base is not None or not t.is_contiguous() else t
            for n, t in revert_weight_conversion(hf, tensors).items()}


def meta_model_for(config) -> nn.Module | None:
    """A meta-device model of `config`'s architecture (for its conversion mapping and tied
    names when no model object is at hand, as in ``merak export``); None if transformers
    cannot build one."""
    import transformers

    # a config saved from a from_config model names no architecture: the causal LM of its type
    names = getattr(config, "architectures", None) or ["AutoModelForCausalLM"]
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is None:
            continue
        try:
            with torch.device("meta"):
                return cls.from_config(config) if name.startswith("Auto") else cls(config)
        except Exception as error:  # noqa: BLE001 - the export still writes the names it has
            warnings.warn(f"{name} could not be built from the checkpoint's config ({error}); "
                          f"its tensors are written under their own names", stacklevel=2)
    return None
