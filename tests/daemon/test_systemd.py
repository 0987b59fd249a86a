"""systemd/: the unit passes `systemd-analyze verify`, keeps the contract the daemon relies on
(Type=notify, SIGHUP reload, a stop timeout above the drain, the directories that match the
example configuration, no sandboxing that hides the GPUs), the example h3d.toml loads and
documents every key with its real default, and the notify protocol reaches a socket the way
systemd listens for it (a path or an abstract name).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
import sys
import tomllib
import uuid
from dataclasses import MISSING, fields
from pathlib import Path

import pytest

from h3d.config import EngineConfig, SamplingDefaults
from h3d.daemon.config import DEFAULT_DATA_DIR, RELOADABLE, DaemonConfig, key_types, load
from h3d.daemon.notify import Notifier

ROOT = Path(__file__).resolve().parents[2]
UNIT = ROOT / "systemd" / "h3d.service"
EXAMPLE = ROOT / "systemd" / "h3d.toml"
README = ROOT / "systemd" / "README.md"
INSTALLED_AT = "/usr/local/bin/h3d"  # the unit's ExecStart binary


# ---- the unit -----------------------------------------------------------------------------


def unit_settings(text: str) -> dict[str, dict[str, list[str]]]:
    """section -> directive -> its values in order (comments and blank lines dropped)."""
    out: dict[str, dict[str, list[str]]] = {}
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out.setdefault(section, {})
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a directive: {raw!r}"
        out.setdefault(section, {}).setdefault(key.strip(), []).append(value.strip())
    return out


def service() -> dict[str, list[str]]:
    return unit_settings(UNIT.read_text(encoding="utf-8"))["Service"]


def one(settings: dict[str, list[str]], key: str) -> str:
    values = settings.get(key)
    assert values is not None and len(values) == 1, f"{key}= must be set exactly once, got {values}"
    return values[0]


def seconds(value: str) -> float:
    """A plain systemd time span: `30`, `30s`, `5min`."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)\s*(s|sec|min)?", value)
    assert match, f"expected a plain time span, got {value!r}"
    return float(match[1]) * (60 if match[2] == "min" else 1)


def installed_h3d() -> Path:
    """The console script of the h3d installed with this interpreter (the venv's), else on PATH."""
    beside = Path(sys.executable).parent / "h3d"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("h3d")
    if found is None:
        pytest.skip("the h3d console script is not installed (pip install -e .): verify needs a real ExecStart binary")
    return Path(found)


def verifiable_copy(directory: Path, text: str) -> Path:
    """The unit as `directory`/h3d.service, its binaries pointed at ones that exist here:
    `systemd-analyze verify` fails when ExecStart='s (or ExecReload='s) program is missing."""
    assert f"ExecStart={INSTALLED_AT} " in text
    text = text.replace(f"ExecStart={INSTALLED_AT} ", f"ExecStart={installed_h3d()} ")
    if not Path("/bin/kill").exists():  # procps' kill; the unit's ExecReload
        kill = shutil.which("kill")
        if kill is None:
            pytest.skip("no kill binary here for the unit's ExecReload")
        text = text.replace("ExecReload=/bin/kill ", f"ExecReload={kill} ")
    path = directory / UNIT.name
    path.write_text(text, encoding="utf-8")
    return path


# Lines of `systemd-analyze verify` (systemd 252, Debian 12) that name the unit but are not
# problems of the unit. None is known: `verify` does not resolve User=/Group= (the h3d user need
# not exist), it does not create StateDirectory=/RuntimeDirectory=, and running as root in a
# container without systemd as PID 1 adds nothing. Lines about *other* units (the host's own, or
# the implied var-lib-h3d.mount at debug level) never name h3d.service and are ignored anyway,
# since the host's units are not ours to judge. Add a pattern here only with the reason it is
# harmless.
BENIGN: tuple[re.Pattern[str], ...] = ()


