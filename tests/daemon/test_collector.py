"""The daemon's garbage collection between steps (h3d.daemon.collector): frozen at start,
automatic collection off, the generation CPython would collect collected when `due` is called."""

from __future__ import annotations

import gc
import weakref

from h3d.daemon.collector import Collector


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


def test_collection_happens_between_steps_only() -> None:
    collector = Collector()
    assert collector.due() == -1  # not started: nothing to do (automatic collection is on)
    limits = gc.get_threshold()
    try:
        gc.set_threshold(100, 10, 10)
        collector.start()
        # (other threads of the test process may free frozen objects meanwhile: never more frozen)
        assert not gc.isenabled() and collector.frozen >= gc.get_freeze_count() > 0
        a, b = Node(), Node()
        a.other, b.other = b, a  # a cycle: only the collector frees it
        dead = weakref.ref(a)
        del a, b
        kept = [Node() for _ in range(1000)]  # past gen 0's threshold: CPython would have collected by now
        assert dead() is not None  # nothing collected during the "step"
        assert collector.due() >= 0
        assert dead() is None and collector.collections == 1 and collector.pause_s_max > 0
        assert collector.due() == -1  # nothing due right after
        assert collector.take_max() > 0 and collector.take_max() == 0.0
        del kept
    finally:
        collector.stop()
        gc.unfreeze()
        gc.set_threshold(*limits)
    assert gc.isenabled()
