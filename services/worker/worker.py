"""A worker: loads the model, sizes and allocates the KV cache, executes steps.

The gRPC service wraps this class; tests and benchmarks drive it in-process.
Lifecycle: ``load_model()`` -> ``initialize_kv_cache()`` (returns the number of
KV blocks, null block included, that the scheduler's pool must use; captures
CUDA graphs, or compiles the CPU pieces through warm-up steps) ->
``execute_model(scheduler_output)`` once per step, or its three parts
(``prepare_step``, ``launch_step``, ``finish_step``) as ``StepPipeline`` calls
them to prepare a step while the previous one is on the device.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from kernels.cpu_extension import load_cpu_kernels
from services.common.max_model_len import resolve_max_model_len
from services.common.model_files import DEFAULT_MODEL_NAME, resolve_model_dir
from services.common.model_runner_output import ModelRunnerOutput
from services.common.registration import WorkerRegistration
from services.common.scheduler_output import SchedulerOutput
from services.worker.compilation import use_compile_cache
from services.worker.config import ModelConfig, WorkerConfig, parse_kv_cache_dtype
from services.worker.grammar import GrammarBackend
from services.worker.kv_cache import KVCacheSpec, allocate_kv_caches, determine_num_blocks
from services.worker.model_loader import load_model
from services.worker.model_runner import LaunchedStep, ModelRunner, PreparedStep
from services.worker.simulated import SimulatedModelRunner
from services.worker.step_events import COMPLETED, StepEvent
from services.worker.spec_decode.calibration import measure_step_costs
from services.worker.warmup import warm_up_model

logger = logging.getLogger(__name__)
# Steps in a row that may fail before the worker gives up and exits.
MAX_CONSECUTIVE_FAILED_STEPS = 3
# The simulated worker's pool unless --num-kv-blocks says otherwise: 262,144
# tokens, enough for 1,024 requests of 256 tokens.
SIMULATED_NUM_KV_BLOCKS = 16_384


@dataclass(slots=True)
class WorkerStep:
    """One step between ``Worker.prepare_step`` and ``Worker.finish_step``."""

    scheduler_output: SchedulerOutput
    prepared: PreparedStep | None = None
    launched: LaunchedStep | None = None
    error: Exception | None = None  # raised by a part of the step; finish_step fails it

    @property
    def done(self) -> StepEvent:
        """When the step's device work ends (at once when it never reached the device)."""
        return self.launched.done if self.launched is not None else COMPLETED


