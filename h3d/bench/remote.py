"""Sessions across daemons through the remote tier: `h3d serve` with its defaults and `--remote-url`.

    python -m h3d.bench.remote [--model data/models/smollm2-135m-instruct] [--tokens 6000]
                               [--streams 4] [--phase sigterm|kill|outage ...] [--out FILE]
                               [--write docs/BENCHMARKS.md]
    python3 -m h3d.bench.remote --shape llama3-8b --tokens 32768 --phase sigterm --tokenizer DIR   # the GPU row

With `--shape`, the model folder is written first as `h3d.bench.prefix` writes it.

A `redis-server` of the benchmark's own (a free port, a temporary folder, appendonly yes with
appendfsync always: what `remote_log = sync` asks) and daemons on the same model:

- **Taken over after a SIGTERM.** Daemon A is given a document of `--tokens` tokens of real text
  (AppendContext) and generates one token; A gets SIGTERM (its checkpoint, its KV written to the
  store, its leases released). Daemon B is asked to continue the session: the time to its first
  token (taking the session over, reading its KV from the store or leaving it to the prefill, as
  `remote_kv_resume` chose, the first step; the KV's bytes
  and seconds each way, from the daemons' `remote_kv_written` and `session_taken_over` events) against the same
  context prefilled again on B (a new session, AppendContext of the same tokens, then its first
  token; on a daemon of its own, since on B prefix reuse would share the taken-over session's KV),
  and whether the two continue with the same greedy tokens.
- **Taken over after kill -9.** Daemon A streams `--streams` generations (sessions of 1,000
  tokens); A is killed once each stream has shown 10 tokens. Daemon B takes each session over as
  soon as A's lease has expired: the seconds from the kill, the tokens the clients had that B's
  log lacks (the goal: none), and whether B continues each as the context's greedy continuation
  computed again on B.
- **The store down under load.** `--clients` clients generate 8 tokens at a time on sessions of
  their own; the store is stopped for `--down-s` seconds from 5 s in, then started again: the
  requests by outcome (`async`: the goal is none failed; `sync`: only UNAVAILABLE ones), the
  daemon's RSS, whether the tier caught up by itself, and the sessions the daemon lost.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import grpc

from h3d.bench.prefix import add_shape_args, document, host_name, shaped_model
from h3d.bench.report import write_section
from h3d.bench.serve import Client, Daemon, log
from h3d.remote.local import LocalRedis

PHASES = ("sigterm", "kill", "outage")


def generate(client: Client, sid: str, n: int) -> tuple[list[int], float]:
    """`n` greedy tokens continuing the session, and the seconds to the first."""
    pb = client.pb
    sampling = pb.SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    t0, first, out = time.perf_counter(), None, []
    for msg in client.h3.Generate(pb.GenerateRequest(session_id=sid, sampling=sampling)):
        if msg.HasField("delta"):
            first = first or time.perf_counter()
            out += list(msg.delta.token_ids)
    return out, (first or time.perf_counter()) - t0


def created(client: Client, ids: list[int]) -> tuple[str, float]:
    sid = client.h3.CreateSession(client.pb.CreateSessionRequest()).session_id
    t0 = time.perf_counter()
    for _ in client.h3.AppendContext(client.pb.AppendContextRequest(session_id=sid, token_ids=ids)):
        pass
    return sid, time.perf_counter() - t0


def after_sigterm(model: Path, work: Path, url: str, ids: list[int]) -> dict[str, Any]:
    flags = ["--remote-url", url]
    a = Daemon(model, work / "a", flags=flags)
    ca = Client(a.sock)
    sid, append_s = created(ca, ids)
    first, _ = generate(ca, sid, 1)
    ca.channel.close()
    stop_s = a.stop()
    written = a.event("remote_kv_written") or {}
    checkpoint = a.event("checkpoint") or {}
    b = Daemon(model, work / "b", flags=flags)
    cb = Client(b.sock)
    taken, resume_s = generate(cb, sid, 16)
    stats = getattr(cb.h3.GetStats(cb.pb.GetStatsRequest()), "global")
    cb.channel.close()
    b.stop()
    read = b.event("session_taken_over") or {}
    # The same context prefilled again, on a daemon of its own (on B, prefix reuse would share the
    # taken-over session's KV instead of computing it).
    c = Daemon(model, work / "c", flags=flags)
    cc = Client(c.sock)
    ref, reprefill_append_s = created(cc, ids + first)
    again, ref_first_s = generate(cc, ref, 16)
    cc.channel.close()
    c.stop()
    return {
        "tokens": len(ids), "append_s": append_s, "sigterm_s": stop_s, "checkpoint_s": checkpoint.get("seconds"),
        "kv_blocks_written": written.get("blocks"), "kv_bytes_written": written.get("bytes"),
        "kv_blocks_copied": written.get("copied_blocks"), "kv_bytes_copied": written.get("copied_bytes"),
        "kv_write_s": written.get("seconds"), "kv_blocks_read": read.get("kv_blocks_read"),
        "kv_bytes_read": read.get("kv_bytes_read"), "kv_read_s": read.get("kv_read_s"),
        "digest_blocks_read": read.get("digest_blocks_read"), "digest_read_s": read.get("digest_read_s"),
        "kv_source": read.get("kv_source"), "read_estimate_s": read.get("read_estimate_s"),
        "prefill_estimate_s": read.get("prefill_estimate_s"),
        "resume_first_token_s": resume_s,
        "reprefill_first_token_s": reprefill_append_s + ref_first_s,
        "ratio": resume_s / (reprefill_append_s + ref_first_s), "same_tokens": taken == again,
        "kv_rebuild_blocks": stats.kv_rebuild_blocks,
    }  # fmt: skip


def after_kill(model: Path, work: Path, url: str, docs: list[list[int]]) -> dict[str, Any]:
    flags = ["--remote-url", url]
    b = Daemon(model, work / "kb", flags=flags)
    a = Daemon(model, work / "ka", flags=flags)
    ca, cb = Client(a.sock), Client(b.sock)
    sids = [created(ca, ids)[0] for ids in docs]
    got: list[list[int]] = [[] for _ in sids]

    def stream(i: int) -> None:
        pb = ca.pb
        sampling = pb.SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
        try:
            for msg in ca.h3.Generate(pb.GenerateRequest(session_id=sids[i], sampling=sampling)):
                if msg.HasField("delta"):
                    got[i] += list(msg.delta.token_ids)
        except grpc.RpcError:  # (the kill cuts it)
            return

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(len(sids))]
    for t in threads:
        t.start()
    while min(len(g) for g in got) < 10:
        time.sleep(0.01)
    a.proc.send_signal(signal.SIGKILL)
    killed = time.perf_counter()
    if a in Daemon.running:
        Daemon.running.remove(a)
    for t in threads:
        t.join(60)
    lease = float(cb.config()["remote_lease_s"])
    takeover, contexts = [], []
    for sid in sids:  # each taken over as soon as B can
        while True:
            try:
                s = cb.h3.GetSession(cb.pb.GetSessionRequest(session_id=sid, with_tokens=True, take_over=True))
                break
            except grpc.RpcError as e:  # A's lease, until it expires
                if e.code() != grpc.StatusCode.FAILED_PRECONDITION or time.perf_counter() - killed > lease + 60:
                    raise
                time.sleep(0.05)
        takeover.append(time.perf_counter() - killed)
        contexts.append(list(s.token_ids))
    lost = 0
    for ids, sent, tokens in zip(docs, got, contexts, strict=True):
        logged = tokens[len(ids) :]
        lost += max(0, len(sent) - len(logged)) + sum(1 for x, y in zip(sent, logged, strict=False) if x != y)
    more = [generate(cb, sid, 8)[0] for sid in sids]
    cb.channel.close()
    b.stop()
    c = Daemon(model, work / "kc", flags=flags)  # the references, computed on a daemon of their own
    cc = Client(c.sock)
    same = sum(generate(cc, created(cc, tokens)[0], 8)[0] == m for tokens, m in zip(contexts, more, strict=True))
    cc.channel.close()
    c.stop()
    return {
        "streams": len(sids), "tokens_each": len(docs[0]), "streamed_before_kill": [len(g) for g in got],
        "lease_s": lease, "takeover_s_max": max(takeover), "takeover_s_min": min(takeover), "tokens_lost": lost,
        "continuations_identical": same,
    }  # fmt: skip


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def outage(model: Path, work: Path, store: LocalRedis, mode: str, clients: int, down_s: float) -> dict[str, Any]:
    """`clients` clients generating 8 tokens at a time on sessions of their own; the store stopped
    for `down_s` seconds from 5 s in, then started again; 5 s more. Requests by outcome, the
    daemon's RSS, and whether the tier caught up by itself."""
    d = Daemon(model, work / f"outage-{mode}", flags=["--remote-url", store.url, "--remote-log", mode])
    client = Client(d.sock)
    pb = client.pb
    sids = [created(client, list(range(100 + i, 164 + i)))[0] for i in range(clients)]
    outcomes: dict[str, int] = {}
    lock, stop = threading.Lock(), threading.Event()

    def run(sid: str) -> None:
        sampling = pb.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        while not stop.is_set():
            try:
                for _ in client.h3.Generate(pb.GenerateRequest(session_id=sid, sampling=sampling)):
                    pass
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            with lock:
                outcomes[code] = outcomes.get(code, 0) + 1

    threads = [threading.Thread(target=run, args=(sid,)) for sid in sids]
    for t in threads:
        t.start()
    rss, t0 = [], time.perf_counter()
    stopped = started = False
    while time.perf_counter() - t0 < 10 + down_s:
        rss.append(rss_mb(d.proc.pid))
        now = time.perf_counter() - t0
        if now >= 5 and not stopped:
            store.stop()
            stopped = True
        if now >= 5 + down_s and not started:
            store.start()
            started = True
        time.sleep(0.5)
    stop.set()
    for t in threads:
        t.join(120)
    deadline, g = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        g = getattr(client.h3.GetStats(pb.GetStatsRequest()), "global")
        if not g.remote_degraded and not g.remote_lag_bytes:
            break
        time.sleep(0.5)
    assert g is not None
    client.channel.close()
    d.stop()
    return {
        "mode": mode, "clients": clients, "down_s": down_s, "outcomes": outcomes, "rss_mb_max": max(rss),
        "rss_mb_start": rss[0], "recovered": not g.remote_degraded and not g.remote_lag_bytes,
        "lost_sessions": sum(e.get("event") == "session_lost" for e in d.events()),
    }  # fmt: skip


