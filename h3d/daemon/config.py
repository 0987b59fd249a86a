"""The daemon's configuration: `h3d.toml`, overridden by flags of the same names.

The file is flat: every engine key (`h3d.config.EngineConfig`) and every daemon key
(`DaemonConfig`) at the top level, the sampling defaults in a `[sampling]` table. Each key is also
a flag in kebab case (`hbm_mb` <-> `--hbm-mb`, `sampling.temperature` <-> `--sampling-temperature`);
flags win. A bad key or value raises `ConfigError` naming it. systemd/h3d.toml documents every
key; docs/OPERATIONS.md says which ones SIGHUP reloads (`RELOADABLE`).
"""

from __future__ import annotations

import ipaddress
import json
import tomllib
from dataclasses import MISSING, asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any

from h3d.config import AUTO, OR_AUTO, EngineConfig, SamplingDefaults
from h3d.errors import ConfigError

LOG_LEVELS = ("debug", "info", "warning", "error")
REMOTE_LOGS = ("sync", "async")
DEFAULT_DATA_DIR = "/var/lib/h3d"
# Keys SIGHUP re-reads from the file (the others need a restart).
RELOADABLE = (
    "log_level",
    "stats_interval_s",
    "drain_timeout_s",
    "shutdown_budget_s",
    "max_pending_requests",
    "max_tokens_limit",
    "auth_token_file",
    "admin_token_file",
    "session_ttl_s",
)


