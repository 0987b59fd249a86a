"""CPU threads: how many torch uses (`cpu_threads`) and how its OpenMP threads wait.

`apply_cpu_threads(config)` is called once at start, before the model loads: by `h3d generate`
before torch is imported, by `h3d serve` (Daemon.run) after. It sets, unless the user did,

- `OMP_NUM_THREADS` to the thread count and `OMP_WAIT_POLICY=PASSIVE` (unless `GOMP_SPINCOUNT`
  is set) in the environment: libgomp reads them when torch loads it, so they count only before
  the first `import torch`; `omp_environment()` sets the wait policy alone, for a caller that
  imports torch before it knows the configuration;
- torch's intra-op thread count (`torch.set_num_threads`: OpenMP and MKL), whenever it is called.

Why the wait policy: by default libgomp's threads spin (`GOMP_SPINCOUNT`, 300,000 times) at the
end of each parallel region, waiting for the slowest. When another job holds one of the cores, the
thread that shares that core is descheduled for whole time slices while its partner spins on the
other core, and each of the hundreds of parallel regions of a decode step waits for it: on a
2-core host with one busy core decode ran several times slower than with PASSIVE
(docs/BENCHMARKS.md, "CPU threads on a shared host"). A passive thread sleeps at once, which
gives its core to the other job or to its partner.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from h3d.config import EngineConfig


def affinity_cores() -> int:
    """The cores this process may run on (its CPU affinity), or all cores where that is unknown."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def resolve_cpu_threads(config: EngineConfig) -> int:
    """`cpu_threads` when set (> 0); else `OMP_NUM_THREADS` when set to a positive integer; else the affinity."""
    if config.cpu_threads:
        return config.cpu_threads
    env = os.environ.get("OMP_NUM_THREADS", "").strip()
    if env.isdigit() and int(env) > 0:
        return int(env)
    return affinity_cores()


def omp_environment() -> None:
    """`OMP_WAIT_POLICY=PASSIVE` unless the user set a policy or libgomp's `GOMP_SPINCOUNT`
    (effective only before torch loads)."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"


def apply_cpu_threads(config: EngineConfig) -> int:
    """Set torch's CPU thread count from `config` (and the OpenMP environment, where still in time); return it."""
    n = resolve_cpu_threads(config)
    if "torch" not in sys.modules:
        os.environ.setdefault("OMP_NUM_THREADS", str(n))
        omp_environment()
    import torch

    torch.set_num_threads(n)  # a global of ATen's: every thread's first parallel op takes it up
    return n
