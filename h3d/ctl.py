"""`h3ctl`: the operator's command line for a running `h3d serve` (gRPC, `h3.v1`).

    h3ctl [--socket PATH | --address HOST:PORT [--tls-ca FILE]] [--token-file PATH] [--json] [--timeout S] COMMAND

    health                                   SERVING or NOT_SERVING (exit 0 only when serving)
    stats [--watch] [--interval S]           the tiers' figures and throughput (GetStats)
    top [--interval S] [--once]              live view: global figures, one row per session (q quits)
    session create [--chat] [--system TEXT] [--policy P]
    session list                             every session (all pages of ListSessions)
    session show ID [--with-tokens]          tokens, KV blocks per tier (per layer), chat messages
    session close ID [--purge]
    append ID (--text TEXT | --file PATH) [--role user|assistant|system]
                                             add to a session's context (progress on stderr); the
                                             role: chat sessions only, default user
    generate ID --prompt TEXT [--max-tokens N] [--temperature T] [--top-p P] [--top-k K] [--seed S] [--stop S]...
                                             (chat session: the prompt is appended as a user message)
    evict ID --to ddr|ssd                    move a session's KV down a tier (H3Admin)
    pin ID [--ttl S | --unpin]               keep a session's KV in HBM (H3Admin)
    policy ID P                              switch a session's HBF policy (H3Admin)
    drain [--timeout S]                      stop taking requests, let those in flight end (H3Admin)
    resume                                   undo a drain: take requests again (H3Admin)
    config                                   the daemon's effective configuration (H3Admin)

The daemon is found at `--socket` (default `$H3D_SOCKET`, else /run/h3d/h3d.sock) or over TCP at
`--address` (TLS with `--tls-ca`). `--token-file` holds the bearer token sent with every call.
`--timeout` bounds each unary call (streams have no deadline).

An ID is a session's 32 hex digits or any prefix of them that names one session (as `top`'s
12-digit ids): a prefix is looked up with ListSessions, a full id is sent as is.

Output: human-readable by default; with `--json` one single-line JSON object per command on stdout
(`stats --watch`: one per refresh). Exit codes: 0 success; 1 the daemon answered with an error
(`h3ctl: error: CODE: message` on stderr, or `{"error": {"code", "message"}}` with `--json`) or
cannot be reached, or no session has the ID given (NOT_FOUND); 2 usage errors, among them an ID
prefix that several sessions share (`h3ctl: error: ambiguous session prefix ...`, listing them);
130 interrupted during a stream.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import select
import sys
import termios
import time
import tty
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc
from google.protobuf import json_format
from google.protobuf.message import Message
from grpc_health.v1 import health_pb2, health_pb2_grpc

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d._proto.h3.v1 import h3_pb2_grpc as rpc

DEFAULT_SOCKET = "/run/h3d/h3d.sock"
SOCKET_ENV = "H3D_SOCKET"
DEFAULT_TIMEOUT_S = 30.0
DEFAULT_INTERVAL_S = 2.0
LIST_PAGE_SIZE = 500
PROGRESS_MIN_TOKENS = 256  # appends shorter than this show no progress
PROGRESS_WIDTH = 30
SESSION_PREFIX = 12  # the digits of an id that `top` shows
SESSION_ID = re.compile(r"[0-9a-f]{32}")  # a full id: sent as is, without a lookup
AMBIGUOUS_SHOWN = 10  # matches listed in the error for an ambiguous prefix
ID_HELP = "the session's id, or a prefix of it that no other session's id has"
ROLES = ("user", "assistant", "system")
MIB = 1024 * 1024
CLEAR = "\x1b[H\x1b[2J"
TIERS = {"ddr": pb.TIER_DDR, "ssd": pb.TIER_SSD}
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
# What grpc itself says when the connection fails or is lost (the daemon's own UNAVAILABLE is "draining").
TRANSPORT_ERRORS = ("failed to connect", "connection refused", "no such file", "socket closed", "connection reset")
# The daemon answers within the drain timeout plus this (it cancels what is left, then waits up to 10 s).
DRAIN_GRACE_S = 15.0


class UsageError(Exception):
    """A usage problem found after parsing (a bad file, conflicting options, an ambiguous id): exit 2."""


class NoSuchSession(Exception):
    """No session has the id (or id prefix) given: reported as NOT_FOUND, exit 1."""


class Client:
    """One channel to the daemon, the stubs over it, and what every call carries."""

    def __init__(self, target: str, channel: grpc.Channel, token: str | None, timeout: float) -> None:
        self.target = target
        self.channel = channel
        self.timeout = timeout
        self.metadata: tuple[tuple[str, str], ...] = (("authorization", f"Bearer {token}"),) if token else ()
        self.h3 = rpc.H3Stub(channel)
        self.admin = rpc.H3AdminStub(channel)
        self.health = health_pb2_grpc.HealthStub(channel)

    def call(
        self, method: Callable[..., Any], request: Message, timeout: float | None = None, unbounded: bool = False
    ) -> Any:
        """A unary call with the token and a deadline: `timeout`, else `--timeout`; none if `unbounded`."""
        deadline = None if unbounded else (timeout if timeout is not None else self.timeout)
        return method(request, timeout=deadline, metadata=self.metadata)

    def stream(self, method: Callable[..., Any], request: Message) -> Any:
        """A server-streaming call (no deadline); iterate it, `.cancel()` it."""
        return method(request, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()  # cancels the calls still in flight


# ---- small helpers -----------------------------------------------------------------------------


def to_dict(message: Message) -> dict[str, Any]:
    """A message as JSON-ready data: proto field names, fields at their defaults included, 64-bit
    integers as numbers."""
    return json_format.MessageToDict(
        message,
        preserving_proto_field_name=True,
        always_print_fields_with_no_presence=True,
        unquote_int64_if_possible=True,
    )


def emit_json(obj: Any) -> None:
    print(json.dumps(obj, ensure_ascii=False), flush=True)


def mib(n: int) -> str:
    return f"{n / MIB:.1f}"


def when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t)) if t > 0 else "-"


def duration(seconds: float) -> str:
    s = int(seconds)
    if s < 60:
        return f"{seconds:.1f}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def yes_no(flag: bool) -> str:
    return "yes" if flag else "no"


def finish_name(reason: int) -> str:
    return pb.FinishReason.Name(reason).removeprefix("FINISH_REASON_").lower()


def table(headers: Sequence[str], rows: Sequence[Sequence[object]], left: int = 1) -> str:
    """Columns padded to their widest cell; the first `left` columns left-aligned, the rest right."""
    cells = [[str(c) for c in headers], *[[str(c) for c in row] for row in rows]]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = []
    for row in cells:
        parts = [c.ljust(w) if i < left else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]
        lines.append("  ".join(parts).rstrip())
    return "\n".join(lines)


def read_token(path: str) -> str:
    """The first non-blank line of the file that is not a `#` comment."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"cannot read the token file {path}: {_reason(exc)}") from None
    for line in lines:
        token = line.strip()
        if token and not token.startswith("#"):
            return token
    raise UsageError(f"the token file {path} holds no token")


