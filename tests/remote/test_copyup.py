"""KV copied to the store as write-behind archives it (`h3d.remote.copyup`), against a real
redis-server: every whole block the archive holds reaches the store under its content's key, as
the archive's record; a rewind followed by other tokens never puts a record under another
content's key; an export at shutdown writes only what the store lacks; a full queue skips blocks,
which the export writes then; a hand-over in its steps, and one the store fails."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import redis
from helpers import VOCAB_SIZE, random_prompt

from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import SessionId
from h3d.errors import KVNoRoom, SessionBusy
from h3d.remote.kv import digests, layout, unpack
from h3d.remote.local import LocalRedis
from h3d.remote.logs import RemoteLogs
from h3d.remote.store import KV_MAX_FILL, RemoteStore, RemoteUnavailable
from h3d.tiers.identity import BlockKey

MODEL = "llama_gqa4_tied"  # 3 layers, blocks of 16 tokens
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(ckpt: Path, folder: Path, server: LocalRedis, copy_bytes: int = 64 << 20) -> Engine:
    store = RemoteStore(server.url, namespace="t", owner="a")
    remote = RemoteLogs(store, lambda s: folder / "logs" / f"{s}.h3log", kv_copy_bytes=copy_bytes)
    remote.start()
    cfg = EngineConfig.build(
        model=str(ckpt), block_size=16, prefill_chunk_tokens=64, hbm_mb=8.0, ddr_mb=16.0, check_invariants=True,
        ssd_path=str(folder / "archive"), session_log_path=str(folder / "logs"), write_behind_dirty_mb=0,
    )  # fmt: skip
    return Engine(cfg, remote=remote)


def _written_behind(engine: Engine) -> None:
    """Write-behind run until nothing is left, then what it offered sent to the store."""
    for _ in range(1000):
        if not engine.write_behind():
            break
        time.sleep(0.002)
    engine.kv.tiers.behind.poll(wait=True)
    assert engine.copier is not None and engine.copier.drain(30)


def _stored(engine: Engine, tokens: list[int]) -> dict[tuple[int, int], bytes]:
    """The store's values for the content keys of `tokens`' whole blocks, by (layer, block)."""
    archive, remote = engine.kv.archive, engine.remote
    assert archive is not None and remote is not None
    full = len(tokens) // archive.identity.block_size
    chain = digests(tokens, archive.identity.block_size, full)
    where = [(layer, j) for layer in range(engine.model.config.num_layers) for j in range(full)]
    keys = [remote.store.kv_key(layout(archive.identity), layer, chain[j]) for layer, j in where]
    return {at: v for at, v in zip(where, remote.get_kv(keys), strict=True) if v is not None}


def _as_archived(engine: Engine, sid: SessionId, stored: dict[tuple[int, int], bytes]) -> None:
    archive = engine.kv.archive
    assert archive is not None
    for (layer, j), value in stored.items():
        [record] = archive.get_records([BlockKey(sid, layer, j)])
        assert unpack(value) == record


def test_each_block_written_behind_reaches_the_store_under_its_content(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    engine = _engine(checkpoint(MODEL), tmp_path, redis_server)
    layers = engine.model.config.num_layers
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(200, VOCAB_SIZE, seed=1))
    engine.complete(sid, "", GREEDY)
    _written_behind(engine)
    before = list(engine.session(sid).tokens)
    kv_blocks = (len(before) - 1) // 16  # (the last token is fed by the next request)
    stored = _stored(engine, before)
    assert len(stored) == layers * kv_blocks
    _as_archived(engine, sid, stored)
    assert engine.copier is not None and engine.copier.dropped_blocks == 0
    assert engine.copier.copied_blocks == layers * kv_blocks

    # Cut back into block 6, other tokens after: blocks 0-5 keep their keys, the rest are new keys
    # with the new records; the old content's keys keep the old content's records.
    engine.rewind(sid, 100)
    engine.append(sid, token_ids=random_prompt(150, VOCAB_SIZE, seed=2))
    engine.complete(sid, "", GREEDY)
    _written_behind(engine)
    after = list(engine.session(sid).tokens)
    now = _stored(engine, after)
    assert len(now) == layers * ((len(after) - 1) // 16)
    _as_archived(engine, sid, now)
    assert _stored(engine, before) == stored
    assert all(now[(layer, j)] == stored[(layer, j)] for layer in range(layers) for j in range(6))
    assert not any(now[(layer, 6)] == stored[(layer, 6)] for layer in range(layers))

    # The export a shutdown makes writes nothing the store has (it renews it) but the partial last
    # block, which write-behind never copies; once only.
    assert (len(after) - 1) % 16 and engine.export_kv(sid)[0] == layers
    assert engine.export_kv(sid) == (0, 0)
    engine.close()
    assert engine.remote is not None
    engine.remote.close()


def test_a_full_queue_skips_blocks_and_the_export_writes_them(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    engine = _engine(checkpoint(MODEL), tmp_path, redis_server, copy_bytes=1)  # (no batch fits)
    layers = engine.model.config.num_layers
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(120, VOCAB_SIZE, seed=3))
    _written_behind(engine)
    tokens = list(engine.session(sid).tokens)
    assert engine.copier is not None and engine.copier.copied_blocks == 0
    assert engine.copier.dropped_blocks == layers * ((len(tokens) - 1) // 16)
    assert not _stored(engine, tokens)
    blocks, nbytes = engine.export_kv(sid)
    assert blocks == layers * ((len(tokens) - 1) // 16 + 1) and nbytes > 0  # (the partial last block too)
    stored = _stored(engine, tokens)
    assert len(stored) == blocks - layers
    _as_archived(engine, sid, stored)
    engine.close()
    assert engine.remote is not None
    engine.remote.close()


def test_a_session_being_handed_over_takes_no_request_and_stays_if_the_store_fails(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    """The daemon's ReleaseSession in its three steps (the store's writes off the engine thread):
    while leaving, a request, a fork or a close is refused; a release the store does not take
    leaves the session here, served as before; one it takes forgets it here."""
    engine = _engine(checkpoint(MODEL), tmp_path, redis_server)
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(80, VOCAB_SIZE, seed=4))
    tokens = engine.begin_hand_over(sid)
    assert tokens == engine.session(sid).tokens and engine.session(sid).busy
    for refused in (
        lambda: engine.complete(sid, "", GREEDY),
        lambda: engine.fork_session(sid),
        lambda: engine.close_session(sid),
    ):
        with pytest.raises(SessionBusy, match="handed over"):
            refused()
    redis_server.stop()
    with pytest.raises(RemoteUnavailable):
        engine.send_hand_over(sid, tokens)
    engine.end_hand_over(sid, released=False)
    redis_server.start()
    assert not engine.session(sid).busy
    more = engine.complete(sid, "", GREEDY).token_ids
    assert len(more) == 6
    engine.hand_over(sid)
    assert sid not in engine.sessions
    assert engine.remote is not None and engine.remote.holder(sid) is None  # (free: another daemon takes it)
    engine.close()
    engine.remote.close()


def test_kv_leaves_a_full_stores_last_room_to_the_logs(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    """A store with a maxmemory: KV blocks (copied up, or exported) never take it past
    `KV_MAX_FILL` of it, while the token logs still go there; with room again, the export writes them."""
    engine = _engine(checkpoint(MODEL), tmp_path, redis_server)
    admin = redis.Redis.from_url(redis_server.url)
    used = int(admin.info("memory")["used_memory"])
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", str(int((used + 20_000) / KV_MAX_FILL)))
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(120, VOCAB_SIZE, seed=5))
    _written_behind(engine)
    tokens = list(engine.session(sid).tokens)
    assert engine.copier is not None and engine.copier.copied_blocks == 0 and engine.copier.dropped_blocks > 0
    with pytest.raises(KVNoRoom, match="kept for the token logs"):
        engine.export_kv(sid)
    assert not _stored(engine, tokens)
    assert engine.remote is not None
    engine.remote.durable(sid, (tmp_path / "logs" / f"{sid}.h3log").stat().st_size).result(10)  # (the log: there)
    admin.config_set("maxmemory", "0")
    blocks, _ = engine.export_kv(sid)
    layers = engine.model.config.num_layers  # (the partial last block's too)
    assert blocks == layers * ((len(tokens) - 1) // 16 + 1) == len(_stored(engine, tokens)) + layers
    engine.close()
    engine.remote.close()


def _handed_over(
    ckpt: Path, tmp_path: Path, server: LocalRedis, prompt: list[int]
) -> tuple[Engine, tuple[int, ...], Engine, SessionId]:
    """A reference engine's greedy continuation of `prompt` (it never gives its session up), and
    a session of `prompt` that engine "a" handed over to the store."""
    ref = _engine(ckpt, tmp_path / "ref", server, copy_bytes=0)
    rid = ref.create_session()
    ref.append(rid, token_ids=prompt)
    want = ref.complete(rid, "", GREEDY).token_ids
    a = _engine(ckpt, tmp_path / "a", server)
    sid = a.create_session()
    a.append(sid, token_ids=prompt)
    a.hand_over(sid)
    return ref, want, a, sid


def test_a_sessions_digests_travel_with_it_and_only_to_its_tokens(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis
) -> None:
    """A hand-over writes the session's digest snapshot to the store; the daemon that takes it over
    installs it (the snapshot names the last block it covers by content) and its first step reads
    the digests from it rather than rebuilding them from every block, with the tokens of an engine
    that never gave the session up. A snapshot of other tokens is not taken."""
    ckpt = checkpoint(MODEL)
    prompt = random_prompt(200, VOCAB_SIZE, seed=6)
    ref, want, a, sid = _handed_over(ckpt, tmp_path, redis_server, prompt)
    b = _engine(ckpt, tmp_path / "b", redis_server)
    assert b._import_digests(sid, [t + 1 for t in prompt[:-1]]) == 0  # (not of these tokens)
    taken = b.take_over(sid)
    assert taken is not None and taken.digest_blocks == (len(prompt) - 1) // 16 and taken.kv_blocks > 0
    b.adopt(sid, taken.data)
    assert b.complete(sid, "", GREEDY).token_ids == want
    [restored] = [f for name, f in b.kv.take_notices() if name == "digests_restored"]
    assert restored["from_snapshot"] == taken.digest_blocks and restored["rebuilt"] <= 1
    for e in (ref, a, b):
        e.close()
        assert e.remote is not None
        e.remote.close()


def test_a_hand_over_sends_a_digest_snapshot_still_being_written(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The hand-over's snapshot is written on a thread (`save_digests_later`) while the KV is sent:
    a slow disk must not leave the store without it (reading the header of a write under way, then
    the file not renamed into place yet, left the digests behind)."""
    from h3d.tiers.digestfile import DigestFiles

    write = DigestFiles.write

    def slow(self: DigestFiles, *args: object, **kwargs: object) -> int:
        time.sleep(0.3)
        return write(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(DigestFiles, "write", slow)
    ckpt = checkpoint(MODEL)
    prompt = random_prompt(200, VOCAB_SIZE, seed=9)
    ref, _, a, sid = _handed_over(ckpt, tmp_path, redis_server, prompt)
    head = redis.Redis.from_url(redis_server.url).get(a.remote.store._key(sid, "digests"))  # type: ignore[union-attr]
    assert head is not None and json.loads(head)["blocks"] == (len(prompt) - 1) // 16
    for e in (ref, a):
        e.close()
        assert e.remote is not None
        e.remote.close()


@pytest.mark.parametrize(
    "mode", ["auto, the store slower", "auto, measured on the digests' first piece", "auto, unmeasured", "recompute",
             "store"],
)  # fmt: skip
def test_a_session_taken_over_reads_its_kv_or_computes_it_by_the_rates_measured(
    checkpoint: Callable[[str], Path], tmp_path: Path, redis_server: LocalRedis, mode: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    """`remote_kv_resume`: a session taken over reads its KV (and digests) from the store, or leaves
    it to its next request's prefill; `auto` computes it where the store's read rate and the
    prefill's, as measured by this daemon, say a prefill is faster, and reads it while either is
    unmeasured; a store not measured yet is measured on the digest snapshot's first piece, and
    the rest is not read if computing wins. The tokens are an engine's that never gave the session
    up either way."""
    ckpt = checkpoint(MODEL)
    prompt = random_prompt(200, VOCAB_SIZE, seed=8)
    if mode.startswith("auto, measured"):  # (a snapshot of several pieces)
        from h3d.remote import store as store_module

        monkeypatch.setattr(store_module, "DIGEST_PIECE_BYTES", 4096)
    ref, want, a, sid = _handed_over(ckpt, tmp_path, redis_server, prompt)
    b = _engine(ckpt, tmp_path / "b", redis_server)
    assert b.remote is not None
    b.remote.kv_resume = mode.split(",")[0]
    if mode == "auto, the store slower":  # (as measured: 1 MB/s against a million tokens/s)
        b.remote.read_bytes_per_s, b.prefill_tokens_per_s = 1e6, 1e6
    pieces: list[int] = []
    if mode.startswith("auto, measured"):  # (a prefill as good as instant; any read counts)
        from h3d.remote import logs

        b.prefill_tokens_per_s = 1e15
        monkeypatch.setattr(logs, "RATE_MIN_BYTES", 0)
        piece = b.remote.store.get_digest_piece

        async def counted(session: str, index: int) -> bytes | None:
            pieces.append(index)
            return await piece(session, index)

        monkeypatch.setattr(b.remote.store, "get_digest_piece", counted)
    taken = b.take_over(sid)
    assert taken is not None
    computed = mode != "auto, unmeasured" and mode != "store"
    if mode.startswith("auto, measured"):
        head = redis.Redis.from_url(redis_server.url).get(b.remote.store._key(sid, "digests"))
        assert head is not None and json.loads(head)["pieces"] > 1
        assert pieces == [0] and b.remote.read_bytes_per_s is not None  # (the first piece only)
    assert taken.kv_source == ("recompute" if computed else "store")
    if computed:
        assert taken.kv_blocks == taken.digest_blocks == 0 and not b.kv.archive.blocks_of(sid)  # type: ignore[union-attr]
        if mode.startswith("auto"):
            assert taken.read_estimate_s is not None and taken.prefill_estimate_s is not None
            assert taken.read_estimate_s > taken.prefill_estimate_s
    else:
        assert taken.kv_blocks > 0 and taken.digest_blocks > 0
    b.adopt(sid, taken.data)
    assert b.cached_tokens(sid) == (0 if computed else len(prompt) - 1)  # (the partial last block too)
    assert b.complete(sid, "", GREEDY).token_ids == want
    for e in (ref, a, b):
        e.close()
        assert e.remote is not None
        e.remote.close()
