"""Real storage for meta-built stages: exact init replay, or their HF safetensors shards."""