def verify_problems(unit: Path) -> list[str]:
    """What `systemd-analyze verify` reports about `unit`: its warnings and errors that name the
    unit (an unknown directive or a value it cannot parse is only a warning: exit status 0,
    "…, ignoring."), plus a non-zero exit status (a missing binary, a unit that does not load)."""
    analyze = shutil.which("systemd-analyze")
    assert analyze is not None
    env = {
        **os.environ,
        "SYSTEMD_LOG_TARGET": "console",  # stderr, never the journal (a CI runner may run under systemd)
        "SYSTEMD_LOG_LEVEL": "info",  # warnings included whatever the caller's environment says
        "SYSTEMD_LOG_COLOR": "0",
        "SYSTEMD_PAGER": "cat",
    }
    proc = subprocess.run(
        [analyze, "verify", "--man=no", str(unit)], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    problems = [
        line
        for line in proc.stderr.splitlines()
        if unit.name in line and not any(pattern.search(line) for pattern in BENIGN)
    ]
    if proc.returncode != 0:
        problems.append(f"exit status {proc.returncode}: {proc.stderr.strip()}")
    return problems


needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed (Debian: apt-get install systemd); cannot verify systemd/h3d.service",
)


@needs_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    unit = verifiable_copy(tmp_path, UNIT.read_text(encoding="utf-8"))
    assert verify_problems(unit) == []


@needs_analyze
@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("Type=notify", "TypeX=notify"),  # an unknown directive: a warning, exit status 0
        ("WatchdogSec=30", "WatchdogSec=thirty"),  # a value that does not parse: a warning, exit status 0
        ("ProtectSystem=strict", "ProtectSystem=stric"),
        ("RestartSec=5", "RestartSec=5\nNoSuchThing=1"),
    ],
)
def test_verify_check_catches_broken_units(tmp_path: Path, old: str, new: str) -> None:
    """The negative control: the check above fails on real unit errors."""
    text = UNIT.read_text(encoding="utf-8")
    assert f"\n{old}\n" in text
    unit = verifiable_copy(tmp_path, text.replace(f"\n{old}\n", f"\n{new}\n"))
    problems = verify_problems(unit)
    assert problems, f"systemd-analyze accepted {new!r}"


@needs_analyze
def test_verify_check_catches_a_missing_binary(tmp_path: Path) -> None:
    unit = verifiable_copy(tmp_path, UNIT.read_text(encoding="utf-8"))
    text = unit.read_text(encoding="utf-8")
    unit.write_text(text.replace(f"ExecStart={installed_h3d()} ", f"ExecStart={tmp_path}/no-such-h3d "))
    assert any("no-such-h3d" in p for p in verify_problems(unit))