def read_text(path: str) -> str:
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        raise UsageError(f"cannot read {path}: {_reason(exc)}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{path} is not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start})") from None


def _reason(exc: BaseException) -> str:
    return (exc.strerror if isinstance(exc, OSError) else None) or str(exc)


def connect(args: argparse.Namespace) -> Client:
    if args.socket is not None and args.address is not None:
        raise UsageError("give --socket or --address, not both")
    if args.tls_ca is not None and args.address is None:
        raise UsageError("--tls-ca needs --address (the Unix socket has no TLS)")
    token = read_token(args.token_file) if args.token_file is not None else None
    if args.address is not None:
        target = args.address
        if args.tls_ca is not None:
            try:
                ca = Path(args.tls_ca).read_bytes()
            except OSError as exc:
                raise UsageError(f"cannot read the CA file {args.tls_ca}: {_reason(exc)}") from None
            channel = grpc.secure_channel(target, grpc.ssl_channel_credentials(root_certificates=ca))
        else:
            channel = grpc.insecure_channel(target)
    else:
        path = args.socket or os.environ.get(SOCKET_ENV) or DEFAULT_SOCKET
        target = f"unix:{path}"
        channel = grpc.insecure_channel(target)
    return Client(target, channel, token, args.timeout)


# ---- health, stats, top ------------------------------------------------------------------------


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
        ("hbf_latency_us", f"p50 {g.hbf_latency_us_p50:.1f}  p99 {g.hbf_latency_us_p99:.1f}"),
        (
            "occupancy_mib",
            f"HBM {mib(g.hbm_used_bytes)}/{mib(g.hbm_capacity_bytes)}  "
            f"DDR {mib(g.ddr_used_bytes)}/{mib(g.ddr_capacity_bytes)}  SSD {mib(g.ssd_used_bytes)}",
        ),
        (
            "tokens_per_s",
            f"{t.tokens_per_s:.2f} (last {t.window_s:.0f}s; generated {t.generated_tokens_total}, "
            f"prefilled {t.prefill_tokens_total})",
        ),
        ("sessions", str(t.sessions)),
        (
            "in_flight",
            f"{t.active_requests + t.queued_requests} ({t.active_requests} running, {t.queued_requests} queued)",
        ),
        ("uptime", duration(stats.uptime_s)),
        ("draining", yes_no(stats.draining)),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)