@dataclass(frozen=True, slots=True)
class DaemonConfig:
    """Daemon keys; `engine` holds the engine's. Paths may be relative to the working directory."""

    engine: EngineConfig
    data_dir: str = DEFAULT_DATA_DIR
    socket: str | None = None  # default: <data_dir>/h3d.sock
    socket_mode: str = "0660"
    listen: str | None = None  # "HOST:PORT" for TCP; port 0 picks a free one
    http_listen: str | None = None  # "HOST:PORT" of the OpenAI-compatible HTTP API; off by default
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    auth_token_file: str | None = None  # one bearer token per line; all are clients
    admin_token_file: str | None = None  # tokens allowed to call H3Admin
    metrics_listen: str | None = None  # "HOST:PORT" of the Prometheus endpoint; off by default
    log_level: str = "info"
    stats_interval_s: float = 10.0
    drain_timeout_s: float = 30.0
    shutdown_budget_s: float = 45.0  # SIGTERM: time for the checkpoint after the drain (h3d.daemon.server)
    max_pending_requests: int = 256
    max_tokens_limit: int = 4096
    max_message_bytes: int = 4 * 1024 * 1024
    retry_after_ms: int = 500
    session_ttl_s: float = 0.0  # close sessions idle (no request, not pinned) this long; 0: never
    remote_url: str | None = None  # redis://HOST:PORT/DB of the remote tier (h3d.remote); off by default
    remote_password_file: str | None = None
    remote_log: str = "sync"  # sync: a token streamed once the store holds it; async: copied behind
    remote_lease_s: float = 15.0
    remote_timeout_s: float = 5.0
    remote_kv_ttl_s: float = 7 * 86400.0  # a KV block's life in the store since it was last written
    remote_kv_copy_mb: float = 512.0  # KV written behind waiting to be copied to the store, at most (0: none copied)
    # a session taken over: its KV read from the store, computed again, or whichever the rates measured here say is
    # faster (h3d.engine.engine.Engine._choose_kv)
    remote_kv_resume: str = "auto"

    @property
    def socket_path(self) -> Path:
        return Path(self.socket) if self.socket else Path(self.data_dir) / "h3d.sock"

    def validate(self) -> DaemonConfig:
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        try:
            mode = int(self.socket_mode, 8)
        except ValueError:
            raise ConfigError(f"socket_mode: {self.socket_mode!r} is not an octal mode such as 0660") from None
        if not 0 <= mode <= 0o777:
            raise ConfigError(f"socket_mode: {self.socket_mode!r} is out of range")
        for key in ("stats_interval_s", "drain_timeout_s", "max_pending_requests", "max_tokens_limit"):
            if not getattr(self, key) > 0:
                raise ConfigError(f"{key}: must be > 0, got {getattr(self, key)}")
        if self.max_message_bytes < 1024:
            raise ConfigError(f"max_message_bytes: must be >= 1024, got {self.max_message_bytes}")
        if not self.shutdown_budget_s >= 0:
            raise ConfigError(f"shutdown_budget_s: must be >= 0 (0 writes no KV), got {self.shutdown_budget_s}")
        if not self.session_ttl_s >= 0:
            raise ConfigError(f"session_ttl_s: must be >= 0 (0 keeps sessions forever), got {self.session_ttl_s}")
        if self.retry_after_ms < 0:
            raise ConfigError(f"retry_after_ms: must be >= 0, got {self.retry_after_ms}")
        if (self.tls_cert_file is None) != (self.tls_key_file is None):
            raise ConfigError("tls_cert_file, tls_key_file: give both or neither")
        for key in ("tls_cert_file", "tls_key_file", "auth_token_file", "admin_token_file"):
            path = getattr(self, key)
            if path is not None and not Path(path).is_file():
                raise ConfigError(f"{key}: {path} is not a readable file")
        for key in ("auth_token_file", "admin_token_file"):
            path = getattr(self, key)
            if path is not None and not read_tokens(path):
                raise ConfigError(f"{key}: {path} holds no token")
        for key in ("listen", "http_listen"):
            address = getattr(self, key)
            if address is None:
                continue
            host, _ = split_address(key, address)
            if not is_loopback(host) and self.tls_cert_file is None and self.auth_token_file is None:
                raise ConfigError(
                    f"{key}: {address} is reachable beyond this host; configure tls_cert_file/tls_key_file "
                    f"or auth_token_file (or {key} on 127.0.0.1)"
                )
        if self.metrics_listen is not None:
            split_address("metrics_listen", self.metrics_listen)
        self._validate_remote()
        return self

    def _validate_remote(self) -> None:
        from h3d.remote.store import RemoteError, check_url  # (redis loads only where the tier is used)

        if self.remote_log not in REMOTE_LOGS:
            raise ConfigError(f"remote_log: {self.remote_log!r} is not one of {', '.join(REMOTE_LOGS)}")
        if not self.remote_lease_s > 0 or not self.remote_timeout_s > 0:
            raise ConfigError("remote_lease_s, remote_timeout_s: must be > 0")
        if not self.remote_kv_ttl_s >= 1:
            raise ConfigError(f"remote_kv_ttl_s: must be >= 1, got {self.remote_kv_ttl_s}")
        if self.remote_kv_resume not in ("auto", "store", "recompute"):
            raise ConfigError(f"remote_kv_resume: {self.remote_kv_resume!r} is not one of auto, store, recompute")
        if not self.remote_kv_copy_mb >= 0:
            raise ConfigError(f"remote_kv_copy_mb: must be >= 0, got {self.remote_kv_copy_mb}")
        if self.remote_timeout_s * 3 > self.remote_lease_s:
            raise ConfigError(
                f"remote_timeout_s: {self.remote_timeout_s} s is more than a third of remote_lease_s "
                f"({self.remote_lease_s} s): a lease must be renewable within its life"
            )
        if self.remote_url is None:
            if self.remote_password_file is not None:
                raise ConfigError("remote_password_file: set remote_url too (or neither)")
            return
        try:
            check_url(self.remote_url)
        except RemoteError as e:
            raise ConfigError(f"remote_url: {e}") from None
        path = self.remote_password_file
        if path is not None and not (Path(path).is_file() and Path(path).read_text().strip()):
            raise ConfigError(f"remote_password_file: {path} is not a readable file holding a password")

    def remote_password(self) -> str | None:
        """The remote store's password (`remote_password_file`'s first line), or None."""
        if self.remote_password_file is None:
            return None
        return Path(self.remote_password_file).read_text().strip().splitlines()[0]

    def public(self) -> dict[str, Any]:
        """Every key and value (token files by path only), for GetConfig and the startup log."""
        out = asdict(self)
        engine = out.pop("engine")
        if self.remote_url is not None:
            from h3d.remote.store import redact

            out["remote_url"] = redact(self.remote_url)
        return {**engine, **out, "socket": str(self.socket_path)}

    def to_json(self) -> str:
        return json.dumps(self.public(), sort_keys=True)


def split_address(key: str, value: str) -> tuple[str, int]:
    host, sep, port = value.rpartition(":")
    host = host.strip("[]")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{key}: {value!r} is not HOST:PORT")
    return host, int(port)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def read_tokens(path: str) -> list[str]:
    """Bearer tokens, one per line (blank lines and `#` comments ignored)."""
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read token file {path}: {exc}") from exc
    return [t.strip() for t in lines if t.strip() and not t.strip().startswith("#")]


