"""The Phillips-Dessouky min cut of lowtime, in exact integer arithmetic (scipy's max flow).

Each iteration of the solver cuts the critical DAG, whose edges carry flow bounds ``lb <= flow
<= ub`` (multiples of lowtime's ``FP_ERROR``, 1e-6), and lowtime's compiled `find_min_cut`
(Rust, two Edmonds-Karp max flows in floating point) is most of the planner's time. Its answer
is the source side of the minimal minimum cut: a feasible flow (a max flow from a new source to
a new sink that meet every lower bound), then a max flow from source to sink in its residual
graph, then the nodes reachable from the source over residual capacity. In exact arithmetic
that set is the same for every maximum flow (it is the intersection of all minimum cuts), so
here the bounds become whole units and scipy's Dinic max flow finds it, several times faster.

lowtime's floating-point arithmetic agrees with the exact answer except where a residual of one
unit is compared with its one-unit threshold (``> FP_ERROR`` when it searches the residual
graph, ``< FP_ERROR`` when it drops capacities before its second max flow): ties that its
rounding breaks either way. `minimal_min_cut` returns None wherever such a tie could change the
answer (and where the units do not fit scipy's 32-bit capacities), and the solver asks lowtime's
own min cut instead; so each iteration's cut is lowtime's. ``MERAK_ENERGY_CHECK_CUTS=1`` runs
both on every iteration and raises where they differ (`tests/test_energy_planning.py` does).
"""

from __future__ import annotations

import numpy as np
import scipy.sparse as sp
from scipy.sparse.csgraph import breadth_first_order, maximum_flow

_LIMIT = 2 ** 30  # capacities and flows stay well inside scipy's int32


class _Graph:
    """The critical DAG's edges ``head -> tail`` (node indices ``0..n-1``) and, for residual
    graphs, their reverses: capacities arrays hold the forward edges' then the backward's."""

    def __init__(self, n: int, head: np.ndarray, tail: np.ndarray):
        self.n, self.head, self.tail = n, head, tail
        self.rows, self.cols = np.concatenate([head, tail]), np.concatenate([tail, head])

    def csr(self, caps: np.ndarray, rows=None, cols=None, n=None) -> sp.csr_array:
        """The graph of the edges with positive capacity (scipy: explicit zeros are edges)."""
        rows = self.rows if rows is None else rows
        cols = self.cols if cols is None else cols
        n = self.n if n is None else n
        keep = caps > 0
        rows, cols, caps = rows[keep], cols[keep], caps[keep]
        order = np.lexsort((cols, rows))
        indptr = np.zeros(n + 1, dtype=np.int32)
        np.cumsum(np.bincount(rows, minlength=n), out=indptr[1:])
        return sp.csr_array((caps[order].astype(np.int32), cols[order].astype(np.int32), indptr),
                            shape=(n, n))

    def flow_on(self, result) -> np.ndarray:
        """The net flow of a scipy max-flow `result` on the edges ``head -> tail``."""
        flow = result.flow
        size = flow.shape[0]
        rows = np.repeat(np.arange(size), np.diff(flow.indptr))
        keys = rows.astype(np.int64) * size + flow.indices  # sorted: csr with sorted indices
        wanted = self.head.astype(np.int64) * size + self.tail
        at = np.minimum(np.searchsorted(keys, wanted), len(keys) - 1)
        return np.where(keys[at] == wanted, flow.data[at], 0).astype(np.int64)

    def reachable(self, source: int, residual: np.ndarray) -> np.ndarray:
        """Nodes reachable from `source` over positive `residual` capacity."""
        reached = np.zeros(self.n, dtype=bool)
        order = breadth_first_order(self.csr(residual), source, directed=True,
                                    return_predecessors=False)
        reached[order] = True
        return reached


def _feasible_flow(graph: _Graph, source: int, sink: int, lower, upper) -> np.ndarray | None:
    """A flow within the bounds (a max flow from a new source to a new sink, which meets
    every lower bound), or None where there is none."""
    n, head, tail = graph.n, graph.head, graph.tail
    total = int(lower.sum())
    if not total:
        return lower.copy()
    nodes = np.arange(n)  # the circulation from a new source (n) to a new sink (n + 1)
    rows = np.concatenate([head, np.full(n, n), nodes, [sink]])
    cols = np.concatenate([tail, nodes, np.full(n, n + 1), [source]])
    caps = np.concatenate([upper - lower,
                           np.bincount(tail, weights=lower, minlength=n).astype(np.int64),
                           np.bincount(head, weights=lower, minlength=n).astype(np.int64),
                           [total + 1]])
    feasible = maximum_flow(graph.csr(caps, rows, cols, n + 2), n, n + 1)
    return lower + graph.flow_on(feasible) if feasible.flow_value == total else None


def _residual(graph: _Graph, source: int, sink: int, flow, lower, upper, dropped=None):
    """The residual capacities (forward, then backward) after a max flow from `source` to
    `sink` on top of `flow`, with the capacities in `dropped` left out."""
    caps = np.concatenate([upper - flow, flow - lower])
    if dropped is not None:
        caps = np.where(dropped, 0, caps)
    flow = flow + graph.flow_on(maximum_flow(graph.csr(caps), source, sink))
    residual = np.concatenate([upper - flow, flow - lower])
    return residual if dropped is None else np.where(dropped, 0, residual)


def minimal_min_cut(n: int, source: int, sink: int, head: np.ndarray, tail: np.ndarray,
                    lb: np.ndarray, ub: np.ndarray, unit: float, infinite: float
                    ) -> np.ndarray | None:
    """The source side (a boolean mask over nodes ``0..n-1``) of lowtime's min cut of the
    critical DAG with edges ``head[i] -> tail[i]`` and flow bounds ``lb[i] <= f <= ub[i]``
    (lowtime's floats: multiples of `unit`; `infinite` marks lowtime's unbounded capacity), or
    None where lowtime's floating point could decide otherwise (see the module docstring)."""
    lower = np.rint(lb / unit).astype(np.int64)
    upper = np.rint(ub / unit).astype(np.int64)
    unbounded = ub == infinite
    big = int(upper[~unbounded].sum() + lower.sum() + 1)  # beats every cut of finite edges
    if big >= _LIMIT or (upper - lower == 1).any():  # a linear cost: a one-unit tie in waiting
        return None
    upper = np.where(unbounded, big, upper)
    if (lower > upper).any():
        return None
    graph = _Graph(n, head, tail)
    flow = _feasible_flow(graph, source, sink, lower, upper)
    if flow is None:
        return None
    residual = _residual(graph, source, sink, flow, lower, upper)
    cut = graph.reachable(source, residual)
    if cut[sink]:
        return None
    # lowtime's search may take one-unit residuals for none (``> FP_ERROR``), and it may drop
    # the feasible flow's one-unit residual capacities before its second max flow
    variants = [np.where(residual == 1, 0, residual)]
    units = np.concatenate([upper - flow, flow - lower]) == 1
    if units.any():
        variants.append(_residual(graph, source, sink, flow, lower, upper, units))
    for variant in variants:
        if not np.array_equal(cut, graph.reachable(source, variant)):
            return None
    return cut