class Frames:
    """Successive views on stdout: redrawn in place on a terminal, else separated by a blank line."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.count = 0

    def show(self, text: str) -> None:
        if self.tty:
            sys.stdout.write(CLEAR + text + "\n")
        else:
            sys.stdout.write(("\n" if self.count else "") + text + "\n")
        sys.stdout.flush()
        self.count += 1


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


def list_sessions(c: Client) -> list[Any]:
    sessions: list[Any] = []
    token = ""
    while True:
        resp = c.call(c.h3.ListSessions, pb.ListSessionsRequest(page_size=LIST_PAGE_SIZE, page_token=token))
        sessions.extend(resp.sessions)
        if not resp.next_page_token or resp.next_page_token == token:
            return sessions
        token = resp.next_page_token


def resolve_id(c: Client, given: str) -> str:
    """The full id of the session that `given` names: a full id as is, else the one session whose id
    starts with it (ListSessions, every page). NoSuchSession if none does; UsageError if several do."""
    prefix = given.strip().lower()
    if SESSION_ID.fullmatch(prefix):
        return prefix
    if not prefix:
        raise UsageError("an empty session id")
    matches = sorted(s.session_id for s in list_sessions(c) if s.session_id.startswith(prefix))
    if not matches:
        raise NoSuchSession(f"no session with an id starting with {given!r}")
    if len(matches) > 1:
        shown = ", ".join(matches[:AMBIGUOUS_SHOWN])
        more = f" and {len(matches) - AMBIGUOUS_SHOWN} more" if len(matches) > AMBIGUOUS_SHOWN else ""
        raise UsageError(f"ambiguous session prefix {given!r}: matches {shown}{more} (give more of the id)")
    return matches[0]


def top_frame(stats: Any, sessions: list[Any]) -> str:
    g, t = getattr(stats, "global"), stats.throughput
    header = [
        f"h3d  up {duration(stats.uptime_s)}  sessions {t.sessions}  in flight {t.active_requests + t.queued_requests}"
        f" ({t.queued_requests} queued)  tokens/s {t.tokens_per_s:.2f}" + ("  DRAINING" if stats.draining else ""),
        f"HBM {mib(g.hbm_used_bytes)}/{mib(g.hbm_capacity_bytes)} MiB  DDR {mib(g.ddr_used_bytes)}/"
        f"{mib(g.ddr_capacity_bytes)} MiB  SSD {mib(g.ssd_used_bytes)} MiB",
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
        rows.append(
            (
                s.session_id[:SESSION_PREFIX],
                f"{s.policy}/{s.window_tokens}",
                s.num_tokens,
                res.hbm_blocks,
                res.ddr_blocks,
                res.ssd_blocks,
                hit,
                "busy" if s.busy else "-",
            )
        )
    body = table(("SESSION", "POLICY/WINDOW", "TOKENS", "HBM", "DDR", "SSD", "HIT", "BUSY"), rows, left=2)
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


# ---- sessions ----------------------------------------------------------------------------------


def tokens_text(s: Any) -> str:
    if s.num_tokens == 0:
        return "0"
    if s.cached_tokens >= s.num_tokens:
        return f"{s.num_tokens} ({s.cached_tokens} with KV computed)"
    rest = s.num_tokens - s.cached_tokens
    return f"{s.num_tokens} ({s.cached_tokens} with KV computed, {rest} to compute at the next request)"


def layer_bounds(s: Any, block_size: int) -> tuple[int, int] | None:
    """The model's layer count L as far as one session's residency bounds it: its KV is
    nb = ceil(cached_tokens / block_size) blocks in every layer, each with a copy in at least one
    tier and at most one in each, so max(tier) <= L * nb <= sum(tiers). None when it says nothing
    (no KV, or busy: its blocks may be changing)."""
    nb = math.ceil(s.cached_tokens / block_size)
    if nb == 0 or s.busy:
        return None
    r = s.residency
    counts = (r.hbm_blocks, r.ddr_blocks, r.ssd_blocks)
    return math.ceil(max(counts) / nb), sum(counts) // nb


def layers_of(sessions: Sequence[Any], block_size: int) -> int | None:
    """The layer count where the sessions' residencies decide it (every session has the same
    model's layers); None where they leave it open."""
    low, high = 1, UINT64_MAX
    for s in sessions:
        bounds = layer_bounds(s, block_size)
        if bounds is not None:
            low, high = max(low, bounds[0]), min(high, bounds[1])
    return low if low == high else None


