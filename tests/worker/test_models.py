"""Llama-family models against transformers (the oracle) on the same weights.

Each tiny model runs a ragged multi-request batch the way the runner drives it:
a mixed first step (two whole prompts and the first chunk of a third), then
steps mixing the rest of that prompt with decodes, with blocks handed out of
order and rows reordered between steps. Every scheduled token's logits must
equal transformers' logits at that position of the full sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
import transformers

from services.worker.attention import AttentionMetadata
from services.worker.config import ModelConfig
from services.worker.model_loader import load_model
from tests.cuda import needs_cuda

BLOCK_SIZE = 4
NUM_BLOCKS = 16
TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            rms_norm_eps=1e-5)
LLAMA3_ROPE = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64}
# (request, tokens) per step; row order changes between steps like a condensed batch.
PROMPT_LENS = (13, 5, 21)
SCHEDULE = (
    ((0, 13), (1, 5), (2, 16)),   # two prefills and the first chunk of the third
    ((2, 5), (0, 1), (1, 1)),     # rest of the chunked prefill next to decodes
    ((1, 1), (0, 1), (2, 1)),
    ((0, 1), (1, 1), (2, 1)),
)
PADDED_STEP, NUM_PADDING = 1, 3  # step 1 also carries padding rows (slot -1)


@dataclass
class PagedRequests:
    """Hand-made block tables for a few requests, blocks taken from a shuffled pool."""

    token_ids: list[list[int]]
    block_size: int
    num_computed: list[int] = field(init=False)
    block_ids: list[list[int]] = field(init=False)

    def __post_init__(self) -> None:
        self.num_computed = [0] * len(self.token_ids)
        pool = (torch.randperm(NUM_BLOCKS - 1, generator=torch.Generator().manual_seed(7)) + 1)
        pool_ids = pool.tolist()  # block 0 is the null block
        self.block_ids = []
        for tokens in self.token_ids:
            num_blocks = -(-len(tokens) // self.block_size)
            self.block_ids.append(pool_ids[:num_blocks])
            pool_ids = pool_ids[num_blocks:]

    def step(self, scheduled: tuple[tuple[int, int], ...], num_padding: int = 0,
             device: torch.device | str = "cpu"
             ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """input_ids, positions and metadata for one step; advances num_computed."""
        input_ids, positions, slots, query_start_loc, seq_lens, rows = [], [], [], [0], [], []
        for req, num_tokens in scheduled:
            start = self.num_computed[req]
            for pos in range(start, start + num_tokens):
                input_ids.append(self.token_ids[req][pos])
                positions.append(pos)
                block = self.block_ids[req][pos // self.block_size]
                slots.append(block * self.block_size + pos % self.block_size)
            query_start_loc.append(query_start_loc[-1] + num_tokens)
            seq_lens.append(start + num_tokens)
            rows.append(self.block_ids[req])
            self.num_computed[req] += num_tokens
        num_actual = len(input_ids)
        input_ids += [0] * num_padding
        positions += [0] * num_padding
        slots += [-1] * num_padding
        width = max(len(r) for r in rows)
        block_table = [r + [0] * (width - len(r)) for r in rows]
        metadata = AttentionMetadata(
            num_reqs=len(scheduled), num_actual_tokens=num_actual,
            max_query_len=max(n for _, n in scheduled), max_seq_len=max(seq_lens),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_table=torch.tensor(block_table, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        )
        return (torch.tensor(input_ids, device=device), torch.tensor(positions, device=device),
                metadata)


def make_kv_caches(config: ModelConfig, num_blocks: int, block_size: int,
                   device: torch.device | str = "cpu") -> list[torch.Tensor]:
    shape = (2, num_blocks, block_size, config.num_kv_heads, config.head_size)
    return [torch.zeros(shape, dtype=config.dtype, device=device) for _ in range(config.num_layers)]


def save_tiny_hf_model(path: Path, config_cls: type, max_shard_size: str | None = None,
                       **overrides) -> transformers.PreTrainedModel:
    """A random tiny model (fixed seed, weights spread wider than the default init)
    saved as safetensors; returned in float32 eval mode."""
    torch.manual_seed(0)
    config = config_cls(**{**TINY, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.uniform_(0.5, 1.5)
            else:
                param.normal_(0.0, 0.08)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kwargs)
    return model.eval()


def run_paged_schedule(model: torch.nn.Module, config: ModelConfig, token_ids: list[list[int]],
                       device: torch.device | str = "cpu",
                       kv_caches: list[torch.Tensor] | None = None) -> list[torch.Tensor]:
    """Drives SCHEDULE (on ``kv_caches`` when given, zero-filled); returns each request's
    logits (on the CPU) for all its positions."""
    requests = PagedRequests(token_ids, BLOCK_SIZE)
    kv_caches = kv_caches or make_kv_caches(config, NUM_BLOCKS, BLOCK_SIZE, device)
    logits: list[list[torch.Tensor]] = [[] for _ in token_ids]
    for step_idx, scheduled in enumerate(SCHEDULE):
        num_padding = NUM_PADDING if step_idx == PADDED_STEP else 0
        input_ids, positions, metadata = requests.step(scheduled, num_padding, device)
        with torch.inference_mode():
            hidden = model(input_ids, positions, kv_caches, metadata)
            step_logits = model.compute_logits(hidden[: metadata.num_actual_tokens]).cpu()
        assert hidden.shape == (input_ids.shape[0], config.hidden_size)
        start = 0
        for req, num_tokens in scheduled:
            logits[req].append(step_logits[start : start + num_tokens])
            start += num_tokens
    # Block 0 is the null block: nothing may ever be written to it.
    assert all(torch.count_nonzero(kv[:, 0]) == 0 for kv in kv_caches)
    return [torch.cat(chunks) for chunks in logits]


def final_token_ids(vocab_size: int) -> list[list[int]]:
    total = {req: 0 for req in range(len(PROMPT_LENS))}
    for scheduled in SCHEDULE:
        for req, num_tokens in scheduled:
            total[req] += num_tokens
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab_size, (total[r],), generator=generator).tolist()
            for r in range(len(PROMPT_LENS))]


def assert_matches_hf(hf_model: transformers.PreTrainedModel, logits: list[torch.Tensor],
                      token_ids: list[list[int]], atol: float) -> None:
    for req, tokens in enumerate(token_ids):
        with torch.inference_mode():
            expected = hf_model(torch.tensor([tokens])).logits[0].float()
        assert logits[req].shape == expected.shape
        torch.testing.assert_close(logits[req], expected, atol=atol, rtol=0)
        assert torch.equal(logits[req].argmax(-1), expected.argmax(-1))


CASES = {
    "llama-tied": (transformers.LlamaConfig, None, dict(tie_word_embeddings=True)),
    "llama-llama3rope-untied-bias-sharded": (
        transformers.LlamaConfig, "100KB",
        dict(tie_word_embeddings=False, rope_parameters=LLAMA3_ROPE, attention_bias=True,
             mlp_bias=True)),
    "mistral": (transformers.MistralConfig, None,
                dict(tie_word_embeddings=False, sliding_window=None,
                     rope_parameters={"rope_type": "default", "rope_theta": 100000.0})),
    "qwen2": (transformers.Qwen2Config, None,
              dict(tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})),
}


@pytest.mark.parametrize("case", list(CASES))
def test_paged_batch_matches_transformers(case: str, tmp_path: Path) -> None:
    config_cls, max_shard_size, overrides = CASES[case]
    hf_model = save_tiny_hf_model(tmp_path, config_cls, max_shard_size, **overrides)
    assert (tmp_path / "model.safetensors.index.json").exists() == (max_shard_size is not None)
    model, config = load_model(tmp_path, "float32", "cpu")
    assert config.architecture == type(hf_model).__name__
    token_ids = final_token_ids(config.vocab_size)
    logits = run_paged_schedule(model, config, token_ids)
    assert all(t.dtype == torch.float32 for t in logits)
    assert_matches_hf(hf_model, logits, token_ids, atol=1e-4)


@pytest.mark.triton_cpu
def test_triton_kernels_in_the_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Same batch with the Triton kernels (TRITON_INTERPRET=1 on the CPU): they get the
    strided value view straight out of the fused qkv projection."""
    monkeypatch.setenv("KVMESH_FORCE_TRITON", "1")
    config_cls, max_shard_size, overrides = CASES["qwen2"]
    hf_model = save_tiny_hf_model(tmp_path, config_cls, max_shard_size, **overrides)
    model, config = load_model(tmp_path, "float32", "cpu")
    token_ids = final_token_ids(config.vocab_size)
    assert_matches_hf(hf_model, run_paged_schedule(model, config, token_ids), token_ids, atol=1e-4)