def test_unit_contract_with_the_daemon() -> None:
    s = service()
    assert one(s, "Type") == "notify"  # the daemon sends READY=1 once it serves
    assert one(s, "NotifyAccess") == "main"
    assert one(s, "ExecStart") == f"{INSTALLED_AT} serve --config /etc/h3d/h3d.toml"
    assert one(s, "ExecReload") == "/bin/kill -HUP $MAINPID"  # SIGHUP reloads config.RELOADABLE
    assert one(s, "KillSignal") == "SIGTERM"  # SIGTERM drains
    assert one(s, "Restart") == "on-failure"
    assert (one(s, "User"), one(s, "Group")) == ("h3d", "h3d")
    # The stop timeout outlasts the drain (server.py: drain_timeout_s, then up to 10 s for
    # cancelled streams and a 5 s gRPC grace, then the flush), or systemd SIGKILLs mid-flush.
    drain = tomllib.loads(EXAMPLE.read_text(encoding="utf-8"))["drain_timeout_s"]
    assert seconds(one(s, "TimeoutStopSec")) >= drain + 30
    assert seconds(one(s, "TimeoutStartSec")) >= 120  # model load happens before READY=1
    assert seconds(one(s, "WatchdogSec")) > 0
    # The directories systemd makes are the ones the example configuration uses.
    cfg = load(str(EXAMPLE), {})
    assert one(s, "StateDirectory") == "h3d" and cfg.data_dir == "/var/lib/h3d" == DEFAULT_DATA_DIR
    assert one(s, "RuntimeDirectory") == "h3d" and cfg.socket_path == Path("/run/h3d/h3d.sock")
    assert one(s, "RuntimeDirectoryMode") == "0750" and cfg.socket_mode == "0660"
    assert one(s, "ConfigurationDirectory") == "h3d"
    # Sandboxing that would break CUDA stays off: a private /dev (no /dev/nvidia*), a device allow
    # list (ProtectClock= implies one on some systemd versions), W^X memory (torch/CUDA JIT).
    for key in ("PrivateDevices", "DeviceAllow", "DevicePolicy", "ProtectClock", "MemoryDenyWriteExecute"):
        assert key not in s, f"{key}= would keep the daemon from its GPUs or its JIT"
    for key in ("ProtectSystem", "ProtectHome", "PrivateTmp", "NoNewPrivileges", "SystemCallArchitectures"):
        assert key in s
    assert one(s, "CapabilityBoundingSet") == "" and one(s, "AmbientCapabilities") == ""
    assert unit_settings(UNIT.read_text(encoding="utf-8"))["Install"]["WantedBy"] == ["multi-user.target"]


def test_readme_names_the_reloadable_keys() -> None:
    text = README.read_text(encoding="utf-8")
    for key in RELOADABLE:
        assert f"`{key}`" in text, f"systemd/README.md: `systemctl reload` section misses {key}"


# ---- the example configuration ------------------------------------------------------------

ASSIGNMENT = re.compile(r"^(#\s*)?([a-z_][a-z0-9_]*)\s*=")


def example_keys() -> dict[str, dict[str, bool]]:
    """section ("" or "sampling") -> key -> set in the file (True) or only shown commented out."""
    out: dict[str, dict[str, bool]] = {"": {}}
    section = ""
    for raw in EXAMPLE.read_text(encoding="utf-8").splitlines():
        line = raw.strip()
        if line.startswith("[") and not line.startswith("[["):
            section = line.strip("[]").strip()
            out.setdefault(section, {})
            continue
        match = ASSIGNMENT.match(line)
        if match:
            key, active = match[2], match[1] is None
            out[section][key] = out[section].get(key, False) or active
    return out


def default_is_none(cls: type, name: str) -> bool:
    f = next(f for f in fields(cls) if f.name == name)
    return f.default is None and f.default_factory is MISSING


def test_example_loads(tmp_path: Path) -> None:
    load(str(EXAMPLE), {})  # as installed: nothing on disk is read at load time
    cfg = load(str(EXAMPLE), {"model": str(tmp_path / "model"), "data_dir": str(tmp_path)})
    assert cfg.data_dir == str(tmp_path)
    assert cfg.engine.model == str(tmp_path / "model")
    assert cfg.engine.ssd_path == str(tmp_path / "archive")  # follows data_dir: ssd_path is commented out


def test_example_documents_every_key() -> None:
    found = example_keys()
    assert set(found) == {"", "sampling"}, f"unexpected tables: {sorted(set(found) - {''})}"
    top, sampling = found[""], found["sampling"]
    for key in key_types():
        if key.startswith("sampling_"):
            name = key.removeprefix("sampling_")
            assert name in sampling, f"[sampling] {name} is not in systemd/h3d.toml (as `{name} =` or `# {name} =`)"
        else:
            assert key in top, f"{key} is not in systemd/h3d.toml (as `{key} =` or `# {key} =`)"
    # Nothing documented that does not exist.
    assert set(top) <= set(key_types()), sorted(set(top) - set(key_types()))
    assert set(sampling) == {f.name for f in fields(SamplingDefaults)}


