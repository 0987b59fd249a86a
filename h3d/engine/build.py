"""Building the engine's model runner from its config: the memory budgets of the KV tiers and
the SSD archive, opened under the identity of the cache it may hold.

The budgets are MiB in the config and slots of one KV block here (`h3d.kv.sizing.plan_pools`,
which the GPU benchmark plans with too); HBM must hold at least one block per layer. The
archive's `CacheIdentity` (model fingerprint, dtype, block size, KV shape) is what keeps KV
written for another model or layout from being read (the archive refuses to open under another
identity: `h3d.tiers.identity`).
"""

from __future__ import annotations

from pathlib import Path

from h3d.config import EngineConfig
from h3d.engine.runner import ModelRunner
from h3d.kv.sizing import plan_pools
from h3d.model.config import ModelConfig
from h3d.model.fingerprint import model_fingerprint
from h3d.model.llama import CausalLM
from h3d.tiers.archive import Archive
from h3d.tiers.codecs import Codec
from h3d.tiers.identity import CacheIdentity


def build_runner(config: EngineConfig, model: CausalLM) -> ModelRunner:
    """The runner of `model` within `config`'s HBM and DDR budgets, over its archive (if any)."""
    mc = model.config
    pools = plan_pools(
        config.hbm_mb, config.ddr_mb, config.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim,
        model.lm_head.weight_t.dtype.itemsize, config.dense_layers, config.dense_hbm_share,
    )  # fmt: skip
    runner = ModelRunner(
        model,
        pools.regions,
        pools.ddr_slots,
        config.block_size,
        archive=open_archive(config, mc),
        high_watermark=config.ddr_high_watermark,
        check_invariants=config.check_invariants,
        hbf=config.hbf,
        promote_mb_per_step=config.promote_mb_per_step,
        ssd_retry_interval_s=config.ssd_retry_interval_s,
    )
    return runner


def open_archive(cfg: EngineConfig, mc: ModelConfig) -> Archive | None:
    """The SSD archive of `cfg.ssd_path` for a model of config `mc` (None: no SSD tier)."""
    if cfg.ssd_path is None:
        return None
    identity = CacheIdentity(
        fingerprint=model_fingerprint(cfg.model),
        dtype=cfg.resolved_dtype,
        block_size=cfg.block_size,
        num_kv_heads=mc.num_kv_heads,
        head_dim=mc.head_dim,
    )
    return Archive(Path(cfg.ssd_path), identity, Codec(cfg.ssd_codec), frozenset(cfg.quantize_skip_layers))
