"""Search the layouts of a model on a cluster: enumerate, predict, rank, explain.

Every candidate is predicted (`Predictor`); those over the memory limit or that cannot run are
dropped with their reason; the rest are ranked by predicted step time (ties: less memory). An
online plan then dry-runs the best few (`merak.dryrun.run`) and keeps the fastest measured.
"""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from merak.rules import Choices, refusal
from merak.schedule.registry import SCHEDULES
from merak.strategy.candidate import BLOCK, RECOMPUTE_CHOICES, Candidate, Prediction
from merak.strategy.cluster import Cluster
from merak.strategy.costs import BlockCosts
from merak.strategy.predict import Predictor
from merak.strategy.reference import ReferenceCosts
from merak.strategy.shape import ModelShape

MICRO_BATCH_SIZES = (1, 2, 4, 8)


def context_parallel_degrees(world_size: int, seq: int, most: int = 8) -> tuple[int, ...]:
    """cp degrees to search: 1 and the powers of two up to `most` that divide the world and
    cut the sequence into ``2 x cp`` chunks (the load-balanced split)."""
    found, cp = [1], 2
    while cp <= min(most, world_size):
        if world_size % cp == 0 and seq % (2 * cp) == 0:
            found.append(cp)
        cp *= 2
    return tuple(found)


def cp_modes(shape: ModelShape, tp: int, cp: int) -> tuple[str, ...]:
    """The attention of a cp > 1 layout: ring always; Ulysses where cp divides the heads and
    key/value heads of a TP rank."""
    if cp == 1:
        return ("ring",)
    heads, kv = shape.heads // tp, shape.kv_heads // tp
    return ("ring", "ulysses") if heads % cp == 0 and kv % cp == 0 else ("ring",)


