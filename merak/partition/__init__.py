"""Automatic pipeline partitioning: tracing, graph sharding, stage assignment."""
