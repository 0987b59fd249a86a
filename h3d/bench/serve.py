"""The GPU benchmark through the daemon: `h3d serve` with its defaults, driven over gRPC.

    python -m h3d.bench.serve --phase single [--phase many ...] [--out FILE] [--write docs/BENCHMARKS.md]
    python -m h3d.bench.serve --tiny --phase single          # the same code path on a CPU, in a minute

The product is the daemon, so its figures are the headline. Each run:

1. writes a model folder (`--model-dir`): Llama-3-8B's shape (32 layers, hidden 4,096, 32 query
   / 8 KV heads, MLP 14,336) with random bf16 weights (N(0, 0.02), norms 1), the embedded model's
   tokenizer and vocabulary (49,152), 139,264 positions (a 128K prompt and its answer); or, with
   `--shape gemma3-12b`, Gemma 3 12B's text shape (48 layers, 40 of them sliding with a 1,024-token
   window, hidden 3,840, 16 query / 8 KV heads of 256, MLP 15,360, local RoPE base, linear global
   scaling 8) with the same vocabulary and positions, 128K only, no transformers baseline;
2. starts `h3d serve --model DIR --data-dir DIR --socket SOCK` and nothing else: every other key
   is the daemon's default (`auto` sizing, policy, chunking, graphs, warm-up);
3. drives it over gRPC with the project's stubs (CreateSession with the mode as the policy,
   AppendContext with token ids, Generate greedy with `ignore_eos`, GetStats), timing each token
   as it arrives;
4. stops it, loads the same folder in-process as an `Engine` with the daemon's resolved
   configuration (GetConfig: `auto` keys replaced by the figures the daemon chose) and runs the
   same requests through `Engine.append` / `Engine.generate`: the two differ only by the daemon;
5. where the phase has one, runs transformers' LlamaForCausalLM (sdpa, DynamicCache) with the same
   weights on the same prompts.

Phases (`--phase`, repeatable; each fits in 10 minutes on an H200; sessions are purged between
them):
- `single`: one session at each context (32K, 128K) under `exact` and `attention_entropy`:
  append time, time to first token of a Generate right after it (a one-token prompt), inter-token
  p50 / p99 / mean over `--steps` tokens, the engine-level figures, and the floor of a step;
- `many`: `--many` sessions of 32K decoding together: tokens/s, inter-token p50 / p99, HBM hit
  rate per session (min / mean), the engine-level tokens/s, and the floor of a step;
- `prefill-under-load`: a 128K append arriving while 8 sessions of 32K decode: their inter-token
  p99 during it, the append's time against its time alone;
- `restart`: the disk's bandwidth (`df`, a file written and fsynced, read back cold and warm);
  sessions of 128K and 4 x 32K appended, decoding together (after a few tokens that capture the
  batch's graphs) while write-behind writes their KV and again once it has (the inter-token p99
  ratio), each session's HBF window then, SIGTERM with no stream in flight (its time,
  the blocks left to recompute), the archive's pages dropped from the page cache, a restart on the
  same data folder: start to ready, tokens lost, the first token of each session (the 128K one
  first: cold), the share of blocks the archive gave back, the 128K session closed, parked and reopened
  (warm), and a fresh 128K session's prefill and first token (recompute).

The floor of a step: (weight bytes + the KV bytes it read from HBM) / the HBM copy bandwidth +
the bytes it fetched over PCIe / the pinned host-to-device bandwidth, from the daemon's own
counters (GetStats before and after) and bandwidths measured in the same run.

The JSON (`--out`, default `bench/results/<date>-<card>-serve.json`; `--tiny`: under `--work`) is
merged across runs: a phase run again replaces its own keys only. The daemon's packages that a GPU
host lacks travel as wheels (docs/BENCHMARKS.md says how).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import datetime as dt
import json
import os
import pstats
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from h3d.bench.gpu_base import ceilings, device_times_us, free_memory, save, version
from h3d.bench.report import write_section
from h3d.kv.sizing import slot_bytes

PHASES = ("single", "many", "prefill-under-load", "restart")
SHAPES = ("llama3-8b", "gemma3-12b")
MODES = ("exact", "attention_entropy")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
DEFAULT_TOKENIZER = Path("data/models/smollm2-135m-instruct")
READY_TIMEOUT_S = 600.0


def log(msg: str) -> None:
    print(f"[serve-bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- sizes ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Shape:
    """What `--tiny` changes: the model's shape and the contexts; the code path is the same."""

    model: dict[str, Any]  # config.json (HF key names)
    dtype: torch.dtype
    contexts: tuple[int, ...]
    steps: int
    many: int  # sessions of `many_context` decoding together
    many_context: int
    load_sessions: int  # prefill-under-load: sessions decoding ...
    load_context: int
    long_context: int  # ... while a prompt of this many tokens is appended
    load_tokens: int  # tokens each decoding stream generates (more than the append lasts)

    @staticmethod
    def pick(tiny: bool, tokenizer: dict[str, Any], name: str = "llama3-8b") -> Shape:
        if name == "gemma3-12b":
            return Shape.gemma(tiny, tokenizer)
        ids: dict[str, Any] = {k: tokenizer[k] for k in ("bos_token_id", "eos_token_id") if k in tokenizer}
        base: dict[str, Any] = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "rms_norm_eps": 1e-5}
        base.update(ids)
        base.update(vocab_size=tokenizer["vocab_size"], tie_word_embeddings=False, rope_theta=500000.0)
        if tiny:
            base.update(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
            base.update(num_key_value_heads=2, head_dim=16, max_position_embeddings=8192, torch_dtype="float32")
            return Shape(base, torch.float32, (512, 2048), 8, 4, 512, 2, 512, 2048, 1500)
        base.update(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32)
        base.update(num_key_value_heads=8, head_dim=128, max_position_embeddings=139264, torch_dtype="bfloat16")
        return Shape(base, torch.bfloat16, (32768, 131072), 64, 32, 32768, 8, 32768, 131072, 1024)

    @staticmethod
    def gemma(tiny: bool, tokenizer: dict[str, Any]) -> Shape:
        """Gemma 3 12B's text shape (`--tiny`: 3 layers, a 64-token window on two of them)."""
        base: dict[str, Any] = {"architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text"}
        base.update({k: tokenizer[k] for k in ("bos_token_id", "eos_token_id") if k in tokenizer})
        base.update(vocab_size=tokenizer["vocab_size"], tie_word_embeddings=True, rms_norm_eps=1e-6,
                    hidden_activation="gelu_pytorch_tanh", rope_theta=1_000_000.0, rope_local_base_freq=10_000.0,
                    query_pre_attn_scalar=256, final_logit_softcapping=None, attn_logit_softcapping=None)  # fmt: skip
        if tiny:
            base.update(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=16, sliding_window=64, sliding_window_pattern=3,
                        max_position_embeddings=8192, torch_dtype="float32")  # fmt: skip
            return Shape(base, torch.float32, (2048,), 8, 4, 512, 2, 512, 2048, 1500)
        base.update(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
                    num_key_value_heads=8, head_dim=256, sliding_window=1024, sliding_window_pattern=6,
                    rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=139264,
                    torch_dtype="bfloat16")  # fmt: skip
        return Shape(base, torch.bfloat16, (131072,), 64, 32, 32768, 8, 32768, 131072, 1024)

    @property
    def llama(self) -> bool:
        return self.model["architectures"] == ["LlamaForCausalLM"]


def write_gemma(folder: Path, model: dict[str, Any], dtype: torch.dtype, seed: int) -> None:
    """A Gemma 3 text folder's random weights (N(0, 0.02); norms 0, Gemma's 1 + w scale of 1), in
    shards of about 4 GB, made on the GPU where there is one."""
    from safetensors.torch import save_file

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator(device=device).manual_seed(seed)
    h, m, d = model["hidden_size"], model["intermediate_size"], model["head_dim"]
    q, kv = model["num_attention_heads"] * d, model["num_key_value_heads"] * d

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=g, device=device) * 0.02).to(dtype).cpu()

    def zeros(n: int) -> torch.Tensor:
        return torch.zeros(n, dtype=dtype)

    shards: list[dict[str, torch.Tensor]] = [{"model.embed_tokens.weight": normal(model["vocab_size"], h),
                                              "model.norm.weight": zeros(h)}]  # fmt: skip
    for i in range(model["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {p + "self_attn.q_proj.weight": normal(q, h), p + "self_attn.k_proj.weight": normal(kv, h),
                 p + "self_attn.v_proj.weight": normal(kv, h), p + "self_attn.o_proj.weight": normal(h, q),
                 p + "self_attn.q_norm.weight": zeros(d), p + "self_attn.k_norm.weight": zeros(d),
                 p + "mlp.gate_proj.weight": normal(m, h), p + "mlp.up_proj.weight": normal(m, h),
                 p + "mlp.down_proj.weight": normal(h, m)}  # fmt: skip
        for norm in ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                     "post_feedforward_layernorm"):  # fmt: skip
            layer[p + norm + ".weight"] = zeros(h)
        if sum(t.numel() * t.element_size() for t in shards[-1].values()) > 4 << 30:
            shards.append({})
        shards[-1].update(layer)
    weight_map: dict[str, str] = {}
    for n, shard in enumerate(shards):
        name = f"model-{n + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")


