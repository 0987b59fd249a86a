"""Engine state into protobuf messages, and request fields into engine values (`sampling_from`).

What reads engine state runs on the engine thread (`EngineWorker.call`), and `expire_pin` drops a
pin whose TTL has passed whenever a session is read; the request checks (`sampling_from`,
`sampling_with`) and `new_session_pb` read none, and run on any thread. What must stay true: a
request's values are checked before the engine sees them (InvalidRequest names the field).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.auth import LOCAL, Caller
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import FinishReason, GenerationDone, NewSession, Session, SessionId
from h3d.errors import InvalidRequest, SessionNotFound
from h3d.store.tokenlog import parse_log

if TYPE_CHECKING:
    from h3d.daemon.rpc import State
    from h3d.hbf.policy import SelectionState

FINISH = {
    FinishReason.STOP: pb.FINISH_REASON_STOP,
    FinishReason.LENGTH: pb.FINISH_REASON_LENGTH,
    FinishReason.CANCELLED: pb.FINISH_REASON_CANCELLED,
}
MAX_STOP_STRINGS = 16


def residency_pb(engine: Engine, session: Session) -> pb.TierResidency:
    r = engine.kv.residency(session.seq)
    return pb.TierResidency(hbm_blocks=r.hbm, ddr_blocks=r.ddr, ssd_blocks=r.archived)


def expire_pin(engine: Engine, session: Session) -> None:
    """Drop a session's pin once its TTL has passed (checked whenever it is read, and periodically)."""
    until = engine.kv.pinned_until(session.seq)
    if until is not None and until <= time.time():
        engine.set_pin(session.id, None)


def session_pb(engine: Engine, session: Session, with_tokens: bool = False) -> pb.Session:
    expire_pin(engine, session)
    kv = engine.kv
    pin = kv.pinned_until(session.seq)
    out = session_message(session, kv.selection(session.seq), pin, kv.cached_tokens(session.seq))
    out.residency.CopyFrom(residency_pb(engine, session))
    if with_tokens:
        out.token_ids.extend(session.tokens)
        out.text = engine.tokenizer.decode(session.tokens)
    return out


def new_session_pb(new: NewSession) -> pb.Session:
    """A session `Engine.prepare_session` made, as `session_pb` will read it once the engine
    has taken it in (no KV, no pin): built off the engine's thread, from what the session holds."""
    return session_message(new.session, new.selection, None, 0)


def session_message(session: Session, selection: SelectionState, pin: float | None, cached: int) -> pb.Session:
    s = session.sampling
    out = pb.Session(
        session_id=session.id,
        num_tokens=len(session.tokens),
        cached_tokens=cached,
        policy=selection.policy.name,
        created_at=session.created_at,
        last_used_at=session.last_used_at,
        busy=session.busy,
        pinned=pin is not None,
        pinned_until=pin if pin not in (None, math.inf) else 0.0,
        sampling=pb.SamplingParams(
            max_tokens=s.max_tokens,
            temperature=s.temperature,
            top_p=s.top_p,
            top_k=s.top_k,
            stop=list(s.stop),
            stop_token_ids=list(s.stop_token_ids),
            ignore_eos=s.ignore_eos,
            presence_penalty=s.presence_penalty,
            frequency_penalty=s.frequency_penalty,
        ),
        residency=pb.TierResidency(),
        window_tokens=selection.window_tokens,
        closed=session.closed,
        chat=session.chat is not None,
        num_messages=len(session.chat.messages) + (session.chat.open_at is not None) if session.chat else 0,
    )
    if s.seed is not None:
        out.sampling.seed = s.seed
    return out


def remote_session_pb(engine: Engine, sid: SessionId, caller: Caller, with_tokens: bool = False) -> pb.Session:
    """A session this daemon does not serve, as the remote store's log tells it (read, not taken
    over): what its log holds, and who serves it (`served_by`). SessionNotFound if the store has no
    such session of the caller's. Called off the engine thread: it reads the store and the
    tokenizer only, never the engine's state."""
    remote = engine.remote
    data = remote.fetch(sid) if remote is not None else None
    if data is None or remote is None:
        raise SessionNotFound(f"no session {sid!r}")
    r = parse_log(sid, data)
    owner = str(r.meta.get("owner", "")) or LOCAL
    if owner != caller.owner and not caller.admin:
        raise SessionNotFound(f"no session {sid!r}")
    holder = remote.holder(sid)
    out = pb.Session(
        session_id=sid,
        num_tokens=len(r.tokens),
        policy=str(r.meta.get("policy", "")),
        created_at=float(r.meta.get("created_at", 0.0)),
        last_used_at=float(r.meta.get("last_used_at", 0.0)),
        closed=bool(r.meta.get("closed", False)),
        chat=bool(r.meta.get("chat", False)),
        num_messages=len(r.messages),
        served_by=holder.split(" ")[0] if holder else "",
    )
    if with_tokens:
        out.token_ids.extend(r.tokens)
        out.text = engine.tokenizer.decode(r.tokens)
    return out