@needs_cuda
@pytest.mark.parametrize("case", list(CASES))
def test_paged_batch_on_cuda_matches_transformers(case: str, tmp_path: Path) -> None:
    config_cls, max_shard_size, overrides = CASES[case]
    hf_model = save_tiny_hf_model(tmp_path, config_cls, max_shard_size, **overrides)
    model, config = load_model(tmp_path, "float32", "cuda")
    token_ids = final_token_ids(config.vocab_size)
    logits = run_paged_schedule(model, config, token_ids, "cuda")
    assert_matches_hf(hf_model, logits, token_ids, atol=1e-3)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_transformers(dtype: torch.dtype, tmp_path: Path) -> None:
    hf_model = save_tiny_hf_model(tmp_path, transformers.LlamaConfig, tie_word_embeddings=True)
    model, config = load_model(tmp_path, str(dtype).removeprefix("torch."), "cpu")
    assert config.dtype == dtype
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.model.rotary_emb.cos_sin_cache.dtype == dtype
    token_ids = final_token_ids(config.vocab_size)
    logits = run_paged_schedule(model, config, token_ids)
    assert all(t.dtype == torch.float32 for t in logits)
    for req, tokens in enumerate(token_ids):
        with torch.inference_mode():
            expected = hf_model.to(dtype)(torch.tensor([tokens])).logits[0].float()
        # Both sides round to 8 (bf16) or 11 (fp16) mantissa bits along different paths.
        torch.testing.assert_close(logits[req], expected, atol=0.05, rtol=0)


