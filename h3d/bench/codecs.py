"""SSD codecs on real KV: compression ratio, reconstruction error and speed.

    python -m h3d.bench.codecs --model DIR [--tokens 2048] [--write docs/BENCHMARKS.md]

Prefills the model with real English text (h3d.bench.text), takes every full KV block of every
layer from the HBM pool, and encodes each with both codecs. Error of int8-delta-zstd is measured
per token row (one head's K or V of one token), relative to that row's max magnitude, which is
what the codec bounds (INT8_MAX_REL_ERROR); the table also gives the relative Frobenius error.
"""

from __future__ import annotations

import argparse
import datetime as dt
import time

import torch

from h3d.bench.report import write_section
from h3d.bench.text import corpus
from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.tiers.codecs import INT8_MAX_REL_ERROR, Codec, decode, decode_int8_many, encode, encode_int8_many

MARK = "codecs"


def kv_blocks(model: str, tokens: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], int]:
    engine = Engine(EngineConfig.build(model=model, hbm_mb=4096))
    ids = engine.tokenizer.encode(corpus())[:tokens]
    session = engine.create_session()
    engine.append(session, token_ids=ids)
    runner = engine.runner
    table = runner.blocks.table(engine.session(session).seq)
    full = table.num_tokens // runner.blocks.block_size
    slots = torch.from_numpy(table.hbm[:, :full].reshape(-1).copy())
    k, v = runner.hbm.read(slots)  # [Hkv, L*full, bs, D]
    return [(k[:, i], v[:, i]) for i in range(k.shape[1])], len(ids)


def measure(blocks: list[tuple[torch.Tensor, torch.Tensor]], codec: Codec) -> dict[str, float]:
    raw = stored = 0
    worst = 0.0
    err2 = ref2 = 0.0
    t_enc = t_dec = 0.0
    for k, v in blocks:
        t0 = time.perf_counter()
        payload = encode(codec, k, v)
        t1 = time.perf_counter()
        k2, v2 = decode(codec, payload, k.dtype, k.shape[0], k.shape[1], k.shape[2])
        t2 = time.perf_counter()
        t_enc, t_dec = t_enc + t1 - t0, t_dec + t2 - t1
        raw += 2 * k.numel() * k.element_size()
        stored += len(payload)
        for a, b in ((k, k2), (v, v2)):
            diff = (a.float() - b.float()).abs()
            row_max = a.float().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
            worst = max(worst, float((diff / row_max).max()))
            err2 += float(diff.pow(2).sum())
            ref2 += float(a.float().pow(2).sum())
    n = len(blocks)
    bulk_enc = bulk_dec = float("nan")
    if codec is Codec.INT8_DELTA_ZSTD:  # a bulk write's and read's path: every block in one pass
        t0 = time.perf_counter()
        payloads = encode_int8_many(blocks)
        t1 = time.perf_counter()
        decode_int8_many(payloads, blocks[0][0].dtype, *blocks[0][0].shape)
        t2 = time.perf_counter()
        bulk_enc, bulk_dec = (t1 - t0) / n * 1e6, (t2 - t1) / n * 1e6
    return {
        "bulk_enc_us": bulk_enc,
        "bulk_dec_us": bulk_dec,
        "ratio": raw / stored,
        "worst_row_rel": worst,
        "frob_rel": (err2 / ref2) ** 0.5,
        "enc_us": t_enc / n * 1e6,
        "dec_us": t_dec / n * 1e6,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--write", default=None, help="update this markdown file's codec table")
    args = parser.parse_args()
    blocks, n_tokens = kv_blocks(args.model, args.tokens)
    lines = [
        "| codec | compression ratio | worst per-row error (of row max) | relative Frobenius error "
        "| encode µs/block | decode µs/block | in bulk: encode / decode µs/block |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for codec in Codec:
        m = measure(blocks, codec)
        lines.append(
            f"| {codec.value} | {m['ratio']:.2f}x | {m['worst_row_rel']:.2e} | {m['frob_rel']:.2e} "
            f"| {m['enc_us']:.0f} | {m['dec_us']:.0f} | "
            + ("-" if m["bulk_enc_us"] != m["bulk_enc_us"] else f"{m['bulk_enc_us']:.0f} / {m['bulk_dec_us']:.0f}")
            + " |"
        )
    shape = blocks[0][0].shape
    table = "\n".join(lines)
    meta = (
        f"Measured {dt.date.today().isoformat()} on the CPU host: KV of the embedded model (fp32) after "
        f"prefilling {n_tokens} tokens of real English text (licence texts, `h3d/bench/text.py`), "
        f"{len(blocks)} full blocks of K+V [{shape[0]} heads x {shape[1]} tokens x {shape[2]}]. "
        f"The int8 codec's documented bound is {INT8_MAX_REL_ERROR:.2e} of each token row's max "
        f"(plus fp32 rounding). In bulk: all the blocks in one `encode_int8_many` / `decode_int8_many` "
        f"call, as an archive write or read of many blocks does (raw-zstd has no such pass: its bytes "
        f"go straight into place).\n\nCommand: `python -m h3d.bench.codecs --model MODEL --tokens {args.tokens}`"
    )
    print(table)
    if args.write:
        from pathlib import Path

        write_section(Path(args.write), f"{meta}\n\n{table}", MARK)


if __name__ == "__main__":
    main()
