"""The SSD cold tier: a durable, checksummed, append-only archive of KV blocks.

A store is one folder, owned by one process at a time (an flock on `lock`):
- `identity.json`: the cache the blocks belong to and the format version; opening with another
  identity raises ArchiveMismatch (`h3d.tiers.identity`);
- `seg-NNNNNN.h3kv`: append-only segments of records (`h3d.tiers.segments`);
- `manifest.log`: one checksummed line per change, replayed into the live index at open
  (`h3d.tiers.manifest`).
This module is the `Archive` itself: the lock, the index, writes, reads, deletes and recovery.

Write protocol (`put`): append the records, fsync the segment, then append the manifest lines
and fsync the manifest (and the folder whenever a file is created). What must stay true:
- a manifest entry only points at record bytes that were fsynced before the entry was written, so
  a block is durable exactly when `put` returns;
- what a crash leaves (segment bytes no entry points at, a torn manifest tail) is cut off at the
  next open, as `h3d.tiers.segments` and `h3d.tiers.manifest` say;
- `get` returns a block only after its crc matches and its header matches this archive's identity
  and the key asked for (ArchiveCorrupt / ArchiveMismatch otherwise: `identity.verify_record`).

A block several sessions share is stored once (`link`): the other sessions' keys point at the
record written under the first one's name (`Loc.home`), in a manifest line of their own and
without a byte of KV written again; the reader checks the record's header against its home's key.
A record is live while any key points at it, its own or a linked one, and counted once in
`live_bytes`; deleting its home session leaves it to the others. Linked records are what store
format 2 adds (`h3d.tiers.identity.STORE_FORMAT`); an archive of format 1 opens as it is.

Superseded and deleted records stay in their segments until a compaction (`compact`, or
`compact_later` on the archive's own thread: h3d.tiers.compaction) copies the live records of mostly
dead segments into a new one, renames a rewritten manifest over the old one and deletes those
segments, beside puts, deletes and reads. For it, two more rules: the in-memory index always says
what the durable manifest says, and `get` opens a record's segment while holding the index lock
(so a segment it found is still there when it reads).
Files are created 0600 and the folder 0700, whatever the umask (`h3d.store.files`). The live index
is held in memory.

Seams (what a test passes in or reads, never a private name): every file system call the open
archive makes (writes, fsyncs, truncations, renames, deletes, and opening a segment or the
manifest; the compaction's too) goes through `files`, an `h3d.store.files.FileOps` (the real
calls by default), so a subclass stands for a full disk, a crash between two calls or a slow
disk; `copy_chunk_bytes` and `compaction_hooks` are the compaction's
(`h3d.tiers.compaction`); `compaction_stats`, `active_segment` and `closing` say where the
archive stands; `abandon` lets it go as a process exit would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import logging
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from h3d.store.files import FileOps, make_dirs, open_or_create
from h3d.tiers import compaction
from h3d.tiers.codecs import (
    CODEC_IDS,
    DTYPES,
    Codec,
    decode,
    decode_int8_many,
    decompress_raw,
    decompress_raw_many,
    encode,
    encode_int8_many,
    encode_raw_many,
    record_prefix,
    record_prefixes,
)
from h3d.tiers.compaction import COPY_CHUNK_BYTES, CompactionHooks, CompactionStats
from h3d.tiers.identity import (
    ArchiveCorrupt,
    ArchiveError,
    ArchiveWriteFailed,
    BlockKey,
    CacheIdentity,
    check_identity,
    describe,
    record_header,
    verify_record,
)
from h3d.tiers.manifest import del_entry, encode_lines, put_entry, puts_entry, replay
from h3d.tiers.segments import Loc, open_segment, segment_path, segment_sizes, trim_segments

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12

log = logging.getLogger(__name__)

DEFAULT_SEGMENT_BYTES = 256 * 2**20
# A bulk read (`get_bytes`) reads records that lie next to each other in a segment, or apart by at
# most READ_GAP_BYTES, with one pread of at most READ_RUN_BYTES: records are written in batches
# (write-behind's, a checkpoint's), so a session's blocks lie in runs, and one large read costs
# the disk less than many of a record each (a 128 KiB record is about 0.1 ms at 1.4 GB/s).
READ_RUN_BYTES = 4 * 2**20
READ_GAP_BYTES = 128 * 2**10


@dataclass(frozen=True, slots=True)
class ArchiveStats:
    """Counters since this Archive was opened, except `live_records` (blocks the store holds now,
    counted under each session: a linked record counts once per session pointing at it)."""

    raw_bytes: int  # uncompressed K+V bytes put
    stored_bytes: int  # payload bytes written (after compression, headers excluded)
    records: int  # records written
    reads: int  # blocks returned by get
    live_records: int


@dataclass(slots=True)
class _Records:
    """Encoded records on their way to a segment, as columns: record i is `parts[2i]` (its prefix)
    then `parts[2i + 1]` (its payload), written as they are (no join copies the payloads). `bulk`:
    one session's, given the manifest as one `puts` line."""

    keys: list[BlockKey]
    parts: list[Buffer]
    lengths: list[int]
    tokens: list[int]
    codecs: list[Codec]
    crcs: list[int]
    raw_bytes: int
    payload_bytes: int
    bulk: bool = False


