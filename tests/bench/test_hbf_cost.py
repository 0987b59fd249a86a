"""`python -m h3d.bench.hbf_cost`'s planning runs for each shape: a latency per step after the
first 100, each the promotion's planning (the Llama-3-8B shape hands the picks over counted)."""

from __future__ import annotations

import pytest

from h3d.bench import hbf_cost


@pytest.mark.parametrize("shape", sorted(hbf_cost.SHAPES))
def test_planning_times_each_step_after_the_first_hundred(shape: str) -> None:
    lat = hbf_cost.planning(4096, 130, sessions=2, shape=shape)
    assert len(lat) == 30 and all(0 < x < 5e6 for x in lat)


def test_too_few_steps_is_a_usage_error(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """--steps within the untimed warm-up is refused with a message, not a traceback."""
    monkeypatch.setattr("sys.argv", ["hbf_cost", "--steps", str(hbf_cost.WARM_STEPS)])
    with pytest.raises(SystemExit) as exit_info:
        hbf_cost.main()
    assert exit_info.value.code == 2
    assert f"more than the {hbf_cost.WARM_STEPS} steps" in capsys.readouterr().err
