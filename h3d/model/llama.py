"""A Llama-family decoder in plain torch: RMSNorm, RoPE, GQA, SwiGLU; Qwen2 adds q/k/v biases,
Qwen3 an RMSNorm over each query and key head before RoPE (`q_norm`, `k_norm`). Gemma 3 adds to
those: norms that scale by 1 + w in fp32, a norm after attention and two around the MLP (the
"sandwich"), GeGLU, embeddings scaled by sqrt(hidden), its own attention scale, a RoPE of its own
for the sliding-window layers, and soft-capped logits (`ModelConfig`'s fields say which).

Tokens of several sequences are packed along one axis ([N, hidden]); attention reads and writes the
paged KV cache through a `StepKV`, so prefill chunks and decode steps of many sessions run
in one forward. Parameter names follow Hugging Face's, except that q/k/v and gate/up are fused into
one matrix each (one matmul instead of three or two) and projection weights are stored transposed
(`weight_t`, see `Linear`); `h3d.model.loader` converts at load.
"""

from __future__ import annotations

import math
from collections.abc import Generator, Iterator

import torch
import torch.nn.functional as F
from torch import nn

from h3d.kernels.fused import add_rms_norm, rotary
from h3d.kv.attention import GROUP_BYTES, AttentionFn, StepKV, paged_attention
from h3d.model.config import ModelConfig
from h3d.model.rope import RotaryEmbedding, apply_rotary

SLICE_BYTES = 256 << 20  # a long forward's slice: about this much of MLP activations (`CausalLM.slice_rows`)


def drain(stages: Generator[None, None, torch.Tensor]) -> torch.Tensor:
    """Run a forward's pieces (`CausalLM.stages`) in one go; its result."""
    while True:
        try:
            next(stages)
        except StopIteration as done:
            result: torch.Tensor = done.value
            return result