def write_model(folder: Path, shape: Shape, tokenizer: Path, seed: int) -> None:
    """The model folder: random weights (as `h3d.bench.gpu_hf.build_hf` makes them, so the
    transformers baseline rebuilds the same ones), our config.json, the tokenizer's files."""
    config = folder / "config.json"
    if config.exists() and json.loads(config.read_text()) == shape.model:
        log(f"model folder {folder} is current")
        return
    from h3d.bench.gpu_hf import build_hf

    t0 = time.perf_counter()
    if folder.exists():
        shutil.rmtree(folder)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if shape.llama:
        hf = build_hf(shape.model, shape.dtype, device, seed)
        hf.save_pretrained(folder, max_shard_size="4GB")  # type: ignore[operator]
        del hf
    else:
        folder.mkdir(parents=True)
        write_gemma(folder, shape.model, shape.dtype, seed)
    free_memory()
    config.write_text(json.dumps(shape.model, indent=1) + "\n")  # ours: rope_theta as the checkpoints have it
    (folder / "generation_config.json").unlink(missing_ok=True)
    for name in TOKENIZER_FILES:
        if (tokenizer / name).exists():
            shutil.copy(tokenizer / name, folder / name)
    log(f"wrote {folder} in {time.perf_counter() - t0:.1f} s")


def tokenizer_config(folder: Path) -> dict[str, Any]:
    """The embedded model's vocabulary size and special token ids (its config.json)."""
    raw = json.loads((folder / "config.json").read_text()) if (folder / "config.json").exists() else {}
    vocab = raw.get("vocab_size")
    if vocab is None:
        from tokenizers import Tokenizer

        vocab = Tokenizer.from_file(str(folder / "tokenizer.json")).get_vocab_size()
    return {"vocab_size": vocab, **{k: raw[k] for k in ("bos_token_id", "eos_token_id") if k in raw}}


def prompt(vocab: int, n: int, seed: int) -> list[int]:
    """n token ids drawn uniformly (the special ids below 17 left out)."""
    g = np.random.default_rng(seed)
    return g.integers(17, vocab, size=n).tolist()


# ---- the daemon and its client ------------------------------------------------------------------


class Daemon:
    """`h3d serve` on a model folder and a data folder, with nothing else set; its JSON log in
    `<data>/daemon.log`. `running`: the ones not stopped yet (killed if a phase fails)."""

    running: ClassVar[list[Daemon]] = []

    def __init__(self, model: Path, data: Path, log_name: str = "daemon.log", flags: Sequence[str] = ()) -> None:
        data.mkdir(parents=True, exist_ok=True)
        self.sock = data / "h3d.sock"
        self.log_path = data / log_name
        cmd = [sys.executable, "-m", "h3d.cli", "serve", "--model", str(model), "--data-dir", str(data),
               "--socket", str(self.sock), *flags]  # fmt: skip
        self.out = self.log_path.open("w")
        self.t0 = time.perf_counter()
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=subprocess.STDOUT, text=True)
        Daemon.running.append(self)
        self.listening = self.wait_for("listening", READY_TIMEOUT_S)
        self.spawn_to_ready_s = time.perf_counter() - self.t0

    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in self.log_path.read_text().splitlines():
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(event, dict):
                out.append(event)
        return out

    def event(self, name: str) -> dict[str, Any] | None:
        return next((e for e in self.events() if e.get("event") == name), None)

    def wait_for(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.event(name)
            if found is not None:
                return found
            if self.proc.poll() is not None:
                tail = self.log_path.read_text().splitlines()[-15:]
                raise SystemExit(f"h3d serve exited ({self.proc.returncode}) before {name!r}:\n" + "\n".join(tail))
            time.sleep(0.2)
        self.proc.kill()
        raise SystemExit(f"h3d serve: no {name!r} event after {timeout:.0f} s (log: {self.log_path})")

    def stop(self, timeout: float = 300.0) -> float:
        """SIGTERM; the seconds until it exited."""
        t0 = time.perf_counter()
        if self in Daemon.running:
            Daemon.running.remove(self)
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            log(f"h3d serve did not exit within {timeout:.0f} s of SIGTERM: killed")
        self.out.close()
        return time.perf_counter() - t0


@dataclass(slots=True)
class Stream:
    """One Generate as the client saw it: when it was sent, and when each token arrived."""

    sent: float
    arrivals: list[float]

    @property
    def ttft_s(self) -> float:
        return self.arrivals[0] - self.sent

    def gaps_ms(self, since: float = 0.0, until: float = float("inf")) -> list[float]:
        """Inter-token gaps (ms) of the tokens that arrived within [since, until]."""
        a = self.arrivals
        return [(a[i] - a[i - 1]) * 1e3 for i in range(1, len(a)) if since <= a[i] <= until]


class Client:
    """The project's stubs on the daemon's socket."""

    def __init__(self, sock: Path) -> None:
        import grpc

        from h3d._proto.h3.v1 import h3_pb2 as pb
        from h3d._proto.h3.v1 import h3_pb2_grpc as rpc

        options = [("grpc.max_send_message_length", 64 << 20), ("grpc.max_receive_message_length", 64 << 20)]
        self.channel = grpc.insecure_channel(f"unix:{sock}", options=options)
        self.pb, self.h3, self.admin = pb, rpc.H3Stub(self.channel), rpc.H3AdminStub(self.channel)

    def config(self) -> dict[str, Any]:
        return json.loads(self.admin.GetConfig(self.pb.GetConfigRequest()).json)

    def session(self, policy: str) -> str:
        return self.h3.CreateSession(self.pb.CreateSessionRequest(policy=policy)).session_id

    def refused(self, what: str, call: Any, *args: Any) -> bool:
        """call(*args); True where the daemon refused it for want of room (RESOURCE_EXHAUSTED: the tiers
        or the device's digests cannot hold it), logged with its message; other errors raised."""
        import grpc

        try:
            call(*args)
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise
            log(f"{what} refused: {e.details()}")
            return True
        return False

    def append(self, sid: str, ids: list[int]) -> float:
        t0 = time.perf_counter()
        for _ in self.h3.AppendContext(self.pb.AppendContextRequest(session_id=sid, token_ids=ids)):
            pass
        return time.perf_counter() - t0

    def generate(self, sid: str, first: int | None, tokens: int) -> Stream:
        """`tokens` tokens after the prompt token `first` (None: a continuation, no prompt)."""
        sampling = self.pb.SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        stream = Stream(time.perf_counter(), [])
        prompt = [] if first is None else [first]
        request = self.pb.GenerateRequest(session_id=sid, prompt_token_ids=prompt, sampling=sampling)
        for msg in self.h3.Generate(request):
            if msg.HasField("delta"):
                now = time.perf_counter()
                stream.arrivals += [now] * max(1, len(msg.delta.token_ids))
        return stream

    def stats(self) -> Any:
        return self.h3.GetStats(self.pb.GetStatsRequest())

    def close(self, sid: str, purge: bool = True) -> None:
        self.h3.CloseSession(self.pb.CloseSessionRequest(session_id=sid, purge=purge))

    def tokens(self, sid: str) -> list[int]:
        return list(self.h3.GetSession(self.pb.GetSessionRequest(session_id=sid, with_tokens=True)).token_ids)

    def window_tokens(self, sid: str) -> int:
        return int(self.h3.GetSession(self.pb.GetSessionRequest(session_id=sid)).window_tokens)

    def parked(self, sid: str, timeout_s: float = 300.0) -> float:
        """Wait until a closed session's KV is in the archive only (the daemon parks it once
        write-behind wrote it; blocks shared with other sessions stay where they are: for a
        session that shares none); returns the seconds waited."""
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < timeout_s:
            r = self.h3.GetSession(self.pb.GetSessionRequest(session_id=sid)).residency
            if not r.hbm_blocks and not r.ddr_blocks:
                break
            time.sleep(0.05)
        return time.perf_counter() - t0


def parallel(fn: Any, items: list[Any]) -> list[Any]:
    """fn(item) for each item, each on a thread of its own (concurrent streams); the first error
    any of them met is raised here once all have ended."""
    out: list[Any] = [None] * len(items)
    errors: list[BaseException] = []

    def run(i: int) -> None:
        try:
            out[i] = fn(items[i])
        except BaseException as e:  # (raised below, in the caller's thread)
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(items))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


