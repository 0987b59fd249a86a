"""Which cache archived blocks belong to, the checks that keep them there, and the archive's errors.

A store belongs to one cache: `identity.json` in its folder names the model fingerprint, dtype,
block geometry and the store's format (`STORE_FORMAT`). `check_identity` creates it, or refuses a
store written for another cache (ArchiveMismatch): blocks are never reused across models or
layouts. Each record names its cache and its block again in its header (`record_header`, whose
format is the record's own, `h3d.tiers.codecs.FORMAT_VERSION`). What must stay true:
- `verify_record` returns a record's payload only after its crc matches and its header matches the
  archive's identity and the key asked for, every field compared (ArchiveCorrupt /
  ArchiveMismatch otherwise);
- an error's message names the block, file and offset at fault.
The errors live here, below every other archive module, so that each raises the same classes.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, fields
from pathlib import Path

from h3d.errors import H3Error
from h3d.store.files import replace_file
from h3d.tiers.codecs import CODECS_BY_ID, DTYPES, FORMAT_VERSION, Codec, RecordHeader, unpack_record
from h3d.tiers.segments import Loc

log = logging.getLogger(__name__)

# The store's layout, in identity.json. 1: each session's blocks in records of their own. 2: a
# session's block may point at a record written under another session's name (`Archive.link`),
# which a reader of format 1 would refuse as corrupt. A store of format 1 is one of format 2 with
# no links: opening it rewrites identity.json and nothing else.
STORE_FORMAT = 2


class ArchiveError(H3Error):
    """The SSD archive cannot do what was asked (in use, closed, or a write failed)."""


class ArchiveCorrupt(ArchiveError):
    """Stored bytes fail their checksum or are malformed; the message names the block, file and offset.
    `key` is the block, when one block's record is at fault (not the whole archive)."""

    def __init__(self, message: str, key: BlockKey | None = None) -> None:
        super().__init__(message)
        self.key = key


class ArchiveWriteFailed(ArchiveError):
    """A write to the archive failed (a full disk, an I/O error): nothing of it counts, and the
    archive takes no more writes until `Archive.recover` succeeds."""


class ArchiveMismatch(ArchiveError):
    """Stored data belongs to another cache (model, dtype, geometry, codec, format); names the field."""


@dataclass(frozen=True, slots=True)
class CacheIdentity:
    """What archived blocks are only valid for. `fingerprint` identifies the model weights (hex)."""

    fingerprint: str
    dtype: str  # "fp32", "bf16" or "fp16"
    block_size: int
    num_kv_heads: int
    head_dim: int

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"CacheIdentity.dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")


@dataclass(frozen=True, slots=True)
class BlockKey:
    session: str
    layer: int
    index: int  # block index within the session's layer


def describe(key: BlockKey, loc: Loc | None = None) -> str:
    linked = f", linked to session {loc.home!r}'s record" if loc is not None and loc.home is not None else ""
    return f"archived block (session {key.session!r}, layer {key.layer}, block {key.index}{linked})"


def check_identity(folder: Path, identity: CacheIdentity) -> None:
    """Create identity.json, or refuse a store written for another cache (or a newer h3d); a
    store of an older format is migrated (`STORE_FORMAT`)."""
    want = {"format": STORE_FORMAT, **{f.name: getattr(identity, f.name) for f in fields(CacheIdentity)}}
    file = folder / "identity.json"
    if not file.exists():
        replace_file(file, json.dumps(want, indent=1).encode())
        return
    try:
        found = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ArchiveCorrupt(f"{file} is unreadable ({e}); delete the folder to start a new archive") from e
    stored = found.get("format") if isinstance(found, dict) else None
    if isinstance(stored, int) and stored > STORE_FORMAT:
        raise ArchiveMismatch(
            f"KV archive {folder} is of format {stored}, written by a newer h3d (this one reads up to "
            f"{STORE_FORMAT}); run that version, or point the archive at another folder"
        )
    for name, expected in want.items():
        got = found.get(name) if isinstance(found, dict) else None
        if got != expected and not (name == "format" and got == 1):
            raise ArchiveMismatch(
                f"KV archive {folder} belongs to another cache: {name} expected {expected!r}, found "
                f"{got!r}; point the archive at another folder or delete this one"
            )
    if stored != STORE_FORMAT:
        replace_file(file, json.dumps(want, indent=1).encode())
        log.info("KV archive %s: store format %s migrated to %d", folder, stored, STORE_FORMAT)


def record_header(identity: CacheIdentity, key: BlockKey, num_tokens: int, codec_id: int) -> RecordHeader:
    """The header a record of `key` must carry in this archive (the reader compares all fields)."""
    i = identity
    return RecordHeader(
        FORMAT_VERSION, codec_id, i.dtype, i.fingerprint, i.block_size, i.num_kv_heads, i.head_dim,
        key.session, key.layer, key.index, num_tokens,
    )  # fmt: skip


def verify_record(
    identity: CacheIdentity, want_codec: Codec, key: BlockKey, loc: Loc, data: bytes | memoryview, where: str
) -> tuple[Codec, memoryview]:
    """Check the record's crc, then that it is the block asked for, of this cache. -> (codec, payload).
    `want_codec`: the codec the archive writes `key`'s layer with (a lossless one is taken too).
    A linked record (`loc.home`) carries its home's name: the header is compared with that; the
    errors name `key`, the block asked for."""
    try:
        if len(data) != loc.length:
            raise ValueError(f"record is truncated ({len(data)} of {loc.length} bytes)")
        found, crc, payload = unpack_record(data)
        if crc != loc.crc:
            raise ValueError("checksum differs from the manifest's")
    except ValueError as e:
        raise ArchiveCorrupt(f"{describe(key, loc)} is corrupt: {e}, in {where}", key) from e
    own = key if loc.home is None else BlockKey(loc.home, key.layer, key.index)
    want = record_header(identity, own, loc.num_tokens, found.codec_id)
    if found != want:  # one comparison of the whole header; the loop only names what differs
        for f in fields(RecordHeader):
            expected, got = getattr(want, f.name), getattr(found, f.name)
            if expected != got:
                raise ArchiveMismatch(f"{describe(key, loc)} in {where}: {f.name} expected {expected!r}, found {got!r}")
    codec = CODECS_BY_ID.get(found.codec_id)
    if codec is None or not (codec is want_codec or codec.lossless):
        name = codec.value if codec else f"id {found.codec_id}"
        raise ArchiveMismatch(
            f"{describe(key, loc)} in {where}: codec expected {want_codec.value} (or lossless), found {name}"
        )
    return codec, payload