def tier_stats_pb(engine: Engine) -> pb.TierStats:
    t = engine.tier_stats()
    p50, p99 = engine.hbf_latency_us()
    copier = engine.copier
    return pb.TierStats(
        hbm_hit_rate=t.hbm_hit_rate,
        hbm_hits=t.hbm_hits,
        hbm_misses=t.hbm_misses,
        ddr_evict_count=t.ddr_evict_count,
        hbm_evict_count=t.hbm_evict_count,
        ssd_read_count=t.ssd_read_count,
        ssd_write_count=t.ssd_write_count,
        hbf_latency_us_p50=p50,
        hbf_latency_us_p99=p99,
        hbm_used_bytes=t.hbm_used_bytes,
        hbm_capacity_bytes=t.hbm_capacity_bytes,
        ddr_used_bytes=t.ddr_used_bytes,
        ddr_capacity_bytes=t.ddr_capacity_bytes,
        ssd_used_bytes=t.ssd_used_bytes,
        fetch_bytes=t.fetch_bytes,
        kv_rebuild_blocks=t.kv_rebuild_blocks,
        ssd_degraded=t.ssd_degraded,
        ssd_degraded_reason=engine.kv.ssd_degraded or "",
        ssd_write_errors=t.ssd_write_errors,
        hbm_rebalance_count=t.hbm_rebalance_count,
        recompute_evict_count=t.recompute_evict_count,
        dirty_bytes=t.dirty_bytes,
        write_behind_bytes=t.write_behind_bytes,
        write_behind_in_flight_bytes=t.write_behind_in_flight_bytes,
        write_behind_lag_s=t.write_behind_lag_s,
        read_ahead_bytes=t.read_ahead_bytes,
        read_ahead_in_flight_bytes=t.read_ahead_in_flight_bytes,
        window_freed_blocks=t.window_freed_blocks,
        window_hbm_bytes=t.window_hbm_bytes,
        shared_blocks=t.shared_blocks,
        shared_hbm_saved_bytes=t.shared_hbm_saved_bytes,
        shared_ddr_saved_bytes=t.shared_ddr_saved_bytes,
        digest_bytes=t.digest_bytes,
        digest_shared_saved_bytes=t.digest_shared_saved_bytes,
        digests_set_aside=t.digests_set_aside,
        copy_up_bytes=t.copy_up_bytes,
        copy_down_bytes=t.copy_down_bytes,
        remote_on=engine.remote is not None,
        remote_degraded=engine.remote is not None and engine.remote.degraded is not None,
        remote_degraded_reason=(engine.remote.degraded or "") if engine.remote is not None else "",
        remote_lag_bytes=engine.remote.lag_bytes() if engine.remote is not None else 0,
        remote_kv_copied_bytes=copier.copied_bytes if copier is not None else 0,
        remote_kv_copy_queued_bytes=copier.queued_bytes if copier is not None else 0,
        remote_kv_copy_skipped_blocks=copier.dropped_blocks if copier is not None else 0,
    )


def sampling_from(base: SamplingParams, msg: pb.SamplingParams, limit: int) -> SamplingParams:
    """`base` with the fields `msg` sets, checked (`sampling_with`)."""
    over: dict[str, Any] = {}
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed", "presence_penalty", "frequency_penalty"):
        if msg.HasField(name):
            over[name] = getattr(msg, name)
    if msg.stop:
        over["stop"] = tuple(msg.stop)
    if msg.stop_token_ids:
        over["stop_token_ids"] = tuple(msg.stop_token_ids)
    if msg.ignore_eos:
        over["ignore_eos"] = True
    return sampling_with(base, over, limit)


