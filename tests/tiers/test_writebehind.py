"""Write-behind (`h3d.tiers.writebehind`): full KV blocks archived in the background.

- Every full block ends up archived, byte for byte what HBM or DDR holds; a shutdown's checkpoint
  then writes only the partial blocks; the tokens equal an engine without tiers.
- Property: under slow and failing archive writes, interleaved with appends, generations, idle
  pumps, closes (parked now, or once written behind), rewinds and forks (which do not wait for
  the batches in flight), a block is
  marked archived only when the archive holds its bytes (checked for every block, not settled
  first), no block is ever in no tier, and the tokens equal the untiered engine's.
- A rewind waits for its session's writes in flight, so no record of a cut block stands for the
  block that replaces it; a purge does not (it abandons them, and deletes what they wrote); the
  archive's capacity stops write-behind (the blocks stay dirty).
- A session resumed after a restart reads its archived KV back on several threads.
- Write-behind makes way for a prompt: while a request waits for its first token nothing is
  submitted and the batches not started wait, for at most `WRITE_BEHIND_HOLD_S` in a row and
  at most about half of the time (a budget of hold time, on a fake clock).

kill -9 during write-behind is in tests/daemon/test_durability.py.
"""

from __future__ import annotations

import errno
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from helpers import VOCAB_SIZE, make_engine, random_prompt
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import SessionId, TokenDelta
from h3d.errors import ConfigError, SsdDegraded
from h3d.kv.blocks import NONE, SeqId
from h3d.store.files import FileOps
from h3d.tiers.digestfile import DigestFiles
from h3d.tiers.identity import BlockKey
from h3d.tiers.writebehind import WRITE_BEHIND_THREADS

MODEL = "llama_gqa4_tied"  # 3 layers, 2 KV heads of 16: 4 KiB per block of 16 tokens (fp32)
SLOT_BYTES = 2 * 16 * 2 * 16 * 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _engine(model: Path, folder: Path, **overrides: Any) -> Engine:
    kw: dict[str, Any] = {
        "ssd_path": str(folder / "archive"),
        "write_behind_dirty_mb": 0,
        "hbm_mb": 3 * 8 * SLOT_BYTES / 2**20,  # 8 blocks per layer: most blocks live in DDR only
        "prefill_chunk_tokens": 64,
    }
    return make_engine(model, **(kw | overrides))


def _drain(engine: Engine) -> None:
    """Write behind while idle until nothing is left past the budget, then apply what finished."""
    for _ in range(1000):
        if not engine.write_behind():
            break
        time.sleep(0.002)
    engine.runner.tiers.behind.poll(wait=True)


def _check_archived_blocks(engine: Engine) -> int:
    """Every block marked archived is in the archive with the bytes its HBM or DDR copy holds
    (without waiting for the writes in flight: a flag set before the write is durable fails here).
    Returns the blocks checked."""
    tiers = engine.runner.tiers
    archive = tiers.archive
    assert archive is not None
    b = tiers.blocks
    checked = 0
    for seq, t in b.tables().items():
        name = tiers.sessions[seq].name
        full = t.num_tokens // b.block_size
        for layer in range(b.num_layers):
            hbm, ddr, arch = t.layer_hbm(layer), t.layer_ddr(layer), t.layer_archived(layer)
            for j in np.flatnonzero(arch[:full]).tolist():
                home = int(b.entries.home[t.ids[layer, j]])  # (a block a fork shares: its writer's record)
                owner = tiers.sessions[SeqId(home)].name if home in tiers.sessions else name
                k, v = archive.get(BlockKey(owner, layer, j))  # raises if the record is missing
                pool, slot = (tiers.hbm, hbm[j]) if hbm[j] != NONE else (tiers.ddr, ddr[j])
                if slot == NONE:
                    continue  # the archive is its only copy
                pk, pv = pool.k[:, int(slot)], pool.v[:, int(slot)]
                assert torch.equal(k, pk.cpu()) and torch.equal(v, pv.cpu()), f"{name} layer {layer} block {j}"
                checked += 1
    return checked


