"""The cost of structured outputs on the CPU worker (issue 25), in one run.

Tables, constrained and unconstrained measured in the same process and run:
  * decode tok/s at 1 and 64 requests, every request JSON-schema constrained
    (an array of 200 integers, so the grammar never ends first) against the
    same requests unconstrained; 128 output tokens each, greedy;
  * time to first token of one short request: unconstrained, with a grammar
    already compiled (cached), and with a schema never seen (cold);
  * the per-step mask fill (the grammar processor's update_state: accept the
    new token, fill each row's bitmask) and apply (mask the logits), per batch size.

    .venv/bin/python -m benchmarks.structured_output --repeats 3

Medians over the repeats; constrained and unconstrained alternate within each,
the one that goes first alternating too.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import uuid

import torch

from kvmesh.offline import LLM, SamplingParams
from services.common.model_files import resolve_model_dir
from services.common.sampling_params import StructuredOutputsParams
from services.worker.grammar import GrammarBackend
from services.worker.sample import SamplingState

OUTPUT_TOKENS = 128
VOCAB = 49152
LONG_ARRAY = {"type": "object", "required": ["values"], "properties": {"values": {
    "type": "array", "minItems": 200, "maxItems": 200,
    "items": {"type": "integer", "minimum": 0, "maximum": 999}}}}
PROMPT = "List numbers as JSON: "


def decode_tok_s(llm: LLM, num_requests: int, constrained: bool) -> float:
    so = StructuredOutputsParams(json=LONG_ARRAY) if constrained else None
    # EOS ignored by both: the same stop checks; the grammar never ends first anyway.
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_TOKENS, ignore_eos=True,
                            structured_outputs=so)
    prompts = [f"{PROMPT}{i}" for i in range(num_requests)]
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    assert tokens == num_requests * OUTPUT_TOKENS, tokens
    return tokens / elapsed


def ttft_ms(llm: LLM, so: StructuredOutputsParams | None) -> float:
    params = SamplingParams(temperature=0.0, max_tokens=1, structured_outputs=so)
    (output,) = llm.generate([PROMPT + uuid.uuid4().hex[:4]], params, use_tqdm=False)
    return (output.metrics.first_token_time - output.metrics.arrival_time) * 1e3


def fresh_schema() -> StructuredOutputsParams:
    """A schema of the random-schema tests' size no cache has seen."""
    name = "f" + uuid.uuid4().hex[:8]
    return StructuredOutputsParams(json={"type": "object", "required": [name, "tags"],
                                         "properties": {
        name: {"type": "string", "maxLength": 12},
        "score": {"type": "number", "minimum": 0, "maximum": 10},
        "tags": {"type": "array", "maxItems": 3, "items": {"enum": ["a", "b", "c"]}},
        "meta": {"type": "object", "properties": {"id": {"type": "integer"},
                                                  "kind": {"pattern": "^[A-Z]{2}$"}}}}})


def mask_step_us(grammar: GrammarBackend, batch: int, repeats: int = 50) -> tuple[float, float]:
    """(fill, apply) microseconds per step for ``batch`` constrained rows."""
    state = SamplingState(batch, VOCAB, torch.device("cpu"), grammar=grammar)
    for row in range(batch):
        state.add_request(row, SamplingParams(temperature=0.0, structured_outputs=(
            StructuredOutputsParams(json=LONG_ARRAY))), [1], [])
    state.make_sampling_metadata(batch)
    (proc,) = [p for p in state.logitsprocs.non_argmax_invariant
               if type(p).__name__ == "StructuredOutputLogitsProcessor"]
    logits = torch.randn(batch, VOCAB)
    fills, applies = [], []
    for _ in range(repeats):
        start = time.perf_counter()
        proc.update_state(None)
        fills.append(time.perf_counter() - start)
        start = time.perf_counter()
        proc.apply(logits)
        applies.append(time.perf_counter() - start)
    return statistics.median(fills) * 1e6, statistics.median(applies) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    llm = LLM(max_num_seqs=64, num_kv_blocks=2048, device="cpu")
    decode: dict[tuple[int, bool], list[float]] = {}
    ttft: dict[str, list[float]] = {"unconstrained": [], "cached grammar": [],
                                    "cold grammar": []}
    cached = fresh_schema()
    ttft_ms(llm, cached)  # compiles it once
    for repeat in range(args.repeats):
        for num_requests in (1, 64):
            # Alternating which goes first, so a drift of the machine favours neither.
            for constrained in ((False, True) if repeat % 2 == 0 else (True, False)):
                decode.setdefault((num_requests, constrained), []).append(
                    decode_tok_s(llm, num_requests, constrained))
        ttft["unconstrained"].append(ttft_ms(llm, None))
        ttft["cached grammar"].append(ttft_ms(llm, cached))
        ttft["cold grammar"].append(ttft_ms(llm, fresh_schema()))

    print("| requests | unconstrained tok/s | JSON-schema constrained tok/s | ratio |")
    print("| --- | --- | --- | --- |")
    for num_requests in (1, 64):
        free = statistics.median(decode[(num_requests, False)])
        bound = statistics.median(decode[(num_requests, True)])
        print(f"| {num_requests} | {free:.1f} | {bound:.1f} | {bound / free:.3f} |")
    print()
    print("| time to first token (1 request, short prompt) | median ms |")
    print("| --- | --- |")
    for name, values in ttft.items():
        print(f"| {name} | {statistics.median(values):.1f} |")
    print()
    grammar = GrammarBackend(resolve_model_dir(), VOCAB, [2])
    print("| constrained rows | mask fill µs/step | mask apply µs/step |")
    print("| --- | --- | --- |")
    for batch in (1, 8, 64):
        fill, apply = mask_step_us(grammar, batch)
        print(f"| {batch} | {fill:.0f} | {apply:.0f} |")
    grammar.close()
    print(json.dumps({"repeats": args.repeats}))


if __name__ == "__main__":
    main()
