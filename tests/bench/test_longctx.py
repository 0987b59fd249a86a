"""`python -m h3d.bench.longctx` on a tiny checkpoint: every task under every configuration, rows
and per-prompt entries as documented. Its contexts are shorter than every budget, so each
sparse configuration reads every block and must answer exactly as `exact` did (the prefill
once, rewound between configurations)."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path

from h3d.bench import longctx
from h3d.bench.longtasks import TASKS
from h3d.bench.text import corpus
from h3d.engine.sampling import SamplingParams


def test_the_suite_runs_every_task_under_every_configuration(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    out = tmp_path / "longctx.json"
    longctx.main(
        ["--model", str(checkpoint("llama_gqa4_tied")), "--contexts", "480", "--smoke", "--max-tokens", "6",
         "--out", str(out)]
    )  # fmt: skip
    result = json.loads(out.read_text())
    rows = result["rows"]
    assert len(rows) == len(TASKS) * len(longctx.CONFIGS)
    assert all(r["total"] == 1 and r["context"] == 480 for r in rows)
    assert {(r["policy"], r["budget"], r["resize"]) for r in rows} == {
        (c.policy, c.budget, c.resize) for c in longctx.CONFIGS
    }
    for task in TASKS:
        runs = [p for p in result["prompts"] if p["task"] == task]
        assert len(runs) == len(longctx.CONFIGS)
        assert all(480 - 6 - 3 * longctx.MARGIN <= p["prompt_tokens"] <= 480 - 6 for p in runs)  # room for the answer
        assert all(p["answer"] == runs[0]["answer"] for p in runs), task  # the window holds the whole context
    assert "| task | context |" in longctx.table(rows)


def _suite(model: Path, out: Path, *extra: str) -> dict:
    longctx.main(
        ["--model", str(model), "--contexts", "1800", "--smoke", "--tasks", "single_needle", "multi_value",
         "--max-tokens", "24", "--out", str(out), *extra]
    )  # fmt: skip
    return json.loads(out.read_text())


def test_a_miss_is_traced_to_the_digest_bound_and_the_window_over_the_answer_is_kept(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """At 1,800 tokens a 1,024-token window selects in every layer past the dense ones. Each miss
    of a selecting policy carries, per selecting layer, the rank of the answer's blocks under the
    digest bound and whether the layer picked them; the blocks it names hold the facts' tokens."""
    model = checkpoint("llama_long")
    configs = ["exact", "attention_entropy@1024", "attention_entropy@2048+resize", "layerwise@2048"]
    result = _suite(model, tmp_path / "r.json", "--configs", *configs)
    prompts = result["prompts"]
    assert {p["config"] for p in prompts} == set(configs)
    engine_cfg = longctx.EngineConfig.build(model=str(model))
    layers = list(range(engine_cfg.hbf.dense_layers, 3))
    missed = [p for p in prompts if p["config"] == "attention_entropy@1024" and not p["correct"]]
    assert missed, "the tiny model answers nothing: every sparse run misses"
    for p in prompts:
        assert ("miss" in p) == (p["config"] != "exact" and not p["correct"])
    for p in missed:
        miss = p["miss"]
        assert miss["replayed"]  # greedy: generated again up to the step, the same tokens
        assert 0 <= miss["step"] < p["answer_tokens"]
        assert miss["layers"] == layers
        facts = 1 if p["task"] == "single_needle" else 4
        assert len(miss["fact_blocks"]) == facts
        bs = engine_cfg.block_size
        nb = -(-p["prompt_tokens"] // bs)
        firsts = [blocks[0] for blocks in miss["fact_blocks"]]
        assert firsts == sorted(firsts) and all(0 < b < nb for b in firsts)  # spread from the depth on, in order
        assert nb // 4 < firsts[0] < 3 * nb // 4  # the first at depth 0.5 of the body
        for ranks, picked, room in zip(miss["ranks"], miss["picked"], miss["room"], strict=True):
            assert len(ranks) == len(picked) == facts
            assert all(0 <= r < nb for r in ranks)
            assert room == 1024 // bs - 1 - -(-256 // bs)  # the window less the sink and the recent blocks
            # The block scoring highest of all is the top pick of the head that scores it so.
            assert all(pk for r, pk in zip(ranks, picked, strict=True) if r == 0)
    resized = [p for p in prompts if p["config"] == "attention_entropy@2048+resize"]
    for p in resized:
        assert len(p["window_sizes"]) == p["answer_tokens"]  # one per decode step (rewound: each token is one)
        assert p["mean_window"] == round(sum(p["window_sizes"]) / len(p["window_sizes"]), 1)


def test_with_the_archive_in_play_answers_equal_the_untiered_ones(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A small HBM and DDR send most blocks to the archive and back; under the lossless codec every
    answer is the one of the run that kept everything in HBM (tiered against untiered decoding)."""
    model = checkpoint("llama_long")
    configs = ["exact", "attention_entropy@1024"]
    plain = _suite(model, tmp_path / "plain.json", "--configs", *configs)
    tiered = _suite(
        model, tmp_path / "tiered.json", "--configs", *configs, "--archive", str(tmp_path / "archive"),
        "--hbm-mb", "0.25", "--ddr-mb", "0.5", "--codec", "raw-zstd",
    )  # fmt: skip
    assert tiered["archive"] == {"codec": "raw-zstd", "hbm_mb": 0.25, "ddr_mb": 0.5}
    assert [p["answer"] for p in tiered["prompts"]] == [p["answer"] for p in plain["prompts"]]
    assert all(p["ssd_reads"] > 0 for p in tiered["prompts"])  # blocks came back from the archive
    assert all(p["ssd_reads"] == 0 for p in plain["prompts"])
    both = longctx.combine([tmp_path / "plain.json", tmp_path / "tiered.json"])
    assert both["rows"] == plain["rows"]
    assert both["archive_rows"] == [{**r, "codec": "raw-zstd"} for r in tiered["rows"]]
    assert "| task | context | codec |" in longctx.table(both["archive_rows"], by_codec=True)
    twice = longctx.combine([tmp_path / "plain.json", tmp_path / "plain.json"])  # a prompt run twice counts once
    assert twice["rows"] == plain["rows"] and twice["prompts"] == plain["prompts"]
    (tmp_path / "both.json").write_text(json.dumps(both))
    again = longctx.combine([tmp_path / "both.json", tmp_path / "tiered.json"])  # a combined result is a run too
    assert again["rows"] == both["rows"] and again["archive_rows"] == both["archive_rows"]
    assert again["archive_prompts"] == both["archive_prompts"] and again["archive"] == both["archive"]


def test_the_departure_from_exact_is_the_first_differing_step() -> None:
    assert longctx.departure((1, 2, 3), (1, 2, 4)) == 2
    assert longctx.departure((5, 2), (1, 2)) == 0
    assert longctx.departure((1, 2, 3), (1, 2)) == 2  # exact stopped, this one went on
    assert longctx.departure((1, 2), (1, 2, 3)) == 0  # this one stopped early: its first step is traced
    assert longctx.departure((1, 2), (1, 2)) == 0
    assert longctx.departure((1, 2), None) == 0


def test_a_later_step_is_traced_on_the_answer_generated_again(checkpoint: Callable[[str], Path]) -> None:
    """The trace of step 7 generates the answer again up to it and watches that step's picks; a
    different answer is reported as not replayed."""
    args = argparse.Namespace(
        model=str(checkpoint("llama_long")), contexts=[1800], hbm_mb=None, ddr_mb=None, archive=None, codec=None
    )
    engine = longctx.engine_for(args)
    text = corpus()
    hay = (text, engine.tokenizer.encode(text, add_special_tokens=False))
    task, ids = longctx.build(engine, "single_needle", 1800, 0.5, 0, hay, 24)
    offset = len(ids) - len(task.ids) - len(longctx.frame(engine, task.question)[1])
    sid = engine.create_session(policy="attention_entropy")
    engine.append(sid, token_ids=ids)
    config = longctx.Config("attention_entropy", 1024)
    engine.kv.hbf = engine.runner.hbf = longctx.windowed(engine.kv.hbf, config)
    engine.kv.selection(engine.session(sid).seq).window_tokens = 1024
    done = engine.complete(sid, "", SamplingParams(max_tokens=12, temperature=0.0))
    assert len(done.token_ids) == 12
    engine.rewind(sid, len(ids))
    miss = longctx.rank_answer(engine, sid, task, offset, config, done.token_ids, 7)
    assert miss["replayed"] and miss["step"] == 7
    assert miss["layers"] == [2] and len(miss["ranks"]) == 1 and len(miss["picked"][0]) == 1
    assert "_pick" not in vars(longctx.POLICIES["attention_entropy"])  # the watch is undone
    engine.rewind(sid, len(ids))
    other = (done.token_ids[0] + 1, *done.token_ids[1:])
    assert not longctx.rank_answer(engine, sid, task, offset, config, other, 7)["replayed"]