class Worker:
    """One model and its KV cache on one device; see the module docstring for the lifecycle."""

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.device = torch.device(config.device)
        self.model: nn.Module | None = None
        self.model_config: ModelConfig | None = None
        self.model_name = ""
        self.max_model_len = 0
        self.num_blocks = 0
        self.model_runner: ModelRunner | None = None
        self.grammar: GrammarBackend | None = None
        self.num_consecutive_failed_steps = 0

    def load_model(self) -> None:
        """Loads the weights onto the device and fixes ``max_model_len``."""
        if self.config.num_threads is not None:
            torch.set_num_threads(self.config.num_threads)
        if self.device.type == "cpu":
            # Before anything compiles: the pieces and the CPU attention kernel.
            use_compile_cache(self.config.compile_cache_dir)
        model_dir = resolve_model_dir(self.config.model)
        self.model_name = self.config.model or DEFAULT_MODEL_NAME
        if self.config.simulate is not None:  # the config alone: no weights
            self.model_config = ModelConfig.from_pretrained(model_dir, self.config.dtype,
                                                            self.device)
        else:
            if self.device.type == "cpu":
                # Built (once per machine) before registration, not in a first request.
                load_cpu_kernels()
            self.model, self.model_config = load_model(model_dir, self.config.dtype, self.device,
                                                       self.config.quantization)
            # Reads the tokenizer on its own thread while the worker warms up.
            self.grammar = GrammarBackend(model_dir, self.model_config.vocab_size,
                                          list(self.model_config.eos_token_ids))
        self.max_model_len = resolve_max_model_len(self.model_config.max_model_len,
                                                   self.config.max_model_len)

    def initialize_kv_cache(self) -> int:
        """Allocates the KV cache and the model runner; returns the number of blocks."""
        if self.model_config is None:
            raise RuntimeError("initialize_kv_cache() needs load_model() first")
        if self.config.simulate is not None:
            self.num_blocks = self.config.num_kv_blocks or SIMULATED_NUM_KV_BLOCKS
            self.model_runner = SimulatedModelRunner(self.config.simulate, self.model_config,
                                                     **self._runner_options())
            return self.num_blocks
        assert self.model is not None
        mc = self.model_config
        spec = KVCacheSpec(
            block_size=self.config.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_size=mc.head_size,
            dtype=parse_kv_cache_dtype(self.config.kv_cache_dtype, mc.dtype),
            num_layers=mc.num_layers,
        )
        num_blocks = self.config.num_kv_blocks or determine_num_blocks(
            spec, self.device, self.config.gpu_memory_utilization, self.config.kv_cache_gib
        )
        kv_caches = allocate_kv_caches(spec, num_blocks, self.device)
        self.num_blocks = num_blocks
        self.model_runner = ModelRunner(
            self.model,
            mc,
            kv_caches,
            **self._runner_options(),
            cudagraph_mode=self.config.resolved_cudagraph_mode(),
            cudagraph_capture_sizes=self.config.resolved_capture_sizes(),
            compile_pieces=self.config.resolved_compile_pieces(),
            speculative=self.config.speculative_config,
        )
        self.model_runner.capture_model()
        if self.model_runner.compiled_pieces:
            warm_up_model(self.model_runner, self.config.block_size, num_blocks)
        spec = self.config.speculative_config
        if spec is not None and self.model_runner.drafter is not None:
            self.model_runner.drafter.step_costs = measure_step_costs(
                self.model_runner, self.config.block_size, num_blocks, spec.num_speculative_tokens)
        return num_blocks

    def _runner_options(self) -> dict[str, Any]:
        """The model runner's batch sizing and sampling options, from the config."""
        return dict(
            block_size=self.config.block_size,
            max_num_reqs=self.config.limits.max_num_seqs,
            max_num_batched_tokens=self.config.limits.max_num_batched_tokens,
            max_model_len=self.max_model_len,
            device=self.device,
            logitsprocs=self.config.logits_processors,
            thinking=self.config.thinking,
            grammar=self.grammar,
        )

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step. A step that raises fails its own requests and the worker goes on.

        The error is raised instead when the device itself failed (its error
        is sticky) or after MAX_CONSECUTIVE_FAILED_STEPS in a row: then only a
        restart helps, and the scheduler re-places the requests elsewhere.
        The same as ``finish_step(launch_step(prepare_step(scheduler_output)))``.
        """
        return self.finish_step(self.launch_step(self.prepare_step(scheduler_output)))

    def prepare_step(self, scheduler_output: SchedulerOutput) -> WorkerStep:
        """ModelRunner.prepare_step; an error is kept for finish_step to report."""
        runner = self._runner()
        step = WorkerStep(scheduler_output)
        try:
            step.prepared = runner.prepare_step(scheduler_output)
        except Exception as e:
            step.error = e
        return step

    def launch_step(self, step: WorkerStep) -> WorkerStep:
        """ModelRunner.launch_step, unless the step already failed; an error is kept."""
        runner = self._runner()
        if step.error is None:
            assert step.prepared is not None
            try:
                step.launched = runner.launch_step(step.prepared)
            except Exception as e:
                step.error = e
        return step

    def finish_step(self, step: WorkerStep) -> ModelRunnerOutput:
        """The step's output: ModelRunner.finish_step, or every request of the step
        failed when any part of it raised (see ``execute_model`` for when it raises)."""
        runner = self._runner()
        if step.error is None:
            assert step.launched is not None
            try:
                output = runner.finish_step(step.launched)
            except Exception as e:
                step.error = e
            else:
                self.num_consecutive_failed_steps = 0
                return output
        error = step.error
        self.num_consecutive_failed_steps += 1
        if (isinstance(error, torch.AcceleratorError)
                or self.num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS):
            raise error
        so = step.scheduler_output
        logger.error("event=step_failed step_id=%d num_requests=%d", so.step_id,
                     len(so.num_scheduled_tokens), exc_info=error)
        return runner.fail_step(so, error)

    @property
    def overlaps_steps(self) -> bool:
        """Whether a step may be prepared while the previous one is unfinished."""
        return getattr(self.model_runner, "overlaps_steps", True)

    def _runner(self) -> ModelRunner:
        if self.model_runner is None:
            raise RuntimeError("steps need initialize_kv_cache() first")
        return self.model_runner

    def registration_info(self, worker_id: str = "") -> WorkerRegistration:
        """What this worker registers with the scheduler as ``worker_id``."""
        if self.model_config is None or self.model_runner is None:
            raise RuntimeError("registration_info() needs load_model() and initialize_kv_cache()")
        spec = self.config.speculative_config
        return WorkerRegistration(
            worker_id=worker_id,
            model=self.model_name,
            dtype=str(self.model_config.dtype).removeprefix("torch."),
            block_size=self.config.block_size,
            num_blocks=self.num_blocks,
            max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size,
            eos_token_ids=list(self.model_config.eos_token_ids),
            limits=self.config.limits,
            num_speculative_tokens=spec.num_speculative_tokens if spec else 0,
            speculative_disable_by_batch_size=spec.disable_by_batch_size if spec else 0,
        )
