"""The scheduler's configs: how every worker is scheduled (`SchedulingOptions`),
one worker's scheduling loop (`SchedulerConfig`) and the service (`SchedulerServiceConfig`)."""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field, fields

from services.common.limits import SchedulingLimits
from services.common.registration import WorkerRegistration
from services.common.security import TlsConfig
from services.common.validation import DEFAULT_MAX_LOGPROBS
from services.scheduler.request_queue import SchedulingPolicy


@dataclass(slots=True, kw_only=True)
class SchedulingOptions:
    """How a scheduler service, or the offline engine, schedules each of its workers.

    ``limits`` are capped per worker by what the worker reports
    (``make_scheduler_config``). ``async_scheduling`` schedules a worker's next
    step before the output of its current one arrives (``max_steps_in_flight``
    2 instead of 1), hiding the control plane behind the worker's compute.
    Every field is validated on construction; a bad value raises ``ValueError``
    naming the field and the allowed range.
    """

    limits: SchedulingLimits = field(default_factory=SchedulingLimits)
    long_prefill_token_threshold: int = 0  # most tokens of one request per step; 0 = off
    policy: SchedulingPolicy | str = SchedulingPolicy.FCFS
    enable_prefix_caching: bool = True
    max_num_waiting: int = 0  # bound on each worker's waiting queue; 0 = unbounded
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        _check_at_least("long_prefill_token_threshold", self.long_prefill_token_threshold, 0)
        _check_at_least("max_num_waiting", self.max_num_waiting, 0)
        try:
            self.policy = SchedulingPolicy(self.policy)
        except ValueError:
            allowed = ", ".join(repr(p.value) for p in SchedulingPolicy)
            raise ValueError(f"policy is {self.policy!r}, allowed: {allowed}") from None

    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        defaults = SchedulingOptions()
        SchedulingLimits.add_cli_args(parser)
        parser.add_argument("--long-prefill-token-threshold", type=int,
                            default=defaults.long_prefill_token_threshold, help="0: off")
        parser.add_argument("--policy", default=defaults.policy.value,
                            choices=[policy.value for policy in SchedulingPolicy])
        parser.add_argument("--max-num-waiting", type=int, default=defaults.max_num_waiting,
                            help="0: unbounded")
        parser.add_argument("--no-prefix-caching", action="store_true")
        parser.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction,
                            default=defaults.async_scheduling,
                            help="schedule a worker's next step while it computes the "
                                 "current one (default: on)")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> SchedulingOptions:
        return cls(
            limits=SchedulingLimits.from_cli_args(args),
            long_prefill_token_threshold=args.long_prefill_token_threshold,
            policy=args.policy,
            enable_prefix_caching=not args.no_prefix_caching,
            max_num_waiting=args.max_num_waiting,
            async_scheduling=args.async_scheduling,
        )

    @property
    def max_steps_in_flight(self) -> int:
        """Steps sent to a worker whose output has not arrived, at most."""
        return 2 if self.async_scheduling else 1


@dataclass(slots=True, kw_only=True)
class SchedulerConfig(SchedulingOptions):
    """One scheduling loop: the options it runs under plus one worker's block pool.

    ``num_blocks`` is what the worker reported and INCLUDES the null block 0,
    so ``num_blocks - 1`` blocks can hold KV. ``max_model_len`` bounds prompt
    plus output tokens of one request. ``num_speculative_tokens`` > 0 grants
    each decoding request that many draft slots a step (fewer near its
    ``max_tokens`` or ``max_model_len``), none while more than
    ``speculative_disable_by_batch_size`` requests run (0: no bound).
    """

    num_blocks: int
    block_size: int = 16
    max_model_len: int = 2048
    engine_index: int = 0
    num_speculative_tokens: int = 0
    speculative_disable_by_batch_size: int = 0

    def __post_init__(self) -> None:
        SchedulingOptions.__post_init__(self)
        _check_at_least("num_blocks", self.num_blocks, 2)
        _check_at_least("block_size", self.block_size, 1)
        # One prompt token plus one generated token is the smallest useful request.
        _check_at_least("max_model_len", self.max_model_len, 2)
        _check_at_least("engine_index", self.engine_index, 0)
        _check_at_least("num_speculative_tokens", self.num_speculative_tokens, 0)
        _check_at_least("speculative_disable_by_batch_size",
                        self.speculative_disable_by_batch_size, 0)

    @property
    def num_usable_blocks(self) -> int:
        """Blocks that can hold KV (all but the null block)."""
        return self.num_blocks - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RegistrationBounds:
    """The largest worker the scheduler accepts (see worker_checks.check_registration).

    ``max_num_blocks`` bounds the memory one registration makes the scheduler
    allocate (a few hundred bytes of bookkeeping per block): 1M blocks of 16
    tokens is 16M tokens of KV, beyond any single GPU today.
    """

    max_num_blocks: int = 1 << 20
    max_block_size: int = 1024
    max_model_len: int = 1 << 22
    max_vocab_size: int = 1 << 22
    max_num_seqs: int = 1 << 16
    max_num_batched_tokens: int = 1 << 22


