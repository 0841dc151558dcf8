"""What a person reads: the frontier and per-step figures, a run's energy against the baseline."""
