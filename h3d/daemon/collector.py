"""Python's garbage collector kept off the engine's steps.

CPython collects when allocations pass a generation's threshold, in whichever thread allocates:
in the daemon that is often the engine thread in the middle of a step, and a full collection walks
every object the process holds (the model's modules, torch's, the sessions'), a pause of tens of
milliseconds in a decoding stream. The daemon therefore:

- freezes what exists once it is warm (`gc.freeze()`: the model, the tiers, the compiled graphs;
  a collection no longer walks them) and turns automatic collection off (`start`);
- collects between steps instead (`due`, called by the engine thread after each step and while
  it idles): the generation CPython would have collected by then (the same thresholds), never
  during a step. What a collection took is kept (`collections`, `pause_s_max`) and logged with
  the periodic `tier_stats` event.
"""

from __future__ import annotations

import gc
import time


class Collector:
    def __init__(self) -> None:
        self.collections = 0
        self.pause_s_total = 0.0
        self.pause_s_max = 0.0  # since `take_max`
        self.frozen = 0  # objects frozen at start
        self.on = False

    def start(self) -> None:
        """Freeze what exists now and collect only through `due` from here on."""
        gc.collect()
        gc.freeze()
        self.frozen = gc.get_freeze_count()
        gc.disable()
        self.on = True

    def stop(self) -> None:
        """Automatic collection back on (the process is shutting down)."""
        if self.on:
            gc.enable()
            self.on = False

    def due(self) -> int:
        """Collect the oldest generation past its threshold, if any (as CPython would have by
        now); returns the generation collected, -1 when none was due."""
        if not self.on:
            return -1
        counts, limits = gc.get_count(), gc.get_threshold()
        generation = next((g for g in (2, 1, 0) if limits[g] and counts[g] >= limits[g]), -1)
        if generation < 0:
            return -1
        t0 = time.perf_counter()
        gc.collect(generation)
        pause = time.perf_counter() - t0
        self.collections += 1
        self.pause_s_total += pause
        self.pause_s_max = max(self.pause_s_max, pause)
        return generation

    def take_max(self) -> float:
        """The longest pause since the last call (seconds)."""
        out, self.pause_s_max = self.pause_s_max, 0.0
        return out
