"""Resuming a session from the archive: its digests first (`h3d.tiers.digestfile`), then only the blocks its steps read.

- A shutdown's checkpoint writes each session's digest snapshot; after the restart the digests are
  read from it, bit for bit those rebuilt from the keys, and the first step reads from the archive
  only the blocks it reads: every block of the dense layers, the selections' blocks of the others
  (counted record by record). The tokens equal an untiered engine's.
- A snapshot that does not match (a flipped byte, another shape) is ignored and the digests are
  rebuilt from every key; one that covers fewer blocks than the session has (it grew after) gives
  its blocks and the rest are rebuilt; a rewind below its blocks deletes it.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import VOCAB_SIZE, flip_payload_byte, make_engine, random_prompt

from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import SessionId
from h3d.engine.stepkv import HostStepKV
from h3d.kv.slots import HELD
from h3d.tiers.digestfile import DigestFiles, Layout

MODEL = "llama_gqa4_tied"  # 3 layers, 2 KV heads of 16, blocks of 16 tokens
HBF: dict[str, Any] = {
    "policy": "attention_entropy",
    "window_tokens": 128,
    "window_min_tokens": 64,
    "window_max_tokens": 256,
    "recent_tokens": 32,
    "dense_layers": 1,
}
PROMPT = 600  # 38 blocks: a window of 8 of them per KV head
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def _engine(model: Path, folder: Path, **overrides: Any) -> Engine:
    kw: dict[str, Any] = {
        "ssd_path": str(folder / "archive"),
        "session_log_path": str(folder / "sessions"),
        "hbm_mb": 3 * 8 * 4096 / 2**20,
        "read_ahead_at_start": False,  # (these tests follow a resume from its first request; the start's below)
        **HBF,
    }
    return make_engine(model, **(kw | overrides))


def _first_run(checkpoint: Callable[[str], Path], folder: Path) -> tuple[SessionId, Engine, SessionId]:
    """A session of PROMPT tokens and 6 generated, checkpointed and closed; its untiered twin
    (left open, at the same point)."""
    engine = _engine(checkpoint(MODEL), folder)
    plain = make_engine(checkpoint(MODEL), **HBF)
    ids = random_prompt(PROMPT, VOCAB_SIZE, seed=41)
    sid, twin = engine.create_session(), plain.create_session()
    engine.append(sid, token_ids=ids)
    plain.append(twin, token_ids=ids)
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    done = engine.checkpoint()
    assert done.digest_bytes > 0 and done.blocks_left == 0
    engine.close()
    return sid, plain, twin


def _files(engine: Engine) -> DigestFiles:
    files = engine.runner.kv.digest_files
    assert files is not None
    return files


def _digests(engine: Engine, sid: SessionId, blocks: int) -> torch.Tensor:
    return engine.runner.kv.digests.head(engine.session(sid).seq, blocks).cpu().clone()


def test_a_resumed_session_reads_its_digests_then_only_the_blocks_its_first_step_selects(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from h3d.tiers.readahead import ReadAhead

    monkeypatch.setattr(ReadAhead, "start", lambda *_: None)  # read-ahead off: the step's own reads
    folder = tmp_path / "data"
    sid, plain, twin = _first_run(checkpoint, folder)
    engine = _engine(checkpoint(MODEL), folder)
    seq = engine.session(sid).seq
    tiers = engine.runner.tiers
    table = tiers.blocks.table(seq)
    nb, last = table.num_blocks, table.num_tokens // tiers.blocks.block_size
    assert table.archive_only().all()
    selected: dict[int, set[int]] = {}
    select = HostStepKV._select

    def spy_select(self: HostStepKV, i: int, index: int, q: torch.Tensor, scale: float) -> np.ndarray | None:
        sel = select(self, i, index, q, scale)
        if sel is not None:
            selected.setdefault(index, set()).update(np.unique(sel).tolist())
        return sel

    reads: dict[int, set[int]] = {}
    read = tiers.mover.read

    def spy_read(keys: list[Any], slots: np.ndarray) -> int:
        for key in keys:
            assert (key.index) not in reads.setdefault(key.layer, set()), "a block read twice"
            reads[key.layer].add(key.index)
        return read(keys, slots)

    monkeypatch.setattr(HostStepKV, "_select", spy_select)
    monkeypatch.setattr(tiers.mover, "read", spy_read)
    timings = []  # where each step's time went (the daemon logs a slow one: `slow_step`)
    step = engine.step
    monkeypatch.setattr(engine, "step", lambda: (step(), timings.append(engine.timing))[0])
    out = engine.complete(sid, "", ONE).token_ids
    monkeypatch.undo()
    [host] = [t.host for t in timings if t.host is not None]  # the resumed step, planned layer by layer
    assert host.layers == 3 and 0 < host.staged_blocks <= tiers.counters.ssd_read_count and host.stage_s > 0
    assert set(host.fields()) == {"digests_ms", "select_ms", "stage_ms", "staged_blocks"}

    assert _files(engine).bytes_read > 0  # the digests came from the snapshot
    assert set(selected) == {1, 2}  # the dense layer 0 selects nothing
    assert reads[0] == set(range(nb))  # a dense layer reads every block
    for layer in (1, 2):
        assert len(selected[layer]) < nb - 4  # a window, not the whole context
        assert reads[layer] == selected[layer] | {last}, layer  # the selection's blocks and the partial last one
    assert tiers.counters.ssd_read_count == sum(len(r) for r in reads.values())
    assert tiers.blocks.table(seq).archive_only().any()  # the rest stays in the archive

    # The digests loaded are those rebuilt from every key, and the tokens the untiered engine's.
    loaded = _digests(engine, sid, last)
    assert out + engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", ONE).token_ids + (
        plain.complete(twin, "", GREEDY).token_ids
    )
    engine.close()
    DigestFiles(folder / "archive" / "digests", "").remove(sid)
    rebuilt_engine = _engine(checkpoint(MODEL), folder)
    rebuilt_engine.complete(sid, "", ONE)
    assert _files(rebuilt_engine).bytes_read == 0
    assert torch.equal(_digests(rebuilt_engine, sid, last), loaded)
    rebuilt_engine.close()
    plain.close()


def test_a_snapshot_that_does_not_match_is_ignored_and_one_that_covers_less_gives_what_it_has(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """A flipped byte in a snapshot's rows: ignored, the digests rebuilt from every key. A
    snapshot of fewer blocks than the session has: its blocks loaded, the rest rebuilt. Both give
    the digests rebuilt from the keys and the untiered engine's tokens."""
    folder = tmp_path / "data"
    sid, plain, twin = _first_run(checkpoint, folder)
    files = DigestFiles(folder / "archive" / "digests", "")
    path = files.path(sid)
    good = path.read_bytes()
    engine = _engine(checkpoint(MODEL), folder)
    engine.complete(sid, "", ONE)
    blocks = len(engine.session(sid).tokens) // 16
    want = _digests(engine, sid, blocks)
    engine.checkpoint()  # (its HBF state, which the tokens depend on: its snapshot covers these blocks already)
    engine.close()

    bad = bytearray(good)
    bad[-100] ^= 0x40
    path.write_bytes(bytes(bad))
    engine = _engine(checkpoint(MODEL), folder)
    engine.complete(sid, "", ONE)
    assert not path.exists()  # ignored, deleted
    # its one piece holds every layer that keeps digests (2 of 3: the first is dense): each
    # rebuilt from its keys when the first step read it
    assert engine.kv.digests.layers == (1, 2) and engine.kv.digests.layers_rebuilt == 2
    assert torch.equal(_digests(engine, sid, blocks), want)
    engine.checkpoint()
    engine.close()

    # A snapshot of the first 20 blocks only, written by hand from the good rows.
    engine = _engine(checkpoint(MODEL), folder)
    files = _files(engine)
    meta = files.header(sid)
    assert meta is not None and meta["blocks"] == 37
    path.write_bytes(good)
    got = files.read(sid, Layout((2, 2, 2, 16), torch.float32, 8, (1, 2)), 37)
    assert got is not None and got[0] == 37
    rows = got[1][:, :, : 20 * 2]  # 2 parts per block of 16 tokens
    files.write(sid, 20, 8, rows, [1, 2])
    before = files.bytes_read
    engine.complete(sid, "", ONE)
    assert files.bytes_read - before == rows.numel() * 4
    tokens = engine.complete(sid, "", GREEDY).token_ids
    assert torch.equal(_digests(engine, sid, blocks), want)
    engine.close()
    for _ in range(3):
        plain.complete(twin, "", ONE)
    assert tokens == plain.complete(twin, "", GREEDY).token_ids
    plain.close()


