"""Top-k / top-p filtering and the random draw, batched over the rows."""

from __future__ import annotations

import torch

# Tokens a partial top-k gathers when looking for a row's top-p nucleus on the CPU.
_PARTIAL_TOP_P_TOKENS = 256


def apply_top_k_only(logits: torch.Tensor, top_k: torch.Tensor, max_top_k: int) -> torch.Tensor:
    """Keep each row's ``top_k`` largest logits (ties at the k-th value kept).

    ``top_k`` is int64 ``[n]``; rows with ``top_k >= vocab`` are not filtered.
    ``max_top_k`` (the largest enabled k, known on the host) sizes one batched
    ``topk`` instead of a full sort.
    """
    vocab_size = logits.shape[1]
    disabled = top_k >= vocab_size
    kth = (top_k.clamp(max=max_top_k) - 1).unsqueeze(1)
    threshold = logits.topk(max_top_k, dim=1).values.gather(1, kth)
    threshold.masked_fill_(disabled.unsqueeze(1), float("-inf"))
    return logits.masked_fill_(logits < threshold, float("-inf"))


def apply_top_k_top_p(
    logits: torch.Tensor,
    top_k: torch.Tensor | None,
    top_p: torch.Tensor | None,
    max_top_k: int,
) -> torch.Tensor:
    """Mask (to -inf) the tokens outside each row's top-k and then its top-p nucleus.

    Top-p keeps the smallest set of most likely tokens whose probability
    reaches ``top_p`` (always at least one token); ``top_p == 1`` keeps all.
    Edits ``logits`` in place and returns it.
    """
    if top_p is None:
        return logits if top_k is None else apply_top_k_only(logits, top_k, max_top_k)
    if logits.device.type == "cpu":
        # A full sort is by far the slowest sampling step on the CPU, and a
        # partial top-k usually holds the nucleus: try that first (the host
        # check that it sufficed costs nothing here, unlike a device sync).
        if top_k is not None:
            apply_top_k_only(logits, top_k, max_top_k)
        if _apply_top_p_partial(logits, top_p):
            return logits
        top_k = None  # applied already
    return _apply_top_k_top_p_sorted(logits, top_k, top_p)


def _apply_top_k_top_p_sorted(
    logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor
) -> torch.Tensor:
    sorted_logits, sorted_idx = logits.sort(dim=-1)  # ascending
    if top_k is not None:
        vocab_size = logits.shape[1]
        # top_k == vocab (disabled) points at the smallest logit: nothing is masked.
        kth = sorted_logits.gather(1, (vocab_size - top_k).unsqueeze(1))
        sorted_logits.masked_fill_(sorted_logits < kth, float("-inf"))
    cumulative = sorted_logits.softmax(dim=-1).cumsum_(dim=-1)
    # Drop the low tail whose total probability is at most 1 - top_p.
    outside = cumulative <= (1.0 - top_p).unsqueeze(1)
    outside[:, -1] = False  # the most likely token always stays
    sorted_logits.masked_fill_(outside, float("-inf"))
    return logits.scatter_(1, sorted_idx, sorted_logits)


def _apply_top_p_partial(logits: torch.Tensor, top_p: torch.Tensor) -> bool:
    """Top-p from each row's best few tokens; False (nothing done) if a nucleus may be larger."""
    vocab_size = logits.shape[1]
    num_top = min(_PARTIAL_TOP_P_TOKENS, vocab_size)
    probs = logits.softmax(dim=-1)
    top_probs = probs.topk(num_top, dim=-1).values  # descending
    # Same rule as the sorted path: a token stays if the mass above it is below top_p.
    mass_above = top_probs.cumsum(dim=-1).sub_(top_probs)
    num_kept = (mass_above < top_p.unsqueeze(1)).sum(dim=-1)
    if num_top < vocab_size and bool((num_kept == num_top).any()):
        return False
    threshold = top_probs.gather(1, (num_kept - 1).unsqueeze(1))
    logits.masked_fill_(probs < threshold, float("-inf"))
    return True


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """One token per row from ``probs [n, vocab]``, as ``argmax(probs / q)`` with q ~ Exp(1).

    This exponential race is equivalent to sampling from ``probs`` and needs no
    sync. Rows in ``generators`` draw their noise from their own generator (so
    their result does not depend on the rest of the batch); the others share
    one batched draw. ``probs`` is overwritten.
    """
    noise = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        noise.uniform_()
    for row, generator in generators.items():
        noise[row].uniform_(generator=generator)
    # -log(U) ~ Exp(1); several times faster than exponential_() on the CPU.
    # U == 0 gives q = inf, so a token can lose but never divide by zero.
    noise.log_().neg_()
    return probs.div_(noise).argmax(dim=-1)
