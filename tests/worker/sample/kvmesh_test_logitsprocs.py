"""Custom logits processors the sampler tests load by "module:Class" and entry point."""

from __future__ import annotations

import torch

from services.common.sampling_params import SamplingParams
from services.worker.sample.logits_processor import (
    AdapterLogitsProcessor,
    BatchUpdate,
    LogitsProcessor,
    LogitsProcessorConfig,
)


class BanFirstTokenProcessor(LogitsProcessor):
    """Bans token 0 in every row (a stateless batch-level processor)."""

    def __init__(
        self, config: LogitsProcessorConfig, device: torch.device, is_pin_memory: bool
    ) -> None:
        self.max_num_reqs = config.max_num_reqs

    def is_argmax_invariant(self) -> bool:
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        return None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        logits[:, 0] = float("-inf")
        return logits


class RejectMaxTokens13Processor(BanFirstTokenProcessor):
    """Rejects requests with max_tokens == 13 at add time; otherwise inert."""

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        if params.max_tokens == 13:
            raise ValueError("max_tokens=13 is not served")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits


class NoRepeatAdapter(AdapterLogitsProcessor):
    """Seeded requests may not repeat their previous output token.

    Two-argument callable that returns a NEW row (exercises the write-back).
    ``seed`` is the trigger; BanExtraArgsTokensAdapter reads ``extra_args``.
    """

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if params.seed is None:
            return None

        def ban_last(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if not output_ids:
                return logits
            banned = logits.clone()
            banned[output_ids[-1]] = float("-inf")
            return banned

        return ban_last


class BanPromptTokensAdapter(AdapterLogitsProcessor):
    """Seeded requests may not emit any prompt token (three-argument callable, in place)."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if params.seed is None:
            return None
        return _BanPrompt()


class _BanPrompt:
    def __call__(
        self, prompt_ids: list[int], output_ids: list[int], logits: torch.Tensor
    ) -> torch.Tensor:
        logits[prompt_ids] = float("-inf")
        return logits


class FourArgAdapter(AdapterLogitsProcessor):
    """Returns a callable of the wrong arity: adding a seeded request must fail."""

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        if params.seed is None:
            return None
        return lambda a, b, c, d: d


class BanExtraArgsTokensAdapter(AdapterLogitsProcessor):
    """Bans the token ids a request lists in ``extra_args["ban_token_ids"]``.

    extra_args numbers cross the wire as floats, hence the ``int``.
    """

    @classmethod
    def validate_params(cls, params: SamplingParams) -> None:
        banned = (params.extra_args or {}).get("ban_token_ids", [])
        if not isinstance(banned, list):
            raise ValueError(f"extra_args['ban_token_ids'] must be a list, got {banned!r}")

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        banned = [int(t) for t in (params.extra_args or {}).get("ban_token_ids", [])]
        if not banned:
            return None

        def ban(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            logits[banned] = float("-inf")
            return logits

        return ban


class PoisonAdapter(AdapterLogitsProcessor):
    """Fails the requests that ask for it with ``extra_args["poison"]``, each its own way.

    "refuse": ``new_req_logits_processor`` raises ValueError (a refusal of the
    arguments); "raise": the callable raises; "nan": the callable writes NaN.
    """

    def is_argmax_invariant(self) -> bool:
        return False

    def new_req_logits_processor(self, params: SamplingParams):
        poison = (params.extra_args or {}).get("poison")
        if poison is None:
            return None
        if poison == "refuse":
            raise ValueError("extra_args['poison'] is 'refuse'")

        def poisoned(output_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
            if poison == "raise":
                raise RuntimeError("poisoned callable")
            logits[0] = float("nan")
            return logits

        return poisoned


class ExplodingProcessor(BanFirstTokenProcessor):
    """Raises from update_state when a request with ``extra_args["explode"]`` joins:
    a failure no row can be blamed for, so the whole step fails."""

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        for _, params, _, _ in batch_update.added if batch_update else ():
            if (params.extra_args or {}).get("explode"):
                raise RuntimeError("exploding processor")

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        return logits
