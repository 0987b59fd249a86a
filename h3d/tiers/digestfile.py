"""Digest snapshots: a session's block digests kept beside the archive, read first when it resumes.

HBF's selection reads every block's digest (`h3d.hbf.digests`) before a decode step reads any
block. A session resumed from the archive (after a restart, or closed and reopened) has no digests
on the device; rebuilt from its keys they cost a read of every block it has (half its KV: 8.6 GB
for a 128K-token session of an 8B model), before its first token. A snapshot holds the digests of
its first `blocks` full blocks, all layers, an eighth of its KV by default (`digest_tokens` 8):
read first, it lets the first step read only the blocks it selects (`TierManager.stage`).

A full block's keys never change while the session keeps it, so a snapshot stays valid for the
blocks it covers as the session grows; what must stay true is that a cut below its coverage (a
rewind, a damaged block computed again: `KVCache.cut`) deletes it, and so does forgetting the
session's KV. Snapshots are written at a shutdown's checkpoint (`Engine.checkpoint`), after the
blocks themselves, and when a session is closed (`KVCache.park`: copied to the host on the
engine thread, written on a thread of its own, `write_later`; every other call on that session
waits for it). After a kill -9 there may be none, or one that covers fewer blocks: the digests
of the blocks past it are rebuilt from their keys, as they always were.

File `<archive>/digests/<session>.h3dg`: `MAGIC`, the header's length and crc32 (two little-endian
u32), a JSON header (format version, the model fingerprint, dtype, shape [Ls, Hkv, rows, 2, D],
the Ls layers held (those that select: `h3d.hbf.digests.digest_layers`), part tokens, blocks
covered, piece bytes, one crc32 per piece), then at `DATA_OFFSET` or the next 4 KiB boundary past
the header the rows as stored on the device. A version-1 snapshot held every full-attention layer
(dense ones too) and lists none: it is read as such, its dense layers skipped. Written under a temporary name,
fsynced, renamed over the old one and the folder fsynced: a crash leaves the old snapshot or the
new one. Read in pieces of `PIECE_BYTES` on `THREADS` threads (zlib's crc32 releases the GIL), each
piece's crc checked: a snapshot that does not match (another model or shape, a bad crc, a short
file) is ignored with a warning and deleted, and the digests are rebuilt from the keys, never taken wrong.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import struct
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from h3d.store.files import FILE_MODE, fsync_dir, make_dirs

log = logging.getLogger(__name__)

MAGIC = b"H3DG"
VERSION = 2  # 2: the layers held are listed (those that select); 1 held every full-attention layer
PREFIX = struct.Struct("<4sII")  # magic, header length, header crc32
DATA_ALIGN = 4096
PIECE_BYTES = 32 << 20
THREADS = min(8, os.cpu_count() or 1)
_SAFE_NAME = re.compile(r"[A-Za-z0-9_-]{1,128}")


@dataclass(frozen=True)
class Layout:
    """What a cache reads a snapshot as: its rows' `shape` without the rows ([len(layers), Hkv, 2,
    D]), `dtype`, `part_tokens`, the model's `layers` whose digests it keeps (those that select)
    and `legacy_layers`, those a version-1 snapshot held (every full-attention layer: the cache's
    `full_layers`; such a snapshot is read too, its other layers skipped)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    part_tokens: int
    layers: tuple[int, ...]
    legacy_layers: tuple[int, ...] = ()


def snapshots_folder(archive: Path) -> Path:
    """Where the digest snapshots of the archive at `archive` lie."""
    return Path(archive) / "digests"


def folder_bytes(folder: Path) -> dict[str, int]:
    """The snapshot files in `folder` (none if it does not exist), by name: their bytes on disk."""
    return {p.name: p.stat().st_size for p in Path(folder).glob("*.h3dg")}


