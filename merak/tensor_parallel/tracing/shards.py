"""The layout of a sharded value in a recorded block, and how views and permutations move it
(`merak.tensor_parallel.tracing.op_rules`, `merak.tensor_parallel.tracing.propagate`).

A value sharded by `Shard(dim, pos)` holds, along `dim`, the elements whose index reads
``hi * (tp * pos) + rank * pos + lo``: ``pos`` of every period of ``tp * pos``. A column's
output split into equal blocks has ``pos = width / tp``; viewed as ``(heads, head_dim)`` the
shard moves to the heads dim (``pos = heads / tp``); merged with the batch as ``(b * heads)``
it stays expressible (``pos = heads / tp`` within each period of ``heads``).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.utils import _pytree as pytree

from merak.tensor_parallel.tracing.trace import Node, Value


class Unplaceable(Exception):
    """The columns tried cannot be sharded exactly; the message says why."""


@dataclass(frozen=True)
class Shard:
    dim: int
    pos: int
    source: str | None = None  # the column linear whose whole output this still is


def tensors(node: Node) -> list[Value]:
    return [v for v in pytree.tree_leaves((node.args, node.kwargs)) if isinstance(v, Value)]


def outputs(node: Node) -> list[Value]:
    return [o for o in node.outputs if isinstance(o, Value)]


def arg(node: Node, index: int, name: str, default=None):
    if name in node.kwargs:
        return node.kwargs[name]
    return node.args[index] if len(node.args) > index else default


def dim_list(value, ndim: int) -> list[int] | None:
    if value is None:
        return None
    return [int(d) % ndim for d in (value if isinstance(value, (list, tuple)) else [value])]


def size_args(node: Node, start: int = 1) -> list:
    rest = node.args[start:]
    if len(rest) == 1 and isinstance(rest[0], (list, tuple)):
        return list(rest[0])
    return list(rest)


def view_groups(a: tuple, b: tuple) -> list[tuple[list[int], list[int]]]:
    """The dims of shape `a` and of shape `b` (as many elements) a view maps onto each other."""
    groups, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        ia, jb, pa, pb = [i], [j], a[i], b[j]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                ia.append(i)
                pa *= a[i]
                i += 1
            else:
                jb.append(j)
                pb *= b[j]
                j += 1
        groups.append((ia, jb))
    if groups:
        groups[-1][0].extend(range(i, len(a)))
        groups[-1][1].extend(range(j, len(b)))
    return groups


def map_view(a: tuple, b: tuple, shard: Shard, tp: int) -> Shard | None:
    """The shard of a view of shape `b` of a value of shape `a` sharded by `shard`, or None
    when the view spreads the per-rank part over two dims."""
    for ia, jb in view_groups(a, b):
        if shard.dim not in ia:
            continue
        flat = shard.pos
        for d in ia:
            flat *= a[d] if d > shard.dim else 1
        after = 1
        for d in reversed(jb):
            if flat % after == 0 and (after * b[d]) % (flat * tp) == 0:
                same = b[d] == a[shard.dim] and flat // after == shard.pos
                return Shard(d, flat // after, shard.source if same else None)
            after *= b[d]
        return None
    return None


def permutation(node: Node, name: str, nd: int) -> list[int]:
    """The input dim of each output dim of a transpose-like op."""
    order = list(range(nd))
    if name in ("transpose", "swapaxes", "swapdims"):
        a, b = int(node.args[1]) % nd, int(node.args[2]) % nd
        order[a], order[b] = order[b], order[a]
    elif name == "permute":
        order = [int(d) % nd for d in size_args(node)]
    elif name in ("movedim", "moveaxis"):
        src, dst = dim_list(node.args[1], nd), dim_list(node.args[2], nd)
        rest = [d for d in range(nd) if d not in src]
        order = [None] * nd
        for a, b in zip(src, dst):
            order[b] = a
        order = [d if d is not None else rest.pop(0) for d in order]
    elif name in ("mT", "mH"):
        order[-2], order[-1] = order[-1], order[-2]
    else:  # t, T, H
        order.reverse()
    return order