def per_layer(n: int, layers: int) -> str:
    return str(n // layers) if n % layers == 0 else f"{n / layers:.1f}"


def kv_rows(s: Any, block_size: int | None, layers: int | None) -> list[tuple[str, str]]:
    """Where the session's KV is, in words: TierResidency counts block copies (a block is
    block_size tokens of one layer) summed over the layers."""
    r = s.residency
    counts = f"HBM {r.hbm_blocks}, DDR {r.ddr_blocks}, SSD {r.ssd_blocks} block copies"
    if block_size is None:
        return [("residency", f"{counts} (all layers together; a block holds block_size tokens of one layer)")]
    nb = math.ceil(s.cached_tokens / block_size)
    if nb == 0:
        blocks = "none" + (" yet (the next request computes them)" if s.num_tokens else "")
    else:
        blocks = f"{nb} per layer ({block_size} tokens each)"
        blocks += f" x {layers} layers = {nb * layers}" if layers is not None else ", in every layer"
    if layers is not None:
        where = f"{counts} (all layers); per layer HBM {per_layer(r.hbm_blocks, layers)}, "
        where += f"DDR {per_layer(r.ddr_blocks, layers)}, SSD {per_layer(r.ssd_blocks, layers)}"
    else:
        where = f"{counts} (all layers together)"
    return [("kv_blocks", blocks), ("residency", where)]


def session_text(s: Any, block_size: int | None = None, layers: int | None = None) -> str:
    sp = s.sampling
    sampling = f"max_tokens {sp.max_tokens}  temperature {sp.temperature:g}  top_p {sp.top_p:g}  top_k {sp.top_k}"
    if sp.HasField("seed"):
        sampling += f"  seed {sp.seed}"
    if sp.stop:
        sampling += f"  stop {list(sp.stop)!r}"
    if sp.stop_token_ids:
        sampling += f"  stop_token_ids {list(sp.stop_token_ids)}"
    if sp.ignore_eos:
        sampling += "  ignore_eos"
    pinned = "no"
    if s.pinned:
        pinned = f"until {when(s.pinned_until)}" if s.pinned_until else "yes (until unpinned)"
    rows = [
        ("session_id", s.session_id),
        ("tokens", tokens_text(s)),
        *kv_rows(s, block_size, layers),
        ("chat", f"yes, {s.num_messages} message{'' if s.num_messages == 1 else 's'}" if s.chat else "no"),
        ("policy", f"{s.policy} (window {s.window_tokens} tokens)"),
        ("created_at", when(s.created_at)),
        ("last_used_at", when(s.last_used_at)),
        ("busy", yes_no(s.busy)),
        ("closed", yes_no(s.closed) + (" (its next request reopens it)" if s.closed else "")),
        ("pinned", pinned),
        ("sampling", sampling),
    ]
    width = max(len(k) for k, _ in rows)
    out = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    if s.token_ids:
        out += f"\ntoken_ids ({len(s.token_ids)}):\n{' '.join(map(str, s.token_ids))}\ntext:\n{s.text}"
    return out


def cmd_session_create(c: Client, args: argparse.Namespace) -> int:
    req = pb.CreateSessionRequest(system_prompt=args.system or "", policy=args.policy or "", chat=args.chat)
    s = c.call(c.h3.CreateSession, req)
    if args.json:
        emit_json(to_dict(s))
    else:
        print(s.session_id)
    return 0


def cmd_session_list(c: Client, args: argparse.Namespace) -> int:
    sessions = list_sessions(c)
    if args.json:
        emit_json({"sessions": [to_dict(s) for s in sessions], "total": len(sessions)})
        return 0
    if not sessions:
        print("no sessions")
        return 0
    rows = [
        (
            s.session_id,
            s.policy,
            s.num_tokens,
            s.cached_tokens,
            f"{s.residency.hbm_blocks}/{s.residency.ddr_blocks}/{s.residency.ssd_blocks}",
            when(s.created_at),
            when(s.last_used_at),
            " ".join(
                flag
                for flag, on in (("chat", s.chat), ("busy", s.busy), ("pinned", s.pinned), ("closed", s.closed))
                if on
            )
            or "-",
        )
        for s in sessions
    ]
    headers = ("SESSION", "POLICY", "TOKENS", "CACHED", "HBM/DDR/SSD", "CREATED", "LAST USED", "FLAGS")
    print(table(headers, rows, left=2))
    return 0


def block_size_of(c: Client) -> int | None:
    """The daemon's block_size (GetConfig); None where it is refused (a client token) or lacking."""
    try:
        config = json.loads(c.call(c.admin.GetConfig, pb.GetConfigRequest()).json)
    except (grpc.RpcError, ValueError):
        return None
    size = config.get("block_size") if isinstance(config, dict) else None
    return size if isinstance(size, int) and size > 0 else None


def cmd_session_show(c: Client, args: argparse.Namespace) -> int:
    s = c.call(c.h3.GetSession, pb.GetSessionRequest(session_id=args.id, with_tokens=args.with_tokens))
    if args.json:
        emit_json(to_dict(s))
        return 0
    block_size = block_size_of(c)
    layers = None
    if block_size is not None:
        # No call tells the layer count: the residencies do (this session's, else all of them).
        layers = layers_of([s], block_size)
        if layers is None and math.ceil(s.cached_tokens / block_size) > 0:
            layers = layers_of([s, *list_sessions(c)], block_size)
    print(session_text(s, block_size, layers))
    return 0


def cmd_session_close(c: Client, args: argparse.Namespace) -> int:
    c.call(c.h3.CloseSession, pb.CloseSessionRequest(session_id=args.id, purge=args.purge))
    if args.json:
        emit_json({"session_id": args.id, "closed": True, "purge": args.purge})
    else:
        print(f"{'purged' if args.purge else 'closed'} {args.id}")
    return 0


# ---- append, generate --------------------------------------------------------------------------


class Progress:
    """Prefill progress on stderr: a bar redrawn in place on a terminal, else a line per quarter."""

    def __init__(self, enabled: bool, out: TextIO) -> None:
        self.enabled = enabled
        self.out = out
        self.tty = out.isatty()
        self.shown = False
        self.quarter = 0

    def update(self, done: int, total: int) -> None:
        if not self.enabled or total < PROGRESS_MIN_TOKENS:
            return
        if self.tty:
            filled = PROGRESS_WIDTH * done // total
            bar = "#" * filled + "." * (PROGRESS_WIDTH - filled)
            self.out.write(f"\r[{bar}] {done}/{total} tokens")
        else:
            quarter = 4 * done // total
            if quarter <= self.quarter:
                return
            self.quarter = quarter
            self.out.write(f"prefill: {done}/{total} tokens\n")
        self.out.flush()
        self.shown = True

    def end(self) -> None:
        if self.shown and self.tty:
            self.out.write("\n")
            self.out.flush()
        self.shown = False


def consume(call: Any) -> Iterator[Any]:
    """The responses of a stream; Ctrl-C cancels the call (the daemon then cancels the request)."""
    try:
        yield from call
    except KeyboardInterrupt:
        call.cancel()
        raise


def cmd_append(c: Client, args: argparse.Namespace) -> int:
    text = args.text if args.file is None else read_text(args.file)
    progress = Progress(enabled=not args.json or sys.stderr.isatty(), out=sys.stderr)
    summary = None
    req = pb.AppendContextRequest(session_id=args.id, text=text, role=args.role or "")  # role: only when given
    try:
        for resp in consume(c.stream(c.h3.AppendContext, req)):
            which = resp.WhichOneof("event")
            if which == "progress":
                progress.update(resp.progress.tokens_done, resp.progress.tokens_total)
            elif which == "done":
                summary = resp.done
    finally:
        progress.end()
    if summary is None:
        return stream_ended(args)
    if args.json:
        emit_json({"session_id": args.id, **to_dict(summary)})
    else:
        print(
            f"appended {summary.tokens_added} tokens in {summary.prefill_s:.3f} s "
            f"(the context holds {summary.num_tokens} tokens)"
        )
    return 0


def stream_ended(args: argparse.Namespace) -> int:
    report("UNKNOWN", "the stream ended without its summary", args.json)
    return 1


def sampling_of(args: argparse.Namespace) -> Any:
    """Only what the user gave: unset fields take the session's defaults."""
    sp = pb.SamplingParams()
    for name in ("max_tokens", "temperature", "top_p", "top_k", "seed"):
        value = getattr(args, name)
        if value is not None:
            setattr(sp, name, value)
    sp.stop.extend(args.stop or [])
    return sp


def cmd_generate(c: Client, args: argparse.Namespace) -> int:
    req = pb.GenerateRequest(session_id=args.id, prompt=args.prompt, sampling=sampling_of(args))
    parts: list[str] = []
    ids: list[int] = []
    summary = None
    try:
        for resp in consume(c.stream(c.h3.Generate, req)):
            which = resp.WhichOneof("event")
            if which == "delta":
                parts.append(resp.delta.text)
                ids.extend(resp.delta.token_ids)
                if not args.json and resp.delta.text:
                    sys.stdout.write(resp.delta.text)
                    sys.stdout.flush()
            elif which == "done":
                summary = resp.done
    finally:
        if not args.json and (parts or summary is not None):
            sys.stdout.write("\n")
            sys.stdout.flush()
    if summary is None:
        return stream_ended(args)
    if args.json:
        emit_json(
            {
                "session_id": args.id,
                "text": "".join(parts),
                "token_ids": ids,
                "finish_reason": finish_name(summary.finish_reason),
                "prompt_tokens": summary.prompt_tokens,
                "completion_tokens": summary.completion_tokens,
                "ttft_s": summary.ttft_s,
                "tokens_per_s": summary.tokens_per_s,
                "residency": to_dict(summary.residency),
            }
        )
    elif summary.finish_reason == pb.FINISH_REASON_CANCELLED:
        print(
            "h3ctl: the generation was cancelled (the daemon is draining, or the session was closed)", file=sys.stderr
        )
    return 0


# ---- H3Admin -----------------------------------------------------------------------------------


def cmd_evict(c: Client, args: argparse.Namespace) -> int:
    resp = c.call(c.admin.EvictSession, pb.EvictSessionRequest(session_id=args.id, to=TIERS[args.to]))
    if args.json:
        emit_json({"session_id": args.id, **to_dict(resp)})
    else:
        r = resp.residency
        print(
            f"moved {resp.blocks_moved} block copies to {args.to.upper()}; "
            f"now HBM {r.hbm_blocks}  DDR {r.ddr_blocks}  SSD {r.ssd_blocks} blocks"
        )
    return 0


def cmd_pin(c: Client, args: argparse.Namespace) -> int:
    req = pb.PinSessionRequest(session_id=args.id, ttl_s=args.ttl or 0.0, unpin=args.unpin)
    s = c.call(c.admin.PinSession, req)
    if args.json:
        emit_json(to_dict(s))
    elif not s.pinned:
        print(f"unpinned {s.session_id}")
    elif s.pinned_until:
        print(f"pinned {s.session_id} until {when(s.pinned_until)}")
    else:
        print(f"pinned {s.session_id} until unpinned")
    return 0


def cmd_policy(c: Client, args: argparse.Namespace) -> int:
    s = c.call(c.admin.SetPolicy, pb.SetPolicyRequest(session_id=args.id, policy=args.policy))
    if args.json:
        emit_json(to_dict(s))
    else:
        print(f"{s.session_id}: policy {s.policy}")
    return 0


def cmd_drain(c: Client, args: argparse.Namespace) -> int:
    # The daemon answers once the drain is over: allow for it on top of --timeout (no deadline when
    # the daemon's own drain_timeout_s applies, which it bounds).
    wait = args.drain_timeout
    deadline = None if wait is None else c.timeout + wait + DRAIN_GRACE_S
    resp = c.call(c.admin.Drain, pb.DrainRequest(timeout_s=wait or 0.0), timeout=deadline, unbounded=deadline is None)
    if args.json:
        emit_json(to_dict(resp))
    else:
        print(
            f"draining: {resp.requests_finished} requests finished, {resp.requests_cancelled} cancelled; "
            "the daemon takes no new requests"
        )
    return 0


def cmd_resume(c: Client, args: argparse.Namespace) -> int:
    resp = c.call(c.admin.Resume, pb.ResumeRequest())
    if args.json:
        emit_json(to_dict(resp))
    elif resp.was_draining:
        print("resumed: the daemon was draining; it takes requests again")
    else:
        print("the daemon was not draining: nothing to resume")
    return 0


def cmd_config(c: Client, args: argparse.Namespace) -> int:
    resp = c.call(c.admin.GetConfig, pb.GetConfigRequest())
    config = json.loads(resp.json)
    if args.json:
        emit_json(config)
    else:
        print(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False))
    return 0


