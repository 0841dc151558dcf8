"""The error every schedule tool raises for a schedule that cannot run.

Its own module so that the validator and the simulator, which both raise it, need not import
each other for it.
"""

from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule that cannot run: unmatched communication, a deadlock, or a bad order."""
