"""`h3ctl health`, `stats` and `top`: whether the daemon serves, its tiers' figures and throughput
(GetStats), and the live view of the daemon and its sessions.

- `health` exits 0 only when the daemon is SERVING.
- `stats --watch` (human output) and `top` redraw in place on a terminal, else put a blank line
  between views; both end with exit 0 on Ctrl-C, `top` also on `q`, leaving the terminal as it was.
- `top` shows a session's id as its first `SESSION_PREFIX` digits, a prefix every command takes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import sys
import termios
import time
import tty
from typing import Any

from grpc_health.v1 import health_pb2

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.ctl.client import Client
from h3d.ctl.options import positive
from h3d.ctl.output import Frames, duration, emit_json, mib, table, to_dict, yes_no
from h3d.ctl.sessions import list_sessions

DEFAULT_INTERVAL_S = 2.0
SESSION_PREFIX = 12  # the digits of an id that `top` shows


def cmd_health(c: Client, args: argparse.Namespace) -> int:
    resp = c.call(c.health.Check, health_pb2.HealthCheckRequest(service=""))
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
    if args.json:
        emit_json({"status": status})
    else:
        print(status)
    return 0 if resp.status == health_pb2.HealthCheckResponse.SERVING else 1


def stats_text(stats: Any) -> str:
    g, t = getattr(stats, "global"), stats.throughput
    rows = [
        ("hbm_hit_rate", f"{g.hbm_hit_rate:.4f} ({g.hbm_hits} hits, {g.hbm_misses} misses)"),
        ("ddr_evict_count", str(g.ddr_evict_count)),
        ("hbm_evict_count", str(g.hbm_evict_count)),
        ("ssd_read_count", str(g.ssd_read_count)),
        ("ssd_write_count", str(g.ssd_write_count)),
        ("ssd_tier", f"DEGRADED: {g.ssd_degraded_reason}" if g.ssd_degraded else "ok"),
        ("kv_rebuild_blocks", str(g.kv_rebuild_blocks)),
        (
            "write_behind_mib",
            f"{mib(g.dirty_bytes)} dirty, {mib(g.write_behind_in_flight_bytes)} in flight, "
            f"{mib(g.write_behind_bytes)} written; lag {g.write_behind_lag_s:.1f}s",
        ),
        (
            "read_ahead_mib",
            f"{mib(g.read_ahead_bytes)} read back, {mib(g.read_ahead_in_flight_bytes)} in flight",
        ),
        ("window_layers", f"{mib(g.window_hbm_bytes)} MiB in HBM, {g.window_freed_blocks} blocks freed behind"),
        (
            "shared_blocks",
            f"{g.shared_blocks}; saving HBM {mib(g.shared_hbm_saved_bytes)} MiB, "
            f"DDR {mib(g.shared_ddr_saved_bytes)} MiB, digests {mib(g.digest_shared_saved_bytes)} MiB",
        ),
        ("digests_mib", f"{mib(g.digest_bytes)}"),
        ("digests_set_aside", f"{g.digests_set_aside}"),
        ("hbm_ddr_copies_mib", f"{mib(g.copy_up_bytes)} up, {mib(g.copy_down_bytes)} down"),
        ("hbf_latency_us", f"p50 {g.hbf_latency_us_p50:.1f}  p99 {g.hbf_latency_us_p99:.1f}"),
        (
            "remote_tier",
            "off"
            if not g.remote_on
            else f"DEGRADED ({g.remote_degraded_reason}); {g.remote_lag_bytes} bytes of logs behind"
            if g.remote_degraded
            else f"ok; {g.remote_lag_bytes} bytes of logs behind",
        ),
        *(
            [
                (
                    "remote_kv_copy",
                    f"{mib(g.remote_kv_copied_bytes)} MiB copied, {mib(g.remote_kv_copy_queued_bytes)} MiB waiting, "
                    f"{g.remote_kv_copy_skipped_blocks} blocks skipped",
                )
            ]
            if g.remote_on
            else []
        ),
        (
            "occupancy_mib",
            f"HBM {mib(g.hbm_used_bytes)}/{mib(g.hbm_capacity_bytes)}  "
            f"DDR {mib(g.ddr_used_bytes)}/{mib(g.ddr_capacity_bytes)}  SSD {mib(g.ssd_used_bytes)}",
        ),
        (
            "tokens_per_s",
            f"{t.tokens_per_s:.2f} (last {t.window_s:.0f}s; generated {t.generated_tokens_total}, "
            f"prefilled {t.prefill_tokens_total}; {t.steps_total} steps)",
        ),
        ("sessions", str(t.sessions)),
        (
            "in_flight",
            f"{t.active_requests + t.queued_requests} ({t.active_requests} running, {t.queued_requests} queued)",
        ),
        ("uptime", duration(stats.uptime_s)),
        ("draining", yes_no(stats.draining)),
        (
            "graphs",
            f"{stats.graphs.captures_total} captured ({stats.graphs.warm_graphs} warm in {stats.graphs.warm_s:.1f}s, "
            f"{stats.graphs.captures_after_ready} after ready, {stats.graphs.captures_ahead} of them ahead, "
            f"{stats.graphs.deferred} waiting); "
            f"{stats.graphs.replays_total} steps replayed, {stats.graphs.eager_steps_total} uncaptured while waiting",
        ),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


def cmd_stats(c: Client, args: argparse.Namespace) -> int:
    frames = Frames()
    try:
        while True:
            stats = c.call(c.h3.GetStats, pb.GetStatsRequest())
            if args.json:
                emit_json(to_dict(stats))
            else:
                frames.show(stats_text(stats))
            if not args.watch:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def top_frame(stats: Any, sessions: list[Any]) -> str:
    g, t = getattr(stats, "global"), stats.throughput
    header = [
        f"h3d  up {duration(stats.uptime_s)}  sessions {t.sessions}  in flight {t.active_requests + t.queued_requests}"
        f" ({t.queued_requests} queued)  tokens/s {t.tokens_per_s:.2f}" + ("  DRAINING" if stats.draining else ""),
        f"HBM {mib(g.hbm_used_bytes)}/{mib(g.hbm_capacity_bytes)} MiB  DDR {mib(g.ddr_used_bytes)}/"
        f"{mib(g.ddr_capacity_bytes)} MiB  SSD {mib(g.ssd_used_bytes)} MiB  dirty {mib(g.dirty_bytes)} MiB",
        f"hbm_hit_rate {g.hbm_hit_rate:.4f}  hbm_evict {g.hbm_evict_count}  ddr_evict {g.ddr_evict_count}  "
        f"ssd_read {g.ssd_read_count}  ssd_write {g.ssd_write_count}  "
        f"hbf p50/p99 {g.hbf_latency_us_p50:.1f}/{g.hbf_latency_us_p99:.1f} us",
    ]
    per = {s.session_id: s for s in stats.sessions}
    rows = []
    for s in sessions:
        st = per.get(s.session_id)
        res = st.residency if st is not None else s.residency
        hit = f"{st.hbm_hit_rate:.3f}" if st is not None else "-"
        itl = f"{st.itl_ms_p50:.1f}/{st.itl_ms_p99:.1f}" if st is not None and st.itl_ms_p50 > 0 else "-"
        share = st.hbm_share_blocks if st is not None and st.hbm_share_blocks else "-"
        rows.append(
            (
                s.session_id[:SESSION_PREFIX],
                f"{s.policy}/{s.window_tokens}",
                s.num_tokens,
                res.hbm_blocks,
                share,
                res.ddr_blocks,
                res.ssd_blocks,
                hit,
                itl,
                "busy" if s.busy else "-",
            )
        )
    columns = ("SESSION", "POLICY/WINDOW", "TOKENS", "HBM", "HBM SHARE", "DDR", "SSD", "HIT", "ITL P50/P99 MS", "BUSY")
    body = table(columns, rows, left=2)
    return "\n".join(header) + "\n\n" + body


class Keys:
    """Key presses on stdin while `top` runs, when stdin is a terminal: it is put in cbreak mode
    (no echo, no line buffering; Ctrl-C still interrupts) and restored on exit, however `top` ends.
    When stdin is not a terminal nothing is read: `wait` only sleeps."""

    QUIT = frozenset(b"qQ")

    def __init__(self) -> None:
        self.fd: int | None = None  # the terminal, while in cbreak mode
        self.saved: list[Any] | None = None
        self.reading = False

    def __enter__(self) -> Keys:
        try:
            fd = sys.stdin.fileno()
            if os.isatty(fd):
                self.saved = termios.tcgetattr(fd)
                tty.setcbreak(fd)
                self.fd, self.reading = fd, True
        except (AttributeError, OSError, ValueError, termios.error):
            pass  # no usable stdin (none, closed): Ctrl-C only
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None and self.saved is not None:
            with contextlib.suppress(termios.error):  # the terminal may be gone
                termios.tcsetattr(self.fd, termios.TCSADRAIN, self.saved)
        self.fd, self.reading = None, False

    def wait(self, seconds: float) -> bool:
        """Sleep `seconds`, or less if `q` is pressed: then True."""
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            if self.fd is None or not self.reading:
                time.sleep(left)
                return False
            if not select.select([self.fd], [], [], left)[0]:
                continue
            data = os.read(self.fd, 64)
            if not data:  # end of input (the terminal hung up): sleep from now on
                self.reading = False
            elif self.QUIT.intersection(data):
                return True
        return False


def cmd_top(c: Client, args: argparse.Namespace) -> int:
    frames = Frames()
    if args.once:
        stats = c.call(c.h3.GetStats, pb.GetStatsRequest())
        frames.show(top_frame(stats, list_sessions(c)))
        return 0
    try:
        with Keys() as keys:
            footer = f"every {args.interval:g}s; " + ("q quits" if keys.reading else "Ctrl-C quits")
            while True:
                stats = c.call(c.h3.GetStats, pb.GetStatsRequest())
                frames.show(top_frame(stats, list_sessions(c)) + "\n\n" + footer)
                if keys.wait(args.interval):
                    return 0
    except KeyboardInterrupt:
        return 0


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`health`, `stats` and `top`."""
    c = sub.add_parser("health", help="is the daemon serving?")
    c.set_defaults(func=cmd_health)

    c = sub.add_parser("stats", help="tier figures and throughput")
    c.add_argument("--watch", action="store_true", help="refresh until Ctrl-C")
    c.add_argument(
        "--interval", type=positive, default=DEFAULT_INTERVAL_S, metavar="S", help="seconds between refreshes"
    )
    c.set_defaults(func=cmd_stats)

    c = sub.add_parser(
        "top",
        help="live view of the daemon and its sessions (q quits)",
        description="A frame per interval: global figures, one row per session (ids: their first 12 digits, "
        "which every command takes). On a terminal q quits; otherwise Ctrl-C.",
    )
    c.add_argument("--interval", type=positive, default=DEFAULT_INTERVAL_S, metavar="S", help="seconds between frames")
    c.add_argument("--once", action="store_true", help="print one frame and exit")
    c.set_defaults(func=cmd_top)
