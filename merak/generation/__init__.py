"""Text generation with the pipelined model (`generate`), on any (dp, tp, pp) layout."""

from merak.generation.generate import generate
from merak.generation.stage_view import StageView

__all__ = ["StageView", "generate"]
