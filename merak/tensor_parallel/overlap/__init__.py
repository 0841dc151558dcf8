"""Sub-pipelined tensor parallelism (`tp_overlapping_level`): all-reduces behind compute."""
