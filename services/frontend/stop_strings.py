"""Stop-string matching on streamed text.

Two questions, asked after every decoded token: did a stop string just
complete (and where does the output end), and how much of the tail must be
held back from the client because it could still turn into a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence


def find_stop_string(
    text: str, new_text_start: int, stop: Sequence[str], include_in_output: bool
) -> tuple[str, int] | None:
    """The stop string that completes first in ``text[new_text_start:]``.

    Text before ``new_text_start`` was searched already, so only matches that
    END in the new text count (they may start earlier). The match that ends
    first wins whatever its place in ``stop``; at equal ends the longer one
    wins, so none of it reaches the client. Returns ``(stop_str, cut)`` where
    ``text[:cut]`` is the output: up to the match's end when
    ``include_in_output``, else up to its start. None when nothing matched.
    """
    best: tuple[int, int, str] | None = None  # (end, start, stop_str)
    for stop_str in stop:
        start = text.find(stop_str, max(0, new_text_start - len(stop_str) + 1))
        if start == -1:
            continue
        candidate = (start + len(stop_str), start, stop_str)
        if best is None or candidate[:2] < best[:2]:
            best = candidate
    if best is None:
        return None
    end, start, stop_str = best
    return stop_str, end if include_in_output else start


def num_held_back_chars(text: str, stop: Sequence[str]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a stop string.

    Only those characters could still become part of a stop string, so only
    they are held back while streaming; at most ``max(len(stop)) - 1``.
    """
    held = 0
    for stop_str in stop:
        for length in range(min(len(stop_str) - 1, len(text)), held, -1):
            if text.endswith(stop_str[:length]):
                held = length
                break
    return held
