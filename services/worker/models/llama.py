"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) over a paged KV cache.

The batch is flattened: ``input_ids`` / ``positions`` hold every scheduled token
of every request back to back, and ``AttentionMetadata`` says where each request
starts. q/k/v and gate/up projections are fused into one matmul each; the
checkpoint's separate tensors are written into row ranges of the fused weight
by ``load_weights``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import skip_init

from kernels.cpu_extension import has_cpu_kernel
from kernels.int8_dynamic_linear_cpu import CPU_KERNEL_MAX_K as INT8_DYNAMIC_MAX_K
from kernels.llama_decode_cpu import gguf_format, llama_decode_cpu
from kernels.paged_attention_cpu import uses_cpu_kernel
from services.worker.attention import Attention, AttentionMetadata
from services.worker.compilation import private_copy
from services.worker.config import ModelConfig
from services.worker.gguf_weights import QuantizedWeight, fuse_quantized
from services.worker.huge_pages import move_to_huge_pages_
from services.worker.layers import RMSNorm, RotaryEmbedding, SiluAndMul, apply_rotary_emb
from services.worker.layers.bf16_linear import Bf16Linear
from services.worker.layers.gguf_linear import GGUFLinear
from services.worker.layers.linear_choice import bf16_max_rows_by_shape
from services.worker.layers.packed_linear import PackedLinear, cpu_linear, pack_linears_
from services.worker.layers.prefetch_choice import choose_row_group_prefetch
from services.worker.layers.quantization import Int8Linear, quantize_linears_int8
from services.worker.layers.quantized_choice import set_kernel_max_rows_

# (fused parameter, checkpoint projection, shard id) in vLLM's naming.
_STACKED_PARAMS = (
    (".qkv_proj.", ".q_proj.", "q"),
    (".qkv_proj.", ".k_proj.", "k"),
    (".qkv_proj.", ".v_proj.", "v"),
    (".gate_up_proj.", ".gate_proj.", "gate"),
    (".gate_up_proj.", ".up_proj.", "up"),
)
# The fused decode step (``FusedDecodeStep``) serves up to this many requests: measured
# faster than the compiled step from 1 to 64 (Zen 5, benchmarks/RESULTS.md: 1.3x at
# one, 1.1x at 16, 1.02-1.03x at 64), not beyond; it runs each layer's elementwise work
# on one thread. Fewer where a layer's kernel serves fewer (``Bf16Linear.max_rows``).
FUSED_MAX_ROWS = 64
# ... and in_features that kvmesh's bfloat16 kernel and its vector loops step through.
FUSED_K_MULTIPLE = 32
# Each linear layer of a decoder layer: (its module, its name, the checkpoint
# weights stacked into it by rows, in order).
_CHECKPOINT_PARTS = (
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj")),
    ("self_attn", "o_proj", ("o_proj",)),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj")),
    ("mlp", "down_proj", ("down_proj",)),
)


