"""The offline API: ``LLM(...).generate(prompts)`` and ``.chat(messages)``.

Everything runs in this process (scheduler and worker included); outputs come
back complete (FINAL_ONLY) and in the order the prompts were given.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

from tqdm.auto import tqdm

from kvmesh.offline.engine_args import EngineArgs
from kvmesh.offline.llm_engine import LLMEngine
from services.common.sampling_params import RequestOutputKind, SamplingParams
from services.frontend.input_processor import PromptType
from services.frontend.outputs import RequestOutput
from services.frontend.tokenizer import ChatMessage


class LLM:
    """An engine for offline batch inference.

    ``LLM(model=None, dtype="auto", **engine_args)``: ``model`` is a local HF
    directory or a .gguf file (None: SmolLM2-135M-Instruct); the other keyword
    arguments are the fields of ``EngineArgs`` (an unknown one is a TypeError).
    """

    def __init__(
        self, model: str | None = None, *, dtype: str = "auto", **engine_args: Any
    ) -> None:
        self.engine_args = EngineArgs(model=model, dtype=dtype, **engine_args)
        self.llm_engine = LLMEngine.from_engine_args(self.engine_args)
        self._request_counter = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        priority: Sequence[int] | None = None,
    ) -> list[RequestOutput]:
        """Completes each prompt (text, token ids, or vLLM's ``{"prompt": ...}`` /
        ``{"prompt_token_ids": ...}`` dicts); one output per prompt, in order.

        ``sampling_params`` is one for all prompts or one per prompt.
        """
        if isinstance(prompts, str | Mapping) or _is_token_ids(prompts):
            prompts = [prompts]
        return self._run(list(prompts), sampling_params, use_tqdm, priority, True)

    def chat(
        self,
        messages: Sequence[ChatMessage] | Sequence[Sequence[ChatMessage]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        add_generation_prompt: bool = True,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Answers one conversation or a list of them through the chat template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        return self._run(list(conversations), sampling_params, use_tqdm, None,
                         add_generation_prompt)

    def _run(
        self,
        prompts: list[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        priority: Sequence[int] | None,
        add_generation_prompt: bool,
    ) -> list[RequestOutput]:
        num_prompts = len(prompts)
        params_list = _per_prompt(
            sampling_params or SamplingParams(), num_prompts, "sampling_params"
        )
        priorities = _per_prompt(priority or 0, num_prompts, "priority")
        request_ids: list[str] = []
        try:
            for prompt, params, prio in zip(prompts, params_list, priorities):
                request_id = str(next(self._request_counter))
                # Only the final output matters here; the caller's params stay as they are.
                final_only = dataclasses.replace(params, output_kind=RequestOutputKind.FINAL_ONLY)
                self.llm_engine.add_request(
                    request_id, prompt, final_only, priority=prio,
                    add_generation_prompt=add_generation_prompt,
                )
                request_ids.append(request_id)
        except Exception:
            self.llm_engine.abort_request(request_ids)
            raise
        return self._run_engine(request_ids, use_tqdm)

    def _run_engine(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        with tqdm(total=len(request_ids), desc="Processed prompts", disable=not use_tqdm) as pbar:
            while self.llm_engine.has_unfinished_requests():
                for output in self.llm_engine.step():
                    if output.finished:
                        finished[output.request_id] = output
                        pbar.update(1)
        # Under asynchronous scheduling a step scheduled ahead may still run for
        # requests that have finished: collect it, so no step outlives the call
        # (one running at interpreter exit aborts the process).
        while self.llm_engine.engine_core.has_requests():
            self.llm_engine.step()
        return [finished[request_id] for request_id in request_ids]


def _is_token_ids(prompt: object) -> bool:
    return isinstance(prompt, Sequence) and bool(prompt) and all(
        isinstance(t, int) and not isinstance(t, bool) for t in prompt
    )


def _per_prompt(value: Any, num_prompts: int, name: str) -> list[Any]:
    if isinstance(value, (SamplingParams, int)):
        return [value] * num_prompts
    values = list(value)
    if len(values) != num_prompts:
        raise ValueError(
            f"{name} has {len(values)} entries, must be one per prompt ({num_prompts})"
        )
    return values
