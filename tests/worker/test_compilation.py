"""The CPU worker's compiled pieces and decode step: same results as eager, warm-up
before serving, the on-disk cache, and the switches that turn compilation off."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest
import torch
import transformers

from services.worker import compilation
from services.worker.compilation import compile_piece, use_compile_cache
from services.worker.config import WorkerConfig
from services.worker.layers import quantized_choice
from services.worker.layers.quantized_choice import wide_rows
from services.worker.model_loader import load_model
from tests.worker.helpers import greedy_request, make_scheduler, make_worker, random_prompts, run_engine
from tests.worker.test_models import (
    BLOCK_SIZE,
    NUM_BLOCKS,
    final_token_ids,
    make_kv_caches,
    run_paged_schedule,
    save_tiny_hf_model,
)

T = TypeVar("T")


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_hf_model(path, transformers.LlamaConfig, tie_word_embeddings=True)
    return path


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_compiled_pieces_match_eager(tiny_llama: Path, dtype: str) -> None:
    """A ragged schedule (mixed prefill/decode, padding rows) through both forms."""
    eager, config = load_model(tiny_llama, dtype, "cpu")
    compiled, _ = load_model(tiny_llama, dtype, "cpu")
    compiled.compile_pieces(compile_piece)
    assert len({piece.func for piece in compiled.model.pieces}) == 3  # one graph per kind
    token_ids = final_token_ids(config.vocab_size)
    expected = run_paged_schedule(eager, config, token_ids)
    actual = run_paged_schedule(compiled, config, token_ids)
    atol = 1e-4 if dtype == "float32" else 0.05  # inductor fuses, so bfloat16 rounds elsewhere
    for ours, theirs in zip(actual, expected):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


def on_new_thread(fn: Callable[[], T]) -> T:
    """``fn()`` run on a thread of its own, as the worker's step pipeline runs steps."""
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as pool:
        return pool.submit(fn).result()


@pytest.mark.parametrize(("dtype", "thread"), [("float32", False), ("bfloat16", False),
                                               ("float32", True)])
def test_compiled_decode_step_matches_eager(tiny_llama: Path, dtype: str, thread: bool) -> None:
    """Decode-only steps run as one compiled graph (attention and KV write inside);
    mixed steps still take the pieces. Logits agree with eager, the last step's through
    the K/V that the step before wrote inside the graph. ``thread``: compiled on
    another thread than the one that built the model (torch's compiler settings
    are per thread)."""
    eager, config = load_model(tiny_llama, dtype, "cpu")
    compiled, _ = load_model(tiny_llama, dtype, "cpu")
    compiled.compile_pieces(compile_piece)
    decode_steps = []

    def counted(fn):
        graph = compile_piece(fn)

        def run(*args):
            decode_steps.append(args[2].shape[0])  # (model, decode_layer, input_ids, ...)
            return graph(*args)
        return run

    kv_caches = make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE)
    compiled.compile_decode_step(counted, kv_caches)
    token_ids = final_token_ids(config.vocab_size)
    expected = run_paged_schedule(eager, config, token_ids)
    def run_compiled() -> list[torch.Tensor]:
        return run_paged_schedule(compiled, config, token_ids, kv_caches=kv_caches)
    actual = on_new_thread(run_compiled) if thread else run_compiled()
    assert decode_steps == [3, 3]  # SCHEDULE's two decode-only steps, three requests each
    atol = 1e-4 if dtype == "float32" else 0.05
    for ours, theirs in zip(actual, expected):
        torch.testing.assert_close(ours, theirs, atol=atol, rtol=0)


def test_compiled_worker_warms_up_then_matches_eager(tiny_llama: Path) -> None:
    compiled = make_worker(tiny_llama, compile_pieces=True, max_model_len=128)
    eager = make_worker(tiny_llama, max_model_len=128)
    assert compiled.model_runner.compiled_pieces and not eager.model_runner.compiled_pieces
    runner = compiled.model_runner
    # Warm-up left nothing behind, and never wrote the null block.
    assert not runner.requests and runner.input_batch.num_reqs == 0
    assert all(torch.count_nonzero(kv[:, 0]) == 0 for kv in runner.kv_caches)
    prompts = random_prompts([9, 17, 4], seed=3)
    arrivals = [(i, greedy_request(f"r{i}", p, 6)) for i, p in enumerate(prompts)]
    results = [run_engine(make_scheduler(w), w, arrivals).token_ids for w in (compiled, eager)]
    assert results[0] == results[1]


def test_warm_up_builds_every_variant_serving_needs(tiny_llama: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """After warm-up, nothing compiles again: int8 (whose layers switch from their
    kernel to dequantize-then-GEMM above the measured row count, pinned here to a
    width other than the default) through wide and narrow prefills, mixed steps with
    one and several decodes, and decode-only steps of one, several and 40 requests."""
    kernel_max_rows = 8
    monkeypatch.setattr(quantized_choice, "load_max_rows", lambda path: kernel_max_rows)
    # A graph cached on disk by a worker with another width brings that width's
    # shape guards with it (one more compile, at serving time): compile afresh.
    with (torch._inductor.config.patch(fx_graph_cache=False),
          torch._functorch.config.patch(enable_autograd_cache=False)):
        worker = make_worker(tiny_llama, compile_pieces=True, dtype="bfloat16",
                             quantization="int8", max_model_len=128)
        assert wide_rows(worker.model_runner.model) == kernel_max_rows + 1
        wide = [(0, greedy_request(f"w{i}", p, 4 + i % 5))
                for i, p in enumerate(random_prompts([3] * 40, seed=5))]
        late = [(9 + i, greedy_request(f"l{i}", p, 6))
                for i, p in enumerate(random_prompts([40, 5, 7], seed=6))]
        graphs_built = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        result = run_engine(make_scheduler(worker), worker, wide + late)
    assert len(result.token_ids) == 43
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs_built


def test_compile_switch_defaults_by_device() -> None:
    assert WorkerConfig().resolved_compile_pieces() is True
    assert WorkerConfig(device="cuda").resolved_compile_pieces() is False
    assert WorkerConfig(compile_pieces=False).resolved_compile_pieces() is False


def test_without_a_cpp_compiler_the_worker_runs_eagerly(tiny_llama: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("services.worker.model_runner.cpp_compiler_available", lambda: False)
    worker = make_worker(tiny_llama, compile_pieces=True, max_model_len=128)
    assert not worker.model_runner.compiled_pieces


def test_compile_cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVMESH_CACHE_DIR", str(tmp_path / "kvmesh"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    assert use_compile_cache(None) == tmp_path / "kvmesh" / "inductor"
    assert compilation.os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "kvmesh" / "inductor")
    # A directory the user chose for inductor is kept, unless the config names one.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert use_compile_cache(None) == tmp_path / "mine"
    assert use_compile_cache(tmp_path / "cfg") == tmp_path / "cfg"
    assert (tmp_path / "cfg").is_dir()
