"""`CudagraphDispatcher`: the one place that knows which CUDA graphs exist.

Built from the (resolved) mode and the capture sizes, it holds one key set per
runtime mode (FULL and PIECEWISE). Per step, ``dispatch`` pads the batch to the
next capture size and picks FULL, then PIECEWISE, then NONE (eager, unpadded).
The runner captures exactly the keys listed here, largest first, so a key
that ``dispatch`` returns always has its graphs.
"""

from __future__ import annotations

import bisect

from services.worker.cudagraph.mode import CUDAGraphMode
from services.worker.forward_context import BatchDescriptor

# Largest capture size unless configured: vLLM's, enough for decode at 256 requests.
DEFAULT_MAX_CAPTURE_SIZE = 512


def default_capture_sizes(max_capture_size: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 to 256 and of 16 beyond, up to ``max_capture_size``."""
    if max_capture_size < 1:
        raise ValueError(f"max_cudagraph_capture_size is {max_capture_size}, must be >= 1")
    sizes = [1, 2, 4, *range(8, 256, 8), *range(256, max_capture_size + 1, 16)]
    sizes = [s for s in sizes if s <= max_capture_size]
    if sizes[-1] != max_capture_size:
        sizes.append(max_capture_size)
    return sizes


class CudagraphDispatcher:
    """Maps each batch to (runtime mode, padded BatchDescriptor).

    Args:
        cudagraph_mode: the mode after ``resolve_cudagraph_mode``.
        capture_sizes: token counts to capture, each in [1, max_num_batched_tokens].
        max_num_reqs: the batch's request capacity; uniform keys with more
            requests are not built, mixed keys hold at most this many.
        uniform_decode_query_len: query tokens per request in a uniform decode
            batch (1, or 1 + speculative tokens).
    """

    def __init__(self, cudagraph_mode: CUDAGraphMode, capture_sizes: list[int],
                 max_num_reqs: int, uniform_decode_query_len: int = 1) -> None:
        if any(s < 1 for s in capture_sizes):
            raise ValueError(f"cudagraph_capture_sizes {capture_sizes} must all be >= 1")
        self.cudagraph_mode = cudagraph_mode
        self.capture_sizes = sorted(set(capture_sizes))
        self.max_num_reqs = max_num_reqs
        self.uniform_decode_query_len = uniform_decode_query_len
        self.cudagraph_keys: dict[CUDAGraphMode, set[BatchDescriptor]] = {
            CUDAGraphMode.FULL: set(),
            CUDAGraphMode.PIECEWISE: set(),
        }
        self._initialize_cudagraph_keys()

    @property
    def max_capture_size(self) -> int:
        return self.capture_sizes[-1] if self.capture_sizes else 0

    def _mixed_key(self, num_tokens: int) -> BatchDescriptor:
        return BatchDescriptor(num_tokens, min(num_tokens, self.max_num_reqs), uniform=False)

    def _uniform_key(self, num_tokens: int) -> BatchDescriptor | None:
        num_reqs, rest = divmod(num_tokens, self.uniform_decode_query_len)
        if rest or num_reqs > self.max_num_reqs:
            return None
        return BatchDescriptor(num_tokens, num_reqs, uniform=True)

    def _initialize_cudagraph_keys(self) -> None:
        mode = self.cudagraph_mode
        mixed_mode = mode.mixed_mode()
        if mixed_mode is not CUDAGraphMode.NONE:
            # Uniform batches reuse these keys unless the mode captures decode separately.
            self.cudagraph_keys[mixed_mode].update(self._mixed_key(s) for s in self.capture_sizes)
        if mode.separate_routine():
            keys = (self._uniform_key(s) for s in self.capture_sizes)
            self.cudagraph_keys[CUDAGraphMode.FULL].update(k for k in keys if k is not None)

    def padded_num_tokens(self, num_tokens: int) -> int:
        """The smallest capture size >= ``num_tokens``; ``num_tokens`` itself past the largest."""
        i = bisect.bisect_left(self.capture_sizes, num_tokens)
        return self.capture_sizes[i] if i < len(self.capture_sizes) else num_tokens

    def dispatch(self, num_tokens: int, num_reqs: int,
                 uniform: bool) -> tuple[CUDAGraphMode, BatchDescriptor]:
        """Runtime mode and key for a batch of ``num_tokens`` tokens in ``num_reqs`` requests.

        ``uniform``: every request has ``uniform_decode_query_len`` query tokens.
        Prefers a FULL graph, then PIECEWISE graphs; with neither, returns NONE
        and the unpadded batch.
        """
        padded = self.padded_num_tokens(num_tokens)
        candidates = [self._mixed_key(padded)]
        if uniform and self.cudagraph_mode.separate_routine():
            uniform_key = self._uniform_key(padded)
            if uniform_key is not None:
                candidates.insert(0, uniform_key)
        for runtime_mode in (CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE):
            for key in candidates:
                if key in self.cudagraph_keys[runtime_mode]:
                    return runtime_mode, key
        return CUDAGraphMode.NONE, BatchDescriptor(num_tokens, num_reqs, uniform)

    def keys_to_capture(self) -> list[tuple[CUDAGraphMode, BatchDescriptor]]:
        """Every (runtime mode, key), largest batch first: the order graphs are captured in.

        Largest first lets the smaller graphs reuse the shared pool's memory and
        slices of the wrappers' static output buffers.
        """
        items = [(m, k) for m, keys in self.cudagraph_keys.items() for k in keys]
        return sorted(items, key=lambda mk: (-mk[1].num_tokens, mk[0].name, not mk[1].uniform))
