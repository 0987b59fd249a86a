"""Convert a GGUF file (llama, qwen2, qwen3, gemma3 architectures) into a Hugging Face folder that
h3d loads.

Weights are read straight from the `gguf` reader and dequantized to fp32 with its numpy codecs;
the tokenizer (and the chat template, from the GGUF metadata) is rebuilt by `transformers`' GGUF
tokenizer converter. Both packages are an optional extra (`pip install h3d[convert]`): the engine
itself never needs them.

llama.cpp stores the Q and K projections of llama-architecture files permuted for its own RoPE
layout (pairs interleaved); h3d, like `transformers`, rotates halves, so the permutation is undone
here (for llama files only: the others are stored unpermuted). llama.cpp stores Gemma's norm
weights as 1 + w (its norms multiply by the weight); transformers' Gemma adds the 1 itself, so it
is taken off here, as transformers' own GGUF loader does. Gemma 3's settings that a GGUF file does
not carry (`query_pre_attn_scalar`, the local RoPE base, the layer pattern) take transformers'
defaults, as its GGUF loader does too. The output is `config.json`, `generation_config.json`, `model.safetensors`,
`tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja` (where the file has one).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from h3d.errors import ModelLoadError

_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
# Per architecture, where its names differ: Gemma's `ffn_norm` is the norm before the MLP, and it has
# norms after attention and after the MLP; Qwen3 and Gemma 3 have q/k norms.
_ARCH_LAYER_NAMES = {
    "qwen3": {
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
    },
    "gemma3": {
        "attn_q_norm.weight": "self_attn.q_norm.weight",
        "attn_k_norm.weight": "self_attn.k_norm.weight",
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "ffn_norm.weight": "pre_feedforward_layernorm.weight",
        "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    },
}
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ARCHITECTURES = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma3": "Gemma3ForCausalLM",
}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: [heads, 2, half, in] <- [heads, half, 2, in]."""
    rows = w.shape[0]
    half = rows // n_heads // 2
    return w.reshape(n_heads, half, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _hf_name(name: str, arch: str = "llama") -> str:
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    names = {**_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})}
    parts = name.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in names:
        return f"model.layers.{parts[1]}.{names[parts[2]]}"
    raise ModelLoadError(f"unexpected tensor {name!r} in GGUF file")


def _field(reader: Any, key: str, default: Any = None) -> Any:
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _hf_config(reader: Any, arch: str, tied: bool) -> dict[str, Any]:
    p = f"{arch}."
    n_heads = int(_field(reader, p + "attention.head_count"))
    hidden = int(_field(reader, p + "embedding_length"))
    tokens = _field(reader, "tokenizer.ggml.tokens") or []
    config: dict[str, Any] = {
        "architectures": [_ARCHITECTURES[arch]],
        "model_type": arch,
        "hidden_size": hidden,
        "intermediate_size": int(_field(reader, p + "feed_forward_length")),
        "num_hidden_layers": int(_field(reader, p + "block_count")),
        "num_attention_heads": n_heads,
        "num_key_value_heads": int(_field(reader, p + "attention.head_count_kv", n_heads)),
        "head_dim": int(_field(reader, p + "rope.dimension_count", hidden // n_heads)),
        "max_position_embeddings": int(_field(reader, p + "context_length")),
        "rms_norm_eps": float(_field(reader, p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(_field(reader, p + "rope.freq_base", 10000.0)),
        "vocab_size": int(_field(reader, p + "vocab_size", len(tokens))),
        "tie_word_embeddings": tied,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"),
        "pad_token_id": _field(reader, "tokenizer.ggml.padding_token_id"),
    }
    if arch == "llama":
        config["attention_bias"] = False
        config["mlp_bias"] = False
    if arch == "qwen3":
        config["head_dim"] = int(_field(reader, p + "attention.key_length", config["head_dim"]))
    if arch == "gemma3":
        config.update(
            model_type="gemma3_text",
            head_dim=int(_field(reader, p + "attention.key_length", 256)),
            hidden_activation="gelu_pytorch_tanh",
            sliding_window=int(_field(reader, p + "attention.sliding_window", 4096)),
            query_pre_attn_scalar=256,
            rope_local_base_freq=10_000.0,
            sliding_window_pattern=6,
        )
        del config["hidden_act"]
    return config


def convert_gguf(gguf_file: str | os.PathLike[str], out_dir: str | os.PathLike[str]) -> Path:
    """Write an HF folder for `gguf_file` into `out_dir` (atomically: a temp folder renamed)."""
    try:
        from gguf import GGUFReader
        from gguf.quants import dequantize
        from safetensors.numpy import save_file
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelLoadError("convert-gguf needs the 'convert' extra: pip install 'h3d[convert]'") from exc

    src = Path(gguf_file)
    if not src.is_file():
        raise ModelLoadError(f"GGUF file not found: {src}")
    out = Path(out_dir)
    try:
        reader = GGUFReader(str(src))
    except Exception as exc:
        raise ModelLoadError(f"{src} is not a readable GGUF file: {exc}") from exc
    arch = str(_field(reader, "general.architecture", ""))
    if arch not in _ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} (supported: {', '.join(_ARCHITECTURES)})")

    n_heads = int(_field(reader, f"{arch}.attention.head_count"))
    n_kv = int(_field(reader, f"{arch}.attention.head_count_kv", n_heads))
    tensors: dict[str, np.ndarray] = {}
    for t in reader.tensors:
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if arch == "llama" and t.name.endswith("attn_q.weight"):
            w = _unpermute(w, n_heads)
        elif arch == "llama" and t.name.endswith("attn_k.weight"):
            w = _unpermute(w, n_kv)
        elif arch == "gemma3" and t.name.endswith("norm.weight"):
            w = w - 1.0  # llama.cpp's 1 + w back to Gemma's w
        tensors[_hf_name(t.name, arch)] = np.ascontiguousarray(w)
    tied = "lm_head.weight" not in tensors
    config = _hf_config(reader, arch, tied)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    tmp.chmod(0o755)  # mkdtemp makes it private; a model folder is for every local reader
    try:
        save_file(tensors, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        _write_tokenizer(src, tmp)
        if out.exists():
            shutil.rmtree(out)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _write_tokenizer(src: Path, out: Path) -> None:
    try:
        from transformers import AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ModelLoadError("convert-gguf needs the 'convert' extra: pip install 'h3d[convert]'") from exc
    tok = AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    tok.save_pretrained(str(out))