# ---- loading ------------------------------------------------------------------------------

ENGINE_KEYS = {f.name for f in fields(EngineConfig)} - {"sampling"}
DAEMON_KEYS = {f.name for f in fields(DaemonConfig)} - {"engine"}
SAMPLING_KEYS = {f.name for f in fields(SamplingDefaults)}


def key_types() -> dict[str, type]:
    """Every flat key (sampling keys as `sampling_<name>`) and the type of its value."""
    out: dict[str, type] = {}
    for cls, prefix, skip in ((EngineConfig, "", {"sampling"}), (DaemonConfig, "", {"engine"})):
        for f in fields(cls):
            if f.name in skip:
                continue
            default = f.default if f.default is not MISSING else None
            out[prefix + f.name] = type(default) if default is not None else str
    for f in fields(SamplingDefaults):
        out["sampling_" + f.name] = type(f.default)
    out["hbm_mb"] = out["ddr_mb"] = out["ssd_capacity_mb"] = float  # or "auto" (OR_AUTO)
    out["prefill_chunk_tokens"] = int
    out["quantize_skip_layers"] = tuple
    out["max_context_tokens"] = int
    out["cpu_threads"] = int
    out["dense_hbm_share"] = float
    out["check_invariants"] = bool
    return out


def load(path: str | None, overrides: dict[str, Any]) -> DaemonConfig:
    """The file at `path` (if any) with `overrides` (flat keys, None = not given) on top."""
    values: dict[str, Any] = {}
    sampling: dict[str, Any] = {}
    if path is not None:
        try:
            raw = tomllib.loads(Path(path).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"cannot read {path}: {exc.strerror or exc}") from exc
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{path}: not valid TOML: {exc}") from exc
        for key, value in raw.items():
            if key == "sampling":
                if not isinstance(value, dict):
                    raise ConfigError("sampling: must be a table ([sampling])")
                for k, v in value.items():
                    if k not in SAMPLING_KEYS:
                        raise ConfigError(f"sampling.{k}: unknown configuration key")
                    sampling[k] = v
            elif key in ENGINE_KEYS or key in DAEMON_KEYS:
                values[key] = value
            else:
                raise ConfigError(f"{key}: unknown configuration key")
    for key, value in overrides.items():
        if value is None:
            continue
        if key.startswith("sampling_") and key[len("sampling_") :] in SAMPLING_KEYS:
            sampling[key[len("sampling_") :]] = value
        elif key in ENGINE_KEYS or key in DAEMON_KEYS:
            values[key] = value
        else:
            raise ConfigError(f"{key}: unknown configuration key")
    types = key_types()
    for key, value in list(values.items()) + [(f"sampling_{k}", v) for k, v in sampling.items()]:
        _check_type(key, value, types.get(key, str))
    if "quantize_skip_layers" in values:
        values["quantize_skip_layers"] = tuple(values["quantize_skip_layers"])
    daemon = {k: v for k, v in values.items() if k in DAEMON_KEYS}
    engine = {k: v for k, v in values.items() if k in ENGINE_KEYS}
    data_dir = str(daemon.get("data_dir", DEFAULT_DATA_DIR))
    engine.setdefault("ssd_path", str(Path(data_dir) / "archive"))
    engine.setdefault("session_log_path", str(Path(data_dir) / "sessions"))
    engine_cfg = EngineConfig.build(**engine)
    if sampling:
        engine_cfg = replace(engine_cfg, sampling=replace(SamplingDefaults(), **sampling)).validate()
    return DaemonConfig(engine=engine_cfg, **daemon).validate()


def _check_type(key: str, value: Any, kind: type) -> None:
    name = key.replace("sampling_", "sampling.", 1) if key.startswith("sampling_") else key
    if key in OR_AUTO and value == AUTO:
        return
    if kind is bool:
        ok = isinstance(value, bool)
    elif kind is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
    elif kind is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind is tuple:
        ok = isinstance(value, list | tuple) and all(isinstance(v, int) and not isinstance(v, bool) for v in value)
    else:
        ok = isinstance(value, str)
    if not ok:
        also = " or 'auto'" if key in OR_AUTO else ""
        raise ConfigError(f"{name}: expected {_kind_name(kind)}{also}, got {value!r}")


def _kind_name(kind: type) -> str:
    return {bool: "true or false", float: "a number", int: "an integer", tuple: "a list of integers"}.get(
        kind, "a string"
    )