# ---- the engine-level run -----------------------------------------------------------------------


def engine_config(daemon: dict[str, Any], data: Path) -> Any:
    """The daemon's engine configuration (GetConfig's JSON), `auto` keys replaced by what it
    resolved, with its own archive and token logs under `data`."""
    from h3d.config import EngineConfig
    from h3d.daemon.config import ENGINE_KEYS

    keys = {k: v for k, v in daemon.items() if k in ENGINE_KEYS}
    keys.update(daemon.get("resolved", {}))
    for k, v in keys.items():
        if isinstance(v, list):
            keys[k] = tuple(v)
    keys.update(ssd_path=str(data / "archive"), session_log_path=str(data / "sessions"))
    return EngineConfig.build(**keys)


# Where an in-process step's time goes: between steps (`Engine.upkeep`: graphs captured, parked
# sessions, the archive's capacity), the plan (allocations, HBF's selections), the forward's launch
# or replay (`ModelRunner.execute`), the runner's commit
# (reads counted, picks promoted, windows), the engine's (sampling: it waits for the device), and
# Python's garbage collection after it (the daemon's `Collector`: what exists frozen as the timed
# loop begins, the due generation collected between steps, as the daemon's engine thread collects).
STEP_PHASES = ("upkeep", "plan", "execute", "runner_commit", "commit", "gc")
# Inside the runner's commit: the lagged picks read back, this step's picks resolved (to the host
# now, or lagged), their promotion, DDR-only blocks back into HBM, the tiers' end of step; the
# launches of the mover's copies between HBM and DDR wherever they are made (most inside `promote`);
# and, between the two commits, HBM moved toward the fair shares (`Engine._rebalance`).
COMMIT_PARTS = ("picks", "resolve", "promote", "fill_hbm", "end_step", "copies", "rebalance")


@contextlib.contextmanager
def timed_phases(engine: Any, into: dict[str, float]) -> Any:
    """Add each phase's seconds to `into` while the block runs (instance attributes wrapped)."""
    runner = engine.runner
    owners = {"upkeep": engine, "plan": runner, "execute": runner, "runner_commit": runner, "commit": engine,
              "picks": runner.graphs, "resolve": runner.graphs, "promote": engine.kv,
              "fill_hbm": engine.kv.promoter, "end_step": runner.tiers, "copies": engine.kv.tiers.mover,
              "rebalance": engine.kv}  # fmt: skip
    names = {"runner_commit": "commit", "copies": "_copy"}
    saved = []
    for phase, owner in owners.items():
        name = names.get(phase, phase)
        fn = getattr(owner, name)

        def wrap(*a: Any, _fn: Any = fn, _phase: str = phase, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return _fn(*a, **kw)
            finally:
                into[_phase] += time.perf_counter() - t0

        setattr(owner, name, wrap)
        saved.append((owner, name))
    try:
        yield
    finally:
        for owner, name in saved:
            delattr(owner, name)


class Local:
    """The same requests on an in-process `Engine` (no daemon, no gRPC)."""

    def __init__(self, config: Any) -> None:
        from h3d.daemon.collector import Collector
        from h3d.engine.engine import Engine

        self.engine = Engine(config)
        self.warmup = self.engine.warm()
        self.sync = torch.cuda.synchronize if self.engine.runner.device.type == "cuda" else (lambda: None)
        self.collector = Collector()

    @contextlib.contextmanager
    def collecting(self) -> Any:
        """Python's collector as the daemon runs it while the block runs: what exists frozen and
        automatic collection off (`Collector.start`), the due generation collected between steps
        (`collect`), so that the engine's figures and the daemon's pay for collection alike; as
        before after it."""
        import gc

        self.collector.start()
        try:
            yield
        finally:
            self.collector.stop()
            gc.unfreeze()  # (else what the engine drops later, its device memory too, would never be freed)

    def collect(self, into: dict[str, float]) -> None:
        """Between steps: the generation due, if any (the daemon's `Collector.due`), timed as `gc`."""
        t0 = time.perf_counter()
        self.collector.due()
        into["gc"] += time.perf_counter() - t0

    def session(self, policy: str) -> Any:
        return self.engine.create_session(policy=policy)

    def append(self, sid: Any, ids: list[int]) -> float:
        t0 = time.perf_counter()
        self.engine.append(sid, token_ids=ids)
        self.sync()
        return time.perf_counter() - t0

    def params(self, tokens: int) -> Any:
        return self.engine.with_sampling(max_tokens=tokens, temperature=0.0, ignore_eos=True)

    def generate(self, sid: Any, first: int, tokens: int) -> Stream:
        """One generation; `self.phases` gets, per token, where the engine's time went since the
        token before (`STEP_PHASES`, ms): a slow gap's phase says whether the host or the device took it."""
        from h3d.engine.session import TokenDelta

        current = dict.fromkeys(STEP_PHASES + COMMIT_PARTS, 0.0)
        self.phases: list[list[float]] = []
        with self.collecting(), timed_phases(self.engine, current):
            stream = Stream(time.perf_counter(), [])
            for event in self.engine.generate(sid, token_ids=[first], params=self.params(tokens)):
                if isinstance(event, TokenDelta):
                    stream.arrivals.append(time.perf_counter())
                    self.phases.append([round(current[p] * 1e3, 3) for p in STEP_PHASES + COMMIT_PARTS])
                    current.update(dict.fromkeys(STEP_PHASES + COMMIT_PARTS, 0.0))
                    self.collect(current)  # between steps: the next token's gap
        return stream

    def generate_many(
        self, sids: list[Any], firsts: list[int], tokens: int, around: Any = contextlib.nullcontext
    ) -> list[Stream]:
        """One Generate per session, all in flight together (the engine batches them); `around()`
        is a context the steps run in (not the first tokens' appends)."""
        from h3d.engine.session import TokenDelta

        for sid, first in zip(sids, firsts, strict=True):
            self.engine.append(sid, token_ids=[first])
        current = dict.fromkeys(STEP_PHASES + COMMIT_PARTS, 0.0)
        self.phases = []  # per step, as `generate` keeps them per token
        with self.collecting():
            rids = {self.engine.submit(sid, generate=True, params=self.params(tokens)): i for i, sid in enumerate(sids)}
            streams = [Stream(time.perf_counter(), []) for _ in sids]
            with timed_phases(self.engine, current), around():
                while self.engine.has_work:
                    self.engine.upkeep()
                    for event in self.engine.step():
                        if isinstance(event, TokenDelta) and event.request_id in rids:
                            streams[rids[event.request_id]].arrivals.append(time.perf_counter())
                    self.phases.append([round(current[p] * 1e3, 3) for p in STEP_PHASES + COMMIT_PARTS])
                    current.update(dict.fromkeys(STEP_PHASES + COMMIT_PARTS, 0.0))
                    self.collect(current)  # between steps: the next step's
        return streams

    def close(self, sid: Any) -> None:
        self.engine.close_session(sid, purge=True)

    def shutdown(self) -> None:
        self.engine.close()
        del self.engine
        free_memory()


# ---- figures ------------------------------------------------------------------------------------


def trace_kernels(folder: Path, engine: Any, fn: Callable[[Any], list[Stream]]) -> dict[str, Any]:
    """fn(around)'s steps under torch.profiler (fn runs its steps inside `around()`): the table by
    device time to `folder`/many-kernels.txt; the kernels' (and copies') milliseconds per step, the
    ten longest kernels by name, and the blocks `engine`'s tiers moved per step, by reason."""
    from torch.profiler import ProfilerActivity, profile

    folder.mkdir(parents=True, exist_ok=True)
    cuda = torch.cuda.is_available()
    prof = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
    tiers = engine.kv.tiers
    before: dict[str, int] = {}

    @contextlib.contextmanager
    def around() -> Any:
        before.update(moved(tiers))
        with prof:
            yield
        if cuda:
            torch.cuda.synchronize()

    streams = fn(around)
    steps = max(1, max(len(s.arrivals) for s in streams))
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    (folder / "many-kernels.txt").write_text(prof.key_averages().table(sort_by=key, row_limit=40,
                                                                       max_name_column_width=90))  # fmt: skip
    by_name, copies = device_times_us(prof)
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:10]
    after = moved(tiers)
    return {
        "steps": steps,
        "kernels_ms_per_step": round(sum(by_name.values()) / steps / 1e3, 3),
        "copies_ms_per_step": round(copies / steps / 1e3, 3),
        "top_ms_per_step": {name[:90]: round(us / steps / 1e3, 3) for name, us in top},
        "blocks_per_step": {k: round((after[k] - before[k]) / steps, 1) for k in after},
    }


