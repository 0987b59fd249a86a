"""The archive read and pinning probes (`h3d.bench.archive_read`, `h3d.bench.pinning`) on the CPU:
the read probe writes, reads back cold and warm, and leaves nothing; the pinning probe says it
needs a CUDA device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h3d.bench import archive_read, pinning


def test_the_read_probe_times_each_run_length_and_thread_count_cold_and_warm(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from h3d.tiers import archive, mover

    defaults = mover.READ_THREADS, archive.READ_RUN_BYTES
    work = tmp_path / "w"
    argv = ["--records", "130", "--threads", "1", "2", "--run-bytes", "0", "4194304", "--work", str(work)]
    assert archive_read.main(argv) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("put 130 records")
    assert [line.split(":")[0] for line in lines[1:]] == [
        f"read 130 records, runs of {kib} KiB, {n:2d} threads {kind}"
        for kib in (0, 4096) for n in (1, 2) for kind in ("cold", "warm")
    ]  # fmt: skip
    assert not work.exists()
    assert defaults == (mover.READ_THREADS, archive.READ_RUN_BYTES)  # the modules' settings put back
    assert archive_read.main([*argv[:4], "--first-step", "--work", str(work)]) == 0  # layers 0, 1 and a fifth
    lines = capsys.readouterr().out.splitlines()
    read = int(lines[1].split()[1])
    assert 2 * 130 // 32 < read < 130 and len(lines) == 3 and not work.exists()
    assert defaults == (mover.READ_THREADS, archive.READ_RUN_BYTES)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the probe itself")
def test_the_pinning_probe_needs_a_cuda_device() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        pinning.main([])
