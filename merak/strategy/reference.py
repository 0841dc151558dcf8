"""The reference model's forwards of a preference trainer (TRL's DPO, KTO) in a candidate's
predicted cost (`merak.schedule.reference` says where they run).

``"before"``: the pass before training is the schedule `reference_pass` over one step's
micro-batches, replayed by the simulator with the candidate's reference-forward times; it reads
each training row once, so a step is charged its time divided by the epochs trained.
``"per_step"`` and ``"replica"``: the training schedule itself carries the reference's forwards
(``make_schedule(..., reference=True)``), so the replay times them where they run, bubbles
included; a ``"replica"`` also holds a frozen copy of its stage's weights on every rank
(`replica_bytes`), which no optimizer or gradient touches; under ZeRO-2/3 it is sharded over
the replicas as the policy's weights are.
"""

from __future__ import annotations

from merak.schedule.reference import PER_STEP_MODES, check_reference_mode
from merak.schedule.registry import reference_pass
from merak.schedule.simulator import CostModel, simulate

REPLICA_BYTES_PER_PARAM = 4  # the frozen replica's weights, fp32 as the policy's


class ReferenceCosts:
    """What the reference adds to one candidate's prediction, for a `Predictor`.

    Args:
        mode: one of `merak.schedule.reference.REFERENCE_MODES`.
        epochs: how many times training reads each row (the pass before training reads it
            once).
    """

    def __init__(self, mode: str = "none", epochs: float = 1.0):
        self.mode = check_reference_mode(mode)
        if not epochs > 0:
            raise ValueError(f"epochs must be positive, got {epochs}")
        self.epochs = epochs
        self._passes: dict[tuple, float] = {}

    @property
    def per_step(self) -> bool:
        """Whether the training schedule runs the reference (``make_schedule(reference=)``)."""
        return self.mode in PER_STEP_MODES

    def replica_bytes(self, params: list[float], placement, pp: int,
                      shards: int = 1) -> list[float]:
        """Per pipeline rank, the bytes of its stages' frozen replica (``"replica"``; else 0).
        `shards`: the ranks its weights are sharded over (ZeRO-2/3 shard the replica over the
        replicas as the policy, `merak.trainer.reference_replica`; its pass gathers them unit
        by unit, or whole under ZeRO-2 before the policy's step gathers its own)."""
        held = [0.0] * pp
        if self.mode == "replica":
            for s, p in enumerate(params):
                held[placement[s]] += REPLICA_BYTES_PER_PARAM * p / shards
        return held

    def before_training_s(self, c, costs: CostModel, placement) -> float:
        """``"before"``: seconds of the pass over one step's micro-batches (else 0), from the
        candidate's per-rank reference-forward times and p2p latency."""
        if self.mode != "before":
            return 0.0
        key = (c.pp, c.chunks, c.microbatches, tuple(placement), tuple(costs.reference),
               costs.p2p)
        if key not in self._passes:
            schedule = reference_pass(c.pp, c.microbatches, stages_per_rank=c.chunks,
                                      placement=tuple(placement))
            self._passes[key] = simulate(schedule, costs).makespan
        return self._passes[key]
