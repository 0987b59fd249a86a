"""Write-behind's test of a submit's entries against those in flight: np.isin against every
batch's entries (before 37398c5) and a lookup in a mask kept as batches come and go (after).
WRITE_BEHIND_IN_FLIGHT_MB (512) of 128 KiB blocks: 4,096 in flight, in 16 MiB batches of 128;
a submit looks at 32 layers x 64 columns."""
import timeit

import numpy as np

E = 2_000_000  # entries
rng = np.random.default_rng(0)
flight = np.split(rng.choice(E, 4096, replace=False), 32)
ids = rng.integers(0, E, (32, 64))
mask = np.zeros(E, dtype=bool)
for f in flight:
    mask[f] = True
assert (np.isin(ids, np.concatenate(flight)) == mask[ids]).all()
n = 500
isin = timeit.timeit(lambda: np.isin(ids, np.concatenate(flight)), number=n) / n
look = timeit.timeit(lambda: mask[ids], number=n) / n
print(f"np.isin {isin * 1e3:.3f} ms, mask {look * 1e3:.4f} ms a submit")
