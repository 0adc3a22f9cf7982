"""Generation backends. Each returns `Completion`s with per-token behaviour log-probs."""
