"""Automatic pipeline partitioning: meta-device build, tracing, graph sharding, stage assignment."""