# ---- errors ------------------------------------------------------------------------------------


def report(code: str, message: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps({"error": {"code": code, "message": message}}, ensure_ascii=False), file=sys.stderr)
    else:
        print(f"h3ctl: error: {code}: {message}", file=sys.stderr)


def rpc_failed(exc: grpc.RpcError, c: Client, args: argparse.Namespace) -> int:
    code_obj = exc.code() if isinstance(exc, grpc.Call) else None
    code = code_obj.name if code_obj is not None else "UNKNOWN"
    details = (exc.details() if isinstance(exc, grpc.Call) else None) or str(exc)
    if code == "UNAVAILABLE" and any(m in details.lower() for m in TRANSPORT_ERRORS):
        details = f"cannot reach the daemon at {c.target}: is h3d running? ({details})"
    elif code == "DEADLINE_EXCEEDED":
        details = f"no answer from the daemon at {c.target} within {c.timeout:g} s (--timeout)"
    elif code == "UNAUTHENTICATED" and not c.metadata:
        details += " (give the token with --token-file)"
    report(code, details, args.json)
    return 1


# ---- arguments ---------------------------------------------------------------------------------


def _number(kind: type, low: float, high: float = math.inf, low_open: bool = False) -> Callable[[str], Any]:
    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
        ok = (value > low if low_open else value >= low) and value <= high and not math.isnan(value)
        if not ok:
            bound = f"> {low:g}" if low_open else f">= {low:g}"
            raise argparse.ArgumentTypeError(f"must be {bound}" + (f" and <= {high:g}" if high != math.inf else ""))
        return value

    parse.__name__ = kind.__name__  # argparse's "invalid <name> value"
    return parse


