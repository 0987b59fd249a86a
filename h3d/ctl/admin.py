"""The H3Admin commands: `h3ctl evict`, `pin`, `policy`, `drain`, `resume` and `config`.

- `drain` waits for the daemon's answer, which comes once the drain is over: its deadline is
  `--timeout` plus the drain's own timeout plus `DRAIN_GRACE_S`, and none when the daemon's
  drain_timeout_s applies.
- A client token is refused these calls by the daemon (PERMISSION_DENIED, exit 1).
"""

from __future__ import annotations

import argparse
import json

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.ctl.client import Client
from h3d.ctl.options import ID_HELP, positive
from h3d.ctl.output import emit_json, to_dict, when

TIERS = {"ddr": pb.TIER_DDR, "ssd": pb.TIER_SSD}
# The daemon answers within the drain timeout plus this (it cancels what is left, then waits up to 10 s).
DRAIN_GRACE_S = 15.0


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


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`evict`, `pin`, `policy`, `drain`, `resume` and `config`."""
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
