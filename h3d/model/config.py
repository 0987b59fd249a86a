"""The model's shape, read from a Hugging Face `config.json`.

Only what the decoder needs is kept, typed and validated; anything h3d cannot run exactly (another
architecture, an unknown layer type or RoPE type) is refused here with a clear error rather than
computed wrongly later.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from h3d.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "MistralForCausalLM": "mistral",
    "Gemma3ForCausalLM": "gemma3",
    # The text model of Gemma 3's 4B-27B checkpoints (`text_config`); the vision tower is not loaded.
    "Gemma3ForConditionalGeneration": "gemma3",
}
MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "mistral": "mistral", "gemma3_text": "gemma3"}
# transformers' Gemma3TextConfig defaults, for the keys a checkpoint's (often sparse) config leaves out.
GEMMA3_DEFAULTS: dict[str, Any] = {
    "vocab_size": 262_208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "hidden_activation": "gelu_pytorch_tanh",
    "max_position_embeddings": 131_072,
    "rms_norm_eps": 1e-6,
    "pad_token_id": 0,
    "eos_token_id": 1,
    "bos_token_id": 2,
    "tie_word_embeddings": True,
    "rope_theta": 1_000_000.0,
    "rope_local_base_freq": 10_000.0,
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "sliding_window_pattern": 6,
}
ACTIVATIONS = {"silu": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """RoPE frequencies: `theta` and an optional HF scaling type with its parameters."""

    theta: float
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int | None = None
    # yarn: the ramp's bounds in rotations, the cos/sin scale (None: from `factor` and the mscales,
    # as transformers infers it) and whether the ramp's range is rounded out to whole dimensions.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Shape of a Llama-family decoder. `qkv_bias` is True for Qwen2; `qk_norm` (Qwen3, Gemma 3): an
    RMSNorm over each query and key head (weights per head dimension, shared by the heads) before
    RoPE. Gemma 3's differences are fields too: `norm_offset` (norms scale by 1 + w, in fp32),
    `sandwich_norms` (a norm after attention and around the MLP), `activation`, `embed_scale`,
    `attn_scale`, `final_softcap`, and `rope_local` (the sliding layers' RoPE)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope: RopeConfig
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    qk_norm: bool = False
    # Sliding-window layers: a query at position p attends to keys p - sliding_window < j <= p
    # (transformers' `sliding_window_overlay`); `sliding_layers` lists them.
    sliding_window: int | None = None
    sliding_layers: tuple[int, ...] = ()
    # The layers the config types as sliding, whether or not their window is shorter than the
    # context (Gemma 3's RoPE follows the type: `rope_local`).
    sliding_typed: tuple[int, ...] = ()
    norm_offset: bool = False
    sandwich_norms: bool = False
    activation: str = "silu"  # "silu" (SwiGLU) or "gelu_tanh" (GeGLU, tanh-approximated GELU)
    embed_scale: float = 1.0  # embeddings times this (Gemma: sqrt(hidden), rounded to the weights' dtype)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    final_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    rope_local: RopeConfig | None = None  # the sliding layers' RoPE (None: `rope`)

    @property
    def windows(self) -> tuple[int | None, ...]:
        """Each layer's window in tokens (None: full attention)."""
        sliding = set(self.sliding_layers)
        return tuple(self.sliding_window if i in sliding else None for i in range(self.num_layers))

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, per byte of element size."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim


def _ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(int(v) for v in value)


def _rope(raw: dict[str, Any], max_pos: int, layer_type: str | None = None) -> RopeConfig:
    # transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x writes `rope_parameters`, per layer
    # type where they differ (Gemma 3: `rope_parameters[layer_type]`).
    params = dict(raw.get("rope_parameters") or {})
    if layer_type is not None and any(k in params for k in LAYER_TYPES):
        params = dict(params.get(layer_type) or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    rope_type = str(merged.get("rope_type", merged.get("type", "default")))
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope type {rope_type!r} (supported: {', '.join(ROPE_TYPES)})")
    partial = float(merged.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) or 1.0)
    if partial != 1.0:
        raise ModelLoadError(f"partial_rotary_factor {partial} is not supported (RoPE over whole heads only)")
    original = merged.get("original_max_position_embeddings")
    factor = merged.get("factor")
    if rope_type == "yarn":  # as transformers' standardize_rope_params: the top-level key wins
        original = int(raw.get("original_max_position_embeddings", original) or max_pos)
        factor = max_pos / original if factor is None else factor
    optional = {k: float(merged[k]) for k in ("attention_factor", "mscale", "mscale_all_dim") if merged.get(k)}
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(1.0 if factor is None else factor),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(original) if original is not None else None,
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        truncate=bool(merged.get("truncate", True)),
        **optional,
    )


LAYER_TYPES = ("full_attention", "sliding_attention")


