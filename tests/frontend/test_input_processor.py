"""Prompts (text, token ids, chat) become EngineCoreRequests; BOS exactly once."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from services.common.sampling_params import SamplingParams
from services.common.validation import ValidationError
from services.frontend.input_processor import InputProcessor
from services.frontend.tokenizer import (
    encode_chat,
    encode_prompt,
    load_eos_token_ids,
    tokenizer_adds_bos,
)

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# SmolLM2's chat template (with its default system prompt), tokenized.
QUESTION_IDS = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28,
                7018, 411, 407, 19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282,
                4649, 47, 2, 198, 1, 520, 9531, 198]


def test_smollm2_eos_and_bos(default_model_dir, tokenizer):
    assert load_eos_token_ids(default_model_dir, tokenizer) == [2]
    # SmolLM2's tokenizer adds no BOS to plain text; its chat template writes one.
    assert not tokenizer_adds_bos(tokenizer)
    assert encode_prompt(tokenizer, "Hello world") == [19556, 905]


def test_chat_prompt(input_processor, tokenizer):
    text, ids = input_processor.render_prompt(QUESTION)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert ids == QUESTION_IDS
    request = input_processor.process_inputs("q", QUESTION, SamplingParams(temperature=0))
    assert request.prompt_token_ids == QUESTION_IDS
    _, without_prompt = input_processor.render_prompt(QUESTION, add_generation_prompt=False)
    assert without_prompt == QUESTION_IDS[:-4]  # no "<|im_start|>assistant\n"


def test_token_ids_pass_through_and_request_fields(input_processor):
    params = SamplingParams(max_tokens=7, stop="###")
    request = input_processor.process_inputs(
        "q", (5, 6, 7), params, arrival_time=12.5, priority=3, cache_salt="s", client_index=2)
    assert request.prompt_token_ids == [5, 6, 7]
    assert (request.arrival_time, request.priority, request.cache_salt, request.client_index) == (
        12.5, 3, "s", 2)
    assert request.eos_token_id == 2
    assert request.sampling_params.stop == ["###"]
    assert params.stop == "###"  # the caller's params are never modified
    assert request.sampling_params is not params


def test_vllm_prompt_dicts_and_a_bad_prompt_get_a_clear_error(input_processor, tokenizer):
    assert input_processor.render_prompt({"prompt_token_ids": [5, 6]}) == (None, [5, 6])
    text, ids = input_processor.render_prompt({"prompt": "Hello"})
    assert (text, ids) == ("Hello", input_processor.render_prompt("Hello")[1])
    for bad in ({"prompt": "a", "prompt_token_ids": [1]}, {"text": "a"}, {}):
        with pytest.raises(ValidationError, match="prompt dict must hold exactly one"):
            input_processor.render_prompt(bad)
    with pytest.raises(ValidationError, match="prompt must be a string"):
        input_processor.render_prompt(["a", 1])


def test_extra_eos_ids_become_stop_token_ids(tokenizer):
    processor = InputProcessor(tokenizer, 2048, 49152, eos_token_ids=[2, 0, 5])
    request = processor.process_inputs("q", "Hi", SamplingParams(stop_token_ids=[5, 9]))
    assert request.eos_token_id == 2
    assert request.sampling_params.stop_token_ids == [5, 9, 0]
    ignoring = processor.process_inputs("q", "Hi", SamplingParams(ignore_eos=True))
    assert ignoring.sampling_params.stop_token_ids == []


@pytest.fixture(scope="module")
def bos_tokenizer():
    """A tokenizer that prepends BOS "<s>" to every encoded text."""
    backend = Tokenizer(models.WordLevel({"[UNK]": 0, "hello": 1, "world": 2}, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.add_special_tokens(["<s>"])
    backend.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", 3)])
    return PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>")


@pytest.mark.parametrize(
    "template",
    [
        "{{ bos_token }}{% for m in messages %}{{ m['content'] }} {% endfor %}",
        "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    ],
    ids=["template-writes-bos", "template-without-bos"],
)
def test_chat_gets_exactly_one_bos(bos_tokenizer, template):
    bos_tokenizer.chat_template = template
    assert tokenizer_adds_bos(bos_tokenizer)
    _, ids = encode_chat(bos_tokenizer, [{"role": "user", "content": "hello world"}])
    assert ids == [3, 1, 2]


def test_text_prompt_bos_not_doubled(bos_tokenizer):
    assert encode_prompt(bos_tokenizer, "hello world") == [3, 1, 2]
    assert encode_prompt(bos_tokenizer, "<s> hello") == [3, 1]


def test_internal_ids_are_unique(input_processor):
    ids = {input_processor.process_inputs("same", "Hi", SamplingParams()).request_id
           for _ in range(50)}
    assert len(ids) == 50