def _linear(in_features: int, out_features: int, bias: bool,
            dtype: torch.dtype, device: torch.device) -> nn.Linear:
    # Weights come from the checkpoint: skip the random init, which costs
    # seconds on large models.
    return skip_init(nn.Linear, in_features, out_features, bias=bias, dtype=dtype, device=device)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        if config.hidden_act != "silu":
            raise ValueError(f"hidden_act {config.hidden_act!r} is not supported; supported: silu")
        hidden, inter, bias = config.hidden_size, config.intermediate_size, config.mlp_bias
        self.gate_up_proj = _linear(hidden, 2 * inter, bias, config.dtype, device)
        self.down_proj = _linear(inter, hidden, bias, config.dtype, device)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_size = config.head_size
        self.q_size = config.num_heads * config.head_size
        self.kv_size = config.num_kv_heads * config.head_size
        self.qkv_proj = _linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                config.qkv_bias, config.dtype, device)
        self.o_proj = _linear(self.q_size, config.hidden_size, config.o_proj_bias,
                              config.dtype, device)
        self.attn = Attention(self.num_heads, self.head_size, self.head_size ** -0.5,
                              self.num_kv_heads)

    def qkv(self, hidden_states: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Projects and rotates: (q [T, heads, head], k [T, kv_heads, head], v [T, kv_heads * head])."""
        num_tokens = hidden_states.shape[0]
        qk, v = self.qkv_proj(hidden_states).split([self.q_size + self.kv_size, self.kv_size], -1)
        # q and k heads rotate by the same angles: one rotation over both halves the
        # number of small elementwise ops per layer.
        qk = apply_rotary_emb(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_size),
                              cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], 1)
        return q, k, v


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        eps, dtype = config.rms_norm_eps, config.dtype
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = LlamaAttention(config, device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = LlamaMLP(config, device)

    def pre_attention(self, hidden_states: torch.Tensor, residual: torch.Tensor | None,
                      cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Norm (after adding the residual) and q/k/v: returns (q, k, v, residual stream)."""
        if residual is None:
            residual = hidden_states
            hidden_states = self.input_layernorm(hidden_states)
        else:
            hidden_states, residual = self.input_layernorm(hidden_states, residual)
        q, k, v = self.self_attn.qkv(hidden_states, cos, sin)
        return q, k, v, residual

    def post_attention(self, attn_output: torch.Tensor,
                       residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (mlp output, residual stream); the caller adds them in the next norm."""
        hidden_states = self.self_attn.o_proj(attn_output)
        hidden_states, residual = self.post_attention_layernorm(hidden_states, residual)
        return self.mlp(hidden_states), residual


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.embed_tokens = skip_init(nn.Embedding, config.vocab_size, config.hidden_size,
                                      dtype=config.dtype, device=device)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, device)
                                    for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.dtype, device)
        self.rotary_emb = RotaryEmbedding(config.head_size, config.max_position_embeddings,
                                          config.rope_theta, config.rope_scaling,
                                          config.dtype, device)
        # The forward pass between attention calls, in order. A runner may replace
        # each piece with a PIECEWISE CUDA graph wrapper (``wrap_pieces``) or compile
        # them (``compile_pieces``); attention always runs between them, outside.
        self.pieces: list[Callable[..., Any]] = self._make_pieces(
            _first_piece, _middle_piece, _last_piece)
        # A decode-only step's whole forward pass, attention included, as one
        # compiled graph (``compile_decode_step``); None: decode steps use the pieces.
        self.decode_step: Callable[..., torch.Tensor] | None = None
        # The same as one C++ op for up to its max_rows requests (``fuse_decode_step``).
        self.fused_decode: FusedDecodeStep | None = None

    def _make_pieces(self, first: Callable[..., Any], middle: Callable[..., Any],
                     last: Callable[..., Any]) -> list[Callable[..., Any]]:
        """Binds each piece function to the modules it runs. Every middle piece shares
        one function (modules are arguments), so one compiled graph serves them all."""
        layers = self.layers
        return [
            functools.partial(first, self.embed_tokens, self.rotary_emb, layers[0]),
            *(functools.partial(middle, layers[i - 1], layers[i]) for i in range(1, len(layers))),
            functools.partial(last, layers[-1], self.norm),
        ]

    def compile_pieces(self, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replaces the pieces with ``compile_fn`` of each piece function (three in all)."""
        self.pieces = self._make_pieces(compile_fn(_first_piece), compile_fn(_middle_piece),
                                        compile_fn(_last_piece))

    def compile_decode_step(self, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]],
                            kv_caches: list[torch.Tensor]) -> None:
        """Runs every later decode-only step through ``compile_fn(_decode_step)``: the
        CPU counterpart of a FULL CUDA graph (one call per step instead of one per
        piece and per attention layer, and the KV write fused into the graph).

        ``kv_caches`` are the caches those steps pass; they are marked static, so
        that torch never traces their sizes as symbols it could tie to a batch's.
        """
        for kv_cache in kv_caches:
            torch._dynamo.mark_static(kv_cache)
        # Traced and compiled once, then stamped out for every layer: tracing 30
        # layers one by one took 10 s per compiled variant, on every start. A
        # private copy, since torch keeps a region's subgraphs (at most 8) per code
        # object: another model in the process must not share or use up this one's.
        decode_layer = torch.compiler.nested_compile_region(private_copy(_decode_layer))
        self.decode_step = functools.partial(compile_fn(_decode_step), self, decode_layer)

    def fuse_decode_step(self, kv_caches: list[torch.Tensor]) -> bool:
        """Runs every later decode-only step of up to ``FusedDecodeStep.max_rows``
        requests as one C++ op (``kernels/llama_decode_cpu.py``), where the model
        and ``kv_caches`` are what it serves: bfloat16 or float32 on the CPU, every
        linear layer on kvmesh's bfloat16 kernel (``Bf16Linear``), every one on its
        w8a8 kernel (``Int8Linear`` with dynamic activations) or every one a GGUF's
        blocks (``GGUFLinear``), none with a bias. Returns whether it does. Call
        after ``pack_weights_``."""
        self.fused_decode = FusedDecodeStep.of(self, kv_caches)
        return self.fused_decode is not None

    def _whole_decode_step(self, num_reqs: int) -> Callable[..., torch.Tensor] | None:
        """What runs a decode-only step of ``num_reqs`` requests whole: the fused op up
        to its rows, else the compiled graph; None: the pieces do."""
        if self.fused_decode is not None and num_reqs <= self.fused_decode.max_rows:
            return self.fused_decode
        return self.decode_step

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"got {len(kv_caches)} KV caches, need one per layer ({len(self.layers)})")
        num_reqs = attn_metadata.num_reqs
        decode_only = (attn_metadata.max_query_len == 1
                       and attn_metadata.num_actual_tokens == num_reqs == input_ids.shape[0])
        step = self._whole_decode_step(num_reqs) if decode_only else None
        if step is not None:
            plan = self.layers[0].self_attn.attn.plan(attn_metadata, kv_caches[0][0])
            return step(input_ids, positions, kv_caches, attn_metadata.slot_mapping[:num_reqs],
                        plan.decode_block_table, plan.decode_seq_lens)
        q, k, v, attn_output, residual, cos, sin = self.pieces[0](input_ids, positions)
        for i, layer in enumerate(self.layers):
            layer.self_attn.attn(q, k, v, kv_caches[i], attn_metadata, out=attn_output)
            if i + 1 < len(self.layers):
                q, k, v, attn_output, residual = self.pieces[i + 1](attn_output, residual, cos, sin)
        return self.pieces[-1](attn_output, residual)


