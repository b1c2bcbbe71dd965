"""The frontend's configs: the service (`FrontendServiceConfig`) and the model
facts it validates requests against (`ModelInfo`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from services.common.max_model_len import max_model_len_from_hf_config
from services.common.model_files import DEFAULT_MODEL_NAME
from services.common.scheduler_addresses import parse_scheduler_addresses
from services.common.security import TlsConfig
from services.common.validation import DEFAULT_MAX_LOGPROBS, RequestLimits


@dataclass(slots=True, kw_only=True)
class FrontendServiceConfig:
    """Where the frontend listens, which scheduler it streams to, which model it serves.

    ``model`` None is the default model; ``max_model_len`` None is the
    model's limit capped at 2048, as on the workers (pass the workers' value
    when they use another). ``port`` 0 picks a free port. ``http_port`` serves
    the HTTP API (OpenAI's, ``/metrics``, the dashboard) on ``host`` too: 0
    picks a free port, None serves none (the command line's default is 8000).
    ``api_keys`` / ``admin_api_keys``: see services/frontend/auth.py. ``tls``
    serves the public APIs over TLS (its certificate and key) and
    authenticates the frontend to the scheduler (the same certificate, checked
    against its CA); ``cluster_secret`` goes with every scheduler call.
    ``scheduler_address`` is ``HOST:PORT[,HOST:PORT...]``, one per scheduler
    (cell), or a DNS name resolving to several. ``redis_url`` reads the
    cells' prefix index to route requests (None: by load only), weighing a
    prompt token to prefill by ``router_prefill_weight`` and each request a
    cell holds as ``router_request_weight`` tokens (cell_routing.py). A lost cell's
    requests wait ``cell_grace_s`` for it before another cell takes them;
    requests wait at most ``resubmit_grace_s`` for any cell (engine_cells.py).
    ``request_limits`` bound each request before it is tokenized.
    ``logits_processors`` names the custom processors the workers run (plus
    the installed plugins): their ``validate_params`` run at admission.
    ``chat_template`` replaces the model's (a bundled name such as
    "smollm2_tools", a file, or the template itself); None keeps the
    model's, except that the default model gets its tool-aware template.
    ``tool_call_parser`` reads tool calls in free answers ("hermes", "smollm2").
    ``reasoning_parser`` ("deepseek_r1", "think") splits chat answers into
    ``reasoning_content`` and ``content``; constraints apply after the reasoning.
    """

    host: str = "127.0.0.1"
    port: int = 50051
    scheduler_address: str = "127.0.0.1:50052"
    model: str | None = None
    max_model_len: int | None = None
    max_logprobs: int = DEFAULT_MAX_LOGPROBS
    stream_interval: int = 1
    http_port: int | None = None
    api_keys: tuple[str, ...] = ()
    admin_api_keys: tuple[str, ...] = ()
    resubmit_grace_s: float = 30.0
    redis_url: str | None = None
    router_prefill_weight: float = 1.0
    router_request_weight: float = 32.0
    cell_grace_s: float = 1.0
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    logits_processors: list[str] = field(default_factory=list)
    chat_template: str | None = None
    tool_call_parser: str = "hermes"
    reasoning_parser: str | None = None
    tls: TlsConfig | None = None
    cluster_secret: str | None = None

    def __post_init__(self) -> None:
        for name in ("port", "http_port"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 65535:
                raise ValueError(f"{name} is {value}, must be in [0, 65535]")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len is {self.max_model_len}, must be >= 2")
        if self.max_logprobs < 0:
            raise ValueError(f"max_logprobs is {self.max_logprobs}, must be >= 0")
        if self.stream_interval < 1:
            raise ValueError(f"stream_interval is {self.stream_interval}, must be >= 1")
        for name in ("resubmit_grace_s", "cell_grace_s", "router_prefill_weight",
                     "router_request_weight"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} is {getattr(self, name)}, must be >= 0")
        parse_scheduler_addresses(self.scheduler_address)  # ValueError naming the bad one


@dataclass(slots=True, frozen=True)
class ModelInfo:
    """What the frontend validates against and reports in GetModelInfo."""

    name: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]


def read_model_info(
    model_dir: Path, config: FrontendServiceConfig, eos_token_ids: list[int]
) -> ModelInfo:
    """The model facts from ``config.json``; ``max_model_len`` by the workers' rule."""
    hf = json.loads((model_dir / "config.json").read_text())
    max_model_len = max_model_len_from_hf_config(hf, config.max_model_len)
    return ModelInfo(config.model or DEFAULT_MODEL_NAME, max_model_len, hf["vocab_size"],
                     tuple(eos_token_ids))
