"""Split and stage data model shared by the partitioner, the runtime, recomputation and ZeRO:
which modules are blocks, how the blocks are assigned to stages, the pieces of a split and a
rank's stage modules."""
