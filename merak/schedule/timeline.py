"""Timelines of a step (recorded by `merak.runtime.hooks.TimelineRecorder`, or simulated):
Chrome trace JSON and a PNG."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TimelineEvent:
    row: int            # the rank (or simulated stage) the action ran on
    name: str
    microbatch_id: int | None
    start: float        # seconds since the step began
    end: float


def to_chrome_trace(events: Sequence[TimelineEvent], row_label: str = "rank") -> dict:
    """Chrome trace JSON (open in Perfetto or chrome://tracing): one track per row."""
    trace = []
    for row in sorted({e.row for e in events}):
        trace.append({"ph": "M", "name": "process_name", "pid": row,
                      "args": {"name": f"{row_label} {row}"}})
    for e in events:
        label = e.name if e.microbatch_id is None else f"{e.name} {e.microbatch_id}"
        trace.append({"ph": "X", "name": label, "cat": e.name, "pid": e.row, "tid": 0,
                      "ts": e.start * 1e6, "dur": max(e.end - e.start, 0.0) * 1e6,
                      "args": {"microbatch": e.microbatch_id}})
    return {"traceEvents": trace, "displayTimeUnit": "ms"}


def save_chrome_trace(events: Sequence[TimelineEvent], path: str | Path,
                      row_label: str = "rank") -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_chrome_trace(events, row_label)))
    return path


_COLORS = {"forward": "#4c72b0", "backward": "#dd8452", "recv_act": "#c7c7c7",
           "recv_grad": "#c7c7c7", "send_act": "#8c8c8c", "send_grad": "#8c8c8c",
           "reduce_grads": "#55a868", "reduce_tied_grads": "#8172b3",
           "optimizer_step": "#c44e52", "load": "#937860"}


def save_png(events: Sequence[TimelineEvent], path: str | Path, title: str = "",
             row_label: str = "rank", time_unit: str = "ms") -> Path:
    """A Gantt chart of the step: one row per rank, forward/backward labelled by micro-batch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    scale = {"s": 1.0, "ms": 1e3}[time_unit]
    rows = sorted({e.row for e in events})
    fig, ax = plt.subplots(figsize=(12, 0.6 * len(rows) + 1.6))
    bars: dict[tuple[int, str], list[tuple[float, float]]] = {}  # (row, colour) -> spans
    for e in events:
        width = (e.end - e.start) * scale
        if width <= 0:
            continue
        y = rows.index(e.row)
        bars.setdefault((y, _COLORS.get(e.name, "#cccccc")), []).append((e.start * scale, width))
        if e.name in ("forward", "backward") and e.microbatch_id is not None:
            ax.text(e.start * scale + width / 2, y, str(e.microbatch_id), ha="center",
                    va="center", fontsize=7, color="white")
    for (y, colour), spans in bars.items():  # one collection per row and colour (drawn fast)
        ax.broken_barh(spans, (y - 0.4, 0.8), facecolors=colour, edgecolor="white",
                       linewidth=0.3)
    ax.set_yticks(range(len(rows)), [f"{row_label} {r}" for r in rows])
    ax.invert_yaxis()
    ax.set_xlabel(f"time ({time_unit})")
    ax.set_title(title)
    used = [n for n in _COLORS if any(e.name == n and e.end > e.start for e in events)]
    ax.legend(handles=[Patch(color=_COLORS[n], label=n) for n in used], loc="upper center",
              bbox_to_anchor=(0.5, -0.25), ncol=min(len(used), 6), fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
