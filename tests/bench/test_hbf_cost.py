"""`python -m h3d.bench.hbf_cost`'s planning runs for each shape: a latency per step after the
first 100, each the promotion's planning (the Llama-3-8B shape hands the picks over counted)."""

from __future__ import annotations

import pytest

from h3d.bench import hbf_cost


@pytest.mark.parametrize("shape", sorted(hbf_cost.SHAPES))
def test_planning_times_each_step_after_the_first_hundred(shape: str) -> None:
    lat = hbf_cost.planning(4096, 130, sessions=2, shape=shape).latencies_us
    assert len(lat) == 30 and all(0 < x < 5e6 for x in lat)


def test_a_wide_selection_hands_over_more_pairs() -> None:
    """`--picks` and `--drift` reach the selection: wide picks that all move each step (what a
    model of random weights selects) hand the promotion more pairs than the default's."""
    counts = []
    for picks, drift in ((hbf_cost.PICKS, hbf_cost.DRIFT), (186, 1.0)):
        planned = hbf_cost.planning(32768, 130, sessions=1, shape="llama3-8b", picks_per_head=picks, drift=drift)
        assert len(planned.latencies_us) == 30
        counts.append(planned.keys_per_step)
    # 32 layers x (9 base blocks + the union of 8 heads' 55 picks of 1,024 blocks: about 370)
    assert 32 * (9 + 55) < counts[0] < 32 * (9 + 8 * 55), counts
    assert counts[1] > 2 * counts[0], counts


def test_promotions_are_capped_as_the_engine_caps_them() -> None:
    """The pools are one element wide, but a step promotes at most the default
    `promote_mb_per_step` of the shape's real blocks (64 MiB of 128 KiB blocks: 512), as a
    `many` step does; picks that all move every step would promote more."""
    planned = hbf_cost.planning(32768, 130, sessions=4, shape="llama3-8b", picks_per_head=186, drift=1.0)
    assert planned.promotion_cap == 512
    assert 0.9 * 512 <= planned.promotions_per_step <= 512


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--steps", str(hbf_cost.WARM_STEPS)], f"more than the {hbf_cost.WARM_STEPS} steps"),
        (["--drift", "1.5"], "--drift must be within 0 and 1"),
        (["--picks", "0"], "--picks must be within 1 and"),
        (["--tokens", "4096", "--picks", "200"], "--picks must be within 1 and 118"),
    ],
)
def test_bad_flags_are_usage_errors(
    flags: list[str], message: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """--steps within the untimed warm-up, a drift outside [0, 1] and more picks than blocks are
    refused with a message, not a traceback."""
    monkeypatch.setattr("sys.argv", ["hbf_cost", *flags])
    with pytest.raises(SystemExit) as exit_info:
        hbf_cost.main()
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
