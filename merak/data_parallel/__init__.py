"""Data parallelism: gradient averaging over the dp axis."""