def moved(tiers: Any) -> dict[str, int]:
    """The tiers' cumulative block moves and reads below HBM: copies by the mover (all reasons; up
    are HBF's promotions and the fair shares' fills), the fair shares' moves (both ways), demotions,
    blocks read from below HBM."""
    c = tiers.counters
    return {
        "copied_up": tiers.mover.copied["up"],
        "copied_down": tiers.mover.copied["down"],
        "rebalanced": c.hbm_rebalance_count,
        "demoted": c.hbm_evict_count,
        "read_below_hbm": c.hbm_misses,
    }


def itl(gaps: list[float]) -> dict[str, float | None]:
    if not gaps:
        return {"itl_ms_p50": None, "itl_ms_p99": None, "itl_ms_mean": None}
    a = np.array(gaps)
    return {
        "itl_ms_p50": round(float(np.percentile(a, 50)), 3),
        "itl_ms_p99": round(float(np.percentile(a, 99)), 3),
        "itl_ms_mean": round(float(a.mean()), 3),
    }


def bandwidths(device: torch.device) -> dict[str, float | None]:
    """HBM copy GB/s (read + write) and pinned host-to-device GB/s, measured now
    (`h3d.bench.gpu_base.ceilings`; on the CPU a DRAM copy, and no PCIe)."""
    cuda = device.type == "cuda"
    c = ceilings((4 << 30) if cuda else (64 << 20), 1 << 30, device)
    return {"hbm_gbps": c["hbm_copy_gbps"], "pcie_gbps": c["h2d_gbps"]}


def block_bytes(config: dict[str, Any], model: dict[str, Any], element: int) -> int:
    """One layer's block of K and V (`h3d.kv.sizing.slot_bytes`)."""
    return slot_bytes(int(config["block_size"]), model["num_key_value_heads"], model["head_dim"], element)


def floor_fields(
    before: Any, after: Any, steps: int, weights: int, block: int, bw: dict[str, float | None]
) -> dict[str, Any]:
    """What a step read, from the daemon's counters (GetStats before and after `steps` steps),
    and the time those bytes take at the measured bandwidths; beside it, what the tiers copied
    between HBM and DDR per step (not in the floor: the reads' floor is what the step must do)."""
    g0, g1 = getattr(before, "global"), getattr(after, "global")
    steps = max(1, steps)
    hbm_kv = (g1.hbm_hits - g0.hbm_hits) * block / steps
    pcie = (g1.fetch_bytes - g0.fetch_bytes) / steps
    hbm_gbps, pcie_gbps = bw["hbm_gbps"], bw["pcie_gbps"]
    assert hbm_gbps
    floor_s = (weights + hbm_kv) / (hbm_gbps * 1e9) + (pcie / (pcie_gbps * 1e9) if pcie_gbps else 0.0)
    return {
        "floor_ms": round(floor_s * 1e3, 3),
        "weights_bytes": weights,
        "hbm_kv_bytes_read": int(hbm_kv),
        "pcie_bytes": int(pcie),
        "copy_up_bytes": int((g1.copy_up_bytes - g0.copy_up_bytes) / steps),
        "copy_down_bytes": int((g1.copy_down_bytes - g0.copy_down_bytes) / steps),
        "hbm_gbps": hbm_gbps,
        "pcie_gbps": pcie_gbps,
    }


def weight_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.glob("*.safetensors"))