def test_example_comments_out_exactly_the_keys_without_a_default() -> None:
    top = example_keys()[""]
    no_default = {f.name for f in fields(EngineConfig) if default_is_none(EngineConfig, f.name)} | {
        f.name for f in fields(DaemonConfig) if f.name != "engine" and default_is_none(DaemonConfig, f.name)
    }
    commented = {key for key, active in top.items() if not active}
    # `socket` has no value by default (<data_dir>/h3d.sock) but is set on purpose: /run/h3d.
    assert commented == no_default - {"socket"}
    assert top["socket"] is True


def test_example_commented_values_have_the_right_types() -> None:
    """Uncommenting an example line gives a value of the key's type."""
    types = key_types()
    for raw in EXAMPLE.read_text(encoding="utf-8").splitlines():
        match = ASSIGNMENT.match(raw.strip())
        if not match or match[1] is None:
            continue
        key = match[2]
        value = tomllib.loads(raw.strip().removeprefix("#").strip())[key]
        kind = types[key]
        ok = isinstance(value, kind) or (kind is float and isinstance(value, int))
        assert ok and not isinstance(value, bool), f"# {key} = {value!r}: expected {kind.__name__}"


def test_example_values_are_the_defaults(tmp_path: Path) -> None:
    """Every value set in the example is the key's default, except `socket` (/run/h3d/h3d.sock)."""
    overrides = {"model": str(tmp_path / "model"), "data_dir": str(tmp_path)}
    example = load(str(EXAMPLE), overrides).public()
    defaults = load(None, overrides).public()
    example.pop("socket")
    defaults.pop("socket")
    assert example == defaults


# ---- the notify protocol ------------------------------------------------------------------


def receive(sock: socket.socket) -> dict[str, str]:
    data = sock.recv(4096).decode()
    return dict(line.split("=", 1) for line in data.split("\n") if line)


def listener(address: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(5)
    return sock


def test_notify_ready_reaches_a_socket_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "notify"
    with listener(str(path)) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        notifier = Notifier()
        # What server.py sends once it serves, then while it stops.
        notifier.send(READY="1", STATUS="serving", MAINPID=str(os.getpid()))
        assert receive(sock) == {"READY": "1", "STATUS": "serving", "MAINPID": str(os.getpid())}
        notifier.send(STOPPING="1", STATUS="draining")
        assert receive(sock) == {"STOPPING": "1", "STATUS": "draining"}


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="abstract Unix socket names are Linux only")
def test_notify_ready_reaches_an_abstract_socket(monkeypatch: pytest.MonkeyPatch) -> None:
    name = f"h3d-test-notify-{os.getpid()}-{uuid.uuid4().hex}"
    with listener("\0" + name) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)  # systemd's spelling of "\0name"
        Notifier().send(READY="1")
        assert receive(sock) == {"READY": "1"}


def test_notify_watchdog_matches_the_unit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """systemd passes WatchdogSec= as WATCHDOG_USEC (and WATCHDOG_PID); the daemon pings at half."""
    watchdog_s = seconds(one(service(), "WatchdogSec"))
    path = tmp_path / "notify"
    with listener(str(path)) as sock:
        monkeypatch.setenv("NOTIFY_SOCKET", str(path))
        monkeypatch.setenv("WATCHDOG_USEC", str(int(watchdog_s * 1_000_000)))
        monkeypatch.setenv("WATCHDOG_PID", str(os.getpid()))
        notifier = Notifier()
        assert notifier.watchdog_s == watchdog_s
        notifier.send(WATCHDOG="1")
        assert receive(sock) == {"WATCHDOG": "1"}
    monkeypatch.setenv("WATCHDOG_PID", str(os.getpid() + 1))  # meant for another process
    assert Notifier().watchdog_s is None


def test_notify_without_a_manager_does_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    monkeypatch.delenv("WATCHDOG_USEC", raising=False)
    notifier = Notifier()
    assert notifier.address is None and notifier.watchdog_s is None
    notifier.send(READY="1")
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone"))  # the manager went away
    Notifier().send(READY="1")  # no error
