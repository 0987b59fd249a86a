"""Every configuration key of h3d, its default and its check, in one place.

`EngineConfig` is one frozen tree, validated when built (`EngineConfig.build`); a bad value raises
`ConfigError` naming the key. The CLI exposes each key as a flag of the same name in kebab case
(`block_size` <-> `--block-size`). h3d/keys.py says what each key means; the flags' help and
docs/OPERATIONS.md's key tables are written from it.

Nothing here imports torch: `h3d generate` sets the OpenMP environment (`cpu_threads`) from this
configuration before torch loads.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import TYPE_CHECKING, Any

from h3d.errors import ConfigError

if TYPE_CHECKING:
    from h3d.hbf.policy import HbfConfig

AUTO = "auto"  # the value of a key sized from the hardware (`AUTO_KEYS`)
AUTO_KEYS = ("prefill_chunk_tokens", "hbm_mb", "ddr_mb")
OR_AUTO = (*AUTO_KEYS, "ssd_capacity_mb")  # keys that take a number or `auto`
DEVICES = ("auto", "cpu", "cuda")
DTYPES = ("fp32", "bf16", "fp16")
POLICIES = ("attention_entropy", "exact", "fixed", "layerwise")
SHARE_PREFIXES = ("owner", "all", "off")
DDR_MEMORY = ("auto", "mapped", "registered")  # how the DDR pool is pinned on CUDA (h3d.kv.pool)
SSD_CODECS = ("raw-zstd", "int8-delta-zstd")


@dataclass(frozen=True, slots=True)
class SamplingDefaults:
    """A request's sampling parameters when it names none. temperature 0 is greedy."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int = 256


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """Engine keys. `device` "auto" means CUDA where torch sees a GPU, else the CPU; `dtype` None
    means fp32 on the CPU and bf16 on CUDA."""

    model: str = ""
    device: str = "auto"
    dtype: str | None = None
    cpu_threads: int | None = None  # torch's CPU threads; None or 0: auto (h3d.engine.threads)
    block_size: int = 32
    # `auto`: sized from the hardware when the engine starts (h3d.kv.sizing.auto_budgets)
    prefill_chunk_tokens: int | str = AUTO
    prefill_step_ms: float = 150.0  # a long chunk's forward runs this long between decode steps (h3d.engine.prefill)
    hbm_mb: float | str = AUTO
    ddr_mb: float | str = AUTO
    ddr_memory: str = "auto"  # how the DDR pool is pinned on CUDA: mapped | registered | auto (h3d.kv.pool)
    ssd_path: str | None = None
    ssd_codec: str = "raw-zstd"
    quantize_skip_layers: tuple[int, ...] = ()
    ddr_high_watermark: float = 0.85
    promote_mb_per_step: float = 64.0  # HBF promotions DDR -> HBM per step, all sessions together
    rebalance_mb_per_step: float = 1024.0  # blocks moved toward the fair shares of HBM per step (h3d.tiers.shares)
    # live archive records beyond this: closed sessions' KV evicted; `auto`: the file system's free space
    # at start less a margin (h3d.engine.build.ssd_capacity)
    ssd_capacity_mb: float | str = AUTO
    write_behind: bool = True  # full blocks archived in the background (h3d.tiers.writebehind)
    write_behind_dirty_mb: float = 1024.0  # KV left not archived; past it the oldest is written behind
    read_ahead_at_start: bool = True  # restored sessions' next-step and hot blocks read back into DDR at start
    graphs_before_ready: bool = False  # the warm set of decode graphs captured before ready (else while idle after)
    ssd_retry_interval_s: float = 10.0  # a degraded SSD tier (full disk, I/O error) is tried again this often
    policy: str = "attention_entropy"
    window_tokens: int = 2048
    window_min_tokens: int = 512
    window_max_tokens: int = 8192
    sink_blocks: int = 1
    recent_tokens: int = 256
    dense_layers: int = 2
    # Share of the HBM pool for the dense layers' regions together (unset: every layer's region equal)
    dense_hbm_share: float | None = None
    digest_tokens: int = 8  # tokens per key digest (min/max); digests cost 1/digest_tokens of the KV
    anchor_share: float = 0.5  # attention_entropy: share of the window past sinks + recent for prompt anchors
    # Calibrated on the retrieval benchmark (docs/BENCHMARKS.md, "Calibrating the entropy thresholds").
    entropy_shrink_below: float = 3.0
    entropy_grow_above: float = 3.3
    max_batch_size: int = 64
    # A new session shares the KV blocks of another with the same first blocks of tokens: among one owner's
    # sessions, everyone's, or never (h3d.engine.prefixes); finished request sessions kept for it
    share_prefixes: str = "owner"
    prefix_cache_sessions: int = 16
    # A sliding-window layer frees its blocks this many tokens past its window (a rewind that short keeps the KV)
    window_keep_tokens: int = 512
    max_context_tokens: int | None = None
    session_log_path: str | None = None  # token logs: sessions survive restarts (h3d serve sets it)
    fsync_interval_ms: float = 50.0
    sampling: SamplingDefaults = field(default_factory=SamplingDefaults)
    check_invariants: bool = False

    @property
    def hbf(self) -> HbfConfig:
        from h3d.hbf.policy import HbfConfig  # imports torch

        return HbfConfig(
            policy=self.policy,
            window_tokens=self.window_tokens,
            window_min_tokens=self.window_min_tokens,
            window_max_tokens=self.window_max_tokens,
            sink_blocks=self.sink_blocks,
            recent_tokens=self.recent_tokens,
            dense_layers=self.dense_layers,
            digest_tokens=self.digest_tokens,
            anchor_share=self.anchor_share,
            entropy_shrink_below=self.entropy_shrink_below,
            entropy_grow_above=self.entropy_grow_above,
        )

    @property
    def resolved_device(self) -> str:
        """`device` with "auto" resolved: "cuda" where torch sees a GPU, else "cpu"."""
        if self.device != "auto":
            return self.device
        import torch  # here only: the configuration is read before the model's modules load

        return "cuda" if torch.cuda.is_available() else "cpu"

    @property
    def resolved_dtype(self) -> str:
        return self.dtype or ("fp32" if self.resolved_device == "cpu" else "bf16")

    def validate(self) -> EngineConfig:
        if not self.model:
            raise ConfigError("model: a model folder is required")
        _choice("device", self.device.split(":")[0], DEVICES)
        if self.dtype is not None:
            _choice("dtype", self.dtype, DTYPES)
        if self.cpu_threads is not None and self.cpu_threads < 0:
            raise ConfigError(
                f"cpu_threads: must be >= 1 (0 or unset: the cores this process may run on), got {self.cpu_threads}"
            )
        _positive("block_size", self.block_size)
        for key in OR_AUTO:
            value = getattr(self, key)
            if isinstance(value, str) and value != AUTO:
                raise ConfigError(f"{key}: expected a number or 'auto', got {value!r}")
        if self.prefill_chunk_tokens != AUTO:
            _positive("prefill_chunk_tokens", self.prefill_chunk_tokens)  # type: ignore[arg-type]
        if self.hbm_mb != AUTO:
            _positive("hbm_mb", self.hbm_mb)  # type: ignore[arg-type]
        if self.ddr_mb != AUTO and not self.ddr_mb >= 0:  # type: ignore[operator]
            raise ConfigError(f"ddr_mb: must be >= 0, got {self.ddr_mb}")
        _choice("ssd_codec", self.ssd_codec, SSD_CODECS)
        _choice("ddr_memory", self.ddr_memory, DDR_MEMORY)
        _choice("policy", self.policy, POLICIES)
        _choice("share_prefixes", self.share_prefixes, SHARE_PREFIXES)
        if self.prefix_cache_sessions < 0:
            raise ConfigError(f"prefix_cache_sessions must be >= 0, got {self.prefix_cache_sessions}")
        if self.ssd_capacity_mb != AUTO and not self.ssd_capacity_mb > 0:  # type: ignore[operator]
            raise ConfigError(f"ssd_capacity_mb: must be > 0 or 'auto', got {self.ssd_capacity_mb}")
        if not self.write_behind_dirty_mb >= 0:
            raise ConfigError(f"write_behind_dirty_mb: must be >= 0, got {self.write_behind_dirty_mb}")
        if not self.ssd_retry_interval_s > 0:
            raise ConfigError(f"ssd_retry_interval_s: must be > 0, got {self.ssd_retry_interval_s}")
        _positive("promote_mb_per_step", self.promote_mb_per_step)
        _positive("rebalance_mb_per_step", self.rebalance_mb_per_step)
        _positive("prefill_step_ms", self.prefill_step_ms)
        if not 0 < self.ddr_high_watermark <= 1:
            raise ConfigError(f"ddr_high_watermark: must be in (0, 1], got {self.ddr_high_watermark}")
        for key in ("window_tokens", "window_min_tokens", "window_max_tokens", "recent_tokens"):
            _positive(key, getattr(self, key))
        if not self.window_min_tokens <= self.window_tokens <= self.window_max_tokens:
            raise ConfigError("window_tokens: must lie within [window_min_tokens, window_max_tokens]")
        if self.sink_blocks < 0 or self.dense_layers < 0:
            raise ConfigError("sink_blocks, dense_layers: must be >= 0")
        if self.dense_hbm_share is not None and not 0 < self.dense_hbm_share < 1:
            raise ConfigError(f"dense_hbm_share: must be in (0, 1), got {self.dense_hbm_share}")
        _positive("digest_tokens", self.digest_tokens)
        if self.digest_tokens < self.block_size and self.block_size % self.digest_tokens:
            raise ConfigError(
                f"digest_tokens: must divide block_size ({self.block_size}) or cover a whole block, "
                f"got {self.digest_tokens}"
            )
        if not 0 <= self.anchor_share <= 1:
            raise ConfigError(f"anchor_share: must be in [0, 1], got {self.anchor_share}")
        if self.entropy_shrink_below > self.entropy_grow_above:
            raise ConfigError("entropy_shrink_below: must be <= entropy_grow_above")
        if any(layer < 0 for layer in self.quantize_skip_layers):
            raise ConfigError("quantize_skip_layers: layer indices must be >= 0")
        _positive("max_batch_size", self.max_batch_size)
        if self.window_keep_tokens < 0:
            raise ConfigError(f"window_keep_tokens: must be >= 0, got {self.window_keep_tokens}")
        if not self.fsync_interval_ms >= 0:
            raise ConfigError(f"fsync_interval_ms: must be >= 0, got {self.fsync_interval_ms}")
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
