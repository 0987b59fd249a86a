"""Prometheus metrics: a text-format endpoint (`GET /metrics` on `metrics_listen`, served by aiohttp),
rendered here (no client library: the figures come from one `Stats` snapshot).

Every name starts with `h3d_`. The daemon's own counters and histograms (RPCs, time to first
token, time between tokens) live here; the engine's figures (tiers, HBF, throughput) are read
from a fresh `Stats` snapshot at each scrape, so both always agree with `GetStats`.
docs/OPERATIONS.md lists them; docs/grafana-dashboard.json plots them.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Awaitable, Callable

import structlog
from aiohttp import web

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.errors import ConfigError

log = structlog.get_logger("h3d.metrics")

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def lines(self, name: str, labels: str = "") -> list[str]:
        out, total = [], 0
        sep = "," if labels else ""
        for bound, count in zip([*self.buckets, float("inf")], self.counts, strict=True):
            total += count
            le = "+Inf" if bound == float("inf") else repr(bound)
            out.append(f'{name}_bucket{{{labels}{sep}le="{le}"}} {total}')
        suffix = f"{{{labels}}}" if labels else ""
        out += [f"{name}_sum{suffix} {self.sum}", f"{name}_count{suffix} {total}"]
        return out


class Metrics:
    def __init__(self) -> None:
        self.rpcs: dict[tuple[str, str, str], int] = defaultdict(int)  # (api, method, code)
        self.rpc_seconds: dict[tuple[str, str], Histogram] = defaultdict(lambda: Histogram(LATENCY_BUCKETS))
        self.ttft = Histogram(LATENCY_BUCKETS)
        self.inter_token = Histogram(LATENCY_BUCKETS)

    def rpc(self, method: str, code: str, seconds: float, api: str = "grpc") -> None:
        """A call answered: `api` "grpc" (code: the status's name) or "http" (code: the HTTP status)."""
        self.rpcs[(api, method, code)] += 1
        self.rpc_seconds[(api, method)].observe(seconds)

    def token(self, gap_s: float, first: bool) -> None:
        (self.ttft if first else self.inter_token).observe(gap_s)

    def render(self, stats: pb.Stats, in_flight: int) -> str:
        g, t = getattr(stats, "global"), stats.throughput
        lines: list[str] = []

        def metric(name: str, kind: str, help_: str, value: float) -> None:
            lines.extend([f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"])

        metric("h3d_hbm_hit_rate", "gauge", "Blocks read from HBM / blocks read, since start.", g.hbm_hit_rate)
        metric("h3d_hbm_hits_total", "counter", "Blocks attention read from HBM.", g.hbm_hits)
        metric("h3d_hbm_misses_total", "counter", "Blocks attention read from below HBM.", g.hbm_misses)
        metric("h3d_ddr_evict_total", "counter", "DDR block copies dropped (ddr_evict_count).", g.ddr_evict_count)
        metric("h3d_hbm_evict_total", "counter", "HBM block copies dropped.", g.hbm_evict_count)
        metric("h3d_hbm_rebalance_total", "counter", "Blocks moved toward the active sessions' fair shares of HBM.",
               g.hbm_rebalance_count)  # fmt: skip
        metric("h3d_ssd_read_total", "counter", "Blocks read back from the SSD archive.", g.ssd_read_count)
        metric("h3d_ssd_write_total", "counter", "Blocks written to the SSD archive.", g.ssd_write_count)
        metric("h3d_fetch_bytes_total", "counter", "Bytes attention read from below HBM.", g.fetch_bytes)
        metric("h3d_kv_rebuild_blocks_total", "counter", "KV blocks computed again (archive copy missing or damaged).",
               g.kv_rebuild_blocks)  # fmt: skip
        metric("h3d_ssd_degraded", "gauge", "1 while the SSD tier takes no writes (full disk, I/O error).",
               int(g.ssd_degraded))  # fmt: skip
        metric("h3d_ssd_write_errors_total", "counter", "Archive writes that failed.", g.ssd_write_errors)
        metric("h3d_recompute_evict_total", "counter", "Block copies forgotten while the SSD tier was degraded.",
               g.recompute_evict_count)  # fmt: skip
        metric("h3d_kv_dirty_bytes", "gauge", "KV bytes of full blocks without a durable archive copy.", g.dirty_bytes)
        metric("h3d_write_behind_bytes_total", "counter", "KV bytes written to the archive in the background.",
               g.write_behind_bytes)  # fmt: skip
        metric("h3d_write_behind_in_flight_bytes", "gauge", "KV bytes written behind and not yet durable.",
               g.write_behind_in_flight_bytes)  # fmt: skip
        metric("h3d_write_behind_lag_seconds", "gauge", "Seconds the dirty KV has been past write_behind_dirty_mb.",
               g.write_behind_lag_s)  # fmt: skip
        metric("h3d_read_ahead_bytes_total", "counter", "Resumed sessions' KV read back into DDR in the background.",
               g.read_ahead_bytes)  # fmt: skip
        metric("h3d_read_ahead_in_flight_bytes", "gauge", "Resumed sessions' KV being read back into DDR now.",
               g.read_ahead_in_flight_bytes)  # fmt: skip
        metric("h3d_window_freed_blocks_total", "counter", "Sliding-window layers' blocks freed behind their window.",
               g.window_freed_blocks)  # fmt: skip
        metric("h3d_window_hbm_bytes", "gauge", "HBM bytes held by sliding-window layers' blocks.", g.window_hbm_bytes)
        metric("h3d_shared_blocks", "gauge", "Blocks several sessions point to (forks, reused prefixes).",
               g.shared_blocks)  # fmt: skip
        if g.remote_on:
            metric("h3d_remote_degraded", "gauge", "1 while the remote store does not take the token logs' copies.",
                   int(g.remote_degraded))  # fmt: skip
            metric("h3d_remote_lag_bytes", "gauge", "Bytes of the token logs the remote store does not hold yet.",
                   g.remote_lag_bytes)  # fmt: skip
            metric("h3d_remote_kv_copied_bytes_total", "counter",
                   "KV bytes (compressed) write-behind archived and copied to the remote store.",
                   g.remote_kv_copied_bytes)  # fmt: skip
            metric("h3d_remote_kv_copy_queued_bytes", "gauge", "KV bytes waiting to be copied to the remote store.",
                   g.remote_kv_copy_queued_bytes)  # fmt: skip
            metric("h3d_remote_kv_copy_skipped_blocks_total", "counter",
                   "KV blocks not copied to the remote store (queue full, store unavailable).",
                   g.remote_kv_copy_skipped_blocks)  # fmt: skip
        lines += [
            "# HELP h3d_shared_saved_bytes Bytes that sharing blocks saves now, per tier (and in the digests).",
            "# TYPE h3d_shared_saved_bytes gauge",
            f'h3d_shared_saved_bytes{{tier="hbm"}} {g.shared_hbm_saved_bytes}',
            f'h3d_shared_saved_bytes{{tier="ddr"}} {g.shared_ddr_saved_bytes}',
            f'h3d_shared_saved_bytes{{tier="digests"}} {g.digest_shared_saved_bytes}',
        ]
        metric("h3d_digest_bytes", "gauge", "Bytes of the sessions' block digests (HBF's selection reads them).",
               g.digest_bytes)  # fmt: skip
        metric("h3d_digests_set_aside_total", "counter",
               "Idle sessions whose digests were taken off the device to make room for a request's.",
               g.digests_set_aside)  # fmt: skip
        # Stats carries microseconds (hbf_latency_us_p50/p99); Prometheus wants base units, and a quantile
        # label only on a summary. Quantiles over a window of recent steps are what a summary is; Stats
        # has no sum or count of the steps' planning time, so the summary has no _sum and _count lines.
        lines += [
            "# HELP h3d_hbf_latency_seconds Host-side HBF planning per decode step, quantiles of recent steps.",
            "# TYPE h3d_hbf_latency_seconds summary",
            f'h3d_hbf_latency_seconds{{quantile="0.5"}} {g.hbf_latency_us_p50 / 1e6}',
            f'h3d_hbf_latency_seconds{{quantile="0.99"}} {g.hbf_latency_us_p99 / 1e6}',
            "# HELP h3d_tier_used_bytes Bytes of KV held per tier.",
            "# TYPE h3d_tier_used_bytes gauge",
            f'h3d_tier_used_bytes{{tier="hbm"}} {g.hbm_used_bytes}',
            f'h3d_tier_used_bytes{{tier="ddr"}} {g.ddr_used_bytes}',
            f'h3d_tier_used_bytes{{tier="ssd"}} {g.ssd_used_bytes}',
            "# HELP h3d_tier_capacity_bytes Bytes of KV each tier can hold (SSD: unbounded, not shown).",
            "# TYPE h3d_tier_capacity_bytes gauge",
            f'h3d_tier_capacity_bytes{{tier="hbm"}} {g.hbm_capacity_bytes}',
            f'h3d_tier_capacity_bytes{{tier="ddr"}} {g.ddr_capacity_bytes}',
            "# HELP h3d_tier_copy_bytes_total Bytes of KV copied between HBM and DDR (up: DDR to HBM).",
            "# TYPE h3d_tier_copy_bytes_total counter",
            f'h3d_tier_copy_bytes_total{{direction="up"}} {g.copy_up_bytes}',
            f'h3d_tier_copy_bytes_total{{direction="down"}} {g.copy_down_bytes}',
        ]
        metric("h3d_tokens_per_second", "gauge", "Generated tokens per second (last 10 s).", t.tokens_per_s)
        metric("h3d_generated_tokens_total", "counter", "Tokens generated.", t.generated_tokens_total)
        metric("h3d_prefill_tokens_total", "counter", "Tokens prefilled.", t.prefill_tokens_total)
        metric("h3d_steps_total", "counter", "Engine steps (batched forward passes).", t.steps_total)
        metric("h3d_prefix_queries_total", "counter", "New sessions' first requests that looked for a cached prefix.",
               t.prefix_queries_total)  # fmt: skip
        metric("h3d_prefix_hits_total", "counter", "Of those, the ones that shared another session's KV blocks.",
               t.prefix_hits_total)  # fmt: skip
        metric("h3d_prefix_reused_tokens_total", "counter", "Tokens whose KV blocks were shared instead of computed.",
               t.prefix_reused_tokens_total)  # fmt: skip
        metric("h3d_prefix_cache_sessions", "gauge", "Finished request sessions kept for their KV.",
               t.prefix_cache_sessions)  # fmt: skip
        metric("h3d_sessions", "gauge", "Open sessions.", t.sessions)
        metric("h3d_requests_in_flight", "gauge", "AppendContext and Generate streams admitted.", in_flight)
        metric("h3d_requests_queued", "gauge",
               "Requests waiting: for a batch slot, or for memory (the tiers' KV past HBM and DDR).",
               t.queued_requests)  # fmt: skip
        metric("h3d_draining", "gauge", "1 while the daemon drains.", int(stats.draining))
        metric("h3d_uptime_seconds", "gauge", "Seconds since the daemon started.", stats.uptime_s)
        gr = stats.graphs
        metric("h3d_graph_captures_total", "counter", "Decode graphs captured (the warm-up's included).",
               gr.captures_total)  # fmt: skip
        metric("h3d_graph_captures_after_ready_total", "counter",
               "Decode graphs captured after ready (between steps: the warm set left for after ready, and those steps "
               "wanted, which ran uncaptured meanwhile).",
               gr.captures_after_ready)  # fmt: skip
        metric("h3d_graph_captures_ahead_total", "counter",
               "Decode graphs captured ahead: before the step that joined sessions (their prompts appended before) to "
               "a batch, for that batch.",
               gr.captures_ahead)  # fmt: skip
        metric("h3d_graph_replays_total", "counter", "Decode steps replayed through a graph.", gr.replays_total)
        metric("h3d_graph_eager_steps_total", "counter", "Decode steps run uncaptured while their graph waited.",
               gr.eager_steps_total)  # fmt: skip
        lines += [
            "# HELP h3d_rpc_total Calls answered, by API (grpc, http), method and status code.",
            "# TYPE h3d_rpc_total counter",
        ]
        lines += [
            f'h3d_rpc_total{{api="{a}",method="{m}",code="{c}"}} {n}' for (a, m, c), n in sorted(self.rpcs.items())
        ]
        lines += ["# HELP h3d_rpc_duration_seconds Call handling time.", "# TYPE h3d_rpc_duration_seconds histogram"]
        for (api, method), hist in sorted(self.rpc_seconds.items()):
            lines += hist.lines("h3d_rpc_duration_seconds", f'api="{api}",method="{method}"')
        lines += [
            "# HELP h3d_ttft_seconds Generate and the HTTP API: request to first token.",
            "# TYPE h3d_ttft_seconds histogram",
        ]
        lines += self.ttft.lines("h3d_ttft_seconds")
        lines += [
            "# HELP h3d_inter_token_seconds Generate and the HTTP API: time between tokens of a stream.",
            "# TYPE h3d_inter_token_seconds histogram",
        ]
        lines += self.inter_token.lines("h3d_inter_token_seconds")
        return "\n".join(lines) + "\n"


class MetricsServer:
    """`GET /metrics` on `metrics_listen` (aiohttp, in the daemon's loop); anything else is 404."""

    def __init__(self, snapshot: Callable[[], Awaitable[str]]) -> None:
        self.snapshot = snapshot
        self._runner: web.AppRunner | None = None

    async def start(self, host: str, port: int) -> int:
        """Serve on HOST:PORT (0 picks one); returns the bound port."""
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        try:
            await web.TCPSite(runner, host, port, reuse_address=True).start()
        except OSError as exc:
            await runner.cleanup()
            raise ConfigError(f"metrics_listen: cannot bind {host}:{port}: {exc.strerror or exc}") from exc
        self._runner = runner
        return int(runner.addresses[0][1])

    async def _metrics(self, request: web.Request) -> web.Response:
        try:
            text = await self.snapshot()
        except Exception:
            log.exception("metrics_request_failed")
            raise web.HTTPServiceUnavailable(text="metrics unavailable; the daemon's log says why\n") from None
        return web.Response(body=text.encode(), headers={"Content-Type": "text/plain; version=0.0.4; charset=utf-8"})

    async def close(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
