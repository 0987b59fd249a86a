"""How many KV slots each pool gets: the HBM regions (one per layer) and the DDR pool, from the
MiB each tier is given.

One function for the engine (its `hbm_mb`, `ddr_mb`, `dense_layers`, `dense_hbm_share` keys) and
the GPU bench (each of its modes as such settings), so that the bench measures pools of the sizes
the engine would build. Pure Python, no torch: the dtype is its element size in bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from h3d.errors import ConfigError


@dataclass(frozen=True, slots=True)
class PoolPlan:
    """HBM slots of each layer's region, and DDR slots (one slot: one layer's K+V of one block)."""

    regions: tuple[int, ...]
    ddr_slots: int

    @property
    def hbm_slots(self) -> int:
        return sum(self.regions)


def slot_bytes(block_size: int, num_kv_heads: int, head_dim: int, elem_bytes: int) -> int:
    """Bytes of one slot: one layer's K and V for a block."""
    return 2 * block_size * num_kv_heads * head_dim * elem_bytes


def region_sizes(
    total: int, num_layers: int, dense_layers: int, dense_share: float | None, max_slots: int | None = None
) -> list[int]:
    """HBM slots per layer region for `total` slots: equal regions (`dense_share` None), or
    `dense_share` of them split among the first `dense_layers` layers and the rest among the
    others; every region gets at least one slot and, with `max_slots`, at most that many (what
    a capped dense region leaves goes to the others)."""

    def fit(slots: int) -> int:
        return max(1, slots) if max_slots is None else min(max_slots, max(1, slots))

    if dense_share is None or not 0 < dense_layers < num_layers:
        return [fit(total // num_layers)] * num_layers
    dense = fit(int(total * dense_share) // dense_layers)
    sparse = fit((total - dense * dense_layers) // (num_layers - dense_layers))
    return [dense] * dense_layers + [sparse] * (num_layers - dense_layers)


def plan_pools(
    hbm_mb: float,
    ddr_mb: float,
    block_size: int,
    num_layers: int,
    num_kv_heads: int,
    head_dim: int,
    elem_bytes: int,
    dense_layers: int = 0,
    dense_hbm_share: float | None = None,
    *,
    max_region_slots: int | None = None,
) -> PoolPlan:
    """The slots `hbm_mb` and `ddr_mb` MiB hold, the HBM ones split into layer regions
    (`region_sizes`); `max_region_slots` caps a region (a run that knows how many blocks it
    writes). Raises ConfigError when HBM holds fewer than one slot per layer."""
    slot = slot_bytes(block_size, num_kv_heads, head_dim, elem_bytes)
    hbm = int(hbm_mb * 2**20) // slot
    if hbm < num_layers:
        raise ConfigError(f"hbm_mb: {hbm_mb} MiB holds fewer than one KV block per layer")
    regions = region_sizes(hbm, num_layers, dense_layers, dense_hbm_share, max_region_slots)
    return PoolPlan(tuple(regions), int(ddr_mb * 2**20) // slot)
