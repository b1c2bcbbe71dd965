"""Runs one scheduler step on the model (vLLM V1's GPUModelRunner, CPU or CUDA).

Per step, in three calls so that a step can be prepared while the previous
one is still on the device (``StepPipeline``): ``prepare_step`` applies the
SchedulerOutput diff to the persistent batch (``_update_states``), builds the
flattened inputs in CPU buffers, pads them to the CUDA graph the dispatcher
picks and copies them to the device once (``_prepare_inputs``);
``launch_step`` fills in the input ids the previous step had not sampled yet,
runs the model, computes logits only at each request's last scheduled token,
and samples; ``finish_step`` waits for the device and records the sampled
tokens. ``execute_model`` does all three. CUDA graphs are captured once,
before the first step (``capture_model``).

With speculative decoding (``speculative``) each request's drafts, proposed
when its step finishes, ride in the next step after its last sampled token;
the step's logits cover every one of their positions and the
``RejectionSampler`` samples them in turn. Such a step needs the previous
one finished before it is prepared (``overlaps_steps`` is False), since its
positions and drafts depend on what that step accepted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import partial

import grpc
import numpy as np
import torch
from torch import nn

from services.common.engine import Logprobs
from services.common.model_runner_output import ModelRunnerOutput, RequestFailure
from services.common.scheduler_output import CachedRequestData, NewRequestData, SchedulerOutput
from services.common.speculative import SpeculativeConfig
from services.worker.attention.backend import get_attention_backend
from services.worker.attention.metadata import AttentionMetadata
from services.worker.compilation import compile_piece, cpp_compiler_available
from services.worker.config import ModelConfig
from services.worker.cudagraph import (
    CUDAGraphMode,
    CUDAGraphWrapper,
    CudagraphDispatcher,
    resolve_cudagraph_mode,
)
from services.worker.forward_context import BatchDescriptor, ForwardContext
from services.worker.grammar import GrammarBackend
from services.worker.input_batch import CachedRequestState, InputBatch
from services.worker.sample import Sampler, SamplerOutput, ThinkingConfig, compute_prompt_logprobs
from services.worker.sample.logits_processor.structured_output import (
    StructuredOutputLogitsProcessor,
)
from services.worker.spec_decode import Drafter, DraftState
from services.worker.spec_decode.decode_rows import as_decode_rows
from services.worker.spec_decode.rejection_sampler import RejectionSampler, VerifiedRow
from services.worker.step_events import COMPLETED, CudaStepEvent, StepEvent

logger = logging.getLogger(__name__)
# Query tokens per request in a uniform decode batch (no speculative decoding yet).
UNIFORM_DECODE_QUERY_LEN = 1
# The sampled id that marks a row whose logits were not finite.
_NONFINITE = -1
_NONFINITE_FAILURE = RequestFailure.of(
    grpc.StatusCode.INTERNAL,
    "the logits for this request are not finite (NaN, +inf, or every token masked)",
)
_EARLIER_FAILURE = RequestFailure.of(
    grpc.StatusCode.INTERNAL, "the request failed in the previous step on this worker")


@dataclass(slots=True)
class StepInputs:
    """One step's device inputs, built by ``_prepare_inputs``."""

    input_ids: torch.Tensor  # int64 [padded num_tokens] on the device
    positions: torch.Tensor  # int64 [padded num_tokens] on the device
    attn_metadata: AttentionMetadata
    logits_indices: torch.Tensor  # int64 [num_reqs]: each request's last scheduled token
    num_scheduled_tokens: np.ndarray  # int32 [num_reqs], in batch row order
    cudagraph_runtime_mode: CUDAGraphMode
    batch_descriptor: BatchDescriptor
    # Speculative decoding: each row's drafts in this step, None when no row has any.
    drafts: list[list[int]] | None = None


@dataclass(slots=True)
class PreparedStep:
    """A step whose batch update and inputs are done (``ModelRunner.prepare_step``).

    ``deferred_*``: the input-id slots that need a token the previous step was
    still sampling (flat token index, batch row), or None.
    """

    step_id: int
    failed: dict[str, RequestFailure]
    inputs: StepInputs | None = None  # None: nothing to run
    deferred_token_indices: np.ndarray | None = None
    deferred_rows: np.ndarray | None = None


@dataclass(slots=True)
class LaunchedStep:
    """A step on the device (``ModelRunner.launch_step``); rows as at the launch."""

    step_id: int
    failed: dict[str, RequestFailure]
    done: StepEvent = COMPLETED
    req_ids: list[str] = field(default_factory=list)
    sampler_output: SamplerOutput | None = None  # None: nothing ran
    finished_prompt: list[bool] = field(default_factory=list)
    num_logprobs: list[int | None] | None = None  # per row, when any row asked
    prompt_logprobs: dict[str, Logprobs] = field(default_factory=dict)
    # A step with drafts: each row's samples (already recorded), and its drafts.
    verified: list[VerifiedRow | None] | None = None
    drafts: list[list[int]] | None = None


class _StagedBuffer:
    """A CPU staging tensor (pinned on CUDA) with its device twin, allocated once.

    On the CPU both are the same tensor, so the per-step copy is free.
    """

    def __init__(self, size: int, dtype: torch.dtype, device: torch.device) -> None:
        on_cpu = device.type == "cpu"
        self.cpu = torch.zeros(size, dtype=dtype, pin_memory=not on_cpu)
        self.np = self.cpu.numpy()
        self.device = self.cpu if on_cpu else torch.zeros(size, dtype=dtype, device=device)

    def copy_to_device(self, n: int) -> torch.Tensor:
        if self.device is not self.cpu:
            self.device[:n].copy_(self.cpu[:n], non_blocking=True)
        return self.device[:n]


