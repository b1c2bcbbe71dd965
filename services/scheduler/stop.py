"""Token-level stop conditions, checked after each appended output token.

Stop strings are text and belong to the frontend; everything here works on
token ids only.
"""

from __future__ import annotations

from services.scheduler.request import Request, RequestStatus


def check_stop(request: Request, max_model_len: int) -> bool:
    """Returns True and marks ``request`` finished if its last output token ends it.

    In order:
    1. once ``min_tokens`` outputs exist: the EOS token (unless ``ignore_eos``)
       -> FINISHED_STOPPED with ``stop_reason`` None; a token of
       ``stop_token_ids`` -> FINISHED_STOPPED with ``stop_reason`` = that id;
    2. ``max_tokens`` outputs, or ``num_tokens >= max_model_len``
       -> FINISHED_LENGTH_CAPPED.
    A stop token beats the length cap when both hold. ``min_tokens`` only
    holds back EOS and stop ids, never the length caps, so a request can never
    grow past ``max_model_len``.
    """
    params = request.sampling_params
    output_token_ids = request.output_token_ids
    num_output_tokens = len(output_token_ids)
    if num_output_tokens >= params.min_tokens:
        last_token_id = output_token_ids[-1]
        if last_token_id == request.eos_token_id and not params.ignore_eos:
            request.status = RequestStatus.FINISHED_STOPPED
            return True
        if last_token_id in params.stop_token_ids:
            request.status = RequestStatus.FINISHED_STOPPED
            request.stop_reason = last_token_id
            return True
    max_tokens = request.max_tokens
    if len(request.all_token_ids) >= max_model_len or (
        max_tokens is not None and num_output_tokens >= max_tokens
    ):
        request.status = RequestStatus.FINISHED_LENGTH_CAPPED
        return True
    return False
