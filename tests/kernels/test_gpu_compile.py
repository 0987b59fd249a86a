"""Every Triton kernel the GPU path launches compiles for the H100 / H200 (sm_90), checked on a
host without a GPU: `gpu_compile.py` (its docstring says how) in a process of its own, since this
one runs Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]


def test_every_kernel_compiles_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(ROOT)
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("gpu_compile.py")), "--arch", "90"],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    lines = proc.stdout.splitlines()
    kernels = {line.split(": ")[1].split()[0] for line in lines if " compiled in " in line}
    expected = {"_split_kernel", "_merge_kernel", "_write_kernel", "_copy_kernel", "_add_norm_kernel",
                "_rope_kernel", "_scores_kernel", "_top_kernel", "_lists_kernel", "_fold_kernel",
                "_lse_kernel", "_mass_kernel", "_combine_kernel"}  # fmt: skip
    assert kernels == expected, lines[-1]
