"""h3d/keys.py: one entry per configuration key, docs/OPERATIONS.md's key tables generated from it and
current, and every flag of `h3d serve` / `h3d generate` with a help line that shows its default."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from h3d import keys
from h3d.cli import build_parser, main
from h3d.daemon.config import key_types

ROOT = Path(__file__).resolve().parent.parent
OPERATIONS = ROOT / "docs" / "OPERATIONS.md"


def subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def flags(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def test_every_key_has_one_entry_and_every_entry_a_key() -> None:
    names = [k.name for k in keys.ENGINE + keys.DAEMON]
    assert len(names) == len(set(names)), "a key is listed twice"
    real = set(keys.dataclass_keys())
    assert real - set(names) == set(), "keys without an entry in h3d/keys.py"
    assert set(names) - real == set(), "entries of h3d/keys.py that are no configuration key"
    # The flat names of the loader (sampling keys as sampling_<name>) are the same keys.
    assert {n.replace("sampling.", "sampling_") for n in names} == set(key_types())
    assert all(k.doc and not k.doc.endswith(".") for k in keys.ENGINE + keys.DAEMON)


def test_shown_defaults_are_the_real_ones() -> None:
    real = keys.dataclass_keys()
    assert keys.default_text(keys.KEYS["block_size"]) == "32"
    assert keys.default_text(keys.KEYS["hbm_mb"]) == "`auto`"
    assert keys.default_text(keys.KEYS["promote_mb_per_step"]) == "64"
    assert keys.default_text(keys.KEYS["ddr_high_watermark"]) == "0.85"
    assert keys.default_text(keys.KEYS["policy"]) == "`attention_entropy`"
    assert keys.default_text(keys.KEYS["quantize_skip_layers"]) == "none"
    assert keys.default_text(keys.KEYS["check_invariants"]) == "false"
    assert keys.default_text(keys.KEYS["sampling.top_p"]) == "1"
    for key in keys.ENGINE + keys.DAEMON:
        value = real[key.name]
        if key.default is not None and value not in (None, ""):
            # A written-out default starts with the real value (`0 (never)`).
            derived = keys.default_text(keys.Key(key.name, key.doc))
            assert key.default.startswith(derived), (key.name, key.default, derived)


def test_operations_tables_are_current() -> None:
    text = OPERATIONS.read_text(encoding="utf-8")
    assert keys.update(text) == text, "docs/OPERATIONS.md: run python -m h3d.keys --write docs/OPERATIONS.md"
    assert keys.main(["--check", str(OPERATIONS)]) == 0
    for key in keys.ENGINE + keys.DAEMON:
        assert f"| `{key.name}` |" in text


def test_check_and_write(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = tmp_path / "ops.md"
    current = OPERATIONS.read_text(encoding="utf-8")
    doc.write_text(current.replace("| tokens per KV block |", "| tokens per block |"), encoding="utf-8")
    assert keys.main(["--check", str(doc)]) == 1
    assert "not current" in capsys.readouterr().err
    assert keys.main(["--write", str(doc)]) == 0
    assert doc.read_text(encoding="utf-8") == current
    assert keys.main(["--check", str(doc)]) == 0
    doc.write_text("# no markers\n", encoding="utf-8")
    assert keys.main(["--check", str(doc)]) == 1
    assert "keys:engine" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_every_flag_has_a_help_line_with_its_default(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main([command, "--help"])
    assert exit_.value.code == 0
    out = "".join(capsys.readouterr().out.split())  # argparse wraps lines, also after a hyphen
    actions = flags(subparser(command))
    assert len(actions) > (40 if command == "serve" else 30)
    for action in actions:
        assert action.help and action.help != argparse.SUPPRESS, f"{action.option_strings}: no help"
        text = action.help.replace("%%", "%")
        assert "(default: " in text or text.endswith(" (required)"), f"{action.option_strings}: no default"
        assert "".join(text.split()) in out, f"{action.option_strings}: help line not in `h3d {command} --help`"
        for option in action.option_strings:
            assert option in out


def test_help_comes_from_the_table() -> None:
    serve = {a.dest: a.help for a in flags(subparser("serve"))}
    generate = {a.dest: a.help for a in flags(subparser("generate"))}
    assert serve["block_size"] == generate["block_size"] == keys.flag_help("block_size")
    assert serve["check_invariants"] == keys.flag_help("check_invariants")
    assert serve["sampling_top_p"] == generate["top_p"] == keys.flag_help("sampling.top_p")
    assert serve["cpu_threads"] == generate["cpu_threads"] == keys.flag_help("cpu_threads")
    assert serve["session_ttl_s"] == keys.flag_help("session_ttl_s")
    assert "(default: 0 (never))" in serve["session_ttl_s"]
    assert "(default: <data_dir>/h3d.sock)" in serve["socket"]
    # Every configuration key is a flag of `h3d serve`.
    assert set(serve) - {"config"} == set(key_types())


def test_generate_flags_parse_to_the_keys_types() -> None:
    args = build_parser().parse_args(
        ["generate", "--model", "m", "--prompt", "x", "--max-context-tokens", "100", "--dense-hbm-share", "0.4",
         "--ssd-capacity-mb", "512", "--cpu-threads", "1", "--quantize-skip-layers", "0", "1", "--check-invariants"]
    )  # fmt: skip
    assert args.max_context_tokens == 100 and args.dense_hbm_share == 0.4 and args.ssd_capacity_mb == 512.0
    assert args.cpu_threads == 1 and args.quantize_skip_layers == [0, 1] and args.check_invariants is True
