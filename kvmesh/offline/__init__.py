"""The offline engine: scheduler and worker in this process, no server.

    from kvmesh.offline import LLM, SamplingParams

    llm = LLM()  # SmolLM2-135M-Instruct
    outputs = llm.generate(["The capital of France is"], SamplingParams(max_tokens=8))

The only code that imports the frontend, scheduler and worker services
together (the folder rule in tests/test_layering.py).
"""

from kvmesh.offline.engine_args import EngineArgs
from kvmesh.offline.engine_core import EngineCore
from kvmesh.offline.llm import LLM
from kvmesh.offline.llm_engine import LLMEngine
from services.common.sampling_params import SamplingParams

__all__ = ["LLM", "EngineArgs", "EngineCore", "LLMEngine", "SamplingParams"]