class DigestFiles:
    """The snapshots of one archive's sessions (`folder` is `<archive>/digests`), for the cache
    whose model `fingerprint` they were computed with."""

    def __init__(self, folder: Path, fingerprint: str) -> None:
        self.folder = Path(folder)
        self.fingerprint = fingerprint
        self.bytes_read = 0
        self.bytes_written = 0
        self._writer: ThreadPoolExecutor | None = None  # `write_later`'s one thread
        self._reader: ThreadPoolExecutor | None = None  # `read_later`'s THREADS threads
        self._pending: dict[str, Future[int]] = {}  # session -> its write under way
        # session -> (blocks, part_tokens, rows, layers) of its write under way, until it is done: a
        # read then takes the rows (a session closed and reopened at once waits for no write)
        self._staged: dict[str, tuple[int, int, torch.Tensor, list[int]]] = {}
        self._staged_lock = threading.Lock()
        # file name -> bytes on disk of each snapshot (counted against `ssd_capacity_mb`:
        # `disk_bytes`), from the folder at start, then kept as snapshots are written and removed
        self._sizes = folder_bytes(self.folder)
        self._total = sum(self._sizes.values())

    def path(self, session: str) -> Path:
        name = session if _SAFE_NAME.fullmatch(session) else hashlib.sha256(session.encode()).hexdigest()
        return self.folder / f"{name}.h3dg"

    # ---- writing ---------------------------------------------------------------------------

    def write(self, session: str, blocks: int, part_tokens: int, rows: torch.Tensor, layers: Sequence[int]) -> int:
        """Save `rows` ([len(layers), Hkv, blocks * parts, 2, D], any device: the digests of the
        model's `layers`) as `session`'s snapshot of its first `blocks` blocks, atomically. Returns
        the bytes written."""
        data = rows if rows.device.type == "cpu" and rows.is_contiguous() else host_copy(rows)
        raw = data.view(torch.uint8).numpy().reshape(-1)
        pieces = [raw[i : i + PIECE_BYTES].data for i in range(0, len(raw), PIECE_BYTES)]
        with ThreadPoolExecutor(THREADS) as pool:
            crcs = list(pool.map(zlib.crc32, pieces))
        header = json.dumps({
            "version": VERSION,
            "fingerprint": self.fingerprint,
            "dtype": str(data.dtype).removeprefix("torch."),
            "shape": list(data.shape),
            "layers": list(layers),
            "part_tokens": part_tokens,
            "blocks": blocks,
            "piece_bytes": PIECE_BYTES,
            "crcs": crcs,
        }).encode()  # fmt: skip
        start = _data_offset(len(header))
        head = PREFIX.pack(MAGIC, len(header), zlib.crc32(header)) + header
        self._replace(session, [head + b"\0" * (start - len(head)), *pieces])
        self.bytes_written += start + len(raw)
        return start + len(raw)

    def _replace(self, session: str, parts: list[Any]) -> None:
        """`session`'s snapshot file made of `parts` (buffers), atomically: written under a
        temporary name, fsynced, renamed over the old one, the folder fsynced."""
        make_dirs(self.folder)
        final = self.path(session)
        tmp = final.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
            for part in parts:
                _write_all(fd, part)
            os.fsync(fd)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
        os.close(fd)
        os.replace(tmp, final)
        self._resized(final.name, sum(memoryview(part).nbytes for part in parts))
        fsync_dir(self.folder)

    def disk_bytes(self, session: str | None = None) -> int:
        """Bytes the snapshots (of `session`, or all) take on disk, from any thread."""
        if session is None:
            return self._total
        with self._staged_lock:
            return self._sizes.get(self.path(session).name, 0)

    def _resized(self, name: str, size: int) -> None:
        with self._staged_lock:
            self._total += size - self._sizes.pop(name, 0)
            if size:
                self._sizes[name] = size

    def install(self, session: str, data: bytes) -> None:
        """Make `data` (a snapshot file's bytes, as another daemon wrote it: checked when read)
        `session`'s snapshot, atomically."""
        self._replace(session, [data])

    def write_later(
        self, session: str, blocks: int, part_tokens: int, rows: torch.Tensor, layers: Sequence[int]
    ) -> None:
        """`write` on a thread of its own (a closed session's snapshot: `KVCache.park`); `rows` on
        the CPU, no longer written to. Every other call on `session` waits for it first."""
        self.settle(session)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(1, thread_name_prefix="h3d-digest-write")
        staged = (blocks, part_tokens, rows, list(layers))
        with self._staged_lock:
            self._staged[session] = staged
        future = self._writer.submit(self.write, session, blocks, part_tokens, rows, layers)
        with self._staged_lock:
            self._pending[session] = future

        def done(_: Future[int]) -> None:
            with self._staged_lock:
                if self._staged.get(session) is staged:
                    del self._staged[session]

        future.add_done_callback(done)

    def settle(self, session: str | None = None) -> None:
        """Wait for `write_later`'s writes (of `session`, or all), from any thread: one that failed
        is logged and leaves the old snapshot, or none (the digests are then rebuilt from the keys)."""
        for name in [session] if session is not None else list(self._pending):
            future = self._pending.get(name)
            if future is None:
                continue
            try:  # (every caller waits for it, whichever thread calls: a hand-over sends the file)
                future.result()
            except OSError as e:
                if self._done(name, future):  # (logged once)
                    log.warning("digest snapshot %s not written: %s", self.path(name), e)
            else:
                self._done(name, future)

    def _done(self, session: str, future: Future[int]) -> bool:
        """Forget `session`'s write `future` if it is still the one pending (not a later one)."""
        with self._staged_lock:
            if self._pending.get(session) is future:
                del self._pending[session]
                return True
        return False

    def close(self) -> None:
        self.settle()
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self._reader is not None:
            self._reader.shutdown(wait=True)

    # ---- reading ---------------------------------------------------------------------------

    def header(self, session: str) -> dict[str, Any] | None:
        """The snapshot's header, or None if there is none (or it is unreadable); that of a write
        under way (`write_later`) without waiting for it."""
        staged = self._staged_meta(session)
        if staged is not None:
            return staged[0]
        self.settle(session)
        path = self.path(session)
        try:
            with open(path, "rb") as f:
                head = f.read(PREFIX.size)
                if len(head) < PREFIX.size:
                    raise ValueError("shorter than its prefix")
                magic, n, crc = PREFIX.unpack(head)
                if magic != MAGIC:
                    raise ValueError("not a digest snapshot")
                body = f.read(n)
            if len(body) != n or zlib.crc32(body) != crc:
                raise ValueError("its header fails its checksum")
            meta = json.loads(body)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as e:
            self._ignore(session, str(e))
            return None
        return meta if isinstance(meta, dict) else None

    def read(self, session: str, layout: Layout, max_blocks: int) -> tuple[int, torch.Tensor] | None:
        """`session`'s snapshot as (blocks, rows [len(layers), Hkv, blocks * parts, 2, D] on the
        CPU: the digests of `layout.layers`), if there is one that matches `layout`, holds those
        layers and covers at most `max_blocks` blocks (the session's full blocks now); None
        otherwise (a warning says why, except where there is simply none)."""
        got = self.read_later(session, layout, max_blocks)
        if got is None:
            return None
        blocks, _, layer = got
        try:
            return blocks, torch.stack([layer(i) for i in range(len(layout.layers))])
        except ValueError:
            return None

    def read_later(
        self, session: str, layout: Layout, max_blocks: int
    ) -> tuple[int, torch.Tensor, Callable[[int], torch.Tensor]] | None:
        """`read`, its pieces read in the background in the file's order (a layer after another):
        (blocks, rows as the file holds them, `layer`), where `layer(i)` waits for the rows of
        `layers[i]` and returns them, or raises ValueError if a piece holding them failed (the
        snapshot is then ignored and deleted). None where `read` gives None for its header. A
        snapshot whose write is under way (`write_later`) is taken from the rows being written,
        none read."""
        staged = self._staged_meta(session)
        meta = staged[0] if staged is not None else self.header(session)
        if meta is None:
            return None
        path = self.path(session)
        layers, shape, part_tokens = layout.layers, layout.shape, layout.part_tokens
        want_dtype = str(layout.dtype).removeprefix("torch.")
        got = meta.get("shape", [])
        held = meta.get("layers") if meta.get("version") == VERSION else list(layout.legacy_layers)
        at = {layer: i for i, layer in enumerate(held)} if isinstance(held, list) else {}
        problem = None
        if meta.get("version") not in (1, VERSION) or meta.get("fingerprint") != self.fingerprint:
            problem = "written for another model or format"
        elif len(at) != len(held or ()) or any(x not in at for x in layers) or len(got) != 5 or got[0] != len(at):
            problem = f"it holds the digests of layers {held}, not of {list(layers)}"
        elif meta.get("dtype") != want_dtype or meta.get("part_tokens") != part_tokens:
            problem = f"dtype {meta.get('dtype')}, {meta.get('part_tokens')}-token parts"
            problem += f" (this cache: {want_dtype}, {part_tokens})"
        elif (len(layers), got[1], got[3], got[4]) != tuple(shape):
            problem = f"shape {got}, not {list(shape)} with rows"
        elif not 0 < int(meta.get("blocks", 0)) <= max_blocks:
            problem = f"it covers {meta.get('blocks')} blocks, the session has {max_blocks} full ones"
        if problem is not None:
            self._ignore(session, problem)
            return None
        index = [at[layer] for layer in layers]  # the file's layer of each wanted one
        if staged is not None:
            rows = staged[1]
            return int(meta["blocks"]), rows, lambda i: rows[index[i]]
        out = torch.empty(got, dtype=layout.dtype)
        raw = out.view(torch.uint8).numpy().reshape(-1)
        piece, crcs = int(meta["piece_bytes"]), list(meta["crcs"])
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            self._ignore(session, str(e))
            return None
        try:
            start = _data_offset(PREFIX.unpack(os.pread(fd, PREFIX.size, 0))[1])
            if os.fstat(fd).st_size != start + len(raw) or len(crcs) != -(-len(raw) // piece):
                raise ValueError("its length does not match its header")
        except (OSError, ValueError) as e:
            os.close(fd)
            self._ignore(session, str(e))
            return None

        def one(i: int) -> bool:
            view = raw[i * piece : (i + 1) * piece].data
            try:
                n = os.preadv(fd, [view], start + i * piece)
            except OSError:
                return False
            good = n == len(view) and zlib.crc32(view) == crcs[i]
            if good:
                with lock:
                    self.bytes_read += n
            return good

        if self._reader is None:
            self._reader = ThreadPoolExecutor(THREADS, thread_name_prefix="h3d-digest-read")
        lock = threading.Lock()
        pieces = [self._reader.submit(one, i) for i in range(len(crcs))]
        left = [len(pieces)]

        def done(_: Future[bool]) -> None:
            with lock:
                left[0] -= 1
                if not left[0]:
                    os.close(fd)

        for f in pieces:
            f.add_done_callback(done)
        per_layer = len(raw) // max(1, int(got[0]))
        failed: list[str] = []

        def layer(i: int) -> torch.Tensor:
            i = index[i]
            first, last = i * per_layer // piece, ((i + 1) * per_layer - 1) // piece
            if failed or not all(pieces[j].result() for j in range(first, min(last + 1, len(pieces)))):
                if not failed:
                    failed.append("a piece fails its checksum")
                    self._ignore(session, failed[0])
                raise ValueError(failed[0])
            return out[i]

        return int(meta["blocks"]), out, layer

    def _staged_meta(self, session: str) -> tuple[dict[str, Any], torch.Tensor] | None:
        """The header a write under way will write, and its rows (None: no write under way)."""
        with self._staged_lock:
            staged = self._staged.get(session)
        if staged is None:
            return None
        blocks, part_tokens, rows, layers = staged
        meta = {
            "version": VERSION, "fingerprint": self.fingerprint, "dtype": str(rows.dtype).removeprefix("torch."),
            "shape": list(rows.shape), "layers": layers, "part_tokens": part_tokens, "blocks": blocks,
        }  # fmt: skip
        return meta, rows

    def _ignore(self, session: str, why: str) -> None:
        """A snapshot that cannot be used: deleted (the next checkpoint writes a good one)."""
        log.warning("digest snapshot %s ignored and deleted: %s", self.path(session), why)
        with contextlib.suppress(OSError):
            self.remove(session)

    # ---- upkeep ----------------------------------------------------------------------------

    def cut(self, session: str, blocks: int) -> None:
        """The session keeps only its first `blocks` blocks as they are: a snapshot covering more is deleted."""
        meta = self.header(session)
        if meta is not None and int(meta.get("blocks", 0)) > blocks:
            self.remove(session)

    def remove(self, session: str) -> None:
        self.settle(session)
        path = self.path(session)
        self._resized(path.name, 0)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
            fsync_dir(self.folder)

    def clean(self) -> int:
        """Delete what an interrupted write left (temporary files); returns how many."""
        gone = 0
        for tmp in self.folder.glob("*.tmp") if self.folder.is_dir() else ():
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
                gone += 1
        return gone


def host_copy(rows: torch.Tensor) -> torch.Tensor:
    """`rows` as a contiguous CPU tensor, copied a layer at a time (a device copy's staging is a
    layer's size, not the whole)."""
    data = torch.empty(rows.shape, dtype=rows.dtype)
    for layer in range(rows.shape[0]):
        data[layer].copy_(rows[layer])
    return data


def _data_offset(header_bytes: int) -> int:
    return -(-(PREFIX.size + header_bytes) // DATA_ALIGN) * DATA_ALIGN


def _write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data).cast("B")
    while len(view):
        n = os.write(fd, view)
        view = view[n:]
