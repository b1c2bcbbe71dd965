"""Frontend fixtures: the real SmolLM2 tokenizer and processors built on it.

Engine outputs in these tests are synthetic EngineCoreOutputs carrying real
token ids from the tokenizer: test data standing in for the engine core.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from services.common.engine import EngineCoreOutput, FinishReason
from services.frontend.input_processor import InputProcessor
from services.frontend.output_processor import OutputProcessor
from services.frontend.outputs import RequestOutput
from services.frontend.tokenizer import load_eos_token_ids, load_tokenizer

MAX_MODEL_LEN = 2048
VOCAB_SIZE = 49152


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="session")
def eos_token_ids(default_model_dir, tokenizer) -> list[int]:
    return load_eos_token_ids(default_model_dir, tokenizer)


@pytest.fixture
def input_processor(tokenizer, eos_token_ids) -> InputProcessor:
    return InputProcessor(tokenizer, MAX_MODEL_LEN, VOCAB_SIZE, eos_token_ids)


@pytest.fixture
def output_processor(tokenizer) -> OutputProcessor:
    return OutputProcessor(tokenizer)


StreamFn = Callable[..., list[RequestOutput]]


@pytest.fixture
def stream() -> StreamFn:
    """Feeds ``token_ids`` to ``processor`` one token per engine step.

    The last step carries ``finish_reason`` / ``stop_reason`` when given.
    Returns every RequestOutput produced, in order; stops early once the
    processor drops the request (a stop string), like the engine after an abort.
    """

    def _stream(
        processor: OutputProcessor,
        request_id: str,
        token_ids: list[int],
        finish_reason: FinishReason | None = None,
        stop_reason: int | str | None = None,
    ) -> list[RequestOutput]:
        results: list[RequestOutput] = []
        for i, token_id in enumerate(token_ids):
            last = i == len(token_ids) - 1
            output = EngineCoreOutput(
                request_id=request_id,
                new_token_ids=[token_id],
                finish_reason=finish_reason if last else None,
                stop_reason=stop_reason if last else None,
            )
            results.extend(processor.process_outputs([output]).request_outputs)
            if request_id not in processor.request_states:
                break
        return results

    return _stream
