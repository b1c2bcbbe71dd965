"""Shared by the worker tests: tiny random checkpoints, and the worker driven by the real Scheduler."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

from services.common.engine import EngineCoreRequest, Logprobs
from services.common.sampling_params import SamplingParams
from services.scheduler.config import SchedulingOptions, make_scheduler_config
from services.scheduler.scheduler import Scheduler
from services.worker.config import WorkerConfig
from services.worker.worker import Worker

VOCAB_SIZE = 256
BLOCK_SIZE = 16


def save_tiny_model(path: Path, arch: str) -> Path:
    common = dict(
        vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        # Larger than the default 0.02 so the greedy top-1 margin dwarfs float32
        # rounding differences between the paged and the dense attention.
        initializer_range=0.25,
    )
    config = LlamaConfig(**common) if arch == "llama" else Qwen2Config(**common)
    config.architectures = ["LlamaForCausalLM" if arch == "llama" else "Qwen2ForCausalLM"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def make_worker(model_dir: Path, **overrides) -> Worker:
    """A worker on the tiny checkpoint: float32, max_model_len 256, eager unless overridden.

    Eager because compiling each of these small workers would cost more than the
    tests themselves; tests/worker/test_compilation.py covers the compiled pieces.
    """
    overrides = {"dtype": "float32", "max_model_len": 256, "compile_pieces": False, **overrides}
    config = WorkerConfig(model=str(model_dir), **overrides)
    worker = Worker(config)
    worker.load_model()
    worker.initialize_kv_cache()
    return worker


def make_scheduler(worker: Worker, **options) -> Scheduler:
    """The scheduler the service would build for ``worker`` (``options``: SchedulingOptions)."""
    options = SchedulingOptions(**options)
    return Scheduler(make_scheduler_config(options, worker.registration_info(), engine_index=0))


# ------------------------------------------------------------------ engine loop
@dataclass
class RunResult:
    token_ids: dict[str, list[int]] = field(default_factory=dict)
    num_cached_tokens: dict[str, int] = field(default_factory=dict)
    logprobs: dict[str, Logprobs] = field(default_factory=dict)
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    scheduled_per_step: list[dict[str, int]] = field(default_factory=list)
    num_steps_with_discarded_sample: int = 0
    # Requests that failed: (grpc status code value, message).
    errors: dict[str, tuple[int, str]] = field(default_factory=dict)


def run_engine(scheduler: Scheduler, worker: Worker,
               arrivals: list[tuple[int, EngineCoreRequest]], max_steps: int = 2000) -> RunResult:
    """schedule -> execute_model -> update_from_output until every request finished.

    ``arrivals`` are (step, request): a request is added before that step.
    """
    result = RunResult()
    pending = sorted(arrivals, key=lambda a: a[0])
    step = 0
    while pending or scheduler.has_requests():
        while pending and pending[0][0] <= step:
            request = pending.pop(0)[1]
            result.token_ids[request.request_id] = []
            scheduler.add_request(request)
        scheduler_output = scheduler.schedule()
        result.scheduled_per_step.append(dict(scheduler_output.num_scheduled_tokens))
        runner_output = worker.execute_model(scheduler_output)
        assert runner_output.step_id == scheduler_output.step_id
        if any(not ids for ids in runner_output.sampled_token_ids):
            result.num_steps_with_discarded_sample += 1
        for outputs in scheduler.update_from_output(scheduler_output, runner_output).values():
            for out in outputs.outputs:
                result.token_ids[out.request_id].extend(out.new_token_ids)
                result.num_cached_tokens[out.request_id] = out.num_cached_tokens
                if out.status_code:
                    result.errors[out.request_id] = (out.status_code, out.finish_message)
                for target, new in ((result.logprobs, out.new_logprobs),
                                    (result.prompt_logprobs, out.new_prompt_logprobs)):
                    if new is not None:
                        target.setdefault(out.request_id, Logprobs()).extend(new)
        step += 1
        assert step < max_steps, "engine loop did not finish"
    return result


def greedy_request(req_id: str, prompt: list[int], max_tokens: int, **params) -> EngineCoreRequest:
    sampling = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, **params)
    return EngineCoreRequest(req_id, prompt, sampling, eos_token_id=2)


def random_prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB_SIZE) for _ in range(n)] for n in lengths]
