"""KV blocks copied up to the remote store as write-behind archives them.

Without this, a session's KV reaches the store only when its daemon gives it up (ReleaseSession,
a move, a SIGTERM: `Engine.export_kv`); a daemon killed leaves the daemon that takes its sessions
over nothing but their token logs, and their contexts are computed again. With it, every block
write-behind makes durable in the local archive (`h3d.tiers.writebehind`) is offered here, with its
content key and its record as the archive wrote it (`Archive.put_blocks`: nothing is read back or
encoded again), and sent to the store by the store's own thread (`RemoteLogs.soon`), in
pipelines of `KV_PIPELINE_BYTES`.

What is offered while more than `limit_bytes` wait, or while the store is unavailable, is dropped
and counted (`dropped_blocks`), and so is everything waiting when a send fails (the store down, or
too full for KV: `KVNoRoom`): the local archive keeps it, and the next export writes what the
store lacks (`h3d.remote.kv.outgoing`). So what a kill -9 leaves to compute again is the KV not
archived yet (at most `write_behind_dirty_mb`) and what was dropped here.

Content keys are taken on the engine thread when write-behind submits a batch (`Chains`: the
session's tokens then are the blocks' tokens; a rewind waits for the batches in flight), so a
record is never sent under another content's key.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import numpy as np

from h3d.remote.kv import Chains, pack
from h3d.remote.store import KV_PIPELINE_BYTES, RemoteError

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from h3d.remote.logs import RemoteLogs
    from h3d.tiers.codecs import Codec

log = logging.getLogger(__name__)


class KVCopier:
    """See the module's docstring. `offer` may be called from any thread; the sends run on the
    store's thread, one pipeline at a time."""

    def __init__(
        self,
        remote: RemoteLogs,
        layout: str,
        block_size: int,
        limit_bytes: int,
        tokens_of: Callable[[str], Sequence[int] | None],
    ) -> None:
        """`tokens_of(name)`: the session's tokens (None if it is gone), on the engine thread."""
        self.remote, self.layout, self.block_size, self.limit_bytes = remote, layout, block_size, limit_bytes
        self.tokens_of = tokens_of
        self.chains = Chains(block_size)  # the engine thread's
        self._lock = threading.Lock()
        self._queue: deque[tuple[str, Codec, Buffer]] = deque()  # (key, codec, payload)
        self._bytes = 0  # payload bytes queued or in the pipeline being sent
        self._sending = False
        self._idle = threading.Event()
        self._idle.set()
        self.copied_blocks = 0
        self.copied_bytes = 0
        self.dropped_blocks = 0

    @property
    def queued_bytes(self) -> int:
        return self._bytes

    # ---- the engine thread ---------------------------------------------------------------------

    def digests(self, name: str, blocks: np.ndarray) -> list[str] | None:
        """The content digests of `name`'s whole blocks `blocks` (a write-behind batch, as it is
        submitted); None if the session is gone."""
        tokens = self.tokens_of(name)
        if tokens is None or not len(blocks):
            return None
        chain = self.chains.of(name, tokens, int(blocks.max()) + 1)
        if len(chain) <= int(blocks.max()):
            return None
        return [chain[j] for j in blocks.tolist()]

    def forget(self, name: str) -> None:
        """`name`'s tokens were cut, or it is gone: its digests are taken again when next asked."""
        self.chains.forget(name)

    # ---- any thread ----------------------------------------------------------------------------

    def offer(self, layers: list[int], digests: list[str], records: list[tuple[Codec, Buffer]]) -> None:
        """Whole blocks just made durable in the archive: block i is layer `layers[i]` with content
        `digests[i]` and `records[i]` (codec, payload). Never raises, never waits."""
        size = sum(memoryview(payload).nbytes for _, payload in records)
        with self._lock:
            if self._bytes + size > self.limit_bytes or self.remote.degraded is not None:
                self.dropped_blocks += len(records)
                return
            kv_key = self.remote.store.kv_key
            self._queue.extend(
                (kv_key(self.layout, layer, d), codec, payload)
                for layer, d, (codec, payload) in zip(layers, digests, records, strict=True)
            )
            self._bytes += size
            start, self._sending = not self._sending, True
            self._idle.clear()
        if start:
            sending = self._send()
            try:
                self.remote.soon(sending)
            except Exception as e:  # (the store's thread stopped: a daemon shutting down)
                sending.close()
                with self._lock:
                    self.dropped_blocks += len(self._queue)
                    self._queue.clear()
                    self._bytes, self._sending = 0, False
                    self._idle.set()
                log.debug("KV blocks not copied to the remote store: %s", e)

    async def _send(self) -> None:
        try:
            await self._send_all()
        except BaseException:
            with self._lock:  # (a bug, or the loop stopping: what waits is dropped, the next offer starts again)
                self.dropped_blocks += len(self._queue)
                self._queue.clear()
                self._bytes, self._sending = 0, False
                self._idle.set()
            raise

    async def _send_all(self) -> None:
        while True:
            with self._lock:
                batch, size = [], 0
                while self._queue and size < KV_PIPELINE_BYTES:
                    key, codec, payload = self._queue.popleft()
                    batch.append((key, codec, payload))
                    size += memoryview(payload).nbytes
                if not batch:
                    self._sending = False
                    self._idle.set()
                    return
            items = [(key, pack(self.block_size, codec, payload)) for key, codec, payload in batch]
            try:
                await self.remote.store.put_kv(items, self.remote.kv_ttl_s)
                self.copied_blocks += len(items)
                self.copied_bytes += size
            except RemoteError as e:  # (the archive keeps them: the next export writes what the store lacks)
                with self._lock:  # what waits is dropped too: a store that fails (or is full) would fail it as well
                    self.dropped_blocks += len(items) + len(self._queue)
                    self._bytes -= sum(memoryview(payload).nbytes for _, _, payload in self._queue)
                    self._queue.clear()
                log.debug("KV blocks not copied to the remote store: %s", e)
            finally:
                with self._lock:
                    self._bytes -= size

    def drain(self, timeout: float) -> bool:
        """Wait until what was offered is sent (or dropped); False if `timeout` passed first."""
        return self._idle.wait(timeout)
