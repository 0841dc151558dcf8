"""A candidate training layout (`Candidate`) and what the predictor says of it (`Prediction`):
the strategy search's unit, shared by the predictor, the dry runs and the trainer's plan."""

from __future__ import annotations

from dataclasses import dataclass, field

RECOMPUTE_CHOICES = ("off", "full", "budget")
# every block recomputed inside the backward, one at a time (`recompute_in_backward`): searched
# where asked (`merak plan` offline)
BLOCK = "block"


@dataclass(frozen=True)
class Candidate:
    """One training layout: degrees, micro-batching, schedule, recomputation, ZeRO stage."""

    dp: int
    tp: int
    pp: int
    micro_batch: int
    microbatches: int
    schedule: str = "1f1b"
    recompute: str = "off"
    zero: int = 0
    chunks: int = 1  # stages per pipeline rank (interleaved_1f1b, zbv, dualpipev)
    sequence_parallel: bool = False  # the blocks' residual stream split over the TP ranks
    cp: int = 1  # context parallelism: each row's sequence split over cp ranks
    cp_mode: str = "ring"  # its attention: "ring" or "ulysses"
    ep: int = 1  # expert parallelism: each MoE block's experts split over ep of the replicas

    @property
    def replicas(self) -> int:
        """Ranks holding the same weights: dp x cp."""
        return self.dp * self.cp

    @property
    def label(self) -> str:
        chunks = f" v{self.chunks}" if self.chunks > 1 else ""
        sp = "+sp" if self.sequence_parallel else ""
        cp = f" cp{self.cp}:{self.cp_mode}" if self.cp > 1 else ""
        ep = f" ep{self.ep}" if self.ep > 1 else ""
        return (f"dp{self.dp}{ep} tp{self.tp}{sp}{cp} pp{self.pp}{chunks} mb{self.micro_batch}x"
                f"{self.microbatches} {self.schedule} rc:{self.recompute} zero{self.zero}")


@dataclass
class Prediction:
    candidate: Candidate
    step_s: float = float("inf")
    peak_bytes: float = float("inf")  # the highest rank's
    state_bytes: list[float] = field(default_factory=list)  # per rank
    activation_bytes: list[float] = field(default_factory=list)  # per rank, peak
    recompute_ratios: list[float] = field(default_factory=list)  # per stage
    pipeline_s: float = 0.0  # the simulated schedule, without the tail
    tail_s: float = 0.0
    reference_s: float = 0.0  # the pass before training over one step's rows (in step_s / epochs)
    error: str | None = None  # why the candidate cannot run

    @property
    def fits(self) -> bool:
        return self.error is None
