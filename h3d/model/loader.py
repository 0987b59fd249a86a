"""Load a Hugging Face model folder: config, safetensors weights (single file or sharded index);
of a multimodal checkpoint (Gemma 3), the text model only.

Weights are read tensor by tensor with `safetensors.safe_open`, cast to the requested dtype and
placed on the device; q/k/v and gate/up are fused into the matrices `h3d.model.llama` expects.
Missing files, missing tensors and unexpected ones are reported with the folder and the names.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from h3d.errors import ModelLoadError
from h3d.model.config import ModelConfig, load_model_config
from h3d.model.llama import CausalLM
from h3d.model.rope import RotaryEmbedding

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _shards(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc!r}") from exc
        shards = [model_dir / str(name) for name in names]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} lacks weight shards named in its index: {', '.join(missing)}")
        return shards
    raise ModelLoadError(f"{model_dir} has no model.safetensors nor model.safetensors.index.json")


def _tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    for shard in _shards(model_dir):
        try:
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    yield name, f.get_tensor(name)
        except (OSError, RuntimeError) as exc:
            raise ModelLoadError(f"cannot read {shard}: {exc}") from exc


def _fused(raw: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF names -> h3d names (q/k/v and gate/up concatenated)."""
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            parts = [raw.pop(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"]
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat(parts, dim=0)
        gate_up = [raw.pop(f"{p}mlp.{x}_proj.weight") for x in ("gate", "up")]
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat(gate_up, dim=0)
    out.update(raw)
    if cfg.tie_word_embeddings:  # the head reads the embedding matrix
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    # Projections are stored transposed: [out, in] -> [in, out] (see h3d.model.llama.Linear).
    return {
        (k[: -len("weight")] + "weight_t" if k.endswith("proj.weight") or k == "lm_head.weight" else k): (
            v.t() if k.endswith("proj.weight") or k == "lm_head.weight" else v
        )
        for k, v in out.items()
    }


# A multimodal checkpoint's text model (Gemma 3 4B-27B): its names under these prefixes (transformers
# 4 wrote the first, 5 the second) become a causal LM's; the vision tower and the projector are
# not loaded.
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_model(raw: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors of the text model, under a causal LM's names (see `_TEXT_PREFIXES`)."""
    out = {}
    for name, t in raw.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        out[name if prefix is None else _TEXT_PREFIXES[prefix] + name[len(prefix) :]] = t
    return out


def load_model(model_dir: str | Path, dtype: str, device: str | torch.device) -> CausalLM:
    """Build the model for `model_dir` with weights in `dtype` ('fp32'|'bf16'|'fp16') on `device`."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model folder not found: {path}")
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    cfg = load_model_config(path)
    dev = torch.device(device)
    raw = _text_model({name: t for name, t in _tensors(path)})
    if cfg.tie_word_embeddings:
        raw.pop("lm_head.weight", None)
    try:
        state = _fused(raw, cfg)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: weights lack tensor {exc.args[0]!r}") from exc
    with torch.device("meta"):
        model = CausalLM(cfg, torch.device("meta"))
    model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, dev)
    if cfg.rope_local is not None:
        model.rotary_local = RotaryEmbedding(cfg.rope_local, cfg.head_dim, cfg.max_position_embeddings, dev)
    expected = set(model.state_dict().keys())
    missing = sorted(expected - state.keys())
    unexpected = sorted(state.keys() - expected)
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: weights do not fit the config; missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    torch_dtype = DTYPES[dtype]
    state = {k: v.to(device=dev, dtype=torch_dtype).contiguous() for k, v in state.items()}
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval().requires_grad_(False)
