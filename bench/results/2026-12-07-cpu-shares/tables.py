"""A decode graph's slot whose table changed, written whole (as before) and by its
moved blocks alone (`BlockTable.moves_since`), at the `many` scale: 32 layers x 1,025 blocks a
session, a step's promotions spread over 16 sessions (512 a step: 32 blocks a slot), entry arrays
of two million entries. NumPy only: the two paths' array work, without the classes."""
import timeit

import numpy as np

E, L, NB, MOVED = 2_000_000, 32, 1025, 32
rng = np.random.default_rng(0)
hbm = np.where(rng.random(E) < 0.8, rng.integers(0, E, E), -1)
ddr = rng.integers(0, E, E)
ids = rng.integers(0, E, (L, 1280))
locs = np.zeros((L, 16, 1280), dtype=np.int64)
whole_layers = np.zeros(L, dtype=bool)
whole_layers[:2] = True
layers, blocks = rng.integers(0, L, MOVED), rng.integers(0, NB, MOVED)


def where(i: np.ndarray) -> np.ndarray:
    h = hbm[i]
    return np.where(h >= 0, h, -2 - ddr[i])


def whole() -> None:
    w = where(ids[:, :NB])
    locs[:, 3, :NB] = w
    locs[:, 3, NB:] = 0
    reads = (np.arange(NB)[None, :] >= np.zeros(L, dtype=np.int64)[:, None]) & whole_layers[:, None]
    int(np.count_nonzero(reads)), int(np.count_nonzero(reads & (w < 0)))


def moved() -> None:
    cell = np.unique(layers * 1280 + blocks)
    ly, bl = cell // 1280, cell % 1280
    old, new = locs[ly, 3, bl], where(ids[ly, bl])
    locs[ly, 3, bl] = new
    read = whole_layers[ly]
    int(np.count_nonzero(read & (new < 0))) - int(np.count_nonzero(read & (old < 0)))


n = 400
a = timeit.timeit(whole, number=n) / n
b = timeit.timeit(moved, number=n) / n
print(f"a slot written whole {a * 1e3:.3f} ms, its {MOVED} moved blocks {b * 1e3:.3f} ms; 16 slots: {16 * a * 1e3:.1f} / {16 * b * 1e3:.2f} ms")
