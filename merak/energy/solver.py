"""lowtime's Phillips-Dessouky solver, with its pure-Python min-cut where the compiled one is
missing (lowtime 0.3.0 ships wheels for CPython 3.10-3.13 only; the Python path gives the same
frontier, about 3.5x slower)."""

from __future__ import annotations

import sys
import types

import networkx as nx


class _PythonMinCut:
    """Stands in for the compiled ``lowtime._lowtime_rs.PhillipsDessouky``: same constructor,
    `find_min_cut` by lowtime's own reference implementation."""

    solver_class = None  # lowtime.solver.PhillipsDessouky, set on install

    def __init__(self, fp_error, nodes, source, sink, edges):
        dag = nx.DiGraph()
        dag.add_nodes_from(nodes)
        for (u, v), (capacity, flow, ub, lb) in edges:
            dag.add_edge(u, v, capacity=capacity, flow=flow, ub=ub, lb=lb)
        dag.graph.update(source_node=source, sink_node=sink)
        self.dag = dag

    def find_min_cut(self):
        # the reference method reads only its argument, not the solver instance
        return self.solver_class.find_min_cut(None, self.dag)


def phillips_dessouky():
    """lowtime's `PhillipsDessouky` class (compiled min-cut, or the Python fallback)."""
    try:
        from lowtime.solver import PhillipsDessouky
        return PhillipsDessouky
    except ImportError as error:
        if "_lowtime_rs" not in str(error):
            raise
    import lowtime

    stub = types.ModuleType("lowtime._lowtime_rs")
    stub.PhillipsDessouky = _PythonMinCut
    sys.modules["lowtime._lowtime_rs"] = stub  # lowtime.solver imports it at module level
    lowtime._lowtime_rs = stub
    from lowtime.solver import PhillipsDessouky

    _PythonMinCut.solver_class = PhillipsDessouky
    return PhillipsDessouky
