"""Samplers: generation backends that return token ids with behaviour log-probs."""