def _first_piece(embed_tokens: nn.Embedding, rotary_emb: RotaryEmbedding, layer: LlamaDecoderLayer,
                 input_ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Embedding and layer 0 up to attention: (q, k, v, attention output buffer,
    residual, cos, sin)."""
    hidden_states = embed_tokens(input_ids)
    # Every layer rotates by the same positions: gather cos/sin once per step.
    cos, sin = rotary_emb(positions)
    q, k, v, residual = layer.pre_attention(hidden_states, None, cos, sin)
    return q, k, v, _attention_output(q), residual, cos, sin


def _middle_piece(prev_layer: LlamaDecoderLayer, layer: LlamaDecoderLayer,
                  attn_output: torch.Tensor, residual: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``prev_layer`` after attention, ``layer`` up to it: (q, k, v, attention output
    buffer, residual)."""
    hidden_states, residual = prev_layer.post_attention(attn_output, residual)
    q, k, v, residual = layer.pre_attention(hidden_states, residual, cos, sin)
    return q, k, v, _attention_output(q), residual


def _last_piece(layer: LlamaDecoderLayer, norm: RMSNorm, attn_output: torch.Tensor,
                residual: torch.Tensor) -> torch.Tensor:
    """The last layer after attention and the final norm: hidden states [T, hidden]."""
    hidden_states, residual = layer.post_attention(attn_output, residual)
    hidden_states, _ = norm(hidden_states, residual)
    return hidden_states


def _decode_step(model: LlamaModel, decode_layer: Callable[..., tuple[torch.Tensor, torch.Tensor]],
                 input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
    """The whole forward pass of a decode-only step (one token per request, no
    padding), written to be compiled as one graph: hidden states [num_reqs, hidden].
    ``decode_layer`` runs one layer (`_decode_layer`, as a nested compile region);
    ``block_table``/``seq_lens`` are the step's CPU attention plan's decode ones."""
    hidden_states = model.embed_tokens(input_ids)
    # Copies: the layers' compiled region takes no inputs that alias each other.
    cos, sin = (t.clone() for t in model.rotary_emb(positions))
    # Layer 0 adds a zero residual, exactly as if it added none: every layer is alike.
    residual = torch.zeros_like(hidden_states)
    for layer, kv_cache in zip(model.layers, kv_caches):
        hidden_states, residual = decode_layer(layer, hidden_states, residual, cos, sin,
                                               kv_cache, slot_mapping, block_table, seq_lens)
    hidden_states, _ = model.norm(hidden_states, residual)
    return hidden_states


def _decode_layer(layer: LlamaDecoderLayer, hidden_states: torch.Tensor, residual: torch.Tensor,
                  cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
                  slot_mapping: torch.Tensor, block_table: torch.Tensor,
                  seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer of `_decode_step`: (mlp output, residual stream)."""
    q, k, v, residual = layer.pre_attention(hidden_states, residual, cos, sin)
    attn_output = layer.self_attn.attn.forward_decode(q, k, v, kv_cache, slot_mapping,
                                                      block_table, seq_lens)
    return layer.post_attention(attn_output, residual)


@dataclasses.dataclass(frozen=True)
class FusedDecodeStep:
    """A decode-only step as ``kvmesh::llama_decode_cpu``: the embedding lookup, then
    every layer and the final norm in one C++ call. Called like ``LlamaModel``'s
    compiled ``decode_step``, for up to ``max_rows`` requests."""

    embed_tokens: nn.Embedding
    cos_sin_cache: torch.Tensor
    weights: list[torch.Tensor]  # per layer, the op's tensors in its order
    linear: str  # the op's kind of linear layer: "bf16", "w8a8" or "gguf"
    final_norm: torch.Tensor
    num_heads: int
    num_kv_heads: int
    eps: float
    scale: float
    max_rows: int

    @classmethod
    def of(cls, model: LlamaModel, kv_caches: list[torch.Tensor]) -> FusedDecodeStep | None:
        """The fused step where the op serves ``model`` and ``kv_caches``, else None."""
        parts = [(layer.input_layernorm, layer.self_attn.qkv_proj, layer.self_attn.o_proj,
                  layer.post_attention_layernorm, layer.mlp.gate_up_proj, layer.mlp.down_proj)
                 for layer in model.layers]
        linears = [m for part in parts for m in part if not isinstance(m, RMSNorm)]
        linear = _fused_linear_kind(linears)
        attn = model.layers[0].self_attn.attn
        dtype = model.norm.weight.dtype  # the activations'
        query = torch.empty(1, attn.num_heads, attn.head_size, dtype=dtype)
        norms = [m.weight for part in parts for m in part if isinstance(m, RMSNorm)]
        if not (linear is not None and has_cpu_kernel("llama_decode_cpu") and kv_caches
                and dtype in (torch.bfloat16, torch.float32)
                and all(t.dtype == dtype and t.device.type == "cpu"
                        for t in [*norms, model.rotary_emb.cos_sin_cache, *kv_caches])
                and uses_cpu_kernel(query, kv_caches[0][0])):
            return None
        weights = [t for part in parts for m in part for t in _fused_tensors(m)]
        max_rows = min(FUSED_MAX_ROWS, *(m.max_rows if isinstance(m, Bf16Linear)
                                         else m.kernel_max_rows for m in linears))
        return cls(model.embed_tokens, model.rotary_emb.cos_sin_cache, weights, linear,
                   model.norm.weight.detach(), attn.num_heads, attn.num_kv_heads,
                   model.norm.variance_epsilon, attn.scale, max_rows)

    @contextlib.contextmanager
    def one_row_call(self, kv_caches: list[torch.Tensor]) -> Iterator[Callable[[], torch.Tensor]]:
        """A call of the step for one request of one token, to time: its K and V go
        to the first slot of the last block of ``kv_caches`` [2, num_blocks,
        block_size, ...], whose contents are put back on leaving."""
        block = kv_caches[0].shape[1] - 1
        saved = [kv[:, block, 0].clone() for kv in kv_caches]
        zero = torch.zeros(1, dtype=torch.int64)
        try:
            yield functools.partial(self, zero, zero, kv_caches,
                                    torch.tensor([block * kv_caches[0].shape[2]]),
                                    torch.full((1, 1), block, dtype=torch.int32),
                                    torch.ones(1, dtype=torch.int32))
        finally:
            with torch.inference_mode():  # the caches may have been made in it
                for kv, contents in zip(kv_caches, saved):
                    kv[:, block, 0] = contents

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor,
                 kv_caches: list[torch.Tensor], slot_mapping: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        return llama_decode_cpu(self.embed_tokens(input_ids), positions, self.cos_sin_cache,
                                self.weights, self.final_norm, kv_caches, slot_mapping,
                                block_table, seq_lens, self.num_heads, self.num_kv_heads,
                                self.eps, self.scale, self.linear)


def _fused_linear_kind(linears: list[nn.Module]) -> str | None:
    """The fused op's kind for ``linears``: "bf16" where each is on kvmesh's bfloat16
    kernel, "w8a8" where each is on its w8a8 kernel, "gguf" where each keeps a GGUF's
    blocks (of any quant type and layout); None otherwise (or with a bias)."""
    if not all(getattr(m, "bias", None) is None and m.in_features % FUSED_K_MULTIPLE == 0
               for m in linears):
        return None
    if all(isinstance(m, Bf16Linear) for m in linears):
        return "bf16"
    if all(isinstance(m, Int8Linear) and m.dynamic_activations and m.has_kernel
           and m.in_features <= INT8_DYNAMIC_MAX_K for m in linears):
        return "w8a8"
    if all(isinstance(m, GGUFLinear) for m in linears):
        return "gguf"
    return None


def _fused_tensors(module: nn.Module) -> list[torch.Tensor]:
    """A norm's or linear layer's tensors as the fused op takes them."""
    if isinstance(module, RMSNorm):
        return [module.weight.detach()]
    if isinstance(module, Bf16Linear):
        return [module.weight]
    if isinstance(module, GGUFLinear):
        return [module.qweight, gguf_format(module.quant_type, module.packed)]
    return [module.qweight, module.float_scales, module.weight_sums]  # w8a8


def _attention_output(q: torch.Tensor) -> torch.Tensor:
    # Allocated in the piece before attention (vLLM's attention-with-output), so that
    # under PIECEWISE graphs it is a static buffer the attention call writes in place.
    return q.new_empty(q.shape[0], q.shape[1] * q.shape[2])


class LlamaForCausalLM(nn.Module):
    """Causal LM head on ``LlamaModel``.

    ``forward(input_ids [T] int64, positions [T] int64, kv_caches, attn_metadata)``
    -> hidden states [T, hidden_size]; ``kv_caches[i]`` is layer i's
    [2, num_blocks, block_size, num_kv_heads, head_size] cache, written in place.
    ``compute_logits`` turns the rows the caller selected into float32 logits.
    Parameters are uninitialized until ``load_weights``.
    """

    def __init__(self, config: ModelConfig, device: torch.device | str = "cpu") -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.model = LlamaModel(config, device)
        if config.tie_word_embeddings:
            self.lm_head: nn.Module = self.model.embed_tokens
        else:
            self.lm_head = _linear(config.hidden_size, config.vocab_size, False, config.dtype, device)
        q_size, kv_size = config.num_heads * config.head_size, config.num_kv_heads * config.head_size
        inter = config.intermediate_size
        # Row range [start, start + size) of each shard inside its fused weight.
        self._shard_rows = {"q": (0, q_size), "k": (q_size, kv_size),
                            "v": (q_size + kv_size, kv_size), "gate": (0, inter), "up": (inter, inter)}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                kv_caches: list[torch.Tensor], attn_metadata: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, attn_metadata)

    def wrap_pieces(self, wrap: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Replaces each piece of the forward pass between attention calls with ``wrap(piece)``."""
        self.model.pieces = [wrap(piece) for piece in self.model.pieces]

    def compile_pieces(self, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
        """Compiles the forward pass between attention calls: ``compile_fn`` (e.g.
        ``torch.compile``) is applied to each of the three piece functions once."""
        self.model.compile_pieces(compile_fn)

    def compile_decode_step(self, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]],
                            kv_caches: list[torch.Tensor]) -> None:
        """Compiles decode-only steps whole, attention included (CPU; see ``LlamaModel``)."""
        self.model.compile_decode_step(compile_fn, kv_caches)

    def fuse_decode_step(self, kv_caches: list[torch.Tensor]) -> int:
        """Runs small decode-only steps as one C++ op where it serves the model (CPU,
        bfloat16 or float32; see ``LlamaModel``); returns up to how many requests, 0
        if never.

        Where it does, the op's weights, then the LM head's and the embedding's,
        move onto huge pages in the order a step reads them (``huge_pages``): a
        step of few requests reads them all from memory and little else. Then
        the kernels' prefetch mode is measured on a step of one request
        (``prefetch_choice``; ``kv_caches`` are left as they were)."""
        fused = self.model.fused_decode if self.model.fuse_decode_step(kv_caches) else None
        if fused is None:
            return 0
        head = [t for t in (*self.lm_head.parameters(), *self.lm_head.buffers())
                if t.layout == torch.strided]  # not oneDNN's opaque packed copy
        move_to_huge_pages_([*fused.weights, *head, self.model.embed_tokens.weight])
        with fused.one_row_call(kv_caches) as step:
            choose_row_group_prefetch(step)
        return fused.max_rows

    def compute_logits(self, hidden_states: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        """[n, hidden_size] -> logits [n, vocab_size]: float32, or written into ``out``
        (any float dtype) when given. A plain head of ``out``'s dtype writes straight
        into it; the others (int8, prepacked, bfloat16 on kvmesh's kernel: their
        kernels have no ``out`` form; or a dtype change) return their own
        [n, vocab_size] result, copied in."""
        if isinstance(self.lm_head, (Int8Linear, PackedLinear, Bf16Linear, GGUFLinear)):
            logits = self.lm_head(hidden_states)
        elif out is not None and out.dtype == hidden_states.dtype:
            return torch.mm(hidden_states, self.lm_head.weight.t(), out=out)
        else:
            logits = F.linear(hidden_states, self.lm_head.weight)
        return logits.float() if out is None else out.copy_(logits)

    def quantize_int8_(self, dtype: torch.dtype) -> None:
        """Weight-only int8 for every linear layer and the LM head, the rest cast to ``dtype``.

        Call after ``load_weights`` on a float32 model, so that quantization
        starts from the checkpoint's own values. A tied head gets its own int8
        copy of the embedding (the lookup keeps the ``dtype`` table).
        """
        quantize_linears_int8(self.model, dtype)
        self.lm_head = Int8Linear.from_float(self.lm_head.weight, None, dtype)
        self.to(dtype)
        self.config = dataclasses.replace(self.config, dtype=dtype)

    def use_gguf_weights_(self, weights: Mapping[str, QuantizedWeight]) -> int:
        """Serves each linear layer, and the LM head, from a GGUF file's own blocks
        (``GGUFLinear``) where ``weights`` (Hugging Face names) holds every part
        of it in one block type; returns how many layers were replaced.

        Call after ``load_weights``: biases, norms and the embedding table stay
        the float ones loaded there. A tied head multiplies the embedding's blocks.
        """
        count = 0
        for i, layer in enumerate(self.model.layers):
            for owner, name, parts in _CHECKPOINT_PARTS:
                module = getattr(layer, owner)
                quantized = fuse_quantized([weights.get(f"model.layers.{i}.{owner}.{part}.weight")
                                            for part in parts])
                if quantized is not None:
                    setattr(module, name, GGUFLinear(quantized.data, quantized.quant_type,
                                                     quantized.in_features,
                                                     getattr(module, name).bias))
                    count += 1
        head = weights.get("model.embed_tokens.weight" if self.config.tie_word_embeddings
                           else "lm_head.weight")
        if head is not None:
            self.lm_head = GGUFLinear(head.data, head.quant_type, head.in_features)
            count += 1
        return count

    def pack_weights_(self) -> int:
        """Gives every float linear layer and the LM head its CPU kernel (``cpu_linear``):
        bfloat16 ones kvmesh's kernel up to the row count this machine measured it
        faster at (``Bf16Linear``), the rest oneDNN's prepacked linear
        (``PackedLinear``); returns how many were replaced, 0 where neither serves.

        Call once the weights are final (loaded, quantized): a packed weight can
        no longer be loaded into, cast or read. A tied head gets its own packed
        copy of the embedding (the lookup keeps the plain table), or shares the
        table as a ``Bf16Linear``. Measures each new bfloat16 shape (~1 s for
        SmolLM2-135M's five), once per machine (``bf16_max_rows_by_shape``).
        Quantized layers keep their weights and get the row count up to which
        their kernel serves, measured once per machine and model
        (``set_kernel_max_rows_``).
        """
        set_kernel_max_rows_(self, self.config.dtype)
        head = self.lm_head
        heads = [head] if isinstance(head, (nn.Linear, nn.Embedding)) else []
        linears = [m for m in self.model.modules() if isinstance(m, nn.Linear)] + heads
        bf16_max_rows = bf16_max_rows_by_shape(m.weight for m in linears)
        count = pack_linears_(self.model, bf16_max_rows)
        layer = cpu_linear(head.weight, getattr(head, "bias", None), bf16_max_rows) if heads else None
        if layer is not None:
            self.lm_head = layer
            count += 1
        return count

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copies Hugging Face-named tensors into the parameters, casting to their dtype.

        Returns the names of the parameters loaded. Raises ValueError for a
        tensor with no parameter or the wrong shape, and when a parameter (or
        one shard of a fused one) was never written.
        """
        params = dict(self.named_parameters())
        loaded: set[tuple[str, str | None]] = set()
        for hf_name, tensor in weights:
            if "rotary_emb.inv_freq" in hf_name:
                continue  # old checkpoints store it; it is recomputed
            if hf_name == "lm_head.weight" and self.config.tie_word_embeddings:
                continue  # the embedding doubles as the head
            name, shard = _to_param_name(hf_name)
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} matches no parameter of "
                                 f"{self.config.architecture}")
            target = params[name].data
            if shard is not None:
                target = target.narrow(0, *self._shard_rows[shard])
            if target.shape != tensor.shape:
                raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(target.shape)}")
            target.copy_(tensor)
            loaded.add((name, shard))
        missing = self._expected_shards(params) - loaded
        if missing:
            names = sorted(f"{n}[{s}]" if s else n for n, s in missing)
            raise ValueError(f"checkpoint is missing {len(missing)} tensors, e.g. {names[:5]}")
        return {name for name, _ in loaded}

    @staticmethod
    def _expected_shards(params: dict[str, nn.Parameter]) -> set[tuple[str, str | None]]:
        expected: set[tuple[str, str | None]] = set()
        for name in params:
            shards = [s for fused, _, s in _STACKED_PARAMS if fused in name]
            expected.update((name, s) for s in shards or [None])
        return expected


def _to_param_name(hf_name: str) -> tuple[str, str | None]:
    """Checkpoint name -> (our parameter name, shard id or None)."""
    for fused, part, shard in _STACKED_PARAMS:
        if part in hf_name:
            return hf_name.replace(part, fused), shard
    return hf_name, None
