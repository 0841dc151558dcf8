"""A block's forward recorded op by op on fake weights; shard layouts followed through it (plan
inference's machinery); a plan proven on each rank's blocks; the TP cause of a shape error."""
