"""The mover: the only code that copies KV bytes between the HBM pool, the DDR pool and the archive.

- HBM <-> DDR: one call moves a batch of blocks. On CUDA it is one kernel launch
  (`h3d.kernels.copies.copy_blocks`: each program reads a block where it lives, pinned DDR over
  PCIe included, and writes it where it goes: no gather on the host, no staging copy) on a
  dedicated stream, and the compute stream waits on it (an event), so copies overlap whatever the
  host does next; on the CPU the same calls are plain tensor copies. `batched` gathers a caller's
  many calls into two launches.
- DDR -> SSD: `submit_write` copies the blocks' bytes out and hands them to one worker thread
  (`put` appends, fsyncs, then commits the manifest). Each write in flight is a `Transfer`
  in `in_flight`; `poll` returns the finished ones, in one place, so the caller frees DDR copies
  only once their archive write is durable. `write_now` does the same and waits.
- SSD -> DDR: `read` verifies and decodes records straight into DDR slots, many at once on
  several threads; the step that needs the blocks waits for it. A slot written on the host may
  have held a block that kernels queued before (a step's earlier layers, a promotion's copy on
  the mover's stream) still read in place: each read takes a `fence` when it is asked for (on
  the engine's thread) and writes its slots only once the device has passed it, the disk's
  reads and the decoding done meanwhile.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from h3d.kernels.copies import copy_blocks
from h3d.kv.pool import KVPool
from h3d.tiers.backend import ColdTier
from h3d.tiers.identity import BlockKey

# Archive reads at once, each decoding its own records. On the H200 host (16 cores), 4 GiB of
# records read by 4 threads at 1.19-1.40 GB/s cold and 1.67-1.70 warm, by 8 at 1.59 / 1.44 (the
# disk reads 1.34-1.55 cold): beyond that, the work each record does under the GIL.
READ_THREADS = max(1, min(8, os.cpu_count() or 1))
READ_PIECE = 64  # records one reader takes at a time, at most
# ... and at least (where there are more): a layer's selection of a few hundred blocks is shared
# out over every reader, not read by a few in pieces of READ_PIECE while the others wait.
MIN_READ_PIECE = 8
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(frozen=True, slots=True)
class Transfer:
    """An archive write in flight: the blocks it makes durable and the future that says when."""

    id: int
    keys: tuple[BlockKey, ...]
    future: Future[Any]  # (its result: nothing the mover uses)


class Mover:
    def __init__(self, hbm: KVPool, ddr: KVPool, archive: ColdTier | None) -> None:
        self.hbm = hbm
        self.ddr = ddr
        self.archive = archive
        self.in_flight: dict[int, Transfer] = {}
        self._ids = itertools.count(1)
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="h3d-archive") if archive else None
        self._readers: ThreadPoolExecutor | None = None  # made at the first read of many blocks
        cuda = hbm.k.device.type == "cuda"
        self._stream = torch.cuda.Stream(device=hbm.k.device) if cuda else None
        # HBM -> DDR and DDR -> HBM copies held back by `batched`: (source slots, destination slots)
        self._queued: dict[str, tuple[list[np.ndarray], list[np.ndarray]]] | None = None
        self.copied = {"down": 0, "up": 0}  # blocks copied HBM -> DDR and DDR -> HBM, for any reason

    @contextmanager
    def batched(self) -> Iterator[None]:
        """Hold the HBM <-> DDR copies made inside the block, then make them in two launches when
        it ends (even by an error: the tables already say the bytes moved): every HBM -> DDR copy
        first, then every DDR -> HBM one. For callers whose copies up may write HBM slots their
        copies down read (a victim copied down, a promoted block copied into its slot), and whose
        copies read no slot that another copy of the block writes otherwise. Nested blocks join
        the outermost."""
        if self._queued is not None:
            yield
            return
        self._queued = {"down": ([], []), "up": ([], [])}
        try:
            yield
        finally:
            queued, self._queued = self._queued, None
            for direction, (src, dst) in queued.items():
                if src:
                    pools = (self.hbm, self.ddr) if direction == "down" else (self.ddr, self.hbm)
                    self._copy(pools[0], np.concatenate(src), pools[1], np.concatenate(dst))

    def _copy(self, src: KVPool, src_slots: np.ndarray, dst: KVPool, dst_slots: np.ndarray) -> None:
        if not len(src_slots):
            return
        self.copied["up" if src is self.ddr else "down"] += len(src_slots)
        if self._stream is None:
            s = torch.from_numpy(src_slots).to(src.k.device)
            dst.store(torch.from_numpy(dst_slots).to(dst.k.device), *src.read(s))
            return
        dev = self.hbm.k.device
        slots = torch.from_numpy(np.stack([src_slots, dst_slots])).pin_memory().to(dev, non_blocking=True)
        self._stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self._stream):
            copy_blocks((src.k, src.v), slots[0], (dst.k, dst.v), slots[1])
        slots.record_stream(self._stream)
        torch.cuda.current_stream().wait_stream(self._stream)

    def hbm_to_ddr(self, hbm_slots: np.ndarray, ddr_slots: np.ndarray) -> None:
        if self._queued is not None:
            self._queued["down"][0].append(hbm_slots)
            self._queued["down"][1].append(ddr_slots)
            return
        self._copy(self.hbm, hbm_slots, self.ddr, ddr_slots)

    def ddr_to_hbm(self, ddr_slots: np.ndarray, hbm_slots: np.ndarray) -> None:
        if self._queued is not None:
            self._queued["up"][0].append(ddr_slots)
            self._queued["up"][1].append(hbm_slots)
            return
        self._copy(self.ddr, ddr_slots, self.hbm, hbm_slots)

    def _items(self, keys: list[BlockKey], pool: KVPool, slots: np.ndarray, tokens: list[int]) -> list:
        k, v = pool.read(torch.from_numpy(slots).to(pool.k.device))  # [Hkv, n, bs, D]
        k, v = k.cpu(), v.cpu()
        return [(key, k[:, i, :n], v[:, i, :n]) for i, (key, n) in enumerate(zip(keys, tokens, strict=True))]

    def submit_write(self, keys: list[BlockKey], pool: KVPool, slots: np.ndarray, tokens: list[int]) -> Transfer:
        """Start archiving blocks (their first `tokens` tokens) from `pool`; the bytes are copied now.
        Whole blocks of one session go in bulk (`put_blocks`: no Python call per block)."""
        assert self.archive is not None and self._writer is not None
        _check_slots(keys, slots)
        bs = pool.k.shape[2]
        if keys and all(n == bs for n in tokens) and len({key.session for key in keys}) == 1:
            k, v = pool.read(torch.from_numpy(slots).to(pool.k.device))  # [Hkv, n, bs, D]
            layers = np.array([key.layer for key in keys], dtype=np.int64)
            indices = np.array([key.index for key in keys], dtype=np.int64)
            put: Future[Any] = self._writer.submit(
                self.archive.put_blocks, keys[0].session, layers, indices, k.cpu(), v.cpu()
            )
        else:
            put = self._writer.submit(self.archive.put, self._items(keys, pool, slots, tokens))
        transfer = Transfer(next(self._ids), tuple(keys), put)
        self.in_flight[transfer.id] = transfer
        return transfer

    def write_now(self, keys: list[BlockKey], pool: KVPool, slots: np.ndarray, tokens: list[int]) -> None:
        """Archive blocks and return once they are durable."""
        transfer = self.submit_write(keys, pool, slots, tokens)
        transfer.future.result()

    def poll(self, wait: bool = False) -> list[Transfer]:
        """Finished archive writes, removed from `in_flight` (their futures' errors re-raised by the caller)."""
        done = [t for t in self.in_flight.values() if wait or t.future.done()]
        for t in done:
            if wait:
                t.future.exception()  # waits
            del self.in_flight[t.id]
        return done

    def fence(self) -> list[torch.cuda.Event]:
        """Events after all the device work queued so far, on the compute stream and the mover's
        (none on a CPU, whose copies are done when they return): the slots a read is about to
        write may be ones that work still reads."""
        if self._stream is None:
            return []
        events = []
        for stream in (torch.cuda.current_stream(self.hbm.k.device), self._stream):
            event = torch.cuda.Event()
            event.record(stream)
            events.append(event)
        return events

    def read(self, keys: list[BlockKey], ddr_slots: np.ndarray) -> int:
        """Stage archived blocks into DDR slots, each record read, checked and decoded straight
        into its slot (a partial block's tail zeroed); more than `MIN_READ_PIECE` of them on
        `READ_THREADS` threads at once, in pieces that give every thread some (`READ_PIECE` at
        most). Returns the bytes read (decoded). The first error a record meets (ArchiveCorrupt,
        KeyError) is raised once every read has ended."""
        assert self.archive is not None
        if not keys:
            return 0
        slots = ddr_slots.tolist()
        fence = self.fence()
        n = len(keys)
        per = min(READ_PIECE, max(MIN_READ_PIECE, -(-n // READ_THREADS)))
        pieces = [range(i, min(i + per, n)) for i in range(0, n, per)]
        if len(pieces) == 1:
            self._read_piece(keys, slots, pieces[0], fence)
        else:
            if self._readers is None:
                self._readers = ThreadPoolExecutor(READ_THREADS, thread_name_prefix="h3d-archive-read")
            futures = [self._readers.submit(self._read_piece, keys, slots, piece, fence) for piece in pieces]
            errors = [f.exception() for f in futures]  # waits for every one
            first = next((e for e in errors if e is not None), None)
            if first is not None:
                raise first
        return len(keys) * self.ddr.slot_bytes

    def read_into(self, keys: list[BlockKey], ddr_slots: np.ndarray, fence: list[torch.cuda.Event]) -> None:
        """`read` on the calling thread (a read-ahead thread: `h3d.tiers.readahead`), its slots
        written once the device has passed `fence` (taken where the read was asked for)."""
        self._read_piece(keys, ddr_slots.tolist(), range(len(keys)), fence)

    def _read_piece(self, keys: list[BlockKey], slots: list[int], piece: range, fence: list[torch.cuda.Event]) -> None:
        assert self.archive is not None
        # NumPy views of the pool and the records as integers of the same width: their slice
        # assignment costs a quarter of torch's per call (14 against 58 µs on the CPU host).
        bits = _INT_OF_WIDTH[self.ddr.k.element_size()]
        k, v = self.ddr.k.view(bits).numpy(), self.ddr.v.view(bits).numpy()
        hkv, d = k.shape[0], k.shape[-1]
        records = self.archive.get_bytes([keys[i] for i in piece])
        for event in fence:  # (read and decoded meanwhile)
            event.synchronize()
        for i, (n, raw) in zip(piece, records, strict=True):
            slot = slots[i]
            kv = np.frombuffer(memoryview(raw), dtype=k.dtype).reshape(2, hkv, n, d)
            k[:, slot, :n], v[:, slot, :n] = kv[0], kv[1]
            if n < self.ddr.block_size:
                k[:, slot, n:] = 0
                v[:, slot, n:] = 0

    def close(self) -> None:
        if self._writer is not None:
            self._writer.shutdown(wait=True)
        if self._readers is not None:
            self._readers.shutdown(wait=True)


def _check_slots(keys: list[BlockKey], slots: np.ndarray) -> None:
    """An archive write reads real slots: a NONE (-1) would read the pool's last slot, another
    block's bytes, into a record that checks as sound."""
    if len(slots) and int(slots.min()) < 1:
        raise ValueError(f"an archive write from no slot: {keys[int(np.argmin(slots))]}")
