"""Building the engine's model runner from its config: the memory budgets of the KV tiers and
the SSD archive, opened under the identity of the cache it may hold.

The budgets are MiB in the config (or `auto`: sized here from the card's free memory and the
host's, `h3d.kv.sizing.auto_budgets`) and slots of one KV block in the pools
(`h3d.kv.sizing.plan_pools`, which the GPU benchmark plans with too); HBM must hold at least one
block per layer. The
archive's `CacheIdentity` (model fingerprint, dtype, block size, KV shape) is what keeps KV
written for another model or layout from being read (the archive refuses to open under another
identity: `h3d.tiers.identity`).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from h3d.config import AUTO, EngineConfig
from h3d.engine.runner import ModelRunner
from h3d.hbf.digests import digest_layers
from h3d.hbf.policy import policy_named
from h3d.kv.sizing import Budgets, Hardware, auto_budgets, plan_pools, window_caps
from h3d.model.config import ModelConfig
from h3d.model.fingerprint import model_fingerprint
from h3d.model.llama import CausalLM
from h3d.tiers.archive import Archive
from h3d.tiers.codecs import Codec
from h3d.tiers.digestfile import folder_bytes, snapshots_folder
from h3d.tiers.identity import CacheIdentity


def host_memory() -> tuple[int, int]:
    """(MemTotal, MemAvailable) of this host in bytes (Linux's /proc/meminfo; else the physical
    pages, both)."""
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines() if ":" in line)
        return int(info["MemTotal"].split()[0]) * 1024, int(info["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        import os

        total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        return total, total


def budgets(config: EngineConfig, model: CausalLM, max_context: int, gpu_free: int | None = None) -> Budgets:
    """`config`'s budgets, its `auto` keys sized from the hardware: on CUDA the card's free memory
    with the weights allocated (`gpu_free`, measured before they are read: `Weights.gpu_free`;
    None: now) and the host's memory; on a CPU the CPU's figures."""
    device = model.lm_head.weight_t.device
    hw = None
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        free = free if gpu_free is None else gpu_free
        host_total, host_available = host_memory()
        hw = Hardware(gpu_total=total, gpu_free=free, host_total=host_total, host_available=host_available)
    keeps = policy_named(config.policy).keeps_digests
    # Digests for the full-attention layers past the dense ones: their share of the full layers'
    # KV (which is nearly all of it: a sliding layer holds its window).
    full = [i for i, w in enumerate(model.config.windows) if w is None]
    kept = len(digest_layers(full, config.dense_layers)) / max(1, len(full))
    return auto_budgets(
        config.hbm_mb, config.ddr_mb, config.prefill_chunk_tokens, hw, max_context=max_context,
        hidden=model.config.hidden_size, elem_bytes=model.lm_head.weight_t.dtype.itemsize,
        digest_share=kept / config.digest_tokens if keeps else 0.0,
    )  # fmt: skip


def build_runner(config: EngineConfig, model: CausalLM, sizes: Budgets, max_context: int | None = None) -> ModelRunner:
    """The runner of `model` within the HBM and DDR budgets `sizes`, over `config`'s archive (if
    any). Under a selecting policy the dense layers' regions hold a whole `max_context` where HBM
    allows (`h3d.kv.sizing.region_sizes`)."""
    mc = model.config
    selects = policy_named(config.policy).selects and config.dense_layers > 0
    whole = -(-max_context // config.block_size) if max_context and selects else None
    pools = plan_pools(
        sizes.hbm_mb, sizes.ddr_mb, config.block_size, mc.num_layers, mc.num_kv_heads, mc.head_dim,
        model.lm_head.weight_t.dtype.itemsize, config.dense_layers, config.dense_hbm_share, whole_blocks=whole,
        caps=window_caps(
            mc.windows, config.block_size, config.max_batch_size, sizes.prefill_chunk_tokens, config.window_keep_tokens
        ),
    )  # fmt: skip
    archive = open_archive(config, mc)
    runner = ModelRunner(
        model,
        pools.regions,
        pools.ddr_slots,
        config.block_size,
        archive=archive,
        high_watermark=config.ddr_high_watermark,
        check_invariants=config.check_invariants,
        hbf=config.hbf,
        promote_mb_per_step=config.promote_mb_per_step,
        rebalance_mb_per_step=config.rebalance_mb_per_step,
        ssd_retry_interval_s=config.ssd_retry_interval_s,
        write_behind_dirty_mb=config.write_behind_dirty_mb if config.write_behind else None,
        ssd_capacity=ssd_capacity(config, archive),
        window_keep_tokens=config.window_keep_tokens,
        ddr_memory=config.ddr_memory,
    )
    return runner


SSD_MARGIN_SHARE = 0.05  # `ssd_capacity_mb = auto` leaves this share of the archive's file system free,
SSD_MARGIN_MIN = 1 << 30  # and at least this much


def ssd_capacity(config: EngineConfig, archive: Archive | None) -> int | None:
    """The archive's capacity in bytes of live records and digest snapshots
    (`TierManager.ssd_used`): `ssd_capacity_mb`, or with `auto` the free space of its file system
    at start plus what the archive and its snapshots take there already, less a margin
    (`SSD_MARGIN_SHARE` of the file system, at least `SSD_MARGIN_MIN`), so that write-behind never
    fills the disk. None without an archive."""
    if archive is None:
        return None
    if config.ssd_capacity_mb != AUTO:
        return int(float(config.ssd_capacity_mb) * 2**20)
    fs = os.statvfs(archive.path)
    margin = max(SSD_MARGIN_MIN, int(SSD_MARGIN_SHARE * fs.f_blocks * fs.f_frsize))
    snapshots = sum(folder_bytes(snapshots_folder(archive.path)).values())
    return max(0, fs.f_bavail * fs.f_frsize + archive.disk_bytes() + snapshots - margin)


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
