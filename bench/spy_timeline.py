"""One thread of a py-spy profile in speedscope's format (`bench/gpu-host.sh chat` with SPY=1), as
a timeline: per bucket of BUCKET_S seconds of that thread's samples, its two most common stacks
(the last DEPTH frames in h3d, and the leaf).

    python bench/spy_timeline.py PROFILE THREAD BUCKET_S [FROM_S TO_S [DEPTH]]

THREAD: part of the thread's name as py-spy wrote it (its id will do). Times count from the
thread's first sample; with `--idle` every tick is a sample, so they are the thread's wall time.
py-spy names a thread by the first one that had its id: the daemon's engine thread, started
once the DDR pool's pinning threads have ended, comes under one of their names (`h3d-pin_N`, the
one whose samples run to the end), and its times count from that pinning thread's start. Threads
that run to the end line up by their ends (each profile's `endValue`).
"""

from __future__ import annotations

import collections
import json
import sys


def main(argv: list[str]) -> None:
    path, thread, bucket = argv[0], argv[1], float(argv[2])
    start, end = (float(argv[3]), float(argv[4])) if len(argv) > 4 else (0.0, float("inf"))
    depth = int(argv[5]) if len(argv) > 5 else 2
    with open(path) as f:
        profile = json.load(f)
    frames = profile["shared"]["frames"]
    samples = next(p for p in profile["profiles"] if thread in p["name"])
    buckets: dict[int, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    t = 0.0
    for stack, weight in zip(samples["samples"], samples["weights"], strict=True):
        if start <= t < end:
            ours = [f"{frames[i]['name']}:{frames[i]['line']}" for i in stack if "h3d/" in (frames[i]["file"] or "")]
            leaf = frames[stack[-1]]["name"] if stack else "idle"
            buckets[int(t / bucket)][" > ".join(ours[-depth:]) + " | " + leaf if ours else leaf] += 1
        t += weight
    for b in sorted(buckets):
        counts = buckets[b]
        top = "; ".join(f"{k} x{v}" for k, v in counts.most_common(2))
        print(f"{b * bucket:8.3f} {sum(counts.values()):5d} {top[:330]}")


if __name__ == "__main__":
    main(sys.argv[1:])
