"""`auto` budgets as pure functions: the hardware's figures in, the tiers' MiB and the prefill chunk out."""

from __future__ import annotations

import pytest

from h3d.errors import ConfigError
from h3d.kv.sizing import CPU_BUDGETS, Budgets, Hardware, auto_budgets, plan_pools, region_sizes, window_caps

GIB = 2**30
MIB = 2**20
# A card of 100 GiB with 80 free once the weights are loaded, on a host of 100 GiB (all available).
CARD = Hardware(gpu_total=100 * GIB, gpu_free=80 * GIB, host_total=100 * GIB, host_available=100 * GIB)
SMALL = Hardware(gpu_total=24 * GIB, gpu_free=8 * GIB, host_total=100 * GIB, host_available=100 * GIB)


def sized(hbm="auto", ddr="auto", chunk="auto", hw=CARD, share=0.25, context=65536):  # type: ignore[no-untyped-def]
    return auto_budgets(hbm, ddr, chunk, hw, max_context=context, hidden=4096, elem_bytes=2, digest_share=share)


@pytest.mark.parametrize(
    ("kwargs", "hbm_gib", "ddr_gib", "chunk"),
    [
        # DDR 40 % of the host (40 GiB); a 65,536-token chunk's activations 3 x 65536 x 4096 x 2 B
        # = 1.5 GiB + one 0.25 GiB MLP slice; graphs 1 GiB; margin 5 % of the card (5 GiB); the
        # digests of DDR's 40 GiB at 1/4 (10 GiB): 80 - 1.75 - 1 - 5 - 10 = 62.25 GiB for HBM's
        # KV and its own digests, 62.25 / 1.25 = 49.8 GiB.
        ({}, 49.8, 40.0, 65536),
        # A policy without digests: 80 - 1.75 - 1 - 5 = 72.25 GiB.
        ({"share": 0.0}, 72.25, 40.0, 65536),
        # Less available than 40 % of the host: 80 % of it (16 GiB of 20); its digests 4 GiB:
        # (80 - 1.75 - 1 - 5 - 4) / 1.25 = 54.6 GiB.
        ({"hw": Hardware(100 * GIB, 80 * GIB, 100 * GIB, 20 * GIB)}, 54.6, 16.0, 65536),
        # A set chunk: 3 x 8192 x 4096 x 2 B = 192 MiB + 256 MiB of activations.
        ({"chunk": 8192}, (80 - 0.4375 - 1 - 5 - 10) / 1.25, 40.0, 8192),
        # A small card: the margin is at least 2 GiB (5 % of 24 GiB is 1.2).
        (
            {"hw": Hardware(24 * GIB, 8 * GIB, 100 * GIB, 100 * GIB), "ddr": 4096.0},
            (8 - 1.75 - 1 - 2 - 1) / 1.25,
            4,
            65536,
        ),
        # Set figures are kept; DDR's digests still come out of HBM's auto share.
        ({"ddr": 1024.0}, (80 - 1.75 - 1 - 5 - 0.25) / 1.25, 1.0, 65536),
        ({"hbm": 3072.0, "ddr": 2048.0, "chunk": 512}, 3.0, 2.0, 512),
    ],
)
def test_auto_sizes_the_tiers_from_the_card_and_the_host(
    kwargs: dict, hbm_gib: float, ddr_gib: float, chunk: int
) -> None:
    got = sized(**kwargs)
    assert got.hbm_mb == pytest.approx(hbm_gib * 1024, abs=0.1)
    assert got.ddr_mb == pytest.approx(ddr_gib * 1024, abs=0.1)
    assert got.prefill_chunk_tokens == chunk


def test_auto_prefills_the_longest_context_in_one_chunk_up_to_128k() -> None:
    assert sized(context=32768).prefill_chunk_tokens == 32768
    assert sized(context=1 << 20, share=0.0).prefill_chunk_tokens == 131072  # a 1M-token model: 128K chunks
    assert sized(context=1 << 20, share=0.0).hbm_mb == pytest.approx((80 - 3 - 0.25 - 1 - 5) * 1024, abs=0.1)


def test_auto_says_which_keys_it_sized_and_keeps_the_cpu_figures() -> None:
    assert sized().resolved == ("hbm_mb", "ddr_mb", "prefill_chunk_tokens")
    assert sized(hbm=3072.0).resolved == ("ddr_mb", "prefill_chunk_tokens")
    assert sized(hw=None) == Budgets(
        CPU_BUDGETS.hbm_mb, CPU_BUDGETS.ddr_mb, CPU_BUDGETS.prefill_chunk_tokens, sized().resolved
    )
    assert (CPU_BUDGETS.hbm_mb, CPU_BUDGETS.ddr_mb, CPU_BUDGETS.prefill_chunk_tokens) == (1024.0, 4096.0, 512)
    assert sized(hbm=8.0, ddr=16.0, chunk=64, hw=None) == Budgets(8.0, 16.0, 64, ())


def test_auto_refuses_a_card_left_without_room_for_kv() -> None:
    full = Hardware(gpu_total=24 * GIB, gpu_free=3 * GIB, host_total=100 * GIB, host_available=100 * GIB)
    with pytest.raises(ConfigError, match=r"hbm_mb: auto leaves no GPU memory for KV .* 65536-token prefill chunk"):
        sized(hw=full)


@pytest.mark.parametrize(
    ("total", "share", "whole", "want"),
    [
        # 3 GiB of 128 KiB slots for 32 layers at 128K (4,097 blocks): equal regions would hold 768
        # of them; each dense layer gets its whole context, the 30 others share the rest.
        (24576, None, 4097, [4097, 4097] + [546] * 30),
        (786432, None, 4097, [24576] * 32),  # equal regions already hold the whole context
        (8192, None, 4097, [2048, 2048] + [136] * 30),  # the dense layers take at most half of HBM
        (24576, None, None, [768] * 32),  # no context known (or a policy that reads every block)
        (24576, 0.5, 4097, [6144, 6144] + [409] * 30),  # dense_hbm_share decides when set
    ],
)
def test_dense_layers_get_their_whole_context_where_it_fits(
    total: int, share: float | None, whole: int | None, want: list[int]
) -> None:
    assert region_sizes(total, 32, 2, share, whole=whole) == want
    assert sum(want) <= total


def test_window_layers_get_only_what_their_windows_use() -> None:
    """A sliding-window layer's region is capped at `max_batch` sessions' windows (each: its
    window's blocks, the partial block and one more) plus one prefill chunk; what it leaves goes
    to the full layers equally, and nothing is lost."""
    caps = window_caps([None, 512, 512, None], block_size=16, max_batch=4, chunk_tokens=512)
    assert caps == [None, 4 * (32 + 2) + 32, 4 * (32 + 2) + 32, None]
    plain = plan_pools(64.0, 0.0, 16, 4, 1, 64, 2)
    capped = plan_pools(64.0, 0.0, 16, 4, 1, 64, 2, caps=caps)
    assert plain.regions == (4096,) * 4
    assert capped.regions == (4096 + 3928, 168, 168, 4096 + 3928)
    assert capped.hbm_slots == plain.hbm_slots
    # a cap above the equal share changes nothing
    assert plan_pools(64.0, 0.0, 16, 4, 1, 64, 2, caps=[None, 10**6, None, None]).regions == plain.regions
