"""Custom processors: loading by "module:Class" and entry point, and the per-request adapter."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from services.common.convert import sampling_params_from_proto, sampling_params_to_proto
from services.common.sampling_params import SamplingParams
from services.worker.sample import Sampler, SamplingState
from services.worker.sample.logits_processor import LOGITSPROCS_GROUP, load_custom_logitsprocs

CPU = torch.device("cpu")
HERE = Path(__file__).parent
MODULE = "kvmesh_test_logitsprocs"


@pytest.fixture(autouse=True)
def _test_module_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(HERE))


def greedy(state: SamplingState, logits: torch.Tensor) -> list[int]:
    md = state.make_sampling_metadata(state.num_reqs)
    return Sampler()(logits.clone(), md).sampled_token_ids.tolist()


def test_load_by_qualname_and_apply() -> None:
    state = SamplingState(2, 4, CPU, logitsprocs=[f"{MODULE}:BanFirstTokenProcessor"])
    names = [type(p).__name__ for p in state.logitsprocs.non_argmax_invariant]
    assert names[-1] == "BanFirstTokenProcessor"
    state.add_request(0, SamplingParams(temperature=0.0), [1], [])
    state.add_request(1, SamplingParams(temperature=0.0), [1], [])
    assert greedy(state, torch.tensor([[5.0, 1.0, 2.0, 0.0]] * 2)) == [2, 2]


@pytest.mark.parametrize(
    ("spec", "error", "match"),
    [
        (f"{MODULE}.BanFirstTokenProcessor", ValueError, "must be written 'module.path:ClassName'"),
        (f"{MODULE}:Missing", ValueError, "'Missing' not found"),
        (f"{MODULE}:_BanPrompt", ValueError, "not a LogitsProcessor subclass"),
        ("kvmesh_no_such_module:Proc", RuntimeError, "failed to import module 'kvmesh_no_such"),
    ],
)
def test_bad_qualnames(spec: str, error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        load_custom_logitsprocs([spec])


def test_class_objects_are_accepted_and_duplicates_dropped() -> None:
    from kvmesh_test_logitsprocs import BanFirstTokenProcessor

    classes = load_custom_logitsprocs(
        [BanFirstTokenProcessor, f"{MODULE}:BanFirstTokenProcessor"]
    )
    assert classes == [BanFirstTokenProcessor]
    with pytest.raises(ValueError, match="not a LogitsProcessor subclass"):
        load_custom_logitsprocs([int])  # type: ignore[list-item]


def _install_plugin(root: Path, target: str) -> None:
    dist_info = root / "kvmesh_test_plugin-1.0.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: kvmesh-test-plugin\nVersion: 1.0\n"
    )
    (dist_info / "entry_points.txt").write_text(f"[{LOGITSPROCS_GROUP}]\nban_first = {target}\n")


def test_entry_point_plugin_is_loaded(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_custom_logitsprocs() == []
    _install_plugin(tmp_path, f"{MODULE}:BanFirstTokenProcessor")
    monkeypatch.syspath_prepend(str(tmp_path))
    classes = load_custom_logitsprocs()
    assert [c.__name__ for c in classes] == ["BanFirstTokenProcessor"]
    state = SamplingState(1, 3, CPU)
    state.add_request(0, SamplingParams(temperature=0.0), [1], [])
    assert greedy(state, torch.tensor([[3.0, 2.0, 1.0]])) == [1]


def test_broken_entry_point_names_the_plugin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _install_plugin(tmp_path, "kvmesh_no_such_module:Proc")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(RuntimeError, match="plugin 'ban_first'"):
        load_custom_logitsprocs()


def test_adapter_two_argument_callable_sees_live_outputs() -> None:
    state = SamplingState(2, 4, CPU, logitsprocs=[f"{MODULE}:NoRepeatAdapter"])
    outputs: list[list[int]] = [[], []]
    state.add_request(0, SamplingParams(temperature=0.0, seed=1), [3], outputs[0])
    state.add_request(1, SamplingParams(temperature=0.0), [3], outputs[1])
    logits = torch.tensor([[4.0, 3.0, 2.0, 1.0]] * 2)
    tokens: list[list[int]] = []
    for _ in range(4):
        step = greedy(state, logits)
        for out, token in zip(outputs, step):
            out.append(token)
        tokens.append(step)
    # Row 0 may not repeat its previous token; row 1 has no callable.
    assert [t[0] for t in tokens] == [0, 1, 0, 1]
    assert [t[1] for t in tokens] == [0, 0, 0, 0]


def test_adapter_three_argument_callable_gets_the_prompt_and_follows_moves() -> None:
    state = SamplingState(3, 5, CPU, logitsprocs=[f"{MODULE}:BanPromptTokensAdapter"])
    state.add_request(0, SamplingParams(temperature=0.0), [0], [])
    state.add_request(1, SamplingParams(temperature=0.0), [0], [])
    state.add_request(2, SamplingParams(temperature=0.0, seed=4), [0, 1], [])
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    assert greedy(state, logits.expand(3, -1)) == [0, 0, 2]
    state.remove_request(0)
    state.move_request(2, 0)
    assert greedy(state, logits.expand(2, -1)) == [2, 0]


def test_adapter_fails_the_request_of_a_callable_of_the_wrong_arity() -> None:
    state = SamplingState(2, 5, CPU, logitsprocs=[f"{MODULE}:FourArgAdapter"])
    state.add_request(0, SamplingParams(temperature=0.0), [0], [])
    state.add_request(1, SamplingParams(temperature=0.0, seed=4), [0], [])
    output = Sampler()(torch.tensor([[5.0, 1.0, 2.0, 0.0, 0.0]] * 2),
                       state.make_sampling_metadata(2))
    assert output.sampled_token_ids.tolist()[0] == 0
    assert list(output.row_failures) == [1]
    assert output.row_failures[1].status_code == grpc.StatusCode.INTERNAL.value[0]
    assert "FourArgAdapter" in output.row_failures[1].message
    assert "got 4" in output.row_failures[1].message


@pytest.mark.parametrize(("poison", "code", "message"), [
    ("refuse", grpc.StatusCode.INVALID_ARGUMENT,
     "logits processor PoisonAdapter refused the request: extra_args['poison'] is 'refuse'"),
    ("raise", grpc.StatusCode.INTERNAL,
     "logits processor PoisonAdapter failed: RuntimeError('poisoned callable')"),
])
def test_a_poisoned_row_fails_alone_and_its_neighbours_sample(poison, code, message) -> None:
    state = SamplingState(3, 5, CPU, logitsprocs=[f"{MODULE}:PoisonAdapter"])
    for row in range(3):
        extra_args = {"poison": poison} if row == 1 else None
        state.add_request(row, SamplingParams(temperature=0.0, extra_args=extra_args), [0], [])
    logits = torch.tensor([[0.0, 1.0, 5.0, 2.0, 0.0]] * 3)
    output = Sampler()(logits, state.make_sampling_metadata(3))
    assert {row: (f.status_code, f.message) for row, f in output.row_failures.items()} == \
        {1: (code.value[0], message)}
    assert output.sampled_token_ids.tolist()[0::2] == [2, 2]
    assert not output.nonfinite_rows.any()


def test_plugin_sees_extra_args_as_the_worker_receives_them() -> None:
    def over_the_wire(params: SamplingParams) -> SamplingParams:
        return sampling_params_from_proto(sampling_params_to_proto(params))

    banning = over_the_wire(SamplingParams(temperature=0.0, extra_args={"ban_token_ids": [0, 1]}))
    # Struct numbers are doubles: the plugin gets floats.
    assert [(t, type(t)) for t in banning.extra_args["ban_token_ids"]] == [(0.0, float),
                                                                           (1.0, float)]
    state = SamplingState(4, 5, CPU, logitsprocs=[f"{MODULE}:BanExtraArgsTokensAdapter"])
    state.add_request(0, banning, [3], [])
    state.add_request(1, over_the_wire(SamplingParams(temperature=0.0)), [3], [])
    state.add_request(2, over_the_wire(SamplingParams(temperature=0.0, extra_args={})), [3], [])
    logits = torch.tensor([[5.0, 4.0, 3.0, 2.0, 1.0]])
    assert greedy(state, logits.expand(3, -1)) == [2, 0, 0]
    with pytest.raises(ValueError, match=r"extra_args\['ban_token_ids'\] must be a list, got 7"):
        state.add_request(3, SamplingParams(extra_args={"ban_token_ids": 7}), [3], [])
