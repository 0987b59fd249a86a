"""Purging a session gives its archived KV's disk space back (issue 16, task 7).

`close_session(purge=True)` drops the session's manifest entries (a tombstone) and asks the
archive for a compaction on its own thread (`Archive.compact_later`); the folder's bytes on disk
drop by about the purged session's share, and the other sessions' KV, moved by the compaction,
is still read back exactly: they continue as an engine that never closed them, before and after
a restart. A purge whose tombstone the archive refuses still deletes the session.
"""

from __future__ import annotations

import errno
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import VOCAB_SIZE, make_engine, random_prompt

from h3d.engine.sampling import SamplingParams
from h3d.errors import SessionNotFound
from h3d.store.files import FileOps
from h3d.tiers.archive import Archive

MODEL = "llama_gqa4_tied"


def folder_bytes(folder: Path) -> int:
    """What the folder's files take, by their sizes (segments, manifest, identity, lock)."""
    return sum(p.stat().st_size for p in folder.iterdir() if p.is_file())


def test_purge_frees_the_archive_space_and_keeps_the_other_sessions(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    folder = tmp_path / "archive"
    kw = {"ssd_path": str(folder), "session_log_path": str(tmp_path / "sessions")}
    engine = make_engine(checkpoint(MODEL), **kw)
    twin = make_engine(checkpoint(MODEL))  # never closes anything: the reference
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    prompts = [random_prompt(299, VOCAB_SIZE, seed=160 + i) for i in range(3)]
    sids, twins = [], []
    for ids in prompts:
        sid, t = engine.create_session(), twin.create_session()
        engine.append(sid, token_ids=ids)
        twin.append(t, token_ids=ids)
        engine.close_session(sid)  # its KV, the partial last block too, to the archive only
        sids.append(sid)
        twins.append(t)
    archive = engine.runner.tiers.archive
    assert archive is not None
    live, before = archive.live_bytes(), folder_bytes(folder)
    assert archive.disk_bytes() == live  # nothing dead yet

    engine.close_session(sids[1], purge=True)
    share = live - archive.live_bytes()  # the purged session's records
    assert share > 0.3 * live
    assert archive.wait_compactions(timeout=60)
    after = folder_bytes(folder)
    print(f"live {live} B, purged share {share} B, folder {before} -> {after} B (dropped {before - after} B)")
    assert archive.disk_bytes() == archive.live_bytes() == live - share  # no dead record left on disk
    assert share <= before - after <= 1.1 * share  # the share, and the manifest's lines of it

    survivors = [(sids[0], twins[0]), (sids[2], twins[2])]
    for sid, t in survivors:  # their records were moved by the compaction: read back, not recomputed
        assert engine.complete(sid, "", params).token_ids == twin.complete(t, "", params).token_ids
    assert engine.tier_stats().kv_rebuild_blocks == 0 and engine.tier_stats().ssd_read_count > 0
    engine.runner.tiers.check()
    engine.checkpoint()
    engine.close()

    engine = make_engine(checkpoint(MODEL), **kw)  # a restart reads the rewritten manifest
    assert sorted(engine.sessions) == sorted(s for s, _ in survivors)
    for sid, t in survivors:
        assert engine.complete(sid, "", params).token_ids == twin.complete(t, "", params).token_ids
    assert engine.tier_stats().kv_rebuild_blocks == 0
    archive = engine.runner.tiers.archive
    assert archive is not None
    keys, identity = archive.keys(), archive.identity
    engine.close()
    twin.close()
    with Archive(folder, identity) as reopened:
        assert reopened.keys() == keys and not reopened.blocks_of(sids[1])
        for key in keys:
            reopened.get(key)


def test_purge_with_a_failing_archive_still_deletes_the_session(
    checkpoint: Callable[[str], Path], tmp_path: Path
) -> None:
    """The purge's tombstone is refused (a full disk): the SSD tier is marked degraded, and the
    session is deleted all the same (its log, its memory, its id); the others keep serving."""
    kw = {"ssd_path": str(tmp_path / "archive"), "session_log_path": str(tmp_path / "sessions")}
    engine = make_engine(checkpoint(MODEL), ssd_retry_interval_s=3600, **kw)
    twin = make_engine(checkpoint(MODEL))
    params = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    gone, kept, t = engine.create_session(), engine.create_session(), twin.create_session()
    for sid, ids in ((gone, random_prompt(120, VOCAB_SIZE, seed=1)), (kept, random_prompt(90, VOCAB_SIZE, seed=2))):
        engine.append(sid, token_ids=ids)
    twin.append(t, token_ids=random_prompt(90, VOCAB_SIZE, seed=2))
    engine.close_session(gone)  # archived

    class FullDisk(FileOps):
        def write_all(self, fd: int, data: bytes, offset: int) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

    archive = engine.runner.tiers.archive
    assert archive is not None
    archive.files = FullDisk()  # the disk fills up under the running engine
    engine.close_session(gone, purge=True)
    assert engine.tier_stats().ssd_degraded
    with pytest.raises(SessionNotFound):
        engine.session(gone)
    assert not list((tmp_path / "sessions").glob(f"{gone}*"))
    assert engine.complete(kept, "", params).token_ids == twin.complete(t, "", params).token_ids
    engine.runner.tiers.check()
    engine.close()
    twin.close()
