"""The remote tier's tests: each gets a redis-server of its own (`h3d.remote.local.LocalRedis`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from h3d.remote.local import LocalRedis


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[LocalRedis]:
    server = LocalRedis(tmp_path / "redis")
    try:
        yield server
    finally:
        server.stop()
