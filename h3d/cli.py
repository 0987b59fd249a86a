"""`h3d`: the daemon, one-off generation and model conversion.

    h3d serve [--config h3d.toml] [--model DIR] [--data-dir DIR] [--socket PATH] [--listen HOST:PORT]
              [--http-listen HOST:PORT]
              [every configuration key as --kebab-case-flag]

    h3d generate --model DIR (--prompt TEXT | --prompt-file PATH) [--max-tokens N] [--temperature T]
                 [--top-p P] [--top-k K] [--seed S] [--chat] [--device auto|cpu|cuda] [--dtype fp32|bf16|fp16]
                 [--json] [engine flags: --block-size, --prefill-chunk-tokens, --hbm-mb, ...]
    h3d convert-gguf (FILE | --embedded) OUTDIR

Every engine configuration key is a flag of the same name in kebab case; the defaults are
`h3d.config`'s, the help texts `h3d.keys`'s (which docs/OPERATIONS.md's key tables come from too).
Errors print one line to stderr and exit 1; usage errors exit 2.

torch is imported only once the configuration is known (`h3d.engine.threads` sets the OpenMP
environment first).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

from h3d.config import AUTO, DDR_MEMORY, DTYPES, OR_AUTO, POLICIES, SSD_CODECS, EngineConfig, SamplingDefaults
from h3d.daemon.config import key_types
from h3d.errors import H3Error
from h3d.keys import flag_help

_CHOICES = {
    "policy": POLICIES,
    "ssd_codec": SSD_CODECS,
    "dtype": DTYPES,
    "ddr_memory": DDR_MEMORY,
}  # device: also cuda:N


def _add_key_flag(p: argparse.ArgumentParser, key: str, kind: type, dest: str | None = None) -> None:
    """`--kebab-key` (or `--kebab-dest`) for configuration key `key` (flat: `sampling_top_p`), typed,
    with its help line from h3d.keys."""
    dest = dest or key
    flag = "--" + dest.replace("_", "-")
    help = flag_help(key.replace("sampling_", "sampling.", 1) if key.startswith("sampling_") else key)
    if kind is bool:
        p.add_argument(flag, dest=dest, action=argparse.BooleanOptionalAction, default=None, help=help)
    elif kind is tuple:
        p.add_argument(flag, dest=dest, type=int, nargs="*", default=None, help=help)
    elif key in OR_AUTO:
        p.add_argument(flag, dest=dest, type=_or_auto(kind), default=None, help=help, metavar="N|auto")
    elif kind in (int, float):
        p.add_argument(flag, dest=dest, type=kind, default=None, help=help)
    else:
        p.add_argument(flag, dest=dest, choices=_CHOICES.get(key), default=None, help=help)


def _or_auto(kind: type) -> Any:
    """A flag's value: `auto`, or a number of `kind`."""

    def parse(text: str) -> Any:
        if text == AUTO:
            return AUTO
        try:
            return kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number or 'auto', got {text!r}") from None

    return parse


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help=flag_help("model"))
    types = key_types()
    for f in fields(EngineConfig):
        if f.name not in ("model", "sampling"):
            _add_key_flag(p, f.name, types[f.name])


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    keys = {f.name for f in fields(EngineConfig)} - {"sampling"}
    values = {k: getattr(args, k) for k in keys if hasattr(args, k)}
    if values.get("quantize_skip_layers") is not None:
        values["quantize_skip_layers"] = tuple(values["quantize_skip_layers"])
    return EngineConfig.build(**values)


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is not None:
        try:
            return Path(args.prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise H3Error(f"cannot read prompt file {args.prompt_file}: {exc}") from exc
    return str(args.prompt)


def cmd_generate(args: argparse.Namespace) -> int:
    from h3d.engine.threads import apply_cpu_threads

    config = _engine_config(args)
    cpu_threads = apply_cpu_threads(config)  # before torch loads: it reads the OpenMP environment once

    from h3d.engine.engine import Engine
    from h3d.engine.session import GenerationDone, TokenDelta

    engine = Engine(config)
    prompt = _read_prompt(args)
    if args.chat:
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    if not engine.tokenizer.encode(prompt):
        raise H3Error("the prompt tokenizes to nothing: an empty context cannot be continued")
    d = SamplingDefaults()
    params = engine.with_sampling(
        max_tokens=args.max_tokens if args.max_tokens is not None else d.max_tokens,
        temperature=args.temperature if args.temperature is not None else d.temperature,
        top_p=args.top_p if args.top_p is not None else d.top_p,
        top_k=args.top_k if args.top_k is not None else d.top_k,
        seed=args.seed,
    )
    session = engine.create_session()
    started = time.perf_counter()
    done: GenerationDone | None = None
    for event in engine.generate(session, prompt, params):
        if isinstance(event, TokenDelta) and not args.json and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, GenerationDone):
            done = event
    assert done is not None
    if args.json:
        print(
            json.dumps(
                {
                    "text": done.text,
                    "token_ids": list(done.token_ids),
                    "finish_reason": done.finish_reason.value,
                    "prompt_tokens": done.prompt_tokens,
                    "completion_tokens": len(done.token_ids),
                    "ttft_s": round(done.ttft_s, 6),
                    "decode_tokens_per_s": round(done.decode_tokens_per_s, 3),
                    "total_s": round(time.perf_counter() - started, 6),
                    "stats": {
                        **engine.tier_stats().as_dict(),
                        "hbf_latency_us_p50": round(engine.hbf_latency_us()[0], 1),
                        "hbf_latency_us_p99": round(engine.hbf_latency_us()[1], 1),
                        "window_tokens": engine.kv.window_tokens(engine.session(session).seq),
                        "cpu_threads": cpu_threads,
                    },
                },
                ensure_ascii=False,
            )
        )
    else:
        sys.stdout.write("\n")
    engine.close()
    return 0