def sampling_with(base: SamplingParams, over: dict[str, Any], limit: int) -> SamplingParams:
    """`base` with the request's values `over` (field name -> value; both APIs build it),
    checked: at most MAX_STOP_STRINGS stop strings, max_tokens within 1..limit (a max_tokens the
    request leaves unset, the session's or the daemon's default, is capped at the limit)."""
    stop = over.get("stop", ())
    if len(stop) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"stop: at most {MAX_STOP_STRINGS} stop strings, got {len(stop)}")
    params = replace(base, **over)
    if "max_tokens" not in over:
        params = replace(params, max_tokens=min(params.max_tokens, limit))
    if not 1 <= params.max_tokens <= limit:
        raise InvalidRequest(f"max_tokens must be within 1..{limit} (max_tokens_limit), got {params.max_tokens}")
    return params.validate()  # temperatures below sampling.MIN_TEMPERATURE sample greedily


def check_token_ids(engine: Engine, ids: list[int], field: str) -> None:
    vocab = engine.model.config.vocab_size
    bad = next((t for t in ids if t >= vocab), None)
    if bad is not None:
        raise InvalidRequest(f"{field}: token id {bad} is outside the vocabulary (size {vocab})")


def summary_pb(
    engine: Engine,
    *,
    sid: SessionId,
    done: GenerationDone,
    ttft_s: float = 0.0,
    tier_stats: pb.TierStats | None = None,
) -> pb.GenerateSummary:
    """`tier_stats`: the daemon's tier figures if already taken at this step (several generations
    that end at one step share them); taken here otherwise."""
    residency = residency_pb(engine, engine.session(sid)) if sid in engine.sessions else pb.TierResidency()
    return pb.GenerateSummary(
        finish_reason=FINISH[done.finish_reason],
        prompt_tokens=done.prompt_tokens,
        completion_tokens=len(done.token_ids),
        ttft_s=ttft_s,
        tokens_per_s=done.decode_tokens_per_s,
        residency=residency,
        tier_stats=tier_stats_pb(engine) if tier_stats is None else tier_stats,
    )


def stats_pb(state: State, engine: Engine, ids: list[SessionId]) -> pb.Stats:
    sessions = []
    for sid in ids:
        session = engine.sessions.get(sid)
        if session is None:
            continue
        mine = engine.kv.counters(session.seq)
        sessions.append(
            pb.SessionStats(
                session_id=sid,
                num_tokens=len(session.tokens),
                residency=residency_pb(engine, session),
                hbm_hit_rate=mine.hbm_hit_rate,
                ssd_read_count=mine.ssd_read_count,
                window_tokens=engine.kv.window_tokens(session.seq),
                hbm_share_blocks=engine.kv.hbm_share(session.seq),
                **itl_fields(state.gaps.get(sid)),
            )
        )
    active = len(engine.requests())
    waiting = len(engine.waiting_for_memory.intersection(engine.requests()))  # (their KV past HBM and DDR)
    return pb.Stats(
        **{"global": tier_stats_pb(engine)},
        sessions=sessions,
        throughput=pb.Throughput(
            tokens_per_s=state.worker.throughput(),
            window_s=10.0,
            generated_tokens_total=engine.counters.generated_tokens,
            prefill_tokens_total=engine.counters.prefill_tokens,
            active_requests=min(active, engine.config.max_batch_size) - waiting,
            queued_requests=max(active - engine.config.max_batch_size, 0) + waiting,
            sessions=len(engine.sessions),
            steps_total=engine.counters.steps,
            prefix_queries_total=engine.counters.prefix_queries,
            prefix_hits_total=engine.counters.prefix_hits,
            prefix_reused_tokens_total=engine.counters.prefix_reused_tokens,
            prefix_cache_sessions=len(engine.prefix_cache),
        ),
        uptime_s=time.time() - state.started,
        draining=state.draining,
        graphs=graph_stats_pb(engine),
    )


def itl_fields(gaps: Iterable[float] | None) -> dict[str, float]:
    """p50 / p99 of a session's recent inter-token gaps, in ms (0 when it has none)."""
    ms = sorted(g * 1e3 for g in list(gaps or ()))
    if not ms:
        return {"itl_ms_p50": 0.0, "itl_ms_p99": 0.0}
    return {"itl_ms_p50": ms[(len(ms) - 1) // 2], "itl_ms_p99": ms[min(len(ms) - 1, int(len(ms) * 0.99))]}


def graph_stats_pb(engine: Engine) -> pb.GraphStats:
    g = engine.runner.graphs
    warm = engine.warmup
    return pb.GraphStats(
        captures_total=g.captures,
        captures_after_ready=g.captures_after_ready,
        captures_ahead=g.captures_ahead,
        replays_total=g.replays,
        eager_steps_total=g.eager_steps,
        warm_graphs=len(g.warm_keys),
        warm_s=0.0 if warm is None else warm.kernels_s + warm.graphs_s,
        deferred=len(g.deferred),
    )
