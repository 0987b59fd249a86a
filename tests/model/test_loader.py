"""The parallel weight reader (`h3d.model.loader.fill_weights`) against safetensors' own reader:
every parameter equal, whatever the pieces, threads and read-ahead; broken shards refused with
their names, never a traceback."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.errors import ModelLoadError
from h3d.model.config import ModelConfig, load_model_config
from h3d.model.loader import Stored, _Reader, _recipes, _stored, _text_model, fill_weights, load_model, start_model


def _oracle(folder: Path, cfg: ModelConfig, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The h3d parameters from `safetensors.torch.load_file`: q/k/v and gate/up concatenated,
    projections transposed, everything cast."""
    raw = load_file(folder / "model.safetensors")
    out: dict[str, torch.Tensor] = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[f"{p}self_attn.qkv_proj.{kind}"] = torch.cat([raw.pop(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv"])
        out[f"{p}mlp.gate_up_proj.weight"] = torch.cat([raw.pop(f"{p}mlp.{x}_proj.weight") for x in ("gate", "up")])
    out.update(raw)
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return {
        (k[: -len("weight")] + "weight_t" if k.endswith("proj.weight") or k == "lm_head.weight" else k): (
            v.t() if k.endswith("proj.weight") or k == "lm_head.weight" else v
        ).to(dtype)
        for k, v in out.items()
    }


@pytest.mark.parametrize("name", ["qwen2_gqa4_untied", "llama_gqa4_tied"])
@pytest.mark.parametrize(("piece", "threads", "ahead"), [(7, 3, 0), (1 << 20, 1, 1 << 30), (4096, 4, 5000)])
def test_the_weights_read_equal_safetensors_own(
    checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch, name: str, piece: int, threads: int, ahead: int
) -> None:
    """Every parameter equal to the oracle's, and every stored tensor read once (a tied head is
    copied from the embedding on the device)."""
    reads: list[str] = []
    read = _Reader.read

    def spy(self: _Reader, stored: Stored, into: torch.Tensor) -> list[Any]:
        reads.append(f"{stored.shard.name}@{stored.offset}")
        return read(self, stored, into)

    monkeypatch.setattr(_Reader, "read", spy)
    folder = checkpoint(name)
    cfg = load_model_config(folder)
    stored = _text_model(_stored(folder))
    if cfg.tie_word_embeddings:
        stored.pop("lm_head.weight", None)
    recipes = _recipes(stored, cfg)
    for dtype in (torch.float32, torch.bfloat16):
        want = _oracle(folder, cfg, dtype)
        got = {k: torch.full(want[k].shape, float("nan"), dtype=dtype) for k in recipes}
        reads.clear()
        fill_weights(recipes, got, threads=threads, piece=piece, ahead=ahead)
        assert sorted(reads) == sorted(f"{t.shard.name}@{t.offset}" for t in stored.values())
        assert got.keys() == want.keys()
        for k, t in got.items():
            assert t.dtype == dtype and t.is_contiguous(), k
            assert torch.equal(t, want[k]), k
    model = dict(load_model(folder, "fp32", "cpu").state_dict())
    want = _oracle(folder, cfg, torch.float32)
    assert all(torch.equal(model[k], v) for k, v in want.items())


def _error(folder: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        load_model(folder, "fp32", "cpu")
    return str(info.value)


def test_broken_shards_are_refused_with_their_names(model_copy: Callable[[str], Path]) -> None:
    folder = model_copy("llama_mha_untied")
    shard = folder / "model.safetensors"
    data = shard.read_bytes()
    shard.write_bytes(data[:-10])  # cut short: the last tensor lies past the end
    message = _error(folder)
    assert str(shard) in message and "lies at bytes" in message
    shard.write_bytes(b"\xff" * 64)  # no header
    assert "not a safetensors file" in _error(folder)
    shard.write_bytes(b"")
    assert "not a safetensors file" in _error(folder)
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    name = next(k for k in header if k != "__metadata__")
    for broken in ({**header[name], "dtype": "Q7"}, {**header[name], "shape": [3]}, "nothing"):
        text = json.dumps({**header, name: broken}).encode()
        shard.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
        assert name in _error(folder)
    text = b"[1, 2]"
    shard.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + n :])
    assert "not a table of tensors" in _error(folder)


def test_weights_of_another_shape_than_the_config_says_are_refused(model_copy: Callable[[str], Path]) -> None:
    folder = model_copy("llama_mha_untied")
    config = json.loads((folder / "config.json").read_text())
    config["intermediate_size"] += 8
    (folder / "config.json").write_text(json.dumps(config))
    message = _error(folder)
    assert "do not fit the config's shapes" in message and "gate_up_proj" in message


def test_weights_read_in_the_background_fail_at_wait_with_the_shard_named(
    checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`start_model` returns with the parameters allocated and the reading under way; a read that
    fails midway (an I/O error) is raised by `Weights.wait` as a ModelLoadError naming the file,
    and by an engine's start the same way."""
    folder = checkpoint("llama_mha_untied")
    model, weights = start_model(folder, "fp32", "cpu")
    weights.wait()
    want = _oracle(folder, load_model_config(folder), torch.float32)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in want.items()) and weights.seconds > 0

    def failing(fd: int, buf: object, stored: Stored, at: int) -> None:
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(_Reader, "_fill", staticmethod(failing))
    _, weights = start_model(folder, "fp32", "cpu")
    with pytest.raises(ModelLoadError, match=r"cannot read .*model\.safetensors.*Input/output error"):
        weights.wait()
    with pytest.raises(ModelLoadError, match="Input/output error"):
        Engine(EngineConfig.build(model=str(folder)))


def test_a_start_that_fails_beside_the_reading_raises_its_own_error_once_the_reading_ended(
    checkpoint: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    import threading

    from h3d.engine import engine as engine_module

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("the pools could not be made")

    monkeypatch.setattr(engine_module, "build_runner", broken)
    with pytest.raises(RuntimeError, match="the pools could not be made"):
        Engine(EngineConfig.build(model=str(checkpoint("llama_mha_untied"))))
    assert not [t for t in threading.enumerate() if t.name == "h3d-weights"]  # joined, not left writing
