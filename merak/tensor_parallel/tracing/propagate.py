"""Where a set of column-parallel linears puts sharded values in one recorded block
(`merak.tensor_parallel.tracing.trace`), op by op, and what else that asks of the plan.

A sharded value holds, along one dim, this rank's part of a tp-way split: a dim index reads
``hi * (tp * pos) + rank * pos + lo`` (`Shard`: ``pos`` elements of each period of ``tp * pos``).
A column-parallel linear's output starts sharded along its features (``pos = out / tp``); views
carry the split into a head dim (``view(b, s, H, d)``: ``pos = H / tp``) and back, element-wise
ops, norms and reductions over other dims, attention matmuls over sharded batch or head dims
keep it; a linear reading it whole along its last dim is row-parallel. `propagate` walks the
block once and returns what it found (`Region`), or raises `Unplaceable` with the reason: a
reduction or contraction over the sharded dim, a view that splits it across dims, an op it does
not know, a sharded value the model reads after the block. A replicated value that meets a
sharded one along the sharded dim must be sharded too: a parameter (split along that dim), a
block input (sliced per rank), a tensor made from an attribute (the attribute divided), or the
output of another linear, which then joins the columns (`Region.more_columns`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.utils import _pytree as pytree

from merak.tensor_parallel.tracing.op_rules import (
    ACTIVATIONS,
    CREATE,
    NARY,
    PERMUTES,
    RULES,
    UNARY,
    VIEWS,
    getitem,
    narrow,
    nary,
    split,
    unary,
)
from merak.tensor_parallel.tracing.shards import (
    Shard,
    Unplaceable,
    map_view,
    outputs,
    permutation,
    tensors,
    view_groups,
)
from merak.tensor_parallel.tracing.trace import SHAPE, BlockTrace, Node, Value, describe, sources_of


@dataclass
class Region:
    """What sharding `columns` asks of the plan."""

    columns: set[str]
    rows: set[str] = field(default_factory=set)
    bounds: dict[str, set[int]] = field(default_factory=dict)  # fused part boundaries
    param_shards: dict[str, tuple[int, int]] = field(default_factory=dict)  # (dim, period)
    partial: set[str] = field(default_factory=set)  # replicated params seeing this rank's part
    outside: set[str] = field(default_factory=set)  # params read by replicated ops
    inputs: dict[str, tuple[int, int]] = field(default_factory=dict)  # input path -> (dim, period)
    divide: list[frozenset] = field(default_factory=list)  # attribute sources, one of each
    head_sizes: set[int] = field(default_factory=set)  # sizes of the sharded head dims
    more_columns: set[str] = field(default_factory=set)
    # (column, k): a view split a column's whole output into k parts along the sharded dim;
    # the walk may be tried again with that output as k fused parts
    fused_guesses: list[tuple[str, int]] = field(default_factory=list)
    heads: bool = False  # a linear's features were split into sharded heads
    activation: bool = False  # a sharded value went through a non-linear activation


PART_RULES = (unary, nary, split, getitem, narrow)  # the ops fused parts of several sizes allow


class _Pass:
    """One walk of the block for one set of columns (see the module docstring)."""

    def __init__(self, trace: BlockTrace, tp: int, columns: set[str], linears: dict[str, str],
                 bounds: dict[str, set[int]]):
        self.trace, self.tp, self.linears = trace, tp, linears
        self.region = Region(set(columns), bounds={k: set(v) for k, v in bounds.items()})
        self.shard: dict[int, Shard] = {}
        self.replicated_reads: dict[int, set[str]] = {}  # node -> parameters it reads
        self.companions: set[int] = set()  # nodes that only reshape a value `meet` shards
        self.met: set[int] = set()  # replicated values `meet` made sharded

    def fail(self, node: Node, why: str):
        raise Unplaceable(f"{why} (at {describe(node)})")

    def of(self, v) -> Shard | None:
        return self.shard.get(id(v)) if isinstance(v, Value) else None

    def set(self, v, s: Shard) -> None:
        if isinstance(v, Value):
            self.shard[id(v)] = s

    def run(self) -> Region:
        try:
            for node in self.trace.nodes:
                self.node(node)
        except Unplaceable as error:
            error.region = self.region  # what the walk saw up to there (its fused guesses)
            raise
        for value, read in self.trace.outputs:
            if read and value is not None and id(value) in self.shard:
                raise Unplaceable("a sharded value leaves the block and the model reads it")
        self.region.partial -= set(self.region.param_shards)
        for index, params in self.replicated_reads.items():
            if index not in self.companions:  # not on the way to a sharded parameter's use
                self.region.outside |= params
        clash = (self.region.partial | set(self.region.param_shards)) & self.region.outside
        if clash:
            raise Unplaceable(f"parameters {sorted(clash)} are read by sharded and by "
                              f"replicated computations alike")
        return self.region

    def linear_call(self, node: Node) -> tuple[str, Value] | None:
        """(module, input) when `node` calls one of the block's linear layers."""
        if node.name == "linear" and len(node.args) > 1:
            weight, x = node.args[1], node.args[0]
        elif node.name == "addmm" and len(node.args) > 2:
            weight, x = node.args[2], node.args[1]
        elif node.name in ("matmul", "__matmul__") and len(node.args) > 1 \
                and isinstance(node.args[1], Value) and node.args[1].producer is not None \
                and self.trace.nodes[node.args[1].producer].name in ("T", "t", "mT"):
            weight, x = self.trace.nodes[node.args[1].producer].args[0], node.args[0]
        else:
            return None
        name = self.trace.params.get(id(weight)) if isinstance(weight, Value) else None
        module = self.linears.get(name) if name else None
        # the layer's own forward only: a weight read elsewhere bypasses the layer's collectives
        inside = module is not None and (node.module == module
                                         or node.module.startswith(module + "."))
        return (module, x) if inside else None

    def node(self, node: Node) -> None:
        call = self.linear_call(node)
        if call is not None:
            return self.linear(node, *call)
        found = tensors(node)
        sharded = [v for v in found if id(v) in self.shard]
        params = {v.origin[6:] for v in found if v.origin.startswith("param:")
                  and not self.of_column(v)}
        if not sharded:
            if params:
                self.replicated_reads[node.index] = params
            return None
        if node.name in ("__setitem__", "copy_", "index_put_", "masked_scatter_") \
                or node.name.endswith("_") and not node.name.endswith("__") \
                and id(found[0]) not in self.shard:
            self.fail(node, "sharded values written in place into a replicated tensor")
        if not outputs(node):
            return None
        name = node.name if node.name.endswith("__") else node.name.rstrip("_")
        self.region.partial |= params
        self.region.activation |= name in ACTIVATIONS
        rule = RULES.get(name)
        if rule is None:
            self.fail(node, f"plan inference does not know how {node.name!r} treats a sharded "
                            f"value")
        if rule not in PART_RULES and any(self.shard[id(v)].pos == 0 for v in sharded):
            self.fail(node, "fused parts of several sizes are used before they are split apart")
        rule(self, node, name)
        for v in found:  # a replicated value read with sharded ones gets this rank's part of
            # its gradient: fine for parameters only (summed over tp, `partial`), unless `meet`
            # shards it
            if v.requires_grad and id(v) not in self.shard and id(v) not in self.met \
                    and not v.origin.startswith("param:"):
                roots = self.grad_roots(v)
                if "" in roots:
                    self.fail(node, "a replicated value computed from the block's inputs meets "
                                    "sharded values (its gradient would be this rank's part)")
                self.region.partial |= roots
        return None

    def grad_roots(self, v: Value) -> set[str]:
        """The parameters a gradient through `v` reaches; "" for the block's inputs."""
        roots, todo, seen = set(), [v], set()
        while todo:
            value = todo.pop()
            if value.origin.startswith("param:"):
                roots.add(value.origin[6:])
            elif value.origin == "input" and value.requires_grad:
                roots.add("")
            elif value.producer is not None and value.producer not in seen:
                seen.add(value.producer)
                todo += [t for t in tensors(self.trace.nodes[value.producer]) if t.requires_grad]
        return roots

    def linear(self, node: Node, module: str, x: Value) -> None:
        out = outputs(node)[0]
        s = self.of(x)
        if module in self.region.columns:
            if s is not None:
                self.fail(node, f"column {module} reads a sharded value")
            width = out.shape[-1]
            edges = sorted(self.region.bounds.get(module, {0, width}))
            chunks = {b - a for a, b in zip(edges, edges[1:])}
            if any(c % self.tp for c in chunks):
                self.fail(node, f"tp={self.tp} does not divide {module}'s output parts "
                                f"{sorted(chunks)}")
            # fused parts of one size: each split apart; of several sizes (pos 0): only a split
            # into the parts may follow
            pos = chunks.pop() // self.tp if len(chunks) == 1 else 0
            self.set(out, Shard(out.ndim - 1, pos, module))
        elif s is not None:
            if s.dim != x.ndim - 1 or s.pos * self.tp != x.shape[-1]:
                self.fail(node, f"{module} reads a value sharded otherwise than in equal blocks "
                                f"of its input features")
            self.region.rows.add(module)

    def parts(self, node: Node, x: Value, s: Shard, spans: list[tuple[int, int]], outs: list,
              dim: int | None = None) -> None:
        """`outs` are the parts `spans` of `x` along its sharded dim: `x` must be a column's whole
        output, whose features are then fused parts, each split apart (part boundaries are
        collected; a walk that found new ones is repeated with them)."""
        width = x.shape[s.dim]
        if s.source is None:
            self.fail(node, "parts of a sharded dim that is no column's whole output")
        bounds = self.region.bounds.setdefault(s.source, {0, width})
        for start, stop in spans:
            bounds |= {start, stop}
        edges = sorted(bounds)
        for (start, stop), out in zip(spans, outs):
            inside = [b - a for a, b in zip(edges, edges[1:]) if start <= a and b <= stop]
            if len(set(inside)) != 1 or inside[0] % self.tp:
                self.fail(node, f"{s.source}'s output parts {inside} cannot each be split "
                                f"{self.tp} ways")
            self.set(out, Shard(s.dim if dim is None else dim, inside[0] // self.tp))

    def fused_view(self, node: Node, x: Value, s: Shard, out: Value) -> Shard:
        """A view of a column's whole output that splits its features as ``(k, N / k)``
        (``view(b, s, 2, I)`` of a fused gate and up projection): its output is k fused parts,
        each split apart."""
        width = x.shape[s.dim]
        if s.source is not None and s.pos * self.tp == width:
            for ia, jb in view_groups(x.shape, out.shape):
                if s.dim not in ia:
                    continue
                k = 1
                for d in jb[:-1]:
                    k *= out.shape[d]
                    part = width // k
                    new = map_view(x.shape, out.shape, Shard(s.dim, part // self.tp), self.tp) \
                        if width % k == 0 and part % self.tp == 0 else None
                    if new is not None and new.dim != d:
                        self.region.bounds.setdefault(s.source, {0, width}).update(
                            range(0, width + 1, part))
                        return new
        self.fail(node, "a view spreads the per-rank part of a sharded dim over two dims")

    def meet(self, node: Node, v: Value, dim: int, s: Shard) -> None:
        """Replicated `v` meets a value sharded by `s` along its own dim `dim` (full size): what
        made it, walked back through views, permutes and element-wise copies, is sharded the
        same way (a parameter, a block input, a size from an attribute), or the linears whose
        outputs it comes from join the columns."""
        seen, want = set(), Shard(dim, s.pos)
        self.met.add(id(v))
        if not s.pos:
            self.fail(node, "a replicated value meets fused parts of several sizes")
        while True:
            if self.of_column(v):  # a column's bias added by its own forward: split with it
                return
            if v.origin.startswith("param:"):
                self.region.param_shards[v.origin[6:]] = (want.dim, want.pos * self.tp)
                return
            if v.origin == "input":
                path = next(p for p, x in self.trace.inputs if x is v)
                self.region.inputs[path] = (want.dim, want.pos * self.tp)
                return
            if v.producer is None or v.producer in seen:
                break
            seen.add(v.producer)
            self.companions.add(v.producer)
            producer = self.trace.nodes[v.producer]
            if producer.name in CREATE:
                sizes = [a for a in pytree.tree_leaves(producer.args) if isinstance(a, int)]
                at = want.dim + len(sizes) - v.ndim
                if 0 <= at < len(sizes):
                    return self.need_divided(producer, sizes[at])
                break
            src = producer.args[0] if producer.args else None
            want = self._source_shard(producer, src, v, want) if isinstance(src, Value) \
                else None
            if want is None:
                break
            v = src
        linears = self.linears_before(v)
        if linears and not linears & (self.region.rows | self.region.columns):
            self.region.more_columns |= linears
            return
        self.fail(node, "a replicated value meets a sharded one along the sharded dim")

    def _source_shard(self, producer: Node, src: Value, v: Value, want: Shard) -> Shard | None:
        """How `src` must be sharded for `v` (made from it by `producer`) to be sharded as
        `want`; None when `producer` mixes the elements otherwise."""
        name, dim = producer.name, want.dim
        if name in ("expand", "expand_as", "broadcast_to"):
            at = dim - (v.ndim - src.ndim)
            return Shard(at, want.pos) if at >= 0 and src.shape[at] == v.shape[dim] else None
        if name in VIEWS:
            return map_view(v.shape, src.shape, want, self.tp)
        if name in PERMUTES:
            return Shard(permutation(producer, name, src.ndim)[dim], want.pos)
        slices_only = name == "__getitem__" and not any(
            isinstance(i, (int, Value)) or i is None for i in pytree.tree_leaves(producer.args[1:]))
        scalar_op = name in NARY and len(tensors(producer)) == 1  # p * 2.0
        if (name in UNARY or scalar_op or slices_only) and src.ndim == v.ndim \
                and src.shape[dim] == v.shape[dim]:
            return want
        return None

    def of_column(self, v: Value) -> bool:
        """Whether `v` is a parameter of a column (its conversion splits it)."""
        return v.origin.startswith("param:") \
            and v.origin[6:].rpartition(".")[0] in self.region.columns

    def linears_before(self, v: Value) -> set[str]:
        """The block's linears whose outputs reach `v` without passing another linear."""
        found, todo, seen = set(), [v], set()
        while todo:
            value = todo.pop()
            if value.producer is None or value.producer in seen:
                continue
            seen.add(value.producer)
            producer = self.trace.nodes[value.producer]
            call = self.linear_call(producer)
            if call is not None:
                found.add(call[0])
            else:
                todo.extend(tensors(producer))
        return found

    def need_divided(self, node: Node, size) -> None:
        """`size` is an argument of `node` along a sharded dim: it must shrink with it (read
        from a sharded dim of a sharded value, or from attributes, which are divided)."""
        if not isinstance(size, int) or size in (-1, 0):
            return
        sources = sources_of(size)
        for owner, key in sources:
            if owner == SHAPE:
                value, dim = self.trace.shapes[key]
                shard = self.of(value)
                if shard is not None and shard.dim == dim:
                    return
        attrs = frozenset(s for s in sources if s[0] != SHAPE)
        if not attrs:
            self.fail(node, f"the size {int(size)} along the sharded dim is a constant or is "
                            f"read from a replicated value")
        self.region.divide.append(attrs)


def propagate(trace: BlockTrace, tp: int, columns: set[str], linears: dict[str, str],
              bounds: dict[str, set[int]] | None = None) -> Region:
    """Walk `trace` with `columns` column-parallel (see the module docstring). `linears` maps
    the block's linear weights (relative names) to their modules; `bounds` the fused part
    boundaries found by an earlier walk (a split of a column's output along its features)."""
    return _Pass(trace, tp, columns, linears, bounds or {}).run()