positive = _number(float, 0.0, low_open=True)
non_negative = _number(float, 0.0)
uint32 = _number(int, 0, UINT32_MAX)
uint64 = _number(int, 0, UINT64_MAX)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="h3ctl",
        description="Operate a running h3d daemon (sessions, generation, tiers, stats).",
        epilog="Global options go before the command. An ID may be any prefix that names one session. "
        "Exit codes: 0 ok, 1 error from (or no) daemon or no such session, 2 usage (an ambiguous ID among them).",
    )
    p.add_argument("--socket", metavar="PATH", help=f"Unix socket (default: ${SOCKET_ENV}, else {DEFAULT_SOCKET})")
    p.add_argument("--address", metavar="HOST:PORT", help="reach the daemon over TCP instead")
    p.add_argument("--tls-ca", metavar="FILE", help="with --address: use TLS, trusting this CA certificate (PEM)")
    p.add_argument("--token-file", metavar="PATH", help="file holding the bearer token (first non-comment line)")
    p.add_argument("--json", action="store_true", help="print one JSON object per command")
    p.add_argument(
        "--timeout", type=positive, default=DEFAULT_TIMEOUT_S, metavar="S", help="deadline of each unary call"
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

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

    session = sub.add_parser("session", help="create, list, show, close sessions")
    ss = session.add_subparsers(dest="session_command", required=True, metavar="ACTION")
    c = ss.add_parser("create", help="open a session; prints its id")
    c.add_argument(
        "--chat",
        action="store_true",
        help="a chat session: appends are messages rendered through the model's chat template",
    )
    c.add_argument("--system", metavar="TEXT", help="system prompt (in a chat session: its system message)")
    c.add_argument("--policy", metavar="P", help="HBF policy (attention_entropy, exact, fixed, layerwise)")
    c.set_defaults(func=cmd_session_create)
    c = ss.add_parser("list", help="every session")
    c.set_defaults(func=cmd_session_list)
    c = ss.add_parser("show", help="one session: tokens, KV blocks per tier and per layer, flags")
    c.add_argument("id", metavar="ID", help=ID_HELP)
    c.add_argument("--with-tokens", action="store_true", help="include the whole context (ids and text)")
    c.set_defaults(func=cmd_session_show)
    c = ss.add_parser("close", help="close a session, freeing its KV")
    c.add_argument("id", metavar="ID", help=ID_HELP)
    c.add_argument(
        "--purge",
        action="store_true",
        help="delete it now, token log and archived KV (without: closed, kept on disk, reopened when used)",
    )
    c.set_defaults(func=cmd_session_close)

    c = sub.add_parser("append", help="add text to a session's context (a message to a chat session)")
    c.add_argument("id", metavar="ID", help=ID_HELP)
    src = c.add_mutually_exclusive_group(required=True)
    src.add_argument("--text", metavar="TEXT", help="the text to append")
    src.add_argument("--file", metavar="PATH", help="UTF-8 text file")
    c.add_argument(
        "--role",
        choices=ROLES,
        help="chat sessions only: the message's role (default: user, the daemon's)",
    )
    c.set_defaults(func=cmd_append)

    c = sub.add_parser("generate", help="generate, continuing a session's context")
    c.add_argument("id", metavar="ID", help=ID_HELP)
    c.add_argument(
        "--prompt",
        required=True,
        metavar="TEXT",
        help='appended first (a chat session: as a user message); "" continues the context',
    )
    c.add_argument("--max-tokens", type=uint32, metavar="N")
    c.add_argument("--temperature", type=non_negative, metavar="T", help="0 is greedy")
    c.add_argument("--top-p", type=_number(float, 0.0, 1.0, low_open=True), metavar="P")
    c.add_argument("--top-k", type=uint32, metavar="K", help="0 keeps every token")
    c.add_argument("--seed", type=uint64, metavar="S")
    c.add_argument("--stop", action="append", metavar="S", help="stop string (repeatable)")
    c.set_defaults(func=cmd_generate)

    c = sub.add_parser("evict", help="move a session's KV down to DDR or the SSD archive")
    c.add_argument("id", metavar="ID", help=ID_HELP)
    c.add_argument("--to", required=True, choices=sorted(TIERS))
    c.set_defaults(func=cmd_evict)

    c = sub.add_parser("pin", help="keep a session's KV in HBM")
    c.add_argument("id", metavar="ID", help=ID_HELP)
    how = c.add_mutually_exclusive_group()
    how.add_argument("--ttl", type=positive, metavar="S", help="seconds (default: until unpinned)")
    how.add_argument("--unpin", action="store_true", help="remove the pin")
    c.set_defaults(func=cmd_pin)

    c = sub.add_parser("policy", help="switch a session's HBF policy")
    c.add_argument("id", metavar="ID", help=ID_HELP)
    c.add_argument("policy", metavar="P", help="attention_entropy, exact, fixed or layerwise")
    c.set_defaults(func=cmd_policy)

    c = sub.add_parser("drain", help="stop taking requests; wait for those in flight, cancel the rest")
    c.add_argument(
        "--timeout", dest="drain_timeout", type=positive, metavar="S", help="default: the daemon's drain_timeout_s"
    )
    c.set_defaults(func=cmd_drain)

    c = sub.add_parser("resume", help="undo a drain: take requests again (says whether it was draining)")
    c.set_defaults(func=cmd_resume)

    c = sub.add_parser("config", help="the daemon's effective configuration")
    c.set_defaults(func=cmd_config)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        client = connect(args)
    except UsageError as exc:
        print(f"h3ctl: error: {exc}", file=sys.stderr)
        return 2
    try:
        if getattr(args, "id", None) is not None:
            args.id = resolve_id(client, args.id)
        code: int = args.func(client, args)
        return code
    except UsageError as exc:
        print(f"h3ctl: error: {exc}", file=sys.stderr)
        return 2
    except NoSuchSession as exc:
        report("NOT_FOUND", str(exc), args.json)
        return 1
    except grpc.RpcError as exc:
        return rpc_failed(exc, client, args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        # The reader went away (`h3ctl ... | head`): say nothing more.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    finally:
        client.close()


if __name__ == "__main__":
    sys.exit(main())
