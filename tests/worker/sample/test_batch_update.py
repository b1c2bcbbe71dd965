"""BatchUpdateBuilder, process_dict_updates and LogitsProcessors semantics."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.sample.logits_processor import (
    BatchUpdate,
    BatchUpdateBuilder,
    LogitBiasLogitsProcessor,
    LogitsProcessorConfig,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
    MoveDirectionality,
    ThinkingBudgetLogitsProcessor,
    ThinkingConfig,
    build_logitsprocs,
    process_dict_updates,
)

UNI = MoveDirectionality.UNIDIRECTIONAL


def test_discard_removed() -> None:
    builder = BatchUpdateBuilder()
    builder.removed_append(1)
    builder.removed_append(6)
    assert builder.discard_removed(6) is True
    assert builder.discard_removed(6) is False
    assert builder.removed == [1]


def test_get_and_reset_freezes_and_starts_afresh() -> None:
    builder = BatchUpdateBuilder()
    assert builder.get_and_reset(batch_size=0) is None
    params = SamplingParams()
    builder.removed_append(0)
    builder.added.append((1, params, [1], []))
    builder.moved.append((3, 0, UNI))
    update = builder.get_and_reset(batch_size=3)
    assert update == BatchUpdate(
        batch_size=3, removed=[0], added=[(1, params, [1], [])], moved=[(3, 0, UNI)]
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        update.batch_size = 4  # type: ignore[misc]
    # The builder's new lists do not alias the frozen update's.
    builder.added.append((2, params, [2], []))
    assert len(update.added) == 1
    assert builder.get_and_reset(batch_size=3) is not None
    assert builder.get_and_reset(batch_size=3) is None


def _bias(params: SamplingParams, _prompt: object, _output: object) -> dict[int, float] | None:
    return params.logit_bias or None


def test_process_dict_updates_add_remove_move() -> None:
    entries: dict[int, dict[int, float]] = {}
    p_a = SamplingParams(logit_bias={100: 0.5})
    p_b = SamplingParams(logit_bias={200: -0.3})
    p_none = SamplingParams()

    added = BatchUpdate(2, removed=[], added=[(0, p_a, [], []), (1, p_b, [], [])], moved=[])
    assert process_dict_updates(entries, added, _bias) is True
    assert entries == {0: {100: 0.5}, 1: {200: -0.3}}

    moved = BatchUpdate(3, removed=[], added=[], moved=[(1, 2, UNI)])
    assert process_dict_updates(entries, moved, _bias) is True
    assert entries == {0: {100: 0.5}, 2: {200: -0.3}}

    # A request without a bias added at an occupied row drops the stale state.
    replaced = BatchUpdate(3, removed=[], added=[(0, p_none, [], [])], moved=[])
    assert process_dict_updates(entries, replaced, _bias) is True
    assert entries == {2: {200: -0.3}}

    assert process_dict_updates(entries, None, _bias) is False
    untouched = BatchUpdate(3, removed=[1], added=[(1, p_none, [], [])], moved=[])
    assert process_dict_updates(entries, untouched, _bias) is False


def test_process_dict_updates_applies_removed_before_added() -> None:
    entries = {1: {5: 1.0}}
    update = BatchUpdate(
        2, removed=[1], added=[(1, SamplingParams(logit_bias={9: 2.0}), [], [])], moved=[]
    )
    process_dict_updates(entries, update, _bias)
    assert entries == {1: {9: 2.0}}


def test_logitsprocs_split_by_argmax_invariance() -> None:
    config = LogitsProcessorConfig(max_num_reqs=4, vocab_size=16)
    procs = build_logitsprocs(config, torch.device("cpu"), False)
    assert [type(p) for p in procs.argmax_invariant] == [MinPLogitsProcessor]
    assert [type(p) for p in procs.non_argmax_invariant] == [
        MinTokensLogitsProcessor,
        LogitBiasLogitsProcessor,
    ]
    assert [type(p) for p in procs.all] == [
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
        LogitBiasLogitsProcessor,
    ]

    thinking = ThinkingConfig(think_start_token_ids=(3,), think_end_token_ids=(4,))
    config = LogitsProcessorConfig(max_num_reqs=4, vocab_size=16, thinking=thinking)
    procs = build_logitsprocs(config, torch.device("cpu"), False)
    assert [type(p) for p in procs.non_argmax_invariant] == [
        MinTokensLogitsProcessor,
        LogitBiasLogitsProcessor,
        ThinkingBudgetLogitsProcessor,
    ]
    assert len(procs) == 4


def test_thinking_config_rejects_empty_sequences() -> None:
    with pytest.raises(ValueError, match="think_end_token_ids"):
        ThinkingConfig(think_start_token_ids=[1], think_end_token_ids=[])
    config = ThinkingConfig(think_start_token_ids=[1, 2], think_end_token_ids=[3])
    assert config.think_start_token_ids == (1, 2)
