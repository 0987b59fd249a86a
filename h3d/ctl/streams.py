"""`h3ctl append` and `generate`: the two commands that stream (AppendContext, Generate).

- Ctrl-C cancels the call (the daemon then cancels the request) and exits 130.
- `append` shows the prefill's progress on stderr (none with `--json` unless stderr is a terminal);
  `--role` is sent only when given (chat sessions: the daemon's default is user).
- `generate` writes the text as it comes (human output) and sends only the sampling fields given:
  the others take the session's defaults.
- A stream that ends without its summary is an error (UNKNOWN, exit 1).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterator
from typing import Any, TextIO

from h3d._proto.h3.v1 import h3_pb2 as pb
from h3d.ctl.client import Client, read_text
from h3d.ctl.options import ID_HELP, non_negative, number, uint32, uint64
from h3d.ctl.output import emit_json, finish_name, report, to_dict

PROGRESS_MIN_TOKENS = 256  # appends shorter than this show no progress
PROGRESS_WIDTH = 30
ROLES = ("user", "assistant", "system")


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


def add_parsers(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """`append` and `generate`."""
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
    c.add_argument("--top-p", type=number(float, 0.0, 1.0, low_open=True), metavar="P")
    c.add_argument("--top-k", type=uint32, metavar="K", help="0 keeps every token")
    c.add_argument("--seed", type=uint64, metavar="S")
    c.add_argument("--stop", action="append", metavar="S", help="stop string (repeatable)")
    c.set_defaults(func=cmd_generate)
