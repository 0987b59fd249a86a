"""Forks and prefix reuse through the daemon: `h3d serve` with its defaults, on a model folder.

    python -m h3d.bench.prefix [--model data/models/smollm2-135m-instruct] [--tokens 6000] [--forks 16]
                               [--out FILE] [--write docs/BENCHMARKS.md]
    python3 -m h3d.bench.prefix --shape llama3-8b --tokens 32768 --tokenizer DIR   # the GPU row

With `--shape`, the model folder (`--model`, default `.bench/model-<shape>-shape`) is written first
as `h3d.bench.serve` writes it: the shape's random weights, the tokenizer of `--tokenizer` (`--tiny`:
the shape at a few layers, the test of the code on a CPU).

Two measurements, both on the product path (gRPC and the OpenAI HTTP API of one `h3d serve`
started with `--http-listen` and nothing else):

- **Forks** (`ForkSession`): a session given a document of `--tokens` tokens (AppendContext), then
  `--forks` forks of it, each generating `--generate` tokens greedily, and a session given the same
  tokens without a fork (the unshared reference): the document's append time against a fork's
  time, whether every fork's tokens equal the reference's, the KV blocks (HBM + DDR copies,
  GetStats) the forks hold against the parent's, and the archive's records (GetStats'
  `ssd_used_bytes`) once the document and its forks are closed (parked: every block archived, as a
  checkpoint writes it) against the reference's closed alone.
- **A chat's second turn** (`/v1/chat/completions`, streamed, stateless as OpenAI's clients send
  it): turn 1 is the document as a user message and a question; turn 2 sends the whole
  conversation again (the first reply as the assistant's message) with a new question. Time to
  first token of each, and `usage.prompt_tokens_details.cached_tokens` of turn 2 against turn 1's
  history (its prompt and reply). Turn 2 comes as soon as turn 1 ended, while write-behind
  archives turn 1's KV; then, once that settled, the same history with another question (turn 2
  as a reader who took a few seconds would send it). Each with where the daemon's time went (its
  `generation` event). Turn 1, and the settled turn, wait for the daemon's warm set of decode
  graphs (captured after ready, one per idle turn: `graphs_warmed`), so that no turn waits for
  a capture under way as a request right after the start would (its own figure: `queued_ms`).

`--phase forks` or `--phase chat` runs one of them (default: both).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import socket
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from h3d.bench.report import write_section
from h3d.bench.serve import Client, Daemon, log

DEFAULT_MODEL = Path("data/models/smollm2-135m-instruct")
SOURCE = Path(__file__).resolve().parents[2] / "docs" / "OPERATIONS.md"  # real text to read


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def shaped_model(model: Path | None, shape: str | None, tiny: bool, tokenizer: Path) -> Path:
    """The model folder to serve: `model` (default: the embedded one) or, with `shape`, a folder of
    that shape's random weights and `tokenizer`'s files written first (`h3d.bench.serve`'s; at a
    few layers if `tiny`), at `model` or `.bench/model-<shape>-shape`."""
    if shape is None:
        return model or DEFAULT_MODEL
    from h3d.bench.serve import Shape, tokenizer_config, write_model

    model = model or Path(".bench") / (f"model-tiny-{shape}" if tiny else f"model-{shape}-shape")
    write_model(model, Shape.pick(tiny, tokenizer_config(tokenizer), shape), tokenizer, 0)
    return model


def add_shape_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        type=Path,
        default=None,
        help="the model folder served (default: the embedded model; with --shape, where that model is written)",
    )
    p.add_argument(
        "--shape",
        choices=["llama3-8b", "gemma3-12b"],
        default=None,
        help="write a model folder of this shape with random weights (h3d.bench.serve's) and serve it",
    )
    p.add_argument("--tiny", action="store_true", help="with --shape: a few layers (the code's test on a CPU)")
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_MODEL, help="with --shape: the tokenizer's folder")


def document(tokenizer: Any, n: int) -> str:
    """About `n` tokens of real text (the operations manual, repeated as needed)."""
    text = SOURCE.read_text()
    while len(tokenizer.encode(text)) < n:
        text += "\n\n" + text
    ids = tokenizer.encode(text)[:n]
    return str(tokenizer.decode(ids))


def chat(url: str, model: str, messages: list[dict[str, str]], max_tokens: int) -> dict[str, Any]:
    """One streamed chat completion: time to first token, its text, its usage."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    request = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})  # fmt: skip
    t0, first, texts, used = time.perf_counter(), None, [], {}
    try:
        response = urllib.request.urlopen(request, timeout=3600)
    except urllib.error.HTTPError as e:  # the daemon's status and message, not a traceback
        message = e.read().decode(errors="replace")
        raise SystemExit(f"h3d.bench.prefix: the chat request got HTTP {e.code}: {message}") from None
    with response:
        for raw in response:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                used = chunk["usage"]
            for choice in chunk.get("choices", []):
                text = choice.get("delta", {}).get("content")
                if text:
                    first = first or time.perf_counter()
                    texts.append(text)
    return {"ttft_s": (first or time.perf_counter()) - t0, "text": "".join(texts), "usage": used}


