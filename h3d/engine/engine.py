"""The engine: sessions, requests and the step loop over one model.

`Engine` owns every session and request; it is single-threaded (the daemon gives it a thread of
its own and serializes calls). Each `step()` reads as three verbs: `_schedule` picks the chunks of
this step (every decoding request's next token, then prefill chunks within
`prefill_chunk_tokens`), `runner.execute` runs them in one forward, `_commit` samples and emits
events. Requests join and leave between steps (continuous batching).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math
import time
import uuid
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from h3d.config import POLICIES, EngineConfig
from h3d.engine.chat import Conversation, end_of_turn
from h3d.engine.detok import IncrementalDetokenizer
from h3d.engine.runner import Chunk, ModelRunner
from h3d.engine.sampling import SamplingParams, make_generator, sample_batch
from h3d.engine.session import (
    AppendDone,
    Event,
    FinishReason,
    GenerationDone,
    PrefillProgress,
    Request,
    RequestFailed,
    RequestId,
    Session,
    SessionId,
    TokenDelta,
)
from h3d.errors import (
    ConfigError,
    ContextTooLong,
    H3Error,
    InvalidRequest,
    NoChatTemplate,
    OutOfBlocks,
    SessionBusy,
    SessionNotFound,
    SsdDegraded,
    clip,
)
from h3d.kv.blocks import SeqId, region_sizes
from h3d.kv.pool import KVPool
from h3d.model.fingerprint import model_fingerprint
from h3d.model.loader import load_model
from h3d.model.tokenizer import Tokenizer
from h3d.store.tokenlog import TokenStore
from h3d.tiers.archive import Archive, ArchiveCorrupt, ArchiveWriteFailed, BlockKey, CacheIdentity
from h3d.tiers.codecs import Codec
from h3d.tiers.stats import TierStats


@dataclass(slots=True)
class EngineCounters:
    """Cumulative work since the engine started."""

    steps: int = 0
    prefill_tokens: int = 0  # tokens fed in prefill chunks (more than one token per sequence)
    generated_tokens: int = 0


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config.validate()
        self.model = load_model(config.model, config.resolved_dtype, config.device)
        self.tokenizer = Tokenizer(config.model)
        mc = self.model.config
        dtype = self.model.lm_head.weight_t.dtype
        hbm_slots = KVPool.slots_for_budget(config.hbm_mb, config.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        ddr_slots = KVPool.slots_for_budget(config.ddr_mb, config.block_size, mc.num_kv_heads, mc.head_dim, dtype)
        if hbm_slots < mc.num_layers:
            raise ConfigError(f"hbm_mb: {config.hbm_mb} MiB holds fewer than one KV block per layer")
        regions = region_sizes(hbm_slots, mc.num_layers, config.dense_layers, config.dense_hbm_share)
        self.runner = ModelRunner(
            self.model,
            regions,
            ddr_slots,
            config.block_size,
            archive=self._open_archive(),
            high_watermark=config.ddr_high_watermark,
            check_invariants=config.check_invariants,
            hbf=config.hbf,
            promote_mb_per_step=config.promote_mb_per_step,
        )
        self.runner.tiers.ssd_retry_interval_s = config.ssd_retry_interval_s
        self.max_context = config.max_context_tokens or mc.max_position_embeddings
        self.eos_ids = frozenset(mc.eos_token_ids)
        self.sessions: dict[SessionId, Session] = {}
        self._requests: dict[RequestId, Request] = {}
        self._seq_ids = itertools.count(1)
        self._request_ids = itertools.count(1)
        self._ended: list[Event] = []  # requests ended outside a step, reported by step() / take_events()
        self.counters = EngineCounters()
        self.journal: TokenStore | None = None
        self.restored: list[SessionId] = []  # sessions reopened from the token logs at start
        self.rebuilds: list[str] = []  # why KV was dropped to be prefilled again (the daemon logs them)
        self.evictions: list[SessionId] = []  # closed sessions whose archived KV ssd_capacity_mb evicted
        self._rebuilt: set[BlockKey] = set()  # damaged records already dropped once
        if config.session_log_path is not None:
            self.journal = TokenStore(Path(config.session_log_path), config.fsync_interval_ms)
            self._restore()

    def _open_archive(self) -> Archive | None:
        cfg = self.config
        if cfg.ssd_path is None:
            return None
        mc = self.model.config
        identity = CacheIdentity(
            fingerprint=model_fingerprint(cfg.model),
            dtype=cfg.resolved_dtype,
            block_size=cfg.block_size,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
        )
        return Archive(Path(cfg.ssd_path), identity, Codec(cfg.ssd_codec), frozenset(cfg.quantize_skip_layers))

    def tier_stats(self) -> TierStats:
        """The tier layer's counters and occupancy (see h3d.tiers.stats)."""
        return self.runner.tiers.stats()

    def close(self) -> None:
        """Finish archive writes in flight and release the archive (its folder stays); token logs
        are synced and closed."""
        if self.journal is not None:
            self.journal.close()
        self.runner.tiers.close()
        if self.runner.tiers.archive is not None:
            self.runner.tiers.archive.close()

    # ---- durability -----------------------------------------------------------------------

    def _meta(self, session: Session) -> dict[str, object]:
        state = self.runner.selection.get(session.seq)
        sampling = asdict(session.sampling)
        sampling["stop"], sampling["stop_token_ids"] = list(sampling["stop"]), list(sampling["stop_token_ids"])
        hbf = None
        if state is not None:
            hbf = {
                "window_tokens": state.window_tokens,
                "steps": state.steps,
                "entropies": [float(x) for x in state.entropies],
                # The prompt's anchors (probed at its last chunk): selection reads them, so a
                # restarted session selects as it would have.
                "anchors": {str(layer): a.tolist() for layer, a in state.anchors.items()},
                "head_anchors": {str(layer): a.tolist() for layer, a in state.head_anchors.items()},
            }
        pin = session.pinned_until
        return {
            "policy": session.policy,
            "owner": session.owner,
            "closed": session.closed,
            "created_at": session.created_at,
            "last_used_at": session.last_used_at,
            "pinned_until": "forever" if pin == math.inf else pin,
            "chat": session.chat is not None,
            "sampling": sampling,
            "hbf": hbf,
        }

    def _restore(self) -> None:
        """Reopen every session of the token logs; adopt the KV their blocks have in the archive
        (read lazily); the tokens without it are prefilled again by the session's next request."""
        assert self.journal is not None
        for r in self.journal.load_all():
            meta = r.meta
            saved = dict(meta.get("sampling", {}))
            saved["stop"] = tuple(saved.get("stop", ()))
            saved["stop_token_ids"] = tuple(saved.get("stop_token_ids", ()))
            sampling = SamplingParams(**saved)
            policy = meta.get("policy", self.config.policy)
            session = Session(
                id=SessionId(r.session_id),
                seq=SeqId(next(self._seq_ids)),
                sampling=sampling,
                policy=policy if policy in POLICIES else self.config.policy,
                tokens=list(r.tokens),
                pieces=int(bool(r.tokens)),
                created_at=float(meta.get("created_at", time.time())),
                owner=str(meta.get("owner", "")),
                closed=bool(meta.get("closed", False)),
            )
            session.last_used_at = float(meta.get("last_used_at", session.created_at))
            pin = meta.get("pinned_until")
            session.pinned_until = math.inf if pin == "forever" else float(pin) if pin is not None else None
            if meta.get("chat"):
                session.chat = self._replay_chat(r.messages, session.tokens)
            self.runner.open(session.seq, session.id, session.policy)
            if session.pinned_until is not None:
                self.runner.tiers.pinned.add(session.seq)
            hbf = meta.get("hbf") or {}
            state = self.runner.selection[session.seq]
            state.window_tokens = int(hbf.get("window_tokens", state.window_tokens))
            state.steps = int(hbf.get("steps", 0))
            state.entropies[:] = [float(x) for x in hbf.get("entropies", [])]
            state.anchors = {int(k): np.asarray(v, dtype=np.int64) for k, v in hbf.get("anchors", {}).items()}
            state.head_anchors = {
                int(k): torch.tensor(v, dtype=torch.int64, device=self.runner.device)
                for k, v in hbf.get("head_anchors", {}).items()
            }
            state.anchors_version += 1
            want = max(len(session.tokens) - 1, 0)  # the last token is fed by the next request
            adopted = self.runner.adopt(session.seq, want)
            bs = self.runner.blocks.block_size
            rebuilt = -(-want // bs) - -(-adopted // bs)
            self.runner.tiers.counters.kv_rebuild_blocks += rebuilt
            self.sessions[session.id] = session
            self.restored.append(session.id)

    def _replay_chat(self, messages: list[tuple[dict[str, object], int]], tokens: list[int]) -> Conversation:
        """A chat session's conversation from its log's message records (see `_extend`)."""
        chat = Conversation()
        for message, at in messages:
            chat.close_turn(self.tokenizer, tokens[:at])
            chat.tail = ""  # what closed the previous turn came with this record
            if "turn" in message:
                chat.begin(at + int(str(message.get("n", 0))))
            else:
                chat.messages.append({"role": str(message.get("role")), "content": str(message.get("content"))})
        return chat

    def checkpoint(self) -> int:
        """Before a shutdown: every session's KV blocks (the partial last one too) durable in the
        archive, its HBF state in its log, every log synced. Returns the blocks written. With the
        SSD tier degraded, only the logs are written (the KV is computed again after a restart)."""
        written = 0
        for session in self.sessions.values():
            if self.runner.tiers.archive is not None and self.runner.tiers.ssd_degraded is None:
                # If it fails, the KV is computed again after the restart; the token log is the truth.
                with contextlib.suppress(SsdDegraded):
                    written += self.runner.tiers.snapshot(session.seq, partial=True)
            if self.journal is not None:
                self.journal.set_meta(session.id, self._meta(session))
        if self.journal is not None:
            self.journal.sync()
        return written

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
        policy = policy or self.config.policy
        if chat and self.tokenizer.chat_template is None:
            raise NoChatTemplate("this model has no chat template: create a plain session (chat off)")
        if policy not in POLICIES:
            raise InvalidRequest(f"unknown policy {clip(policy)!r} (known: {', '.join(POLICIES)})")
        defaults = self.config.sampling
        params = sampling or SamplingParams(
            max_tokens=defaults.max_tokens, temperature=defaults.temperature, top_p=defaults.top_p, top_k=defaults.top_k
        )
        session = Session(
            id=SessionId(uuid.uuid4().hex),
            seq=SeqId(next(self._seq_ids)),
            sampling=params.validate(),
            policy=policy,
            owner=owner,
            chat=Conversation() if chat else None,
        )
        message = None
        if chat and system_prompt:
            assert session.chat is not None
            system_prompt = session.chat.add(self.tokenizer, "system", system_prompt, [])
            message = {"role": "system", "content": session.chat.messages[-1]["content"]}
        first = self._tokenize(session, system_prompt) if system_prompt else []
        self._check_tokens(session, first)
        if self.journal is not None:
            self.journal.create(session.id, self._meta(session), [] if message else first)  # durable before it is known
            if message:
                self.journal.append_message(session.id, {**message, "n": len(first)}, first)
                self.journal.sync(session.id)
        session.tokens.extend(first)
        session.pieces += bool(first)
        self.runner.open(session.seq, session.id, policy)
        self.sessions[session.id] = session
        return session.id

    def session(self, session_id: SessionId) -> Session:
        session = self.sessions.get(session_id)
        if session is None:
            raise SessionNotFound(f"no session {clip(session_id)!r}")
        return session

    def set_pin(self, session_id: SessionId, until: float | None) -> None:
        """Pin a session's HBM blocks until the Unix time `until` (math.inf: until unpinned), or
        unpin it (None). Kept in its log: a restarted daemon keeps the pin."""
        session = self.session(session_id)
        session.pinned_until = until
        if until is None:
            self.runner.tiers.pinned.discard(session.seq)
        else:
            self.runner.tiers.pinned.add(session.seq)
        if self.journal is not None:
            self.journal.set_meta(session.id, self._meta(session))

    def rewind(self, session_id: SessionId, num_tokens: int) -> None:
        """Cut the session's context back to its first `num_tokens` tokens (and its KV with it).

        Used to branch several continuations from one prefill (benchmarks): the KV and the digests
        are those of the kept tokens, so every branch selects as if the others had never run.
        """
        session = self.session(session_id)
        if session.busy:
            raise InvalidRequest(f"session {session_id} has a request in flight")
        if session.chat is not None:
            raise InvalidRequest("a chat session cannot be rewound (its messages would no longer match its context)")
        if not 0 <= num_tokens <= len(session.tokens):
            raise InvalidRequest(f"cannot rewind to {num_tokens} tokens: the context holds {len(session.tokens)}")
        if self.journal is not None:
            self.journal.cut(session.id, num_tokens)
        del session.tokens[num_tokens:]
        self.runner.truncate(session.seq, max(0, min(self.cached_tokens(session_id), num_tokens - 1)))

    def close_session(self, session_id: SessionId, purge: bool = False) -> None:
        """End `session_id`'s requests (cancelled) and free its memory. With `purge`, the session
        is deleted: its token log and archived KV go, their disk space given back by a compaction
        on the archive's own thread (`Archive.compact_later`). Without, it is closed: its KV goes
        to the archive only (or is forgotten, to be computed again, without a writable archive),
        it stays listed, and its next request reopens it where it stopped."""
        session = self.session(session_id)
        for req in [r for r in self._requests.values() if r.session is session]:
            self._ended.append(self._finish(req, FinishReason.CANCELLED))
        if purge:
            tiers = self.runner.tiers
            if tiers.archive is not None and not tiers.writable:
                tiers.retry_ssd()  # the purge's tombstone is an archive write
            try:
                self.runner.release(session.seq)
            except ArchiveWriteFailed as e:  # the tombstone was refused: the records stay, unreachable
                tiers.degrade(e)
                self.runner.release(session.seq)  # the rest of the release (the archive name is gone)
            del self.sessions[session_id]
            if self.journal is not None:
                self.journal.delete(session_id)
            if tiers.archive is not None and tiers.writable:
                tiers.archive.compact_later()  # the purged records' space, given back off this thread
            return
        if session.closed:
            return
        session.pinned_until = None
        tiers = self.runner.tiers
        try:
            if not tiers.writable:
                raise SsdDegraded("no writable archive")
            self.runner.park(session.seq)
        except SsdDegraded:
            tiers.forget(session.seq)
        session.closed = True
        if self.journal is not None:
            self.journal.set_meta(session.id, self._meta(session))
        self._enforce_ssd_capacity()

    def _reopen(self, session: Session) -> None:
        session.closed = False
        if self.journal is not None:
            self.journal.set_meta(session.id, self._meta(session))

    def _enforce_ssd_capacity(self) -> None:
        """Past `ssd_capacity_mb` of live archive records: forget the archived KV of closed
        sessions, least recently used first (their tokens stay; the KV is computed again if
        they are reopened); then reclaim the disk space of dead records."""
        archive, cap = self.runner.tiers.archive, self.config.ssd_capacity_mb
        if archive is None or cap is None or not self.runner.tiers.writable:
            return
        limit = int(cap * 2**20)
        try:
            if archive.live_bytes() > limit:
                closed = sorted((s for s in self.sessions.values() if s.closed), key=lambda s: s.last_used_at)
                for session in closed:
                    if self.runner.cached_tokens(session.seq) == 0:
                        continue
                    self.runner.tiers.forget(session.seq)
                    self.evictions.append(session.id)
                    if archive.live_bytes() <= limit:
                        break
            disk = archive.disk_bytes()
            # worth copying the live records; not beside a purge's compaction (next check, then)
            if disk > limit and disk - archive.live_bytes() >= limit / 10 and not archive.compacting:
                archive.compact(keep_ratio=1.0)
        except ArchiveWriteFailed as e:
            self.runner.tiers.degrade(e)

    def set_policy(self, session_id: SessionId, policy: str) -> None:
        """Switch the HBF policy a session's decode steps use (takes effect at the next step)."""
        if policy not in POLICIES:
            raise InvalidRequest(f"unknown policy {clip(policy)!r} (known: {', '.join(POLICIES)})")
        session = self.session(session_id)
        session.policy = policy
        self.runner.set_policy(session.seq, policy)
        if self.journal is not None:
            self.journal.set_meta(session.id, self._meta(session))

    def hbf_latency_us(self) -> tuple[float, float]:
        """p50 and p99 of the host-side HBF planning per step, over the last steps (0, 0 if none)."""
        lat = sorted(self.runner.tiers.latencies_us)
        if not lat:
            return 0.0, 0.0
        return lat[len(lat) // 2], lat[min(len(lat) - 1, int(len(lat) * 0.99))]

    def cached_tokens(self, session_id: SessionId) -> int:
        return self.runner.cached_tokens(self.session(session_id).seq)

    # ---- requests -------------------------------------------------------------------------

    def _tokenize(self, session: Session, text: str) -> list[int]:
        # Special tokens only where the tokenizer adds them to a session's first piece.
        return self.tokenizer.encode(text, add_special_tokens=session.pieces == 0)

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
            if message is None:
                self.journal.append(session.id, ids)
            else:  # a chat message and its tokens in one record: never one without the other
                self.journal.append_message(session.id, {**message, "n": len(ids)}, ids)
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
        if session.busy:
            raise SessionBusy(f"session {session_id} already has a request in flight")
        params = (params or session.sampling).validate()
        ids = list(token_ids or [])
        chat, message = self._chat_piece(session, text, ids, role, generate)
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
        self.runner.tiers.admit(session.seq, total - self.runner.cached_tokens(session.seq))
        if ids:
            self._extend(session, ids, message)
        if chat is not None:
            session.chat = chat[0]
            if generate:
                session.chat.begin(len(session.tokens))
        if generate and not session.tokens:
            raise InvalidRequest("cannot generate from an empty context")
        cached = self.runner.cached_tokens(session.seq)
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

    def _chat_piece(
        self, session: Session, text: str | None, ids: list[int], role: str | None, generate: bool
    ) -> tuple[tuple[Conversation, str], dict[str, object] | None] | tuple[None, None]:
        """For a chat session: its conversation as it will be once this request's piece is added,
        the piece's text and its log record (nothing changes until the request is accepted)."""
        if session.chat is None:
            if role:
                raise InvalidRequest("role: only a chat session's appends have roles")
            return None, None
        if ids:
            raise InvalidRequest("a chat session takes messages as text, not token ids")
        if generate and text:
            raise InvalidRequest("a chat generation's prompt is a message: append it first (as Engine.generate does)")
        chat = session.chat.copy()
        if generate:
            turn: dict[str, object] = {"turn": "assistant"}
            return (chat, chat.open_turn(self.tokenizer, session.tokens)), turn
        if not text:
            raise InvalidRequest("a chat message needs text")
        piece = chat.add(self.tokenizer, role or "user", text, session.tokens)
        message: dict[str, object] = dict(chat.messages[-1])
        return (chat, piece), message

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

        A request that fails with an expected error (`H3Error`: no room, an unreadable archive
        record) ends with a `RequestFailed` event; the others go on. Anything else is a bug and
        propagates."""
        events: list[Event] = []
        for req in list(self._requests.values()):
            if req.cancelled:
                events.append(self._finish(req, FinishReason.CANCELLED))
            elif not req.generate and self._pending(req) <= 0:
                events.append(self._finish_append(req))
        chunks, reqs = self._schedule()
        events += self._ended
        self._ended = []
        if chunks:
            try:
                logits = self.runner.execute(chunks)
            except ArchiveCorrupt as exc:
                # The runner left no half-written KV behind. A damaged block is never used: its
                # KV is computed again from the token log, and the step runs again next time.
                session = self._session_named(exc.key.session) if exc.key is not None else None
                if session is None or exc.key in self._rebuilt:
                    return events + [self._fail(req, exc) for req in reqs]
                assert exc.key is not None
                self._repair(session, exc.key, str(exc))
                return events
            except H3Error as exc:
                # The runner left no half-written KV behind; the sessions keep their tokens.
                return events + [self._fail(req, exc) for req in reqs]
            self.counters.steps += 1
            if self.counters.steps % 64 == 0:
                self._enforce_ssd_capacity()
            self.counters.prefill_tokens += sum(len(c.token_ids) for c in chunks if len(c.token_ids) > 1)
            if self.journal is not None:
                for chunk, req in zip(chunks, reqs, strict=True):
                    probed = self.runner.selection[chunk.seq].policy in ("layerwise", "attention_entropy")
                    if chunk.final and len(chunk.token_ids) > 1 and probed:
                        self.journal.set_meta(req.session.id, self._meta(req.session))  # its new anchors
            events += self._commit(chunks, reqs, logits)
        return events

    def _session_named(self, name: str) -> Session | None:
        return self.sessions.get(SessionId(name))

    def _repair(self, session: Session, key: BlockKey, reason: str) -> None:
        """Compute the KV of the damaged block `key` again from `session`'s tokens, in every
        layer, over the blocks before it; a damaged block met on the way is rewritten first.
        Only those blocks are recomputed (`kv_rebuild_blocks` counts them). If that cannot be
        done (no room), the session's KV is cut back to the block, to be prefilled again."""
        bs = self.runner.blocks.block_size
        cached = self.runner.cached_tokens(session.seq)
        todo = [key]
        while todo:
            block = todo[-1].index
            self._rebuilt.add(todo[-1])
            try:
                self.runner.rewrite(session.seq, block, session.tokens[block * bs : min((block + 1) * bs, cached)])
            except H3Error as exc:
                if isinstance(exc, ArchiveCorrupt) and exc.key is not None and exc.key not in self._rebuilt:
                    todo.append(exc.key)  # an earlier block of the session: rewritten first
                    continue
                self._rebuild_from(session, min(k.index for k in todo), f"{reason}; rewriting it failed: {exc}")
                return
            done = todo.pop()
            self.runner.tiers.counters.kv_rebuild_blocks += 1
            self.rebuilds.append(f"{reason}: block {done.index} of session {session.id} was computed again")
            reason = f"while rewriting block {done.index}"

    def _rebuild_from(self, session: Session, block: int, reason: str) -> None:
        """Forget `session`'s KV from `block` on (every layer); its next step prefills it again."""
        blocks = self.runner.blocks
        before = blocks.table(session.seq).num_blocks
        blocks.truncate(session.seq, block * blocks.block_size)
        dropped = before - blocks.table(session.seq).num_blocks
        self.runner.tiers.counters.kv_rebuild_blocks += dropped
        self.rebuilds.append(f"{reason}: {dropped} blocks of session {session.id} are prefilled again")

    def take_events(self) -> list[Event]:
        """Events of requests that ended outside a step (their session was closed), once."""
        events, self._ended = self._ended, []
        return events

    def _touch(self, session: Session) -> None:
        """A request of `session` ended: its `last_used_at`, kept in its log (idle TTLs and
        least-recently-used order survive a restart)."""
        session.last_used_at = time.time()
        if self.journal is not None and session.id in self.sessions:
            self.journal.set_meta(session.id, self._meta(session))

    def _fail(self, req: Request, error: H3Error) -> RequestFailed:
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
        return target - self.runner.cached_tokens(req.session.seq)

    def _schedule(self) -> tuple[list[Chunk], list[Request]]:
        budget = self.config.prefill_chunk_tokens
        chunks: list[Chunk] = []
        reqs: list[Request] = []
        # Decoding requests first (one token each), then prefill chunks within the budget.
        ordered = sorted(self._requests.values(), key=lambda r: (self._pending(r) > 1, r.id))
        for req in ordered[: self.config.max_batch_size]:
            pending = self._pending(req)
            take = 1 if pending == 1 else min(pending, budget, self.runner.tiers.chunk_limit(req.session.seq))
            if take <= 0 or (pending > 1 and budget <= 0):
                continue
            cached = self.runner.cached_tokens(req.session.seq)
            chunk = Chunk(
                seq=req.session.seq,
                token_ids=tuple(req.session.tokens[cached : cached + take]),
                start=cached,
                want_logits=req.generate and take == pending,
                final=take == pending,
            )
            if not self.runner.can_fit([*chunks, chunk]):
                if not chunks:
                    # Nothing else runs and this cannot fit: fail the request, keep the session.
                    error = OutOfBlocks(
                        f"KV pool full: session {req.session.id} needs more than hbm_mb={self.config.hbm_mb}"
                    )
                    self._ended.append(self._fail(req, error))
                continue
            chunks.append(chunk)
            reqs.append(req)
            budget -= take
        return chunks, reqs

    def _commit(self, chunks: list[Chunk], reqs: list[Request], logits: torch.Tensor) -> list[Event]:
        events: list[Event] = []
        sampling = [r for r, c in zip(reqs, chunks, strict=True) if c.want_logits]
        tokens = sample_batch(logits, [r.params for r in sampling], [r.generator for r in sampling])
        for req, chunk in zip(reqs, chunks, strict=True):
            if not req.generate:
                done = req.prefill_total - self._pending(req)
                events.append(PrefillProgress(req.id, req.session.id, done, req.prefill_total))
                if self._pending(req) <= 0:
                    events.append(self._finish_append(req))
            elif not chunk.want_logits:
                done = req.prefill_total - self._pending(req)
                events.append(PrefillProgress(req.id, req.session.id, done, req.prefill_total))
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
        reason = self._stop_reason(req, token)
        text = req.detok.text
        if reason is None:
            # Hold back what could be the start of a stop string.
            hold = max((len(s) - 1 for s in req.params.stop), default=0)
            visible = text[: max(len(text) - hold, req.emitted_chars)]
        else:
            visible = self._final_text(req)
        delta = visible[req.emitted_chars :]
        req.emitted_chars = len(visible)
        events: list[Event] = [TokenDelta(req.id, req.session.id, token, delta)]
        if reason is not None:
            events.append(self._finish(req, reason))
        return events

    def _stop_reason(self, req: Request, token: int) -> FinishReason | None:
        p = req.params
        if (token in self.eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
            return FinishReason.STOP
        if p.stop and any(s in req.detok.text for s in p.stop if req.detok is not None):
            return FinishReason.STOP
        if len(req.output_ids) >= p.max_tokens or len(req.session.tokens) >= self.max_context:
            return FinishReason.LENGTH
        return None

    def _final_text(self, req: Request) -> str:
        assert req.detok is not None
        req.detok.flush()
        text = req.detok.text
        cuts = [text.find(s) for s in req.params.stop if s in text]
        return text[: min(cuts)] if cuts else text

    def _finish(self, req: Request, reason: FinishReason) -> GenerationDone:
        self._touch(req.session)
        if self.journal is not None and req.session.id in self.sessions:
            self.journal.sync(req.session.id)  # every Generate ends durable
        req.finish_reason = reason
        req.session.busy = False
        self._requests.pop(req.id, None)
        start = req.first_token_at or time.perf_counter()
        decode_s = time.perf_counter() - start
        n = len(req.output_ids)
        return GenerationDone(
            request_id=req.id,
            session_id=req.session.id,
            text=self._final_text(req) if req.detok is not None else "",
            token_ids=tuple(req.output_ids),
            finish_reason=reason,
            prompt_tokens=len(req.session.tokens) - n,
            ttft_s=start - req.submitted_at,
            decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
        )

    def _finish_append(self, req: Request) -> AppendDone:
        self._touch(req.session)
        req.session.busy = False
        self._requests.pop(req.id, None)
        return AppendDone(req.id, req.session.id, req.tokens_added, time.perf_counter() - req.submitted_at)

    # ---- synchronous helpers (CLI, tests, benchmarks) ---------------------------------------

    def run(self, request_id: RequestId) -> Iterator[Event]:
        """Step until `request_id` ends, yielding its events (other requests advance too)."""
        while request_id in self._requests:
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
