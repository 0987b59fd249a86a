"""protos/breaking.py: the current proto keeps the committed contract, and each kind of break is caught.

Negative controls copy protos/ to a temporary folder, edit h3.proto there and compare the result with
the committed descriptor set (protos/h3/v1/h3.binpb), as `python protos/breaking.py` does.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[2]
PROTO = Path("h3/v1/h3.proto")


def _load_breaking() -> ModuleType:
    spec = importlib.util.spec_from_file_location("breaking", ROOT / "protos" / "breaking.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


breaking = _load_breaking()


def edited_protos(tmp_path: Path, *edits: tuple[str, str]) -> Path:
    """A copy of protos/ whose h3.proto has each `old` text (found exactly once) replaced by `new`."""
    root = tmp_path / "protos"
    (root / PROTO).parent.mkdir(parents=True)
    text = (ROOT / "protos" / PROTO).read_text()
    for old, new in edits:
        assert text.count(old) == 1, f"the edit's anchor {old!r} is not unique in h3.proto"
        text = text.replace(old, new)
    (root / PROTO).write_text(text)
    return root


def changes(tmp_path: Path, *edits: tuple[str, str]) -> list[str]:
    problems: list[str] = breaking.breaking_changes(
        breaking.load(), breaking.compile_protos(edited_protos(tmp_path, *edits))
    )
    return problems


def test_current_protos_keep_the_committed_contract() -> None:
    assert breaking.breaking_changes(breaking.load(), breaking.compile_protos()) == []


def test_committed_set_is_small_and_covers_the_protos() -> None:
    """h3.binpb is a plain descriptor set: every file under protos/, no source info (comments)."""
    committed = breaking.load()
    assert sorted(f.name for f in committed.file) == [PROTO.as_posix()]
    assert not any(f.HasField("source_code_info") for f in committed.file)


ONEOF_DELTA = "message GenerateResponse {\n  oneof event {\n    TokenDelta delta = 1;\n"
DELTA_OUT_OF_ONEOF = "message GenerateResponse {\n  TokenDelta delta = 1;\n  oneof event {\n"
GET_SESSION = "rpc GetSession(GetSessionRequest) returns (Session);"
GET_STATS = "  rpc GetStats(GetStatsRequest) returns (Stats);\n"
GENERATE_STREAMING = "Generate(h3.v1.GenerateRequest) returns (stream h3.v1.GenerateResponse)"

# (old text, new text, the one line reported)
BREAKS = [
    pytest.param(
        "  string policy = 4;\n",
        "",
        "h3.v1.Session: field 4 `policy` removed (to delete a field, reserve its number)",
        id="field removed",
    ),
    pytest.param(
        "uint64 window_tokens = 12;",
        "uint64 window_tokens = 19;",
        "h3.v1.Session: field `window_tokens` renumbered 12 -> 19",
        id="field renumbered",
    ),
    pytest.param(
        "  uint64 tokens_added = 1;",
        "  int64 tokens_added = 1;",
        "h3.v1.AppendSummary: field 1 `tokens_added` retyped uint64 -> int64",
        id="scalar type changed",
    ),
    pytest.param(
        "  SamplingParams sampling = 10;",
        "  TierResidency sampling = 10;",
        "h3.v1.Session: field 10 `sampling` retyped h3.v1.SamplingParams -> h3.v1.TierResidency",
        id="message type changed",
    ),
    pytest.param(
        "  string prompt = 2;",
        "  repeated string prompt = 2;",
        "h3.v1.GenerateRequest: field 2 `prompt` retyped string -> repeated string",
        id="made repeated",
    ),
    pytest.param(
        "  bool busy = 7;",
        "  bool in_flight = 7;",
        "h3.v1.Session: field 7 renamed `busy` -> `in_flight`",
        id="field renamed",
    ),
    pytest.param(
        ONEOF_DELTA,
        DELTA_OUT_OF_ONEOF,
        "h3.v1.GenerateResponse: field 1 `delta` moved out of oneof `event`",
        id="moved out of a oneof",
    ),
    pytest.param(GET_STATS, "", "h3.v1.H3: rpc `GetStats` removed", id="rpc removed"),
    pytest.param(
        GET_SESSION,
        GET_SESSION.replace("(Session)", "(Stats)"),
        "h3.v1.H3: rpc `GetSession` changed: `GetSession(h3.v1.GetSessionRequest) returns (h3.v1.Session)` -> "
        "`GetSession(h3.v1.GetSessionRequest) returns (h3.v1.Stats)`",
        id="rpc response changed",
    ),
    pytest.param(
        "returns (stream GenerateResponse)",
        "returns (GenerateResponse)",
        f"h3.v1.H3: rpc `Generate` changed: `{GENERATE_STREAMING}` -> `{GENERATE_STREAMING.replace('stream ', '')}`",
        id="rpc no longer streams",
    ),
    pytest.param(
        "  FINISH_REASON_CANCELLED = 3;\n",
        "",
        "h3.v1.FinishReason: value 3 `FINISH_REASON_CANCELLED` removed (to delete a value, reserve its number)",
        id="enum value removed",
    ),
    pytest.param(
        "  TIER_SSD = 3;",
        "  TIER_DISK = 3;",
        "h3.v1.Tier: value 3 renamed `TIER_SSD` -> `TIER_DISK`",
        id="enum value renamed",
    ),
]


@pytest.mark.parametrize(("old", "new", "want"), BREAKS)
def test_each_break_is_reported(tmp_path: Path, old: str, new: str, want: str) -> None:
    assert changes(tmp_path, (old, new)) == [want]


# (old text, new text)
SAFE = [
    pytest.param(
        "  string served_by = 18;\n}", "  string served_by = 18;\n  uint64 generation = 19;\n}", id="field added"
    ),
    pytest.param("message GetConfigRequest {}", "message GetConfigRequest {}\nmessage Ping {}", id="message added"),
    pytest.param(GET_STATS, GET_STATS + "  rpc WatchStats(GetStatsRequest) returns (stream Stats);\n", id="rpc added"),
    pytest.param("  TIER_SSD = 3;\n", "  TIER_SSD = 3;\n  TIER_CXL = 4;\n", id="enum value added"),
    pytest.param(
        "  string policy = 4;\n", '  reserved 4;\n  reserved "policy";\n', id="field removed, number reserved"
    ),
    pytest.param("  FINISH_REASON_CANCELLED = 3;\n", "  reserved 3;\n", id="enum value removed, number reserved"),
    pytest.param("  // Opaque id (32 hex digits).\n", "  // The session's id.\n", id="comment changed"),
]


@pytest.mark.parametrize(("old", "new"), SAFE)
def test_additions_and_reserved_removals_are_not_reported(tmp_path: Path, old: str, new: str) -> None:
    assert changes(tmp_path, (old, new)) == []


def test_reusing_a_reserved_number_is_reported(tmp_path: Path) -> None:
    reserved = breaking.compile_protos(edited_protos(tmp_path / "a", ("  string policy = 4;\n", "  reserved 4;\n")))
    reused = breaking.compile_protos(edited_protos(tmp_path / "b", ("  string policy = 4;\n", "  uint32 flags = 4;\n")))
    assert breaking.breaking_changes(reserved, reused) == ["h3.v1.Session: field 4 `flags` reuses a reserved number"]


def test_command_lists_the_breaks_and_accept_records_a_baseline(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = edited_protos(tmp_path, ("  string policy = 4;\n", ""), ("  bool busy = 7;", "  bool in_flight = 7;"))
    assert breaking.main(["--protos", str(broken)]) == 1
    err = capsys.readouterr().err
    assert "(2):" in err and "field 4 `policy` removed" in err and "renamed `busy` -> `in_flight`" in err
    assert "--accept" in err

    baseline = tmp_path / "h3.binpb"
    assert breaking.main(["--protos", str(broken), "--against", str(baseline), "--accept"]) == 0
    assert breaking.main(["--protos", str(broken), "--against", str(baseline)]) == 0
    assert "matches" in capsys.readouterr().out


def test_command_notes_additions_not_yet_accepted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    added = edited_protos(
        tmp_path, ("  string served_by = 18;\n}", "  string served_by = 18;\n  uint64 generation = 19;\n}")
    )
    assert breaking.main(["--protos", str(added)]) == 0
    assert "`--accept` records the additions" in capsys.readouterr().out


def test_script_passes_on_the_repo() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "protos" / "breaking.py")], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert "no breaking change" in done.stdout
