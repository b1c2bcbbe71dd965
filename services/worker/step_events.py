"""When a launched step's device work is done, asked without blocking or waited for.

``StepPipeline`` prepares the next step while the device runs this one, and
asks these events when to stop preparing and collect the output instead:
a CUDA event on a GPU, a deadline on the simulated worker (its "device" is a
modelled wait), and an event that is always done on the CPU, whose forward
pass has finished by the time the launch returns.
"""

from __future__ import annotations

import time
from typing import Protocol

import torch

# How long a wait for a CUDA step sleeps between queries: well under a step.
_CUDA_POLL_S = 0.0001


class StepEvent(Protocol):
    def query(self) -> bool:
        """Whether the step's device work is done; never blocks."""
        ...

    def synchronize(self) -> None:
        """Blocks until the step's device work is done."""
        ...

    def poll_interval_s(self) -> float:
        """How long a caller that waits for something else too may sleep before asking again."""
        ...


class CompletedEvent:
    """A step whose work was done when it was launched (the CPU's synchronous forward)."""

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def poll_interval_s(self) -> float:
        return 0.0


COMPLETED = CompletedEvent()


class DeadlineEvent:
    """A step done at a moment of ``time.perf_counter()`` (the simulated accelerator)."""

    def __init__(self, done_at: float) -> None:
        self.done_at = done_at

    def query(self) -> bool:
        return time.perf_counter() >= self.done_at

    def synchronize(self) -> None:
        remaining = self.done_at - time.perf_counter()
        if remaining > 0:
            time.sleep(remaining)

    def poll_interval_s(self) -> float:
        return max(0.0, self.done_at - time.perf_counter())


class CudaStepEvent:
    """A CUDA event recorded on the current stream after the step's last kernel."""

    def __init__(self) -> None:
        self.event = torch.cuda.Event()
        self.event.record()

    def query(self) -> bool:
        return self.event.query()

    def synchronize(self) -> None:
        self.event.synchronize()

    def poll_interval_s(self) -> float:
        return _CUDA_POLL_S