def _gbps(nbytes: Any, seconds: Any) -> str:
    if not nbytes or not seconds:
        return f"0 GB, {seconds:.1f} s" if seconds else "—"
    return f"{nbytes / 1e9:.2f} GB in {seconds:.1f} s ({nbytes / 1e9 / seconds:.2f} GB/s)"


def table(r: dict[str, Any]) -> str:
    lines = [
        f"`python -m h3d.bench.remote {' '.join(r['argv'])}` ({r['date']}, {r['host']}, {r['model']}; "
        "`h3d serve` defaults with `--remote-url`, redis-server 7 with appendfsync always)",
    ]
    s, k = r.get("sigterm"), r.get("kill")
    if s:
        lines += [
            "",
            "| taken over after SIGTERM | |",
            "|---|---|",
            f"| the session | {s['tokens']} tokens, appended in {s['append_s']:.2f} s on daemon A |",
            f"| A's SIGTERM (checkpoint {s.get('checkpoint_s') or 0:.1f} s, then the KV the store lacks) | "
            f"{s['sigterm_s']:.2f} s |",
            f"| the KV copied to the store as write-behind (and the checkpoint's flush) archived it | "
            f"{s.get('kv_blocks_copied') or 0} blocks, {(s.get('kv_bytes_copied') or 0) / 1e9:.2f} GB |",
            f"| the KV the store still lacked, written after the checkpoint (the copies' wait included) | "
            f"{s['kv_blocks_written']} blocks, {_gbps(s.get('kv_bytes_written'), s.get('kv_write_s'))} |",
            f"| the KV read from the store by daemon B ({s.get('kv_blocks_read')} blocks) | "
            f"{_gbps(s.get('kv_bytes_read'), s.get('kv_read_s'))} |",
            f"| its digest snapshot read from the store first (blocks it covers; s) | "
            f"{s.get('digest_blocks_read')}; {s.get('digest_read_s')} s |",
            *(
                [
                    f"| B's choice (`remote_kv_resume`): its KV from the store or computed again; the estimates "
                    f"(s): the store's read / a prefill | {s['kv_source']}; {s.get('read_estimate_s')} / "
                    f"{s.get('prefill_estimate_s')} |"
                ]
                if s.get("kv_source")
                else []
            ),
            f"| daemon B's first token: taken over, its KV from the store or computed | "
            f"{s['resume_first_token_s']:.2f} s |",
            f"| the same context prefilled again (a daemon of its own), to its first token | "
            f"{s['reprefill_first_token_s']:.2f} s |",
            f"| ratio (goal ≤ 1/3) | {s['ratio']:.3f} |",
            f"| B's 16 greedy tokens equal the prefilled-again session's | {'yes' if s['same_tokens'] else 'no'} |",
            f"| blocks B computed again | {s['kv_rebuild_blocks']} |",
        ]
    if k:
        lines += [
            "",
            "| taken over after kill -9 | |",
            "|---|---|",
            f"| streams cut | {k['streams']} sessions of {k['tokens_each']} tokens, "
            f"{min(k['streamed_before_kill'])}-{max(k['streamed_before_kill'])} tokens streamed each |",
            f"| taken over by B, seconds after the kill (lease {k['lease_s']:g} s; goal ≤ lease + 5) | "
            f"{k['takeover_s_min']:.1f}-{k['takeover_s_max']:.1f} s |",
            f"| tokens a client had that B's log lacks | {k['tokens_lost']} |",
            f"| B's continuations equal the context's computed again | {k['continuations_identical']} of "
            f"{k['streams']} |",
        ]
    if r.get("outages"):
        lines += [
            "",
            "| the store down under load | requests by outcome | daemon RSS, start / max | caught up by itself "
            "| sessions lost |",
            "|---|---|---|---|---|",
            *[
                f"| `remote_log = {o['mode']}`: {o['clients']} clients, {o['down_s']:g} s down | "
                f"{', '.join(f'{k}: {v}' for k, v in sorted(o['outcomes'].items()))} | "
                f"{o['rss_mb_start']:.0f} / {o['rss_mb_max']:.0f} MiB | {'yes' if o['recovered'] else 'no'} | "
                f"{o['lost_sessions']} |"
                for o in r["outages"]
            ],
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.remote", description=__doc__.split("\n\n")[0])
    add_shape_args(p)
    p.add_argument("--phase", action="append", choices=PHASES, help="what to measure (repeatable; default: all)")
    p.add_argument("--tokens", type=int, default=6000, help="the document's tokens (taken over after SIGTERM)")
    p.add_argument("--streams", type=int, default=4, help="streams cut by kill -9")
    p.add_argument("--clients", type=int, default=64, help="clients generating while the store is down")
    p.add_argument("--down-s", type=float, default=30.0, help="how long the store is down")
    p.add_argument("--work", type=Path, default=Path(".bench/remote"), help="the daemons' and the store's folders")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default bench/results/DATE-cpu-remote.json)")
    p.add_argument("--write", type=Path, default=None, help="update this markdown file's remote section")
    args = p.parse_args(argv)
    phases = args.phase or list(PHASES)
    args.model = shaped_model(args.model, args.shape, args.tiny, args.tokenizer)
    from h3d.model.tokenizer import Tokenizer

    if args.work.exists():
        shutil.rmtree(args.work)
    store = LocalRedis(args.work / "redis")
    today = dt.date.today().isoformat()
    result: dict[str, Any] = {
        "date": today, "host": host_name(), "model": args.model.name, "argv": sys.argv[1:] if argv is None else argv,
        "outages": [],
    }  # fmt: skip
    try:
        tok = Tokenizer(args.model)
        ids = tok.encode(document(tok, args.tokens))
        if "sigterm" in phases:
            log("taken over after SIGTERM ...")
            result["sigterm"] = after_sigterm(args.model, args.work, store.url, ids)
            log(f"sigterm: {json.dumps(result['sigterm'])}")
        if "kill" in phases:
            log("taken over after kill -9 ...")
            docs = [ids[i * 100 : i * 100 + 1000] for i in range(args.streams)]
            result["kill"] = after_kill(args.model, args.work, store.url, docs)
            log(f"kill: {json.dumps(result['kill'])}")
        for mode in ("async", "sync") if "outage" in phases else ():
            log(f"the store down for {args.down_s:g} s under {args.clients} clients, remote_log = {mode} ...")
            result["outages"].append(outage(args.model, args.work, store, mode, args.clients, args.down_s))
            log(f"outage: {json.dumps(result['outages'][-1])}")
    finally:
        for d in list(Daemon.running):
            d.proc.kill()
        store.stop()
    card = "cpu" if result["host"].startswith("CPU") else "gpu"
    out = args.out or Path("bench/results") / f"{today}-{card}-remote.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    text = table(result)
    print(text)
    if args.write is not None:
        where = "CPU" if card == "cpu" else result["host"].split(",")[0]
        title = f"## Sessions across daemons through the remote tier ({where})\n\n"
        write_section(args.write, title + text, "remote" if card == "cpu" else "remote-gpu")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