def _sliding(
    raw: dict[str, Any], arch: str, num_layers: int, max_pos: int
) -> tuple[int | None, tuple[int, ...], tuple[int, ...]]:
    """The sliding window and the layers that use it, as transformers decides them: `layer_types`
    where the config has it (transformers 5 writes it); else Mistral's `sliding_window` (every
    layer), Qwen2's and Qwen3's `use_sliding_window` (the layers from `max_window_layers` on). A
    window that covers `max_position_embeddings` is full attention.
    -> (window, the layers it limits, the layers typed sliding)."""
    window = raw.get("sliding_window")
    types = raw.get("layer_types")
    if types is None:
        if arch == "mistral" and window is not None:
            types = ["sliding_attention"] * num_layers
        elif arch in ("qwen2", "qwen3") and raw.get("use_sliding_window") and window is not None:
            first = int(raw.get("max_window_layers", num_layers))
            types = ["sliding_attention" if i >= first else "full_attention" for i in range(num_layers)]
        else:
            types = ["full_attention"] * num_layers
    unknown = sorted(set(map(str, types)) - set(LAYER_TYPES))
    if unknown:
        supported = ", ".join(LAYER_TYPES)
        raise ModelLoadError(f"layer types {', '.join(unknown)} are not supported (supported: {supported})")
    if len(types) != num_layers:
        raise ModelLoadError(f"layer_types lists {len(types)} layers, the model has {num_layers}")
    sliding = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if not sliding:
        return None, (), ()
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise ModelLoadError(f"sliding-window layers need a positive integer sliding_window, got {window!r}")
    if window >= max_pos:
        return None, (), sliding
    return window, sliding, sliding


def _gemma3(raw: dict[str, Any]) -> dict[str, Any]:
    """A Gemma 3 config as the text model's keys, transformers' defaults filled in: the text model
    of a multimodal checkpoint (`text_config`), whose image inputs h3d refuses."""
    text = dict(raw["text_config"] or {}) if "text_config" in raw else dict(raw)
    text.setdefault("architectures", raw.get("architectures"))
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # the outer config's ids win
        if key in raw and "text_config" in raw:
            text.setdefault(key, raw[key])
    for key, value in GEMMA3_DEFAULTS.items():
        text.setdefault(key, value)
    if text.get("layer_types") is None:  # transformers: every `sliding_window_pattern`-th layer is full
        pattern, layers = int(text["sliding_window_pattern"]), int(text["num_hidden_layers"])
        text["layer_types"] = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    params = text.get("rope_parameters") or {}
    if not any(k in params for k in LAYER_TYPES):  # transformers 4's keys: global scaling, a local base
        scaling = dict(text.get("rope_scaling") or {})
        text["rope_parameters"] = {
            "full_attention": {"rope_type": "default", **scaling, "rope_theta": text["rope_theta"]},
            "sliding_attention": {"rope_type": "default", "rope_theta": text["rope_local_base_freq"]},
        }
        text.pop("rope_scaling", None)
    if text.get("attn_logit_softcapping"):
        raise ModelLoadError("attn_logit_softcapping is not supported (Gemma 2's attention soft-capping)")
    if text.get("use_bidirectional_attention"):
        raise ModelLoadError("use_bidirectional_attention is not supported (h3d serves causal decoders)")
    return text


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is not None:
        return arch
    model_type = raw.get("model_type")
    if model_type in MODEL_TYPES and not archs:
        return MODEL_TYPES[str(model_type)]
    supported = ", ".join(SUPPORTED_ARCHITECTURES)
    raise ModelLoadError(f"unsupported architecture {archs or model_type!r} (supported: {supported})")


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from config.json's dict (and generation_config.json's, if any)."""
    arch = _architecture(raw)
    if arch == "gemma3":
        raw = _gemma3(raw)
    if raw.get("mlp_bias"):
        raise ModelLoadError("mlp_bias = true is not supported")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "silu"
    if act not in ACTIVATIONS or (arch == "gemma3") != (act == "gelu_pytorch_tanh"):
        want = "gelu_pytorch_tanh" if arch == "gemma3" else "silu"
        raise ModelLoadError(f"unsupported activation {act!r} for this architecture (supported: {want})")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        max_pos = int(raw.get("max_position_embeddings", 2048))
        head_dim = raw.get("head_dim") or hidden // heads
        # generation_config.json's EOS ids win over config.json's, as in transformers.
        eos = _ids((generation or {}).get("eos_token_id")) or _ids(raw.get("eos_token_id"))
        window, sliding, typed = _sliding(raw, arch, int(raw["num_hidden_layers"]), max_pos)
        gemma = arch == "gemma3"
        return ModelConfig(
            architecture=arch,
            vocab_size=int(raw["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(raw["intermediate_size"]),
            num_layers=int(raw["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(raw.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=max_pos,
            rope=_rope(raw, max_pos, "full_attention" if gemma else None),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(raw.get("attention_bias", False)),
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id"),
            qk_norm=arch in ("qwen3", "gemma3"),
            sliding_window=window,
            sliding_layers=sliding,
            sliding_typed=typed,
            norm_offset=gemma,
            sandwich_norms=gemma,
            activation=ACTIVATIONS[act],
            # transformers: a tensor of sqrt(hidden) cast to the embeddings' dtype (fp32 here; the
            # model rounds it to its own dtype)
            embed_scale=float(hidden**0.5) if gemma else 1.0,
            attn_scale=float(raw["query_pre_attn_scalar"]) ** -0.5 if gemma else None,
            final_softcap=float(raw["final_logit_softcapping"]) if raw.get("final_logit_softcapping") else None,
            rope_local=_rope(raw, max_pos, "sliding_attention") if gemma else None,
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json lacks required key {exc.args[0]!r}") from exc


def load_model_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{model_dir} has no config.json (is it a Hugging Face model folder?)")
    try:
        raw = json.loads(path.read_text())
        gen_path = model_dir / "generation_config.json"
        generation = json.loads(gen_path.read_text()) if gen_path.is_file() else None
    except json.JSONDecodeError as exc:
        raise ModelLoadError(f"cannot parse {path.name}: {exc}") from exc
    return parse_model_config(raw, generation)
