"""`h3d serve`: the daemon's lifecycle around one engine.

start: logs -> engine (model load, in a thread) -> worker thread -> gRPC on the Unix socket
       (mode `socket_mode`) and optional TCP -> the OpenAI HTTP API (`http_listen`, optional)
       -> health SERVING -> READY=1 (systemd)
run:   every `stats_interval_s` a `tier_stats` log event; WATCHDOG=1 at half the watchdog
       period; SIGHUP reloads the keys in `config.RELOADABLE`
stop:  SIGTERM/SIGINT -> STOPPING=1, health NOT_SERVING, new work refused (UNAVAILABLE);
       streams in flight get `drain_timeout_s` to finish, then end with finish reason
       CANCELLED; the sessions' KV goes to the archive within `shutdown_budget_s` (systemd told
       through EXTEND_TIMEOUT_USEC and STATUS=; what does not fit is computed again after the
       restart); archive writes are flushed; exit 0.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import os
import signal
import socket
import time
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from h3d.config import AUTO_KEYS
from h3d.daemon import logs
from h3d.daemon.admin import H3AdminServicer
from h3d.daemon.auth import LOCAL, Auth
from h3d.daemon.config import RELOADABLE, DaemonConfig, load, split_address
from h3d.daemon.convert import expire_pin, stats_pb
from h3d.daemon.metrics import Metrics, MetricsServer
from h3d.daemon.notify import Notifier
from h3d.daemon.rpc import State, handlers
from h3d.daemon.service import H3Servicer
from h3d.daemon.status import Draining
from h3d.daemon.worker import EngineWorker, cancel_all
from h3d.errors import ConfigError, H3Error
from h3d.store.files import make_dirs

if TYPE_CHECKING:
    from h3d.engine.engine import Checkpoint, Engine
    from h3d.engine.session import SessionId
    from h3d.kv.pool import Pinning
    from h3d.remote.logs import RemoteLogs

log = structlog.get_logger("h3d.server")
SERVICES = ("h3.v1.H3", "h3.v1.H3Admin")
# Asked of systemd beyond the checkpoint's time left: a session's write that starts just before the
# deadline, then the archive's close (what was written made durable).
SHUTDOWN_OVERRUN_S = 60.0


class Daemon:
    def __init__(self, config: DaemonConfig, config_path: str | None, overrides: dict[str, object]) -> None:
        self.config = config
        self.config_path = config_path
        self.overrides = overrides
        self.notifier = Notifier()
        self.stop_requested = asyncio.Event()
        self.health = health.aio.HealthServicer()
        self.metrics = Metrics()
        self._tasks: list[asyncio.Task[None]] = []
        self._socket_inode: int | None = None

    async def run(self) -> int:
        from h3d.engine.engine import Engine  # the model's modules load here, after the config is known good
        from h3d.engine.threads import apply_cpu_threads

        cfg = self.config
        started = time.perf_counter()
        Path(cfg.data_dir).mkdir(parents=True, exist_ok=True)
        check_socket(cfg.socket_path)  # before the model loads: a live daemon's socket is refused at once
        threads = apply_cpu_threads(cfg.engine)  # before the model loads: torch's CPU thread count
        kernels = triton_cache(Path(cfg.data_dir))  # before any kernel compiles
        log.info(
            "starting", pid=os.getpid(), model=cfg.engine.model, data_dir=cfg.data_dir, cpu_threads=threads,
            triton_cache_dir=kernels,
        )  # fmt: skip
        remote = await self._connect_remote() if cfg.remote_url is not None else None
        t0 = time.perf_counter()
        try:
            engine = await asyncio.to_thread(Engine, cfg.engine, remote)
        except BaseException:
            if remote is not None:
                await asyncio.to_thread(remote.close)
            raise
        if engine.moved_away:
            log.info("sessions_moved_away", sessions=len(engine.moved_away))  # served by other daemons now
        log.info(
            "model_loaded", seconds=round(time.perf_counter() - t0, 3), layers=engine.model.config.num_layers,
            **engine.start_s,
        )  # fmt: skip
        sized = engine.budgets
        blocks = engine.kv.blocks
        log.info(
            "tiers_sized", hbm_mb=sized.hbm_mb, ddr_mb=sized.ddr_mb, prefill_chunk_tokens=sized.prefill_chunk_tokens,
            auto=list(sized.resolved), hbm_slots=blocks.hbm_capacity, ddr_slots=blocks.ddr_alloc.size,
            ddr_slots_pinned=blocks.ddr_alloc.capacity,
        )  # fmt: skip
        # before ready: kernels compiled; the warm set of graphs captured now or while idle after
        warm = await asyncio.to_thread(engine.warm, None, cfg.engine.graphs_before_ready)
        log.info("warmed", **warm.fields())
        loop = asyncio.get_running_loop()
        self.worker = EngineWorker(engine, loop)
        self.worker.start()
        self.state = State(cfg, self.worker, Auth(cfg), self.metrics)
        self.state.resolved = {k: getattr(sized, k) for k in AUTO_KEYS} | {"device": cfg.engine.resolved_device}
        if engine.kv.tiers.ssd_capacity is not None:
            self.state.resolved["ssd_capacity_mb"] = round(engine.kv.tiers.ssd_capacity / 2**20, 1)
        if engine.kv.ddr.host_memory in ("mapped", "registered"):  # (a CPU host's DDR is not pinned)
            self.state.resolved["ddr_memory"] = engine.kv.ddr.host_memory
        self.state.owners = {sid: s.owner or LOCAL for sid, s in engine.sessions.items()}
        if engine.restored:
            log.info(
                "sessions_restored",
                sessions=len(engine.restored),
                kv_rebuild_blocks=engine.tier_stats().kv_rebuild_blocks,
            )
        if engine.swept:
            log.info("archive_swept", blocks=engine.swept)  # of sessions without a token log
        server = self._server()
        addresses = self._bind(server)
        await server.start()
        self._publish_socket()
        http = None
        if cfg.http_listen is not None:
            from h3d.daemon.http.server import HttpApi, model_name  # aiohttp loads only where the API is on

            http = HttpApi(self.state, model_name(cfg.engine.model))
            stored = http.responses.index.load(engine)
            tls = (cfg.tls_cert_file, cfg.tls_key_file) if cfg.tls_cert_file and cfg.tls_key_file else None
            addresses["http_address"] = await http.start(cfg.http_listen, tls)
            if stored:
                log.info("responses_restored", responses=stored)
        for service in ("", *SERVICES):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        metrics_server = None
        if cfg.metrics_listen is not None:
            host, port = split_address("metrics_listen", cfg.metrics_listen)
            metrics_server = MetricsServer(self._scrape)
            bound = await metrics_server.start(host, port)
            log.info("metrics_listening", address=f"{host}:{bound}")
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stop_requested.set)
        loop.add_signal_handler(signal.SIGHUP, self._reload)
        self._tasks.append(asyncio.create_task(self._stats_loop()))
        self._tasks.append(asyncio.create_task(self._expiry_loop()))
        if remote is not None:
            self._tasks.append(asyncio.create_task(self._lost_loop(remote.store.lease_s / 3)))
        if self.notifier.watchdog_s:
            self._tasks.append(asyncio.create_task(self._watchdog_loop(self.notifier.watchdog_s / 2)))
        ddr = engine.kv.ddr
        if ddr.pinning is not None:
            self._tasks.append(asyncio.create_task(self._pinned(ddr.pinning, ddr.slot_bytes, ddr.host_memory)))
            if ddr.host_memory_error is not None:  # `ddr_memory = auto` fell back to registering
                log.warning("ddr_not_mapped", reason=ddr.host_memory_error)
        self.worker.collector.start()  # what exists now is frozen; GC runs between steps from here on
        log.info("listening", **addresses, ready_s=round(time.perf_counter() - started, 3))
        self.notifier.send(READY="1", STATUS="serving", MAINPID=str(os.getpid()))

        await self.stop_requested.wait()
        cfg = self.config  # with what SIGHUP reloaded since the start (drain_timeout_s, shutdown_budget_s)
        self.notifier.send(STOPPING="1", STATUS="draining")
        log.info("draining", in_flight=self.state.in_flight, timeout_s=cfg.drain_timeout_s)
        finished, cancelled = await self.drain(cfg.drain_timeout_s)
        if http is not None:
            await http.stop()
        await server.stop(grace=5)
        for task in self._tasks:
            task.cancel()
        if metrics_server is not None:
            await metrics_server.close()
        await asyncio.to_thread(self.worker.stop, 30)
        self.worker.collector.stop()
        t0 = time.perf_counter()
        done = await asyncio.to_thread(self.checkpoint, engine, cfg.shutdown_budget_s)
        log.info("checkpoint", blocks_written=done.blocks_written, sessions=done.sessions,
                 sessions_left_to_recompute=done.sessions_left, blocks_left_to_recompute=done.blocks_left,
                 digest_bytes=done.digest_bytes, budget_s=cfg.shutdown_budget_s,
                 seconds=round(time.perf_counter() - t0, 3))  # fmt: skip
        if remote is not None:  # the sessions' KV for the daemons that take them over, in what is left of the budget
            left = max(0.0, cfg.shutdown_budget_s - (time.perf_counter() - t0))
            t1 = time.perf_counter()
            exported, kv_blocks, kv_bytes = await asyncio.to_thread(engine.export_kv_all, time.monotonic() + left)
            copier = engine.copier  # (what write-behind copied up since start, the checkpoint's flush included)
            log.info("remote_kv_written", sessions=exported, blocks=kv_blocks, bytes=kv_bytes,
                     seconds=round(time.perf_counter() - t1, 3), copied_blocks=copier.copied_blocks if copier else 0,
                     copied_bytes=copier.copied_bytes if copier else 0)  # fmt: skip
        await asyncio.to_thread(engine.close)  # archive writes in flight become durable
        if remote is not None:  # the logs' last bytes copied, the leases given up: other daemons take over at once
            await asyncio.to_thread(remote.close)
        self._unlink_socket()
        log.info("stopped", requests_finished=finished, requests_cancelled=cancelled)
        return 0

    async def _connect_remote(self) -> RemoteLogs:
        """The remote tier (`remote_url`): connected, and in `sync` mode its durability checked
        (NotDurable, RemoteUnavailable: the daemon does not start)."""
        from h3d.model.fingerprint import model_fingerprint
        from h3d.remote.logs import RemoteLogs
        from h3d.remote.store import RemoteStore, redact

        cfg = self.config
        assert cfg.remote_url is not None and cfg.engine.session_log_path is not None
        folder = Path(cfg.engine.session_log_path)
        namespace = (await asyncio.to_thread(model_fingerprint, cfg.engine.model))[:16]
        store = RemoteStore(
            cfg.remote_url, namespace=namespace, owner=owner_name(cfg), password=cfg.remote_password(),
            timeout_s=cfg.remote_timeout_s, lease_s=cfg.remote_lease_s,
        )  # fmt: skip
        remote = RemoteLogs(
            store, lambda session: folder / f"{session}.h3log", sync=cfg.remote_log == "sync",
            kv_ttl_s=int(cfg.remote_kv_ttl_s), kv_copy_bytes=int(cfg.remote_kv_copy_mb * 2**20),
            kv_resume=cfg.remote_kv_resume,
        )  # fmt: skip
        try:
            checked = await asyncio.to_thread(remote.start)
        except BaseException:
            await asyncio.to_thread(remote.close)
            raise
        log.info("remote_connected", url=redact(cfg.remote_url), namespace=namespace, owner=store.owner,
                 remote_log=cfg.remote_log, durability=checked)  # fmt: skip
        return remote

    def checkpoint(self, engine: Engine, budget_s: float) -> Checkpoint:
        """The sessions' KV into the archive within `budget_s` (`Engine.checkpoint`), telling
        systemd before each session how much longer to wait (the time left, plus
        `SHUTDOWN_OVERRUN_S` for a session's write that starts just before the deadline and for
        closing the archive) and how far it got."""
        from h3d.engine.engine import Checkpoint  # the model's modules load after the config is known good

        deadline = time.monotonic() + budget_s

        def tell(done: Checkpoint) -> None:
            left = max(0.0, deadline - time.monotonic())
            self.notifier.send(
                EXTEND_TIMEOUT_USEC=str(int((left + SHUTDOWN_OVERRUN_S) * 1e6)),
                STATUS=f"checkpoint: {done.sessions_done}/{done.sessions} sessions, {done.blocks_written} blocks "
                f"written, {done.blocks_left} left to recompute",
            )

        tell(Checkpoint(sessions=len(engine.sessions)))
        return engine.checkpoint(deadline, progress=tell)

    def _server(self) -> grpc.aio.Server:
        cfg = self.config
        server = grpc.aio.server(
            options=[
                ("grpc.max_receive_message_length", cfg.max_message_bytes),
                ("grpc.max_send_message_length", cfg.max_message_bytes),
                ("grpc.so_reuseport", 0),
            ]
        )
        server.add_generic_rpc_handlers(
            (
                handlers(self.state, H3Servicer(self.state), "H3", admin=False),
                handlers(self.state, H3AdminServicer(self.state, self.drain, self.resume), "H3Admin", admin=True),
            )
        )
        health_pb2_grpc.add_HealthServicer_to_server(self.health, server)
        names = (*SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME)
        reflection.enable_server_reflection(names, server)
        return server

    def _bind(self, server: grpc.aio.Server) -> dict[str, str]:
        cfg = self.config
        path = cfg.socket_path
        path.parent.mkdir(parents=True, exist_ok=True)
        # gRPC removes the path it bound when it stops, whoever owns it by then: it binds a private
        # name, which `_publish_socket` renames into place once the server runs.
        private = self._private_socket()
        private.unlink(missing_ok=True)
        server.add_insecure_port(f"unix:{private}")
        out = {"socket": str(path)}
        if cfg.listen is not None:
            host, port = split_address("listen", cfg.listen)
            target = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
            if cfg.tls_cert_file and cfg.tls_key_file:
                creds = grpc.ssl_server_credentials(
                    [(Path(cfg.tls_key_file).read_bytes(), Path(cfg.tls_cert_file).read_bytes())]
                )
                bound = server.add_secure_port(target, creds)
            else:
                bound = server.add_insecure_port(target)
            if bound == 0:
                raise ConfigError(f"listen: cannot bind {cfg.listen}")
            out["address"] = f"{host}:{bound}"
        return out

    def _private_socket(self) -> Path:
        path = self.config.socket_path
        return path.with_name(f".{path.name}.{os.getpid()}")

    def _publish_socket(self) -> None:
        """Move the bound socket to `socket` (a stale one there is replaced: `check_socket`
        refuses a live one) with mode `socket_mode`, and remember which inode is ours."""
        path, private = self.config.socket_path, self._private_socket()
        os.chmod(private, int(self.config.socket_mode, 8))
        try:
            check_socket(path)  # again: another daemon may have started while the model loaded
        except ConfigError:
            private.unlink(missing_ok=True)
            raise
        os.replace(private, path)
        self._socket_inode = path.stat().st_ino

    def _unlink_socket(self) -> None:
        """Remove the socket at shutdown, only if it is still this daemon's (same inode): another
        daemon may have taken the path over meanwhile."""
        path = self.config.socket_path
        if self._socket_inode is None:
            return
        try:
            if path.stat().st_ino == self._socket_inode:
                path.unlink()
            else:
                log.warning("socket_replaced", socket=str(path), note="another process owns the path now: left as is")
        except FileNotFoundError:
            pass

    async def drain(self, timeout_s: float) -> tuple[int, int]:
        """Refuse new work; give streams in flight `timeout_s` to end; cancel the rest.
        Returns (requests that finished, requests cancelled)."""
        self.state.draining = True
        for service in ("", *SERVICES):
            await self.health.set(service, health_pb2.HealthCheckResponse.NOT_SERVING)
        before = self.state.in_flight
        deadline = time.monotonic() + timeout_s
        while self.state.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        left = self.state.in_flight
        if left:
            await self.worker.call(lambda e: cancel_all(e, list(e.requests())))
            end = time.monotonic() + 10
            while self.state.in_flight and time.monotonic() < end:
                await asyncio.sleep(0.02)
        return before - left, left

    async def resume(self) -> bool:
        """Undo an admin Drain: take requests again, health SERVING. Returns whether it was
        draining. A stop (SIGTERM) is not undone."""
        if self.stop_requested.is_set():
            raise Draining("the daemon is stopping (SIGTERM): it cannot resume")
        was = self.state.draining
        self.state.draining = False
        for service in ("", *SERVICES):
            await self.health.set(service, health_pb2.HealthCheckResponse.SERVING)
        if was:
            log.info("resumed")
        return was

    async def _scrape(self) -> str:
        stats = await self.worker.call(lambda e: stats_pb(self.state, e, []))
        return self.metrics.render(stats, self.state.in_flight)

    async def _pinned(self, pinning: Pinning, slot_bytes: int, memory: str) -> None:
        """Log when the DDR pool registered after the start is all usable (or stopped short)."""
        usable = await asyncio.to_thread(pinning.wait, pinning.num_slots)  # (returns at the engine's close too)
        if pinning.error is not None:
            log.error(
                "ddr_pinning_failed", reason=pinning.error, usable_gb=round(usable * slot_bytes / 1e9, 1), memory=memory
            )
        elif pinning.done_s is not None:
            gb = round(usable * slot_bytes / 1e9, 1)
            log.info("ddr_pinned", gb=gb, seconds=round(pinning.done_s, 3), memory=memory)

    async def _stats_loop(self) -> None:
        while True:
            await asyncio.sleep(self.state.config.stats_interval_s)
            try:
                await self.worker.call(_expire_pins)
                stats = await self.worker.call(lambda e: stats_pb(self.state, e, []))
            except H3Error:
                continue
            g, t = getattr(stats, "global"), stats.throughput
            remote = (
                {"remote_degraded": g.remote_degraded, "remote_lag_bytes": g.remote_lag_bytes} if g.remote_on else {}
            )
            log.info(
                "tier_stats",
                hbm_hit_rate=round(g.hbm_hit_rate, 4),
                ddr_evict_count=g.ddr_evict_count,
                ssd_read_count=g.ssd_read_count,
                hbm_evict_count=g.hbm_evict_count,
                hbf_latency_us_p50=round(g.hbf_latency_us_p50, 1),
                hbf_latency_us_p99=round(g.hbf_latency_us_p99, 1),
                hbm_used_bytes=g.hbm_used_bytes,
                hbm_capacity_bytes=g.hbm_capacity_bytes,
                ddr_used_bytes=g.ddr_used_bytes,
                ddr_capacity_bytes=g.ddr_capacity_bytes,
                ssd_used_bytes=g.ssd_used_bytes,
                dirty_bytes=g.dirty_bytes,
                write_behind_bytes=g.write_behind_bytes,
                write_behind_lag_s=round(g.write_behind_lag_s, 2),
                tokens_per_s=round(t.tokens_per_s, 2),
                sessions=t.sessions,
                in_flight=self.state.in_flight,
                gc_collections=self.worker.collector.collections,
                gc_pause_ms_max=round(self.worker.collector.take_max() * 1e3, 2),
                **remote,
            )
            self.state.prune_gaps(self.state.owners)  # the gaps of purged sessions

    async def _expiry_loop(self) -> None:
        """Close sessions idle for `session_ttl_s` (not busy, not pinned, not closed yet), when it is set:
        their KV goes to the archive only, and their next request reopens them."""
        while True:
            ttl = self.state.config.session_ttl_s
            await asyncio.sleep(min(max(ttl / 4, 0.2), 10.0) if ttl else 5.0)
            if not ttl:
                continue
            closed = await self.worker.call(functools.partial(_close_idle, ttl_s=ttl))
            for sid in closed:
                log.info("session_expired", session_id=sid, ttl_s=ttl)

    async def _lost_loop(self, every_s: float) -> None:
        """Forget the sessions whose lease another daemon took (this one was cut off from the remote
        store for longer than a lease): their requests end, their log and KV here go."""
        while True:
            await asyncio.sleep(every_s)
            for sid in await self.worker.call(lambda e: e.drop_lost()):
                self.state.owners.pop(sid, None)
                log.warning("session_lost", session_id=sid)  # (another daemon took it over)

    async def _watchdog_loop(self, every_s: float) -> None:
        while True:
            self.notifier.send(WATCHDOG="1")
            await asyncio.sleep(every_s)

    def _reload(self) -> None:
        """SIGHUP: re-read the file (flags still win) and apply the keys in RELOADABLE."""
        try:
            fresh = load(self.config_path, self.overrides)
        except H3Error as exc:
            log.error("reload_failed", error=str(exc))
            return
        changes = {k: getattr(fresh, k) for k in RELOADABLE if getattr(fresh, k) != getattr(self.config, k)}
        self.config = replace(self.config, **changes)
        self.state.config = self.config
        self.state.auth.reload(self.config)
        logs.configure(self.config.log_level)
        restart = sorted(
            k for k, v in fresh.public().items() if k not in RELOADABLE and self.config.public().get(k) != v
        )
        log.info("reloaded", changed=sorted(changes), need_restart=restart)


def owner_name(config: DaemonConfig) -> str:
    """This daemon's name in the remote store's leases: its host and its data folder (one daemon
    per folder: the archive's lock), so that a daemon restarted in place takes its sessions back
    at once."""
    folder = hashlib.sha256(os.path.realpath(config.data_dir).encode()).hexdigest()[:8]
    return f"{socket.gethostname()}-{folder}".replace(" ", "_")


def triton_cache(data_dir: Path) -> str:
    """Where Triton keeps its compiled kernels: `TRITON_CACHE_DIR` if the environment sets it,
    else `<data_dir>/triton-cache` (made 0700), so that a restart reuses them and the systemd
    unit's sandbox (a read-only home) does not stop them from being kept."""
    if not os.environ.get("TRITON_CACHE_DIR"):
        path = data_dir / "triton-cache"
        make_dirs(path)
        os.environ["TRITON_CACHE_DIR"] = str(path)
    return os.environ["TRITON_CACHE_DIR"]


def check_socket(path: Path) -> None:
    """Refuse (ConfigError) a `socket` path that is not a socket, or that a live daemon accepts
    connections on. Nothing there, or a stale socket (a daemon that died), is fine: the bound
    socket is renamed over it (`Daemon._publish_socket`)."""
    if not (path.exists() or path.is_symlink()):
        return
    if not path.is_socket():
        raise ConfigError(f"socket: {path} exists and is not a socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        return  # nobody listens: left behind by a daemon that died
    except OSError as exc:
        raise ConfigError(f"socket: cannot tell whether {path} is in use ({exc}); remove it if no daemon runs") from exc
    finally:
        probe.close()
    raise ConfigError(f"socket: {path} is in use by a running daemon; stop it first or give this one another --socket")


def _close_idle(engine: Engine, *, ttl_s: float) -> list[SessionId]:
    now = time.time()
    idle = [
        s.id
        for s in engine.sessions.values()
        if not s.busy and not s.closed and engine.kv.pinned_until(s.seq) is None and now - s.last_used_at >= ttl_s
    ]
    for sid in idle:
        engine.close_session(sid, later=True)
    return idle


def _expire_pins(engine: Engine) -> None:
    for session in engine.sessions.values():
        expire_pin(engine, session)


def serve(config_path: str | None, overrides: dict[str, object]) -> int:
    """Load the configuration, run the daemon until SIGTERM; 0 on a clean stop, 1 on a bad start."""
    import uvloop

    config = load(config_path, overrides)  # ConfigError -> the CLI prints it and exits 1
    logs.configure(config.log_level)
    daemon = Daemon(config, config_path, overrides)
    try:
        return uvloop.run(daemon.run())
    except H3Error as exc:
        log.error("start_failed", error=str(exc))
        raise