# ---- phases -------------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    args: argparse.Namespace
    shape: Shape
    model_dir: Path
    data: dict[str, Any]
    device: torch.device

    def data_dir(self, name: str) -> Path:
        path = self.args.work / name
        if path.exists():
            shutil.rmtree(path)
        return path

    def record(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.data.setdefault("runs", {})[key] = {
            "date": dt.date.today().isoformat(),
            "command": " ".join(["python -m h3d.bench.serve", *self.args.argv]),
        }
        save(self.args.out, self.data)

    def vocab(self) -> int:
        return int(self.shape.model["vocab_size"])


def sessions_in_memory(config: dict[str, Any], shape: Shape, tokens: int) -> int:
    """How many sessions of `tokens` tokens the daemon's HBM and DDR (as it sized them) hold,
    every layer's KV counted (a sliding-window layer's too: a bound from below)."""
    resolved = config.get("resolved", {})
    room = (float(resolved.get("hbm_mb", 0)) + float(resolved.get("ddr_mb", 0))) * 2**20
    element = torch.finfo(shape.dtype).bits // 8
    blocks = -(-tokens // int(config["block_size"])) * shape.model["num_hidden_layers"]
    return int(room // (blocks * block_bytes(config, shape.model, element)))


def start(run: Run, name: str) -> tuple[Daemon, Client, dict[str, Any]]:
    log(f"starting h3d serve ({name})")
    daemon = Daemon(run.model_dir, run.data_dir(name), flags=run.args.daemon_flag or ())
    client = Client(daemon.sock)
    config = client.config()
    warmed = daemon.event("warmed") or {}
    log(f"ready in {daemon.listening.get('ready_s')} s (spawn to ready {daemon.spawn_to_ready_s:.1f} s); "
        f"resolved {config.get('resolved')}; warm-up {warmed}")  # fmt: skip
    run.data["ready_s"] = daemon.listening.get("ready_s")
    run.data["warmup"] = {k: v for k, v in warmed.items() if k not in ("event", "timestamp", "level", "logger")}
    return daemon, client, config


def phase_single(run: Run) -> None:
    shape, steps = run.shape, run.args.steps or run.shape.steps
    daemon, client, config = start(run, "single")
    out: dict[str, Any] = {m: {} for m in MODES}
    element = torch.finfo(shape.dtype).bits // 8
    counters: dict[tuple[str, int], tuple[Any, Any, int]] = {}
    captures0 = client.stats().graphs.captures_after_ready
    for mode in MODES:
        for ctx in shape.contexts:
            ids = prompt(run.vocab(), ctx, ctx)
            sid = client.session(mode)
            append_s = client.append(sid, ids)
            before = client.stats()
            stream = client.generate(sid, ids[0], steps + 1)
            after = client.stats()
            hit = next(s.hbm_hit_rate for s in after.sessions if s.session_id == sid)
            counters[(mode, ctx)] = (before, after, len(stream.arrivals))
            g = getattr(after, "global")  # the session's KV (the earlier ones are closed: in the archive only)
            out[mode][str(ctx)] = {
                "append_s": round(append_s, 3), "ttft_s": round(stream.ttft_s, 4), **itl(stream.gaps_ms()),
                "tokens": len(stream.arrivals), "hbm_hit_rate": round(hit, 4), "hbm_used_bytes": g.hbm_used_bytes,
                "ddr_used_bytes": g.ddr_used_bytes, "window_hbm_bytes": g.window_hbm_bytes,
                "gaps_ms": [round(x, 2) for x in stream.gaps_ms()],  # each step's, in order: where the p99 comes from
            }  # fmt: skip
            client.close(sid)
            log(f"daemon {mode} {ctx}: {out[mode][str(ctx)]}")
    stats = client.stats()
    run.data["graph_captures_after_ready"] = stats.graphs.captures_after_ready - captures0
    run.data["graphs"] = {"captures_total": stats.graphs.captures_total, "warm_graphs": stats.graphs.warm_graphs,
                          "eager_steps_total": stats.graphs.eager_steps_total}  # fmt: skip
    log(f"daemon stopped in {daemon.stop():.1f} s")

    local = Local(engine_config(config, run.data_dir("single-engine")))
    for mode in MODES:
        for ctx in shape.contexts:
            ids = prompt(run.vocab(), ctx, ctx)
            sid = local.session(mode)
            append_s = local.append(sid, ids)
            stream = local.generate(sid, ids[0], steps + 1)
            local.close(sid)
            fields = itl(stream.gaps_ms())
            out[mode][str(ctx)].update(
                engine_append_s=round(append_s, 3), engine_ttft_s=round(stream.ttft_s, 4),
                engine_itl_ms_p50=fields["itl_ms_p50"], engine_itl_ms_mean=fields["itl_ms_mean"],
                engine_gaps_ms=[round(x, 2) for x in stream.gaps_ms()],
                engine_phases_ms=local.phases[1:],  # per gap: `STEP_PHASES`, then `COMMIT_PARTS`
            )  # fmt: skip
            gaps = stream.gaps_ms()
            names = STEP_PHASES + COMMIT_PARTS
            for i in sorted(range(len(gaps)), key=gaps.__getitem__)[-4:]:
                parts = ", ".join(f"{p} {v:.2f}" for p, v in zip(names, local.phases[i + 1], strict=True))
                log(f"  slow gap {i}: {gaps[i]:.2f} ms: {parts}")
            log(f"engine {mode} {ctx}: append {append_s:.3f} s, itl p50 {fields['itl_ms_p50']} ms")
    local.shutdown()
    bw = bandwidths(run.device)
    weights = weight_bytes(run.model_dir)
    block = block_bytes(config, shape.model, element)
    for (mode, ctx), (before, after, tokens) in counters.items():
        fields = floor_fields(before, after, tokens, weights, block, bw)
        out[mode][str(ctx)].update(floor_ms=fields["floor_ms"], hbm_kv_bytes_read=fields["hbm_kv_bytes_read"],
                                   pcie_bytes=fields["pcie_bytes"])  # fmt: skip
    run.data["bandwidths"] = bw
    run.record("single", out)
    if not run.args.no_hf and shape.llama:
        run.record("hf_dynamic", hf_dynamic(run, steps))


def hf_dynamic(run: Run, steps: int) -> dict[str, Any]:
    """transformers' LlamaForCausalLM (sdpa) with a DynamicCache: the same weights and prompts."""
    from h3d.bench.gpu_hf import build_hf, forward_kw, hf_prefill

    shape = run.shape
    model = build_hf(shape.model, shape.dtype, run.device, run.args.seed)
    kw, _ = forward_kw(model)
    sync = torch.cuda.synchronize if run.device.type == "cuda" else (lambda: None)
    out: dict[str, Any] = {}
    with torch.inference_mode():
        for ctx in (1024, *shape.contexts):  # the first: a warm-up
            prefill_s, tok, cache = hf_prefill(model, prompt(run.vocab(), ctx, ctx), run.device)
            times = []
            for _ in range(min(steps, 16)):
                sync()
                t0 = time.perf_counter()
                tok = model(input_ids=tok, use_cache=True, **{kw: cache}).logits[:, -1:].argmax(-1)
                sync()
                times.append(time.perf_counter() - t0)
            del cache
            free_memory()
            if ctx in shape.contexts:
                out[str(ctx)] = {"prefill_s": round(prefill_s, 3),
                                 "decode_ms_per_tok": round(float(np.median(times)) * 1e3, 3)}  # fmt: skip
                log(f"transformers {ctx}: {out[str(ctx)]}")
    del model
    free_memory()
    return out


def phase_many(run: Run) -> None:
    shape, steps = run.shape, run.args.steps or run.shape.steps
    n, ctx = run.args.many or shape.many, shape.many_context
    daemon, client, config = start(run, "many")
    fits = sessions_in_memory(config, shape, ctx)
    if n > fits:
        what = (f"{n} sessions of {ctx} tokens hold more KV than the daemon's HBM and DDR (at most {fits} fit; "
                "the rest would be read from the archive)")  # fmt: skip
        if not run.args.many:  # the shape's default: a host with less memory than it was chosen for
            daemon.stop()
            raise SystemExit(f"many: {what}; pass --many {fits} (or fewer), or --many {n} to run it anyway")
        log(f"warning: {what}")
    sids = [client.session("attention_entropy") for _ in range(n)]
    t0 = time.perf_counter()
    refused: dict[str, list[int]] = {"appends": [], "generates": []}  # sessions the daemon refused (1-based)
    for i, sid in enumerate(sids):
        if client.refused(f"session {i + 1}", client.append, sid, prompt(run.vocab(), ctx, 1000 + i)):
            refused["appends"].append(i + 1)
    log(f"{n} appends of {ctx} in {time.perf_counter() - t0:.1f} s ({len(refused['appends'])} refused)")
    before = client.stats()
    t0 = time.perf_counter()
    todo = [i for i in range(n) if i + 1 not in refused["appends"]]

    def one(i: int) -> Stream | None:
        stream: list[Stream] = []
        if client.refused(f"session {i + 1}", lambda: stream.append(client.generate(sids[i], 100 + i, steps + 1))):
            refused["generates"].append(i + 1)
            return None
        return stream[0]

    streams = [s for s in parallel(one, todo) if s is not None]
    wall = time.perf_counter() - t0
    if not streams:
        raise SystemExit(f"many: the daemon refused every session ({refused})")
    after = client.stats()
    tokens = sum(len(s.arrivals) for s in streams)
    gaps = [g for s in streams for g in s.gaps_ms()]
    rate = {s.session_id: s.hbm_hit_rate for s in after.sessions}
    decoded = [sids[i] for i in todo if i + 1 not in refused["generates"]]
    hits = [rate[sid] for sid in decoded if sid in rate]  # in the sessions' order of arrival
    for sid in sids:
        client.close(sid)
    out: dict[str, Any] = {"sessions": n, "context": ctx, "tokens_per_s": round(tokens / wall, 2), **itl(gaps)}
    if refused["appends"] or refused["generates"]:  # (the in-process half runs as many as decoded here)
        out["refused"] = {k: sorted(v) for k, v in refused.items()}
        n = out["decoding"] = len(streams)
    out.update(hbm_hit_rate_min=round(min(hits), 4), hbm_hit_rate_mean=round(float(np.mean(hits)), 4))
    out["hbm_hit_rates"] = [round(h, 3) for h in hits]
    g0, g1 = getattr(before, "global"), getattr(after, "global")
    out["hbm_rebalance_blocks"] = g1.hbm_rebalance_count - g0.hbm_rebalance_count
    # The daemon's own HBF planning per step (promotion, copies excluded), recent steps' quantiles
    out["hbf_latency_us_p50"], out["hbf_latency_us_p99"] = g1.hbf_latency_us_p50, g1.hbf_latency_us_p99
    log(f"daemon many: {out}")
    log(f"daemon stopped in {daemon.stop():.1f} s")
    # The daemon's half recorded now: a run cut short in the in-process half keeps it.
    run.record("many", {**out, "in_process": "not ended"})

    local = Local(engine_config(config, run.data_dir("many-engine")))
    lsids = [local.session("attention_entropy") for _ in range(n)]
    for i, sid in enumerate(lsids):
        local.append(sid, prompt(run.vocab(), ctx, 1000 + i))
    profiler = cProfile.Profile() if run.args.profile else None
    t0 = time.perf_counter()
    with profiler or contextlib.nullcontext():
        lstreams = local.generate_many(lsids, [100 + i for i in range(n)], steps + 1)
    lwall = time.perf_counter() - t0
    if profiler is not None:
        with open(run.args.profile, "w") as f:
            stats = pstats.Stats(profiler, stream=f).strip_dirs()
            stats.sort_stats("cumulative").print_stats(80)
            stats.sort_stats("tottime").print_stats(60)
    out["engine_tokens_per_s"] = round(sum(len(s.arrivals) for s in lstreams) / lwall, 2)
    out["engine_itl_ms_p50"] = itl([g for s in lstreams for g in s.gaps_ms()])["itl_ms_p50"]
    # Where a step's time went, in process: each phase's median over the steps after the first
    # few (the batch's eager steps and its graph's capture), and every step's phases.
    names = STEP_PHASES + COMMIT_PARTS
    steady = local.phases[4:] or local.phases
    out["engine_phases_ms_p50"] = {p: round(float(np.median([x[i] for x in steady])), 2) for i, p in enumerate(names)}
    out["engine_steps_phases_ms"] = local.phases
    # HBF's planning per step in process (`Promoter.latency_us`: promotion without its copies), to
    # set beside the `promote` phase, which has the copies' launches (`copies`) too
    out["engine_hbf_latency_us_p50"], out["engine_hbf_latency_us_p99"] = local.engine.kv.promoter.latency_us()
    log(f"engine many, step phases p50 (ms): {out['engine_phases_ms_p50']}")
    if run.args.trace is not None:  # a few more steps, their kernels under torch.profiler
        out["engine_kernels"] = trace_kernels(
            run.args.trace, local.engine, lambda around: local.generate_many(lsids, [7] * n, 9, around)
        )
    local.shutdown()
    bw = bandwidths(run.device)
    element = torch.finfo(shape.dtype).bits // 8
    steps_run = max(1, tokens // n)
    out.update(floor_fields(before, after, steps_run, weight_bytes(run.model_dir),
                            block_bytes(config, shape.model, element), bw))  # fmt: skip
    log(f"many: {out}")
    run.record("many", out)


def phase_prefill_under_load(run: Run) -> None:
    shape = run.shape
    n, ctx, long = shape.load_sessions, shape.load_context, shape.long_context
    daemon, client, _ = start(run, "prefill-under-load")
    ids = prompt(run.vocab(), long, long)
    alone_sid = client.session("attention_entropy")
    alone = client.append(alone_sid, ids)
    client.close(alone_sid)
    sids = [client.session("attention_entropy") for _ in range(n)]
    for i, sid in enumerate(sids):
        client.append(sid, prompt(run.vocab(), ctx, 2000 + i))
    window: dict[str, float] = {}
    long_sid = client.session("attention_entropy")

    def appender() -> None:
        time.sleep(3.0)  # the streams are decoding (and their batch's graph captured)
        window["start"] = time.perf_counter()
        window["append_s"] = client.append(long_sid, ids)
        window["end"] = time.perf_counter()

    t = threading.Thread(target=appender)
    t.start()
    # The streams outlast the append (it starts 3 s into them).
    streams = parallel(lambda i: client.generate(sids[i], 200 + i, shape.load_tokens), list(range(n)))
    t.join()
    during = [g for s in streams for g in s.gaps_ms(window["start"], window["end"])]
    before = [g for s in streams for g in s.gaps_ms(0.0, window["start"])]
    out = {
        "sessions": n, "context": ctx, "long_context": long, "append_s": round(window["append_s"], 3),
        "append_alone_s": round(alone, 3), "itl_ms_p99": itl(during)["itl_ms_p99"],
        "itl_ms_max": round(max(during), 1) if during else None, "itl_ms_p50_before": itl(before)["itl_ms_p50"],
        "tokens_during": len(during),
    }  # fmt: skip
    for sid in [*sids, long_sid]:
        client.close(sid)
    log(f"prefill under load: {out}")
    log(f"daemon stopped in {daemon.stop():.1f} s")
    run.record("prefill_during_decode", out)


RESTART_SESSIONS = 4  # sessions of `many_context` beside the one of `long_context`


def disk_figures(folder: Path, gib: float) -> dict[str, Any]:
    """The work folder's file system: its size and free space (`df`), and `gib` GiB written in
    16 MiB pieces and fsynced, then read back cold (its pages dropped from the page cache with
    posix_fadvise DONTNEED) and warm."""
    folder.mkdir(parents=True, exist_ok=True)
    fs = os.statvfs(folder)
    out: dict[str, Any] = {"fs_gb": round(fs.f_blocks * fs.f_frsize / 1e9, 1),
                           "free_gb": round(fs.f_bavail * fs.f_frsize / 1e9, 1)}  # fmt: skip
    path, piece = folder / "disk-test.bin", os.urandom(16 << 20)
    n = max(1, int(gib * 1024 / 16))
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        t0 = time.perf_counter()
        for _ in range(n):
            os.write(fd, piece)
        os.fsync(fd)
        out["write_gbps"] = round(n * len(piece) / (time.perf_counter() - t0) / 1e9, 2)
    finally:
        os.close(fd)
    for kind in ("cold", "warm"):
        fd = os.open(path, os.O_RDONLY)
        try:
            if kind == "cold":
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            t0 = time.perf_counter()
            while os.read(fd, 16 << 20):
                pass
            out[f"read_{kind}_gbps"] = round(n * len(piece) / (time.perf_counter() - t0) / 1e9, 2)
        finally:
            os.close(fd)
    path.unlink()
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def drop_page_cache(folder: Path) -> int:
    """Drop the pages of every file under `folder` from the page cache (posix_fadvise DONTNEED:
    clean pages go); returns the bytes of the files."""
    total = 0
    for path in folder.rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                total += os.fstat(fd).st_size
            finally:
                os.close(fd)
    return total


def wait_written(client: Client, timeout: float) -> dict[str, Any]:
    """Until write-behind has brought the dirty KV within its budget with nothing in flight (or
    `timeout`): the seconds, the bytes it wrote meanwhile and the dirty bytes left."""
    g0 = getattr(client.stats(), "global")
    budget = float(client.config().get("write_behind_dirty_mb", 0)) * 2**20
    t0 = time.perf_counter()
    g = g0
    while time.perf_counter() - t0 < timeout:
        g = getattr(client.stats(), "global")
        if g.dirty_bytes <= budget and g.write_behind_in_flight_bytes == 0:
            break
        time.sleep(0.5)
    took = time.perf_counter() - t0
    written = g.write_behind_bytes - g0.write_behind_bytes
    return {"drain_s": round(took, 1), "written_gb": round(written / 1e9, 2),
            "write_behind_gbps": round(written / took / 1e9, 2) if took > 0 else None,
            "dirty_gb_left": round(g.dirty_bytes / 1e9, 2)}  # fmt: skip


def phase_restart(run: Run) -> None:
    """SIGTERM with sessions of 4 x 32K and 1 x 128K (no stream in flight), then a restart on the same
    data folder: how long each takes, what the archive gives back, and the first tokens after it."""
    shape = run.shape
    long, ctx = shape.long_context, shape.many_context
    prompts = [prompt(run.vocab(), long, 3100)] + [prompt(run.vocab(), ctx, 3101 + i) for i in range(RESTART_SESSIONS)]
    out: dict[str, Any] = {
        "sessions": [len(p) for p in prompts],
        "disk": disk_figures(run.args.work, 0.0625 if run.args.tiny else 4),
    }
    log(f"disk: {out['disk']}")
    daemon, client, config = start(run, "restart")
    data = daemon.log_path.parent
    sids = [client.session("attention_entropy") for _ in prompts]
    t0 = time.perf_counter()
    for sid, ids in zip(sids, prompts, strict=True):
        client.append(sid, ids)
    out["append_s"] = round(time.perf_counter() - t0, 1)
    steps = run.args.steps or shape.steps
    parallel(lambda i: client.generate(sids[i], prompts[i][6], 4), list(range(len(sids))))  # the batch's graphs
    busy = parallel(lambda i: client.generate(sids[i], prompts[i][1], steps + 1), list(range(len(sids))))
    g = getattr(client.stats(), "global")
    out["dirty_gb_after_appends"] = round(g.dirty_bytes / 1e9, 2)
    out["write_behind"] = wait_written(client, 240.0)
    idle = parallel(lambda i: client.generate(sids[i], prompts[i][2], steps + 1), list(range(len(sids))))
    on, off = itl([x for st in busy for x in st.gaps_ms()]), itl([x for st in idle for x in st.gaps_ms()])
    out["itl_ms_p99_write_behind_busy"], out["itl_ms_p99_write_behind_idle"] = on["itl_ms_p99"], off["itl_ms_p99"]
    if on["itl_ms_p99"] and off["itl_ms_p99"]:
        out["write_behind_itl_p99_ratio"] = round(on["itl_ms_p99"] / off["itl_ms_p99"], 3)
    before = [client.tokens(sid) for sid in sids]
    # HBF's window of each session as the steps above left it: what the first step after the
    # restart selects within (and stages from the archive), the 128K session first
    out["window_tokens_at_sigterm"] = [client.window_tokens(sid) for sid in sids]
    g = getattr(client.stats(), "global")
    out["dirty_gb_at_sigterm"] = round(g.dirty_bytes / 1e9, 2)
    out["sigterm_s"] = round(daemon.stop(), 1)
    checkpoint = next((e for e in daemon.events() if e.get("event") == "checkpoint"), {})
    out["blocks_left_to_recompute"] = checkpoint.get("blocks_left_to_recompute")
    out["checkpoint"] = {
        k: checkpoint.get(k) for k in ("blocks_written", "seconds", "sessions_left_to_recompute", "digest_bytes")
    }
    out["archive_gb_on_disk"] = round(drop_page_cache(data / "archive") / 1e9, 1)
    log(f"restart, before: {out}")

    daemon = Daemon(run.model_dir, data, "daemon-restarted.log")
    client = Client(daemon.sock)
    events = {e.get("event"): e for e in daemon.events()}
    resolved = client.config().get("resolved", {})
    out["ready_s"] = daemon.listening.get("ready_s")
    out["spawn_to_ready_s"] = round(daemon.spawn_to_ready_s, 1)
    out["ddr_pinned_gb"] = round(float(resolved.get("ddr_mb", 0)) * 2**20 / 1e9, 1)
    out["start"] = {"model_load_s": events.get("model_loaded", {}).get("seconds"),
                    "warmed": {k: v for k, v in events.get("warmed", {}).items() if k.endswith("_s")}}  # fmt: skip
    restored = events.get("sessions_restored", {})
    after = [client.tokens(sid) for sid in sids]
    out["tokens_lost"] = sum(
        len(b) - len(a) if b[: len(a)] == a else len(b) for a, b in zip(after, before, strict=True)
    )
    # The first token of each session continued (a decode step: it reads what HBF selects; a
    # prompt of new tokens is an exact prefill, which reads every block: `follow_up` below).
    firsts = []
    g0 = getattr(client.stats(), "global")
    for sid in sids:  # the 128K session first: its blocks' pages are not cached
        firsts.append(round(client.generate(sid, None, 1).ttft_s, 3))
        if len(firsts) == 1:  # what its first token read: blocks (one layer's each) and read-ahead's share
            g1 = getattr(client.stats(), "global")
            out["resume_128k_blocks_read"] = g1.ssd_read_count - g0.ssd_read_count
            out["resume_128k_read_ahead_gb"] = round((g1.read_ahead_bytes - g0.read_ahead_bytes) / 1e9, 2)
    out["resume_first_token_s"] = firsts
    out["resume_first_token_s_128k"] = firsts[0]
    log(f"restart, first tokens: {out}")  # (the figures so far, should the run be cut short)
    # The long session's next tokens, while the rest of its KV is read back (`h3d.tiers.readahead`).
    cont = itl(client.generate(sids[0], None, 33).gaps_ms())
    out["after_resume_itl_ms_p50"], out["after_resume_itl_ms_p99"] = cont["itl_ms_p50"], cont["itl_ms_p99"]
    bs = int(config.get("block_size", 32))
    blocks = sum(-(-len(t) // bs) for t in after)
    rebuilt = restored.get("kv_rebuild_blocks", 0)
    out["archive_resume_share"] = round(1 - rebuilt / blocks, 4) if blocks else None
    out["kv_rebuild_blocks"] = rebuilt
    out["ssd_read_count"] = getattr(client.stats(), "global").ssd_read_count
    # Closed: its KV to the archive only once written (its pages now cached), reopened by the next
    # Generate (reopened before it is parked, it would find its KV where it was).
    client.close(sids[0], purge=False)
    out["park_s_128k"] = round(client.parked(sids[0]), 3)
    out["resume_warm_s_128k"] = round(client.generate(sids[0], None, 1).ttft_s, 3)
    # A question on it: the prompt token and the last one generated, an exact prefill over the 128K
    # context (its KV in the archive or read back into DDR so far).
    out["follow_up_after_resume_s_128k"] = round(client.generate(sids[0], prompts[0][4], 1).ttft_s, 3)
    # Recomputed: the same length, its first token another, so that no cached block matches it
    # (the same tokens would reuse the resumed session's blocks: a prefix hit, not a prefill).
    fresh = client.session("attention_entropy")
    again = [prompts[0][0] + 1 if prompts[0][0] + 1 < run.vocab() else prompts[0][0] - 1, *prompts[0][1:]]
    reused = client.stats().throughput.prefix_reused_tokens_total
    t0 = time.perf_counter()
    client.append(fresh, again)
    first = client.generate(fresh, prompts[0][5], 1)
    out["reprefill_s_128k"] = round(time.perf_counter() - t0, 3)
    out["reprefill_first_token_s"] = round(first.ttft_s, 3)
    out["reprefill_reused_tokens"] = client.stats().throughput.prefix_reused_tokens_total - reused
    client.close(fresh)
    for sid in sids:
        client.close(sid)
    log(f"daemon stopped in {daemon.stop():.1f} s")
    log(f"restart: {out}")
    run.record("restart", out)


# ---- the report ---------------------------------------------------------------------------------


def tokens_label(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def table(data: dict[str, Any]) -> str:
    """docs/BENCHMARKS.md's section: the figures of the newest runs of each phase."""
    lines = []
    single, hf = data.get("single"), data.get("hf_dynamic", {})
    if single:
        lines += [
            "| mode | context | append s | engine append s | transformers prefill s | TTFT s | ITL p50 / p99 / mean ms "
            "| engine ITL p50 ms | floor ms | HBM hit rate |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for mode, by_ctx in single.items():
            for ctx, f in by_ctx.items():
                base = hf.get(ctx, {}).get("prefill_s", "—") if mode == "exact" else "—"
                lines.append(
                    f"| {mode} | {tokens_label(int(ctx))} | {f['append_s']} | {f.get('engine_append_s')} | {base} "
                    f"| {f['ttft_s']} | {f['itl_ms_p50']} / {f['itl_ms_p99']} / {f['itl_ms_mean']} "
                    f"| {f.get('engine_itl_ms_p50')} | {f.get('floor_ms')} | {f['hbm_hit_rate']} |"
                )
        lines.append("")
        lines.append(f"Ready in {data.get('ready_s')} s (warm-up: {data.get('warmup')}); graphs captured after "
                     f"ready in this phase: {data.get('graph_captures_after_ready')}.")  # fmt: skip
    many = data.get("many")
    if many:
        lines += [
            "",
            f"`many`: {many['sessions']} sessions of {tokens_label(many['context'])} decoding together: "
            f"{many['tokens_per_s']} tokens/s through the daemon, {many['engine_tokens_per_s']} in-process; "
            f"ITL p50 / p99 {many['itl_ms_p50']} / {many['itl_ms_p99']} ms; HBM hit rate min / mean "
            f"{many['hbm_hit_rate_min']} / {many['hbm_hit_rate_mean']}; floor of a step {many['floor_ms']} ms.",
        ]
    load = data.get("prefill_during_decode")
    if load:
        lines += [
            "",
            f"`prefill-under-load`: a {tokens_label(load['long_context'])} append while {load['sessions']} sessions of "
            f"{tokens_label(load['context'])} decode: their ITL p99 during it {load['itl_ms_p99']} ms (max "
            f"{load['itl_ms_max']}, p50 before it {load['itl_ms_p50_before']}); the append took {load['append_s']} s "
            f"against {load['append_alone_s']} s alone.",
        ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m h3d.bench.serve", description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", action="append", choices=PHASES, help="phases to run (repeatable; default: single)")
    p.add_argument("--tiny", action="store_true", help="a tiny model and short contexts (a CPU, the test of the code)")
    p.add_argument("--shape", choices=SHAPES, default=SHAPES[0],
                   help="the model: Llama-3-8B's shape (default) or Gemma 3 12B's text model")  # fmt: skip
    p.add_argument("--model-dir", type=Path, default=None, help="where the model folder is written (reused if current)")
    p.add_argument("--tokenizer", type=Path, default=DEFAULT_TOKENIZER, help="folder with the tokenizer's files")
    p.add_argument("--work", type=Path, default=Path(".bench/serve"), help="the daemons' data folders")
    p.add_argument("--out", type=Path, default=None, help="the JSON (default bench/results/<date>-<card>-serve.json)")
    p.add_argument("--steps", type=int, default=0, help="tokens timed per stream (default 64; --tiny 8)")
    p.add_argument(
        "--many",
        type=int,
        default=0,
        help="sessions of the many phase (default 32, --tiny 4; the default is refused where the "
        "daemon's HBM and DDR hold fewer, a number given runs with a warning)",
    )
    p.add_argument("--no-hf", action="store_true", help="skip the transformers baseline")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--daemon-flag", action="append", metavar="FLAG",
                   help="a flag for the daemons (repeatable; e.g. --daemon-flag=--no-write-behind): not the "
                   "defaults, so not the product's figures; the in-process engine takes the daemon's "
                   "configuration")  # fmt: skip
    p.add_argument("--profile", type=Path, default=None,
                   help="the many phase's in-process decode under cProfile: its statistics written here "
                   "(slows the engine: its figures are then not comparable)")  # fmt: skip
    p.add_argument("--trace", type=Path, default=None,
                   help="the many phase's in-process engine decodes 8 more steps under torch.profiler: "
                   "the kernels' table written to this folder, their time and the blocks the tiers "
                   "moved per step in the JSON")  # fmt: skip
    p.add_argument("--write", type=Path, default=None, help="update this markdown file's serve section")
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    card = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    slug = "h200" if "H200" in card else ("tiny" if args.tiny else device.type)
    results = args.work if args.tiny else Path("bench/results")  # a tiny run's figures are not kept
    args.out = args.out or results / f"{dt.date.today().isoformat()}-{slug}-serve.json"
    shape = Shape.pick(args.tiny, tokenizer_config(args.tokenizer), args.shape)
    model_dir = args.model_dir or args.work / (f"model-tiny-{args.shape}" if args.tiny else f"model-{args.shape}-shape")
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.update(card=card, torch=torch.__version__, transformers=version("transformers"), model=shape.model)
    run = Run(args, shape, model_dir, data, device)
    write_model(model_dir, shape, args.tokenizer, args.seed)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    phases = {"single": phase_single, "many": phase_many, "prefill-under-load": phase_prefill_under_load,
              "restart": phase_restart}  # fmt: skip
    import grpc

    try:
        for phase in args.phase or ["single"]:
            t0 = time.perf_counter()
            try:
                phases[phase](run)
            except grpc.RpcError as e:  # the daemon refused: its status, not a traceback
                run.record(phase, {"error": f"{e.code().name}: {e.details()}"})
                print(f"h3d.bench.serve: phase {phase}: the daemon answered {e.code().name}: {e.details()}",
                      file=sys.stderr)  # fmt: skip
                return 1
            log(f"phase {phase}: {time.perf_counter() - t0:.0f} s")
    finally:
        for daemon in Daemon.running:  # a phase that failed leaves none behind
            daemon.proc.kill()
            daemon.proc.wait()
        Daemon.running.clear()
    print(table(run.data))
    if args.write is not None:
        write_section(args.write, "## `h3d serve` on the GPU, through gRPC\n\n" + table(run.data), "serve")
    return 0


if __name__ == "__main__":
    sys.exit(main())