# SmolLM2 chat prompt (real model); the oracle is transformers on the same files.
CHAT = [{"role": "user", "content": "Write a short poem about the sea."}]
NUM_GREEDY_TOKENS = 10


@pytest.fixture(scope="module")
def smollm2(default_model_dir: Path):
    model, config = load_model(default_model_dir, "float32", "cpu")
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        default_model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(default_model_dir)
    prompt_ids = tokenizer.apply_chat_template(CHAT, add_generation_prompt=True, tokenize=True,
                                               return_dict=False)
    return model, config, hf_model, list(prompt_ids)


@pytest.mark.slow
def test_smollm2_prefill_and_greedy_decode_match_transformers(smollm2) -> None:
    model, config, hf_model, prompt_ids = smollm2
    assert (config.num_layers, config.num_heads, config.num_kv_heads, config.head_size) == (30, 9, 3, 64)
    block_size = 16
    max_len = len(prompt_ids) + NUM_GREEDY_TOKENS
    # Reversed block ids: the sequence is scattered backwards through the cache.
    num_blocks = -(-max_len // block_size) + 1
    block_row = list(range(num_blocks - 1, 0, -1))
    kv_caches = make_kv_caches(config, num_blocks, block_size)
    tokens = list(prompt_ids)
    generated: list[int] = []
    prefill_logits = None
    num_computed = 0
    while len(generated) < NUM_GREEDY_TOKENS:
        new_tokens = tokens[num_computed:]
        positions = list(range(num_computed, len(tokens)))
        metadata = AttentionMetadata(
            num_reqs=1, num_actual_tokens=len(new_tokens), max_query_len=len(new_tokens),
            max_seq_len=len(tokens),
            query_start_loc=torch.tensor([0, len(new_tokens)], dtype=torch.int32),
            seq_lens=torch.tensor([len(tokens)], dtype=torch.int32),
            block_table=torch.tensor([block_row], dtype=torch.int32),
            slot_mapping=torch.tensor([block_row[p // block_size] * block_size + p % block_size
                                       for p in positions]),
        )
        with torch.inference_mode():
            hidden = model(torch.tensor(new_tokens), torch.tensor(positions), kv_caches, metadata)
            logits = model.compute_logits(hidden)
        if prefill_logits is None:
            prefill_logits = logits
        num_computed = len(tokens)
        generated.append(int(logits[-1].argmax()))
        tokens.append(generated[-1])

    with torch.inference_mode():
        expected_prefill = hf_model(torch.tensor([prompt_ids])).logits[0]
        expected = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=NUM_GREEDY_TOKENS,
                                     do_sample=False)
    assert torch.equal(prefill_logits.argmax(-1), expected_prefill.argmax(-1))
    torch.testing.assert_close(prefill_logits, expected_prefill, atol=2e-3, rtol=0)
    # The answer is longer than NUM_GREEDY_TOKENS, so generate() did not stop early.
    assert generated == expected[0, len(prompt_ids):].tolist()