def layouts(shape: ModelShape, world_size: int) -> list[tuple[int, int, int]]:
    """(dp, tp, pp) with dp x tp x pp = world size, tp dividing the heads, pp <= blocks."""
    found = []
    for tp in shape.tp_degrees(world_size):
        for pp in range(1, world_size // tp + 1):
            if (world_size // tp) % pp == 0 and pp <= shape.layers:
                found.append((world_size // (tp * pp), tp, pp))
    return found


def candidates(shape: ModelShape, world_size: int, global_batch: int, seq: int,
               micro_batch_sizes: Iterable[int] = MICRO_BATCH_SIZES,
               schedules: Iterable[str] | None = None,
               zero_stages: Iterable[int] = (0, 1, 2, 3),
               sequence_parallel: Iterable[bool] = (False, True),
               job: Choices | None = None,
               context_parallel: Iterable[int] = (1,),
               recompute_choices: Iterable[str] = RECOMPUTE_CHOICES,
               expert_parallel: Iterable[int] | None = None) -> Iterator[Candidate]:
    """Every layout x sequence parallelism x micro-batch size x schedule x recomputation x
    ZeRO stage that the sizes allow (a global batch divisible by dp x micro-batch size;
    sequence parallelism needs tp > 1 dividing the sequence of `seq` tokens; interleaving
    needs two blocks per rank and at least pp micro-batches (the registry's
    `min_microbatches_per_rank`); ZeRO needs dp x cp > 1) and that `merak.rules` accepts for the
    job's other options `job` (ZeRO-2/3 with a schedule that does not split the backward, nor with
    LoRA or torch_compile; Merak's reordering schedules with recomputation: the rules
    `MerakArguments` applies). `sequence_parallel`: the settings to try where tp > 1
    (``(False,)`` for a job that cannot split the sequence: see `sequence_parallel_choices`).
    `context_parallel`: the cp degrees to try (`context_parallel_degrees`; each with the cp
    modes the heads allow, `cp_modes`). `recompute_choices`: add ``"block"`` (every block
    rerun inside the backward, `recompute_in_backward`) to search it, with the schedules that
    do not move a recompute action. `expert_parallel`: the ep degrees to try (default: every
    degree that divides a layout's dp x cp and the experts, `ModelShape.ep_degrees`; 1 for a
    dense model)."""
    job = job or Choices()
    schedules = list(schedules or SCHEDULES)
    for cp, (dp, tp, pp) in _layouts(shape, world_size, seq, context_parallel):
        local = seq // cp  # the tokens of a row on one cp rank
        sp_settings = [sp for sp in sequence_parallel if not sp or (tp > 1 and local % tp == 0)]
        eps = [e for e in shape.ep_degrees(dp * cp)
               if expert_parallel is None or e in expert_parallel]
        for sp, mb, mode, ep in itertools.product(sp_settings or [False], micro_batch_sizes,
                                                  cp_modes(shape, tp, cp), eps):
            if global_batch % (dp * mb):
                continue
            m = global_batch // (dp * mb)
            for name in schedules if pp > 1 else ["1f1b"]:
                info = SCHEDULES[name]
                chunks = info.stages_per_rank(2)
                if chunks * pp > shape.layers or m < info.min_microbatches_per_rank * pp:
                    continue
                for recompute in recompute_choices:
                    if recompute == BLOCK and info.needs_recompute:
                        continue
                    for zero in zero_stages if dp * cp > 1 else (0,):  # (over dp x cp)
                        c = Candidate(dp, tp, pp, mb, m, name, recompute, zero, chunks, sp,
                                      cp, mode, ep)
                        if refusal(job.with_candidate(c)) is None:
                            yield c


def _layouts(shape: ModelShape, world_size: int, seq: int, degrees: Iterable[int]
             ) -> Iterator[tuple[int, tuple[int, int, int]]]:
    """(cp, (dp, tp, pp)) for each cp degree of `degrees` that divides the world size and whose
    ``2 x cp`` chunks divide the sequence."""
    for cp in degrees:
        if world_size % cp == 0 and (cp == 1 or seq % (2 * cp) == 0):
            for layout in layouts(shape, world_size // cp):
                yield cp, layout


def sequence_parallel_choices(config, tp_plan=None) -> tuple[bool, ...]:
    """``(False, True)`` when the tensor-parallel plan of the model `config` describes
    (`tp_plan` when the job gives one) can split the sequence (it names ``sp_gather``
    modules), else ``(False,)``."""
    from merak.tensor_parallel.apply.choice import config_plan
    from merak.tensor_parallel.plans.tp_plan import as_tp_plan

    plan = as_tp_plan(tp_plan) if tp_plan is not None else config_plan(config)
    return (False, True) if plan is not None and plan.sp_gather else (False,)


@dataclass
class StrategyPlan:
    """The outcome of a search: every prediction (best first), the dry runs and the choice."""

    model: str
    cluster: Cluster
    global_batch: int
    seq: int
    memory_bytes: float
    ranked: list[Prediction]  # runnable, best predicted first
    dropped: list[Prediction]  # with their reasons
    measured: dict[str, float] = field(default_factory=dict)  # label -> measured step s
    measured_memory: dict[str, float] = field(default_factory=dict)  # label -> peak bytes
    chosen: Candidate | None = None
    why: str = ""
    search_s: float = 0.0
    flops_per_token: float = 0.0  # model FLOPs of one token's forward and backward
    costs: dict[int, BlockCosts] = field(default_factory=dict)  # what it was predicted from

    def mfu(self, step_s: float) -> float:
        """Model FLOPs utilisation at `step_s` against the cluster's peak (offline plans; a
        measured cluster has no peak figure and gets 0)."""
        if self.cluster.peak_flops <= 1.0:
            return 0.0
        return self.tokens_per_s(step_s) * self.flops_per_token / (
            self.cluster.world_size * self.cluster.peak_flops)

    def chosen_prediction(self) -> Prediction | None:
        return next((p for p in self.ranked if p.candidate == self.chosen), None)

    def tokens_per_s(self, step_s: float) -> float:
        return self.global_batch * self.seq / step_s

    def table(self, limit: int = 12) -> str:
        """The ranked candidates: predicted step time, tokens/s and memory, measured time
        where dry-run, and the choice."""
        offline = self.cluster.peak_flops > 1.0
        lines = [f"{'candidate':58} {'pred s':>9} {'tok/s':>10} {'mem GiB':>8} "
                 + (f"{'MFU':>6}" if offline else f"{'meas s':>9} {'meas GiB':>8}")
                 + "  chosen"]
        shown = self.ranked[:limit] + [p for p in self.ranked[limit:]
                                       if p.candidate.label in self.measured]
        for p in shown:
            label = p.candidate.label
            measured, memory = self.measured.get(label), self.measured_memory.get(label)
            figures = f"{self.mfu(p.step_s):6.1%}" if offline else (
                f"{'' if measured is None else f'{measured:9.4g}':>9} "
                f"{'' if memory is None else f'{memory / 2**30:8.3g}':>8}")
            lines.append(f"{label:58} {p.step_s:9.4g} {self.tokens_per_s(p.step_s):10.4g} "
                         f"{p.peak_bytes / 2**30:8.3g} {figures}  "
                         f"{'<==' if p.candidate == self.chosen else ''}")
        return "\n".join(lines)

    def to_json(self) -> dict:
        chosen = self.chosen_prediction()
        return {"model": self.model, "cluster": self.cluster.to_json(),
                "global_batch": self.global_batch, "seq": self.seq,
                "memory_bytes": self.memory_bytes,
                "chosen": asdict(self.chosen) if self.chosen else None,
                "chosen_ratios": chosen.recompute_ratios if chosen else None, "why": self.why,
                "search_s": self.search_s, "measured": self.measured,
                "measured_memory": self.measured_memory,
                "costs": {m: asdict(c) for m, c in self.costs.items()},
                "ranked": [{**_prediction_json(p), "mfu": self.mfu(p.step_s)}
                           for p in self.ranked[:50]]}

    def write(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1))


def _prediction_json(p: Prediction) -> dict:
    return {**asdict(p.candidate), "label": p.candidate.label, "step_s": p.step_s,
            "peak_bytes": p.peak_bytes, "pipeline_s": p.pipeline_s, "tail_s": p.tail_s,
            "reference_s": p.reference_s, "recompute_ratios": p.recompute_ratios}


def read_strategy_plan(path: str | Path) -> tuple[Candidate, list[float] | None, int | None]:
    """The chosen candidate of a ``plan.json`` (`StrategyPlan.write`), its per-stage recomputation
    ratios and the global batch it was planned for."""
    data = json.loads(Path(path).read_text())
    if not data.get("chosen"):
        raise ValueError(f"{path} holds no chosen plan (no candidate fitted); plan again with "
                         f"more memory or ranks")
    return Candidate(**data["chosen"]), data.get("chosen_ratios"), data.get("global_batch")


def search(shape: ModelShape, costs: dict[int, BlockCosts], cluster: Cluster,
           global_batch: int, seq: int, memory_bytes: float | None = None,
           parallel_vocab: bool = False, imbalance: float = 1.0,
           reference: ReferenceCosts | None = None, **options) -> StrategyPlan:
    """Predict every candidate (`candidates`' keyword options) and rank them (`parallel_vocab`,
    `imbalance`, `reference`: see `Predictor`).

    Raises:
        ValueError: the global batch is not a positive multiple of some dp degree, no layout
            fits the world size, or nothing fits in memory (the message names the candidate
            with the least memory and what it needs).
    """
    start = time.perf_counter()
    if memory_bytes is not None and memory_bytes <= 0:
        raise ValueError(f"the memory limit must be positive, got {memory_bytes} bytes")
    if global_batch < 1:
        raise ValueError(f"the global batch must be >= 1 sequence, got {global_batch}")
    if not layouts(shape, cluster.world_size):
        raise ValueError(f"no dp x tp x pp layout of {cluster.world_size} ranks fits "
                         f"{shape.name}: tp must divide {shape.heads} heads and "
                         f"{shape.kv_heads} key-value heads, pp at most {shape.layers} blocks")
    sizes = [m for m in options.pop("micro_batch_sizes", MICRO_BATCH_SIZES) if m in costs]
    predictor = Predictor(shape, costs, cluster, memory_bytes, parallel_vocab, imbalance,
                          reference)
    ranked, dropped = [], []
    done: dict[tuple, Prediction] = {}
    for candidate in candidates(shape, cluster.world_size, global_batch, seq, sizes, **options):
        c = candidate
        base = (c.dp, c.tp, c.sequence_parallel, c.cp, c.cp_mode, c.ep, c.pp, c.micro_batch,
                c.schedule, c.zero)
        if c.recompute == "budget":  # only between an "off" that fails and a "full" that fits
            off, full = done.get((*base, "off")), done.get((*base, "full"))
            if (off is not None and off.fits) or full is None or not full.fits:
                continue
        prediction = done[(*base, c.recompute)] = predictor.predict(candidate)
        ratios = set(prediction.recompute_ratios)
        if candidate.recompute == "budget" and len(ratios) <= 1 and ratios <= {0.0, 1.0}:
            continue  # recomputing nothing (or everything) is "off" (or "full") again
        (ranked if prediction.fits else dropped).append(prediction)
    if not ranked and not dropped:
        raise ValueError(f"a global batch of {global_batch} sequences divides no dp degree x "
                         f"micro-batch size of {cluster.world_size} ranks; use a multiple of "
                         f"{cluster.world_size}")
    ranked.sort(key=lambda p: (p.step_s, p.peak_bytes))
    plan = StrategyPlan(shape.name, cluster, global_batch, seq, predictor.memory_bytes, ranked,
                        dropped, flops_per_token=shape.flops_per_token(seq), costs=dict(costs))
    if not ranked:
        least = min(dropped, key=lambda p: p.peak_bytes)
        raise ValueError(f"no candidate fits in {predictor.memory_bytes / 2**30:.2f} GiB per "
                         f"rank: the least memory found is {least.peak_bytes / 2**30:.2f} GiB "
                         f"({least.candidate.label}); raise the memory limit, use more ranks "
                         f"or a smaller global batch")
    plan.chosen = ranked[0].candidate
    plan.why = explain(ranked)
    plan.search_s = time.perf_counter() - start
    return plan


def explain(ranked: list[Prediction]) -> str:
    """Why the first won: against the best candidate of each other layout family."""
    best = ranked[0]
    c = best.candidate
    lines = [f"{c.label}: predicted {best.step_s:.4g} s per step ({best.pipeline_s:.4g} s "
             f"pipeline, {best.tail_s:.4g} s exposed data-parallel traffic), "
             f"{best.peak_bytes / 2**30:.3g} GiB on its fullest rank"]
    seen = {(c.dp, c.tp, c.pp, c.cp, c.ep)}
    for p in ranked[1:]:
        o = p.candidate
        if (o.dp, o.tp, o.pp, o.cp, o.ep) in seen:
            continue
        seen.add((o.dp, o.tp, o.pp, o.cp, o.ep))
        cp = f" cp{o.cp}" if o.cp > 1 else ""
        ep = f" ep{o.ep}" if o.ep > 1 else ""
        lines.append(f"  best with dp{o.dp}{ep} tp{o.tp}{cp} pp{o.pp}: {o.label}, "
                     f"{p.step_s / best.step_s:.2f}x the time")
        if len(seen) > 4:
            break
    return "\n".join(lines)
