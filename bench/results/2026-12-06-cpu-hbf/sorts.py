"""np.lexsort against the packed keys of `sort_by_layer_and_rank`, on candidates of the sizes a
32K session gives the fair shares (its DDR-only blocks for a fill, its HBM blocks for a demotion)."""
import time

import numpy as np

from h3d.tiers.promotion import sort_by_layer_and_rank

rng = np.random.default_rng(1)


def ms(f, r=200):
    t0 = time.perf_counter()
    for _ in range(r):
        f()
    return (time.perf_counter() - t0) / r * 1e3


for n in (8000, 24000):
    layers = np.sort(rng.integers(0, 32, n))
    blocks = rng.integers(0, 1024, n)
    value = rng.random(n).astype(np.float32)
    value[rng.random(n) < 0.5] = 0
    print(f"{n} candidates: demotion order, lexsort {ms(lambda: np.lexsort((-blocks, value, layers))):.2f} ms, "
          f"packed {ms(lambda: sort_by_layer_and_rank(layers, value, 1023 - blocks)):.2f} ms; "
          f"fill order, lexsort {ms(lambda: np.lexsort((blocks, -value, layers))):.2f} ms, "
          f"packed {ms(lambda: sort_by_layer_and_rank(layers, value, blocks, descending=True)):.2f} ms")
