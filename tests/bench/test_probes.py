"""The archive read and pinning probes (`h3d.bench.archive_read`, `h3d.bench.pinning`) on the CPU:
the read probe writes, reads back cold and warm, and leaves nothing; the pinning probe says it
needs a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h3d.bench import archive_read, pinning


def test_the_read_probe_times_each_thread_count_cold_and_warm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    work = tmp_path / "w"
    assert archive_read.main(["--records", "130", "--threads", "1", "2", "--work", str(work)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("put 130 records")
    assert [line.split(":")[0] for line in lines[1:]] == [
        "read  1 threads cold", "read  1 threads warm", "read  2 threads cold", "read  2 threads warm",
    ]  # fmt: skip
    assert not work.exists()


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the probe itself")
def test_the_pinning_probe_needs_a_cuda_device() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        pinning.main([])