def _all_full_blocks_archived(engine: Engine) -> bool:
    b = engine.runner.blocks
    return all(t.archived[:, : t.num_tokens // b.block_size].all() for t in b.tables().values())


def test_every_full_block_is_written_behind_and_a_checkpoint_writes_only_partial_blocks(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    engine = _engine(checkpoint(MODEL), tmp_path)
    plain = make_engine(checkpoint(MODEL))
    prompts = [random_prompt(n, VOCAB_SIZE, seed=20 + n) for n in (299, 170)]
    sids, twins = [], []
    for ids in prompts:
        sid, twin = engine.create_session(), plain.create_session()
        engine.append(sid, token_ids=ids)
        plain.append(twin, token_ids=ids)
        assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
        sids.append(sid)
        twins.append(twin)
    _drain(engine)
    stats = engine.tier_stats()
    assert _all_full_blocks_archived(engine) and stats.dirty_bytes == 0
    tables = list(engine.runner.blocks.tables().values())
    full_blocks = sum(t.num_tokens // 16 for t in tables) * 3
    partial_blocks = sum(t.num_tokens % 16 > 0 for t in tables) * 3
    assert stats.write_behind_bytes == full_blocks * SLOT_BYTES and stats.write_behind_in_flight_bytes == 0
    assert _check_archived_blocks(engine) == full_blocks  # every copy checked against its record
    engine.runner.tiers.check()

    done = engine.checkpoint()  # what a shutdown writes: the partial last blocks only
    assert partial_blocks > 0 and done.blocks_written == partial_blocks and done.blocks_left == 0
    for sid, twin in zip(sids, twins, strict=True):  # and serving goes on, the same
        assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    engine.close()
    plain.close()


def test_a_dirty_budget_leaves_that_much_unwritten(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """With write_behind_dirty_mb at 20 blocks' worth, write-behind stops at 20 dirty blocks
    (the newest: the oldest are written first); off, nothing is written behind."""
    budget = 20 * SLOT_BYTES / 2**20
    engine = _engine(checkpoint(MODEL), tmp_path, write_behind_dirty_mb=budget, ddr_mb=64.0)
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(400, VOCAB_SIZE, seed=3))
    _drain(engine)
    stats = engine.tier_stats()
    t = engine.runner.blocks.table(engine.session(sid).seq)
    assert stats.dirty_bytes <= 20 * SLOT_BYTES and stats.write_behind_bytes > 0
    archived = t.archived[:, : t.num_tokens // 16]
    assert archived[:, 0].all() and not archived[:, -1].any()  # oldest first
    engine.close()

    off = _engine(checkpoint(MODEL), tmp_path / "off", write_behind=False, ddr_mb=64.0)
    sid = off.create_session()
    off.append(sid, token_ids=random_prompt(400, VOCAB_SIZE, seed=3))
    assert not off.write_behind()
    full = off.runner.blocks.table(off.session(sid).seq).num_tokens // 16
    assert off.tier_stats().write_behind_bytes == 0 and off.tier_stats().dirty_bytes == full * 3 * SLOT_BYTES
    off.close()


class _Disk(FileOps):
    """An archive's file system calls, slowed (each fsync sleeps) or failing (ENOSPC) on demand."""

    def __init__(self) -> None:
        self.slow = 0.0
        self.full = False
        self.failed = 0

    def write_all(self, fd: int, data: bytes, offset: int) -> None:
        if self.full:
            self.failed += 1
            raise OSError(errno.ENOSPC, "No space left on device")
        super().write_all(fd, data, offset)

    def fsync(self, fd: int) -> None:
        if self.slow:
            time.sleep(self.slow)
        super().fsync(fd)


ACTIONS = st.lists(
    st.one_of(
        st.tuples(st.just("append"), st.integers(0, 2), st.integers(1, 90)),
        st.tuples(st.just("generate"), st.integers(0, 2), st.integers(1, 20)),
        st.tuples(st.just("idle"), st.just(0), st.just(0)),
        st.tuples(st.just("slow"), st.just(0), st.sampled_from([0, 1, 5])),
        st.tuples(st.just("full"), st.just(0), st.booleans()),
        st.tuples(st.just("close"), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("rewind"), st.integers(0, 2), st.integers(1, 40)),
        st.tuples(st.just("fork"), st.integers(0, 2), st.integers(1, 8)),
    ),
    min_size=4,
    max_size=14,
)


@settings(
    max_examples=8,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],  # no shrinking: an example takes a second or two
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(actions=ACTIONS)
def test_a_block_is_marked_archived_only_once_durable_whatever_the_disk_does(
    checkpoint: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory, actions: list[tuple[str, int, Any]]
) -> None:
    folder = tmp_path_factory.mktemp("wb")
    engine = _engine(checkpoint(MODEL), folder, ssd_retry_interval_s=0.01, ddr_mb=40 * SLOT_BYTES / 2**20)
    plain = make_engine(checkpoint(MODEL))
    tiers = engine.runner.tiers
    disk = _Disk()
    assert tiers.archive is not None
    tiers.archive.files = disk
    pairs: list[tuple[SessionId, SessionId]] = []
    for i in range(3):
        ids = random_prompt(40 + 30 * i, VOCAB_SIZE, seed=i)
        sid, twin = engine.create_session(), plain.create_session()
        engine.append(sid, token_ids=ids)
        plain.append(twin, token_ids=ids)
        pairs.append((sid, twin))
    for action, i, arg in actions:
        sid, twin = pairs[i]
        if action == "append":
            ids = random_prompt(arg, VOCAB_SIZE, seed=arg)
            engine.append(sid, token_ids=ids)
            plain.append(twin, token_ids=ids)
        elif action == "generate":
            params = SamplingParams(max_tokens=arg, temperature=0.0, ignore_eos=True)
            assert engine.complete(sid, "", params).token_ids == plain.complete(twin, "", params).token_ids
        elif action == "idle":
            engine.write_behind()  # (and the sessions closed `later` whose blocks are written: parked)
        elif action == "slow":
            disk.slow = arg / 1000
        elif action == "full":
            disk.full = arg
        elif action == "close":  # reopened by its next request; `later`: parked once written behind
            engine.close_session(sid, later=arg)
        elif action == "rewind":
            n = max(1, len(engine.session(sid).tokens) - arg)
            try:
                engine.rewind(sid, n)
            except SsdDegraded:  # the records past the cut could not be deleted: refused, the tokens stay
                assert disk.full and len(engine.session(sid).tokens) == len(plain.session(twin).tokens)
            else:
                plain.rewind(twin, n)
        elif action == "fork":  # (with the session's batches perhaps in flight: a fork does not wait for them)
            child, twin_child = engine.fork_session(sid), plain.fork_session(twin)
            params = SamplingParams(max_tokens=arg, temperature=0.0, ignore_eos=True)
            assert engine.complete(child, "", params).token_ids == plain.complete(twin_child, "", params).token_ids
            _check_archived_blocks(engine)
            engine.close_session(child, purge=True)
            plain.close_session(twin_child, purge=True)
        _check_archived_blocks(engine)
        engine.runner.blocks.check_invariants()  # no block in no tier
    disk.full, disk.slow = False, 0.0
    time.sleep(0.02)  # past ssd_retry_interval_s: the next step's check recovers a degraded tier
    for sid, twin in pairs:
        assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    _drain(engine)
    assert tiers.ssd_degraded is None and _all_full_blocks_archived(engine)
    _check_archived_blocks(engine)
    tiers.check()
    engine.close()
    plain.close()


def test_a_rewind_waits_for_its_writes_in_flight(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """Writes held back by the disk: a rewind of the session waits for them (applied) before its
    blocks go, so the blocks that replace them are dirty, never taken for archived; the archive's
    records past the cut are written again with the new tokens' KV."""
    engine = _engine(checkpoint(MODEL), tmp_path)
    plain = make_engine(checkpoint(MODEL))
    gate = threading.Event()

    class Held(FileOps):
        def fsync(self, fd: int) -> None:
            gate.wait(30)
            super().fsync(fd)

    tiers = engine.runner.tiers
    assert tiers.archive is not None
    tiers.archive.files = Held()
    ids = random_prompt(200, VOCAB_SIZE, seed=5)
    sid, twin = engine.create_session(), plain.create_session()
    engine.append(sid, token_ids=ids)
    tiers.behind.release()  # (the hold it made way for the prompt with: over)
    engine.write_behind()
    assert tiers.behind.batches  # in flight, held by the disk
    threading.Timer(0.2, gate.set).start()
    t0 = time.monotonic()
    engine.rewind(sid, 100)
    assert time.monotonic() - t0 >= 0.15 and not tiers.behind.batches  # waited, applied
    seq = engine.session(sid).seq
    t = tiers.blocks.table(seq)
    assert t.num_tokens == 99 and not t.archived[:, t.num_tokens // 16 :].any()
    other = random_prompt(120, VOCAB_SIZE, seed=6)
    engine.append(sid, token_ids=other)
    plain.append(twin, token_ids=ids[:100] + other)
    _drain(engine)
    _check_archived_blocks(engine)
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    engine.close()
    plain.close()


def test_a_purge_does_not_wait_for_the_writes_of_what_it_deletes(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Writes held back (each batch waits to read its DDR slots): purging their session returns
    at once (its batches not started are cancelled, those under way abandoned), its DDR slots come
    back once the writes end, the records they write after the purge are deleted too, and the
    other session's writes and tokens go on as an untiered engine's."""
    engine = _engine(checkpoint(MODEL), tmp_path)
    plain = make_engine(checkpoint(MODEL))
    gate = threading.Event()
    tiers = engine.runner.tiers
    archive = tiers.archive
    assert archive is not None
    ids, other = random_prompt(300, VOCAB_SIZE, seed=7), random_prompt(150, VOCAB_SIZE, seed=8)
    gone, sid, twin = engine.create_session(), engine.create_session(), plain.create_session()
    engine.append(gone, token_ids=ids)
    seq = engine.session(gone).seq
    name = tiers.sessions[seq].name
    read = tiers.ddr.read

    def held(slots: Any) -> Any:
        if threading.current_thread().name.startswith("h3d-write-behind"):
            gate.wait(30)
        return read(slots)

    monkeypatch.setattr(tiers.ddr, "read", held)
    behind = tiers.behind
    behind.per_batch = 4  # (blocks a batch: more batches than write-behind's threads)
    behind.release()
    engine.write_behind()
    mine = [x for x in behind.batches if x.seq == seq]
    assert len(mine) > WRITE_BEHIND_THREADS  # some under way (held), the others queued
    free = tiers.blocks.ddr_alloc.num_free
    purged = threading.Event()
    closer = threading.Thread(target=lambda: (engine.close_session(gone, purge=True), purged.set()))
    closer.start()
    if not purged.wait(5):  # it waits for the writes: let them go, then fail
        gate.set()
        closer.join()
        pytest.fail("the purge waited for the writes of the KV it deletes")
    assert all(x.abandoned for x in behind.batches)  # the cancelled ones are gone
    assert 0 < len(behind.batches) < len(mine)
    assert tiers.blocks.ddr_alloc.num_held > 0 and tiers.blocks.ddr_alloc.num_free > free
    engine.append(sid, token_ids=other)  # another session goes on meanwhile
    plain.append(twin, token_ids=other)
    gate.set()
    _drain(engine)
    assert not behind.batches and tiers.blocks.ddr_alloc.num_held == 0
    assert name not in archive.sessions()  # what the abandoned batches wrote: deleted again
    assert _all_full_blocks_archived(engine) and _check_archived_blocks(engine) > 0
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    engine.close()
    plain.close()


def test_the_archive_capacity_stops_write_behind(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """ssd_capacity_mb of 10 blocks: write-behind writes no batch past it (the rest stays dirty,
    and the room it wanted is asked for); `auto` is the file system's free space less a margin."""
    engine = _engine(checkpoint(MODEL), tmp_path, ssd_capacity_mb=10 * SLOT_BYTES / 2**20, ddr_mb=64.0)
    sid = engine.create_session()
    engine.append(sid, token_ids=random_prompt(300, VOCAB_SIZE, seed=9))
    _drain(engine)
    archive = engine.runner.tiers.archive
    assert archive is not None and archive.live_bytes() <= 10 * SLOT_BYTES
    assert engine.tier_stats().dirty_bytes > 0 and engine.runner.tiers.behind.wants_room > 0
    engine.close()

    auto = _engine(checkpoint(MODEL), tmp_path / "auto")
    cap = auto.runner.tiers.ssd_capacity
    assert cap is not None and cap > 0
    auto.close()
    with pytest.raises(ConfigError, match="write_behind_dirty_mb"):
        _engine(checkpoint(MODEL), tmp_path / "bad", write_behind_dirty_mb=-1)
    with pytest.raises(ConfigError, match="ssd_capacity_mb"):
        _engine(checkpoint(MODEL), tmp_path / "bad", ssd_capacity_mb="lots")


def test_a_resumed_session_is_read_back_on_several_threads_and_continues_the_same(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """After a restart without a digest snapshot (a kill -9 before the checkpoint wrote it), a
    session's first step reads its whole archived KV into DDR at once, its records decoded on
    several threads (pieces of 8 here), before its digests are rebuilt from it; its generation
    equals the uninterrupted engine's. (With a snapshot: tests/tiers/test_resume.py.)"""
    from h3d.tiers import mover

    monkeypatch.setattr(mover, "READ_PIECE", 8)
    folder = tmp_path / "data"
    kw: dict[str, Any] = {"session_log_path": str(folder / "sessions"), "ddr_mb": 64.0}
    engine = _engine(checkpoint(MODEL), folder, **kw)
    plain = make_engine(checkpoint(MODEL))
    ids = random_prompt(300, VOCAB_SIZE, seed=31)
    sid, twin = engine.create_session(), plain.create_session()
    engine.append(sid, token_ids=ids)
    plain.append(twin, token_ids=ids)
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    engine.checkpoint()
    engine.close()
    DigestFiles(folder / "archive" / "digests", "").remove(sid)

    engine = _engine(checkpoint(MODEL), folder, **kw)
    tiers = engine.runner.tiers
    seq = engine.session(sid).seq
    blocks = tiers.blocks.table(seq).num_blocks * 3
    assert tiers.blocks.table(seq).archive_only().all()
    threads: set[str] = set()
    read_piece = tiers.mover._read_piece
    another = threading.Event()  # a second thread took a piece

    def spy(*args: Any) -> None:
        name = threading.current_thread().name
        if threads and name not in threads:
            another.set()
        first = not threads
        threads.add(name)
        if first:  # the first piece waits (a while) for another thread to take one: not a race on a busy host
            another.wait(5.0)
        read_piece(*args)

    monkeypatch.setattr(tiers.mover, "_read_piece", spy)
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert engine.tier_stats().ssd_read_count == blocks and engine.tier_stats().kv_rebuild_blocks == 0
    assert len(threads) > 1 and all(name.startswith("h3d-archive-read") for name in threads)
    engine.close()
    plain.close()


def test_a_checkpoint_writes_dirty_blocks_on_the_write_behind_threads(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Within its budget nothing is written behind; SIGTERM's checkpoint then writes the dirty
    full blocks on write-behind's threads and only the partial last blocks by snapshot (which
    leaves them unmarked: new tokens go there), and every block is durable."""
    engine = _engine(checkpoint(MODEL), tmp_path, write_behind_dirty_mb=1024, ddr_mb=64.0)
    ids = random_prompt(300, VOCAB_SIZE, seed=41)
    sid = engine.create_session()
    engine.append(sid, token_ids=ids)
    engine.kv.tiers.behind.release()  # (the hold it made way for the prompt with: over)
    assert not engine.write_behind() and engine.tier_stats().write_behind_bytes == 0
    t = engine.runner.blocks.table(engine.session(sid).seq)
    full, partial = t.num_tokens // 16, int(t.num_tokens % 16 > 0)
    done = engine.checkpoint()
    assert done.blocks_written == (full + partial) * 3 and done.blocks_left == 0
    assert engine.tier_stats().write_behind_bytes == full * 3 * SLOT_BYTES  # the full ones, on its threads
    assert t.archived[:, :full].all() and engine.tier_stats().dirty_bytes == 0  # the partial one stays unmarked
    engine.close()


def test_write_behind_makes_way_for_a_prompt_for_a_bounded_time(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """While a request waits for its first token (and just after a session is made), write-behind
    submits nothing and a batch not started waits; the hold ends a margin after the last request
    that asked for it; a step that waits for a batch ends the hold. The tokens are the untiered
    engine's throughout. (How long holds last: the next test.)"""
    from h3d.tiers import writebehind

    monkeypatch.setattr(writebehind, "WRITE_BEHIND_HOLD_S", 30.0)  # (first: never reached)
    monkeypatch.setattr(writebehind, "HOLD_MARGIN_S", 0.3)
    engine = _engine(checkpoint(MODEL), tmp_path)
    plain = make_engine(checkpoint(MODEL))
    behind = engine.runner.tiers.behind
    ids = random_prompt(200, VOCAB_SIZE, seed=71)
    sid, twin = engine.create_session(), plain.create_session()
    assert behind.held and behind.holds == 1  # (a session made: its request comes next)
    engine.append(sid, token_ids=ids)
    assert behind.held and behind.written_blocks == 0 and not behind.batches  # every step made way
    assert engine.write_behind() and not behind.batches  # (idle: still held, call again soon)
    # A thread about to start a batch waits for the hold's end (HOLD_MARGIN_S after the last call).
    behind.hold_back()
    t0 = time.monotonic()
    waited = threading.Thread(target=behind._wait_turn)
    waited.start()
    waited.join(5)
    assert 0.2 <= time.monotonic() - t0 <= 1.0 and not behind.held
    _drain(engine)
    assert behind.written_blocks > 0 and _all_full_blocks_archived(engine)
    # A wait for the batches ends a hold.
    behind.hold_back()
    assert behind.held
    behind.poll(wait=True)  # a wait for the batches ends it
    assert not behind.held
    plain.append(twin, token_ids=ids)
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    engine.close()
    plain.close()


def test_holds_spend_a_budget_that_unheld_time_earns_back(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """On a fake clock: under prompts that keep asking, a hold lasts at most WRITE_BEHIND_HOLD_S in
    a row and write-behind is held at most about half of the time; a chat's next turn, 0.3 s after
    the first turn's long prompt had its first token, is held for its whole prefill (the rule
    before, a hold only 2 x WRITE_BEHIND_HOLD_S after the last one began, held it not at all)."""
    from h3d.tiers.writebehind import HOLD_MARGIN_S, WRITE_BEHIND_HOLD_S

    engine = _engine(checkpoint(MODEL), tmp_path)
    behind = engine.runner.tiers.behind
    now = [1000.0]
    behind.clock = lambda: now[0]
    tick = 0.01

    def ask(seconds: float, asking: bool = True) -> list[bool]:
        """Every tick for `seconds`: a step (asking for a hold if `asking`); whether held after it."""
        held = []
        for _ in range(round(seconds / tick)):
            if asking:
                behind.hold_back()
            held.append(behind.held)
            now[0] += tick
        return held

    def longest_run(held: list[bool]) -> float:
        run = best = 0
        for h in held:
            run = run + 1 if h else 0
            best = max(best, run)
        return best * tick

    # A long first prompt: held from its first step, WRITE_BEHIND_HOLD_S at most in a row.
    first = ask(2.2)
    assert first[0] and longest_run(first) <= WRITE_BEHIND_HOLD_S + tick
    assert behind.holds >= 2  # (held again once the budget came back)
    # Its reply decodes for 0.3 s (nothing waits for a first token), then the next turn comes:
    # held for its whole prefill (0.2 s).
    assert not any(ask(0.3, asking=False)[round(HOLD_MARGIN_S / tick) + 1 :])
    second = ask(0.2)
    assert all(second)
    # Under prompts that never stop, held at most about half of the time.
    steady = ask(30.0)
    assert 0.3 <= sum(steady) / len(steady) <= 0.5 + 2 * tick / HOLD_MARGIN_S
    assert longest_run(steady) <= WRITE_BEHIND_HOLD_S + tick
    # A wait for the batches ends the hold in force.
    behind.hold_back()
    behind.release()
    assert not behind.held
    engine.close()


def test_a_session_closed_later_is_parked_once_its_blocks_are_written_behind(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`close_session(later=True)` (the daemon's CloseSession and idle closes): the engine thread
    writes none of the session's dirty full blocks; write-behind writes them, past its budget, and
    the session is parked between steps once they are durable (the engine thread then writes its
    partial blocks only). Reopened before that, it finds its KV where it was (nothing read back);
    reopened after, it reads it back. Tokens equal the untiered engine's throughout, and a
    session still being parked when the engine closes is parked then (a restart reads it back)."""
    from h3d.tiers import lifecycle

    folder = tmp_path / "data"
    engine = _engine(checkpoint(MODEL), folder, write_behind_dirty_mb=64, session_log_path=str(folder / "logs"))
    plain = make_engine(checkpoint(MODEL))
    kv, tiers = engine.kv, engine.kv.tiers
    written: list[int] = []  # full blocks the engine thread writes (a snapshot's), per call
    snapshot = lifecycle._snapshot

    def spy(tiers_: Any, seq: SeqId, partial: bool) -> int:
        t = tiers_.blocks.table(seq)
        full = t.num_tokens // tiers_.blocks.block_size
        before = int(tiers_.blocks.entries.archived[t.ids[:, :full]].sum())
        n = snapshot(tiers_, seq, partial)
        written.append(int(tiers_.blocks.entries.archived[t.ids[:, :full]].sum()) - before)
        return n

    monkeypatch.setattr(lifecycle, "_snapshot", spy)
    ids = random_prompt(300, VOCAB_SIZE, seed=51)
    sid, twin = engine.create_session(), plain.create_session()
    engine.append(sid, token_ids=ids)
    plain.append(twin, token_ids=ids)
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    seq = engine.session(sid).seq
    table = tiers.blocks.table(seq)
    assert not table.archived[:, : table.num_tokens // 16].any()  # all dirty: within the 64 MiB budget

    engine.close_session(sid, later=True)  # reopened at once: its KV where it was
    assert set(kv.parking) == {seq} and not written
    reads = tiers.counters.ssd_read_count
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert not kv.parking and tiers.counters.ssd_read_count == reads

    engine.close_session(sid, later=True)  # left alone: written behind, then parked
    _drain(engine)
    engine.upkeep()
    assert not kv.parking and table.archive_only().all()
    assert written == [0]  # the engine thread wrote no full block: write-behind had
    assert engine.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert tiers.counters.ssd_read_count > reads  # read back

    engine.close_session(sid, later=True)
    assert set(kv.parking) == {seq}
    engine.close()  # parked now
    again = _engine(checkpoint(MODEL), folder, write_behind_dirty_mb=64, session_log_path=str(folder / "logs"))
    assert again.complete(sid, "", GREEDY).token_ids == plain.complete(twin, "", GREEDY).token_ids
    assert again.tier_stats().kv_rebuild_blocks == 0
    again.close()
    plain.close()


def test_forks_closed_later_write_their_shared_blocks_once(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """A parent and its forks closed together (`later`): write-behind writes each shared block
    once, whichever session's batch takes it (another session's batch in flight is not written
    again), and each session is parked with links to those records; all continue exactly."""
    folder = tmp_path / "data"
    engine = _engine(checkpoint(MODEL), folder, write_behind_dirty_mb=64)
    plain = make_engine(checkpoint(MODEL))
    ids = random_prompt(300, VOCAB_SIZE, seed=53)
    parent, twin = engine.create_session(), plain.create_session()
    engine.append(parent, token_ids=ids)
    plain.append(twin, token_ids=ids)
    forks = [engine.fork(parent) for _ in range(3)]
    behind, blocks = engine.kv.tiers.behind, engine.kv.blocks
    full = len(ids) // 16
    for sid in [parent, *forks]:
        engine.close_session(sid, later=True)
    _drain(engine)
    engine.upkeep()
    assert not engine.kv.parking
    assert behind.written_blocks == full * len(blocks.full_layers)  # the shared blocks once
    want = plain.complete(twin, "", GREEDY).token_ids
    for sid in [parent, *forks]:
        assert engine.complete(sid, "", GREEDY).token_ids == want
    engine.close()
    plain.close()


def test_full_ddr_drops_copies_of_hbm_blocks_before_blocks_a_step_reads(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """Sessions whose KV fits HBM and DDR together, with little to spare: when DDR passes its
    watermark, the copies it holds of blocks also in HBM go first, so that no block is left in the
    archive only to be staged back by the next steps (and dropped again: with both kinds dropped
    in one pass, every decode step staged blocks from the archive). Tokens equal an engine whose
    HBM holds everything."""
    n, tokens = 6, 320
    blocks = n * (tokens // 16 + 2) * 3  # every layer's blocks, with the decode's
    kw: dict[str, Any] = {
        "hbm_mb": 0.75 * blocks * SLOT_BYTES / 2**20,
        "ddr_mb": 0.40 * blocks * SLOT_BYTES / 2**20,
        "prefill_chunk_tokens": 512,
        "check_invariants": True,
    }
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)

    def run(engine: Engine) -> tuple[list[list[int]], int]:
        vocab = engine.model.config.vocab_size
        sids = [engine.create_session() for _ in range(n)]
        for i, sid in enumerate(sids):
            engine.append(sid, token_ids=random_prompt(tokens, vocab, seed=70 + i))
        _drain(engine)
        rids = {engine.submit(sid, generate=True, params=params): i for i, sid in enumerate(sids)}
        out: list[list[int]] = [[] for _ in sids]
        steps, reads = 0, 0
        while engine.requests():
            engine.upkeep()
            for event in engine.step():
                if isinstance(event, TokenDelta):
                    out[rids[event.request_id]].append(event.token_id)
            steps += 1
            if steps == 4:  # (the first steps read back what the appends left in the archive only)
                reads = engine.tier_stats().ssd_read_count
        return out, engine.tier_stats().ssd_read_count - reads

    tight = _engine(checkpoint(MODEL), tmp_path / "tight", **kw)
    got, staged = run(tight)
    stats = tight.tier_stats()
    assert (
        stats.ddr_evict_count > 0 and stats.hbm_rebalance_count + stats.promote_count > 0
    )  # DDR was full, blocks moved
    assert staged == 0, f"{staged} blocks staged from the archive after the first steps"
    want, _ = run(make_engine(checkpoint(MODEL), hbm_mb=64.0, ddr_mb=16.0))
    assert got == want


def test_digest_snapshots_count_against_the_archive_capacity(checkpoint: Callable[[str], Path], tmp_path: Path) -> None:
    """The digest snapshots beside the archive (a closed session's, written when it is parked)
    and room for the next snapshot of each session whose digests are on the device count
    against ssd_capacity_mb with the records: with a capacity the records alone fit in,
    write-behind stops short of the snapshots (where only the records counted, a run of 32
    sessions filled the disk: their snapshots took 16 GB beside the records)."""
    engine = _engine(checkpoint(MODEL), tmp_path, ddr_mb=64.0)
    kv, tiers = engine.runner.kv, engine.runner.tiers
    files, archive = kv.digest_files, tiers.archive
    assert files is not None and archive is not None
    first = engine.create_session()
    engine.append(first, token_ids=random_prompt(200, VOCAB_SIZE, seed=3))
    seq = engine.session(first).seq
    room = 200 // kv.block_size * kv.digests.row_bytes * kv.digests.parts
    assert kv.digests.has(seq) and room > 0
    assert kv.snapshot_bytes() >= room  # its digests are on the device: room for its snapshot
    engine.close_session(first)  # parked: its KV archived, its snapshot written
    files.settle()
    assert files.disk_bytes() == files.path(first).stat().st_size >= room
    assert kv.snapshot_bytes() == files.disk_bytes()
    kept = engine.cached_tokens(first)
    second = engine.create_session()
    prompt = random_prompt(300, VOCAB_SIZE, seed=4)
    records = 300 // kv.block_size * tiers.blocks.num_layers * SLOT_BYTES
    tiers.ssd_capacity = archive.live_bytes() + records + SLOT_BYTES  # the records fit, not the snapshots
    engine.append(second, token_ids=prompt)
    _drain(engine)
    assert archive.live_bytes() + kv.snapshot_bytes() <= tiers.ssd_capacity
    assert tiers.ssd_used() == archive.live_bytes() + kv.snapshot_bytes()
    assert tiers.behind.wants_room > 0 and engine.tier_stats().dirty_bytes > 0
    assert engine.tier_stats().ssd_used_bytes == tiers.ssd_used()
    assert engine.cached_tokens(first) == kept > 0  # (the closed session's archived KV was not evicted for it)
    engine.close()
