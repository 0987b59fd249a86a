"""A conversation through the daemon's OpenAI Responses API: later turns against the first.

    python -m h3d.bench.chain --model DIR [--history-tokens 7800] [--turns 3] [--max-output-tokens 32]
        [--write docs/BENCHMARKS.md] [--json FILE]

Starts `h3d serve` with nothing set but the model, its data folder and `--http-listen`, and talks
to it with the official `openai` client, streaming. The first response reads a long document
(real text, `--history-tokens` of it with the template's markers) and answers a question; each
later turn sends one short question with `previous_response_id`, so that the daemon continues the
session in place. Time to first token is taken on the client (request sent to the first
`response.output_text.delta`). Side by side, in the same run, the stateless way: the same last
question sent with the whole conversation as `input` (what a client without stored responses
resends), which computes the history again. `cached_tokens` is the daemon's own count
(`usage.input_tokens_details.cached_tokens`).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from h3d.bench.load import free_port
from h3d.bench.report import write_section
from h3d.bench.text import corpus
from h3d.model.tokenizer import Tokenizer

QUESTIONS = ["Which licence above is the shortest?", "What does it allow?", "What does it forbid?",
             "Summarize it in one sentence.", "Who wrote it?", "When was it written?"]  # fmt: skip


def document(model: Path, tokens: int) -> str:
    """About `tokens` tokens of real text (cut at a line)."""
    tok = Tokenizer(model)
    text, out, n = corpus(), [], 0
    for line in text.splitlines(keepends=True):
        n += len(tok.encode(line, add_special_tokens=False))
        if n > tokens:
            break
        out.append(line)
    return "".join(out)


def timed(client: Any, model: str, **kw: Any) -> tuple[float, Any]:
    """(seconds to the first text delta, the final response) of one streamed response."""
    t0 = time.perf_counter()
    first = None
    final = None
    for event in client.responses.create(model=model, stream=True, temperature=0, **kw):
        if event.type == "response.output_text.delta" and first is None:
            first = time.perf_counter() - t0
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
    if final is None:
        raise SystemExit("the stream ended without its response")
    return (first if first is not None else time.perf_counter() - t0), final


def run(args: argparse.Namespace) -> tuple[str, dict[str, Any]]:
    try:
        import openai
    except ImportError:
        raise SystemExit(
            "this benchmark needs the openai package: pip install openai (make setup installs it)"
        ) from None
    model = Path(args.model)
    work = Path(tempfile.mkdtemp(prefix="h3d-chain-"))
    port = free_port()
    cmd = [sys.executable, "-m", "h3d.cli", "serve", "--model", str(model), "--data-dir", str(work / "data"),
           "--socket", str(work / "h3d.sock"), "--http-listen", f"127.0.0.1:{port}",
           "--log-level", "warning"]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    name = model.name
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0, timeout=600)
    doc = document(model, args.history_tokens)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                client.models.list()
                break
            except openai.APIConnectionError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise SystemExit(f"h3d serve did not start: {proc.stderr.read() if proc.stderr else ''}") from None
                time.sleep(0.3)
        timed(client, name, input="Hello.", max_output_tokens=4, store=False)  # warm-up
        turns: list[dict[str, Any]] = []
        ttft, resp = timed(client, name, input=f"{doc}\n\n{QUESTIONS[0]}", max_output_tokens=args.max_output_tokens)
        turns.append(_row(1, ttft, resp, 0))
        conversation = [{"role": "user", "content": f"{doc}\n\n{QUESTIONS[0]}"},
                        {"role": "assistant", "content": resp.output_text}]  # fmt: skip
        for i in range(1, args.turns):
            question = QUESTIONS[i % len(QUESTIONS)]
            resp_before = resp
            ttft, resp = timed(client, name, input=question, previous_response_id=resp.id,
                               max_output_tokens=args.max_output_tokens)  # fmt: skip
            history = resp_before.usage.input_tokens + resp_before.usage.output_tokens
            turns.append(_row(i + 1, ttft, resp, history))
            conversation += [{"role": "user", "content": question}, {"role": "assistant", "content": resp.output_text}]
        # The stateless way: the last question again, with the whole conversation before it resent.
        resend = [*conversation[:-1]]
        ttft_resend, again = timed(client, name, input=resend, max_output_tokens=args.max_output_tokens, store=False)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)
        shutil.rmtree(work, ignore_errors=True)
    first, later = turns[0], turns[1:]
    worst = max(t["ttft_s"] for t in later)
    rows = [
        (f"turn {t['turn']}" + (" (the document)" if t["turn"] == 1 else " (previous_response_id)"),
         f"{t['input_tokens']:,}", f"{t['cached_tokens']:,} ({t['cached_share'] * 100:.2f} %)",
         f"{t['ttft_s'] * 1e3:.0f}")
        for t in turns
    ]  # fmt: skip
    rows.append((f"turn {len(turns)} resent whole (stateless, store: false)", f"{again.usage.input_tokens:,}",
                 f"{again.usage.input_tokens_details.cached_tokens:,}", f"{ttft_resend * 1e3:.0f}"))  # fmt: skip
    table = "\n".join(
        ["| request | input tokens | cached tokens (share of the history) | time to first token (ms) |",
         "|---|---:|---:|---:|", *[f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows],
         "", f"Later turns' time to first token / the first turn's: worst {worst / first['ttft_s']:.3f}; "
         f"the last turn continued / resent whole: {later[-1]['ttft_s'] / ttft_resend:.3f}."]
    )  # fmt: skip
    figures = {
        "date": dt.date.today().isoformat(),
        "model": name,
        "history_tokens": first["input_tokens"],
        "turns": turns,
        "later_over_first_ttft_worst": round(worst / first["ttft_s"], 4),
        "resend_ttft_s": round(ttft_resend, 4),
        "resend_input_tokens": again.usage.input_tokens,
        "cached_share_min": min(t["cached_share"] for t in later),
    }
    return table, figures


def _row(turn: int, ttft: float, resp: Any, history: int) -> dict[str, Any]:
    """`history`: the conversation's tokens before this turn (the previous turn's input and output)."""
    used = resp.usage
    cached = used.input_tokens_details.cached_tokens
    return {
        "turn": turn,
        "ttft_s": round(ttft, 4),
        "input_tokens": used.input_tokens,
        "cached_tokens": cached,
        "output_tokens": used.output_tokens,
        "history_tokens": history,
        "cached_share": round(cached / history, 4) if history else 0.0,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--history-tokens", type=int, default=7800, help="the document's length in tokens")
    parser.add_argument("--turns", type=int, default=3, help="responses in the conversation, the first included")
    parser.add_argument("--max-output-tokens", type=int, default=32)
    parser.add_argument("--write", default=None)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    table, figures = run(args)
    print(table)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(figures, indent=1) + "\n")
    if args.write:
        meta = (
            f"Measured {dt.date.today().isoformat()} on the 2-core CPU host ({os.cpu_count()} CPUs), "
            f"{Path(args.model).name}, `h3d serve` with its defaults.\n\nCommand: `python -m h3d.bench.chain "
            f"--model MODEL --history-tokens {args.history_tokens} --turns {args.turns} "
            f"--max-output-tokens {args.max_output_tokens}`"
        )
        write_section(Path(args.write), f"{meta}\n\n{table}", "chain")


if __name__ == "__main__":
    main()
