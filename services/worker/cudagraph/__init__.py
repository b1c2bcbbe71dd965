"""CUDA graphs of the worker's forward pass (seed 001): modes, dispatch, capture/replay."""

from services.worker.cudagraph.dispatcher import CudagraphDispatcher, default_capture_sizes
from services.worker.cudagraph.mode import CUDAGraphMode, resolve_cudagraph_mode
from services.worker.cudagraph.wrapper import CUDAGraphWrapper

__all__ = [
    "CUDAGraphMode",
    "CUDAGraphWrapper",
    "CudagraphDispatcher",
    "default_capture_sizes",
    "resolve_cudagraph_mode",
]
