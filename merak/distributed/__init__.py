"""Process groups and the parallel context."""
