"""Every configuration key of h3d, its default and its check, in one place.

`EngineConfig` is one frozen tree, validated when built (`EngineConfig.build`); a bad value raises
`ConfigError` naming the key. The CLI exposes each key as a flag of the same name in kebab case
(`block_size` <-> `--block-size`). docs/OPERATIONS.md documents every key.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any

from h3d.errors import ConfigError

DEVICES = ("cpu", "cuda")
DTYPES = ("fp32", "bf16", "fp16")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """A request's sampling parameters when it names none. temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine keys. `dtype` None means fp32 on the CPU and bf16 on CUDA."""

    model: str = ""
    device: str = "cpu"
    dtype: str | None = None
    block_size: int = 32
    prefill_chunk_tokens: int = 512
    hbm_mb: float = 1024.0
    max_batch_size: int = 64
    max_context_tokens: int | None = None
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    check_invariants: bool = False

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or ("fp32" if self.device == "cpu" else "bf16")

    def validate(self) -> EngineConfig:
        if not self.model:
            raise ConfigError("model: a model folder is required")
        _choice("device", self.device.split(":")[0], DEVICES)
        if self.dtype is not None:
            _choice("dtype", self.dtype, DTYPES)
        _positive("block_size", self.block_size)
        _positive("prefill_chunk_tokens", self.prefill_chunk_tokens)
        _positive("hbm_mb", self.hbm_mb)
        _positive("max_batch_size", self.max_batch_size)
        if self.max_context_tokens is not None:
            _positive("max_context_tokens", self.max_context_tokens)
        if self.sampling.temperature < 0:
            raise ConfigError("sampling.temperature: must be >= 0")
        if not 0 < self.sampling.top_p <= 1:
            raise ConfigError("sampling.top_p: must be in (0, 1]")
        return self

    @classmethod
    def build(cls, **overrides: Any) -> EngineConfig:
        """Defaults overridden by `overrides` (None values ignored), validated."""
        known = {f.name for f in fields(cls)}
        unknown = set(overrides) - known
        if unknown:
            raise ConfigError(f"{sorted(unknown)[0]}: unknown configuration key")
        return replace(cls(), **{k: v for k, v in overrides.items() if v is not None}).validate()


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}: {value!r} is not one of {', '.join(allowed)}")


def _positive(key: str, value: float) -> None:
    if not value > 0:
        raise ConfigError(f"{key}: must be > 0, got {value}")
