"""Which modules of a model are its repeated blocks: the layers a split assigns to stages,
tensor parallelism shards and recomputation wraps."""

from __future__ import annotations

from torch import nn


def within(name: str, prefix: str) -> bool:
    """Whether module `name` is `prefix` or one of its submodules."""
    return name == prefix or name.startswith(prefix + ".")


def find_blocks(model: nn.Module) -> list[str]:
    """FQNs of the layers to split between stages: the children of every outermost ModuleList
    of two or more modules that each hold parameters. The layers may be of several types
    (hybrid models: Inkling-2's sliding and full attention layers, OLMo-hybrid's linear and
    full attention, Mllama's self- and cross-attention); a list of parameter-free modules
    (Granite-SWA's rotary embedding per layer type) is glue, not layers. A list of one layer
    counts only when there is no longer one (Zamba-2 has an adapter list of one inside its
    hybrid layer)."""
    return _block_lists(model, 2) or _block_lists(model, 1)


def _block_lists(model: nn.Module, least: int) -> list[str]:
    lists, blocks = [], []
    for name, m in model.named_modules():
        if any(name.startswith(o + ".") for o in lists) or not isinstance(m, nn.ModuleList):
            continue
        if len(m) >= least and all(any(True for _ in c.parameters()) for c in m):
            lists.append(name)
            blocks += [f"{name}.{i}" if name else str(i) for i in range(len(m))]
    return blocks
