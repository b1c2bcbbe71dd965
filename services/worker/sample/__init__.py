"""The worker's sampler: SamplingState (per-row params + logits processors),
SamplingMetadata (one step's view), Sampler, and logprob helpers."""

from services.worker.sample.logits_processor import ThinkingConfig
from services.worker.sample.logprobs import LogprobsTensors, compute_prompt_logprobs
from services.worker.sample.sampler import Sampler, SamplerOutput
from services.worker.sample.sampling_metadata import SamplingMetadata
from services.worker.sample.sampling_state import SamplingState

__all__ = [
    "LogprobsTensors",
    "Sampler",
    "SamplerOutput",
    "SamplingMetadata",
    "SamplingState",
    "ThinkingConfig",
    "compute_prompt_logprobs",
]
