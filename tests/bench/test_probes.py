"""The archive read, pinning and DDR read probes (`h3d.bench.archive_read`, `h3d.bench.pinning`,
`h3d.bench.ddr_reads`) on the CPU: the read probe writes, reads back cold and warm, and leaves
nothing; the other two say they need a CUDA device, and the DDR probe's host facts and tables
are right."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from h3d.bench import archive_read, ddr_reads, pinning


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


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA host runs the probe itself")
def test_the_ddr_read_probe_needs_a_cuda_device() -> None:
    with pytest.raises(SystemExit, match="needs a CUDA device"):
        ddr_reads.main([])


def test_the_ddr_read_probe_lists_the_reads_it_times(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.Tensor, "cuda", lambda t: t)  # the tables stay on the CPU here
    g = torch.Generator().manual_seed(0)
    slots, hbm = 1000, 50
    for pattern in ("scattered", "runs", "mixed"):
        tables = ddr_reads._tables(pattern, 3, 2, 10, slots, hbm, g)
        assert len(tables) == 3 and all(t.shape == (2, ddr_reads.HEADS, 10) and t.dtype == torch.int32 for t in tables)
        t = tables[0].long()
        ddr = -t[t < 0] - 1
        assert ddr.min() >= 1 and ddr.max() < slots  # DDR slot s is -(s + 1), never the null slot
        if pattern == "runs":
            assert bool(((t[..., 1:] - t[..., :-1]) == -1).all())  # consecutive slots
        if pattern == "mixed":
            assert (t >= 1).sum() == 2 * ddr_reads.HEADS * 8 and int(t.max()) < hbm  # 8 of 10 in HBM
    nodes = ddr_reads._nodes()
    assert all(cpus for cpus in nodes.values())
