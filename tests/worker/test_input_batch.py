"""InputBatch: row assignment, removal holes, condense moves, resume."""

from __future__ import annotations

import pytest
import torch

from services.common.sampling_params import SamplingParams
from services.worker.input_batch import CachedRequestState, InputBatch

BLOCK_SIZE = 16


def make_batch(max_num_reqs: int = 8) -> InputBatch:
    return InputBatch(
        max_num_reqs=max_num_reqs, max_model_len=64, max_num_batched_tokens=128,
        device=torch.device("cpu"), block_size=BLOCK_SIZE, vocab_size=100,
    )


def make_state(req_id: str, prompt: list[int], block_ids: list[int],
               output: list[int] | None = None, num_computed: int = 0,
               temperature: float = 1.0) -> CachedRequestState:
    return CachedRequestState(
        req_id=req_id, prompt_token_ids=prompt,
        sampling_params=SamplingParams(temperature=temperature),
        block_ids=block_ids, num_computed_tokens=num_computed, output_token_ids=output or [],
    )


def row_tokens(batch: InputBatch, row: int) -> list[int]:
    return batch.token_ids_np[row, : batch.num_tokens[row]].tolist()


def row_blocks(batch: InputBatch, row: int) -> list[int]:
    table = batch.block_table
    return table.block_table_np[row, : table.num_blocks_per_row[row]].tolist()


def end_step(batch: InputBatch):
    """What the runner does after condense: flush the batch's changes into sampling."""
    return batch.sampling_state.make_sampling_metadata(batch.num_reqs)


def fill(batch: InputBatch, n: int) -> list[CachedRequestState]:
    states = [make_state(f"r{i}", [10 * i + 1, 10 * i + 2], [i + 1], temperature=0.1 * i)
              for i in range(n)]
    for i, state in enumerate(states):
        assert batch.add_request(state) == i
    return states


def test_add_request_fills_rows_in_order():
    batch = make_batch()
    batch.add_request(make_state("a", [5, 6, 7], [3, 9], output=[8], num_computed=2))
    batch.add_request(make_state("b", [1], [4]))
    assert batch.req_ids == ["a", "b"]
    assert batch.req_id_to_index == {"a": 0, "b": 1}
    assert row_tokens(batch, 0) == [5, 6, 7, 8]
    assert (batch.num_tokens[0], batch.num_prompt_tokens[0], batch.num_computed_tokens_cpu[0]) == (4, 3, 2)
    assert row_blocks(batch, 0) == [3, 9]
    assert row_blocks(batch, 1) == [4]
    with pytest.raises(ValueError, match="already in the batch"):
        batch.add_request(make_state("a", [1], [1]))


def test_remove_leaves_hole_and_add_takes_lowest():
    batch = make_batch()
    fill(batch, 4)
    assert batch.remove_request("r3") == 3
    assert batch.remove_request("r1") == 1
    assert batch.remove_request("r1") is None
    assert batch.remove_request("unknown") is None
    assert batch.num_reqs == 2
    assert batch.req_ids == ["r0", None, "r2", None]
    assert batch.add_request(make_state("new", [99], [7])) == 1
    # Hole 3 lies past the last request: condense just drops it, no move.
    assert batch.condense() == []
    assert batch.req_ids == ["r0", "new", "r2"]


def test_condense_moves_tail_rows_into_holes():
    batch = make_batch()
    fill(batch, 6)
    for req_id in ("r1", "r2", "r4"):
        batch.remove_request(req_id)
    # Rows: r0 _ _ r3 _ r5 -> r5 fills 1, r3 fills 2.
    assert batch.condense() == [(5, 1), (3, 2)]
    assert batch.req_ids == ["r0", "r5", "r3"]
    assert batch.req_id_to_index == {"r0": 0, "r5": 1, "r3": 2}
    assert [row_tokens(batch, r) for r in range(3)] == [[1, 2], [51, 52], [31, 32]]
    assert [row_blocks(batch, r) for r in range(3)] == [[1], [6], [4]]
    assert batch.block_table.num_blocks_per_row[3:6].tolist() == [0, 0, 0]
    # The sampling state followed the moves: row r has its request's temperature
    # (r0 is greedy, stored as 0).
    metadata = end_step(batch)
    assert metadata.temperature is not None
    assert metadata.temperature.tolist() == pytest.approx([0.0, 0.5, 0.3])
    assert batch.condense() == []
    # The next request goes to the end of the dense rows.
    assert batch.add_request(make_state("x", [1], [2])) == 3


def test_condense_with_every_row_removed():
    batch = make_batch()
    fill(batch, 3)
    for req_id in ("r0", "r1", "r2"):
        batch.remove_request(req_id)
    assert batch.condense() == []
    assert batch.req_ids == [] and batch.num_reqs == 0
    end_step(batch)
    assert batch.add_request(make_state("x", [1], [2])) == 0


def test_append_token_updates_live_output_list():
    batch = make_batch()
    state = make_state("a", [5, 6], [3])
    row = batch.add_request(state)
    batch.append_token(row, 42)
    batch.append_token(row, 43)
    assert state.output_token_ids == [42, 43]
    assert row_tokens(batch, row) == [5, 6, 42, 43]
    assert state.num_tokens == 4


def test_resume_readds_prompt_and_outputs_with_new_blocks():
    batch = make_batch()
    state = make_state("a", [5, 6], [3])
    batch.add_request(state)
    batch.append_token(0, 42)
    batch.remove_request("a")  # preempted: the state lives on outside the batch
    batch.condense()
    end_step(batch)
    state.block_ids = [8]
    state.num_computed_tokens = 0
    assert batch.add_request(state) == 0
    assert row_tokens(batch, 0) == [5, 6, 42]
    assert row_blocks(batch, 0) == [8]
    assert batch.num_computed_tokens_cpu[0] == 0


def test_limits_raise_with_allowed_range():
    batch = make_batch(max_num_reqs=2)
    fill(batch, 2)
    with pytest.raises(ValueError, match=r"allowed range is \[0, 2\]"):
        batch.add_request(make_state("x", [1], [1]))
    with pytest.raises(ValueError, match=r"allowed range is \[1, 64\]"):
        make_batch().add_request(make_state("long", list(range(65)), [1]))
