"""How many KV slots each pool gets: the HBM regions (one per layer) and the DDR pool, from the
MiB each tier is given, and how many MiB `auto` gives each tier on the hardware at hand.

One function for the engine (its `hbm_mb`, `ddr_mb`, `dense_layers`, `dense_hbm_share` keys) and
the GPU bench (each of its modes as such settings), so that the bench measures pools of the sizes
the engine would build. Pure Python, no torch: the dtype is its element size in bytes, and the
hardware's figures (free GPU memory, host memory) come in as numbers (`h3d.engine.build` reads
them).

`auto` (the default of `hbm_mb`, `ddr_mb` and `prefill_chunk_tokens`), on CUDA (`auto_budgets`):
- DDR: `DDR_SHARE` of the host's memory, at most `DDR_AVAILABLE_SHARE` of what is available now,
  pinned;
- HBM: the card's free memory once the weights are loaded, less the activations of the largest
  prefill step (`prefill_activation_bytes`), the captured steps' buffers and pool
  (`GRAPHS_BYTES`), a margin (`HBM_MARGIN_SHARE` of the card, at least `HBM_MARGIN_MIN`), and the
  digests of every block the two tiers hold (1 / `digest_tokens` of the KV, for a policy that
  keeps them);
- a prompt in one chunk (`prefill_chunk_tokens` = the longest context, at most `AUTO_CHUNK_MAX`):
  the layer-by-layer path.
On a CPU `auto` keeps the figures that suit a CPU host (`CPU_BUDGETS`).

A sliding-window layer's region is capped at what its windows can use (`window_caps`: its blocks
older than the window are freed); the slots it leaves go to the full-attention layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from h3d.config import AUTO
from h3d.errors import ConfigError

MIB = 2**20
DDR_SHARE = 0.4  # of the host's memory (MemTotal), pinned for the DDR tier
DDR_AVAILABLE_SHARE = 0.8  # and at most this share of what is available (MemAvailable) at start
HBM_MARGIN_SHARE = 0.05  # of the card's memory left free: the allocator's fragmentation, cuBLAS workspaces
HBM_MARGIN_MIN = 2 << 30
GRAPHS_BYTES = 1 << 30  # the captured decode steps' static buffers and shared pool (h3d.engine.graphs)
MLP_SLICE_BYTES = 256 << 20  # a long chunk's MLP runs in slices of about this (CausalLM.slice_rows)
AUTO_CHUNK_MAX = 131072  # `auto`'s prefill chunk on CUDA: the longest context, at most this


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
    total: int,
    num_layers: int,
    dense_layers: int,
    dense_share: float | None,
    max_slots: int | None = None,
    whole: int | None = None,
) -> list[int]:
    """HBM slots per layer region for `total` slots: `dense_share` of them split among the first
    `dense_layers` layers and the rest among the others; with no `dense_share`, each dense layer
    holds `whole` blocks (a whole longest context: a dense layer reads every block at every step,
    a sparse one its window) where equal regions would hold fewer, the dense layers together at
    most half of HBM, else equal regions. Every region gets at least one slot and, with
    `max_slots`, at most that many (what a capped dense region leaves goes to the others)."""

    def fit(slots: int) -> int:
        return max(1, slots) if max_slots is None else min(max_slots, max(1, slots))

    if not 0 < dense_layers < num_layers:
        return [fit(total // num_layers)] * num_layers
    if dense_share is not None:
        dense = fit(int(total * dense_share) // dense_layers)
    elif whole is not None and total // num_layers < whole:
        dense = fit(min(whole, total // (2 * dense_layers)))
    else:
        return [fit(total // num_layers)] * num_layers
    sparse = fit((total - dense * dense_layers) // (num_layers - dense_layers))
    return [dense] * dense_layers + [sparse] * (num_layers - dense_layers)


def window_caps(
    windows: Sequence[int | None], block_size: int, max_batch: int, chunk_tokens: int, keep_tokens: int = 0
) -> list[int | None]:
    """The most HBM slots a sliding-window layer's region can use, per layer (None: a full
    layer): `max_batch` sessions each holding the blocks of its window and `keep_tokens` more
    (`window_keep_tokens`), the partial block and one block more, and one prefill chunk's blocks
    beside (a chunk's blocks are all written before the next chunk frees those its window has
    passed: `BlockManager.drop_behind`)."""
    chunk = -(-chunk_tokens // block_size)
    return [None if w is None else max_batch * (-(-(w + keep_tokens) // block_size) + 2) + chunk for w in windows]


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
    whole_blocks: int | None = None,
    caps: Sequence[int | None] | None = None,
) -> PoolPlan:
    """The slots `hbm_mb` and `ddr_mb` MiB hold, the HBM ones split into layer regions
    (`region_sizes`; `whole_blocks`: the dense layers' whole context); `max_region_slots` caps a
    region (a run that knows how many blocks it writes); `caps`: the most each layer can use
    (`window_caps`: a sliding-window layer's), what a capped region leaves shared equally by the
    uncapped ones. Raises ConfigError when HBM holds fewer than one slot per layer."""
    slot = slot_bytes(block_size, num_kv_heads, head_dim, elem_bytes)
    hbm = int(hbm_mb * 2**20) // slot
    if hbm < num_layers:
        raise ConfigError(f"hbm_mb: {hbm_mb} MiB holds fewer than one KV block per layer")
    regions = region_sizes(hbm, num_layers, dense_layers, dense_hbm_share, max_region_slots, whole_blocks)
    if caps is not None:
        open_ = [i for i, c in enumerate(caps) if c is None]
        spare = sum(max(0, r - c) for r, c in zip(regions, caps, strict=True) if c is not None)
        regions = [r if c is None else max(1, min(r, c)) for r, c in zip(regions, caps, strict=True)]
        for n, i in enumerate(open_):  # the spare slots, equally (the first ones take the remainder)
            more = spare // len(open_) + (n < spare % len(open_))
            regions[i] = regions[i] + more if max_region_slots is None else min(max_region_slots, regions[i] + more)
    return PoolPlan(tuple(regions), int(ddr_mb * 2**20) // slot)


@dataclass(frozen=True, slots=True)
class Budgets:
    """What the tiers and the prefill get: the configured figures, or what `auto` resolved to."""

    hbm_mb: float
    ddr_mb: float
    prefill_chunk_tokens: int
    resolved: tuple[str, ...] = ()  # the keys that were `auto`


CPU_BUDGETS = Budgets(hbm_mb=1024.0, ddr_mb=4096.0, prefill_chunk_tokens=512)


@dataclass(frozen=True, slots=True)
class Hardware:
    """The figures `auto` sizes from (bytes)."""

    gpu_total: int  # the card's memory
    gpu_free: int  # free once the weights are loaded
    host_total: int  # MemTotal
    host_available: int  # MemAvailable


def prefill_activation_bytes(chunk_tokens: int, hidden: int, elem_bytes: int) -> int:
    """Activations of a prefill step of `chunk_tokens` beside the weights and the pools: about
    three hidden-state buffers of the chunk (residual, normed, attention output), and one MLP
    slice (docs/BENCHMARKS.md: 3.1 GB for 131,072 tokens of a Llama-3-8B shape)."""
    return 3 * chunk_tokens * hidden * elem_bytes + MLP_SLICE_BYTES


def auto_ddr_bytes(hw: Hardware) -> int:
    """The DDR tier's pinned bytes: `DDR_SHARE` of the host, at most `DDR_AVAILABLE_SHARE` of
    what is available."""
    return max(0, int(min(DDR_SHARE * hw.host_total, DDR_AVAILABLE_SHARE * hw.host_available)))


def auto_hbm_bytes(hw: Hardware, activations: int, ddr_bytes: int, digest_share: float) -> int:
    """The HBM tier's bytes: the free memory less `activations`, `GRAPHS_BYTES`, the margin and
    the digests of every block HBM and DDR hold (`digest_share` of their bytes: the pool's own
    digests are solved for, h * (1 + share) = what is left). 0 when nothing is left."""
    margin = max(HBM_MARGIN_MIN, int(HBM_MARGIN_SHARE * hw.gpu_total))
    left = hw.gpu_free - activations - GRAPHS_BYTES - margin - int(ddr_bytes * digest_share)
    return max(0, int(left / (1 + digest_share)))


def auto_budgets(
    hbm_mb: float | str,
    ddr_mb: float | str,
    prefill_chunk_tokens: int | str,
    hw: Hardware | None,
    *,
    max_context: int,
    hidden: int,
    elem_bytes: int,
    digest_share: float,
) -> Budgets:
    """The budgets for the configured keys, each `auto` one sized from `hw` (None: a CPU host,
    `CPU_BUDGETS`). A prompt of `max_context` tokens is one chunk on CUDA; HBM is sized after the
    DDR tier (whose digests it holds) and the activations of that chunk. Raises ConfigError when
    `auto` leaves HBM less than one MiB."""
    resolved = tuple(
        k for k, v in (("hbm_mb", hbm_mb), ("ddr_mb", ddr_mb), ("prefill_chunk_tokens", prefill_chunk_tokens))
        if v == AUTO
    )  # fmt: skip
    if hw is None:
        return Budgets(
            CPU_BUDGETS.hbm_mb if hbm_mb == AUTO else float(hbm_mb),
            CPU_BUDGETS.ddr_mb if ddr_mb == AUTO else float(ddr_mb),
            CPU_BUDGETS.prefill_chunk_tokens if prefill_chunk_tokens == AUTO else int(prefill_chunk_tokens),
            resolved,
        )
    chunk = min(max_context, AUTO_CHUNK_MAX) if prefill_chunk_tokens == AUTO else int(prefill_chunk_tokens)
    ddr = auto_ddr_bytes(hw) / MIB if ddr_mb == AUTO else float(ddr_mb)
    if hbm_mb == AUTO:
        activations = prefill_activation_bytes(chunk, hidden, elem_bytes)
        hbm = auto_hbm_bytes(hw, activations, int(ddr * MIB), digest_share) / MIB
        if hbm < 1:
            raise ConfigError(
                f"hbm_mb: auto leaves no GPU memory for KV ({hw.gpu_free / 2**30:.1f} GiB free after the weights, "
                f"{activations / 2**30:.1f} GiB for a {chunk}-token prefill chunk); set hbm_mb, or a smaller "
                "prefill_chunk_tokens or ddr_mb"
            )
    else:
        hbm = float(hbm_mb)
    return Budgets(round(hbm, 1), round(ddr, 1), chunk, resolved)
