"""The archive's segment files, `seg-NNNNNN.h3kv`, and where a record lies in them (`Loc`).

A segment is append-only: records (`h3d.tiers.codecs.pack_record`: a header naming format
version, codec, dtype, geometry, fingerprint, session, layer and block, a crc32 of header and
payload, then the payload) one after the other. A batch starts a new segment once the active one
has passed `segment_bytes` (the appends are the archive's: `h3d.tiers.archive`). What must stay
true:
- segment bytes no manifest entry points at (a crash between data and manifest) are ignored, and
  cut off at the next open (`trim_segments`);
- at open, segments no live entry points into are deleted (the last one excepted), segment numbers
  are never reused, and nothing is appended after a hole (committed bytes gone missing);
- a segment's name is durable (its folder fsynced, `h3d.store.files.fsync_dir`) before any manifest
  entry names it.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from h3d.store.files import FileOps, fsync_dir
from h3d.tiers.codecs import Codec

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Loc:
    """A record's place: its segment, offset and length, with the tokens, codec and crc it holds.
    `home`: the session whose name the record's header carries, when that is not the session of
    the key pointing at it (a linked record, `Archive.link`); None for a session's own record."""

    segment: int
    offset: int
    length: int
    num_tokens: int
    codec: Codec
    crc: int
    home: str | None = None


def segment_path(folder: Path, n: int) -> Path:
    return folder / f"seg-{n:06d}.h3kv"


def segment_sizes(folder: Path) -> dict[int, int]:
    """Segment number -> its size on disk, for the segments there now."""
    sizes = {}
    for p in folder.glob("seg-*.h3kv"):
        if p.stem[4:].isdigit():
            with contextlib.suppress(FileNotFoundError):  # deleted by a compaction meanwhile
                sizes[int(p.stem[4:])] = p.stat().st_size
    return sizes


def open_segment(files: FileOps, folder: Path, n: int) -> int:
    """Segment `n` opened for writing through `files`, created (and its name made durable) if missing.
    -> the descriptor."""
    fd, created = files.open_or_create(segment_path(folder, n), os.O_WRONLY)
    if created:
        try:
            files.fsync_dir(folder)
        except BaseException:
            os.close(fd)
            raise
    return fd


def trim_segments(folder: Path, live: dict[int, int], ends: dict[int, int]) -> tuple[int, int, int]:
    """Cut bytes no entry points at (left by a crash mid-put); delete the segments no live entry
    points into (left by a compaction that stopped before its deletes), the last one excepted.
    `live`: each segment -> bytes of its records the index points at (the deleted ones dropped);
    `ends`: each segment any entry names -> the end of its last record.
    -> (active segment, its size, the next unused segment number)."""
    sizes = segment_sizes(folder)
    in_use = {n for n, b in live.items() if b > 0}
    last = max([*sizes, *in_use], default=1)
    dead = [n for n in sizes if n not in in_use and n != last]
    for n in dead:
        segment_path(folder, n).unlink()
        live.pop(n, None)
        del sizes[n]
    if dead:
        log.info("KV archive %s: deleted %d segments that held no live record", folder, len(dead))
        fsync_dir(folder)
    for n, size in sizes.items():
        end = ends.get(n, 0)
        if size > end:
            log.warning(
                "KV archive %s: ignoring %d uncommitted bytes at offset %d", segment_path(folder, n), size - end, end
            )
            os.truncate(segment_path(folder, n), end)
    next_no = max([last, *ends]) + 1  # numbers the manifest still names are never reused
    if sizes.get(last, 0) < ends.get(last, 0):  # committed bytes went missing: never append after a hole
        log.warning("KV archive %s: segment %d is shorter than its manifest says", folder, last)
        return next_no, 0, next_no + 1
    return last, ends.get(last, 0), next_no