def test_a_snapshot_of_fewer_blocks_is_left_to_the_first_step_not_taken_at_the_start(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """`read_ahead_at_start` takes a session's digests at the start only from a snapshot of every
    full block (the rest would be rebuilt from their keys, read then): one of 20 of its 37 blocks
    is left to the first step, which loads it and rebuilds the rest; the tokens are the untiered
    engine's."""
    folder = tmp_path / "data"
    sid, plain, twin = _first_run(checkpoint, folder)
    engine = _engine(checkpoint(MODEL), folder)  # (its session untouched: nothing written at its close)
    files = _files(engine)
    got = files.read(sid, Layout((2, 2, 2, 16), torch.float32, 8, (1, 2)), 37)
    assert got is not None and got[0] == 37
    files.write(sid, 20, 8, got[1][:, :, : 20 * 2], [1, 2])
    engine.close()
    engine = _engine(checkpoint(MODEL), folder, read_ahead_at_start=True)
    record = engine.runner.kv.sessions[engine.session(sid).seq]
    assert record.stale_digests  # not taken at the start
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert not record.stale_digests
    engine.close()
    plain.close()


def test_a_damaged_record_met_at_the_start_is_left_to_the_first_step_which_repairs_it(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """The start's digests (`KVCache.resume_ahead`) read the session's partial block to rebuild
    its digests: a damaged record there does not stop the start; the session's digests stay to
    be taken by its first step, which meets the damage, computes that block again from the token
    log (`Engine.rebuilds` names it) and gives the untiered engine's tokens."""
    folder = tmp_path / "data"
    sid, plain, twin = _first_run(checkpoint, folder)  # 606 tokens: block 37 is partial
    flip_payload_byte(folder / "archive", sid, 0, 37)
    engine = _engine(checkpoint(MODEL), folder, read_ahead_at_start=True)
    record = engine.runner.kv.sessions[engine.session(sid).seq]
    assert record.stale_digests and not engine.rebuilds  # left to its first step
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    [reason] = engine.rebuilds
    assert sid in reason and "layer 0" in reason and "block 37" in reason, reason
    engine.close()
    plain.close()


def test_a_rewind_below_a_snapshot_deletes_it(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    folder = tmp_path / "data"
    sid, plain, _ = _first_run(checkpoint, folder)
    plain.close()
    engine = _engine(checkpoint(MODEL), folder)
    files = _files(engine)
    assert files.header(sid) is not None
    engine.rewind(sid, 37 * 16 + 1)  # the KV of blocks 0..36 kept whole (the last token is fed again): it stays
    assert files.header(sid) is not None
    engine.rewind(sid, 300)
    assert files.header(sid) is None and not files.path(sid).exists()
    engine.close()


def test_digest_files_round_trip_and_refuse_what_is_not_theirs(tmp_path: Path) -> None:
    files = DigestFiles(tmp_path / "digests", "abc")
    rows = torch.randn(3, 2, 10, 2, 16).to(torch.bfloat16)
    layers = [1, 2, 4]  # the model's layers whose digests the rows are
    layout = Layout((3, 2, 2, 16), torch.bfloat16, 8, (1, 2, 4))
    assert files.read("s1", layout, 5) is None  # none yet
    n = files.write("s1", 5, 8, rows, layers)
    assert n == files.path("s1").stat().st_size and files.path("s1").stat().st_mode & 0o777 == 0o600
    got = files.read("s1", layout, 5)
    assert got is not None and got[0] == 5 and torch.equal(got[1], rows)
    got = files.read("s1", Layout((2, 2, 2, 16), torch.bfloat16, 8, (2, 4)), 5)  # some of its layers
    assert got is not None and torch.equal(got[1], rows[1:])
    for wrong, max_blocks in (
        (layout, 4),  # it covers more than the session has
        (Layout((3, 2, 2, 16), torch.float16, 8, (1, 2, 4)), 5),
        (Layout((3, 2, 2, 16), torch.bfloat16, 16, (1, 2, 4)), 5),
        (Layout((3, 4, 2, 16), torch.bfloat16, 8, (1, 2, 4)), 5),
        (Layout((3, 2, 2, 16), torch.bfloat16, 8, (1, 2, 3)), 5),  # a layer it does not hold
    ):
        assert files.read("s1", wrong, max_blocks) is None and not files.path("s1").exists(), wrong  # ignored, deleted
        files.write("s1", 5, 8, rows, layers)
    assert DigestFiles(tmp_path / "digests", "other").read("s1", layout, 5) is None
    files.write("s1", 5, 8, rows, layers)
    path = files.path("s1")
    path.write_bytes(path.read_bytes()[:-1])  # short
    assert files.read("s1", layout, 5) is None
    assert files.path("../x y").parent == files.folder  # a name that is not a plain id is hashed
    (files.folder / "s2.tmp").write_bytes(b"torn")
    assert files.clean() == 1 and not (files.folder / "s2.tmp").exists()
    assert not path.exists()  # deleted once found bad
    files.write("s1", 5, 8, rows, layers)
    files.cut("s1", 5)
    assert path.exists()
    files.cut("s1", 3)
    assert not path.exists()


def test_a_version_1_snapshot_of_every_full_layer_is_read_without_its_dense_ones(tmp_path: Path) -> None:
    """Snapshots written before the arena held only the layers that select (format version 1)
    list no layers and hold every full-attention layer: read with those (`legacy_layers`), the
    dense ones skipped; a version-1 snapshot of other layers is ignored."""
    from h3d.tiers import digestfile

    rows = torch.randn(3, 2, 10, 2, 16).to(torch.bfloat16)  # full layers 0, 1, 2; layer 0 dense
    files = DigestFiles(tmp_path / "digests", "abc")
    files.write("s1", 5, 8, rows, [0, 1, 2])
    path = files.path("s1")
    raw = path.read_bytes()
    magic, n, _ = digestfile.PREFIX.unpack(raw[: digestfile.PREFIX.size])
    meta = json.loads(raw[digestfile.PREFIX.size : digestfile.PREFIX.size + n])
    meta["version"] = 1
    del meta["layers"]
    header = json.dumps(meta).encode()
    assert len(header) < n  # the rows stay at their 4 KiB boundary
    start = digestfile._data_offset(n)
    head = digestfile.PREFIX.pack(magic, len(header), zlib.crc32(header)) + header
    v1 = head + b"\0" * (start - len(head)) + raw[start:]
    path.write_bytes(v1)
    got = files.read("s1", Layout((2, 2, 2, 16), torch.bfloat16, 8, (1, 2), legacy_layers=(0, 1, 2)), 5)
    assert got is not None and got[0] == 5 and torch.equal(got[1], rows[1:])
    assert files.read("s1", Layout((2, 2, 2, 16), torch.bfloat16, 8, (1, 2), legacy_layers=(0, 1)), 5) is None
    assert not path.exists()


def test_a_restart_reads_its_open_sessions_kv_back_from_the_start_the_most_recent_first(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`read_ahead_at_start` (the default): a restarted engine reads its open sessions' archived
    KV back into DDR before any request, the most recently used session first, what each one's
    next step reads for sure and its hot blocks before the rest, and takes their digests from
    their snapshots (`KVCache.resume_ahead`, their partial blocks' from their keys); a closed
    session's stay in the archive. Their first steps then read nothing from the archive
    themselves, and every token is the untiered engine's."""
    import time

    folder = tmp_path / "data"
    engine = _engine(checkpoint(MODEL), folder)
    plain = make_engine(checkpoint(MODEL), **HBF)
    pairs = []
    for n in (PROMPT, PROMPT // 2, PROMPT // 3):  # used in this order: the last is the most recent
        sid, twin = engine.create_session(), plain.create_session()
        ids = random_prompt(n, VOCAB_SIZE, seed=n)
        engine.append(sid, token_ids=ids)
        plain.append(twin, token_ids=ids)
        assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
        pairs.append((sid, twin))
        time.sleep(0.01)  # (distinct last uses)
    engine.close_session(pairs[2][0])  # closed: read back when it is reopened, not at start
    assert engine.checkpoint().blocks_left == 0
    engine.close()

    from h3d.tiers.readahead import ReadAhead

    started: list[int] = []
    start = ReadAhead.start
    monkeypatch.setattr(ReadAhead, "start", lambda self, seq, *a: (started.append(seq), start(self, seq, *a))[1])
    engine = _engine(checkpoint(MODEL), folder, read_ahead_at_start=True)
    monkeypatch.undo()
    tiers = engine.runner.tiers
    seqs = [engine.session(sid).seq for sid, _ in pairs]
    assert started[:2] == [seqs[1], seqs[0]]  # open, the most recent first (then their digests', below)
    assert tiers.blocks.table(seqs[2]).archive_only().all()
    stale = [engine.runner.kv.sessions[s].stale_digests for s in seqs]
    assert stale == [False, False, True]  # the open ones' digests taken from their snapshots at the start
    while engine.read_ahead():  # (the daemon's idle loop)
        time.sleep(0.005)
    tiers.ahead.poll()
    events: dict[tuple[str, str], dict[str, Any]] = {
        (name, str(fields["session"])): fields for name, fields in engine.runner.kv.take_notices()
    }
    for sid, _ in pairs[:2]:  # each open session's first blocks, then all of them, read back
        first, done = events[("read_ahead_first", sid)], events[("read_ahead_done", sid)]
        assert 0 < first["blocks"] <= done["blocks"] and first["seconds"] <= done["seconds"]
        assert done["gb"] == round(done["blocks"] * tiers.block_bytes / 1e9, 3)
    assert ("read_ahead_done", pairs[2][0]) not in events  # the closed one: not read ahead
    bs = tiers.blocks.block_size
    partial = {}  # each session's partial last block: read by its next append, not ahead
    for sid, seq in zip([p[0] for p in pairs], seqs, strict=True):
        t = tiers.blocks.table(seq)
        partial[sid] = t.num_tokens // bs
        full = t.archive_only()[:, : partial[sid]]
        assert full.all() if seq == seqs[2] else not full.any()  # every full block back in DDR, but the closed one's

    reads: list[tuple[str, int]] = []
    read = tiers.mover.read

    def spy(keys: list[Any], slots: np.ndarray) -> int:
        reads.extend((k.session, k.index) for k in keys)
        return read(keys, slots)

    monkeypatch.setattr(tiers.mover, "read", spy)
    for sid, twin in pairs[:2]:
        assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert not reads  # nothing: their partial blocks were read at the start with their digests
    sid, twin = pairs[2]
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    engine.close()
    plain.close()


def test_the_rest_is_read_ahead_after_the_first_step_and_a_step_waits_for_a_piece_in_flight(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From the resume on, read-ahead brings every archived block back into DDR (each read once,
    the partial one by the step), in pieces on its own threads; a step that needs a block of a
    piece still in flight waits for it. The tokens equal the untiered engine's."""
    import threading

    from h3d.tiers import readahead

    monkeypatch.setattr(readahead, "READ_AHEAD_PIECE", 8)
    folder = tmp_path / "data"
    sid, plain, twin = _first_run(checkpoint, folder)
    engine = _engine(checkpoint(MODEL), folder)
    seq = engine.session(sid).seq
    tiers = engine.runner.tiers
    ahead = tiers.ahead
    read_into = tiers.mover.read_into
    gate = threading.Event()
    threads: set[str] = set()
    keys_read: list[tuple[int, int]] = []

    def slow(keys: list[Any], slots: np.ndarray, fence: list[Any]) -> None:
        threads.add(threading.current_thread().name)
        gate.wait(10)  # held until the step below has asked for its blocks
        keys_read.extend((k.layer, k.index) for k in keys)
        read_into(keys, slots, fence)

    waited: list[int] = []
    wait_for = ahead.wait_for

    def spy_wait(s: Any, layer: int, blocks: np.ndarray) -> None:
        if any(p.seq == s and not p.future.done() for p in ahead.pieces):
            waited.append(layer)
            gate.set()
        wait_for(s, layer, blocks)

    monkeypatch.setattr(tiers.mover, "read_into", slow)
    monkeypatch.setattr(ahead, "wait_for", spy_wait)
    monkeypatch.setattr(readahead, "READ_AHEAD_IN_FLIGHT_MB", 1)  # 256 blocks at a time: 32 pieces of 8
    before, nb = tiers.counters.ssd_read_count, tiers.blocks.table(seq).num_blocks
    # Read-ahead starts with the resume, beside the snapshot's read; the first step's layers wait
    # for the pieces that hold what they read (the gate opens at the first wait).
    first = engine.complete(sid, "", ONE).token_ids
    assert waited and waited[0] == 0
    out = engine.complete(sid, "", GREEDY).token_ids
    for _ in range(200):
        if not engine.read_ahead():
            break
    assert not ahead.queue and not ahead.pieces
    table = tiers.blocks.table(seq)
    assert not table.archive_only().any()  # all of it back
    assert threads and all(name.startswith("h3d-read-ahead") for name in threads)
    assert len(keys_read) == len(set(keys_read))
    assert tiers.counters.ssd_read_count - before == 3 * nb  # every archived block read once
    assert 0 < ahead.read_blocks < 3 * nb
    stats = engine.tier_stats()
    assert stats.read_ahead_bytes == ahead.read_blocks * 4096 and stats.read_ahead_in_flight_bytes == 0
    assert first + out == plain.complete(twin, "", ONE).token_ids + plain.complete(twin, "", GREEDY).token_ids
    engine.runner.kv.check()
    engine.close()
    plain.close()


def test_a_step_that_reads_the_archive_takes_back_other_sessions_pieces_not_started(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart read-ahead queues every open session's blocks, the most recently used
    session's first; the first step of the other one, which reads the archive, takes back the
    pieces of the first that have not started (`ReadAhead.yield_to`), so that its reads do not
    wait behind them. Those blocks are read ahead later all the same, no slot is lost, and both
    sessions' tokens are the untiered engine's."""
    import threading
    import time

    from h3d.tiers import readahead

    folder = tmp_path / "data"
    engine = _engine(checkpoint(MODEL), folder)
    plain = make_engine(checkpoint(MODEL), **HBF)
    pairs = []
    for n in (PROMPT, PROMPT // 2):  # used in this order: the second is the most recent
        sid, twin = engine.create_session(), plain.create_session()
        ids = random_prompt(n, VOCAB_SIZE, seed=n + 1)
        engine.append(sid, token_ids=ids)
        plain.append(twin, token_ids=ids)
        assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
        pairs.append((sid, twin))
        time.sleep(0.01)  # (distinct last uses)
    assert engine.checkpoint().blocks_left == 0
    engine.close()

    monkeypatch.setattr(readahead, "READ_AHEAD_THREADS", 1)
    monkeypatch.setattr(readahead, "READ_AHEAD_PIECE", 8)
    gate = threading.Event()
    from h3d.tiers.mover import Mover

    read_into = Mover.read_into

    def held(self: Mover, keys: list[Any], slots: np.ndarray, fence: list[Any]) -> None:
        gate.wait(10)  # the one thread holds the recent session's first piece; the rest queue
        read_into(self, keys, slots, fence)

    monkeypatch.setattr(Mover, "read_into", held)
    yield_to = readahead.ReadAhead.yield_to
    taken: list[tuple[list[Any], int, dict[Any, int]]] = []

    def spy(self: readahead.ReadAhead, batch: list[Any]) -> int:
        queued: dict[Any, int] = {}
        for p in self.pieces:
            if not p.future.running() and not p.future.done():
                queued[p.seq] = queued.get(p.seq, 0) + len(p.blocks)
        back = yield_to(self, batch)
        taken.append((list(batch), back, queued))
        gate.set()
        return back

    monkeypatch.setattr(readahead.ReadAhead, "yield_to", spy)
    submit = readahead.ReadAhead._submit
    resubmitted: list[tuple[Any, bool, int]] = []  # (session, as first, blocks) once a step took pieces back

    def submitted(
        self: readahead.ReadAhead, seq: Any, layers: np.ndarray, blocks: np.ndarray, first: bool = False
    ) -> int:
        if taken:
            resubmitted.append((seq, first, len(blocks)))
        return submit(self, seq, layers, blocks, first)

    monkeypatch.setattr(readahead.ReadAhead, "_submit", submitted)
    engine = _engine(checkpoint(MODEL), folder, read_ahead_at_start=True)
    tiers = engine.runner.tiers
    old, recent = (engine.session(sid).seq for sid, _ in pairs)
    (sid, twin), later = pairs[0], pairs[1]
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    batch, back, queued = taken[0]
    assert batch == [old] and back == queued[recent] > 0  # every piece of the other not started
    assert tiers.ahead.yielded_blocks >= back
    # those of its pieces taken back that held what its own first step reads for sure: submitted
    # again as such (before the rest)
    assert 0 < sum(n for seq, first, n in resubmitted if seq == recent and first) <= back
    while engine.read_ahead():  # (the daemon's idle loop): the blocks taken back are read all the same
        time.sleep(0.005)
    tiers.ahead.poll()
    bs = tiers.blocks.block_size
    table = tiers.blocks.table(recent)
    assert not table.archive_only()[:, : table.num_tokens // bs].any()
    sid, twin = later
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert not tiers.ahead.pieces
    engine.runner.kv.check()
    assert not (tiers.blocks.ddr_owner == HELD).any()  # none lost with the pieces taken back
    engine.close()
    plain.close()


def test_read_ahead_submits_what_the_first_step_reads_for_sure_before_the_rest(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the resume, read-ahead's first submission is every block the step reads whatever its
    query (`Policy.known`: the dense layer whole, sinks, recent window, the prompt's anchors),
    past the in-flight bound (0 here); the rest waits for the bound."""
    from h3d.tiers import readahead

    monkeypatch.setattr(readahead, "READ_AHEAD_IN_FLIGHT_MB", 0)
    folder = tmp_path / "data"
    sid, plain, twin = _first_run(checkpoint, folder)
    engine = _engine(checkpoint(MODEL), folder)
    seq = engine.session(sid).seq
    kv = engine.runner.kv
    table = kv.tiers.blocks.table(seq)
    nb, last = table.num_blocks, table.num_tokens // 16
    want = kv._known(seq)
    want[:, last] = False  # the partial block: the step's own
    assert want[0, :last].all() and not want[1:].all() and want[1:].any()
    submitted: list[np.ndarray] = []
    submit = kv.tiers.ahead._submit

    def spy(s: Any, layers: np.ndarray, blocks: np.ndarray, first: bool = False) -> int:
        mask = np.zeros((3, nb), dtype=bool)
        mask[layers, blocks] = True
        submitted.append(mask)
        assert first == (len(submitted) == 1)
        return submit(s, layers, blocks, first)

    monkeypatch.setattr(kv.tiers.ahead, "_submit", spy)
    out = engine.complete(sid, "", GREEDY).token_ids
    assert submitted and np.array_equal(submitted[0], want)
    assert len(submitted) == 1  # nothing else within a bound of 0
    assert out == plain.complete(twin, "", GREEDY).token_ids
    engine.close()
    plain.close()


def test_a_closed_session_is_snapshot_behind_and_reopens_from_it(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Closing a session (its KV parked in the archive) writes its digest snapshot on a thread of
    its own; reopening it while that write is under way takes the digests from the rows being
    written, without waiting for the write nor reading the file, rather than from every key; once
    written, a reopening reads the file. The tokens equal the untiered engine's."""
    import threading

    engine = _engine(checkpoint(MODEL), tmp_path / "data")
    plain = make_engine(checkpoint(MODEL), **HBF)
    ids = random_prompt(PROMPT, VOCAB_SIZE, seed=43)
    sid, twin = engine.create_session(), plain.create_session()
    engine.append(sid, token_ids=ids)
    plain.append(twin, token_ids=ids)
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    files = _files(engine)
    gate, threads = threading.Event(), set()
    write = files.write

    def slow(*args: Any) -> int:
        threads.add(threading.current_thread().name)
        gate.wait(10)
        return write(*args)

    monkeypatch.setattr(files, "write", slow)
    kv = engine.runner.kv
    rebuild, rebuilt_from = kv._rebuild_digests, []
    monkeypatch.setattr(kv, "_rebuild_digests", lambda seq, first=0: rebuilt_from.append(first) or rebuild(seq, first))
    engine.close_session(sid)
    assert not files.path(sid).exists()  # under way, held
    out = engine.complete(sid, "", GREEDY).token_ids  # reopened: the rows being written, no wait
    assert not files.path(sid).exists() and files.bytes_read == 0  # (still held: not waited for, not read)
    assert rebuilt_from == [(PROMPT + 6) // 16]  # only the partial block's digests from its keys
    assert out == plain.complete(twin, "", GREEDY).token_ids
    gate.set()
    engine.close_session(sid)
    files.settle()
    assert files.path(sid).exists()
    assert threads and all(name.startswith("h3d-digest-write") for name in threads)
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert files.bytes_read > 0  # reopened once the write was done: read from the file
    engine.close()
    plain.close()


def test_a_resume_reads_ahead_first_the_blocks_its_last_steps_read_most(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A checkpoint notes in each session's log the blocks its last steps read most in each layer
    that selects (`KVCache.note_hot`: at most 2 windows' blocks); the resume reads them ahead with
    what the first step reads for sure, so that the first step's own reads from the archive are
    fewer than without the note. The tokens are the untiered engine's either way."""
    import shutil

    from h3d.tiers import readahead

    monkeypatch.setattr(readahead, "READ_AHEAD_IN_FLIGHT_MB", 0)  # its first submission, nothing more
    folder = tmp_path / "data"
    sid, plain, twin = _first_run(checkpoint, folder)
    shutil.copytree(folder, tmp_path / "again")
    want = plain.complete(twin, "", GREEDY).token_ids
    own: dict[bool, int] = {}
    for hot, where in ((True, folder), (False, tmp_path / "again")):
        engine = _engine(checkpoint(MODEL), where)
        seq = engine.session(sid).seq
        kv = engine.runner.kv
        state = kv.selection(seq)
        assert set(state.hot) == {1, 2}  # the layers that select (layer 0 is dense)
        assert all(0 < len(b) <= 2 * 128 // 16 for b in state.hot.values())
        if not hot:
            state.hot = {}
        reads: list[int] = []
        read = kv.tiers.mover.read

        def spy(keys: list[Any], slots: np.ndarray, reads: list[int] = reads, read: Any = read) -> int:
            reads.append(len(keys))
            return read(keys, slots)

        with monkeypatch.context() as m:
            m.setattr(kv.tiers.mover, "read", spy)
            assert engine.complete(sid, "", GREEDY).token_ids == want
        own[hot] = sum(reads)
        engine.close()
    assert own[True] < own[False], own
    plain.close()


def test_a_resumed_step_selects_in_a_layer_while_the_next_layers_digests_are_still_read(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The snapshot is read a piece after another in the background (`DigestFiles.read_later`) and
    each layer's rows are copied in when the step first reads them (`DigestStore.load_later`): the
    first step selects in layer 1 while the last layer's pieces are still being read, none is
    rebuilt, and the tokens are the untiered engine's."""
    import os
    import time

    from h3d.tiers import digestfile

    monkeypatch.setattr(digestfile, "PIECE_BYTES", 4096)  # 19 KB of rows a layer: 5 pieces each
    folder = tmp_path / "data"
    sid, plain, twin = _first_run(checkpoint, folder)
    events: list[tuple[str, int, float]] = []
    preadv = os.preadv

    def slow(fd: int, buffers: Any, offset: int) -> int:
        time.sleep(0.03)
        n = preadv(fd, buffers, offset)
        events.append(("piece", offset, time.perf_counter()))
        return n

    select = HostStepKV._select

    def spy_select(self: HostStepKV, i: int, index: int, q: torch.Tensor, scale: float) -> np.ndarray | None:
        events.append(("select", index, time.perf_counter()))
        return select(self, i, index, q, scale)

    engine = _engine(checkpoint(MODEL), folder)
    monkeypatch.setattr(digestfile.os, "preadv", slow)
    monkeypatch.setattr(HostStepKV, "_select", spy_select)
    out = engine.complete(sid, "", ONE).token_ids
    monkeypatch.undo()
    first = min(t for kind, _, t in events if kind == "select")
    pieces = [t for kind, _, t in events if kind == "piece"]
    assert len(pieces) == 10  # 38 KB of rows: the 2 layers that keep digests (the first is dense)
    assert max(pieces) > first, "every piece was read before the step selected"
    assert engine.kv.digests.layers_rebuilt == 0 and not engine.kv.digests._incoming
    assert out + engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", ONE).token_ids + (
        plain.complete(twin, "", GREEDY).token_ids
    )
    engine.close()
    plain.close()