def cmd_convert_gguf(args: argparse.Namespace) -> int:
    from h3d.convert.embedded import embedded_gguf
    from h3d.convert.gguf import convert_gguf

    if args.embedded == (args.file is not None):
        raise H3Error("give either a GGUF FILE or --embedded")
    if args.if_missing and (Path(args.outdir) / "config.json").is_file():
        print(f"{args.outdir} already holds a converted model", file=sys.stderr)
        return 0
    src = embedded_gguf() if args.embedded else Path(args.file)
    print(f"converting {src} -> {args.outdir}", file=sys.stderr)
    out = convert_gguf(src, args.outdir)
    print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    from h3d.engine.threads import omp_environment

    omp_environment()  # h3d.daemon.server imports torch; the thread count follows in Daemon.run
    from h3d.daemon.server import serve

    overrides = {key: getattr(args, key, None) for key in key_types()}
    return serve(args.config, overrides)


def _add_serve_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, help="h3d.toml (see systemd/h3d.toml); flags override it (default: none)")
    for key, kind in sorted(key_types().items()):
        _add_key_flag(p, key, kind)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="h3d", description="h3d: long-context LLM inference over tiered KV")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a completion for one prompt")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", help="prompt text (default: none; this or --prompt-file is required)")
    src.add_argument("--prompt-file", help="read the prompt from this file, UTF-8 (default: none)")
    types = key_types()
    for name in ("max_tokens", "temperature", "top_p", "top_k"):  # the sampling keys, without `sampling-`
        _add_key_flag(gen, f"sampling_{name}", types[f"sampling_{name}"], dest=name)
    gen.add_argument("--seed", type=int, default=None, help="seed of this request's sampler (default: a random one)")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template (default: off)")
    gen.add_argument(
        "--json", action="store_true", help="print one JSON object at the end instead of streaming (default: off)"
    )
    _add_engine_flags(gen)
    gen.set_defaults(func=cmd_generate)

    srv = sub.add_parser("serve", help="run the daemon (gRPC on a Unix socket, optionally TCP)")
    _add_serve_flags(srv)
    srv.set_defaults(func=cmd_serve)

    conv = sub.add_parser("convert-gguf", help="convert a llama, qwen2, qwen3 or gemma3 GGUF file into an HF folder")
    conv.add_argument("file", nargs="?", help="the .gguf file")
    conv.add_argument("outdir", help="output folder")
    conv.add_argument("--embedded", action="store_true", help="convert the embedded SmolLM2 model")
    conv.add_argument("--if-missing", action="store_true", help="do nothing if OUTDIR already holds a model")
    conv.set_defaults(func=cmd_convert_gguf)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    # `convert-gguf --embedded OUTDIR`: the lone positional is the output folder.
    if argv[:1] == ["convert-gguf"] and "--embedded" in argv:
        positional = [a for a in argv[1:] if not a.startswith("--")]
        if len(positional) == 1:
            argv = ["convert-gguf", *[a for a in argv[1:] if a.startswith("--")], "--", "", positional[0]]
    args: Any = parser.parse_args(argv)
    if getattr(args, "file", None) == "":
        args.file = None
    try:
        return int(args.func(args))
    except H3Error as exc:
        print(f"h3d: error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