@dataclass(slots=True, kw_only=True)
class SchedulerServiceConfig:
    """How the scheduler service listens, mirrors KV state, and schedules each worker.

    ``port`` 0 picks a free port (``SchedulerServer.port`` tells which).
    ``redis_url`` None keeps the KV mirror in memory. ``model`` namespaces the
    Redis keys and must equal what workers report; None adopts the first
    worker's. ``scheduling`` applies to every worker (see
    ``make_scheduler_config``). ``load_weight_tokens``: how many
    prefix-hit tokens one queued request on a worker is worth when placing
    requests (see router.Router). ``max_logprobs`` bounds the logprobs a
    request may ask for (the frontend's bound, checked again here).
    ``metrics_port`` serves Prometheus ``/metrics`` on ``host`` (0: a free
    port; None: off). ``tls`` encrypts the server (mutual TLS when it names a
    CA); ``cluster_secret``, when set, is required on every EngineCore call.
    A worker that does not answer a step within ``worker_step_timeout_s`` is
    declared lost and its requests are re-placed (a frozen worker).
    ``fault_exit_after_step`` is fault injection for tests, 0 (off) by default:
    the probability that the process exits (code 70) when a worker's answer
    arrives, after the worker computed the step and before it is applied.
    ``cell_id`` names this scheduler's cell, stable across its restarts (""
    means its listening address, with the host name for a wildcard host); with a ``redis_url`` the cell is published
    for frontends to route by, under a lease of ``cell_lease_ttl_s``.
    """

    host: str = "127.0.0.1"
    port: int = 50052
    redis_url: str | None = None
    model: str | None = None
    scheduling: SchedulingOptions = field(default_factory=SchedulingOptions)
    load_weight_tokens: float = 32.0
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    registration_bounds: RegistrationBounds = field(default_factory=RegistrationBounds)
    worker_step_timeout_s: float = 15.0
    fault_exit_after_step: float = 0.0
    tls: TlsConfig | None = None
    cluster_secret: str | None = None
    metrics_port: int | None = None
    cell_id: str = ""
    cell_lease_ttl_s: float = 3.0

    def __post_init__(self) -> None:
        if len(self.cell_id) > 128 or not all(c.isalnum() or c in "-_.:" for c in self.cell_id):
            raise ValueError(f"cell_id is {self.cell_id!r}: at most 128 characters among "
                             "letters, digits and -_.:")
        if not 0.5 <= self.cell_lease_ttl_s <= 60:
            raise ValueError(f"cell_lease_ttl_s is {self.cell_lease_ttl_s}, must be in [0.5, 60]")
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} is {value}, must be in [0, 65535]")
        if self.load_weight_tokens < 0:
            raise ValueError(f"load_weight_tokens is {self.load_weight_tokens}, must be >= 0")
        _check_at_least("max_logprobs", self.max_logprobs, 0)
        if self.worker_step_timeout_s <= 0:
            raise ValueError(f"worker_step_timeout_s is {self.worker_step_timeout_s}, "
                             "must be > 0")
        if not 0.0 <= self.fault_exit_after_step <= 1.0:
            raise ValueError(f"fault_exit_after_step is {self.fault_exit_after_step}, "
                             "must be in [0, 1]")


def make_scheduler_config(
    options: SchedulingOptions, registration: WorkerRegistration, engine_index: int
) -> SchedulerConfig:
    """A worker's SchedulerConfig: its pool geometry and ``max_model_len``, the
    ``options``, and their limits capped by the worker's own (its batch buffers).

    The one place a worker's scheduling loop is configured, for the scheduler
    service and the offline engine alike; ValueError for a bad geometry.
    """
    shared = {f.name: getattr(options, f.name) for f in fields(SchedulingOptions)}
    shared["limits"] = options.limits.capped_by(registration.limits)
    return SchedulerConfig(
        num_blocks=registration.num_blocks,
        block_size=registration.block_size,
        max_model_len=registration.max_model_len,
        engine_index=engine_index,
        num_speculative_tokens=registration.num_speculative_tokens,
        speculative_disable_by_batch_size=registration.speculative_disable_by_batch_size,
        **shared,
    )


def _check_at_least(name: str, value: int, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} is {value!r}, must be an integer >= {minimum}")
