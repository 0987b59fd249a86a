"""`h3ctl session create|fork|list|show|close`, and the session lookups other commands use: all pages of
ListSessions (`list_sessions`) and an ID prefix to the one full id it names (`resolve_id`).

- A full id (32 hex digits) is sent as is, without a lookup; a prefix that no session's id has is
  `NoSuchSession` (exit 1), one that several share a `UsageError` (exit 2) listing them.
- `session show` tells the KV blocks per layer only where the daemon's block_size (GetConfig) and
  the sessions' residencies decide the layer count; otherwise it says the sums are over the layers.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Sequence
from typing import Any

import grpc

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.ctl.client import Client, NoSuchSession, UsageError, connect
from h3d.ctl.options import ID_HELP, UINT64_MAX, uint64
from h3d.ctl.output import emit_json, table, to_dict, when, yes_no

LIST_PAGE_SIZE = 500
SESSION_ID = re.compile(r"[0-9a-f]{32}")  # a full id: sent as is, without a lookup
AMBIGUOUS_SHOWN = 10  # matches listed in the error for an ambiguous prefix


def list_sessions(c: Client, every: bool = False) -> list[Any]:
    sessions: list[Any] = []
    token = ""
    while True:
        request = pb.ListSessionsRequest(page_size=LIST_PAGE_SIZE, page_token=token, all=every)
        resp = c.call(c.h3.ListSessions, request)
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
    if s.served_by:
        rows.insert(1, ("served_by", f"{s.served_by} (read from the remote store; not taken over)"))
    width = max(len(k) for k, _ in rows)
    out = "\n".join(f"{k.ljust(width)}  {v}" for k, v in rows)
    if s.token_ids:
        out += f"\ntoken_ids ({len(s.token_ids)}):\n{' '.join(map(str, s.token_ids))}\ntext:\n{s.text}"
    return out


def new_session_out(args: argparse.Namespace, s: Any) -> int:
    """A session made (create, fork): the whole message with --json, else its id alone."""
    if args.json:
        emit_json(to_dict(s))
    else:
        print(s.session_id)
    return 0


def cmd_session_create(c: Client, args: argparse.Namespace) -> int:
    req = pb.CreateSessionRequest(system_prompt=args.system or "", policy=args.policy or "", chat=args.chat)
    return new_session_out(args, c.call(c.h3.CreateSession, req))


def cmd_session_fork(c: Client, args: argparse.Namespace) -> int:
    req = pb.ForkSessionRequest(session_id=args.id)
    if args.at is not None:
        req.at_tokens = args.at
    return new_session_out(args, c.call(c.h3.ForkSession, req))


def cmd_session_list(c: Client, args: argparse.Namespace) -> int:
    sessions = list_sessions(c, args.all)
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
            + (f" elsewhere:{s.served_by}" if s.served_by else "")
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


def cmd_session_release(c: Client, args: argparse.Namespace) -> int:
    c.call(c.h3.ReleaseSession, pb.ReleaseSessionRequest(session_id=args.id))
    if args.json:
        emit_json({"session_id": args.id, "released": True})
    else:
        print(f"released {args.id}: the next daemon of the remote store that it names takes it over")
    return 0


def cmd_session_move(c: Client, args: argparse.Namespace) -> int:
    target = connect(argparse.Namespace(**{**vars(args), **target_of(args.to)}))
    c.call(c.h3.ReleaseSession, pb.ReleaseSessionRequest(session_id=args.id))
    s = target.call(target.h3.GetSession, pb.GetSessionRequest(session_id=args.id, take_over=True))
    if args.json:
        emit_json({"session_id": args.id, "moved_to": args.to, "num_tokens": s.num_tokens})
    else:
        print(f"moved {args.id} to {args.to} ({s.num_tokens} tokens; its KV is computed again there when used)")
    return 0


def target_of(to: str) -> dict[str, str | None]:
    """`--to`: a Unix socket's path (it has a `/`) or HOST:PORT."""
    return {"socket": to, "address": None} if "/" in to else {"socket": None, "address": to}


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`session` and its actions."""
    session = sub.add_parser("session", help="create, fork, list, show, close, release, move sessions")
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
    c = ss.add_parser(
        "fork",
        help="a new session whose context is the first N tokens of another's (all by default), its KV "
        "shared: ready to decode when this returns; prints its id",
    )
    c.add_argument("id", metavar="ID", help=ID_HELP)
    c.add_argument("--at", metavar="N", type=uint64, help="the fork's context: the session's first N tokens")
    c.set_defaults(func=cmd_session_fork)
    c = ss.add_parser("list", help="every session")
    c.add_argument(
        "--all",
        action="store_true",
        help="with the remote tier: the store's sessions too, those other daemons serve (FLAGS: elsewhere)",
    )
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
    c = ss.add_parser(
        "release",
        help="with the remote tier (remote_url): hand a session over to the other daemons of the store at "
        "once (its log's last bytes stored, its lease released, forgotten here)",
    )
    c.add_argument("id", metavar="ID", help=ID_HELP)
    c.set_defaults(func=cmd_session_release)
    c = ss.add_parser(
        "move",
        help="with the remote tier: release a session here and have another daemon of the store take it over now",
    )
    c.add_argument("id", metavar="ID", help=ID_HELP)
    c.add_argument(
        "--to",
        required=True,
        metavar="SOCKET|ADDRESS",
        help="the daemon that takes it: its Unix socket's path, or HOST:PORT (the same --token-file and --tls-ca)",
    )
    c.set_defaults(func=cmd_session_move)
