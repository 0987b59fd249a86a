"""The model's shape, read from a Hugging Face `config.json`.

Only what the decoder needs is kept, typed and validated; anything h3d cannot run exactly (another
architecture, sliding-window attention, an unknown RoPE type) is refused here with a clear error
rather than computed wrongly later.
"""

from __future__ import annotations

import enum
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
}
ROPE_TYPES = ("default", "linear", "dynamic", "llama3", "yarn")


class LayerKind(enum.Enum):
    """How a layer's attention reads its KV, which decides what its blocks need from the tiers."""

    FULL = "full"  # every block of the context may be read: tiered, selected by HBF
    SLIDING = "sliding"  # only the last `sliding_window` tokens' blocks (refused until supported)


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
    """Shape of a Llama-family decoder. `qkv_bias` is True for Qwen2; `qk_norm` (Qwen3): an RMSNorm
    over each query and key head (weights per head dimension, shared by the heads) before RoPE."""

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

    @property
    def layer_kinds(self) -> tuple[LayerKind, ...]:
        """Each layer's kind: full attention in every architecture h3d runs (sliding-window
        configurations are refused by `parse_model_config`)."""
        return (LayerKind.FULL,) * self.num_layers

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


def _rope(raw: dict[str, Any], max_pos: int) -> RopeConfig:
    # transformers 4.x writes `rope_theta` + `rope_scaling`; 5.x writes `rope_parameters`.
    params = dict(raw.get("rope_parameters") or {})
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


def parse_model_config(raw: dict[str, Any], generation: dict[str, Any] | None = None) -> ModelConfig:
    """Build a ModelConfig from config.json's dict (and generation_config.json's, if any)."""
    archs = raw.get("architectures") or []
    arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None:
        model_type = raw.get("model_type")
        if model_type in SUPPORTED_ARCHITECTURES.values() and not archs:
            arch = str(model_type)
        else:
            supported = ", ".join(SUPPORTED_ARCHITECTURES)
            raise ModelLoadError(f"unsupported architecture {archs or model_type!r} (supported: {supported})")
    if raw.get("use_sliding_window") or (arch == "mistral" and raw.get("sliding_window")):
        raise ModelLoadError("sliding-window attention is not supported")
    kinds = sorted(set(raw.get("layer_types") or ()) - {"full_attention"})
    if kinds:
        raise ModelLoadError(f"layer types {', '.join(map(str, kinds))} are not supported (supported: full_attention)")
    if raw.get("mlp_bias"):
        raise ModelLoadError("mlp_bias = true is not supported")
    if raw.get("hidden_act", "silu") != "silu":
        raise ModelLoadError(f"unsupported activation {raw.get('hidden_act')!r} (supported: silu)")
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        max_pos = int(raw.get("max_position_embeddings", 2048))
        head_dim = raw.get("head_dim") or hidden // heads
        # generation_config.json's EOS ids win over config.json's, as in transformers.
        eos = _ids((generation or {}).get("eos_token_id")) or _ids(raw.get("eos_token_id"))
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
            rope=_rope(raw, max_pos),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(raw.get("attention_bias", False)),
            o_bias=arch != "qwen2" and bool(raw.get("attention_bias", False)),
            eos_token_ids=eos,
            bos_token_id=raw.get("bos_token_id"),
            qk_norm=arch == "qwen3",
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
