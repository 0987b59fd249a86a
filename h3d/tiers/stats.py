"""Counters kept by the tier layer (one instance per engine, written by the tier manager only)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class TierCounters:
    """Cumulative counts since the engine started.

    A *needed* block is one that a step's attention reads. `hbm_hits` were in HBM already;
    `hbm_misses` were read from DDR (`ddr_hits`: in DDR before the step) or staged from the SSD
    archive during it (counted in `ssd_read_count`, which also counts the blocks a step staged and
    its selections then did not read: `hbm_misses <= ddr_hits + ssd_read_count`, equal under
    `exact`). `fetch_bytes` counts the bytes read from below HBM (DDR reads and
    archive reads; a per-head HBF selection reads only its heads' share of a block).
    `hbm_evict_count` counts HBM->DDR demotions, `ddr_evict_count` blocks whose DDR copy was
    dropped for their archive copy, `promote_count` DDR->HBM promotions (HBF).
    """

    hbm_hits: int = 0
    hbm_misses: int = 0
    ddr_hits: int = 0
    ssd_read_count: int = 0
    ssd_write_count: int = 0
    hbm_evict_count: int = 0
    ddr_evict_count: int = 0
    fetch_bytes: int = 0
    peak_hbm_bytes: int = 0
    kv_rebuild_blocks: int = 0  # blocks (all layers) computed again: missing or damaged in the archive
    ssd_write_errors: int = 0  # archive writes that failed (each degrades the SSD tier)
    recompute_evict_count: int = 0  # block copies forgotten while the SSD tier was degraded, recomputed later
    promote_count: int = 0  # blocks copied DDR -> HBM by HBF promotion
    hbm_rebalance_count: int = 0  # blocks moved toward the fair shares of HBM (h3d.tiers.shares), both ways
    window_freed_blocks: int = 0  # sliding-window layers' blocks freed once behind every later token's window
    digests_set_aside: int = 0  # idle sessions' digests taken off the device to make room (`KVCache.admit`)

    @property
    def hbm_hit_rate(self) -> float:
        needed = self.hbm_hits + self.hbm_misses
        return self.hbm_hits / needed if needed else 1.0


@dataclass(slots=True)
class SessionCounters:
    """One session's share of the read counters."""

    hbm_hits: int = 0
    hbm_misses: int = 0
    ssd_read_count: int = 0

    @property
    def hbm_hit_rate(self) -> float:
        needed = self.hbm_hits + self.hbm_misses
        return self.hbm_hits / needed if needed else 1.0


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot for the API, logs and `h3d generate --json`."""

    hbm_hits: int
    hbm_misses: int
    hbm_hit_rate: float
    ddr_hits: int
    ssd_read_count: int
    ssd_write_count: int
    hbm_evict_count: int
    ddr_evict_count: int
    fetch_bytes: int
    hbm_used_bytes: int
    hbm_capacity_bytes: int
    ddr_used_bytes: int
    ddr_capacity_bytes: int
    ssd_used_bytes: int
    peak_hbm_bytes: int
    kv_rebuild_blocks: int
    ssd_write_errors: int
    recompute_evict_count: int
    promote_count: int
    hbm_rebalance_count: int
    window_freed_blocks: int
    ssd_degraded: bool
    dirty_bytes: int = 0  # full blocks without a durable archive copy (what a shutdown flushes)
    write_behind_bytes: int = 0  # KV written behind since start (before compression)
    write_behind_in_flight_bytes: int = 0  # submitted to the archive, not yet durable
    write_behind_lag_s: float = 0.0  # how long the dirty KV has been past write_behind_dirty_mb
    read_ahead_bytes: int = 0  # resumed sessions' KV read back into DDR in the background since start
    read_ahead_in_flight_bytes: int = 0  # being read back now
    window_hbm_bytes: int = 0  # HBM held by sliding-window layers' blocks (part of hbm_used_bytes)
    shared_blocks: int = 0  # blocks (one layer's block each) several sessions point to now
    shared_hbm_saved_bytes: int = 0  # HBM the shared blocks would take again if each session had its own
    shared_ddr_saved_bytes: int = 0  # DDR likewise
    digest_bytes: int = 0  # the sessions' block digests (h3d.hbf.digests), on the compute device
    digest_shared_saved_bytes: int = 0  # what digests shared with their blocks would take again in copies
    digests_set_aside: int = 0  # idle sessions' digests taken off the device for a request's, since start
    copy_up_bytes: int = 0  # KV copied DDR -> HBM since start (promotions, fair shares' fills), `Mover.copied`
    copy_down_bytes: int = 0  # KV copied HBM -> DDR since start (victims, demotions without a DDR copy)

    def as_dict(self) -> dict[str, float]:
        return asdict(self)
