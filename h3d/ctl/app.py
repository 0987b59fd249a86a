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

This module holds the global options, the parser (each command group's `add_parsers` adds its
commands) and `main`: an ID is resolved to a full id before its command runs, and every error
becomes its exit code here.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

import grpc

from h3d.ctl import admin, sessions, stats, streams
from h3d.ctl.client import DEFAULT_SOCKET, SOCKET_ENV, Client, NoSuchSession, UsageError, connect
from h3d.ctl.options import positive
from h3d.ctl.output import report
from h3d.ctl.sessions import resolve_id

DEFAULT_TIMEOUT_S = 30.0
# What grpc itself says when the connection fails or is lost (the daemon's own UNAVAILABLE is "draining").
TRANSPORT_ERRORS = ("failed to connect", "connection refused", "no such file", "socket closed", "connection reset")


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

    # The commands in the order `h3ctl --help` lists them.
    for group in (stats, sessions, streams, admin):
        group.add_parsers(sub)
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
