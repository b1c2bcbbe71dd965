"""A small synchronous Python client of the public ``kvmesh.v1.Generation`` API.

    from kvmesh.client import Client

    with Client("127.0.0.1:50051") as client:
        for chunk in client.chat([{"role": "user", "content": "Hi!"}], max_tokens=32):
            print(chunk.outputs[0].text, end="", flush=True)

Sampling keyword arguments are the fields of ``kvmesh.v1.SamplingParams``;
whatever is not given takes vLLM's default (temperature 1.0, top_p 1.0,
skip_special_tokens True, ...), except ``output_kind``, which is DELTA so a
stream's chunks concatenate to the answer. ``max_tokens`` not given means
"until EOS or the end of the context window". Errors are ``grpc.RpcError``
with the server's status code (INVALID_ARGUMENT names the bad field).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvmesh.v1 import api_pb2, api_pb2_grpc, engine_pb2
from services.common.rpc import CHANNEL_OPTIONS
from services.common.security import TlsConfig, channel

ChatMessage = Mapping[str, str]

# The client streams deltas; every field left unset takes vLLM's default on the server.
_DEFAULTS: dict[str, Any] = {"output_kind": engine_pb2.DELTA}
_SAMPLING_FIELDS = frozenset(engine_pb2.SamplingParams.DESCRIPTOR.fields_by_name)


def make_sampling_params(**sampling: Any) -> engine_pb2.SamplingParams:
    """A SamplingParams message from keyword arguments (vLLM names and defaults).

    ``output_kind`` may be "delta", "cumulative", "final_only" or the enum
    value; ``stop`` may be one string. Structured outputs: ``json`` (a schema,
    as a dict or JSON text), ``regex``, ``choice`` (a list of strings),
    ``grammar``, ``json_object=True`` or ``structural_tag``, at most one.
    Raises TypeError for an unknown name.
    """
    unknown = sorted(set(sampling) - _SAMPLING_FIELDS)
    if unknown:
        raise TypeError(
            f"unknown sampling parameter(s) {unknown}; allowed: {sorted(_SAMPLING_FIELDS)}"
        )
    values = {**_DEFAULTS, **{k: v for k, v in sampling.items() if v is not None}}
    if isinstance(values["output_kind"], str):
        values["output_kind"] = engine_pb2.RequestOutputKind.Value(values["output_kind"].upper())
    if isinstance(values.get("stop"), str):
        values["stop"] = [values["stop"]]
    if isinstance(values.get("choice"), (list, tuple)):
        values["choice"] = engine_pb2.ChoiceConstraint(choices=values["choice"])
    for name in ("json", "structural_tag"):
        if isinstance(values.get(name), dict):
            values[name] = json.dumps(values[name])
    return engine_pb2.SamplingParams(**values)


class Client:
    """One channel to a frontend; safe to share between threads.

    ``timeout_s`` is the default deadline of every call (None: no deadline).
    """

    def __init__(self, address: str, *, timeout_s: float | None = None,
                 tls: TlsConfig | None = None) -> None:
        """``tls``: dial over TLS, trusting ``tls.ca_file`` (None: the system's roots)."""
        self.address = address
        self.timeout_s = timeout_s
        self._channel = channel(address, tls, CHANNEL_OPTIONS)
        self._stub = api_pb2_grpc.GenerationStub(self._channel)

    def generate(
        self,
        prompt: str | None = None,
        *,
        messages: Sequence[ChatMessage] | None = None,
        token_ids: Sequence[int] | None = None,
        request_id: str = "",
        priority: int = 0,
        cache_salt: str | None = None,
        timeout_s: float | None = None,
        **sampling: Any,
    ) -> Iterator[api_pb2.GenerateResponse]:
        """Streams the chunks for exactly one of ``prompt`` (text),
        ``messages`` (chat) or ``token_ids``.

        Stopping the iteration early (``close()`` on the iterator, or leaving
        a ``for`` loop and dropping it) cancels the call, which aborts the
        request on the server.
        """
        request = api_pb2.GenerateRequest(
            request_id=request_id,
            sampling_params=make_sampling_params(**sampling),
            priority=priority,
        )
        _set_prompt(request, prompt, messages, token_ids)
        if cache_salt is not None:
            request.cache_salt = cache_salt
        return _stream(self._stub.Generate(request, timeout=self._timeout(timeout_s)))

    def chat(
        self, messages: Sequence[ChatMessage], **kwargs: Any
    ) -> Iterator[api_pb2.GenerateResponse]:
        """``generate(messages=messages, **kwargs)``: the model's chat template applies."""
        return self.generate(messages=messages, **kwargs)

    def complete(self, prompt: str | None = None, **kwargs: Any) -> api_pb2.GenerateResponse:
        """The final response of a request (FINAL_ONLY): every output's whole text."""
        kwargs["output_kind"] = engine_pb2.FINAL_ONLY
        *_, last = self.generate(prompt, **kwargs)
        return last

    def tokenize(
        self,
        text: str | None = None,
        *,
        messages: Sequence[ChatMessage] | None = None,
        add_special_tokens: bool = True,
    ) -> list[int]:
        request = api_pb2.TokenizeRequest(add_special_tokens=add_special_tokens)
        _set_prompt(request, text, messages, None)
        return list(self._stub.Tokenize(request, timeout=self._timeout(None)).token_ids)

    def detokenize(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        request = api_pb2.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=skip_special_tokens
        )
        return self._stub.Detokenize(request, timeout=self._timeout(None)).text

    def model_info(self) -> api_pb2.ModelInfo:
        return self._stub.GetModelInfo(api_pb2.GetModelInfoRequest(), timeout=self._timeout(None))

    def stats(self) -> api_pb2.ClusterStats:
        return self._stub.GetStats(api_pb2.GetStatsRequest(), timeout=self._timeout(None))

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _timeout(self, timeout_s: float | None) -> float | None:
        return self.timeout_s if timeout_s is None else timeout_s


def _stream(call: Any) -> Iterator[api_pb2.GenerateResponse]:
    try:
        yield from call
    finally:
        call.cancel()  # a no-op once the stream has ended


def _set_prompt(
    request: api_pb2.GenerateRequest | api_pb2.TokenizeRequest,
    text: str | None,
    messages: Sequence[ChatMessage] | None,
    token_ids: Sequence[int] | None,
) -> None:
    given = [name for name, v in (("prompt", text), ("messages", messages),
                                  ("token_ids", token_ids)) if v is not None]
    if len(given) != 1:
        raise TypeError(f"give exactly one of prompt, messages, token_ids; got {given or 'none'}")
    if text is not None:
        request.text = text
    elif messages is not None:
        request.chat.messages.extend(
            api_pb2.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
    else:
        request.token_ids.ids.extend(token_ids)