class ModelRunner:
    """Holds the persistent batch and the KV cache of one worker and executes steps.

    ``requests`` keeps the state of every request the scheduler has placed here
    and not finished, including preempted ones that are out of the batch.
    ``cudagraph_mode`` is downgraded to what the attention backend supports;
    a mode other than NONE needs a CUDA device (WorkerConfig checks it) and
    ``capture_model()`` before the first step. ``compile_pieces`` compiles the
    model's pieces between attention calls with torch.compile (``compiled_pieces``
    says whether it happened); inductor builds them on their first calls, which
    the worker makes in warm-up steps (``warmup.py``) and, on CUDA, the eager
    run before each capture.
    """

    def __init__(
        self,
        model: nn.Module,
        model_config: ModelConfig,
        kv_caches: list[torch.Tensor],
        *,
        block_size: int,
        max_num_reqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        device: torch.device,
        logitsprocs: Sequence[str | type] = (),
        thinking: ThinkingConfig | None = None,
        grammar: GrammarBackend | None = None,
        cudagraph_mode: CUDAGraphMode = CUDAGraphMode.NONE,
        cudagraph_capture_sizes: Sequence[int] = (),  # each in [1, max_num_batched_tokens]
        compile_pieces: bool = False,
        speculative: SpeculativeConfig | None = None,
    ) -> None:
        self.model = model
        self.model_config = model_config
        self.kv_caches = kv_caches
        self.device = torch.device(device)
        self.max_model_len = max_model_len
        self.max_num_batched_tokens = max_num_batched_tokens
        self.requests: dict[str, CachedRequestState] = {}
        self.input_batch = InputBatch(
            max_num_reqs, max_model_len, max_num_batched_tokens, self.device, block_size,
            model_config.vocab_size, logitsprocs=logitsprocs, thinking=thinking,
            eos_token_id=model_config.eos_token_ids[0] if model_config.eos_token_ids else None,
            grammar=grammar,
        )
        self.grammar = grammar
        self.sampler = Sampler()
        self.drafter = Drafter(speculative) if speculative is not None else None
        self.rejection_sampler = RejectionSampler(self.sampler, _NONFINITE_FAILURE)
        # Requests still owed prompt logprobs; usually empty, so the per-step
        # check costs nothing for everyone else.
        self._prompt_logprobs_req_ids: set[str] = set()
        # The requests the step being prepared dropped, and why (ModelRunnerOutput.failed).
        self._failed: dict[str, RequestFailure] = {}
        # A step is prepared and not launched: its rows must stay where they are.
        self._prepared_pending = False
        self._prepared_step_id = -1
        # fail_step emptied the batch under a prepared step: its launch must fail.
        self._prepared_broken = False
        # Requests failed by a step while the next one, already prepared, held their row.
        self._doomed: set[str] = set()
        # Recorded once a step's inputs are on their way to the device; the next
        # prepare_step waits for it before it overwrites the staging buffers.
        self._inputs_copied = torch.cuda.Event() if self.device.type == "cuda" else None
        self.input_ids = _StagedBuffer(max_num_batched_tokens, torch.int64, self.device)
        self.positions = _StagedBuffer(max_num_batched_tokens, torch.int64, self.device)
        self.query_start_loc = _StagedBuffer(max_num_reqs + 1, torch.int32, self.device)
        self.seq_lens = _StagedBuffer(max_num_reqs, torch.int32, self.device)
        self.arange_np = np.arange(max(max_num_reqs, max_num_batched_tokens) + 1, dtype=np.int64)
        self._init_logits_buffers(max_num_reqs, model_config)
        if self.device.type == "cpu" and hasattr(model, "pack_weights_"):
            # Before compiling: the compiled graphs call the packed kernels.
            model.pack_weights_()  # type: ignore[operator]
            if hasattr(model, "fuse_decode_step"):
                rows = model.fuse_decode_step(kv_caches)  # type: ignore[operator]
                logger.info("event=fused_decode_step max_rows=%d", rows)  # 0: not fused
        # Compiled first: the PIECEWISE wrappers go around the compiled pieces
        # (compiling replaces the pieces, which would drop wrappers made before).
        self.compiled_pieces = compile_pieces and self._init_compilation()
        self._init_cudagraphs(cudagraph_mode, list(cudagraph_capture_sizes))

    @property
    def overlaps_steps(self) -> bool:
        """Whether a step may be prepared before the previous one is finished."""
        return self.drafter is None

    def _init_compilation(self) -> bool:
        """Compiles the pieces between attention calls (inductor's C++ loops on the
        CPU, its Triton kernels on CUDA, where graphs then capture them) and, on the
        CPU where the model offers it, the whole decode-only step (its attention is
        the CPU kernel's; on CUDA, FULL graphs do that job); returns whether the
        pieces are compiled. On a CPU without a C++ compiler they stay eager."""
        if not hasattr(self.model, "compile_pieces"):
            return False
        on_cpu = self.device.type == "cpu"
        if on_cpu and not cpp_compiler_available():
            return False
        self.model.compile_pieces(compile_piece)  # type: ignore[operator]
        if on_cpu and hasattr(self.model, "compile_decode_step"):
            self.model.compile_decode_step(compile_piece, self.kv_caches)
        return True

    def _init_logits_buffers(self, max_num_reqs: int, model_config: ModelConfig) -> None:
        """The sampler's float32 logits, allocated once. The LM head writes into them:
        straight from its GEMM where it can (a float32 head), else through the one
        [rows, vocab] result its kernel returns (oneDNN's and the int8 GEMMs have no
        ``out`` form), converted in a single copy."""
        self.logits = torch.empty((max_num_reqs, model_config.vocab_size), dtype=torch.float32,
                                  device=self.device)

    def _init_cudagraphs(self, requested: CUDAGraphMode, capture_sizes: list[int]) -> None:
        """Resolves the mode, builds the dispatcher and wraps the model (nothing captured yet)."""
        support = get_attention_backend(self.device).cudagraph_support
        mode = resolve_cudagraph_mode(
            requested, support, piecewise_available=hasattr(self.model, "wrap_pieces"),
            uniform_decode_query_len=UNIFORM_DECODE_QUERY_LEN,
        )
        self.cudagraph_mode = mode
        self.cudagraph_dispatcher = CudagraphDispatcher(
            mode, capture_sizes if mode is not CUDAGraphMode.NONE else [],
            self.input_batch.max_num_reqs, UNIFORM_DECODE_QUERY_LEN,
        )
        # Set around each forward pass; read by the wrappers.
        self.forward_context = ForwardContext()
        # The callable each step runs: the model, or a FULL wrapper around it.
        self._forward = self.model
        if mode is CUDAGraphMode.NONE:
            return
        graph_pool = torch.cuda.graph_pool_handle()
        if mode.has_piecewise_cudagraphs():
            self.model.wrap_pieces(  # type: ignore[operator]
                lambda piece: CUDAGraphWrapper(piece, CUDAGraphMode.PIECEWISE, graph_pool,
                                               self.forward_context))
        if mode.has_full_cudagraphs():
            self._forward = CUDAGraphWrapper(self.model, CUDAGraphMode.FULL, graph_pool,
                                             self.forward_context)

    # ------------------------------------------------------------------ states
    def _update_states(self, scheduler_output: SchedulerOutput) -> None:
        """Applies the step's diff to ``requests`` and the persistent batch.

        Finished requests are forgotten. Requests in the batch but not scheduled
        this step (preempted, or left out of the token budget) leave the batch
        but keep their state. New requests arrive in full; cached ones get their
        new block ids appended, or replaced when resumed from preemption, and
        re-enter the batch if they had left it. Ends with a dense batch.
        """
        batch = self.input_batch
        for req_id in scheduler_output.finished_req_ids:
            self.requests.pop(req_id, None)
            self._prompt_logprobs_req_ids.discard(req_id)
            batch.remove_request(req_id)
        scheduled = scheduler_output.num_scheduled_tokens
        for req_id in [r for r in batch.req_id_to_index if r not in scheduled]:
            batch.remove_request(req_id)
        reqs_to_add = [self._add_new_request(r) for r in scheduler_output.scheduled_new_reqs]
        reqs_to_add += self._update_cached_requests(scheduler_output.scheduled_cached_reqs)
        for state in reqs_to_add:
            self._add_to_batch(state)
        batch.condense()

    def _add_to_batch(self, state: CachedRequestState) -> None:
        """Puts a request into the batch; one the batch refuses fails alone."""
        try:
            self.input_batch.add_request(state)
        except ValueError as e:
            self._drop_request(state.req_id)
            self._failed[state.req_id] = RequestFailure.of(grpc.StatusCode.INVALID_ARGUMENT,
                                                           str(e))

    def _drop_request(self, req_id: str) -> None:
        """Forgets a request the worker failed; the scheduler frees its blocks."""
        self.requests.pop(req_id, None)
        self._prompt_logprobs_req_ids.discard(req_id)
        self.input_batch.remove_request(req_id)

    def _add_new_request(self, new_req: NewRequestData) -> CachedRequestState:
        """Records a request sent in full; the caller puts it into the batch."""
        self.input_batch.remove_request(new_req.req_id)  # re-placed after a lost worker
        state = CachedRequestState(
            req_id=new_req.req_id,
            prompt_token_ids=list(new_req.prompt_token_ids),
            sampling_params=new_req.sampling_params,
            block_ids=list(new_req.block_ids),
            num_computed_tokens=new_req.num_computed_tokens,
            output_token_ids=list(new_req.output_token_ids),
            drafts=DraftState() if self.drafter is not None else None,
        )
        if new_req.sampling_params.prompt_logprobs is not None:
            if state.output_token_ids:
                # The prompt was finished on the lost worker: its logprobs went out.
                state.num_prompt_logprobs_sent = len(state.prompt_token_ids) - 1
            else:
                self._prompt_logprobs_req_ids.add(new_req.req_id)
        self.requests[new_req.req_id] = state
        so = new_req.sampling_params.structured_outputs
        if so is not None and self.grammar is not None:
            # Compiles on the grammar thread while this step's prefill runs.
            self.grammar.compile(so)
        return state

    def _update_cached_requests(self, cached: CachedRequestData) -> list[CachedRequestState]:
        """Applies block and progress deltas; returns the states that must re-enter the batch."""
        batch = self.input_batch
        reqs_to_add: list[CachedRequestState] = []
        for i, req_id in enumerate(cached.req_ids):
            state = self.requests.get(req_id)
            if state is None:
                # Failed here in an earlier step whose output the scheduler had
                # not seen when it scheduled this one (asynchronous scheduling),
                # or never sent in full: either way it fails alone.
                self._failed[req_id] = RequestFailure.of(
                    grpc.StatusCode.INTERNAL, f"request {req_id!r} is not known to this worker "
                    "(it failed in an earlier step, or was never sent in full)")
                continue
            state.num_computed_tokens = cached.num_computed_tokens[i]
            new_block_ids = cached.new_block_ids[i]
            resumed = cached.resumed_from_preemption[i]
            if self.drafter is not None:
                # Scheduled before the scheduler saw the previous step's rejected
                # drafts (asynchronous scheduling), it counts them as computed.
                # Every token this worker holds but the last is computed.
                state.num_computed_tokens = min(state.num_computed_tokens, state.num_tokens - 1)
            if resumed:
                state.block_ids = list(new_block_ids)
            else:
                state.block_ids.extend(new_block_ids)
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                reqs_to_add.append(state)
            elif resumed:
                batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
                batch.block_table.add_row(state.block_ids, row)
            else:
                batch.num_computed_tokens_cpu[row] = state.num_computed_tokens
                batch.block_table.append_row(new_block_ids, row)
        return reqs_to_add

    # ------------------------------------------------------------------ inputs
    def _prepare_inputs(
        self, scheduler_output: SchedulerOutput
    ) -> tuple[StepInputs, np.ndarray | None, np.ndarray | None]:
        """Flattened input ids, positions and attention metadata for the batch, and
        the input-id slots still waiting for the previous step's sample.

        Built with numpy in the CPU staging buffers, padded to the CUDA graph
        the dispatcher picks (nothing to pad when it picks NONE), then each
        buffer is copied to the device once. A slot waits (flat index and row
        returned, else None) when its position is past the row's known tokens:
        with asynchronous scheduling the previous step, still running,
        samples that token.
        """
        batch = self.input_batch
        num_reqs = batch.num_reqs
        scheduled = scheduler_output.num_scheduled_tokens
        num_scheduled = np.fromiter(
            (scheduled[req_id] for req_id in batch.req_ids), dtype=np.int32, count=num_reqs
        )
        drafts = self._place_drafts(scheduler_output, num_scheduled)
        cu_num_tokens = np.cumsum(num_scheduled)
        num_tokens = int(cu_num_tokens[-1])
        if num_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"{num_tokens} tokens scheduled; allowed range is "
                f"[1, {self.max_num_batched_tokens}] (max_num_batched_tokens)"
            )
        # [2, 5, 3] -> req_indices [0 0 1 1 1 1 1 2 2 2], query_pos [0 1 0 1 2 3 4 0 1 2]
        req_indices = np.repeat(self.arange_np[:num_reqs], num_scheduled)
        query_pos = self.arange_np[:num_tokens] - np.repeat(cu_num_tokens - num_scheduled, num_scheduled)
        positions_np = self.positions.np[:num_tokens]
        np.add(batch.num_computed_tokens_cpu[req_indices], query_pos, out=positions_np)
        # Gather input ids from the batch's token table in one index_select.
        token_indices = torch.from_numpy(positions_np + req_indices * self.max_model_len)
        torch.index_select(
            batch.token_ids_cpu.view(-1), 0, token_indices, out=self.input_ids.cpu[:num_tokens]
        )
        known = batch.num_tokens[:num_reqs]
        num_drafts = None
        if drafts is not None:
            num_drafts = np.fromiter(map(len, drafts), dtype=np.int32, count=num_reqs)
            known = known + num_drafts
        waiting = np.flatnonzero(positions_np >= known[req_indices])
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1 : num_reqs + 1] = cu_num_tokens
        seq_lens_np = self.seq_lens.np[:num_reqs]
        np.add(batch.num_computed_tokens_cpu[:num_reqs], num_scheduled, out=seq_lens_np)

        max_query_len = int(num_scheduled.max())
        runtime_mode, key = self.cudagraph_dispatcher.dispatch(
            num_tokens, num_reqs, uniform=max_query_len == UNIFORM_DECODE_QUERY_LEN
        )
        batch.block_table.commit(num_reqs)
        input_ids, positions, attn_metadata = self._pad_and_copy_inputs(
            num_reqs, num_tokens, max_query_len, int(seq_lens_np.max()), runtime_mode, key
        )
        logits_indices = attn_metadata.query_start_loc[1 : num_reqs + 1].to(torch.int64) - 1
        if num_drafts is not None and self.device.type == "cpu" and bool(
                (num_scheduled == 1 + num_drafts).all()):
            attn_metadata = as_decode_rows(attn_metadata, req_indices, positions_np)
        inputs = StepInputs(input_ids, positions, attn_metadata, logits_indices, num_scheduled,
                            runtime_mode, key, drafts)
        if not waiting.size:
            return inputs, None, None
        return inputs, waiting, req_indices[waiting]

    def _place_drafts(self, scheduler_output: SchedulerOutput,
                      num_scheduled: np.ndarray) -> list[list[int]] | None:
        """Puts each granted request's drafts after its tokens in the token table and
        cuts its scheduled tokens to 1 + the drafts it has (at most its budget).
        Returns every row's drafts, or None when no row has any."""
        budgets = scheduler_output.num_draft_tokens
        if not budgets or self.drafter is None:
            return None
        batch = self.input_batch
        drafts: list[list[int]] = [[] for _ in range(batch.num_reqs)]
        for req_id, budget in budgets.items():
            row = batch.req_id_to_index.get(req_id)
            state = self.requests.get(req_id)
            if row is None or state is None or state.drafts is None:
                continue
            row_drafts = state.drafts.token_ids[:budget]
            num_tokens = int(batch.num_tokens[row])
            batch.token_ids_np[row, num_tokens : num_tokens + len(row_drafts)] = row_drafts
            num_scheduled[row] -= budget - len(row_drafts)
            drafts[row] = row_drafts
        return drafts if any(drafts) else None

    def _pad_and_copy_inputs(
        self, num_reqs: int, num_tokens: int, max_query_len: int, max_seq_len: int,
        runtime_mode: CUDAGraphMode, key: BatchDescriptor, write_kv: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Pads the staged batch to ``key``, copies it to the device, builds the metadata.

        Padding tokens (``num_tokens`` up to ``key.num_tokens``) get input id 0,
        position 0 and slot -1, and attention leaves them out. A FULL graph's
        attention is part of the graph, so its metadata takes the key's shape:
        ``key.num_reqs`` requests (the padding ones empty) and the query length
        its kernels were captured for. ``write_kv`` False gives every token slot
        -1 (dummy runs).
        """
        padded_tokens = key.num_tokens
        self.input_ids.np[num_tokens:padded_tokens] = 0
        self.positions.np[num_tokens:padded_tokens] = 0
        attn_reqs = num_reqs
        if runtime_mode is CUDAGraphMode.FULL:
            attn_reqs = key.num_reqs
            self.query_start_loc.np[num_reqs + 1 : attn_reqs + 1] = num_tokens
            self.seq_lens.np[num_reqs:attn_reqs] = 0
            max_query_len = UNIFORM_DECODE_QUERY_LEN if key.uniform else padded_tokens
        input_ids = self.input_ids.copy_to_device(padded_tokens)
        positions = self.positions.copy_to_device(padded_tokens)
        query_start_loc = self.query_start_loc.copy_to_device(attn_reqs + 1)
        seq_lens = self.seq_lens.copy_to_device(attn_reqs)
        block_table = self.input_batch.block_table
        slot_mapping = block_table.compute_slot_mapping(
            query_start_loc, positions, num_reqs, num_tokens if write_kv else 0
        )
        attn_metadata = AttentionMetadata(
            num_reqs=attn_reqs,
            num_actual_tokens=num_tokens,
            max_query_len=max_query_len,
            max_seq_len=max_seq_len,
            query_start_loc=query_start_loc,
            seq_lens=seq_lens,
            block_table=block_table.get_device_tensor(attn_reqs),
            slot_mapping=slot_mapping,
        )
        return input_ids, positions, attn_metadata

    # ----------------------------------------------------------- CUDA graphs
    @torch.inference_mode()
    def capture_model(self) -> None:
        """Captures every graph the dispatcher lists, largest first, each after an eager
        warm-up run of the same shape (which compiles its kernels before capture)."""
        keys = self.cudagraph_dispatcher.keys_to_capture()
        if not keys:
            return
        start = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        for runtime_mode, key in keys:
            self._dummy_run(key, runtime_mode, capture=False)
            self._dummy_run(key, runtime_mode, capture=True)
        torch.cuda.synchronize(self.device)
        used = free_before - torch.cuda.mem_get_info(self.device)[0]
        logger.info("captured %d CUDA graph keys (mode %s) in %.1f s, %.2f GiB",
                    len(keys), self.cudagraph_mode.name, time.perf_counter() - start, used / 2**30)

    def _dummy_run(self, key: BatchDescriptor, graph_mode: CUDAGraphMode, capture: bool) -> torch.Tensor:
        """A forward pass over a made-up batch shaped like ``key``, writing no KV.

        Its attention metadata is what a real batch dispatched to (``graph_mode``,
        ``key``) gets; it runs eagerly unless ``capture``, when the graph is
        captured (on the wrapper's first sight of the key) and replayed. Every
        slot is -1, which the Triton KV write skips: dummy runs happen only on
        CUDA, where capture needs them.
        """
        num_reqs, num_tokens = key.num_reqs, key.num_tokens
        # One token per request, the first request taking the rest: uniform when equal.
        query_lens = np.ones(num_reqs, dtype=np.int32)
        query_lens[0] += num_tokens - num_reqs
        self.input_ids.np[:num_tokens] = 0
        self.positions.np[:num_tokens] = 0
        self.query_start_loc.np[0] = 0
        np.cumsum(query_lens, out=self.query_start_loc.np[1 : num_reqs + 1])
        self.seq_lens.np[:num_reqs] = query_lens
        max_query_len = int(query_lens.max())
        input_ids, positions, attn_metadata = self._pad_and_copy_inputs(
            num_reqs, num_tokens, max_query_len, max_query_len, graph_mode, key, write_kv=False,
        )
        runtime_mode = graph_mode if capture else CUDAGraphMode.NONE
        with self.forward_context.set(runtime_mode, key):
            return self._forward(input_ids, positions, self.kv_caches, attn_metadata)

    # ----------------------------------------------------------------- execute
    @torch.inference_mode()
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step; returns one entry per request in the batch, in row order.

        A request whose prompt is not finished after this step gets ``[]`` (its
        sample is discarded); the others get their sampled token, which is also
        appended to the request's token ids. A request the worker cannot serve
        (refused by the batch or a logits processor, logits not finite) is
        dropped and reported in ``failed`` instead; the others go on. The same
        as ``finish_step(launch_step(prepare_step(scheduler_output)))``.
        """
        return self.finish_step(self.launch_step(self.prepare_step(scheduler_output)))

    @torch.inference_mode()
    def prepare_step(self, scheduler_output: SchedulerOutput) -> PreparedStep:
        """The host's share of a step: the batch update and the inputs, copied to the device.

        May run while the previous step is still on the device (launched, not
        finished): the tokens that step samples are then not known yet, and
        the input ids that need them are filled in by ``launch_step``, which
        must come after the previous step's ``finish_step``.
        """
        if self._inputs_copied is not None:
            # The previous step's copies must have read the staging buffers.
            self._inputs_copied.synchronize()
        self._prepared_pending = True
        self._prepared_step_id = scheduler_output.step_id
        self._failed = {}
        self._update_states(scheduler_output)
        num_reqs = self.input_batch.num_reqs
        if num_reqs == 0 or scheduler_output.total_num_scheduled_tokens == 0:
            return PreparedStep(scheduler_output.step_id, self._failed)
        inputs, waiting, waiting_rows = self._prepare_inputs(scheduler_output)
        return PreparedStep(scheduler_output.step_id, self._failed, inputs, waiting, waiting_rows)

    @torch.inference_mode()
    def launch_step(self, prepared: PreparedStep) -> LaunchedStep:
        """Starts the forward pass and the sampler of a prepared step.

        On a GPU this returns while the device still works; on the CPU the
        work is done when it returns. ``finish_step`` collects the output.
        """
        self._prepared_pending = False
        if self._prepared_broken:
            self._prepared_broken = False
            raise RuntimeError("an earlier step failed after this one was prepared")
        inputs = prepared.inputs
        if inputs is None:
            return LaunchedStep(prepared.step_id, prepared.failed)
        batch = self.input_batch
        num_reqs = batch.num_reqs
        self._fill_deferred_input_ids(prepared, inputs)
        if self._inputs_copied is not None:
            self._inputs_copied.record()
        if inputs.drafts is not None:
            return self._launch_with_drafts(prepared, inputs, num_reqs)
        sampler_output, prompt_logprobs = self._run_model(inputs, num_reqs)
        # seq_lens (computed + scheduled) holds this step's values until the next prepare_step.
        finished_prompt = (self.seq_lens.np[:num_reqs] >= batch.num_tokens[:num_reqs]).tolist()
        num_logprobs = None
        if sampler_output.logprobs_tensors is not None:
            num_logprobs = [self.requests[req_id].sampling_params.logprobs
                            for req_id in batch.req_ids[:num_reqs]]
        return LaunchedStep(
            prepared.step_id, prepared.failed, self._step_event(),
            req_ids=list(batch.req_ids[:num_reqs]), sampler_output=sampler_output,
            finished_prompt=finished_prompt, num_logprobs=num_logprobs,
            prompt_logprobs=prompt_logprobs,
        )

    @torch.inference_mode()
    def finish_step(self, launched: LaunchedStep) -> ModelRunnerOutput:
        """Waits for a launched step and records its samples (the step's one host sync)."""
        output = ModelRunnerOutput(step_id=launched.step_id, failed=launched.failed)
        if launched.verified is not None:
            self._record_verified(launched, output)
        elif launched.sampler_output is not None:
            launched.done.synchronize()
            self._record_samples(launched, output)
        if self.drafter is not None:
            self._propose_drafts(output)
        for req_id in launched.failed:
            launched.prompt_logprobs.pop(req_id, None)
        output.prompt_logprobs = launched.prompt_logprobs
        return output

    def _launch_with_drafts(self, prepared: PreparedStep, inputs: StepInputs,
                            num_reqs: int) -> LaunchedStep:
        """launch_step for a step whose requests carry drafts: the forward pass, the
        logits of every draft position and of each row's last token, then the
        positions sampled in turn (``RejectionSampler``), each kept sample
        recorded at once (the next position's sampling reads it)."""
        batch = self.input_batch
        drafts = inputs.drafts
        assert drafts is not None
        with self.forward_context.set(inputs.cudagraph_runtime_mode, inputs.batch_descriptor):
            hidden_states = self._forward(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
            )
        counts = np.fromiter(map(len, drafts), dtype=np.int64, count=num_reqs) + 1
        row_starts = np.cumsum(counts) - counts
        ends = self.query_start_loc.np[1 : num_reqs + 1].astype(np.int64)
        # Row r's positions are the last counts[r] tokens of its chunk.
        flat = np.repeat(ends - counts - row_starts, counts) + self.arange_np[: int(counts.sum())]
        logits = self.model.compute_logits(hidden_states[torch.from_numpy(flat).to(self.device)])
        sampled = self.seq_lens.np[:num_reqs] >= batch.num_tokens[:num_reqs]
        req_ids = list(batch.req_ids[:num_reqs])
        num_logprobs = None
        if any(self.requests[r].sampling_params.logprobs is not None for r in req_ids):
            num_logprobs = [self.requests[r].sampling_params.logprobs for r in req_ids]
        verified = self.rejection_sampler(
            logits, row_starts, drafts, sampled, batch.sampling_state, batch.append_token,
            num_logprobs, self.logits[:num_reqs])
        return LaunchedStep(
            prepared.step_id, prepared.failed, self._step_event(), req_ids=req_ids,
            finished_prompt=sampled.tolist(),
            prompt_logprobs=self._compute_prompt_logprobs(hidden_states, inputs),
            verified=verified, drafts=drafts,
        )

    def _record_verified(self, launched: LaunchedStep, out: ModelRunnerOutput) -> None:
        """``_record_samples`` for a step with drafts, whose samples the batch already holds."""
        assert launched.verified is not None and launched.drafts is not None
        for row, req_id in enumerate(launched.req_ids):
            result = launched.verified[row]
            if req_id in self._doomed:
                self._fail_request(req_id, _EARLIER_FAILURE, launched.failed)
                continue
            if result is not None and result.failure is not None:
                self._fail_request(req_id, result.failure, launched.failed)
                continue
            out.req_ids.append(req_id)
            if result is None:
                out.sampled_token_ids.append([])
                continue
            out.sampled_token_ids.append(result.token_ids)
            if result.logprobs is not None:
                out.logprobs[req_id] = result.logprobs
            num_drafts = len(launched.drafts[row])
            state = self.requests.get(req_id)
            if num_drafts and state is not None and state.drafts is not None:
                out.num_draft_tokens[req_id] = num_drafts
                Drafter.record(state.drafts, num_drafts, len(result.token_ids) - 1)

    def _propose_drafts(self, out: ModelRunnerOutput) -> None:
        """Each request that just sampled proposes the drafts of its next step (none
        while the batch is past the size where drafting pays)."""
        assert self.drafter is not None
        batch = self.input_batch
        limit = self.drafter.config.disable_by_batch_size
        too_many = bool(limit) and batch.num_reqs > limit
        grammar_proc: StructuredOutputLogitsProcessor | None = None
        for req_id, sampled in zip(out.req_ids, out.sampled_token_ids):
            state = self.requests.get(req_id)
            row = batch.req_id_to_index.get(req_id)
            if not sampled or state is None or state.drafts is None or row is None:
                continue
            if too_many:
                state.drafts.token_ids = []
                continue
            constrain = None
            if state.sampling_params.structured_outputs is not None:
                grammar_proc = grammar_proc or next(
                    (p for p in batch.sampling_state.logitsprocs.all
                     if isinstance(p, StructuredOutputLogitsProcessor)), None)
                if grammar_proc is not None:
                    constrain = partial(grammar_proc.constrain_drafts, row)
            self.drafter.propose(state.drafts, batch.token_ids_np[row, : batch.num_tokens[row]],
                                 constrain)

    def _fill_deferred_input_ids(self, prepared: PreparedStep, inputs: StepInputs) -> None:
        """Puts the previous step's samples, recorded since ``prepared`` was built, into
        its input ids. A request whose sample was not kept (it failed) gets id 0: its
        row is computed and then failed (``_doomed``)."""
        indices, rows = prepared.deferred_token_indices, prepared.deferred_rows
        if indices is None:
            return
        batch = self.input_batch
        # The staging positions hold this step's until the next prepare_step.
        positions = self.positions.np[indices]
        known = positions < batch.num_tokens[rows]
        self.input_ids.np[indices] = np.where(
            known, batch.token_ids_np[rows, positions], 0)
        inputs.input_ids = self.input_ids.copy_to_device(inputs.input_ids.shape[0])

    def _step_event(self) -> StepEvent:
        """When the step just launched is done on the device."""
        return CudaStepEvent() if self.device.type == "cuda" else COMPLETED

    def _run_model(
        self, inputs: StepInputs, num_reqs: int
    ) -> tuple[SamplerOutput, dict[str, Logprobs]]:
        """The forward pass, the logits and the sampler; also the prompt logprobs."""
        with self.forward_context.set(inputs.cudagraph_runtime_mode, inputs.batch_descriptor):
            hidden_states = self._forward(
                inputs.input_ids, inputs.positions, self.kv_caches, inputs.attn_metadata
            )
        logits = self._compute_logits(hidden_states, inputs.logits_indices, num_reqs)
        sampling_metadata = self.input_batch.sampling_state.make_sampling_metadata(num_reqs)
        sampler_output = self.sampler(logits, sampling_metadata)
        return sampler_output, self._compute_prompt_logprobs(hidden_states, inputs)

    def fail_step(self, scheduler_output: SchedulerOutput, error: BaseException) -> ModelRunnerOutput:
        """Drops every request of a step that raised, and empties the batch.

        The step's requests fail with INTERNAL; those held here but not in the
        step keep their state and re-enter the batch when next scheduled. A
        step already prepared on the emptied batch fails when launched.
        """
        message = f"the worker failed to run the step: {error!r}"
        failure = RequestFailure.of(grpc.StatusCode.INTERNAL, message)
        for req_id in scheduler_output.finished_req_ids | self._doomed:
            self.requests.pop(req_id, None)
        failed = {req_id: failure for req_id in scheduler_output.num_scheduled_tokens}
        for req_id in failed:
            self.requests.pop(req_id, None)
            self._prompt_logprobs_req_ids.discard(req_id)
        self._doomed.clear()
        # A later step prepared on the batch just emptied cannot run.
        self._prepared_broken = (self._prepared_pending
                                 and self._prepared_step_id != scheduler_output.step_id)
        self._prepared_pending = False
        self.input_batch.reset()
        return ModelRunnerOutput(step_id=scheduler_output.step_id, failed=failed)

    def _compute_logits(self, hidden_states: torch.Tensor, logits_indices: torch.Tensor,
                        num_reqs: int) -> torch.Tensor:
        """float32 logits [num_reqs, vocab] in ``self.logits``. Only rows whose sample is
        kept (their prompt is done after this step) reach the LM head; the rows of
        requests still mid-prompt are zero, and their samples are discarded."""
        sampled = self.seq_lens.np[:num_reqs] >= self.input_batch.num_tokens[:num_reqs]
        rows = np.flatnonzero(sampled)
        logits = self.logits[:num_reqs]
        if rows.size == num_reqs:
            return self.model.compute_logits(hidden_states[logits_indices], out=logits)
        # Mixed step: the kept rows' logits go to the buffer's first rows, then each
        # moves down to its batch row. rows[i] >= i, so moving from the last row on
        # never overwrites a row still to be moved.
        row_ids = torch.from_numpy(rows).to(self.device)
        self.model.compute_logits(hidden_states[logits_indices[row_ids]], out=logits[: rows.size])
        for i in reversed(range(rows.size)):
            if rows[i] != i:
                logits[rows[i]] = logits[i]
        logits[torch.from_numpy(np.flatnonzero(~sampled)).to(self.device)] = 0.0
        return logits

    def _record_samples(self, launched: LaunchedStep, out: ModelRunnerOutput) -> None:
        """Appends each sample whose request is past its prompt; the rest are discarded.

        A row the sampler flagged (logits not finite, or a processor failed
        it) fails its request instead: the sample is never kept. Requests are
        found by id, as the batch may have changed since the launch.
        """
        sampler_output = launched.sampler_output
        assert sampler_output is not None
        sampled_t = sampler_output.sampled_token_ids
        if sampler_output.nonfinite_rows is not None:
            sampled_t = sampled_t.masked_fill(sampler_output.nonfinite_rows, _NONFINITE)
        sampled = sampled_t.tolist()  # the step's one device sync
        row_failures = sampler_output.row_failures
        for row, req_id in enumerate(launched.req_ids):
            token_id = sampled[row]
            if req_id in self._doomed:
                self._fail_request(req_id, _EARLIER_FAILURE, launched.failed)
                continue
            if token_id == _NONFINITE or row in row_failures:
                failure = (row_failures.get(row) or sampler_output.nonfinite_reasons.get(row)
                           or _NONFINITE_FAILURE)
                self._fail_request(req_id, failure, launched.failed)
                continue
            out.req_ids.append(req_id)
            if not launched.finished_prompt[row]:
                out.sampled_token_ids.append([])
                continue
            self._append_token(req_id, token_id)
            out.sampled_token_ids.append([token_id])
            num_logprobs = launched.num_logprobs[row] if launched.num_logprobs else None
            if num_logprobs is not None:
                # -1 (whole vocabulary) keeps every column the batch computed.
                out.logprobs[req_id] = sampler_output.logprobs_for_row(
                    row, num_logprobs if num_logprobs >= 0 else None
                )

    def _append_token(self, req_id: str, token_id: int) -> None:
        """Records a sample; a request that left the batch since keeps it in its state."""
        row = self.input_batch.req_id_to_index.get(req_id)
        if row is not None:
            self.input_batch.append_token(row, token_id)
        elif (state := self.requests.get(req_id)) is not None:
            state.output_token_ids.append(token_id)

    def _fail_request(self, req_id: str, failure: RequestFailure,
                      failed: dict[str, RequestFailure]) -> None:
        """Reports a request failed and drops it, unless the next step, already
        prepared, holds its row: that step runs it and fails it again (the
        scheduler, which scheduled it there, expects an answer)."""
        failed[req_id] = failure
        if self._prepared_pending and req_id in self.input_batch.req_id_to_index:
            self._doomed.add(req_id)
        else:
            self._doomed.discard(req_id)
            self._drop_request(req_id)

    def _compute_prompt_logprobs(
        self, hidden_states: torch.Tensor, inputs: StepInputs
    ) -> dict[str, Logprobs]:
        """Logprobs of the prompt tokens this step's chunk predicts.

        The hidden state at prompt position ``p`` scores prompt token ``p + 1``,
        so a chunk covering positions ``[start, end)`` yields rows for prompt
        tokens ``start + 1 .. min(end, P - 1)``; prompt token 0 has none. Rows
        already sent (before a preemption) are not sent again.
        """
        if not self._prompt_logprobs_req_ids:
            return {}
        batch = self.input_batch
        query_start_loc = self.query_start_loc.np
        out: dict[str, Logprobs] = {}
        for req_id in list(self._prompt_logprobs_req_ids):
            row = batch.req_id_to_index.get(req_id)
            if row is None:
                continue
            state = self.requests[req_id]
            start = int(batch.num_computed_tokens_cpu[row])
            chunk_end = start + int(inputs.num_scheduled_tokens[row])
            last_position = len(state.prompt_token_ids) - 1
            first = max(start, state.num_prompt_logprobs_sent)
            end = min(chunk_end, last_position)
            if end > first:
                flat_start = int(query_start_loc[row]) + first - start
                logits = self.model.compute_logits(hidden_states[flat_start : flat_start + end - first])
                targets = batch.token_ids_cpu[row, first + 1 : end + 1].to(logits.device)
                out[req_id] = compute_prompt_logprobs(
                    logits, targets, state.sampling_params.prompt_logprobs
                )
                state.num_prompt_logprobs_sent = end
            if chunk_end >= last_position:
                self._prompt_logprobs_req_ids.discard(req_id)
        return out

