"""Every configuration key with its default as shown and its meaning, in one table.

The help of `h3d serve` and `h3d generate` flags comes from here ("... (default: X)"). So do the
two key tables of docs/OPERATIONS.md: they are written between marker comments
(`<!-- keys:engine -->` ... `<!-- /keys:engine -->`, `<!-- keys:daemon -->` ... `<!-- /keys:daemon -->`):

    python -m h3d.keys --write docs/OPERATIONS.md   # rewrite the tables in place
    python -m h3d.keys --check docs/OPERATIONS.md   # exit 1 if they are not current

Names are as in h3d.toml: `block_size`, `sampling.top_p`. Texts are Markdown. A `default` of
None shows the dataclass default (`h3d.config`, `h3d.daemon.config`), so the shown default cannot
drift from the real one; a text is given only where the default is not a plain value.
`help` is a shorter text for `--help` where `doc` is a paragraph.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

from h3d.config import EngineConfig, SamplingDefaults
from h3d.daemon.config import DaemonConfig


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    doc: str
    default: str | None = None
    help: str | None = None


REQUIRED = "(required)"  # the default shown for `model`

ENGINE: tuple[Key, ...] = (
    Key(
        "model",
        "Hugging Face model folder (`config.json`, `model.safetensors` or a sharded index, `tokenizer.json`)",
        default=REQUIRED,
    ),
    Key(
        "device",
        "`auto`: CUDA where torch sees a GPU, else the CPU (GetConfig shows what it chose under `resolved`); "
        "`cpu`, or `cuda` (`cuda:N` for GPU N)",
    ),
    Key("dtype", "weights, activations and KV: `fp32`, `bf16`, `fp16`", default="fp32 on cpu, bf16 on cuda"),
    Key(
        "cpu_threads",
        "CPU threads of torch's intra-op pool (OpenMP, MKL), set before the model loads and logged (the "
        "`starting` event; `stats.cpu_threads` in `h3d generate --json`). Unset or 0: `OMP_NUM_THREADS` when "
        "that is set, else the cores this process may run on (its CPU affinity: `taskset`, systemd's "
        "`CPUAffinity=`). Unless the environment sets `OMP_WAIT_POLICY` or `GOMP_SPINCOUNT`, h3d sets "
        "`OMP_WAIT_POLICY=PASSIVE`: an OpenMP thread that waits for the others sleeps instead of spinning, "
        "which keeps decode from crawling when other jobs take a core (on 2 cores with one busy, 16.5 "
        "tokens/s against 4.9 with libgomp's spinning; docs/BENCHMARKS.md, \"CPU threads on a shared "
        'host"); on a dedicated host `OMP_WAIT_POLICY=ACTIVE` in the environment gives the spin back (decode '
        "at a 2,929-token context 7.5 against 6.7 tokens/s there). On a small host fewer threads can be as "
        "fast: one decodes the 135M embedded model as fast as two",
        default="auto",
        help="CPU threads of torch (OpenMP, MKL), logged at start; unset or 0: OMP_NUM_THREADS when set, else "
        "the cores this process may run on (its CPU affinity)",
    ),
    Key("block_size", "tokens per KV block"),
    Key(
        "prefill_chunk_tokens",
        "token budget of one step's prefill chunks (decode tokens come first). A chunk longer than a slice (a "
        "power of two of tokens whose MLP activations take about 256 MiB: 4,096 for a Llama-3-8B shape in bf16) "
        "runs layer by layer, the projections and MLP slice by slice and attention once over the chunk: a "
        "prompt in one chunk makes the same attention call as transformers does for a whole prompt, reads none "
        "of its KV back from DDR, and needs beside the weights and the HBM pool about 3 x (chunk x hidden) of "
        "activations (3.1 GB for 131,072 tokens of a Llama-3-8B shape, docs/BENCHMARKS.md). Such a chunk runs "
        "in pieces between the other sessions' decode steps (`prefill_step_ms`). `auto`: on CUDA the longest "
        "context (`max_context_tokens`, else the model's; at most 131,072): a prompt is one chunk, and "
        "`hbm_mb = auto` leaves room for its activations; on a CPU 512",
        help="token budget of one step's prefill chunks (decode tokens come first); other sessions' decode "
        "steps wait for a long chunk, a smaller value interleaves them; auto: the longest context on CUDA (a "
        "prompt in one chunk), 512 on a CPU",
    ),
    Key(
        "prefill_step_ms",
        "how long a long prompt's forward (a chunk on the layer-by-layer path) runs between two steps of the "
        "other requests. Such a chunk never waits for them nor they for all of it: each engine step runs the "
        "batch of decode tokens and short chunks, then the long forward's pieces (a layer's projections, one "
        "group of KV heads' attention, one slice's MLP) until the next piece would pass this budget of the "
        "device's time. A decoding stream beside a long append waits about this plus its own step per token; "
        "the append takes about (this + one decode step) / this of its time alone. Lower: steadier "
        'inter-token times during long appends; higher: the append finishes sooner (docs/OPERATIONS.md, "A '
        'long prompt beside decoding streams")',
        help="ms a long prompt's forward runs between two steps of the decoding streams (their wait per token "
        "during a long append)",
    ),
    Key(
        "hbm_mb",
        "HBM tier: KV pool budget in MiB (GPU memory on CUDA, a separately budgeted CPU pool on a CPU host), "
        "split evenly between layers unless `dense_hbm_share` is set. `auto`: on CUDA the card's free memory "
        "once the weights are loaded, less the activations of the largest prefill chunk, 1 GiB for the "
        "captured decode steps, a margin (5 % of the card, at least 2 GiB) and the digests of every block HBM "
        "and DDR hold (1 / `digest_tokens` of the KV of the layers that select: full-attention ones past "
        "`dense_layers`; under a policy that keeps them); on a CPU 1024. The "
        "`tiers_sized` log event and GetConfig's `resolved` give the figure chosen",
        help="HBM tier: KV pool budget in MiB; auto: on CUDA the card's free memory after the weights, the "
        "largest prefill's activations, the captured steps, the digests and a margin (5 % of the card, at "
        "least 2 GiB); 1024 on a CPU",
    ),
    Key(
        "ddr_mb",
        "DDR tier: standby pool in MiB (pinned host memory on CUDA), shared by all layers; allocated lazily by "
        "the OS. On CUDA at least its first 4 GiB are registered before ready and the rest in the background, in "
        "slot order (the `ddr_pinned` event says when it is done; until then the tiers use what is registered, "
        "and a request that needs more waits for it). `auto`: on CUDA 40 % of the host's memory, at most 80 % of "
        "what is available at start; on a CPU 4096",
        help="DDR tier: standby pool in MiB (pinned host memory on CUDA); auto: 40 % of the host's memory on "
        "CUDA (at most 80 % of what is available), 4096 on a CPU",
    ),
    Key(
        "ddr_memory",
        "how the DDR pool is pinned on CUDA. `mapped`: the driver's own pinned pages (`cuMemCreate` on the "
        "host, CUDA 12.2+) mapped piece by piece into one range, which the decode kernels read in place faster "
        "(scattered reads 2 x as fast on one H100 host; `cudaHostAlloc`'s pages, which mapped ones match, 1.5 x "
        "on another: docs/BENCHMARKS.md); `registered`: pageable memory "
        "page-locked by `cudaHostRegister`; `auto`: mapped where the driver can, else registered (a `ddr_not_mapped` "
        "warning says why; GetConfig shows the way used under `resolved`). Either way "
        "the first 4 GiB are pinned before ready and the rest in the background; the `ddr_pinned` event says "
        "which was used",
        help="how the DDR pool is pinned on CUDA: mapped (the driver's pinned pages, read in place faster), "
        "registered (cudaHostRegister), or auto (mapped where the driver can)",
    ),
    Key(
        "ssd_path",
        "SSD tier: folder of the cold archive; without it, HBM + DDR must hold every session and admission "
        "refuses what does not fit",
        default="none; `h3d serve`: `<data_dir>/archive`",
    ),
    Key(
        "ssd_codec",
        "archive codec: `raw-zstd` (lossless) or `int8-delta-zstd` (per-token int8, ≤ 1/254 of each token row's "
        "max, about 4x smaller on real KV; opt-in)",
    ),
    Key(
        "quantize_skip_layers",
        "layers archived losslessly even with `int8-delta-zstd` (flag: `--quantize-skip-layers 0 1`)",
    ),
    Key(
        "promote_mb_per_step",
        "most MiB of blocks HBF promotes from DDR to HBM per decode step, all sessions together, shared equally, "
        "each session's hottest blocks first. A block read from DDR in place costs its reading heads' share of "
        "it over PCIe, a promotion the whole block: selections that change from step to step would otherwise "
        "spend the link on copies read once (on the H200 64 MiB is about 1.2 ms of PCIe)",
        help="most MiB of blocks HBF promotes from DDR to HBM per decode step, all sessions together, each "
        "session's hottest blocks first",
    ),
    Key(
        "rebalance_mb_per_step",
        "most MiB of blocks moved per decode step toward the fair shares of HBM (both ways: an active "
        "session's blocks above its share down to DDR, a session's below it up), whenever the active sessions "
        "change. Sessions that arrive when HBM is full reach their shares once the blocks they lack have come up "
        "and as many have gone down, at most half of this a step each way; the copies lengthen those steps (on "
        "the H200 1 GiB is about 20 ms of PCIe each way)",
        help="most MiB of blocks moved per decode step toward the fair shares of HBM, both ways",
    ),
    Key(
        "ddr_high_watermark",
        "fraction of DDR above which, after a step, DDR copies go: first those of blocks also in HBM, then those "
        "of blocks archived already, then the coldest blocks are written to the archive and dropped",
    ),
    Key("ssd_retry_interval_s", "how often a degraded SSD tier (full disk, I/O error) is tried again"),
    Key(
        "ssd_capacity_mb",
        "live archive records and digest snapshots the archive may hold (MiB): the snapshots on disk count, and "
        "room for the next one of each session whose digests are on the device (an eighth of its KV by default, "
        "written when it is closed, when its digests are set aside and at shutdown). Write-behind writes no batch "
        "past it; open sessions' "
        "blocks come first: closed sessions' archived KV is evicted, coldest first, to make room, and the archive "
        "compacted. Spills past `ddr_high_watermark` and the shutdown checkpoint may pass it (they must free DDR "
        "or save the sessions), so admission counts it too: a request whose KV HBM, DDR (below "
        "`ddr_high_watermark`) and the archive within it "
        "cannot hold together (a record counted at a block's raw size) is refused (RESOURCE_EXHAUSTED) once the "
        "prefix cache's and closed sessions' KV is forgotten, coldest first. `auto`: the free space of the "
        "archive's file system at start plus what the "
        "archive takes there, less 5 % of the file system (at least 1 GiB), so that write-behind never fills the "
        "disk (GetConfig shows the value it resolved to)",
        help="live archive records and digest snapshots the archive may hold (MiB), or auto: the file system's "
        "free space at start less a margin",
    ),
    Key(
        "write_behind",
        "write full KV blocks to the archive in the background (`write_behind_dirty_mb` says how many stay "
        "unwritten), so that a shutdown has little to flush and a restart resumes sessions from the archive "
        "instead of computing their KV again. On threads of their own, never blocking a step; a block's DDR copy "
        "is still dropped only once its archive write is durable",
        help="write full KV blocks to the archive in the background",
    ),
    Key(
        "write_behind_dirty_mb",
        "KV (MiB) of full blocks left without an archive copy; past it, write-behind writes the oldest (least "
        "recently used sessions first, from their first block), at most 32 MiB a step while requests run and "
        "512 MiB in flight. 0 writes every full block as it is made. What stays dirty is what SIGTERM's "
        "checkpoint writes within `shutdown_budget_s` (or a crash leaves to compute again): keep it within what "
        "the disk writes in that time",
        help="KV (MiB) of full blocks left without an archive copy; past it the oldest are written behind",
    ),
    Key(
        "read_ahead_at_start",
        "after a restart, read the restored open sessions' KV back from the archive into DDR from the start, "
        "while the daemon warms up and before their requests come, the most recently used session first: what "
        "each one's next decode step reads whatever its query (the dense layers, sinks, recent window, prompt "
        "anchors) and the blocks its last steps read most (`hbf_hot`), then the rest, below `ddr_high_watermark` "
        "(never evicting for it). Off: a session's KV is read back from its first request on, its first step "
        "reading from the archive what it selects",
        help="read the restored open sessions' KV back into DDR from the start, most recently used first",
    ),
    Key(
        "graphs_before_ready",
        "capture the warm set of decode graphs (one session at every table width, exact and selecting: 66 "
        "graphs and 8-13 s for a Llama-8B shape at 128K on H100s) before the daemon says it is ready. Off "
        "(the default): ready comes once the kernels are loaded, and the set is captured after, one graph at a "
        "time while no request runs (a request that comes meanwhile waits for the capture under way: 0.16-0.18 s "
        "a graph there); a step whose graph is not captured yet runs the same forward uncaptured (milliseconds "
        "more) and its graph is captured after two such steps",
        help="capture the warm set of decode graphs before ready (default: after, while idle)",
    ),
    Key(
        "policy",
        "which blocks a decode step reads (per session, switchable): `exact` (all, lossless), `fixed` (sinks + "
        "recent window), `layerwise` (sinks + recent + per-layer anchors: the blocks that drew most attention "
        "mass from the last 64 queries of the prompt's last prefill chunk), `attention_entropy` (sinks + recent "
        "+ each KV head's top blocks within an adaptive window of `window_tokens` per head: up to half of the "
        "room goes to the head's prompt anchors, the blocks that drew most of its attention from the prompt's "
        "last 64 queries, the rest to the top blocks by the digest bound of its query heads; the tiers keep "
        "the union of the heads' blocks readable). Anchors are kept in the session's log, so a restarted "
        "session selects as it would have. Contexts within the window read every block under any policy",
        help="which blocks a decode step reads (per session, switchable): exact (all, lossless), fixed "
        "(sinks + recent window), layerwise (sinks + recent + per-layer prompt anchors), attention_entropy "
        "(sinks + recent + each KV head's top blocks within an adaptive window)",
    ),
    Key("window_tokens", "HBF token budget per layer and step (start value of the adaptive window)"),
    Key("window_min_tokens", "lower bound of the adaptive window"),
    Key("window_max_tokens", "upper bound of the adaptive window"),
    Key("sink_blocks", "first blocks always read"),
    Key("recent_tokens", "last tokens always read (the partial block included)"),
    Key("dense_layers", "first layers that always read every block (as Quest does)"),
    Key(
        "window_keep_tokens",
        "a sliding-window layer (Gemma 3, Mistral, ...) frees its blocks once they lie this many tokens past its "
        "window: a rewind of up to that many tokens keeps the session's KV, a deeper one prefills it again from "
        "its start; each such layer holds this many tokens more per session",
    ),
    Key(
        "dense_hbm_share",
        "share of the HBM pool for the dense layers' regions together; the other layers share the rest equally. "
        "A dense layer reads every block of the context at every step, a sparse layer its window: with long "
        "contexts under HBF, HBM is worth more there (on the H200 at 128K with 3 GiB, equal regions hold 511 of "
        "each layer's 4,100 blocks: 88 % of the two dense layers' blocks sit in DDR and are read over PCIe at "
        "every step). Unset: under a selecting policy each dense layer's region holds the longest context "
        "(`max_context_tokens`, else the model's) where equal regions would hold less, the dense layers together "
        "at most half of HBM, the others sharing the rest; else equal regions. In (0, 1)",
        default="unset",
        help="share of the HBM pool for the dense layers' regions together, in (0, 1); the other layers share "
        "the rest equally. Unset: every layer's region equal",
    ),
    Key(
        "anchor_share",
        "`attention_entropy`: at most this share of the window past sinks and the recent window goes to each KV "
        "head's prompt anchors, best first; the digest bound picks the rest. 0 turns anchors off. On the 8K "
        "retrieval benchmark anchors found 17 of 25 needles at a 512-token window against 7 without them "
        "(docs/BENCHMARKS.md)",
        help="attention_entropy: at most this share of the window past sinks and the recent window goes to "
        "each KV head's prompt anchors, best first; 0 turns anchors off",
    ),
    Key(
        "digest_tokens",
        "tokens per key digest (element-wise min/max of the keys, the bound `attention_entropy` ranks blocks "
        "by); must divide `block_size` (or be at least a block: one digest per block). Digests stay on the "
        "compute device and cost 1/`digest_tokens` of the selecting layers' KV; 16 halves that and found 14 of "
        "exact's 17 needles at 8K, against 17 for 8 (docs/BENCHMARKS.md)",
        help="tokens per key digest (min/max of the keys) attention_entropy ranks blocks by; must divide "
        "block_size (or cover a block); digests cost 1/digest_tokens of the selecting layers' KV",
    ),
    Key(
        "entropy_shrink_below",
        "every 16 decode steps, the mean entropy (nats) of the softmax of block scores at the first sparse "
        "layer shrinks the window by 1/4 below this, grows it by 1/4 above `entropy_grow_above`. Calibrated on "
        "the retrieval benchmark (docs/BENCHMARKS.md: every prompt below 3.0 was served by a 512-token window; "
        "two of the four 8K prompts never found sit above 3.3; thresholds below 2.0 would grow every window "
        "there); the entropy follows the context's length more than the prompt's difficulty",
        help="every 16 decode steps, a mean block-score entropy (nats) below this shrinks the adaptive window by 1/4",
    ),
    Key(
        "entropy_grow_above",
        "mean block-score entropy (nats) above which the window grows by 1/4 (see `entropy_shrink_below`)",
    ),
    Key("max_batch_size", "requests advanced in one step"),
    Key(
        "share_prefixes",
        "prefix reuse: a session with no KV yet whose tokens begin with whole blocks of tokens another session "
        "holds KV for (a hash chain over its blocks, as vLLM's prefix cache keys them) shares those KV blocks at "
        "its first request instead of computing them, but for its last 64 tokens (the prompt probe's). `owner`: only "
        "among sessions of the same token (one tenant cannot time another's prompts), `all`: every session, "
        "`off`: never. Reported as `cached_tokens` by the OpenAI API and counted in the `h3d_prefix_*` metrics",
        help="share another session's KV blocks with a new session whose first blocks of tokens are the same: "
        "among one owner's sessions, all, or off",
    ),
    Key(
        "prefix_cache_sessions",
        "finished request sessions (the OpenAI API's chat and text completions, and responses with `store: "
        "false`) whose KV is kept for prefix reuse after they are answered (their token logs go at once), least "
        "recently used dropped first; 0 keeps none. They are idle sessions to the tiers: demoted, archived and "
        "dropped like any other, never listed",
        help="finished request sessions whose KV is kept for prefix reuse (least recently used dropped first)",
    ),
    Key(
        "session_log_path",
        "token logs: one append-only, checksummed file per session; a token is written there before it is "
        "streamed; sessions are reopened at the next start",
        default="none; `h3d serve`: `<data_dir>/sessions`",
    ),
    Key(
        "fsync_interval_ms",
        "group commit of the token logs: fsync at most this often (in `h3d serve` on a thread of its own, "
        "beside the engine's), and at the end of every generation (there too in `h3d serve`: the stream's end waits "
        "for it, not the engine's step)",
    ),
    Key(
        "max_context_tokens",
        "longest context a session may reach; an append beyond it is refused, a generation that reaches it "
        "ends with `length`",
        default="the model's `max_position_embeddings`",
    ),
    Key(
        "check_invariants",
        "after every engine step (and every rebuild of a damaged block) check the tiers' bookkeeping: no slot "
        "owned twice, free + used = capacity in each pool, every table pointing only at its own slots, every "
        "block in at least one tier, and every two copies of a block holding the same bytes; a violation "
        "raises `AssertionError` and fails the step. Slow: for debugging and tests",
        help="check the tiers' bookkeeping after every engine step (slow; for debugging and tests)",
    ),
    Key("sampling.temperature", "a request's softmax temperature when it names none; 0 is greedy"),
    Key("sampling.top_p", "a request's nucleus sampling mass when it names none, in (0, 1]; 1 keeps every token"),
    Key("sampling.top_k", "a request's top-k when it names none: keep the k most likely tokens; 0 turns it off"),
    Key(
        "sampling.max_tokens",
        "tokens a request generates when it names no `max_tokens` (`h3d serve`: at most `max_tokens_limit`)",
    ),
)

DAEMON: tuple[Key, ...] = (
    Key("data_dir", "the daemon's state: the socket (by default), the SSD archive and the token logs"),
    Key(
        "socket",
        "Unix socket path (h3ctl's default is `$H3D_SOCKET`, else `/run/h3d/h3d.sock`)",
        default="`<data_dir>/h3d.sock`",
    ),
    Key("socket_mode", "the socket's permission bits (clients need write access)"),
    Key(
        "listen",
        "`HOST:PORT` for TCP (port 0 picks one; the `listening` log event says which). Beyond loopback it "
        "requires TLS or `auth_token_file`",
        default="off",
    ),
    Key(
        "http_listen",
        "`HOST:PORT` of the OpenAI-compatible HTTP API (`/v1/chat/completions`, `/v1/completions`, "
        "`/v1/responses`, `/v1/models`; port 0 picks one: the `listening` log event says which). Same bearer "
        "tokens, limits and rule as `listen`: beyond loopback it requires TLS (the same `tls_cert_file`) or "
        "`auth_token_file`",
        default="off",
    ),
    Key(
        "tls_cert_file",
        "PEM certificate: serve TCP (gRPC and HTTP) with TLS (give `tls_key_file` with it)",
        default="off",
    ),
    Key("tls_key_file", "PEM private key of `tls_cert_file`", default="off"),
    Key(
        "auth_token_file",
        "bearer tokens of clients, one per line (`#` comments). When set, every call needs `authorization: "
        "Bearer <token>`; a session belongs to the token that created it (others get NOT_FOUND)",
        default="off",
    ),
    Key("admin_token_file", "tokens allowed to call `H3Admin` (they see every session)", default="off"),
    Key("metrics_listen", "`HOST:PORT` of the Prometheus endpoint (`GET /metrics`)", default="off"),
    Key("log_level", "`debug`, `info`, `warning`, `error`"),
    Key("stats_interval_s", "period of the `tier_stats` log event"),
    Key("drain_timeout_s", "on SIGTERM or `Drain`, how long streams in flight may take before they are cancelled"),
    Key(
        "shutdown_budget_s",
        "on SIGTERM, after the drain: how long the daemon may spend writing the sessions' KV to the archive "
        "(the most recently used sessions first). No session's write starts past it; the sessions left are "
        "computed again from their token logs after the restart, and the `checkpoint` log event says how many "
        "blocks. The daemon asks systemd for this much more time (`EXTEND_TIMEOUT_USEC`) as it works, and reports "
        "its progress in `STATUS=`. 0 writes no KV",
    ),
    Key(
        "max_pending_requests",
        "AppendContext + Generate streams and HTTP generations admitted at once; beyond, RESOURCE_EXHAUSTED with a "
        "`retry-after-ms` trailer (HTTP: 429 with `Retry-After`)",
    ),
    Key("max_tokens_limit", "largest `max_tokens` a request may ask"),
    Key(
        "max_message_bytes",
        "largest gRPC message either way, and largest HTTP request body; larger requests get RESOURCE_EXHAUSTED "
        "(HTTP 413)",
    ),
    Key("retry_after_ms", "the retry hint sent with RESOURCE_EXHAUSTED"),
    Key(
        "session_ttl_s",
        "close sessions idle this long (no request in flight, not pinned): their KV leaves HBM and DDR for the "
        "archive and their next request reopens them; a `session_expired` event says which",
        default="0 (never)",
    ),
    Key(
        "remote_url",
        "`redis://HOST:PORT/DB` (or `rediss://`, `unix://`) of the remote tier: a Redis-protocol store (Redis, "
        "Valkey) that every session's token log is copied to and that is its truth; any daemon of the same model "
        "sharing the store takes over a session whose lease is free or expired. A password never goes in the URL "
        "(refused): `remote_password_file`",
        default="off",
    ),
    Key("remote_password_file", "the remote store's password, on the file's first line", default="off"),
    Key(
        "remote_log",
        "`sync`: a token is streamed only once the store acknowledged the log bytes that hold it (the store must "
        "run `appendonly yes` with `appendfsync always`, checked at start); a Generate whose tokens the store does "
        "not take within `remote_timeout_s` ends with UNAVAILABLE. `async`: the logs are copied behind, and a "
        "daemon that dies may leave the store without its last tokens (those since its last copy; another daemon "
        "continues from there)",
    ),
    Key(
        "remote_lease_s",
        "how long a daemon's hold on a session lasts unless renewed (every third of it): after a daemon dies, "
        "another takes its sessions over this long after its last renewal",
    ),
    Key("remote_timeout_s", "the longest a call to the remote store may take (at most a third of remote_lease_s)"),
    Key(
        "remote_kv_ttl_s",
        "how long a KV block written to the remote store (copied as write-behind archives it, or by a daemon "
        "giving a session up: ReleaseSession, SIGTERM) stays there since it was last written or renewed; blocks "
        "are keyed by content, so a fork's shared prefix is held once; a session taken over after its blocks "
        "expired computes its KV again",
        default="604800 (7 days)",
    ),
    Key(
        "remote_kv_copy_mb",
        "KV blocks that write-behind made durable in the local archive are copied to the remote store too, so "
        "that a daemon killed leaves their KV to the daemon that takes its sessions over; at most this much "
        "waits to be sent (more, or the store unavailable: the blocks are skipped, and written when the session "
        "is given up). 0: KV reaches the store only when a session is given up",
        default="512",
    ),
    Key(
        "remote_kv_resume",
        "how a session taken over from the remote store gets its KV: `store` reads its blocks (and digests) "
        "from the store; `recompute` leaves them to its next request's prefill; `auto` reads them unless the "
        "rates this daemon measured say a prefill is faster (its KV's bytes, uncompressed, at the store's read "
        "rate, against its tokens at the prefill's rate; the prefill's from the warm-up on a GPU and from long "
        "appends, the store's from its reads of 16 MiB or more, the first of them the first piece of the "
        "session's digest snapshot; from the store while either is unmeasured). The tokens are the same either way; "
        "`session_taken_over` logs the choice (`kv_source`) and both estimates",
        default="`auto`",
    ),
)

KEYS: dict[str, Key] = {k.name: k for k in ENGINE + DAEMON}
TABLES = {"engine": ENGINE, "daemon": DAEMON}


def dataclass_keys() -> dict[str, Any]:
    """Every key of the dataclasses (sampling keys as `sampling.<name>`) and its default (None: none)."""
    out: dict[str, Any] = {}
    for cls, prefix, skip in (
        (EngineConfig, "", "sampling"),
        (DaemonConfig, "", "engine"),
        (SamplingDefaults, "sampling.", ""),
    ):
        for f in fields(cls):
            if f.name != skip:
                out[prefix + f.name] = None if f.default is MISSING else f.default
    return out


def default_text(key: Key) -> str:
    """The default as the docs show it (Markdown)."""
    if key.default is not None:
        return key.default
    value = dataclass_keys()[key.name]
    if value is None or value == ():
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f"`{value}`"
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def plain(text: str) -> str:
    """Markdown -> plain text for --help (argparse expands `%`: doubled)."""
    return text.replace("`", "").replace("%", "%%")


def flag_help(name: str, text: str | None = None) -> str:
    """`--help` line of the flag for key `name`: its meaning (or `text`) and its default."""
    key = KEYS[name]
    default = default_text(key)
    return plain(f"{text or key.help or key.doc} " + (default if default == REQUIRED else f"(default: {default})"))


# ---- docs/OPERATIONS.md -------------------------------------------------------------------


def render(table: str) -> str:
    lines = ["| key | default | meaning |", "|---|---|---|"]
    for key in TABLES[table]:
        lines.append(f"| `{key.name}` | {default_text(key)} | {key.doc} |")
    return "\n".join(lines)


def _marker(table: str) -> re.Pattern[str]:
    return re.compile(rf"(<!-- keys:{table} -->\n)(.*?)(<!-- /keys:{table} -->)", re.DOTALL)


def update(text: str) -> str:
    """`text` with every table between its markers written anew; ValueError if a marker is missing."""
    for table in TABLES:
        pattern = _marker(table)
        if len(pattern.findall(text)) != 1:
            raise ValueError(f"<!-- keys:{table} --> ... <!-- /keys:{table} -->: expected once")
        text = pattern.sub(lambda m, t=table: m[1] + render(t) + "\n" + m[3], text)  # type: ignore[misc]
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m h3d.keys", description="write or check the key tables")
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", metavar="FILE", help="rewrite the tables of FILE in place")
    mode.add_argument("--check", metavar="FILE", help="exit 1 if the tables of FILE are not current")
    args = parser.parse_args(argv)
    path = Path(args.write or args.check)
    text = path.read_text(encoding="utf-8")
    try:
        new = update(text)
    except ValueError as exc:
        print(f"{path}: {exc}", file=sys.stderr)
        return 1
    if args.check:
        if new != text:
            print(f"{path}: key tables are not current; run python -m h3d.keys --write {path}", file=sys.stderr)
            return 1
        return 0
    if new != text:
        path.write_text(new, encoding="utf-8")
    return 0


if __name__ == "__main__":
    sys.exit(main())
