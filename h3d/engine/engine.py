"""The engine: sessions, requests and the step loop over one model.

`Engine` owns every session and request; it is single-threaded (the daemon gives it a thread of
its own and serializes calls). Each `step()` reads as four verbs on values (`h3d.engine.step`):
`schedule` picks the chunks of this step (every decoding request's next token, then prefill chunks
within `prefill_chunk_tokens`), the runner plans them (`plan`) and runs them in one forward
(`execute`), and the commit counts, promotes and updates the cache (`runner.commit`), then
samples and emits events (`commit`). Upkeep between steps (`upkeep`) is a call of its own.
Requests join and leave between steps (continuous batching).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import itertools
import logging
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from h3d.config import EngineConfig
from h3d.engine.build import budgets, build_runner
from h3d.engine.chat import Conversation, chat_piece, end_of_turn
from h3d.engine.detok import IncrementalDetokenizer
from h3d.engine.graphs import GraphKey
from h3d.engine.journal import log_piece, meta_of, replay_chat, restore_session, restore_sessions, session_meta
from h3d.engine.prefill import Interleave
from h3d.engine.prefixes import PrefixIndex
from h3d.engine.sampling import Argmax, SamplingParams, make_generator, sample_batch
from h3d.engine.session import (
    AppendDone,
    Event,
    FinishReason,
    GenerationDone,
    NewSession,
    PrefillProgress,
    Request,
    RequestFailed,
    RequestId,
    Session,
    SessionId,
    TokenDelta,
)
from h3d.engine.step import Chunk, HostTimes, SchedulerOutput, StepReport, StepTiming
from h3d.engine.stops import generation_done, stop_reason, visible_text
from h3d.engine.upkeep import BlockRepair, enforce_ssd_capacity, forget_coldest, park_kv, purge_kv, sweep_archive
from h3d.engine.warmup import Warmup, warm_up
from h3d.errors import (
    ContextTooLong,
    H3Error,
    InvalidRequest,
    NoChatTemplate,
    NoRemoteTier,
    OutOfBlocks,
    RemoteError,
    SessionBusy,
    SessionNotFound,
    SsdDegraded,
    TiersFull,
    clip,
)
from h3d.hbf.policy import PROBE_QUERIES, policy_named
from h3d.kv.blocks import SeqId
from h3d.model.loader import Weights, start_model
from h3d.model.tokenizer import Tokenizer
from h3d.store.tokenlog import TokenStore, parse_log
from h3d.tiers.identity import ArchiveCorrupt, ArchiveError, ArchiveWriteFailed
from h3d.tiers.stats import TierStats

if TYPE_CHECKING:
    from h3d.remote.copyup import KVCopier
    from h3d.remote.logs import RemoteLogs

log = logging.getLogger(__name__)

PREFILL_RATE_MIN_TOKENS = 2048  # an append this long counts in the prefill rate (`Engine._choose_kv`)


@dataclasses.dataclass(slots=True)
class TakenOver:
    """`Engine.take_over`'s answer: the session's log, and its KV read from the remote store (or
    left to compute again: `kv_source`, with the estimates it was chosen by)."""

    data: bytes
    kv_blocks: int = 0
    kv_bytes: int = 0
    kv_s: float = 0.0
    digest_blocks: int = 0  # the blocks its digest snapshot from the store covers (0: none)
    digest_s: float = 0.0
    kv_source: str = "store"  # store | recompute
    read_estimate_s: float | None = None  # its KV from the store, at the store's rate measured here
    prefill_estimate_s: float | None = None  # its KV computed again, at the prefill rate measured here


@dataclass(slots=True)
class Checkpoint:
    """What `Engine.checkpoint` did, so far."""

    sessions: int = 0  # sessions to checkpoint
    sessions_done: int = 0  # of them, handled (written, or left to recompute)
    blocks_written: int = 0
    sessions_left: int = 0  # sessions a restart will compute again in part
    blocks_left: int = 0  # the blocks it will compute again from their token logs
    digest_bytes: int = 0  # digest snapshots written (`h3d.tiers.digestfile`)


@dataclass(slots=True)
class EngineCounters:
    """Cumulative work since the engine started."""

    steps: int = 0
    prefill_tokens: int = 0  # tokens fed in prefill chunks (more than one token per sequence)
    generated_tokens: int = 0
    prefix_queries: int = 0  # first requests of sessions with no KV that looked for a prefix (share_prefixes)
    prefix_hits: int = 0  # of those, the ones that found KV to copy
    prefix_reused_tokens: int = 0  # tokens whose KV blocks they shared instead of computing them


class Engine:
    def __init__(self, config: EngineConfig, remote: RemoteLogs | None = None) -> None:
        self.config = config.validate()
        # The remote tier's copies of the token logs (the daemon's `remote_url`): the store's log is
        # each session's truth, and a session another daemon served is taken over from it (`adopt`).
        self.remote = remote
        # The prefill's tokens/s as measured here (the warm-up's second scratch prompt on a GPU,
        # then long appends); None: not measured yet (`_choose_kv`)
        self.prefill_tokens_per_s: float | None = None
        # The weights are read in the background while the tiers are sized and built and the
        # sessions restored (`start_model`); nothing runs the model before `weights.wait()`.
        t0 = time.perf_counter()
        self.model, weights = start_model(config.model, config.resolved_dtype, config.resolved_device)
        setup_s = time.perf_counter() - t0  # the folder checked, the parameters allocated (the device's start)
        try:
            self._start(config, weights, remote)
        except BaseException:
            weights.join()  # (its own failure, if any, after the one raised here)
            raise
        t2 = time.perf_counter()
        weights.wait()
        # Where the start's time went (the daemon's `model_loaded` event): the model's setup, the
        # tokenizer, the pools, the sessions, the weights' reading (beside them) and the wait for
        # it after them
        self.start_s["setup_s"] = round(setup_s, 3)
        self.start_s["device_s"] = round(weights.device_s, 3)  # of setup_s: the device's start
        self.start_s["model_s"] = round(weights.seconds, 3)
        self.start_s["weights_wait_s"] = round(time.perf_counter() - t2, 3)

    def _start(self, config: EngineConfig, weights: Weights, remote: RemoteLogs | None) -> None:
        """`__init__`'s part beside the weights' reading: everything but running the model."""
        t0 = time.perf_counter()
        self.tokenizer = Tokenizer(config.model)
        tokenizer_s = time.perf_counter() - t0
        self.max_context = config.max_context_tokens or self.model.config.max_position_embeddings
        self.budgets = budgets(config, self.model, self.max_context, weights.gpu_free)  # `auto` keys resolved
        t1 = time.perf_counter()
        self.runner = build_runner(config, self.model, self.budgets, self.max_context)
        self.start_s = {"tokenizer_s": round(tokenizer_s, 3), "pools_s": round(time.perf_counter() - t1, 3)}
        self.kv = self.runner.kv  # every session's KV state: asked and changed there
        self.eos_ids = frozenset(self.model.config.eos_token_ids)
        self.sessions: dict[SessionId, Session] = {}
        # Finished request sessions kept for their KV (`retire`), least recently used first, and
        # the hash chains that find a new session's prefix among them and the sessions
        self.prefix_cache: collections.OrderedDict[SessionId, Session] = collections.OrderedDict()
        self.prefixes = PrefixIndex(config.block_size)
        self._requests: dict[RequestId, Request] = {}
        self._seq_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._ended: list[Event] = []  # requests ended outside a step, reported by step() / take_events()
        self.counters = EngineCounters()
        self.journal: TokenStore | None = None
        self.restored: list[SessionId] = []  # sessions reopened from the token logs at start
        self.swept = 0  # archived blocks at start of sessions without a token log (deleted)
        self.rebuilds: list[str] = []  # why KV was dropped to be prefilled again (the daemon logs them)
        self.evictions: list[SessionId] = []  # closed sessions whose archived KV ssd_capacity_mb evicted
        # Decoding requests the last step left out, their sessions' KV past what HBM and DDR hold (`schedule`)
        self.waiting_for_memory: set[RequestId] = set()
        self.warmup: Warmup | None = None  # what `warm` did (the daemon warms before it is ready)
        self.captured: list[GraphKey] = []  # decode graphs captured between steps (the daemon logs them)
        self._repairer = BlockRepair(self.runner, self.rebuilds)  # damaged blocks' KV computed again
        self.interleave = Interleave(self.runner, config.prefill_step_ms)  # a long prompt beside decoding
        self.timing = StepTiming()  # where the last step's time went (the daemon logs slow ones)
        self._upkept = 0  # the step of the last upkeep
        self._rebalanced = False  # this step has rebalanced HBM (`_rebalance`)
        self._touched: dict[SessionId, None] = {}  # sessions whose requests ended: their metadata to write
        # Every Generate ends durable: its session's log fsynced at the step that ends it, on this
        # thread; the daemon turns it off and waits for it off the engine's thread instead
        # (`EngineWorker`: the generation's end goes out once `TokenStore.sync_behind` is done).
        self.sync_on_finish = True
        self.moved_away: list[str] = []  # sessions another daemon serves now (their local logs dropped at start)
        if config.session_log_path is not None:
            self.journal = TokenStore(Path(config.session_log_path), config.fsync_interval_ms, mirror=remote)
            if remote is not None:
                self._reconcile(remote)
            restored = restore_sessions(
                self.journal, self.kv, self.tokenizer, config.policy, self._seq_ids, self.runner.device
            )
            for session in restored:
                self.sessions[session.id] = session
                self.restored.append(session.id)
            self.swept = sweep_archive(self.kv, set(self.sessions))
            if config.read_ahead_at_start:  # the most recently used open sessions first
                recent = sorted((self.sessions[i] for i in self.restored), key=lambda x: -x.last_used_at)
                self.kv.resume_ahead([s.seq for s in recent if not s.closed])
            self.start_s["sessions_s"] = round(time.perf_counter() - t1 - self.start_s["pools_s"], 3)
        self.copier: KVCopier | None = None  # write-behind's KV copied to the remote store as well
        archive = self.kv.archive
        if remote is not None and archive is not None and remote.kv_copy_bytes > 0 and self.kv.tiers.behind.enabled:
            from h3d.remote.copyup import KVCopier
            from h3d.remote.kv import layout

            self.copier = KVCopier(
                remote, layout(archive.identity), config.block_size, remote.kv_copy_bytes, self._tokens_of
            )
            self.kv.tiers.behind.copy_up = self.copier

    def _tokens_of(self, name: str) -> list[int] | None:
        session = self.sessions.get(SessionId(name))
        return session.tokens if session is not None else None

    def _forget_chains(self, session_id: SessionId) -> None:
        """`session_id`'s tokens were cut, or it is gone: its hash chains are taken again when next asked."""
        self.prefixes.forget(session_id)
        if self.copier is not None:
            self.copier.forget(session_id)

    def _reconcile(self, remote: RemoteLogs) -> None:
        """At start, the local logs against the store's (`RemoteLogs.reconcile`): a session whose
        log the store changed (another daemon served it since) loses its archived KV here, which
        may be of other tokens; one another daemon serves now is dropped."""
        assert self.journal is not None
        archive = self.kv.archive
        self.moved_away, replaced = remote.reconcile(sorted(self.journal.folder.glob("*.h3log")))
        if archive is not None and self.kv.writable:
            for session in [*self.moved_away, *replaced]:
                archive.remove(session)
                if self.kv.digest_files is not None:  # (of the same tokens as that KV)
                    self.kv.digest_files.remove(session)

    def take_over(self, session_id: SessionId) -> TakenOver | None:
        """The remote store's part of taking a session over, off the engine thread (it reads only
        the store and writes only the archive, which any thread may): its lease and its log
        (`RemoteLogs.adopt`), then its KV blocks in the store read into the archive under its name
        (what this daemon archived of it before dropped first: maybe of other tokens). Returns the
        log for `adopt` and what was read of the KV; None if the store has no such session. Raises
        Held (another daemon serves it) or RemoteUnavailable."""
        if self.remote is None or self.journal is None:
            return None
        data = self.remote.adopt(session_id)
        if data is None:
            return None
        archive, out = self.kv.archive, TakenOver(data)
        if archive is not None and self.kv.writable:
            files = self.kv.digest_files
            try:
                archive.remove(session_id)
                if files is not None:
                    files.remove(session_id)
                tokens = parse_log(session_id, data).tokens
                written = tokens[: max(len(tokens) - 1, 0)]  # (the last token: fed by the next request)
                if self._choose_kv(out, written):  # (rates measured before: chosen before reading anything)
                    remote = self.remote

                    def measured(nbytes: int, seconds: float) -> bool:  # the snapshot's first piece: go on?
                        remote.note_read(nbytes, seconds)
                        return self._choose_kv(out, written)

                    t0 = time.perf_counter()
                    try:
                        out.digest_blocks = self._import_digests(session_id, written, measured)
                    except (RemoteError, OSError, ValueError) as e:  # (rebuilt from the keys instead)
                        log.warning("digests of session %s not read from the remote store: %s", session_id, e)
                    t1 = time.perf_counter()
                    out.digest_s = t1 - t0
                    if out.kv_source == "store":  # (as `measured` chose: no snapshot installed otherwise)
                        out.kv_blocks, out.kv_bytes = self._import_kv(session_id, written)
                        out.kv_s = time.perf_counter() - t1
                        self.remote.note_read(out.kv_bytes, out.kv_s)  # (the store's path: its archive writes too)
            except (RemoteError, ArchiveError, OSError) as e:  # (its KV is computed again instead)
                log.warning("KV of session %s not read from the remote store: %s", session_id, e)
                with contextlib.suppress(ArchiveError, OSError):
                    archive.remove(session_id)
                    if files is not None:
                        files.remove(session_id)
        return out

    def adopt(self, session_id: SessionId, data: bytes) -> Session:
        """On the engine thread, after `take_over`: the session restored from its log `data` (its
        KV read from the archive, or computed again, by its next request)."""
        assert self.remote is not None and self.journal is not None
        if session_id in self.sessions:
            return self.sessions[session_id]
        try:
            try:
                restored = self.journal.restore(session_id, data)
            except ValueError as e:
                raise RemoteError(f"session {session_id}'s log in the remote store cannot be read: {e}") from e
            session = restore_session(
                restored, self.kv, self.tokenizer, self.config.policy, SeqId(next(self._seq_ids)), self.runner.device
            )
        except BaseException:
            self.remote.forget(session_id)
            raise
        self.sessions[session.id] = session
        return session

    def _choose_kv(self, out: TakenOver, tokens: list[int]) -> bool:
        """Whether a session taken over reads the KV of `tokens` from the remote store
        (`remote_kv_resume`: `store`, `recompute`, or `auto`: from the store unless the rates
        measured here say computing it again is faster: its bytes, uncompressed, at the store's
        read rate against its tokens at the prefill's; from the store while either is unknown).
        Notes the choice and its estimates in `out`."""
        assert self.remote is not None
        mode, read_rate, rate = self.remote.kv_resume, self.remote.read_bytes_per_s, self.prefill_tokens_per_s
        nbytes = len(tokens) // self.kv.block_size * self.model.config.num_layers * self.kv.tiers.block_bytes
        read_s = out.read_estimate_s = nbytes / read_rate if read_rate else None
        prefill_s = out.prefill_estimate_s = len(tokens) / rate if rate else None
        auto = read_s is None or prefill_s is None or read_s < prefill_s
        store = auto if mode == "auto" else mode == "store"
        out.kv_source = "store" if store else "recompute"
        return store

    def _import_digests(
        self, session_id: SessionId, tokens: list[int], go_on: Callable[[int, float], bool] | None = None
    ) -> int:
        """The digest snapshot the store holds of `session_id`, installed here if it covers blocks of
        `tokens` (its head names the last block it covers by content: `h3d.remote.kv.digests`), so
        that the session's first step reads its digests first rather than every block; `go_on`:
        told how long its first piece took, may stop the read (`RemoteLogs.get_digests`). Returns
        the blocks it covers (0: none, not of these tokens, or not read whole)."""
        from h3d.remote.kv import digests

        files, remote, bs = self.kv.digest_files, self.remote, self.kv.block_size
        if files is None or remote is None or len(tokens) < bs:
            return 0
        got = remote.get_digests(session_id, go_on)
        if got is None:
            return 0
        head, data = got
        n = int(head.get("blocks", 0))
        if not 0 < n <= len(tokens) // bs or head.get("last") != digests(tokens, bs, n)[-1]:
            return 0
        files.install(session_id, data)
        return n

    def _send_digests(self, session_id: SessionId, tokens: list[int]) -> int:
        """`session_id`'s digest snapshot written to the store with its blocks (`_send_kv`), if it
        has one of `tokens`' blocks. Returns its bytes."""
        from h3d.remote.kv import digests

        files, remote, bs = self.kv.digest_files, self.remote, self.kv.block_size
        if files is None or remote is None:
            return 0
        files.settle(session_id)  # a snapshot on its way (`save_digests_later`) written first
        meta = files.header(session_id)
        n = int(meta.get("blocks", 0)) if meta is not None else 0
        if not 0 < n <= len(tokens) // bs:
            return 0
        data = files.path(session_id).read_bytes()
        remote.put_digests(session_id, {"blocks": n, "last": digests(tokens, bs, n)[-1]}, data, remote.kv_ttl_s)
        return len(data)

    def _import_kv(self, session_id: SessionId, tokens: list[int]) -> tuple[int, int]:
        """The KV blocks of `tokens` the remote store holds (`h3d.remote.kv`), archived here under
        `session_id`: its next request reads them instead of computing them. -> (blocks, bytes read)."""
        from h3d.remote.kv import incoming, layout, wanted

        archive, remote = self.kv.archive, self.remote
        assert archive is not None and remote is not None
        layers = self.model.config.num_layers
        keys = [
            remote.store.kv_key(layout(archive.identity), layer, d)
            for layer, d in wanted(archive.identity, tokens, layers)
        ]
        if not keys:
            return 0, 0
        values = remote.get_kv(keys)
        return incoming(archive, session_id, tokens, layers, values), sum(len(v) for v in values if v is not None)

    def export_kv(self, session_id: SessionId) -> tuple[int, int]:
        """`session_id`'s whole KV blocks, archived here first (`KVCache.snapshot`), written to the
        remote store for the daemon that takes it over next (`h3d.remote.kv`), the partial last one
        too: those it lacks (copied there by write-behind already, `h3d.remote.copyup`: renewed
        only). -> (blocks, bytes written)."""
        session = self.session(session_id)
        if self.kv.archive is None or self.remote is None or not self.kv.writable:
            return 0, 0
        self.kv.snapshot(session.seq, partial=True)  # (its partial last block travels too)
        return self._send_kv(session_id, session.tokens)

    def _send_kv(self, session_id: SessionId, tokens: list[int]) -> tuple[int, int]:
        """`export_kv` once the session's blocks are archived: the archive's records the store lacks
        written there (any thread: it reads only the archive and the store)."""
        from h3d.remote.kv import layout, outgoing

        archive, remote = self.kv.archive, self.remote
        if archive is None or remote is None:
            return 0, 0
        lay, ttl = layout(archive.identity), remote.kv_ttl_s

        def lacks(blocks: list[tuple[int, str]]) -> list[bool]:  # (those it has live `ttl` more)
            return [not had for had in remote.touch_kv([remote.store.kv_key(lay, x, d) for x, d in blocks], ttl)]

        out = outgoing(archive, session_id, tokens, lacks)
        remote.put_kv([(remote.store.kv_key(lay, layer, d), v) for layer, d, v in out], ttl)
        try:
            self._send_digests(session_id, tokens)
        except (OSError, RemoteError) as e:  # (the next daemon rebuilds them from the keys)
            log.warning("digests of session %s not written to the remote store: %s", session_id, e)
        return len(out), sum(len(v) for _, _, v in out)

    def export_kv_all(self, deadline: float | None = None) -> tuple[int, int, int]:
        """Before a shutdown, after the checkpoint: every session's KV blocks written to the remote
        store (`export_kv`), the most recently used first, none started past `deadline`; a
        session left out is computed again by the daemon that takes it over.
        -> (sessions, blocks, bytes)."""
        sessions = blocks = nbytes = 0
        if self.copier is not None:  # what write-behind copies is in the store first (not written twice)
            self.copier.drain(max(0.0, deadline - time.monotonic()) if deadline is not None else 60.0)
        for session in sorted(self.sessions.values(), key=lambda s: s.last_used_at, reverse=True):
            if deadline is not None and time.monotonic() >= deadline:
                break
            try:
                b, n = self.export_kv(session.id)
                blocks, nbytes = blocks + b, nbytes + n
            except (SsdDegraded, RemoteError) as e:
                log.warning("KV of session %s not written to the remote store: %s", session.id, e)
                continue
            sessions += 1
        return sessions, blocks, nbytes

    def hand_over(self, session_id: SessionId) -> None:
        """Give `session_id` up to the other daemons of the remote store: its requests cancelled,
        its KV written to the store, its log's last bytes copied there and its lease released
        (RemoteUnavailable: it stays here), then everything of it here forgotten (its KV, its local
        log); the store keeps it. The daemon runs the three steps apart, the middle one off the
        engine thread: `begin_hand_over`, `send_hand_over`, `end_hand_over`."""
        tokens = self.begin_hand_over(session_id)
        try:
            self.send_hand_over(session_id, tokens)
        except BaseException:
            self.end_hand_over(session_id, released=False)
            raise
        self.end_hand_over(session_id, released=True)

    def begin_hand_over(self, session_id: SessionId) -> list[int]:
        """On the engine thread: `session_id`'s requests cancelled, its metadata in its log, its
        KV archived, and the session marked leaving (busy: no request, fork, rewind or close is
        taken until `end_hand_over`). Returns its tokens, for `send_hand_over`."""
        session = self.session(session_id)
        if self.remote is None or self.journal is None:
            raise NoRemoteTier("handing a session over needs the remote tier (remote_url), which is off")
        self._check_not_leaving(session)
        self.kv.note_hot(session.seq)
        self._save_meta(session, hot=True)  # (the hot blocks: what the next daemon reads ahead first)
        self._cancel_requests(session)
        if self.kv.archive is not None and self.kv.writable:
            try:
                self.kv.snapshot(session.seq, partial=True)  # (its partial last block travels too)
                self.kv.save_digests_later(session.seq)  # (written on a thread; `send_hand_over` sends it)
            except SsdDegraded as e:  # (the next daemon computes what is not archived)
                log.warning("KV of session %s not archived before its hand-over: %s", session_id, e)
        session.busy = session.leaving = True
        return list(session.tokens)

    def send_hand_over(self, session_id: SessionId, tokens: list[int]) -> None:
        """Off the engine thread (the store's calls and the archive's reads): the KV blocks the
        store lacks written there, then the log's last bytes and the lease released
        (RemoteUnavailable: the session stays here)."""
        assert self.remote is not None
        try:
            self._send_kv(session_id, tokens)
        except (RemoteError, ArchiveError) as e:  # (the next daemon computes the KV again)
            log.warning("KV of session %s not written to the remote store: %s", session_id, e)
        self.remote.release(session_id)

    def end_hand_over(self, session_id: SessionId, released: bool) -> None:
        """On the engine thread, after `send_hand_over`: a session `released` forgotten here (its
        KV, its local log; the store keeps it), else taken back (it stays served here)."""
        session = self.sessions.get(session_id)
        if session is None:
            return
        if not released:
            session.busy = session.leaving = False
            return
        assert self.journal is not None
        purge_kv(self.kv, session.seq)
        self._forget_chains(session_id)
        del self.sessions[session_id]
        self.journal.delete(session_id, mirrored=False)

    def _check_not_leaving(self, session: Session) -> None:
        if session.leaving:
            raise SessionBusy(f"session {session.id} is being handed over to another daemon")

    def drop_lost(self) -> list[SessionId]:
        """Sessions whose lease another daemon took (this one was cut off from the store too long):
        forgotten here, their requests cancelled; the store's log, written by the new holder, is
        theirs. Returns them."""
        if self.remote is None or self.journal is None:
            return []
        gone = []
        for sid in self.remote.lost():
            session = self.sessions.get(SessionId(sid))
            self.remote.forget(sid)
            if session is None:
                continue
            self._cancel_requests(session)
            purge_kv(self.kv, session.seq)
            self._forget_chains(session.id)
            del self.sessions[session.id]
            self.journal.delete(session.id, mirrored=False)
            gone.append(session.id)
        return gone

    def tier_stats(self) -> TierStats:
        """The tier layer's counters and occupancy (see h3d.tiers.stats)."""
        return self.kv.stats()

    def close(self) -> None:
        """Finish archive writes in flight and release the archive (its folder stays); token logs
        are synced and closed. The prefix cache's sessions, which have no token log, go with
        their archived blocks."""
        while self.prefix_cache:
            self._drop_cached(self.prefix_cache.popitem(last=False)[1])
        for seq in list(self.kv.parking):  # closed sessions still being archived: parked now
            park_kv(self.kv, seq)
        self.save_touched()
        if self.journal is not None:
            self.journal.close()
        self.kv.close()

    # ---- durability -----------------------------------------------------------------------

    def _save_meta(self, session: Session, hot: bool = False) -> None:
        """Keep `session`'s metadata in its log (see h3d.engine.journal); its HBF anchors only
        where they changed since the log last got them; `hot`: the blocks its last steps read most
        (a checkpoint, a close: what its resume reads ahead first)."""
        if self.journal is not None:
            version = self.kv.selection(session.seq).anchors_version
            meta = session_meta(session, self.kv, anchors=version != session.anchors_logged, hot=hot)
            self.journal.set_meta(session.id, meta)
            session.anchors_logged = version

    def checkpoint(
        self, deadline: float | None = None, progress: Callable[[Checkpoint], None] | None = None
    ) -> Checkpoint:
        """Before a shutdown: every session's KV blocks (the partial last one too) durable in the
        archive, its HBF state in its log, every log synced. With the SSD tier degraded, only the
        logs are written (the KV is computed again after a restart).

        `deadline` (`time.monotonic()`): no session's snapshot starts after it; the sessions left
        are computed again from their token logs after the restart, from their first block the
        archive lacks (`Checkpoint.blocks_left`). The most recently used sessions go first: they
        are the likeliest to come back first. A session's dirty full blocks are written on
        write-behind's threads (`WriteBehind.flush`), the rest (its partial last block) by its
        snapshot. `progress` is called after each session."""
        done = Checkpoint(sessions=len(self.sessions))
        self.interleave.abandon()  # a long prompt half computed: its KV computed again after the restart
        for session in sorted(self.sessions.values(), key=lambda s: s.last_used_at, reverse=True):
            left = None
            if self.kv.writable and (deadline is None or time.monotonic() < deadline):
                # If it fails, the KV is computed again after the restart; the token log is the truth.
                with contextlib.suppress(SsdDegraded):
                    done.blocks_written += self.kv.tiers.behind.flush(session.seq, deadline)  # on its threads
                    done.blocks_written += self.kv.snapshot(session.seq, partial=True)
                    left = 0  # every block durable, the partial last one too
                if left == 0 and (deadline is None or time.monotonic() < deadline):
                    try:  # the digests its resume reads first; without them, rebuilt from its keys
                        done.digest_bytes += self.kv.save_digests(session.seq)
                    except OSError as e:
                        log.warning("digest snapshot of session %s not written: %s", session.id, e)
            if left is None:
                left = self.kv.to_recompute(session.seq)
            done.blocks_left += left
            done.sessions_left += left > 0
            self.kv.note_hot(session.seq)
            self._save_meta(session, hot=True)
            done.sessions_done += 1
            if progress is not None:
                progress(done)
        if self.journal is not None:
            self.journal.sync()
        return done

    # ---- sessions -------------------------------------------------------------------------

    def create_session(
        self,
        system_prompt: str | None = None,
        sampling: SamplingParams | None = None,
        policy: str | None = None,
        owner: str = "",
        chat: bool = False,
    ) -> SessionId:
        """A new session. `chat`: what is appended are messages rendered through the model's chat
        template (`system_prompt` is its system message; see h3d.engine.chat)."""
        return self.add_session(self.prepare_session(system_prompt, sampling, policy, owner, chat))

    def prepare_session(
        self,
        system_prompt: str | None = None,
        sampling: SamplingParams | None = None,
        policy: str | None = None,
        owner: str = "",
        chat: bool = False,
    ) -> NewSession:
        """`create_session`'s first half, which any thread may run (it reads the configuration
        and the tokenizer only): the request checked, the system prompt tokenized, and the token
        log written, durable before the session is known. `add_session` (the engine's thread)
        takes it in; a request for it must come after that (the daemon's commands run in order)."""
        chosen = policy_named(policy or self.config.policy)
        if chat and self.tokenizer.chat_template is None:
            raise NoChatTemplate("this model has no chat template: create a plain session (chat off)")
        defaults = self.config.sampling
        params = sampling or SamplingParams(
            max_tokens=defaults.max_tokens, temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k
        )
        session = Session(
            id=SessionId(uuid.uuid4().hex),
            seq=SeqId(next(self._seq_ids)),
            sampling=params.validate(),
            owner=owner,
            chat=Conversation() if chat else None,
        )
        message = None
        if chat and system_prompt:
            assert session.chat is not None
            system_prompt = session.chat.add(self.tokenizer, "system", system_prompt, [])
            message = {"role": "system", "content": session.chat.messages[-1]["content"]}
        # Without the encoding memo (`scope`): it belongs to the engine's thread.
        first = self.tokenizer.encode(system_prompt, add_special_tokens=True) if system_prompt else []
        self._check_tokens(session, first)
        selection = self.kv.new_selection(chosen)
        size = 0
        if self.journal is not None:  # durable before it is known
            meta = meta_of(session, selection, None)
            size = self.journal.write_new(session.id, meta, first, {**message, "n": len(first)} if message else None)
            session.anchors_logged = selection.anchors_version
        session.tokens.extend(first)
        session.pieces += bool(first)
        return NewSession(session, selection, size)

    def add_session(self, new: NewSession) -> SessionId:
        """Take in a session `prepare_session` made (on the engine's thread)."""
        self.kv.tiers.behind.hold_back()  # (a request for it comes next, most likely)
        session = new.session
        self.kv.open(session.seq, session.id, state=new.selection)
        try:
            if self.journal is not None:
                self.journal.open_new(session.id)
        except BaseException:
            self.kv.release(session.seq, purge_archive=False)
            raise
        self.sessions[session.id] = session
        return session.id

    def fork_session(self, session_id: SessionId, at_tokens: int | None = None, owner: str | None = None) -> SessionId:
        """A new session whose context is the first `at_tokens` tokens of `session_id`'s (all of
        them by default), with its sampling defaults, policy and chat conversation; `owner`: the
        parent's by default. Its token log is written first (durable before it is known).
        - A fork of the whole context is the parent's twin (`KVCache.fork_whole`): every KV block
          shared, the partial last one copied, the parent's HBF state taken; it continues as the
          parent would, nothing prefilled again (its last prompt tokens are the parent's, so the
          parent's prompt probe is its own).
        - A fork of a prefix (or of a parent whose KV DDR cannot take back from the archive)
          shares the parent's blocks where the parent holds them in HBM or DDR (`KVCache.fork`), whole blocks up to
          `PROBE_QUERIES` tokens before the last one, so that the prompt probe sees the fork's own
          last tokens as it would an unshared session's. The rest is prefilled by `catch_up` (the
          daemon's ForkSession waits for it), or by the fork's next request.
        A chat session forks only where no message's tokens are cut."""
        parent = self.session(session_id)
        self._check_not_leaving(parent)
        if parent.busy:
            raise SessionBusy(f"session {session_id} has a request in flight: fork it once it ends")
        total = len(parent.tokens)
        n = total if at_tokens is None else at_tokens
        if not 0 <= n <= total:
            raise InvalidRequest(f"at_tokens: {n} is past the session's context ({total} tokens)")
        if parent.chat is not None and self.journal is None and n != total:
            raise InvalidRequest("at_tokens: a chat session without a token log forks whole")
        session = Session(
            id=SessionId(uuid.uuid4().hex),
            seq=SeqId(next(self._seq_ids)),
            sampling=parent.sampling,
            tokens=parent.tokens[:n],
            pieces=parent.pieces if n else 0,
            owner=parent.owner if owner is None else owner,
            chat=None if parent.chat is None else parent.chat.copy(),
        )
        self.kv.open(session.seq, session.id, self.kv.policy(parent.seq))
        try:
            if self.journal is not None:  # durable before it is known
                try:
                    logged = self.journal.fork(parent.id, session.id, session_meta(session, self.kv), n)
                except ValueError as e:
                    raise InvalidRequest(f"at_tokens: {e}") from None
                if parent.chat is not None:
                    session.chat = replay_chat(self.tokenizer, logged.messages, session.tokens)
                session.anchors_logged = self.kv.selection(session.seq).anchors_version
            shared = 0
            if n == total and self.kv.cached_tokens(parent.seq) == total - 1:  # the parent's twin
                shared = self.kv.fork_whole(parent.seq, session.seq)
                self._save_meta(session)  # (its anchors, the parent's)
                if shared and parent.closed:  # (read back for the fork: to the archive only again, but what it shares)
                    park_kv(self.kv, parent.seq)
            if not shared:
                shared = self._share_kv(parent, session, max(n - 1 - PROBE_QUERIES, 0))
        except BaseException:
            if self.journal is not None and session.id in self.journal.open_sessions():
                self.journal.delete(session.id)
            self.kv.release(session.seq, purge_archive=False)
            raise
        self.sessions[session.id] = session
        self.kv.tiers.notices.append(
            ("session_forked", {"session": session.id, "parent": parent.id, "tokens": n, "kv_shared_tokens": shared})
        )
        return session.id

    def catch_up(self, session_id: SessionId) -> RequestId | None:
        """Queue the prefill of the session's tokens whose KV is not computed, but its last (the
        next request feeds it): an append of no new tokens (a fork's tail). None if there is none."""
        session = self.session(session_id)
        self._check_not_leaving(session)
        if session.busy:
            raise SessionBusy(f"session {session_id} already has a request in flight")
        cached = self.kv.cached_tokens(session.seq)
        target = len(session.tokens) - 1
        if target <= cached:
            return None
        if session.closed:
            self._reopen(session)
        self._admit(session, target - cached)
        req = Request(
            id=RequestId(next(self._request_ids)), session=session, generate=False, params=session.sampling,
            generator=None, detok=None, tokens_added=0, prefill_total=target - cached,
        )  # fmt: skip
        session.busy = True
        self._requests[req.id] = req
        return req.id

    def session(self, session_id: SessionId) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {clip(session_id)!r}")
        return session

    def set_pin(self, session_id: SessionId, until: float | None) -> None:
        """Pin a session's HBM blocks until the Unix time `until` (math.inf: until unpinned), or
        unpin it (None). Kept in its log: a restarted daemon keeps the pin."""
        session = self.session(session_id)
        self.kv.pin(session.seq, until)
        self._save_meta(session)

    def set_extra(self, session_id: SessionId, key: str, value: object) -> None:
        """Keep `value` (JSON) under `key` in the session's `extra`, in its log (None: drop the key)."""
        session = self.session(session_id)
        if value is None:
            session.extra.pop(key, None)
        else:
            session.extra[key] = value
        self._save_meta(session)

    def rewind(self, session_id: SessionId, num_tokens: int) -> None:
        """Cut the session's context back to its first `num_tokens` tokens (and its KV with it).

        Used to branch several continuations from one prefill (benchmarks): the KV and the digests
        are those of the kept tokens, so every branch selects as if the others had never run. The
        archive's records past the cut are deleted first; if the archive takes no writes, the
        rewind is refused (SsdDegraded) and the tokens stay.
        """
        session = self.session(session_id)
        self._check_not_leaving(session)
        if session.busy:
            raise InvalidRequest(f"session {session_id} has a request in flight")
        if session.chat is not None:
            raise InvalidRequest("a chat session cannot be rewound (its messages would no longer match its context)")
        if not 0 <= num_tokens <= len(session.tokens):
            raise InvalidRequest(f"cannot rewind to {num_tokens} tokens: the context holds {len(session.tokens)}")
        keep = max(0, min(self.cached_tokens(session_id), num_tokens - 1))
        self.kv.truncate(session.seq, keep)
        if num_tokens < len(session.tokens):  # other tokens will follow: the archived KV past the cut is not theirs
            self.kv.forget_archived(session.seq, keep // self.kv.block_size)  # SsdDegraded: the tokens stay
        if self.journal is not None:
            self.journal.cut(session.id, num_tokens)
        del session.tokens[num_tokens:]
        self._forget_chains(session.id)  # its chain is hashed again from its tokens when next asked

    def close_session(self, session_id: SessionId, purge: bool = False, later: bool = False) -> None:
        """End `session_id`'s requests (cancelled) and free its memory. With `purge`, the session
        is deleted: its token log and archived KV go, their disk space given back by a compaction
        on the archive's own thread (`Archive.compact_later`). Without, it is closed: its KV goes
        to the archive only (or is forgotten, to be computed again, without a writable archive),
        it stays listed, and its next request reopens it where it stopped. With `later` (the
        daemon's), its KV goes once write-behind has archived it (`KVCache.park_later`, finished
        between steps: `upkeep`, `write_behind`); a request before then finds it where it was."""
        session = self.session(session_id)
        self._check_not_leaving(session)
        self._cancel_requests(session)
        kv = self.kv
        if purge:
            purge_kv(kv, session.seq)
            self._forget_chains(session_id)
            del self.sessions[session_id]
            if self.journal is not None:
                self.journal.delete(session_id)
            if kv.archive is not None and kv.writable:
                kv.archive.compact_later()  # the purged records' space, given back off this thread
            return
        if session.closed:
            return
        kv.note_hot(session.seq)  # (before its KV goes to the archive)
        if not (later and kv.park_later(session.seq)):
            park_kv(kv, session.seq)
        session.closed = True
        self._save_meta(session, hot=True)
        enforce_ssd_capacity(self.kv, self.sessions.values(), self.evictions)

    def retire(self, session_id: SessionId) -> None:
        """A request's session once it is answered (the OpenAI API's completions, a response with
        `store: false`): deleted as a purge deletes it (its token log goes, it is no longer
        listed), but its KV is kept for prefix reuse (`prefix_cache`, at most
        `prefix_cache_sessions`, least recently used dropped first). Purged where nothing would
        be reused (`share_prefixes` off, no cache, or not a whole block of KV)."""
        session = self.session(session_id)
        keep = self.config.prefix_cache_sessions
        if self._scope(session) is None or keep <= 0 or self.kv.cached_tokens(session.seq) < self.kv.block_size:
            self.close_session(session_id, purge=True)
            return
        self._cancel_requests(session)
        del self.sessions[session_id]
        if self.journal is not None:
            self.journal.delete(session_id)
        self.prefix_cache[session_id] = session
        while len(self.prefix_cache) > keep:
            self._drop_cached(self.prefix_cache.popitem(last=False)[1])

    def _admit(self, session: Session, n_tokens: int) -> None:
        """`KVCache.admit` `n_tokens` more of `session`'s tokens. Where the tiers cannot hold them
        (`TiersFull`: HBM, DDR and the archive within `ssd_capacity_mb` together), cold KV is
        forgotten until they can: the prefix cache's sessions', then closed sessions', least
        recently used first (their tokens stay; the KV is computed again if they are used), as
        `ssd_capacity_mb` evicts it. Raises TiersFull where nothing cold is left."""
        while True:
            try:
                self.kv.admit(session.seq, n_tokens, self._active())
                return
            except TiersFull:
                if self.prefix_cache:
                    self._drop_cached(self.prefix_cache.popitem(last=False)[1])
                    continue
                try:
                    if not forget_coldest(self.kv, self.sessions.values(), self.evictions, keep=session):
                        raise
                except ArchiveWriteFailed as e:  # (its records' tombstone refused: they stay)
                    self.kv.degrade(e)
                    raise TiersFull(f"{e}: the archive takes no writes, so no closed session's KV can make room") from e

    def _active(self) -> set[SeqId]:
        """The sessions with a request queued or running (their digests are never set aside)."""
        return {r.session.seq for r in self._requests.values()}

    def _cancel_requests(self, session: Session) -> None:
        """End `session`'s requests as cancelled (reported by the next `step` / `take_events`)."""
        for req in [r for r in self._requests.values() if r.session is session]:
            self._ended.append(self._finish(req, FinishReason.CANCELLED))

    def _drop_cached(self, session: Session) -> None:
        self._forget_chains(session.id)
        purge_kv(self.kv, session.seq)

    def _share_kv(self, donor: Session, session: Session, num_tokens: int) -> int:
        """`KVCache.fork`; a closed donor, whose blocks it read back from the archive, goes back
        to the archive only, as closed sessions are (but for the blocks it now shares)."""
        shared = self.kv.fork(donor.seq, session.seq, num_tokens)
        if donor.closed:
            park_kv(self.kv, donor.seq)
        return shared

    def _scope(self, session: Session) -> str | None:
        """Whose sessions `session` may reuse a prefix of (`share_prefixes`); None: nobody's."""
        share = self.config.share_prefixes
        return None if share == "off" else "" if share == "all" else f"owner:{session.owner}"

    def _reuse_prefix(self, session: Session) -> int:
        """A session with less than a block of KV (none yet, or a short system message's), whose
        tokens begin with whole blocks another session (or a retired one, `prefix_cache`) of its
        scope holds KV for: those KV blocks shared (`KVCache.fork`; what little KV it had is
        dropped first), up to `PROBE_QUERIES` tokens before its last token, so that its prompt
        probe sees its own last tokens. A session whose first block the archive alone holds (a
        restart, a reopening) takes another's blocks in HBM or DDR for its own instead of reading
        them back (`KVCache.rebase`): a restart rebuilds the sharing as sessions are used. Returns
        the tokens shared (counted: `EngineCounters.prefix_*`)."""
        scope = self._scope(session)
        bs = self.kv.block_size
        had = self.kv.cached_tokens(session.seq)
        resumed = had >= bs and self.kv.resident_head(session.seq) == 0
        n = had if resumed else len(session.tokens) - 1 - PROBE_QUERIES
        if scope is None or n < bs or (had >= bs and not resumed):
            return 0
        self.counters.prefix_queries += 1
        pool = {**self.sessions, **self.prefix_cache}
        for other in pool.values():
            if other is not session and self._scope(other) == scope:
                self.prefixes.refresh(other.id, scope, other.tokens)
        best, blocks = None, 0
        for sid, shared in self.prefixes.longest(scope, session.tokens[:n], exclude=session.id).items():
            donor = pool.get(SessionId(sid))
            if donor is None:
                continue
            held = self.kv.resident_head(donor.seq) if resumed else self.kv.cached_tokens(donor.seq) // bs
            have = min(shared, held)
            if have > blocks:
                best, blocks = donor, have
        if best is None:
            return 0
        if best.id in self.prefix_cache:
            self.prefix_cache.move_to_end(best.id)
        if resumed:
            shared = self.kv.rebase(best.seq, session.seq, blocks * bs)
        else:
            if had:
                self.kv.truncate(session.seq, 0)  # (less than a block: its tokens are the donor's too)
            shared = self._share_kv(best, session, blocks * bs)
        self.counters.prefix_hits += bool(shared)
        self.counters.prefix_reused_tokens += shared
        return shared

    def _reopen(self, session: Session) -> None:
        session.closed = False
        self.kv.unpark(session.seq)  # (closed a moment ago: its KV is still where it was)
        self._save_meta(session)

    def _park_ready(self) -> bool:
        """Park the closed sessions whose KV write-behind has archived (`KVCache.park_later`);
        returns whether some are still being archived."""
        for seq in self.kv.parked():
            park_kv(self.kv, seq)
        return bool(self.kv.parking)

    def set_policy(self, session_id: SessionId, policy: str) -> None:
        """Switch the HBF policy a session's decode steps use (takes effect at the next step)."""
        chosen = policy_named(policy)
        session = self.session(session_id)
        held = self.interleave.current
        if held is not None and held.request.session is session:
            raise SessionBusy(f"session {session_id} is computing a long prompt: switch its policy after the append")
        self.kv.set_policy(session.seq, chosen)
        self._save_meta(session)

    def hbf_latency_us(self) -> tuple[float, float]:
        """p50 and p99 of the host-side HBF planning per step, over the last steps (0, 0 if none)."""
        return self.kv.hbf_latency_us()

    def cached_tokens(self, session_id: SessionId) -> int:
        return self.kv.cached_tokens(self.session(session_id).seq)

    # ---- requests -------------------------------------------------------------------------

    def _tokenize(self, session: Session, text: str) -> list[int]:
        # Special tokens only where the tokenizer adds them to a session's first piece. A text sent
        # again, longer (a stateless chat's next turn), is encoded only past what its owner sent
        # before (`EncodeMemo`).
        return self.tokenizer.encode(text, add_special_tokens=session.pieces == 0, scope=session.owner or "")

    def _check_tokens(self, session: Session, ids: list[int]) -> None:
        if len(session.tokens) + len(ids) > self.max_context:
            raise ContextTooLong(
                f"context would be {len(session.tokens) + len(ids)} tokens, max_context_tokens is {self.max_context}"
            )
        bad = [t for t in ids if not 0 <= t < self.model.config.vocab_size]
        if bad:
            raise InvalidRequest(f"token id {bad[0]} is outside the vocabulary (size {self.model.config.vocab_size})")

    def _extend(self, session: Session, ids: list[int], message: dict[str, object] | None = None) -> None:
        self._check_tokens(session, ids)
        if self.journal is not None:  # the log first: it is the truth
            log_piece(self.journal, session.id, ids, message)
        session.tokens.extend(ids)
        session.pieces += 1
        session.last_used_at = time.time()

    def submit(
        self,
        session_id: SessionId,
        text: str | None = None,
        token_ids: list[int] | None = None,
        generate: bool = True,
        params: SamplingParams | None = None,
        role: str | None = None,
    ) -> RequestId:
        """Queue an append (generate=False) or a generation continuing the session's context. In a
        chat session an append is a message (`role`, default "user", and `text`) and a generation
        opens the assistant's turn and stops at its end."""
        session = self.session(session_id)
        self._check_not_leaving(session)
        if session.busy:
            raise SessionBusy(f"session {session_id} already has a request in flight")
        params = (params or session.sampling).validate()
        ids = list(token_ids or [])
        chat, message = chat_piece(session.chat, self.tokenizer, session.tokens, text, ids, role, generate)
        if session.closed:
            self._reopen(session)
        if chat is not None:
            text = chat[1]
            if generate and not params.ignore_eos and self.end_of_turn is not None:
                params = replace(params, stop_token_ids=(*params.stop_token_ids, self.end_of_turn))
        if text:
            ids += self._tokenize(session, text)
        if not generate and not ids:
            raise InvalidRequest("append needs text or token ids")
        if generate and len(session.tokens) + len(ids) >= self.max_context:
            raise ContextTooLong(
                f"the context already holds {len(session.tokens) + len(ids)} tokens: "
                f"no room to generate within max_context_tokens={self.max_context}"
            )
        growth = len(ids) + (params.max_tokens if generate else 0)
        total = min(len(session.tokens) + growth, self.max_context)
        self._admit(session, total - self.kv.cached_tokens(session.seq))
        if ids:
            self._extend(session, ids, message)
        if chat is not None:
            session.chat = chat[0]
            if generate:
                session.chat.begin(len(session.tokens))
        if generate and not session.tokens:
            raise InvalidRequest("cannot generate from an empty context")
        self._reuse_prefix(session)
        cached = self.kv.cached_tokens(session.seq)
        target = len(session.tokens) if generate else len(session.tokens) - 1
        req = Request(
            id=RequestId(next(self._request_ids)),
            session=session,
            generate=generate,
            params=params,
            generator=make_generator(params, self.runner.device) if generate else None,
            detok=IncrementalDetokenizer(self.tokenizer) if generate else None,
            tokens_added=len(ids),
            prefill_total=max(target - cached, 0),
        )
        session.busy = True
        session.last_used_at = time.time()
        self._requests[req.id] = req
        return req.id

    @functools.cached_property
    def end_of_turn(self) -> int | None:
        """The chat template's end-of-turn token (a chat generation stops there)."""
        return end_of_turn(self.tokenizer) if self.tokenizer.chat_template is not None else None

    def cancel(self, request_id: RequestId) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            req.cancelled = True

    @property
    def has_work(self) -> bool:
        return bool(self._requests)

    # ---- the step loop --------------------------------------------------------------------

    def step(self) -> list[Event]:
        """Advance every request by one forward pass; return the events it produced.

        schedule -> plan -> execute -> commit (`h3d.engine.step`). A request that fails with an
        expected error (`H3Error`: no room, an unreadable archive record) ends with a
        `RequestFailed` event; the others go on. Anything else is a bug and propagates."""
        events: list[Event] = []
        held = self.interleave
        self._rebalanced = False
        if any(r.first_token_at is None and r.id not in self.waiting_for_memory for r in self._requests.values()):
            self.kv.tiers.behind.hold_back()  # a prompt waits for its first token: write-behind makes way
        for req in list(self._requests.values()):
            if req.cancelled:
                events.append(self._finish(req, FinishReason.CANCELLED))
            elif not req.generate and not held.holds(req) and self._pending(req) <= 0:
                events.append(self._finish_append(req))
        out = self.schedule()
        events += self._ended
        self._ended = []
        if out.chunks:
            self._capture_ahead(out)
        t0 = time.perf_counter()
        host = self.runner.host_times = HostTimes()
        if out.chunks:
            events += self._run(out)
        t1 = time.perf_counter()
        pieces = held.pieces_total
        if out.long is not None and out.long[0].id in self._requests:
            events += self._run(SchedulerOutput((out.long[1],), (out.long[0],)), begin=True)
        if held.current is not None:
            events += self._advance_long()
        self._rebalance()  # (where no chunk ran: after the step)
        if not self._requests and self.kv.shares.target:
            self.kv.shares.plan([])  # nothing in flight: no session is owed a share (Stats, `h3ctl top`)
        self.timing = StepTiming(
            len(out.chunks),
            t1 - t0,
            held.pieces_total - pieces,
            time.perf_counter() - t1,
            host if host.layers else None,
        )
        return events

    def _rebalance(self) -> None:
        """HBM moved toward the fair shares of the sessions with a request in flight
        (`KVCache.rebalance`), once a step: where the step runs chunks, once their forward is
        queued and before its tokens are read, so that the host plans the moves while the device
        computes. The moves' copies queue behind the forward (the mover's stream waits for the
        compute stream, `h3d.tiers.mover`), as the promotions of the runner's commit do."""
        if self._rebalanced:
            return
        self._rebalanced = True
        if self._requests:  # (not those waiting for memory: the sessions that decode share HBM)
            self.kv.rebalance([r.session.seq for r in self._requests.values() if r.id not in self.waiting_for_memory])

    def _capture_ahead(self, out: SchedulerOutput) -> None:
        """Before a step that gives requests their first token (their prompt's last chunk): the
        decode graph of the batch they then join, captured now if it would not replay
        (`DecodeGraphs.ahead`): its stall falls on this step, which the newcomers' prompts make
        long for the decoding streams anyway, not on a later step of every stream."""
        graphs = self.runner.graphs
        if not graphs.deferring:
            return
        joining = {
            r.id
            for r, c in zip(out.requests, out.chunks, strict=True)
            if r.generate and c.want_logits and r.first_token_at is None
        }
        if not joining:
            return
        bs = self.kv.block_size
        batch = [  # the requests that decode at the next step: those decoding and the newcomers, bar the ending
            r
            for r in self._requests.values()
            if r.generate
            and not r.cancelled
            and (r.id in joining or r.first_token_at is not None)
            and r.params.max_tokens - len(r.output_ids) > 1
        ]
        # The next step's tables: the token sampled now appended (a decoding stream's last one too).
        key = graphs.ahead([r.session.seq for r in batch], [-(-(len(r.session.tokens) + 1) // bs) for r in batch])
        if key is not None:
            self.captured.append(key)

    def _run(self, out: SchedulerOutput, begin: bool = False) -> list[Event]:
        """Plan, run and commit `out`'s chunks; their events. With `begin`, a lone long chunk that
        may run in pieces starts instead (`h3d.engine.prefill`)."""
        try:
            plan = self.runner.plan(out.chunks)
            if begin and self.runner.suspendable(plan):
                self.interleave.start(out.requests[0], out.chunks[0], self.runner.begin(plan))
                return []
            report = self.runner.execute(plan)
        except ArchiveCorrupt as exc:
            # The runner left no half-written KV behind. A damaged block is never used: its
            # KV is computed again from the token log, and the step runs again next time.
            if self._repairer.repair_for(exc, self.sessions):
                return []
            return [self._fail(req, exc) for req in out.requests]
        except H3Error as exc:
            # The runner left no half-written KV behind; the sessions keep their tokens.
            return [self._fail(req, exc) for req in out.requests]
        self.runner.commit(report)
        argmax = Argmax(report.logits)  # (queued before the rebalance's copies: they do not delay it)
        self._rebalance()
        return self.commit(out, report, argmax)

    def _advance_long(self) -> list[Event]:
        """The long chunk in flight, run for this step's budget (`Interleave.run`): its progress,
        or, once done, its commit's events."""
        prefill = self.interleave.current
        assert prefill is not None
        req, chunk = prefill.request, prefill.chunk
        try:
            report = self.interleave.run()
        except H3Error as exc:  # abandoned: the session's KV ends where the chunk started
            return [self._fail(req, exc)]
        if report is None:
            before = req.prefill_total - (len(req.session.tokens) - (0 if req.generate else 1) - chunk.start)
            return [PrefillProgress(req.id, req.session.id, before + prefill.tokens_done(), req.prefill_total)]
        self.runner.commit(report)
        return self.commit(prefill.out, report)

    def warm(self, kernels: bool | None = None, graphs_now: bool = True) -> Warmup:
        """Before serving: kernels compiled and the named set of decode graphs captured, now or,
        with `graphs_now` False, between steps after (h3d.engine.warmup)."""
        self.warmup = warm_up(self, kernels, graphs_now)
        return self.warmup

    def upkeep(self, idle: bool = False) -> None:
        """Between steps (the fair shares are the step's own, `_rebalance`): a decode graph that
        steps wanted since the warm-up, or one of the warm set left for after ready, captured (when
        `idle`, else one that waited long: `DecodeGraphs.capture_deferred`); every 64th step the
        archive kept within `ssd_capacity_mb` (closed sessions' KV evicted, coldest first). The
        daemon's engine thread and `run` call it."""
        self.save_touched()
        if self.kv.parking:
            self._park_ready()
        graphs = self.runner.graphs
        if graphs.deferred:
            for key in graphs.capture_deferred(idle):
                self.captured.append(key)
        if self.counters.steps - self._upkept >= 64:
            self._upkept = self.counters.steps
            for gone in [s for s in self.prefix_cache.values() if self.kv.cached_tokens(s.seq) < self.kv.block_size]:
                del self.prefix_cache[gone.id]  # its KV was dropped for room: nothing left to reuse
                self._drop_cached(gone)
            enforce_ssd_capacity(self.kv, self.sessions.values(), self.evictions)

    def write_behind(self) -> bool:
        """While no request runs: dirty KV past `write_behind_dirty_mb` written behind, without the
        per-step bound (`h3d.tiers.writebehind`). Returns whether more is to come (call again soon)."""
        behind = self.kv.tiers.behind
        if not behind.enabled:
            return False
        behind.pump([], self.kv.frozen, busy=False)
        parking = self._park_ready() if self.kv.parking else False
        return bool(behind.batches) or behind.pump_due or parking

    def read_ahead(self) -> bool:
        """While no request runs: resumed sessions' archived KV read back into DDR, without the
        per-step bound (`h3d.tiers.readahead`). Returns whether work is under way (call again
        soon); not while DDR has no room for it (the idle loop then calls at its slower pace)."""
        ahead = self.kv.tiers.ahead
        if not ahead.queue:
            return False
        sent = ahead.pump(busy=False)
        return sent > 0 or bool(ahead.pieces)

    def take_events(self) -> list[Event]:
        """Events of requests that ended outside a step (their session was closed), once."""
        events, self._ended = self._ended, []
        return events

    def _touch(self, session: Session) -> None:
        """A request of `session` ended: its `last_used_at`, kept in its log (idle TTLs and
        least-recently-used order survive a restart) by `save_touched`, after the step: the
        metadata (its HBF state with it) is not written before the step's last token goes out."""
        session.last_used_at = time.time()
        self._touched[session.id] = None

    def save_touched(self) -> None:
        """Write the metadata of the sessions whose requests ended since the last call (the
        daemon's engine thread calls it after handing a step's events out; `upkeep`,
        `checkpoint` and `close` call it too)."""
        if not self._touched:
            return
        touched, self._touched = self._touched, {}
        for sid in touched:
            session = self.sessions.get(sid)
            if session is not None:
                self._save_meta(session)

    def _fail(self, req: Request, error: H3Error) -> RequestFailed:
        if self.interleave.holds(req):
            self.interleave.abandon()
        self._touch(req.session)
        req.session.busy = False
        self._requests.pop(req.id, None)
        return RequestFailed(req.id, req.session.id, error)

    def requests(self) -> dict[RequestId, Request]:
        """Requests in flight (read-only use: stats)."""
        return self._requests

    def _pending(self, req: Request) -> int:
        """Tokens of the session still to feed before this request can sample (or is done)."""
        target = len(req.session.tokens) - (0 if req.generate else 1)
        return target - self.kv.cached_tokens(req.session.seq)

    def schedule(self) -> SchedulerOutput:
        """This step's chunks: every decoding request's next token (up to `max_batch_size`; where
        the tiers' KV passes HBM and DDR, the oldest whose sessions' KV fits there, the others
        `waiting_for_memory`: `_memory_blocks`), then prefill chunks of the others within
        `prefill_chunk_tokens`. A chunk long enough for the
        layer-by-layer path is not batched: it runs in pieces beside the batch (`long`, one at a
        time; the others wait for it: h3d.engine.prefill)."""
        budget = self.budgets.prefill_chunk_tokens
        chunks: list[Chunk] = []
        reqs: list[Request] = []
        long: tuple[Request, Chunk] | None = None
        busy = self.interleave.current is not None
        memory = self._memory_blocks()  # None: every session's KV fits HBM and DDR
        held = 0  # the decoding sessions' blocks so far, against `memory`
        waited, self.waiting_for_memory = self.waiting_for_memory, set()
        # Decoding requests first (one token each), then prefill chunks within the budget.
        ordered = sorted(
            (r for r in self._requests.values() if not self.interleave.holds(r)),
            key=lambda r: (self._pending(r) > 1, r.id),
        )
        for req in ordered[: self.config.max_batch_size]:
            pending = self._pending(req)
            limit = self.kv.chunk_limit(req.session.seq)
            # A long chunk runs beside the batch: the batch's tokens do not shorten it (a long
            # prompt cut a few tokens short would leave a tail to prefill over its whole context).
            whole = min(pending, self.budgets.prefill_chunk_tokens, limit)
            is_long = pending > 1 and self.runner.model.is_long(whole)
            take = 1 if pending == 1 else whole if is_long else min(pending, budget, limit)
            if take <= 0 or (pending > 1 and budget <= 0 and not is_long):
                continue
            if pending == 1 and memory is not None:
                need = self.kv.footprint(req.session.seq)
                if self.waiting_for_memory or (held and held + need > memory):
                    self.waiting_for_memory.add(req.id)  # oldest first: its turn comes as earlier ones end
                    continue
                held += need
            cached = self.kv.cached_tokens(req.session.seq)
            chunk = Chunk(
                seq=req.session.seq,
                token_ids=tuple(req.session.tokens[cached : cached + take]),
                start=cached,
                want_logits=req.generate and take == pending,
                final=take == pending,
            )
            if is_long and (busy or long is not None):
                continue  # one long forward at a time
            if not self.runner.can_fit([chunk] if is_long else [*chunks, chunk]):
                if not chunks and not busy:
                    # Nothing else runs and this cannot fit: fail the request, keep the session.
                    error = OutOfBlocks(
                        f"KV pool full: session {req.session.id} needs more than hbm_mb={self.budgets.hbm_mb}"
                    )
                    self._ended.append(self._fail(req, error))
                continue
            if is_long:
                long = (req, chunk)
                continue
            chunks.append(chunk)
            reqs.append(req)
            budget -= take
        if self.waiting_for_memory and not waited and memory is not None:
            gib = self.kv.tiers.block_bytes / 2**30
            self.kv.tiers.notices.append(("decode_waiting_for_memory", {
                "waiting": len(self.waiting_for_memory), "decoding": sum(len(c.token_ids) == 1 for c in chunks),
                "kv_gib": round(self.kv.blocks.entries.num_used * gib, 2), "memory_gib": round(memory * gib, 2),
            }))  # fmt: skip
        return SchedulerOutput(tuple(chunks), tuple(reqs), long)

    def _memory_blocks(self) -> int | None:
        """The blocks HBM and DDR (below its high watermark) hold, where the KV the tiers hold is
        more than that (an archive holds the rest): a decode step then runs the oldest decoding
        requests whose sessions' KV fits there, and the others wait (`waiting_for_memory`), so
        that no step reads the archive for most of its batch (32 sessions of 32K on an H100 host,
        137 GB against 102 GB of HBM and DDR, staged 17 GB a step from the disk, 11 s a step).
        None where everything fits (the common case: nothing waits)."""
        tiers = self.kv.tiers
        if tiers.archive is None:
            return None
        b = tiers.blocks
        room = b.hbm_capacity + int(tiers.high_watermark * b.ddr_alloc.capacity)
        return room if b.entries.num_used > room else None

    def commit(self, out: SchedulerOutput, report: StepReport, argmax: Argmax | None = None) -> list[Event]:
        """The engine's half of a step's commit (the runner's came first): counters, anchors kept
        in the token log, sampling where a chunk reached the end of its context, stop rules, and
        the events."""
        chunks, reqs, logits = out.chunks, out.requests, report.logits
        self.counters.steps += 1
        self.counters.prefill_tokens += sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
        if self.journal is not None:
            for probed, req in zip(report.plan.probes, reqs, strict=True):
                if probed:
                    self._save_meta(req.session)  # its new anchors
        events: list[Event] = []
        sampling = [r for r, c in zip(reqs, chunks, strict=True) if c.want_logits]
        tokens = sample_batch(
            logits,
            [r.params for r in sampling],
            [r.generator for r in sampling],
            [r.output_ids for r in sampling],
            argmax,
        )
        for req, chunk in zip(reqs, chunks, strict=True):
            if not req.generate or not chunk.want_logits:
                done = req.prefill_total - self._pending(req)
                events.append(PrefillProgress(req.id, req.session.id, done, req.prefill_total))
            if not req.generate and self._pending(req) <= 0:
                events.append(self._finish_append(req))
        for req, token in zip(sampling, tokens, strict=True):
            events += self._accept(req, token)
        return events

    def _accept(self, req: Request, token: int) -> list[Event]:
        assert req.detok is not None
        now = time.perf_counter()
        if req.first_token_at is None:
            req.first_token_at = now
        if self.journal is not None:
            self.journal.append(req.session.id, [token])  # logged before the client can see it
        req.output_ids.append(token)
        req.session.tokens.append(token)
        self.counters.generated_tokens += 1
        req.detok.push(token)
        reason = stop_reason(req, token, self.eos_ids, self.max_context)
        visible = visible_text(req, reason)
        delta = visible[req.emitted_chars :]
        req.emitted_chars = len(visible)
        events: list[Event] = [TokenDelta(req.id, req.session.id, token, delta)]
        if reason is not None:
            events.append(self._finish(req, reason))
        return events

    def _finish(self, req: Request, reason: FinishReason) -> GenerationDone:
        if self.interleave.holds(req):
            self.interleave.abandon()  # cancelled midway: the KV ends where its chunk started
        self._touch(req.session)
        if self.journal is not None and self.sync_on_finish and req.session.id in self.sessions:
            self.journal.sync(req.session.id)  # every Generate ends durable
        req.finish_reason = reason
        req.session.busy = False
        self._requests.pop(req.id, None)
        return generation_done(req, reason)

    def _finish_append(self, req: Request) -> AppendDone:
        if self.runner.device.type == "cuda":
            # Done means computed: the prefill's kernels and its KV copies have finished (the
            # host runs ahead of the device otherwise, and the next request would wait for them).
            torch.cuda.synchronize(self.runner.device)
        self._touch(req.session)
        req.session.busy = False
        self._requests.pop(req.id, None)
        took = time.perf_counter() - req.submitted_at
        if req.prefill_total >= PREFILL_RATE_MIN_TOKENS:  # (a long prompt's rate: `_choose_kv`)
            rate = req.prefill_total / max(took, 1e-6)
            last = self.prefill_tokens_per_s
            self.prefill_tokens_per_s = rate if last is None else (last + rate) / 2
        return AppendDone(req.id, req.session.id, req.tokens_added, took)

    # ---- synchronous helpers (CLI, tests, benchmarks) ---------------------------------------

    def run(self, request_id: RequestId) -> Iterator[Event]:
        """Step until `request_id` ends, yielding its events (other requests advance too)."""
        while request_id in self._requests:
            self.upkeep()
            for event in self.step():
                if event.request_id == request_id:
                    if isinstance(event, RequestFailed):
                        raise event.error
                    yield event

    def append(
        self,
        session_id: SessionId,
        text: str | None = None,
        token_ids: list[int] | None = None,
        role: str | None = None,
    ) -> AppendDone:
        rid = self.submit(session_id, text=text, token_ids=token_ids, generate=False, role=role)
        for event in self.run(rid):
            if isinstance(event, AppendDone):
                return event
        raise RuntimeError("append ended without a result")  # pragma: no cover

    def fork(self, session_id: SessionId, at_tokens: int | None = None) -> SessionId:
        """`fork_session`, then its `catch_up`: a fork ready to decode."""
        sid = self.fork_session(session_id, at_tokens)
        rid = self.catch_up(sid)
        if rid is not None:
            for _ in self.run(rid):
                pass
        return sid

    def generate(
        self,
        session_id: SessionId,
        prompt: str = "",
        params: SamplingParams | None = None,
        token_ids: list[int] | None = None,
    ) -> Iterator[TokenDelta | GenerationDone]:
        """Generate continuing the session's context; yields deltas, then one GenerationDone.

        A prompt is appended first (tokenized on its own), so `generate(s, T)` and
        `append(s, T); generate(s)` feed the same tokens in the same chunks.
        """
        params = (params or self.session(session_id).sampling).validate()
        if prompt or token_ids:
            self.append(session_id, text=prompt or None, token_ids=token_ids)
        rid = self.submit(session_id, generate=True, params=params)
        for event in self.run(rid):
            if isinstance(event, TokenDelta | GenerationDone):
                yield event

    def complete(self, session_id: SessionId, prompt: str = "", params: SamplingParams | None = None) -> GenerationDone:
        done = None
        for event in self.generate(session_id, prompt, params):
            if isinstance(event, GenerationDone):
                done = event
        assert done is not None
        return done

    def with_sampling(self, **overrides: object) -> SamplingParams:
        d = self.config.sampling
        base = SamplingParams(max_tokens=d.max_tokens, temperature=d.temperature, top_p=d.top_p, top_k=d.top_k)
        return replace(base, **overrides).validate()  # type: ignore[arg-type]
