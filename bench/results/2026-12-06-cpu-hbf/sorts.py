"""np.lexsort against the packed keys of `sort_by_layer_and_rank`, on candidates of the sizes a
32K session gives the fair shares (its DDR-only blocks for a fill, its HBM blocks for a demotion)
and the promotion's victims (19,000 HBM slots: `lowest_per_layer`)."""
import time

import numpy as np

from h3d.tiers.promotion import lowest_per_layer, sort_by_layer_and_rank

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

n = 19000
layers = np.sort(rng.integers(0, 32, n))
value = rng.random(n).astype(np.float32)
value[rng.random(n) < 0.5] = 0
slots = rng.permutation(n * 10)[:n]
count = np.ones(32, dtype=np.int64)
print(f"{n} victim candidates: lexsort {ms(lambda: np.lexsort((slots, value, layers))):.2f} ms, "
      f"lowest_per_layer (packed, the pick included) {ms(lambda: lowest_per_layer(layers, value, slots, count)):.2f} ms")
