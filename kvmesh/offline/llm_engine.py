"""The offline engine's synchronous loop (vLLM V1's LLMEngine).

Holds the InputProcessor, the OutputProcessor and an engine core. A client
request becomes one EngineCoreRequest, or n of them when n > 1; each step
turns the engine core's outputs into RequestOutputs and aborts, in the
engine core, the requests a stop string finished.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvmesh.offline.engine_args import EngineArgs
from kvmesh.offline.engine_core import EngineCore
from services.common.model_files import resolve_model_dir
from services.common.sampling_params import SamplingParams
from services.frontend.input_processor import (
    InputProcessor,
    PromptType,
    logits_processor_validators,
)
from services.frontend.output_processor import OutputProcessor
from services.frontend.outputs import RequestOutput
from services.frontend.tokenizer import load_tokenizer


class LLMEngine:
    """Adds client requests and steps the engine core until they finish."""

    def __init__(
        self,
        input_processor: InputProcessor,
        output_processor: OutputProcessor,
        engine_core: EngineCore,
    ) -> None:
        self.input_processor = input_processor
        self.output_processor = output_processor
        self.engine_core = engine_core

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        engine_core = EngineCore.create(args.worker_config(), args.scheduling_options())
        info = engine_core.worker_info
        tokenizer = load_tokenizer(resolve_model_dir(args.model))
        input_processor = InputProcessor(
            tokenizer, info.max_model_len, info.vocab_size, info.eos_token_ids, args.max_logprobs,
            params_validators=logits_processor_validators(args.logits_processors),
        )
        return cls(input_processor, OutputProcessor(tokenizer, args.stream_interval), engine_core)

    @property
    def tokenizer(self):
        return self.input_processor.tokenizer

    def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        cache_salt: str | None = None,
        add_generation_prompt: bool = True,
    ) -> str:
        """Validates and queues a request; returns its internal id.

        ``request_id`` is the client's id (duplicates are allowed). Raises
        ValidationError for a bad prompt or parameter; nothing is queued then.
        """
        prompt_text, prompt_token_ids = self.input_processor.render_prompt(
            prompt, add_generation_prompt=add_generation_prompt
        )
        request = self.input_processor.process_inputs(
            request_id, prompt_token_ids, params,
            arrival_time=arrival_time, priority=priority, cache_salt=cache_salt,
        )
        children = self.output_processor.add_client_request(request, prompt_text, request_id)
        try:
            for child in children:
                self.engine_core.add_request(child)
        except Exception:
            # E.g. a full waiting queue: take back whatever was queued.
            self.abort_request([request.request_id])
            raise
        return request.request_id

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Aborts by client id or internal id (a parent's aborts all its children)."""
        self.engine_core.abort_requests(self.output_processor.abort_requests(request_ids))

    def step(self) -> list[RequestOutput]:
        """One engine-core step; returns the RequestOutputs due now."""
        if not self.engine_core.has_requests() and self.output_processor.has_unfinished_requests():
            raise RuntimeError(
                "the engine core holds no requests but "
                f"{self.output_processor.get_num_unfinished_requests()} are unfinished here"
            )
        outputs = self.engine_core.step()
        # The scheduler's timestamp is monotonic; metrics use wall-clock time.
        processed = self.output_processor.process_outputs(outputs.outputs)
        self.engine_core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.output_processor.has_unfinished_requests()

    def get_num_unfinished_requests(self) -> int:
        return self.output_processor.get_num_unfinished_requests()
