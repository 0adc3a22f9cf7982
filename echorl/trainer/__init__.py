"""The trainer: advantages, losses, batching, updates, the warm-up and the co-located loop."""
