"""Batched sampling ops on [num_reqs, vocab] logits."""
