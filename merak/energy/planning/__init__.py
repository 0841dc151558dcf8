"""The clock plan: the time / energy frontier over a schedule's instructions (lowtime's solver, its
min cut), a clock per instruction, and the plan file."""