class Linear(nn.Module):
    """y = x @ weight_t (+ bias), the weight stored transposed ([in, out]).

    On the CPU, MKL reads an [in, out] matrix for a single row of x faster than the [out, in]
    layout of nn.Linear, and decode is bound by reading the weights (docs/BENCHMARKS.md, "CPU: h3d
    against transformers on the embedded model", layout choices).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight_t = nn.Parameter(torch.empty(in_features, out_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x @ self.weight_t
        return y + self.bias if self.bias is not None else y


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset  # Gemma: the weight w scales by 1 + w, in fp32, cast after

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.offset:
            normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
            return (normed * (1.0 + self.weight.float())).to(x.dtype)
        if x.is_cuda and x.dtype != torch.float32:
            return self.fused(x)
        # x * rsqrt(mean(x^2) + eps) in fp32, cast back before the weight, as in transformers.
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(x.dtype)

    def fused(self, x: torch.Tensor) -> torch.Tensor:
        """The GPU's form for bf16/fp16: one fused kernel (fp32 inside, one rounding at the end)
        instead of four, within about one ulp of transformers' two roundings; a decode step of a
        32-layer model runs 65 norms."""
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads = cfg.num_heads
        self.num_kv_heads = cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        self.q_size = cfg.num_heads * cfg.head_dim
        self.kv_size = cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.scale = cfg.attn_scale if cfg.attn_scale is not None else cfg.head_dim**-0.5
        self.local = layer in cfg.sliding_typed and cfg.rope_local is not None  # the sliding layers' RoPE
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps, cfg.norm_offset)
        self.qk_norm = cfg.qk_norm
        self.attention: AttentionFn = paged_attention
        self.fused: bool | None = None  # RoPE in one Triton launch; None: on CUDA (`CausalLM.use_fused`)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: StepKV) -> torch.Tensor:
        q, k, v = self.project(x, cos, sin)
        out = self.attend(q, k, v, kv)  # [N, H, D]
        return self.o_proj(out.reshape(x.shape[0], self.q_size))

    def project(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [N, hidden] (normed) -> q [N, H, D], k and v [N, Hkv, D], RoPE applied."""
        n = x.shape[0]
        qkv = self.qkv_proj(x)  # [N, q + 2kv]
        qk, v = qkv.split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # q and k heads side by side: one rotation for both.
        qk = qk.view(n, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        qk = rotary(qk, cos, sin) if (qk.is_cuda if self.fused is None else self.fused) else apply_rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)  # [N, H, D], [N, Hkv, D]
        return q, k, v.view(n, self.num_kv_heads, self.head_dim)

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: StepKV, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """Write k, v to the cache and attend: [N, H, D] (`out` may receive it, see AttentionFn)."""
        kv.write(self.layer, k, v)
        layer = kv.layer(self.layer, q, self.scale)  # may select blocks for q (HBF) and stage them
        return self.attention(q, kv.pools, layer, self.scale, out=out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.gelu = cfg.activation == "gelu_tanh"  # GeGLU (tanh-approximated GELU), else SwiGLU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate, dim=-1)  # [N, I] each
        act = F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)
        return self.down_proj(act * up)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        eps, offset = cfg.rms_norm_eps, cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.self_attn = Attention(cfg, layer)
        # Llama: the norm before the MLP. Sandwich (Gemma): the norm of the attention's output; the
        # MLP has a norm before and one after it.
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.sandwich = cfg.sandwich_norms
        if self.sandwich:
            self.pre_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
            self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, eps, offset)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: StepKV) -> torch.Tensor:
        if self.sandwich:
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), cos, sin, kv))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_rows(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: StepKV, rows: int) -> None:
        """`forward` for many tokens, in place on x ([N, hidden]), in one go (see `stages`)."""
        for _ in self.stages(x, cos, sin, kv, rows):
            pass

    def stages(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv: StepKV,
        rows: int,
        unit_bytes: int = GROUP_BYTES,
    ) -> Iterator[None]:
        """`forward` for many tokens, in place on x ([N, hidden]), in pieces: the projections, norms
        and MLP run `rows` tokens at a time, attention once over all N in groups of KV heads whose
        output is at most `unit_bytes` (`causal_attention`'s groups), so that memory beyond x is q,
        k, v of the N tokens (the attention output goes into q's buffer) and one slice's
        activations. Yields after the projections, after each group's attention and after each
        slice's MLP: a caller may run other steps there (`h3d.engine.prefill`); the arithmetic is
        the same whether it does or not."""
        attn = self.self_attn
        n = x.shape[0]
        q = x.new_empty(n, attn.num_heads, attn.head_dim)
        k = x.new_empty(n, attn.num_kv_heads, attn.head_dim)
        v = torch.empty_like(k)
        for a in range(0, n, rows):
            b = min(n, a + rows)
            q[a:b], k[a:b], v[a:b] = attn.project(self.input_layernorm(x[a:b]), cos[a:b], sin[a:b])
        yield
        kv.write(attn.layer, k, v)
        layer = kv.layer(attn.layer, q, attn.scale)  # may probe the prompt's end (HBF anchors)
        per = attn.num_heads // attn.num_kv_heads
        group = max(1, min(attn.num_kv_heads, unit_bytes // max(1, n * per * attn.head_dim * q.element_size())))
        for first in range(0, attn.num_kv_heads, group):
            end = min(first + group, attn.num_kv_heads)
            qg = q[:, first * per : end * per]
            part = attn.attention(qg, kv.pools.heads(first, end), layer.heads(first, end), attn.scale, out=qg)
            if part is not qg:
                qg.copy_(part)
            yield
        del k, v, layer  # written (or being written, on the transfer stream): not kept through the MLP
        for a in range(0, n, rows):
            b = min(n, a + rows)
            out = attn.o_proj(q[a:b].reshape(b - a, attn.q_size))
            if self.sandwich:
                x[a:b] += self.post_attention_layernorm(out)
                x[a:b] += self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x[a:b])))
            else:
                x[a:b] += out
                x[a:b] += self.mlp(self.post_attention_layernorm(x[a:b]))
            yield


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Its weight given, not initialized: the model is built on the meta device and its weights
        # read in (`h3d.model.loader`), and initializing a meta tensor goes through torch's Python
        # references, whose first call imports torch._dynamo (3.8-4.9 s of a start on an H100 host).
        weight = torch.empty(cfg.vocab_size, cfg.hidden_size)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=weight)
        self.embed_scale = cfg.embed_scale
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [N] -> [N, hidden], scaled by `embed_scale` (rounded to the weights' dtype first,
        as transformers' Gemma does)."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale == 1.0:
            return x
        # the scale as the weights' dtype holds it, a host number (no tensor copied inside a captured step)
        return x * torch.tensor(self.embed_scale, dtype=torch.float32).to(x.dtype).item()


class CausalLM(nn.Module):
    """The decoder plus its LM head. `forward` returns final hidden states; `logits` projects them."""

    def __init__(self, cfg: ModelConfig, device: torch.device) -> None:
        super().__init__()
        self.config = cfg
        self.model = Backbone(cfg)
        # Tied or not, the head keeps its own transposed copy (see Linear).
        self.lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, device)
        # The sliding-window layers' own RoPE (Gemma 3's local base), where the config has one.
        self.rotary_local = (
            None
            if cfg.rope_local is None
            else RotaryEmbedding(cfg.rope_local, cfg.head_dim, cfg.max_position_embeddings, device)
        )
        # Residual adds fused with the norms after them (a Triton kernel); None: on CUDA only.
        # Tests turn it on on the CPU, under Triton's interpreter (`use_fused`).
        self.fuse_norms: bool | None = None
        self.rows: int | None = None  # tokens per slice of a long forward (None: `slice_rows` picks)
        self.unit_bytes = GROUP_BYTES  # a long forward's attention: one piece's output at most this (tests: less)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv: StepKV) -> torch.Tensor:
        """input_ids, positions: [N] -> hidden: [N, hidden] (K/V of the N tokens written to `kv`).
        More than `slice_rows` tokens (a long prompt in one chunk) go layer by layer in slices
        (`stages`, run in one go)."""
        if self.is_long(input_ids.shape[0]):
            return drain(self.stages(input_ids, positions, kv))
        x = self.model.embed(input_ids)  # [N, hidden]
        tables = self.rope_tables(positions, x.dtype, kv.seq_ends)
        cos, sin = tables[False]
        fused = x.is_cuda if self.fuse_norms is None else self.fuse_norms
        if not fused or self.config.sandwich_norms:  # (the fused adds are Llama's order of norms)
            for layer in self.model.layers:
                assert isinstance(layer, DecoderLayer)
                x = layer(x, *tables[layer.self_attn.local], kv)
            return self.model.norm(x)
        # Each residual add and the norm after it in one launch (`add_rms_norm`): the same
        # arithmetic as DecoderLayer.forward, a decode step's ~130 small kernels fewer.
        layers = [layer for layer in self.model.layers if isinstance(layer, DecoderLayer)]
        h = layers[0].input_layernorm(x)
        for i, layer in enumerate(layers):
            attn = layer.self_attn(h, cos, sin, kv)
            x, h = add_rms_norm(attn, x, layer.post_attention_layernorm.weight, layer.post_attention_layernorm.eps)
            out = layer.mlp(h)
            after = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.model.norm
            x, h = add_rms_norm(out, x, after.weight, after.eps)
        return h

    def rope_tables(
        self, positions: torch.Tensor, dtype: torch.dtype, seq_ends: torch.Tensor
    ) -> dict[bool, tuple[torch.Tensor, torch.Tensor]]:
        """cos, sin [N, D] of the global RoPE (key False) and of the sliding layers' own (True; the
        global one where the model has none)."""
        main = self.rotary.cos_sin(positions, dtype, seq_ends)
        local = main if self.rotary_local is None else self.rotary_local.cos_sin(positions, dtype, seq_ends)
        return {False: main, True: local}

    def is_long(self, n: int) -> bool:
        """Whether a forward of n tokens goes layer by layer in slices (`stages`)."""
        return n > self.slice_rows(self.lm_head.weight_t.element_size())

    def stages(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv: StepKV
    ) -> Generator[None, None, torch.Tensor]:
        """A long forward (`is_long`) layer by layer, in the pieces `DecoderLayer.stages` yields
        between; returns the final hidden states [N, hidden] (x's buffer, normed in place)."""
        x = self.model.embed(input_ids)  # [N, hidden]
        tables = self.rope_tables(positions, x.dtype, kv.seq_ends)
        rows = self.slice_rows(x.element_size())
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            yield from layer.stages(x, *tables[layer.self_attn.local], kv, rows, self.unit_bytes)
        for a in range(0, x.shape[0], rows):
            x[a : a + rows] = self.model.norm(x[a : a + rows])
        return x

    def slice_rows(self, element_size: int) -> int:
        """Tokens per slice of a long forward: a power of two whose MLP activations (gate and up)
        take about SLICE_BYTES, at least 256 (`rows` overrides it: tests)."""
        if self.rows is not None:
            return self.rows
        per_row = 2 * self.config.intermediate_size * element_size
        return max(256, 1 << int(math.log2(max(1, SLICE_BYTES // per_row))))

    def use_fused(self, on: bool | None) -> None:
        """The decode step's fused Triton kernels (residual add + RMSNorm, RoPE): True, False, or
        None for "on CUDA only" (the default; the CPU runs them only under Triton's interpreter)."""
        self.fuse_norms = on
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.fused = on

    def use_attention(self, fn: AttentionFn) -> None:
        """Switch every layer's attention implementation (tests compare fast paths with the reference)."""
        for layer in self.model.layers:
            assert isinstance(layer, DecoderLayer)
            layer.self_attn.attention = fn

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [M, hidden] -> logits: [M, vocab] in fp32 (soft-capped where the config says)."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
