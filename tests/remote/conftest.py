"""The remote tier's tests: each gets a redis-server of its own (`redisserver.RedisServer`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from redisserver import RedisServer, free_port


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis", free_port())
    server.folder.mkdir()
    server.start()
    try:
        yield server
    finally:
        server.stop()