class Archive:
    """An open store. Every public method may be called from any thread.

    `codec` applies to every layer except those in `lossless_layers`, which always use RAW_ZSTD.
    `files`: the file system calls it makes while open (the real ones by default); the attribute
    may be replaced while the archive is open (a test filling the disk under a running engine),
    and the calls made after that go to the new one. `copy_chunk_bytes`: a compaction writes its
    copies in pieces of about this size; `compaction_hooks`: where a caller steps into a
    compaction (`h3d.tiers.compaction.CompactionHooks`; none by default).

    `_write_lock` serializes writers (held across their fsyncs); `_state` guards the index and
    counters only, so readers never wait for a writer's fsync. `_compact_lock` serializes
    compactions, which take `_write_lock` only to plan and to switch the manifest.
    """

    def __init__(
        self,
        path: Path,
        identity: CacheIdentity,
        codec: Codec = Codec.RAW_ZSTD,
        lossless_layers: frozenset[int] = frozenset(),
        *,
        segment_bytes: int = DEFAULT_SEGMENT_BYTES,
        files: FileOps | None = None,
        copy_chunk_bytes: int = COPY_CHUNK_BYTES,
        compaction_hooks: CompactionHooks | None = None,
    ) -> None:
        if copy_chunk_bytes < 1:
            raise ValueError(f"copy_chunk_bytes must be >= 1, got {copy_chunk_bytes}")
        self.path = Path(path)
        self.files = files if files is not None else FileOps()
        self.identity = identity
        self.codec = codec
        self.lossless_layers = frozenset(lossless_layers)
        self._segment_bytes = segment_bytes
        self._copy_chunk_bytes = copy_chunk_bytes
        self._compaction_hooks = compaction_hooks if compaction_hooks is not None else CompactionHooks()
        self._dtype = DTYPES[identity.dtype]
        self._write_lock = threading.Lock()
        self._state = threading.Lock()
        self._index: dict[str, dict[tuple[int, int], Loc]] = {}  # session -> (layer, index) -> place
        self._links: dict[tuple[int, int], int] = {}  # a linked record (segment, offset) -> keys linked to it
        self._seg_paths: dict[int, str] = {}  # segment -> its path (reads name it for every record)
        self._live: dict[int, int] = {}  # segment -> bytes of its records the index points at
        self._live_total = 0  # their sum (read without the lock: the engine thread asks every step)
        self._counts = [0, 0, 0, 0]  # raw_bytes, stored_bytes, records, reads
        self._closed = False
        self._broken: str | None = None  # set when a write failed midway: further writes refused
        self._compact_lock = threading.Lock()
        self._stopping = threading.Event()  # set by close: a compaction stops between two records
        self._compactor = compaction.Compactor(self.compact, f"KV archive {self.path}")
        make_dirs(self.path)
        self._lock_fd = self._take_lock()
        self._seg_fd = self._man_fd = -1
        try:
            check_identity(self.path, identity)
            ends, self._man_size = replay(self.path, self._place, self._forget)
            self._seg_no, self._seg_size, self._next_no = trim_segments(self.path, self._live, ends)
            self._man_fd = self.files.open(self.path / "manifest.log", os.O_WRONLY)
            self._seg_fd = open_segment(self.files, self.path, self._seg_no)
        except BaseException:
            self._close_fds()
            raise

    def _take_lock(self) -> int:
        fd, _ = open_or_create(self.path / "lock", os.O_RDWR)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ArchiveError(f"KV archive {self.path} is already open (another h3d process?)") from None
        return fd

    def _place(self, key: BlockKey, loc: Loc) -> None:
        """Point the index at `loc` for `key` (under `_state`, or while opening)."""
        blocks = self._index.setdefault(key.session, {})
        at = (key.layer, key.index)
        old = blocks.get(at)
        blocks[at] = loc
        if old is not None:
            self._let_go(at, old)
        self._hold(at, loc)

    def _forget(self, session: str, first: int = 0) -> int:
        """Drop `session`'s blocks of index `first` and later from the index (under `_state`, or while opening)."""
        blocks = self._index.get(session, {})
        gone = [key for key in blocks if key[1] >= first]
        for key in gone:
            self._let_go(key, blocks.pop(key))
        if not blocks:
            self._index.pop(session, None)
        return len(gone)

    # A record is live while a key points at it: its own (the key it was written under) or one
    # linked to it (`home` set). Only links are counted (`_links`), so that a session's own
    # records cost no more than their index entry; `_owned` asks the index for the other.

    def _owned(self, at: tuple[int, int], loc: Loc) -> bool:
        """The key `loc` was written under (of `loc.home`, at the same (layer, index)) points at it."""
        own = self._index.get(loc.home, {}).get(at) if loc.home is not None else None
        return own is not None and own.home is None and own.segment == loc.segment and own.offset == loc.offset

    def _hold(self, at: tuple[int, int], loc: Loc) -> None:
        """A key at `at` points at `loc` now (after the index says so): its bytes count as live."""
        record = (loc.segment, loc.offset)
        links = self._links.get(record, 0)
        if loc.home is not None:
            self._links[record] = links + 1
            if links or self._owned(at, loc):
                return  # counted already
        elif links:
            return  # (a compaction moving a record's own key after its links)
        self._live[loc.segment] = self._live.get(loc.segment, 0) + loc.length
        self._live_total += loc.length

    def _let_go(self, at: tuple[int, int], loc: Loc) -> None:
        """A key at `at` no longer points at `loc` (the index says so already): its bytes are dead
        once no key points at it."""
        record = (loc.segment, loc.offset)
        links = self._links.get(record, 0)
        if loc.home is not None:
            links -= 1
            if links:
                self._links[record] = links
                return
            del self._links[record]
            if self._owned(at, loc):
                return
        elif links:
            return
        self._live[loc.segment] -= loc.length
        self._live_total -= loc.length

    def _seg_path(self, n: int) -> Path:
        return segment_path(self.path, n)

    @contextlib.contextmanager
    def _writing(self) -> Iterator[None]:
        """Hold the write lock. A failure midway refuses further writes: what it left on disk is
        unknown (after a failed fsync the kernel may have dropped the dirty pages), and the next
        open cleans it up."""
        with self._write_lock:
            self._check_writable()
            try:
                yield
            except BaseException as e:
                self._broken = repr(e)
                if isinstance(e, OSError):
                    raise ArchiveWriteFailed(f"KV archive {self.path}: write failed ({e})") from e
                raise

    def recover(self) -> None:
        """After a failed write: cut the segment and the manifest back to their last durable
        ends (what the failed write may have left is dropped), and take writes again. Raises
        OSError if the files cannot be cut back (the archive stays refusing writes)."""
        with self._write_lock:
            self._check_open()
            if self._broken is None:
                return
            self.files.truncate(self._seg_fd, self._seg_size)
            self.files.fsync(self._seg_fd)
            self.files.truncate(self._man_fd, self._man_size)
            self.files.fsync(self._man_fd)
            self.files.fsync_dir(self.path)  # a manifest renamed into place by a compaction whose folder fsync failed
            self._broken = None

    def codec_for(self, layer: int) -> Codec:
        return Codec.RAW_ZSTD if layer in self.lossless_layers else self.codec

    def put(self, items: list[tuple[BlockKey, torch.Tensor, torch.Tensor]]) -> None:
        """Archive blocks: each k, v [Hkv, n, D] CPU of the identity's dtype, 1 <= n <= block_size.

        Durable once this returns; a key put again supersedes its older record. Encoding runs
        outside the locks, so several threads' puts compress in parallel.
        """
        payloads = self._encode([(key, *self._checked(key, k, v)) for key, k, v in items])
        records = _Records([], [], [], [], [], [], 0, 0)
        for (key, k, _), payload in zip(items, payloads, strict=True):
            self._add_record(records, key, k.shape[1], self.codec_for(key.layer), payload)
        self._write(records)

    def _add_record(self, records: _Records, key: BlockKey, n: int, codec: Codec, payload: Buffer) -> None:
        """`key`'s record of `n` tokens and `payload` (of `codec`) added to the batch `records`."""
        ident = self.identity
        prefix, crc = record_prefix(record_header(ident, key, n, CODEC_IDS[codec]), payload)
        size = memoryview(payload).nbytes
        records.keys.append(key)
        records.parts += (prefix, payload)
        records.lengths.append(len(prefix) + size)
        records.tokens.append(n)
        records.codecs.append(codec)
        records.crcs.append(crc)
        records.raw_bytes += 2 * ident.num_kv_heads * n * ident.head_dim * self._dtype.itemsize
        records.payload_bytes += size

    def put_blocks(
        self, session: str, layers: np.ndarray, indices: np.ndarray, k: torch.Tensor, v: torch.Tensor
    ) -> list[tuple[Codec, Buffer]]:
        """Archive whole blocks of one session, encoded in bulk: block i is (`layers[i]`,
        `indices[i]`) with k[:, i], v[:, i] of k, v [Hkv, n, block_size, D] CPU of the identity's
        dtype. The records are those `put` writes; durable once this returns, which gives each
        one's codec and payload (what `get_records` would, for the remote store). Write-behind's path:
        raw-zstd layers compress in one call outside the GIL (`codecs.encode_raw_many`), and the
        records go to disk without a copy, so that the engine thread beside it keeps the GIL."""
        ident = self.identity
        shape = (ident.num_kv_heads, len(layers), ident.block_size, ident.head_dim)
        if tuple(k.shape) != shape or tuple(v.shape) != shape or len(indices) != len(layers):
            raise ValueError(f"k, v must be {list(shape)} (one block per layer and index), got {list(k.shape)}")
        if k.dtype != self._dtype or v.dtype != self._dtype:
            raise ValueError(f"dtype must be {self._dtype}, got {k.dtype}, {v.dtype}")
        keys = [BlockKey(session, layer, i) for layer, i in zip(layers.tolist(), indices.tolist(), strict=True)]
        codecs = [self.codec_for(key.layer) for key in keys]
        raw = np.array([c is Codec.RAW_ZSTD for c in codecs], dtype=bool)
        if raw.all():
            payloads: list[Buffer] = encode_raw_many(k, v)
        else:
            payloads = [b""] * len(keys)
            at = np.flatnonzero(raw)
            if len(at):
                pick = torch.from_numpy(at)
                for i, payload in zip(at.tolist(), encode_raw_many(k[:, pick], v[:, pick]), strict=True):
                    payloads[i] = payload
            lossy = np.flatnonzero(~raw).tolist()
            for i, payload in zip(lossy, encode_int8_many([(k[:, i], v[:, i]) for i in lossy]), strict=True):
                payloads[i] = payload
        bs = ident.block_size
        head = record_header(ident, BlockKey(session, 0, 0), bs, 0)  # layer, index and codec: per record
        codec_ids = np.array([CODEC_IDS[c] for c in codecs], dtype=np.uint8)
        prefixes, size, crcs = record_prefixes(head, layers, indices, codec_ids, payloads)
        sizes = [memoryview(x).nbytes for x in payloads]
        parts: list[Buffer] = []
        for i, payload in enumerate(payloads):
            parts += (prefixes[i * size : (i + 1) * size], payload)
        raw_bytes = len(keys) * 2 * ident.num_kv_heads * bs * ident.head_dim * self._dtype.itemsize
        lengths = [size + n for n in sizes]
        self._write(_Records(keys, parts, lengths, [bs] * len(keys), codecs, crcs, raw_bytes, sum(sizes), bulk=True))
        return list(zip(codecs, payloads, strict=True))

    def get_records(self, keys: list[BlockKey]) -> list[tuple[int, Codec, bytes]]:
        """`keys`' records as stored, checked but not decoded: (tokens, codec, payload) each, what
        another archive's `put_records` takes (a session's KV carried to another daemon)."""
        return [(loc.num_tokens, codec, bytes(payload)) for codec, payload, loc, _ in self._records(keys)]

    def put_records(self, items: list[tuple[BlockKey, int, Codec, bytes]]) -> None:
        """Archive records another archive gave (`get_records`: (key, tokens, codec, payload) each)
        without decoding them, under this archive's identity; durable once this returns. A lossy
        record of a layer this archive keeps lossless is refused (ValueError), as a read would."""
        ident = self.identity
        records = _Records([], [], [], [], [], [], 0, 0)
        for key, n, codec, payload in items:
            if not 1 <= n <= ident.block_size:
                raise ValueError(f"{describe(key)}: {n} tokens is not 1 to {ident.block_size}")
            if not (codec is self.codec_for(key.layer) or codec.lossless):
                raise ValueError(
                    f"{describe(key)}: a {codec.value} record in a layer kept {self.codec_for(key.layer).value}"
                )
            self._add_record(records, key, n, codec, payload)
        self._write(records)

    def _write(self, records: _Records) -> None:
        """Append the records, then their manifest lines (the write protocol)."""
        if not records.keys:
            return
        with self._writing():
            locs = self._append_records(records)
            if records.bulk:
                self._append_manifest([puts_entry(records.keys[0].session, records.keys, locs)])
            else:
                self._append_manifest([put_entry(key, loc) for key, loc in zip(records.keys, locs, strict=True)])
            with self._state:
                for key, loc in zip(records.keys, locs, strict=True):
                    self._place(key, loc)
                self._counts[0] += records.raw_bytes
                self._counts[1] += records.payload_bytes
                self._counts[2] += len(records.keys)

    def _checked(self, key: BlockKey, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        ident = self.identity
        n = k.shape[1] if k.dim() == 3 else -1
        shape = (ident.num_kv_heads, n, ident.head_dim)
        if tuple(k.shape) != shape or tuple(v.shape) != shape or not 1 <= n <= ident.block_size:
            raise ValueError(f"{describe(key)}: k, v must be {list(shape)} with 1 <= n <= {ident.block_size}")
        if k.dtype != self._dtype or v.dtype != self._dtype:
            raise ValueError(f"{describe(key)}: dtype must be {self._dtype}, got {k.dtype}, {v.dtype}")
        return k, v

    def _encode(self, items: list[tuple[BlockKey, torch.Tensor, torch.Tensor]]) -> list[bytes]:
        """Each block's payload under its layer's codec; int8 blocks of one token count are
        encoded together (`encode_int8_many`), each payload the same bytes as alone."""
        out: list[bytes | None] = [None] * len(items)
        lossy: dict[int, list[int]] = {}  # token count -> positions
        for i, (key, k, v) in enumerate(items):
            codec = self.codec_for(key.layer)
            if codec is Codec.INT8_DELTA_ZSTD:
                lossy.setdefault(k.shape[1], []).append(i)
            else:
                out[i] = encode(codec, k, v)
        for at in lossy.values():
            for i, payload in zip(at, encode_int8_many([(items[i][1], items[i][2]) for i in at]), strict=True):
                out[i] = payload
        return out  # type: ignore[return-value]

    def _rotate(self) -> None:
        """Start the next segment (the new file first: a failure leaves the active one open)."""
        fd = open_segment(self.files, self.path, self._next_no)
        os.close(self._seg_fd)
        self._seg_no, self._seg_size, self._seg_fd = self._next_no, 0, fd
        self._next_no += 1

    def _append_records(self, records: _Records) -> list[Loc]:
        """Append one batch to the active segment (never split across two) and fsync it."""
        if self._seg_size >= self._segment_bytes:
            self._rotate()
        locs, offset, seg = [], self._seg_size, self._seg_no
        for length, n, codec, crc in zip(records.lengths, records.tokens, records.codecs, records.crcs, strict=True):
            locs.append(Loc(seg, offset, length, n, codec, crc))
            offset += length
        self.files.write_all(self._seg_fd, records.parts, self._seg_size)
        self.files.fsync(self._seg_fd)
        self._seg_size = offset
        return locs

    def _append_manifest(self, entries: list[dict[str, Any]]) -> None:
        data = encode_lines(entries)
        self.files.write_all(self._man_fd, data, self._man_size)
        self.files.fsync(self._man_fd)
        self._man_size += len(data)  # only once durable: `recover` cuts back to it

    def remove(self, session: str, first: int = 0) -> int:
        """Forget every block of `session`, or those of index `first` and later (one durable
        tombstone line). -> number of blocks removed."""
        with self._writing():
            with self._state:
                n = sum(1 for key in self._index.get(session, {}) if key[1] >= first)
            if n == 0:
                return 0
            self._append_manifest([del_entry(session, first)])
            with self._state:
                self._forget(session, first)
            return n

    def link(self, session: str, source: str, blocks: list[tuple[int, int]]) -> int:
        """Give `session` the records `source` holds for `blocks` ((layer, index) pairs) without
        writing them again: one durable manifest line, and `session`'s keys point at the same
        records (a block several sessions share is stored once). A record stays while any key
        points at it, so deleting `source` leaves it to `session`. Blocks `source` lacks are
        skipped. -> the blocks linked."""
        if session == source:
            raise ValueError(f"session {session!r} cannot link its own records")
        with self._writing():  # the index changes only under this lock
            src = self._index.get(source, {})
            found = [(at, src[at]) for at in blocks if at in src]
            if not found:
                return 0
            keys = [BlockKey(session, layer, index) for (layer, index), _ in found]
            locs = [loc if loc.home is not None else dataclasses.replace(loc, home=source) for _, loc in found]
            self._append_manifest([puts_entry(session, keys, locs)])
            with self._state:
                for key, loc in zip(keys, locs, strict=True):
                    self._place(key, loc)
            return len(keys)

    def live_bytes(self) -> int:
        """Bytes of the records the store holds now (what compaction would keep)."""
        return self._live_total  # one int, written under `_state`: read as it stands, never torn

    def disk_bytes(self) -> int:
        """Bytes the segments take on disk."""
        return sum(segment_sizes(self.path).values())

    def compact(self, keep_ratio: float = 0.5) -> int:
        """Reclaim the space of dead records (superseded or deleted) in the segments less than
        `keep_ratio` live, in the calling thread, beside puts, deletes and reads
        (`h3d.tiers.compaction.compact` says how). Returns the bytes freed on disk."""
        return compaction.compact(self, keep_ratio)

    def _rewrite_manifest(self, entries: list[dict[str, Any]], moved: list[tuple[BlockKey, Loc]]) -> None:
        """Switch to a manifest of `entries` (fsynced first, then renamed over the old one) and point
        the index at the `moved` records' new places at once: from the rename on, the index, the
        appends and the file at manifest.log are the new ones, even if the folder's fsync fails."""
        data = encode_lines(entries)
        tmp = self.path / "manifest.tmp"
        self.files.unlink(tmp, missing_ok=True)
        fd = self.files.create(tmp, os.O_WRONLY)
        try:
            self.files.write_all(fd, data, 0)
            self.files.fsync(fd)
            self.files.replace(tmp, self.path / "manifest.log")
        except BaseException:
            os.close(fd)
            raise
        old, self._man_fd, self._man_size = self._man_fd, fd, len(data)
        with self._state:
            for key, loc in moved:
                self._place(key, loc)
        with contextlib.suppress(OSError):
            os.close(old)
        self.files.fsync_dir(self.path)

    def compact_later(self, keep_ratio: float | None = None) -> None:
        """Ask for a compaction on the archive's own thread; returns at once. `keep_ratio`:
        `h3d.tiers.compaction.RECLAIM_KEEP_RATIO` by default."""
        self._compactor.request(compaction.RECLAIM_KEEP_RATIO if keep_ratio is None else keep_ratio)

    @property
    def compacting(self) -> bool:
        """A background compaction runs or is asked for."""
        return self._compactor.busy

    def wait_compactions(self, timeout: float | None = None) -> bool:
        """Wait for the background compactions asked for. -> False if `timeout` passed first."""
        return self._compactor.wait(timeout)

    def compaction_stats(self) -> CompactionStats:
        """The background compactions (`compact_later`) since open: runs completed, bytes they freed,
        the last failure (`h3d.tiers.compaction.Compactor`)."""
        return self._compactor.stats()

    @property
    def active_segment(self) -> int:
        """The number of the segment appends go to now (`seg-NNNNNN.h3kv`)."""
        return self._seg_no

    def contains(self, key: BlockKey) -> bool:
        with self._state:
            return (key.layer, key.index) in self._index.get(key.session, {})

    def blocks_of(self, session: str) -> dict[tuple[int, int], int]:
        """`session`'s archived blocks: (layer, index) -> the tokens the record holds."""
        with self._state:
            return {li: loc.num_tokens for li, loc in self._index.get(session, {}).items()}

    def linked_of(self, session: str) -> list[tuple[int, int]]:
        """`session`'s blocks (layer, index) whose record is another session's (`link`)."""
        with self._state:
            return [li for li, loc in self._index.get(session, {}).items() if loc.home is not None]

    def sessions(self) -> frozenset[str]:
        """The sessions that have archived blocks."""
        with self._state:
            return frozenset(name for name, blocks in self._index.items() if blocks)

    def keys(self) -> frozenset[BlockKey]:
        with self._state:
            return frozenset(BlockKey(s, li[0], li[1]) for s, blocks in self._index.items() for li in blocks)

    def get(self, key: BlockKey) -> tuple[torch.Tensor, torch.Tensor]:
        """-> (k, v), each [Hkv, n, D] CPU of the identity's dtype (n as put). KeyError if not archived."""
        [(codec, payload, loc, where)] = self._records([key])
        ident = self.identity
        try:
            return decode(codec, payload, self._dtype, ident.num_kv_heads, loc.num_tokens, ident.head_dim)
        except ValueError as e:
            raise ArchiveCorrupt(f"{describe(key)} in {where} does not decode: {e}", key) from e

    def get_bytes(self, keys: list[BlockKey]) -> list[tuple[int, Buffer]]:
        """A bulk read: for each key (n, K then V, each [Hkv, n, D] of the identity's dtype, in the
        host's byte order) without making tensors per record (the mover copies them into place).
        Lossless records come back as put; int8 ones decoded, those of one token count together
        (`decode_int8_many`), each as `get` decodes it. KeyError if one is not archived."""
        ident = self.identity
        hkv, d, itemsize = ident.num_kv_heads, ident.head_dim, self._dtype.itemsize
        records = self._records(keys)
        out: list[tuple[int, Buffer] | None] = [None] * len(keys)
        lossy: dict[int, list[int]] = {}  # token count -> positions of int8 records
        raw: list[int] = []  # positions of raw-zstd records
        for i, (codec, _, loc, _) in enumerate(records):
            (raw if codec is Codec.RAW_ZSTD else lossy.setdefault(loc.num_tokens, [])).append(i)
        sizes = [2 * hkv * records[i][2].num_tokens * d * itemsize for i in raw]
        try:  # all at once, outside the GIL
            for i, data in zip(raw, decompress_raw_many([records[i][1] for i in raw], sizes), strict=True):
                out[i] = (records[i][2].num_tokens, data)
        except ValueError:  # name the record: one by one until one fails
            for i, n in zip(raw, sizes, strict=True):
                _, payload, loc, where = records[i]
                try:
                    out[i] = (loc.num_tokens, decompress_raw(payload, n))
                except ValueError as e:
                    raise ArchiveCorrupt(f"{describe(keys[i])} in {where} does not decode: {e}", keys[i]) from e
        for n, at in lossy.items():
            try:
                x = decode_int8_many([records[i][1] for i in at], self._dtype, hkv, n, d)
            except ValueError as e:  # name the record: decode them one by one until one fails
                for i in at:
                    codec, payload, _, where = records[i]
                    try:
                        decode(codec, payload, self._dtype, hkv, n, d)
                    except ValueError as one:
                        raise ArchiveCorrupt(f"{describe(keys[i])} in {where} does not decode: {one}", keys[i]) from e
                raise ArchiveCorrupt(f"{describe(keys[at[0]])}: int8 records do not decode: {e}", keys[at[0]]) from e
            view = x.view(torch.uint8).numpy().data.cast("B")
            per = 2 * hkv * n * d * itemsize
            for j, i in enumerate(at):
                out[i] = (n, view[j * per : (j + 1) * per])
        return out  # type: ignore[return-value]

    def _records(self, keys: list[BlockKey]) -> list[tuple[Codec, memoryview, Loc, str]]:
        """`keys`' records read and checked: (codec, payload, place, where it was read) each. The
        index is looked up and each segment opened once for all of them."""
        with self._state:  # the segments are opened before a compaction can delete them (see compact)
            self._check_open()
            locs = []
            for key in keys:
                loc = self._index.get(key.session, {}).get((key.layer, key.index))
                if loc is None:
                    raise KeyError(key)
                locs.append(loc)
            fds: dict[int, int] = {}
            try:
                for key, loc in zip(keys, locs, strict=True):
                    if loc.segment not in fds:
                        where = f"{self._segment_path(loc.segment)} at offset {loc.offset}"
                        try:
                            fds[loc.segment] = self.files.open(Path(self._segment_path(loc.segment)), os.O_RDONLY)
                        except OSError as e:
                            raise ArchiveCorrupt(f"{describe(key)} cannot be read from {where}: {e}", key) from e
            except BaseException:
                for fd in fds.values():
                    os.close(fd)
                raise
            self._counts[3] += len(keys)
        out: list[tuple[Codec, memoryview, Loc, str] | None] = [None] * len(keys)
        try:
            for run in _runs(locs):
                first, last = locs[run[0]], locs[run[-1]]
                start, end = first.offset, last.offset + last.length
                try:
                    data = os.pread(fds[first.segment], end - start, start) if len(run) > 1 else b""
                except OSError:
                    data = b""  # each record read alone below names the one that cannot be read
                whole = memoryview(data)
                for i in run:
                    key, loc = keys[i], locs[i]
                    where = f"{self._segment_path(loc.segment)} at offset {loc.offset}"
                    if len(data) == end - start:
                        record: bytes | memoryview = whole[loc.offset - start : loc.offset - start + loc.length]
                    else:  # one record, or a run cut short (a damaged segment): read on its own
                        try:
                            record = os.pread(fds[loc.segment], loc.length, loc.offset)
                        except OSError as e:
                            raise ArchiveCorrupt(f"{describe(key)} cannot be read from {where}: {e}", key) from e
                    codec, payload = verify_record(self.identity, self.codec_for(key.layer), key, loc, record, where)
                    out[i] = (codec, payload, loc, where)
        finally:
            for fd in fds.values():
                os.close(fd)
        return out  # type: ignore[return-value]

    def _segment_path(self, n: int) -> str:
        """Segment `n`'s path, as a string made once (reads name it for every record)."""
        path = self._seg_paths.get(n)
        if path is None:
            path = self._seg_paths[n] = str(self._seg_path(n))
        return path

    def stored_bytes(self) -> int:
        """Bytes of the records written (compressed), `ArchiveStats.stored_bytes`."""
        return self.stats().stored_bytes

    def stats(self) -> ArchiveStats:
        with self._state:
            live = sum(len(blocks) for blocks in self._index.values())
            raw, stored, records, reads = self._counts
            return ArchiveStats(raw, stored, records, reads, live)

    def _check_open(self) -> None:
        if self._closed:
            raise ArchiveError(f"KV archive {self.path} is closed")

    def _check_writable(self) -> None:
        self._check_open()
        if self._broken is not None:
            raise ArchiveWriteFailed(f"KV archive {self.path}: an earlier write failed ({self._broken})")

    @property
    def closing(self) -> bool:
        """`close` (or `abandon`) has been called: a compaction in progress stops before its next record."""
        return self._stopping.is_set()

    def close(self) -> None:
        """Release the files and the folder lock. Idempotent; waits for a put in progress, stops a
        compaction in progress (what it copied is dropped)."""
        self._stopping.set()
        self._compactor.close()
        with self._compact_lock, self._write_lock, self._state:
            if self._closed:
                return
            self._closed = True
        self._close_fds()

    def abandon(self) -> None:
        """Let the archive go as the process's exit would, without `close`: its descriptors closed at
        once (the folder lock goes with the last one), no lock taken, nothing waited for or cleaned
        up (what a put or a compaction in progress left on disk is the next open's to clean up, as
        after a crash). For a process going away (a forked child dropping its copy of the parent's
        archive, a test standing for a crash); the archive is closed afterwards, and a call in
        progress on another thread may fail on a closed descriptor."""
        self._stopping.set()
        self._closed = True
        self._close_fds()

    def _close_fds(self) -> None:
        for fd in (self._seg_fd, self._man_fd, self._lock_fd):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)

    def __enter__(self) -> Archive:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _runs(locs: list[Loc]) -> list[list[int]]:
    """The positions of `locs` grouped into runs that one pread reads: records of one segment in
    offset order, each starting at most `READ_GAP_BYTES` past the previous one's end, a run at
    most `READ_RUN_BYTES` long (or one record)."""
    runs: list[list[int]] = []
    segment, start, end = -1, 0, 0
    for i in sorted(range(len(locs)), key=lambda i: (locs[i].segment, locs[i].offset)):
        loc = locs[i]
        near = loc.segment == segment and end <= loc.offset <= end + READ_GAP_BYTES
        if runs and near and loc.offset + loc.length - start <= READ_RUN_BYTES:
            runs[-1].append(i)
        else:
            runs.append([i])
            segment, start = loc.segment, loc.offset
        end = loc.offset + loc.length
    return runs
