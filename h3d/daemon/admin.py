"""The gRPC service `h3.v1.H3Admin`: eviction, pins, snapshots, policies, drain and resume, config.

Its methods go through the same handler table as H3's (h3d.daemon.rpc), as admin calls: where
admin tokens are configured, only their holders get in (`Auth.caller`). What must stay true: a
session's blocks are not evicted while it has a request in flight (SessionBusy); drain and resume
are the daemon's own (`Daemon.drain`, `Daemon.resume`), handed in by the server.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Awaitable, Callable
from typing import Any

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.daemon.auth import Caller
from h3d.daemon.convert import residency_pb, session_pb
from h3d.daemon.rpc import State
from h3d.engine.engine import Engine
from h3d.errors import InvalidRequest, SessionBusy


class H3AdminServicer:
    def __init__(
        self,
        state: State,
        drain: Callable[[float], Awaitable[tuple[int, int]]],
        resume: Callable[[], Awaitable[bool]],
    ) -> None:
        self.s = state
        self._drain = drain
        self._resume = resume

    async def EvictSession(
        self, request: pb.EvictSessionRequest, context: Any, caller: Caller
    ) -> pb.EvictSessionResponse:
        sid = await self.s.owned(caller, request.session_id)
        if request.to not in (pb.TIER_DDR, pb.TIER_SSD):
            raise InvalidRequest("to: must be TIER_DDR or TIER_SSD")

        def evict(engine: Engine) -> pb.EvictSessionResponse:
            session = engine.session(sid)
            if session.busy:
                raise SessionBusy(f"session {sid} has a request in flight: evict it when idle")
            moved = engine.kv.demote(session.seq, to_ssd=request.to == pb.TIER_SSD)
            return pb.EvictSessionResponse(blocks_moved=moved, residency=residency_pb(engine, session))

        return await self.s.worker.call(evict)

    async def PinSession(self, request: pb.PinSessionRequest, context: Any, caller: Caller) -> pb.Session:
        sid = await self.s.owned(caller, request.session_id)
        if not (math.isfinite(request.ttl_s) and request.ttl_s >= 0):
            raise InvalidRequest(f"ttl_s: must be a number >= 0, got {request.ttl_s}")

        def pin(engine: Engine) -> pb.Session:
            engine.set_pin(sid, None if request.unpin else time.time() + request.ttl_s if request.ttl_s else math.inf)
            return session_pb(engine, engine.session(sid))

        return await self.s.worker.call(pin)

    async def SnapshotSession(
        self, request: pb.SnapshotSessionRequest, context: Any, caller: Caller
    ) -> pb.SnapshotSessionResponse:
        sid = await self.s.owned(caller, request.session_id)

        def snapshot(engine: Engine) -> pb.SnapshotSessionResponse:
            t0 = time.perf_counter()
            written = engine.kv.snapshot(engine.session(sid).seq)
            return pb.SnapshotSessionResponse(blocks_written=written, seconds=time.perf_counter() - t0)

        return await self.s.worker.call(snapshot)

    async def SetPolicy(self, request: pb.SetPolicyRequest, context: Any, caller: Caller) -> pb.Session:
        sid = await self.s.owned(caller, request.session_id)

        def set_policy(engine: Engine) -> pb.Session:
            engine.set_policy(sid, request.policy)
            return session_pb(engine, engine.session(sid))

        return await self.s.worker.call(set_policy)

    async def Drain(self, request: pb.DrainRequest, context: Any, caller: Caller) -> pb.DrainResponse:
        if not (math.isfinite(request.timeout_s) and request.timeout_s >= 0):
            raise InvalidRequest(f"timeout_s: must be a number >= 0, got {request.timeout_s}")
        finished, cancelled = await self._drain(request.timeout_s or self.s.config.drain_timeout_s)
        return pb.DrainResponse(requests_finished=finished, requests_cancelled=cancelled)

    async def Resume(self, request: pb.ResumeRequest, context: Any, caller: Caller) -> pb.ResumeResponse:
        return pb.ResumeResponse(was_draining=await self._resume())

    async def GetConfig(self, request: pb.GetConfigRequest, context: Any, caller: Caller) -> pb.GetConfigResponse:
        return pb.GetConfigResponse(
            json=json.dumps({**self.s.config.public(), "resolved": self.s.resolved}, sort_keys=True)
        )
