"""LogitsProcessors: the instantiated processors, split by where the sampler runs them."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from itertools import chain

from services.worker.sample.logits_processor.interface import LogitsProcessor


class LogitsProcessors:
    """Processors grouped by ``is_argmax_invariant()``, each group in construction order.

    ``non_argmax_invariant`` ones run before greedy sampling; ``argmax_invariant``
    ones run after temperature, on the random path only.
    """

    def __init__(self, logitsprocs: Iterable[LogitsProcessor] = ()) -> None:
        self.argmax_invariant: list[LogitsProcessor] = []
        self.non_argmax_invariant: list[LogitsProcessor] = []
        for proc in logitsprocs:
            if proc.is_argmax_invariant():
                self.argmax_invariant.append(proc)
            else:
                self.non_argmax_invariant.append(proc)

    @property
    def all(self) -> Iterator[LogitsProcessor]:
        return chain(self.argmax_invariant, self.non_argmax_invariant)

    def __len__(self) -> int:
        return len(self.argmax_invariant) + len(self.non_argmax_invariant)
