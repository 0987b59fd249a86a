"""The archive's manifest log, `manifest.log`: the durable map from blocks to their records' places.

One line per change, `<crc32 hex> <json>` (`encode_lines`): `put` (`put_entry`) maps a BlockKey to
its record's place (a `Loc`), `puts` (`puts_entry`) maps many of one session's (a bulk write's,
`Archive.put_blocks`: its fields as lists), `del` (`del_entry`) drops a session's blocks (all of them, or those
from a block index on: `from`). A `put` or `puts` entry may name, in `h`, the session whose record
a key points at when it is not the key's own (a linked record, `Archive.link`: several sessions'
keys, one record; store format 2). Replaying it (`replay`) gives
the live index; the last entry for a key wins. What must stay true:
- a torn tail (partial or bad-crc last lines) is truncated at open; a bad line followed by good
  ones is real corruption and refuses to open (ArchiveCorrupt); an entry of an unknown format
  refuses too (ArchiveMismatch);
- what `encode_lines` writes, `replay` reads back as it was.
Appending the lines, and a compaction's rewrite renamed over the file, are the archive's
(`h3d.tiers.archive`): an entry only points at record bytes fsynced before it was written.
"""

from __future__ import annotations

import json
import logging
import os
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

from h3d.store.files import create_file, fsync_dir
from h3d.tiers.codecs import Codec
from h3d.tiers.identity import ArchiveCorrupt, ArchiveMismatch, BlockKey
from h3d.tiers.segments import Loc

log = logging.getLogger(__name__)

Place = Callable[[BlockKey, Loc], None]  # point the index at a record's place
Forget = Callable[[str, int], object]  # drop a session's blocks from an index on (0: all) from the index


def replay(folder: Path, place: Place, forget: Forget) -> tuple[dict[int, int], int]:
    """Rebuild the index from `folder`'s manifest.log (created if missing) through `place` and
    `forget`, truncating a torn tail; delete a rewritten manifest a compaction never renamed into place.

    -> ({segment: end of its last record}, manifest length)."""
    file = folder / "manifest.log"
    if not file.exists():
        os.close(create_file(file, os.O_WRONLY))
        fsync_dir(folder)
    ends: dict[int, int] = {}
    good = pos = 0
    bad_at: int | None = None
    with open(file, "rb") as f:
        for line in f:
            entry = _parse_line(line)
            if entry is None:
                bad_at = pos if bad_at is None else bad_at
            elif bad_at is not None:
                raise ArchiveCorrupt(
                    f"{file} is corrupt at offset {bad_at} (valid entries follow a bad one); "
                    "delete the archive folder to start over"
                )
            else:
                _apply(entry, place, forget, ends, file, pos)
                good = pos + len(line)
            pos += len(line)
    if bad_at is not None:
        log.warning("KV archive %s: dropping a torn manifest tail (%d bytes at offset %d)", file, pos - good, good)
        os.truncate(file, good)
    (folder / "manifest.tmp").unlink(missing_ok=True)  # a compaction's, never renamed into place
    return ends, good


def _apply(entry: dict[str, Any], place: Place, forget: Forget, ends: dict[int, int], file: Path, pos: int) -> None:
    try:
        if entry["op"] == "del":
            forget(entry["s"], int(entry.get("from", 0)))
            return
        if entry["op"] == "puts":
            s = entry["s"]
            names = ("l", "i", "seg", "off", "len", "n", "c", "crc")
            homes = entry.get("h") or [None] * len(entry["l"])
            for layer, index, seg, off, length, n, c, crc, home in zip(*(entry[k] for k in names), homes, strict=True):
                place(BlockKey(s, layer, index), Loc(seg, off, length, n, Codec(c), crc, _home(home)))
                ends[seg] = max(ends.get(seg, 0), off + length)
            return
        loc = Loc(
            entry["seg"], entry["off"], entry["len"], entry["n"], Codec(entry["c"]), entry["crc"], _home(entry.get("h"))
        )
        place(BlockKey(entry["s"], entry["l"], entry["i"]), loc)
        ends[loc.segment] = max(ends.get(loc.segment, 0), loc.offset + loc.length)
    except (KeyError, ValueError, TypeError) as e:
        raise ArchiveMismatch(f"{file} offset {pos}: manifest entry of an unknown format ({e!r})") from e


def _home(name: object) -> str | None:
    if name is None or isinstance(name, str):
        return name
    raise TypeError(f"a record's home must be a session name, got {name!r}")


def encode_lines(entries: list[dict[str, Any]]) -> bytes:
    """Manifest lines: the crc32 of the JSON body in 8 hex digits, a space, the body."""
    out = []
    for entry in entries:
        body = json.dumps(entry, separators=(",", ":")).encode()
        out.append(b"%08x %s\n" % (zlib.crc32(body), body))
    return b"".join(out)


def put_entry(key: BlockKey, loc: Loc) -> dict[str, Any]:
    return {
        "op": "put", "s": key.session, "l": key.layer, "i": key.index, "seg": loc.segment, "off": loc.offset,
        "len": loc.length, "n": loc.num_tokens, "c": loc.codec.value, "crc": loc.crc,
    } | ({"h": loc.home} if loc.home is not None else {})  # fmt: skip


def puts_entry(session: str, keys: list[BlockKey], locs: list[Loc]) -> dict[str, Any]:
    """Many of one session's records in one line (a bulk write's, a link's): the `put` entries'
    fields as lists, one element per record (`h` only where one of them is linked)."""
    homes = [x.home for x in locs]
    return {
        "op": "puts", "s": session, "l": [k.layer for k in keys], "i": [k.index for k in keys],
        "seg": [x.segment for x in locs], "off": [x.offset for x in locs], "len": [x.length for x in locs],
        "n": [x.num_tokens for x in locs], "c": [x.codec.value for x in locs], "crc": [x.crc for x in locs],
    } | ({"h": homes} if any(h is not None for h in homes) else {})  # fmt: skip


def del_entry(session: str, first: int = 0) -> dict[str, Any]:
    """Drop `session`'s blocks of index `first` and later (all of them with 0)."""
    return {"op": "del", "s": session} | ({"from": first} if first else {})


def _parse_line(line: bytes) -> dict[str, Any] | None:
    """A manifest line -> its entry, or None if torn or garbled."""
    if len(line) < 11 or not line.endswith(b"\n") or line[8:9] != b" ":
        return None
    body = line[9:-1]
    try:
        if int(line[:8], 16) != zlib.crc32(body):
            return None
        entry = json.loads(body)
    except ValueError:
        return None
    return entry if isinstance(entry, dict) else None