def kv_bytes(client: Client) -> tuple[int, int, int, int]:
    """The tiers' used bytes: HBM + DDR (each copy of a block counted once, whatever the sessions
    pointing at it), the archive's, what sharing saves in HBM and DDR, and the block digests'
    (rows shared with a block's other sessions counted once)."""
    g = getattr(client.h3.GetStats(client.pb.GetStatsRequest()), "global")
    return (
        g.hbm_used_bytes + g.ddr_used_bytes, g.ssd_used_bytes, g.shared_hbm_saved_bytes + g.shared_ddr_saved_bytes,
        g.digest_bytes,
    )  # fmt: skip


def graphs_warmed(client: Client, timeout: float = 120.0) -> float:
    """Until the daemon has captured the warm set of decode graphs it left for after ready
    (`graphs_before_ready` off: one graph per idle turn, and a request that comes meanwhile waits
    for the capture under way), so that a turn is timed as on a daemon that has finished its
    start. Returns the seconds waited."""
    t0 = time.monotonic()
    while client.h3.GetStats(client.pb.GetStatsRequest()).graphs.deferred and time.monotonic() - t0 < timeout:
        time.sleep(0.5)
    return time.monotonic() - t0


def settled(client: Client, timeout: float = 300.0) -> None:
    """Until write-behind is done with what it will write (nothing in flight, the dirty KV within
    its budget, unchanged for a second): its DDR copies are then in both measures alike."""
    config = client.config()
    if not config.get("write_behind", True):
        return  # (nothing is written behind: nothing to wait for)
    budget = float(config["write_behind_dirty_mb"]) * 2**20
    deadline, last = time.monotonic() + timeout, None
    while time.monotonic() < deadline:
        g = getattr(client.h3.GetStats(client.pb.GetStatsRequest()), "global")
        now = (g.dirty_bytes, g.ddr_used_bytes)
        if not g.write_behind_in_flight_bytes and g.dirty_bytes <= budget and now == last:
            return
        last = now
        time.sleep(1.0)


def continuation(client: Client, sid: str, n: int) -> list[int]:
    """`n` greedy tokens continuing the session."""
    sampling = client.pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    out: list[int] = []
    for msg in client.h3.Generate(client.pb.GenerateRequest(session_id=sid, sampling=sampling)):
        if msg.HasField("delta"):
            out += msg.delta.token_ids
    return out


