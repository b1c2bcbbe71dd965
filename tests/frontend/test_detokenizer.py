"""Incremental detokenization equals decoding the whole sequence at once."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from services.common.engine import EngineCoreRequest
from services.common.sampling_params import SamplingParams
from services.frontend.detokenizer import (
    FastIncrementalDetokenizer,
    IncrementalDetokenizer,
    SlowIncrementalDetokenizer,
)

TEXTS = [
    "Hello 🤗 world 😀👍🏽 ok 🇫🇷",
    "你好,世界!日本語のテキストと한국어",
    "café naïve résumé Ωμέγα Ärger",
    "def f(x):\n    return {'k': x**2}  # ok\n\tprint(f(3))",
]
DETOKENIZERS = [FastIncrementalDetokenizer, SlowIncrementalDetokenizer]


def make_request(prompt_token_ids: list[int], **params) -> EngineCoreRequest:
    return EngineCoreRequest("r-0", prompt_token_ids, SamplingParams(**params))


def stream_pieces(detokenizer: IncrementalDetokenizer, token_ids: list[int]) -> list[str]:
    pieces = []
    for token_id in token_ids:
        detokenizer.update([token_id], stop_terminated=False)
        pieces.append(detokenizer.get_next_output_text(finished=False, delta=True))
    return pieces


@pytest.mark.parametrize("detokenizer_cls", DETOKENIZERS)
@pytest.mark.parametrize("text", TEXTS)
def test_streaming_equals_full_decode(tokenizer, detokenizer_cls, text):
    prompt_ids = tokenizer.encode("Write something:\n", add_special_tokens=False)
    token_ids = tokenizer.encode(text, add_special_tokens=False)
    detokenizer = detokenizer_cls(tokenizer, make_request(prompt_ids))
    pieces = stream_pieces(detokenizer, token_ids)

    assert "".join(pieces) == tokenizer.decode(token_ids) == text
    assert detokenizer.output_text == text
    assert detokenizer.output_token_ids == token_ids
    assert not any("\ufffd" in piece for piece in pieces)


@pytest.mark.parametrize("detokenizer_cls", DETOKENIZERS)
def test_split_character_waits_for_its_last_byte(tokenizer, detokenizer_cls):
    # "🤗" is three byte-level tokens: ' \xf0\x9f', '\xa4', '\x97'.
    token_ids = tokenizer.encode("Hello 🤗", add_special_tokens=False)
    assert token_ids == [19556, 15107, 114, 241]
    detokenizer = detokenizer_cls(tokenizer, make_request([1, 520, 9531, 198]))
    assert stream_pieces(detokenizer, token_ids) == ["Hello", "", "", " 🤗"]


@pytest.mark.parametrize("detokenizer_cls", DETOKENIZERS)
def test_first_token_keeps_its_leading_space(tokenizer, detokenizer_cls):
    prompt_ids = tokenizer.encode("The capital of France is", add_special_tokens=False)
    token_ids = tokenizer.encode(" Paris.", add_special_tokens=False)
    detokenizer = detokenizer_cls(tokenizer, make_request(prompt_ids))
    assert "".join(stream_pieces(detokenizer, token_ids)) == " Paris."


@pytest.mark.parametrize("detokenizer_cls", DETOKENIZERS)
@pytest.mark.parametrize("skip, expected", [(True, "Hi there"), (False, "Hi<|im_end|> there")])
def test_skip_special_tokens(tokenizer, detokenizer_cls, skip, expected):
    token_ids = [*tokenizer.encode("Hi", add_special_tokens=False), 2,
                 *tokenizer.encode(" there", add_special_tokens=False)]
    detokenizer = detokenizer_cls(tokenizer, make_request([1, 9690], skip_special_tokens=skip))
    assert "".join(stream_pieces(detokenizer, token_ids)) == expected


@pytest.fixture(scope="module")
def wordpiece_tokenizer():
    """A tiny tokenizer whose decoder puts spaces between tokens, special ones too."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.decoder = decoders.WordPiece()
    backend.add_special_tokens(["<a>", "<b>"])
    return PreTrainedTokenizerFast(tokenizer_object=backend)


@pytest.mark.parametrize("detokenizer_cls", DETOKENIZERS)
@pytest.mark.parametrize(
    "spaces, expected", [(True, " <a> <b> world"), (False, " <a><b> world")]
)
def test_spaces_between_special_tokens(wordpiece_tokenizer, detokenizer_cls, spaces, expected):
    assert wordpiece_tokenizer.decode([1, 3, 4, 2]) == "hello <a> <b> world"
    request = make_request(
        [1], skip_special_tokens=False, spaces_between_special_tokens=spaces
    )
    detokenizer = detokenizer_cls(wordpiece_tokenizer, request)
    assert "".join(stream_pieces(detokenizer, [3, 4, 2])) == expected


def test_factory_picks_the_implementation(tokenizer):
    assert isinstance(
        IncrementalDetokenizer.from_new_request(tokenizer, make_request([1])),
        FastIncrementalDetokenizer,
    )
    request = make_request([1], detokenize=False)
    ids_only = IncrementalDetokenizer.from_new_request(tokenizer, request)
    assert type(ids_only) is IncrementalDetokenizer
    ids_only.update([19556, 905], stop_terminated=False)
    assert ids_only.output_token_ids == [19556, 905]
    assert ids_only.get_next_output_text(finished=True, delta=False) == ""
