"""Sessions through the Engine API: context building, limits, errors, cleanup; and loader errors."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import (
    BOS_ID,
    VOCAB_SIZE,
    assert_greedy_match,
    make_engine,
    random_prompt,
    runner_logits,
    step_until_failure,
    teacher_margins,
)
from safetensors.torch import load_file, save_file

from h3d.config import EngineConfig
from h3d.engine.engine import Checkpoint, Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import AppendDone, FinishReason, GenerationDone, PrefillProgress, SessionId, TokenDelta
from h3d.errors import ConfigError, ContextTooLong, InvalidRequest, ModelLoadError, OutOfBlocks, SessionNotFound
from h3d.model.loader import load_model
from h3d.model.tokenizer import Tokenizer

MODEL = "llama_gqa4_tied"
SYSTEM = "You are a small model. Answer in one sentence."
USER = "Why does a long conversation need a large cache?"
GREEDY = SamplingParams(max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def engine(checkpoint: Callable[[str], Path]) -> Iterator[Engine]:
    yield make_engine(checkpoint(MODEL), prefill_chunk_tokens=32)


def capacity(engine: Engine) -> int:
    return engine.runner.blocks.slots_per_layer


def test_system_prompt_then_append_then_generate_equals_generate_with_prompt(engine: Engine) -> None:
    tok = engine.tokenizer
    a = engine.create_session(system_prompt=SYSTEM)
    assert engine.session(a).tokens == tok.encode(SYSTEM)
    assert engine.session(a).tokens[0] == BOS_ID  # the session's first piece gets special tokens
    appended = engine.append(a, text=USER)
    assert isinstance(appended, AppendDone) and appended.tokens_added == len(tok.encode(USER, add_special_tokens=False))
    # Later pieces are tokenized on their own, without special tokens.
    assert engine.session(a).tokens == tok.encode(SYSTEM) + tok.encode(USER, add_special_tokens=False)
    done_a = engine.complete(a, "", GREEDY)

    b = engine.create_session(system_prompt=SYSTEM)
    done_b = engine.complete(b, USER, GREEDY)
    assert done_a.token_ids == done_b.token_ids
    assert done_a.text == done_b.text
    assert engine.session(a).tokens == engine.session(b).tokens
    assert done_b.prompt_tokens == len(tok.encode(SYSTEM)) + len(tok.encode(USER, add_special_tokens=False))
    assert engine.session(b).tokens[done_b.prompt_tokens :] == list(done_b.token_ids)
    for sid in (a, b):
        engine.close_session(sid)


def test_multi_turn_reuses_the_cache_correctly(engine: Engine) -> None:
    """A second turn on a session (cached context + last sampled token fed later) decodes like a
    fresh session given the whole context at once."""
    sid = engine.create_session(system_prompt=SYSTEM)
    engine.complete(sid, USER, GREEDY)
    second_prompt = " And why blocks?"
    engine.append(sid, text=second_prompt)
    context = list(engine.session(sid).tokens)
    assert engine.cached_tokens(sid) < len(context)
    second = engine.complete(sid, "", GREEDY)
    fresh = engine.create_session()
    engine.append(fresh, token_ids=context)
    scratch = engine.complete(fresh, "", GREEDY)
    margins = teacher_margins(engine, context, scratch.token_ids)
    assert_greedy_match(second.token_ids, scratch.token_ids, margins)
    for s in (sid, fresh):
        engine.close_session(s)


def test_prefill_progress_and_append_events(checkpoint: Callable[[str], Path]) -> None:
    engine = make_engine(checkpoint(MODEL), prefill_chunk_tokens=16)
    sid = engine.create_session()
    ids = random_prompt(100, VOCAB_SIZE, seed=4)
    rid = engine.submit(sid, token_ids=ids, generate=False)
    events = list(engine.run(rid))
    progress = [e for e in events if isinstance(e, PrefillProgress)]
    assert isinstance(events[-1], AppendDone) and events[-1].tokens_added == 100
    assert len(progress) >= 100 // 16
    done = [p.done for p in progress]
    assert done == sorted(done) and all(p.total == progress[0].total for p in progress)
    assert done[-1] == progress[-1].total
    assert engine.session(sid).tokens == ids
    assert engine.cached_tokens(sid) <= 100


def test_max_context_tokens_is_enforced(checkpoint: Callable[[str], Path]) -> None:
    engine = make_engine(checkpoint(MODEL), max_context_tokens=64)
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(60, VOCAB_SIZE, seed=1))
    with pytest.raises(ContextTooLong):
        engine.append(sid, token_ids=random_prompt(5, VOCAB_SIZE, seed=2))
    with pytest.raises(ContextTooLong):
        list(engine.generate(sid, token_ids=random_prompt(5, VOCAB_SIZE, seed=2), params=GREEDY))
    assert len(engine.session(sid).tokens) == 60, "a refused append changed the context"
    assert not engine.session(sid).busy
    assert issubclass(ContextTooLong, InvalidRequest)
    # Generating up to the limit stops there with LENGTH.
    done = engine.complete(sid, "", SamplingParams(max_tokens=100, ignore_eos=True))
    assert done.finish_reason is FinishReason.LENGTH
    assert len(done.token_ids) == 4
    assert len(engine.session(sid).tokens) == 64


def test_generate_on_a_full_context_is_refused(checkpoint: Callable[[str], Path]) -> None:
    """A context already at max_context_tokens cannot grow by a generated token either.

    (h3d bug: Engine.submit accepts a generation on a full session and the first step appends one
    more token, so the context passes max_context_tokens.)
    """
    engine = make_engine(checkpoint(MODEL), max_context_tokens=64)
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(64, VOCAB_SIZE, seed=1))
    with pytest.raises(ContextTooLong):
        list(engine.generate(sid, params=SamplingParams(max_tokens=8, ignore_eos=True)))
    assert len(engine.session(sid).tokens) <= 64


def test_system_prompt_too_long_leaves_no_session(checkpoint: Callable[[str], Path]) -> None:
    """(h3d bug: create_session registers the session and opens its block table before the system
    prompt is checked, so a refused create_session leaks a session nobody can name.)"""
    engine = make_engine(checkpoint(MODEL), max_context_tokens=8)
    with pytest.raises(ContextTooLong):
        engine.create_session(system_prompt=SYSTEM * 4)
    assert engine.sessions == {}


def test_rejected_generate_leaves_the_context_unchanged(engine: Engine) -> None:
    """generate(prompt, bad params) must not append the prompt before refusing the params.

    (h3d bug: Engine.generate appends the prompt, then submit validates the params.)
    """
    sid = engine.create_session(system_prompt=SYSTEM)
    before = list(engine.session(sid).tokens)
    with pytest.raises(InvalidRequest):
        list(engine.generate(sid, USER, SamplingParams(max_tokens=0)))
    assert engine.session(sid).tokens == before
    assert not engine.session(sid).busy
    engine.close_session(sid)


def test_empty_context_cannot_generate(engine: Engine) -> None:
    sid = engine.create_session()
    with pytest.raises(InvalidRequest):
        list(engine.generate(sid, params=GREEDY))
    with pytest.raises(InvalidRequest):
        engine.complete(sid, "", GREEDY)
    with pytest.raises(InvalidRequest):
        engine.append(sid, text="")
    assert not engine.session(sid).busy and engine.session(sid).tokens == []
    engine.close_session(sid)


def test_bad_token_ids_and_busy_sessions_are_refused(engine: Engine) -> None:
    sid = engine.create_session()
    vocab = engine.model.config.vocab_size
    for bad in ([vocab], [-1], [3, 4, vocab + 10]):
        with pytest.raises(InvalidRequest):
            engine.append(sid, token_ids=bad)
    assert engine.session(sid).tokens == []
    rid = engine.submit(sid, token_ids=[5, 6, 7], params=GREEDY)
    with pytest.raises(InvalidRequest):
        engine.submit(sid, text="more", params=GREEDY)
    with pytest.raises(InvalidRequest):
        engine.create_session(policy="no-such-policy")
    events = list(engine.run(rid))
    assert isinstance(events[-1], GenerationDone)
    assert not engine.session(sid).busy
    engine.close_session(sid)


def test_unknown_session(engine: Engine) -> None:
    calls = [
        lambda: engine.session("nope"),
        lambda: engine.append("nope", text="x"),
        lambda: list(engine.generate("nope", "x")),
        lambda: engine.submit("nope", text="x"),
        lambda: engine.cached_tokens("nope"),
        lambda: engine.close_session("nope"),
    ]
    for call in calls:
        with pytest.raises(SessionNotFound):
            call()
    sid = engine.create_session()
    engine.close_session(sid, purge=True)
    with pytest.raises(SessionNotFound):
        engine.append(sid, text="x")


def test_close_frees_every_block(engine: Engine) -> None:
    blocks = engine.runner.blocks
    free_before = blocks.num_free
    sids = [engine.create_session(system_prompt=SYSTEM) for _ in range(3)]
    for sid in sids:
        engine.complete(sid, USER, GREEDY)
    assert blocks.num_free < free_before
    for sid in sids:
        engine.close_session(sid)
    blocks.check_invariants()
    assert blocks.num_free == free_before


def test_close_with_a_request_in_flight(checkpoint: Callable[[str], Path]) -> None:
    """Closing a session mid-generation cancels its request (reported once) and frees its blocks."""
    engine = make_engine(checkpoint(MODEL))
    other = engine.create_session()
    sid = engine.create_session()
    rid = engine.submit(sid, token_ids=random_prompt(40, VOCAB_SIZE, seed=3), params=GREEDY)
    engine.step()
    engine.step()
    engine.close_session(sid)
    assert engine.session(sid).closed and not engine.has_work  # without an archive its KV is forgotten
    # Its end is reported once, as a cancellation (the daemon ends the client's stream with it).
    ended = [e for e in engine.take_events() if e.request_id == rid]
    assert [type(e).__name__ for e in ended] == ["GenerationDone"]
    assert isinstance(ended[0], GenerationDone) and ended[0].finish_reason is FinishReason.CANCELLED
    assert rid not in {e.request_id for e in engine.step()} and engine.take_events() == []
    engine.runner.blocks.check_invariants()
    assert engine.runner.blocks.num_free == capacity(engine)
    done = engine.complete(other, USER, SamplingParams(max_tokens=3))
    assert len(done.token_ids) >= 1


def test_cancel_finishes_with_cancelled(engine: Engine) -> None:
    sid = engine.create_session()
    rid = engine.submit(sid, text=USER, params=SamplingParams(max_tokens=50, ignore_eos=True))
    events = engine.step() + engine.step()
    engine.cancel(rid)
    events += engine.step()
    done = [e for e in events if isinstance(e, GenerationDone)]
    assert len(done) == 1 and done[0].finish_reason is FinishReason.CANCELLED
    assert len(done[0].token_ids) == len([e for e in events if isinstance(e, TokenDelta)])
    assert not engine.has_work and not engine.session(sid).busy
    engine.close_session(sid)


def _kv_of(engine: Engine, sid: SessionId) -> list[torch.Tensor]:
    """Copies of the session's written K/V bytes, block by block, wherever each block lives (HBM or DDR).

    Only the written tokens: the rest of a partial block is uninitialized pool memory. Raw bytes,
    so that equal NaN payloads compare equal.
    """
    runner = engine.runner
    t = runner.blocks.table(engine.session(sid).seq)
    bs = runner.blocks.block_size
    out = []
    for layer in range(runner.blocks.num_layers):
        for j in range(t.num_blocks):
            pool, slot = (runner.hbm, t.hbm[layer, j]) if t.hbm[layer, j] >= 0 else (runner.ddr, t.ddr[layer, j])
            n = min(bs, t.num_tokens - j * bs)
            out += [
                pool.k[:, int(slot), :n].clone().view(torch.uint8),
                pool.v[:, int(slot), :n].clone().view(torch.uint8),
            ]
    return out


def _refused(engine: Engine, sid: SessionId, ids: list[int]) -> None:
    """An append the tiers cannot hold fails with OutOfBlocks, at submit (admission) or at a step."""
    try:
        engine.submit(sid, token_ids=ids, generate=False)
    except OutOfBlocks:
        pass
    else:
        assert isinstance(step_until_failure(engine), OutOfBlocks)
    assert not engine.has_work and not engine.session(sid).busy


def test_out_of_blocks_fails_the_request_not_the_engine(checkpoint: Callable[[str], Path]) -> None:
    # llama_gqa4_tied: a slot is 2 (K, V) x 16 tokens x 2 heads x 16 x 4 B = 4 KiB; 3 layers.
    # HBM: 4 slots per layer (64 tokens; under exact, equal regions); DDR: 2 slots; no ssd_path,
    # so nothing can spill further.
    slot_mb = 4096 / 2**20
    engine = make_engine(checkpoint(MODEL), hbm_mb=12 * slot_mb, ddr_mb=2 * slot_mb, policy="exact")
    assert capacity(engine) == 4 and engine.runner.blocks.ddr_alloc.capacity == 2
    prompt = random_prompt(20, VOCAB_SIZE, seed=6)
    kept = engine.create_session()
    engine.append(kept, token_ids=prompt)  # 2 blocks per layer: 6 of the 14 blocks
    kv_before = _kv_of(engine, kept)
    big = engine.create_session()
    # 100 tokens: 7 blocks per layer, more than HBM (4 per layer) + DDR (2) can hold at once.
    _refused(engine, big, random_prompt(100, VOCAB_SIZE, seed=5))
    # 50 tokens: 4 blocks per layer would fit alone, not next to the stored session (6 + 12 > 14).
    _refused(engine, big, random_prompt(50, VOCAB_SIZE, seed=7))
    assert engine.session(big).tokens == [] and engine.cached_tokens(big) == 0
    # Nothing stored was dropped: the first session's context and KV bytes are as they were ...
    assert engine.session(kept).tokens == prompt and engine.cached_tokens(kept) == 19  # the last one is fed later
    after = _kv_of(engine, kept)
    assert len(after) == len(kv_before) and all(torch.equal(a, b) for a, b in zip(after, kv_before, strict=True))
    engine.runner.tiers.check()
    # ... and it continues exactly as the same prompt does on an engine with room to spare.
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    roomy = make_engine(checkpoint(MODEL))
    ref_sid = roomy.create_session()
    roomy.append(ref_sid, token_ids=prompt)
    want = roomy.complete(ref_sid, "", params).token_ids
    assert engine.complete(kept, "", params).token_ids == want
    # The engine keeps working: a session that fits generates.
    small = engine.create_session()
    done = engine.complete(small, "Hi", SamplingParams(max_tokens=5, ignore_eos=True))
    assert len(done.token_ids) == 5
    for sid in (big, small, kept):
        engine.close_session(sid)
    assert engine.runner.blocks.num_free == 4 and engine.runner.blocks.ddr_free == 2


def test_engine_config_errors(checkpoint: Callable[[str], Path]) -> None:
    model = str(checkpoint(MODEL))
    for bad in (
        {"block_size": 0},
        {"prefill_chunk_tokens": -1},
        {"hbm_mb": 0},
        {"max_batch_size": 0},
        {"max_context_tokens": 0},
        {"device": "tpu"},
        {"dtype": "int8"},
        {"no_such_key": 1},
        {"ddr_mb": -1},
        {"ssd_codec": "lz4"},
        {"ddr_high_watermark": 0},
        {"ddr_high_watermark": 1.5},
        {"policy": "no-such-policy"},
        {"quantize_skip_layers": (-1,)},
    ):
        with pytest.raises(ConfigError):
            EngineConfig.build(model=model, **bad)
    with pytest.raises(ConfigError):
        EngineConfig.build()


# ---- loader errors -----------------------------------------------------------------------------


def _load_error(folder: Path) -> str:
    with pytest.raises(ModelLoadError) as info:
        Engine(EngineConfig.build(model=str(folder)))
    return str(info.value)


def test_missing_folder_and_missing_config(tmp_path: Path, model_copy: Callable[[str], Path]) -> None:
    assert "not found" in _load_error(tmp_path / "nowhere")
    folder = model_copy(MODEL)
    (folder / "config.json").unlink()
    assert "config.json" in _load_error(folder)


def test_unsupported_architecture(model_copy: Callable[[str], Path]) -> None:
    folder = model_copy(MODEL)
    raw = json.loads((folder / "config.json").read_text())
    raw["architectures"] = ["GPT2LMHeadModel"]
    raw["model_type"] = "gpt2"
    (folder / "config.json").write_text(json.dumps(raw))
    message = _load_error(folder)
    assert "GPT2LMHeadModel" in message and "LlamaForCausalLM" in message


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        ({"rope_parameters": {"rope_type": "longrope", "factor": 4.0, "rope_theta": 1e4}}, "longrope"),
        ({"hidden_act": "gelu"}, "gelu"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"layer_types": ["chunked_attention"]}, "chunked_attention"),
        ({"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
    ],
)
def test_unsupported_config_values(model_copy: Callable[[str], Path], edit: dict, words: str) -> None:
    folder = model_copy(MODEL)
    raw = json.loads((folder / "config.json").read_text())
    raw.update(edit)
    (folder / "config.json").write_text(json.dumps(raw))
    assert words in _load_error(folder)


def test_broken_config_json(model_copy: Callable[[str], Path]) -> None:
    folder = model_copy(MODEL)
    (folder / "config.json").write_text("{not json")
    assert "config.json" in _load_error(folder)
    raw_missing = model_copy("qwen2_mha_tied")
    raw = json.loads((raw_missing / "config.json").read_text())
    del raw["hidden_size"]
    (raw_missing / "config.json").write_text(json.dumps(raw))
    assert "hidden_size" in _load_error(raw_missing)


def test_missing_weights(model_copy: Callable[[str], Path]) -> None:
    folder = model_copy(MODEL)
    (folder / "model.safetensors").unlink()
    assert "model.safetensors" in _load_error(folder)


def test_missing_and_unexpected_tensors(model_copy: Callable[[str], Path]) -> None:
    folder = model_copy("qwen2_gqa4_untied")
    tensors = load_file(folder / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.bias"]
    save_file(tensors, folder / "model.safetensors")
    assert "model.layers.1.self_attn.k_proj.bias" in _load_error(folder)
    folder2 = model_copy("llama_mha_untied")
    tensors = load_file(folder2 / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = torch.zeros(2)
    save_file(tensors, folder2 / "model.safetensors")
    assert "model.layers.0.extra.weight" in _load_error(folder2)


def test_untied_model_without_lm_head_is_refused(model_copy: Callable[[str], Path]) -> None:
    """tie_word_embeddings=false and no lm_head.weight: missing weights, not a silently tied head.

    (h3d bug: loader._fused substitutes model.embed_tokens.weight whenever lm_head.weight is
    absent, so such a checkpoint loads and computes wrong logits.)
    """
    folder = model_copy("llama_mha_untied")
    tensors = load_file(folder / "model.safetensors")
    del tensors["lm_head.weight"]
    save_file(tensors, folder / "model.safetensors")
    assert "lm_head" in _load_error(folder)


def test_sharded_weights(model_copy: Callable[[str], Path], checkpoint: Callable[[str], Path]) -> None:
    """An index + two shards loads like the single file; a missing shard is named."""
    folder = model_copy("qwen2_mha_tied")
    tensors = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, folder / shard)
        weight_map.update(dict.fromkeys(keys, shard))
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    ids = random_prompt(50, VOCAB_SIZE, seed=9)
    sharded = runner_logits(make_engine(folder), 1, ids, [50])
    single = runner_logits(make_engine(checkpoint("qwen2_mha_tied")), 1, ids, [50])
    assert torch.equal(sharded, single)
    (folder / "model-00002-of-00002.safetensors").unlink()
    assert "model-00002-of-00002.safetensors" in _load_error(folder)


@pytest.mark.parametrize("index", ["{not json", "{}", "[]", '{"weight_map": 5}'])
def test_malformed_shard_index(model_copy: Callable[[str], Path], index: str) -> None:
    """A broken index is a ModelLoadError naming it, whatever its JSON holds.

    (h3d bug for "[]" and '{"weight_map": 5}': loader._shards catches only JSONDecodeError and
    KeyError, so a valid JSON document of the wrong shape escapes as TypeError / AttributeError.)
    """
    folder = model_copy("qwen2_mha_tied")
    (folder / "model.safetensors").unlink()
    (folder / "model.safetensors.index.json").write_text(index)
    assert "model.safetensors.index.json" in _load_error(folder)


def test_tokenizer_and_dtype_errors(model_copy: Callable[[str], Path], checkpoint: Callable[[str], Path]) -> None:
    folder = model_copy(MODEL)
    (folder / "tokenizer.json").unlink()
    assert "tokenizer.json" in _load_error(folder)
    with pytest.raises(ModelLoadError):
        Tokenizer(folder)
    broken = model_copy("qwen2_mha_tied")
    (broken / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError):
        Tokenizer(broken)
    with pytest.raises(ModelLoadError):
        load_model(checkpoint(MODEL), "int8", "cpu")


def test_rewind_branches_continuations_from_one_prefill(checkpoint: Callable[[str], Path]) -> None:
    """After a rewind to the prompt, a generation is exactly the first one; blocks are freed."""
    engine = make_engine(checkpoint(MODEL))
    prompt = random_prompt(70, VOCAB_SIZE, seed=21)
    sid = engine.create_session()
    engine.append(sid, token_ids=prompt)
    free_after_prompt = engine.runner.blocks.num_free
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    first = engine.complete(sid, "", params).token_ids
    engine.rewind(sid, len(prompt))
    assert engine.session(sid).tokens == prompt and engine.cached_tokens(sid) == len(prompt) - 1
    assert engine.runner.blocks.num_free == free_after_prompt
    engine.runner.tiers.check()
    assert engine.complete(sid, "", params).token_ids == first
    with pytest.raises(InvalidRequest):
        engine.rewind(sid, 10_000)


def test_a_checkpoint_past_its_deadline_writes_the_most_recently_used_sessions_first(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Three sessions; the checkpoint's deadline passes while it writes the first: that one is the
    session used last, the other two are left to recompute (their blocks counted as a restart will
    compute them again), and every session continues after the restart with the tokens of an
    engine that never stopped."""
    import time

    ckpt = checkpoint("llama_long")
    kw = {"ssd_path": str(tmp_path / "archive"), "session_log_path": str(tmp_path / "sessions")}
    one, six = SamplingParams(max_tokens=1, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [random_prompt(n, 512, seed=n) for n in (300, 200, 250)]

    def start(engine: Engine) -> list[SessionId]:
        sids = [engine.create_session() for _ in prompts]
        for sid, ids in zip(sids, prompts, strict=True):
            engine.append(sid, token_ids=ids)
        engine.complete(sids[1], "", one)  # the session used last
        return sids

    steady = make_engine(ckpt)
    want = [list(steady.complete(sid, "", six).token_ids) for sid in start(steady)]
    engine = make_engine(ckpt, **kw)
    sids = start(engine)
    seen = []

    def slow(done: Checkpoint) -> None:
        seen.append(done.blocks_written)
        time.sleep(1.1)  # the deadline passes after the first session

    done = engine.checkpoint(time.monotonic() + 1.0, progress=slow)
    assert done.sessions == done.sessions_done == 3 and done.blocks_written == seen[0] > 0
    bs = engine.kv.blocks.block_size
    assert done.sessions_left == 2
    assert done.blocks_left == sum(-(-len(prompts[i]) // bs) for i in (0, 2))  # nothing of theirs archived
    engine.close()
    again = make_engine(ckpt, **kw)
    got = [list(again.complete(sid, "", six).token_ids) for sid in sids]
    assert again.tier_stats().kv_rebuild_blocks == done.blocks_left  # what the checkpoint said it left
    assert got == want