def forks(client: Client, ids: list[int], n: int, generate: int) -> dict[str, Any]:
    pb = client.pb
    # An unshared session first: the continuation each fork must give, and what one session's KV
    # takes in the archive once it is closed (parked: every block archived, as a checkpoint writes it).
    start = kv_bytes(client)
    reference = client.session("attention_entropy")
    client.append(reference, ids)
    want = continuation(client, reference, generate)
    client.close(reference, purge=False)
    settled(client)  # (the daemon parks a closed session once write-behind wrote it)
    archive_one = kv_bytes(client)[1] - start[1]
    client.close(reference)  # deleted: its records go
    before = kv_bytes(client)
    parent = client.session("attention_entropy")
    append_s = client.append(parent, ids)
    settled(client)
    one = kv_bytes(client)
    times, made = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        made.append(client.h3.ForkSession(pb.ForkSessionRequest(session_id=parent)).session_id)
        times.append(time.perf_counter() - t0)
    settled(client)
    after = kv_bytes(client)
    # The goal's allowance: 1.2 x one session's KV, plus each fork's own blocks (a whole fork is
    # its parent's twin: the partial last block, copied), at one session's bytes per block.
    bs = int(client.config()["block_size"])
    blocks = -(-len(ids) // bs)
    shared = (len(ids) - 1) // bs
    own = blocks - shared
    allowance = 1.2 * (one[0] - before[0]) + n * own * (one[0] - before[0]) / blocks
    got = [continuation(client, sid, generate) for sid in made]
    same = sum(g == want for g in got)
    # Where they differ, why: the forks among themselves (one computation: one answer), the parent
    # (its KV is what the forks share, its tail from the one-chunk prefill) against the reference,
    # and the first token that differs.
    parent_same = continuation(client, parent, generate) == want
    diverge = sorted(next((i for i, (x, y) in enumerate(zip(g, want, strict=False)) if x != y), len(g)) for g in got)
    for sid in [parent, *made]:
        client.close(sid, purge=False)  # parked: the shared blocks once, each fork's own blocks
    settled(client)
    archive_family = kv_bytes(client)[1] - before[1]
    blocks_after = -(-(len(ids) + generate) // bs)  # (each fork's, and the reference's, after generating)
    archive_allowance = archive_one * (1.2 + n * (blocks_after - shared) / blocks_after)
    for sid in [parent, *made]:
        client.close(sid)
    times.sort()
    return {
        "document_tokens": len(ids), "forks": n, "append_s": append_s, "fork_s_median": times[len(times) // 2],
        "fork_s_max": times[-1], "forks_identical": same, "fork_answers": len({tuple(g) for g in got}),
        "parent_identical": parent_same, "first_difference_median": diverge[len(diverge) // 2],
        "one_session_mb": (one[0] - before[0]) / 2**20, "with_forks_mb": (after[0] - before[0]) / 2**20,
        "digests_one_session_mb": (one[3] - before[3]) / 2**20, "digests_with_forks_mb": (after[3] - before[3]) / 2**20,
        "fork_own_blocks": own, "allowance_mb": allowance / 2**20, "shared_saved_mb": after[2] / 2**20,
        "archive_one_closed_mb": archive_one / 2**20, "archive_family_closed_mb": archive_family / 2**20,
        "archive_allowance_mb": archive_allowance / 2**20, "fork_own_blocks_closed": blocks_after - shared,
    }  # fmt: skip


def second_turn(url: str, model: str, text: str, reply_tokens: int, daemon: Daemon, client: Client) -> dict[str, Any]:
    history = [{"role": "user", "content": text + "\n\nIn one sentence: what does this manual describe?"}]
    waited = graphs_warmed(client)
    first = chat(url, model, history, reply_tokens)
    history += [{"role": "assistant", "content": first["text"]},
                {"role": "user", "content": "And which command shows the tiers?"}]  # fmt: skip
    second = chat(url, model, history, reply_tokens)
    # Where the daemon's part of its time to first token went (its `generation` event): waiting for
    # the engine's thread, the prompt's prefill (the part of it not reused), then the first token.
    inside = [e for e in daemon.events() if e.get("event") == "generation"][-1]
    # The same history once write-behind settled, with another question.
    settled(client)
    graphs_warmed(client)
    history[-1] = {"role": "user", "content": "And where do sessions live after a restart?"}
    later = chat(url, model, history, reply_tokens)
    inside_later = [e for e in daemon.events() if e.get("event") == "generation"][-1]
    had = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
    cached = second["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0)
    keys = ("queued_ms", "prefill_ms", "ttft_ms")
    return {
        "history_tokens": had, "ttft_first_s": first["ttft_s"], "ttft_second_s": second["ttft_s"],
        "ttft_ratio": second["ttft_s"] / first["ttft_s"], "cached_tokens": cached, "cached_share": cached / had,
        "second_prompt_tokens": second["usage"]["prompt_tokens"],
        "second_in_daemon_ms": {k: inside[k] for k in keys},
        "ttft_settled_s": later["ttft_s"], "settled_in_daemon_ms": {k: inside_later[k] for k in keys},
        "settled_cached_tokens": later["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0),
        "graphs_warmed_wait_s": round(waited, 1),  # before turn 1: the warm set's captures after ready
    }  # fmt: skip


def table(r: dict[str, Any]) -> str:
    f, c = r.get("forks"), r.get("chat")
    return "\n".join(
        [
            f"`python -m h3d.bench.prefix {' '.join(r['argv'])}` ({r['date']}, {r['host']}, {r['model']}; "
            "`h3d serve` defaults, `--http-listen`)",
            *(["", *_forks_table(f)] if f else []),
            *(["", *_chat_table(c)] if c else []),
        ]
    )


def _forks_table(f: dict[str, Any]) -> list[str]:
    return [
        "| forks of one document | |",
        "|---|---|",
        f"| document (AppendContext) | {f['document_tokens']} tokens in {f['append_s']:.2f} s |",
        f"| ForkSession, median / max of {f['forks']} | {f['fork_s_median']:.3f} s / {f['fork_s_max']:.3f} s |",
        f"| forks whose greedy tokens equal an unshared session's | {f['forks_identical']} of {f['forks']} |",
        *(
            [
                f"| where they differ: distinct answers among the forks; the parent's equal to the unshared one; "
                f"the first token that differs (median of {f['forks']}) | {f['fork_answers']}; "
                f"{'yes' if f['parent_identical'] else 'no'}; token {f['first_difference_median']} |"
            ]
            if "fork_answers" in f and f["forks_identical"] < f["forks"]
            else []
        ),
        f"| HBM + DDR used by KV (write-behind settled): one session / with its {f['forks']} forks | "
        f"{f['one_session_mb']:.0f} MiB / "
        f"{f['with_forks_mb']:.0f} MiB ({f['with_forks_mb'] / f['one_session_mb']:.1f} x) |",
        f"| the goal: at most 1.2 x one session + each fork's own {f['fork_own_blocks']} blocks | "
        f"{f['allowance_mb']:.0f} MiB: {'met' if f['with_forks_mb'] <= f['allowance_mb'] else 'missed'} |",
        f"| HBM + DDR that sharing saves (GetStats) | {f['shared_saved_mb']:.0f} MiB |",
        *(
            [
                f"| block digests (GetStats `digest_bytes`): one session / with its {f['forks']} forks | "
                f"{f['digests_one_session_mb']:.1f} MiB / {f['digests_with_forks_mb']:.1f} MiB |"
            ]
            if "digests_one_session_mb" in f
            else []
        ),
        f"| archive once closed: one session / the document and its {f['forks']} forks | "
        f"{f['archive_one_closed_mb']:.0f} MiB / {f['archive_family_closed_mb']:.0f} MiB "
        f"({f['archive_family_closed_mb'] / f['archive_one_closed_mb']:.1f} x) |",
        f"| the same rule: 1.2 x one session + each fork's own {f['fork_own_blocks_closed']} blocks | "
        f"{f['archive_allowance_mb']:.0f} MiB: "
        f"{'met' if f['archive_family_closed_mb'] <= f['archive_allowance_mb'] else 'missed'} |",
    ]  # fmt: skip


def _chat_table(c: dict[str, Any]) -> list[str]:
    def inside(ms: dict[str, float]) -> str:
        return " / ".join(f"{ms[k]:.0f} ms" for k in ("queued_ms", "prefill_ms", "ttft_ms"))

    return [
        "| a chat's second turn (`/v1/chat/completions`, stateless) | |",
        "|---|---|",
        f"| history (turn 1's prompt and reply) | {c['history_tokens']} tokens |",
        f"| time to first token: turn 1 / turn 2 | {c['ttft_first_s']:.2f} s / {c['ttft_second_s']:.3f} s "
        f"({c['ttft_ratio']:.3f}) |",
        f"| turn 2's cached_tokens | {c['cached_tokens']} ({100 * c['cached_share']:.1f} % of the history) |",
        "| turn 2 in the daemon: waiting for the engine / the prompt's prefill / to its first token | "
        f"{inside(c['second_in_daemon_ms'])} |",
        f"| turn 2 again once write-behind settled (another question): time to first token | "
        f"{c['ttft_settled_s']:.3f} s ({c['ttft_settled_s'] / c['ttft_first_s']:.3f}) |",
        f"| the same in the daemon | {inside(c['settled_in_daemon_ms'])} |",
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.prefix", description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--tokens", type=int, default=6000, help="the document's tokens")
    p.add_argument("--forks", type=int, default=16, help="forks of the document")
    p.add_argument("--generate", type=int, default=64, help="tokens each fork generates")
    p.add_argument("--work", type=Path, default=Path(".bench/prefix"), help="the daemon's data folder")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default bench/results/DATE-cpu-prefix.json)")
    p.add_argument("--write", type=Path, default=None, help="update this markdown file's prefix section")
    p.add_argument("--phase", choices=("forks", "chat"), default=None, help="run one measurement (default: both)")
    p.add_argument("--daemon-flag", action="append", metavar="FLAG",
                   help="a flag for the daemon (repeatable; e.g. --daemon-flag=--ddr-memory=registered): not the "
                   "defaults, so not the product's figures")  # fmt: skip
    args = p.parse_args(argv)
    args.model = shaped_model(args.model, args.shape, args.tiny, args.tokenizer)
    from h3d.model.tokenizer import Tokenizer

    tokenizer = Tokenizer(str(args.model))
    text = document(tokenizer, args.tokens)
    ids = tokenizer.encode(text)
    port = free_port()
    daemon = Daemon(args.model, args.work, flags=["--http-listen", f"127.0.0.1:{port}", *(args.daemon_flag or [])])
    try:
        client = Client(daemon.sock)
        fork_figures = chat_figures = None
        if args.phase in (None, "forks"):
            log("forks ...")
            fork_figures = forks(client, ids, args.forks, args.generate)
            log(f"forks: {json.dumps(fork_figures)}")
        if args.phase in (None, "chat"):
            log("a chat's second turn ...")
            chat_figures = second_turn(f"http://127.0.0.1:{port}", args.model.name, text, 32, daemon, client)
            log(f"chat: {json.dumps(chat_figures)}")
    finally:
        daemon.stop()
    result = {
        "date": dt.date.today().isoformat(), "host": host_name(), "model": args.model.name,
        "argv": list(sys.argv[1:] if argv is None else argv), "forks": fork_figures, "chat": chat_figures,
    }  # fmt: skip
    card = "cpu" if result["host"].startswith("CPU") else "gpu"
    out = args.out or Path("bench/results") / f"{result['date']}-{card}-prefix.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(table(result))
    if args.write is not None:
        where = "CPU" if card == "cpu" else result["host"].split(",")[0]
        title = f"## Forks and prefix reuse through the daemon ({where})\n\n"
        write_section(args.write, title + table(result), "prefix" if card == "cpu" else "prefix-gpu")
    return 0


def host_name() -> str:
    """The card the daemon's `auto` device picks, else the CPU's cores."""
    import os

    import torch

    if torch.cuda.is_available():
        return f"{torch.cuda.get_device_name(0)}, {len(os.sched_getaffinity(0))} cores"
    return f"CPU, {len(os.sched_getaffinity(0))} cores"


if __name__ == "__main__":
    sys.exit(main())
