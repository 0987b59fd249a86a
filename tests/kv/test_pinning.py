"""A large pinned DDR pool is registered in pieces, lowest slots first, and handed out only as far
as it is registered (`h3d.kv.pool.Pinning`, `SlotAllocator.grow`, `TierManager.grow_ddr`).

On a CPU host nothing is registered with CUDA: these tests register the same pieces with a fake
registrar that records them, slowly, so that the pool is used while the rest is still under way.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import TEST_DEVICE, make_engine, random_prompt

import h3d.kv.cache
import h3d.kv.pool
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import GenerationDone
from h3d.kv.blocks import FREE
from h3d.kv.pool import PAGE, KVPool, Pinning
from h3d.kv.slots import SlotAllocator


class FakeCuda:
    """Records registered ranges; each registration waits `delay` s; `fail_at`: the address whose
    registration fails. Checks that no byte is registered twice."""

    def __init__(self, delay: float = 0.0, fail_at: int | None = None) -> None:
        self.ranges: dict[int, int] = {}
        self.delay, self.fail_at = delay, fail_at
        self.lock = threading.Lock()
        self.calls = 0

    def register(self, ptr: int, size: int) -> int:
        time.sleep(self.delay)
        with self.lock:
            self.calls += 1
            if ptr == self.fail_at:
                return 2
            assert all(ptr + size <= a or a + n <= ptr for a, n in self.ranges.items()), "a byte registered twice"
            self.ranges[ptr] = size
        return 0

    def unregister(self, ptr: int) -> None:
        with self.lock:
            del self.ranges[ptr]

    def covered(self, a: int, b: int) -> bool:
        """Whether every byte of [a, b) is registered."""
        with self.lock:
            spans = sorted(self.ranges.items())
        at = a
        for start, n in spans:
            if start <= at < start + n:
                at = start + n
            if at >= b:
                return True
        return at >= b


def slot_bytes_registered(cuda: FakeCuda, slabs: list[torch.Tensor], slots: int) -> bool:
    """Whether every byte of slots [0, slots) of every head of every slab is registered."""
    for slab in slabs:
        per_slot = slab[0, 0].numel() * slab.element_size()
        head = slab.shape[1] * per_slot
        for h in range(slab.shape[0]):
            a = slab.data_ptr() + h * head
            if slots and not cuda.covered(a, a + slots * per_slot):
                return False
    return True


@pytest.mark.parametrize("shape", [(4, 300, 16, 64), (2, 97, 32, 24), (3, 50, 5, 7)])
def test_usable_slots_are_registered_in_every_head_and_the_pieces_cover_the_slabs(shape: tuple[int, ...]) -> None:
    """At every moment, every byte of every slot below `usable` is registered (all heads, K and V);
    in the end the pieces cover both slabs exactly once, and `close` unregisters them."""
    k, v = torch.empty(shape, dtype=torch.bfloat16), torch.empty(shape, dtype=torch.bfloat16)
    k.fill_(1.0)
    cuda = FakeCuda(delay=0.002)
    slot = 2 * shape[0] * shape[2] * shape[3] * 2  # bytes of a slot, K and V
    p = Pinning([k, v], cuda.register, cuda.unregister, first_bytes=10 * slot, piece_bytes=3 * PAGE, threads=3)
    assert p.usable >= 10, "the first slots are registered before the pool is handed out"
    seen = [p.usable]
    while p.usable < shape[1]:
        usable = p.usable
        assert slot_bytes_registered(cuda, [k, v], usable)
        seen.append(usable)
        time.sleep(0.001)
    assert p.wait(shape[1], timeout=30) == shape[1] and p.error is None and p.done_s is not None
    assert seen == sorted(seen), "usable only grows"
    if shape[1] * shape[2] * shape[3] * 2 >= 8 * 3 * PAGE:  # a head spans many pieces
        assert len(set(seen)) > 2, "the pool was handed out in steps while the rest registered"
    else:  # every piece holds some head's first bytes: all are registered at once
        assert seen == [shape[1]]
    total = sum(cuda.ranges.values())
    assert total == 2 * k.numel() * k.element_size()
    assert slot_bytes_registered(cuda, [k, v], shape[1])
    assert (k == 0).all(), "the pages were faulted in (zeroed) before they were registered"
    p.close()
    assert cuda.ranges == {}


@pytest.mark.parametrize("shape", [(4, 300, 16, 64), (2, 97, 32, 24), (3, 50, 5, 7)])
def test_pieces_mapped_at_an_alignment_cover_the_slabs_rounded_out_to_it(shape: tuple[int, ...]) -> None:
    """Mapped host memory (`h3d.kv.hostmem`): K and V at aligned offsets of one range, every piece
    starts and ends at a multiple of the alignment, together they cover each slab rounded out to
    it once, every slot below `usable` is mapped at every moment, and nothing is zeroed before
    (the pages are not there until mapped)."""
    align = 4 * PAGE
    size = int(np.prod(shape)) * 2
    slab = -(-size // align) * align
    buf = torch.empty(2 * slab + align, dtype=torch.uint8)
    at = -buf.data_ptr() % align
    k, v = (buf[at + o : at + o + size].view(torch.bfloat16).view(shape) for o in (0, slab))
    k.fill_(1.0)
    cuda = FakeCuda(delay=0.002)
    slot = 2 * shape[0] * shape[2] * shape[3] * 2
    p = Pinning([k, v], cuda.register, cuda.unregister, first_bytes=10 * slot, piece_bytes=3 * PAGE, threads=3,
                align=align, zero=False)  # fmt: skip
    while p.usable < shape[1]:
        assert slot_bytes_registered(cuda, [k, v], p.usable)
        time.sleep(0.001)
    assert p.wait(shape[1], timeout=30) == shape[1] and p.error is None
    assert all(a % align == 0 and n % align == 0 for a, n in cuda.ranges.items())
    assert sum(cuda.ranges.values()) == 2 * slab and cuda.covered(k.data_ptr(), k.data_ptr() + 2 * slab)
    assert (k == 1).all(), "nothing written before the pieces were mapped"
    p.close()
    assert cuda.ranges == {}


def test_a_pool_is_pinned_one_of_the_stated_ways() -> None:
    with pytest.raises(ValueError, match="host_memory: one of auto, mapped, registered"):
        KVPool(4, 16, 2, 8, torch.float32, torch.device("cpu"), host_memory="huge")
    from h3d.kv import hostmem

    if not torch.cuda.is_available():  # no driver to map host memory with: a clear error
        assert not hostmem.supported()
        with pytest.raises(RuntimeError, match="cannot map pinned host memory"):
            hostmem.HostRange(1 << 20, torch.device("cuda"))
    cuda = FakeCuda()
    pool = KVPool(64, 16, 2, 8, torch.float32, torch.device("cpu"), register=(cuda.register, cuda.unregister),
                  host_memory="auto")  # fmt: skip
    assert pool.host_memory == "registered" and pool.usable == 64
    assert KVPool(4, 16, 2, 8, torch.float32, torch.device("cpu")).host_memory == "pageable"
    if not torch.cuda.is_available():  # `mapped` asked for where it cannot be: a clear error, not a fallback
        with pytest.raises(RuntimeError, match="ddr_memory mapped: this CUDA driver cannot map"):
            KVPool(4, 16, 2, 8, torch.float32, torch.device("cpu"), pin_memory=True, host_memory="mapped")


def test_a_failed_registration_stops_the_pool_where_it_is() -> None:
    """A piece that cannot be registered stops `usable` below its slots; the error is kept, `wait`
    returns, and the pieces registered are unregistered at close."""
    k, v = torch.zeros(2, 64, 16, 64, dtype=torch.bfloat16), torch.zeros(2, 64, 16, 64, dtype=torch.bfloat16)
    head = 64 * 16 * 64 * 2
    fail = k.data_ptr() + head + 40 * 16 * 64 * 2  # head 1, slot 40 of K
    cuda = FakeCuda(fail_at=fail & ~(PAGE - 1))
    p = Pinning([k, v], cuda.register, cuda.unregister, first_bytes=8 * 4 * 16 * 64 * 2, piece_bytes=4 * PAGE)
    assert p.wait(64, timeout=30) < 64
    assert p.error is not None and "pinning" in p.error and "CUDA error 2" in p.error
    assert 8 <= p.usable <= 40
    assert slot_bytes_registered(cuda, [k, v], p.usable)
    p.close()
    assert cuda.ranges == {}


def test_a_failure_among_the_first_pieces_is_raised() -> None:
    k = torch.zeros(2, 64, 16, 64, dtype=torch.bfloat16)
    cuda = FakeCuda(fail_at=k.data_ptr())
    with pytest.raises(RuntimeError, match=r"pinning .* failed"):
        Pinning([k], cuda.register, cuda.unregister, first_bytes=PAGE, piece_bytes=PAGE)
    assert cuda.ranges == {}


def test_grow_hands_out_new_slots_after_the_free_ones() -> None:
    owner = np.full(1 + 20, FREE, dtype=np.int64)
    a = SlotAllocator(1, 20, owner, usable=5)
    assert (a.capacity, a.size, a.num_free) == (5, 20, 5)
    first = a.allocate(3, 7)
    assert first.tolist() == [1, 2, 3]
    a.release(np.array([2]))
    assert a.grow(12) == 7 and a.capacity == 12 and a.grow(12) == 0
    # the freed and never-used low slots first, ascending, then the new ones
    assert a.allocate(9, 7).tolist() == [2, 4, 5, 6, 7, 8, 9, 10, 11]
    assert a.grow(99) == 8 and a.capacity == 20
    assert a.allocate(9, 7).tolist() == list(range(12, 21))
    assert a.num_free == 0


def test_a_session_decodes_the_same_while_ddr_is_still_registering(
    checkpoint: Callable[[str], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A DDR pool registered slowly (a few slots at first) gives the same greedy tokens as one ready
    at once; no slot past what was registered is ever owned; a prompt that needs more DDR than is
    registered yet waits for it instead of failing. (With `H3D_TEST_DEVICE=cuda`, registered with
    CUDA in pieces of two pages, which the decode kernels read in place.)"""
    ckpt = checkpoint("llama_gqa4_tied")
    prompt = random_prompt(600, 512, seed=3)
    params = SamplingParams(max_tokens=24, ignore_eos=True)

    def run(register: bool) -> list[int]:
        cuda = FakeCuda(delay=0.004)
        pools: list[KVPool] = []
        real = KVPool

        def pool(*args: object, **kw: object) -> KVPool:
            if register and "register" in kw and not TEST_DEVICE:  # (on a GPU: registered with CUDA)
                kw["register"] = (cuda.register, cuda.unregister)
            made = real(*args, **kw)  # type: ignore[arg-type]
            pools.append(made)
            return made

        monkeypatch.setattr(h3d.kv.cache, "KVPool", pool)
        monkeypatch.setattr(h3d.kv.pool, "PIN_FIRST", 2 * 4096 if register else 1 << 40)
        monkeypatch.setattr(h3d.kv.pool, "PIN_PIECE", 2 * PAGE)
        monkeypatch.setattr(h3d.kv.pool, "PIN_THREADS", 1)
        engine = make_engine(ckpt, hbm_mb=0.25, ddr_mb=2.0, ssd_path=str(tmp_path / f"ssd-{register}"))
        ddr = engine.kv.ddr
        if register and not TEST_DEVICE:
            assert ddr.pinning is not None and ddr.usable < ddr.num_slots // 4
            assert engine.kv.blocks.ddr_alloc.capacity == ddr.usable - 1
        sid = engine.create_session()
        done = list(engine.generate(sid, token_ids=prompt, params=params))[-1]
        assert isinstance(done, GenerationDone)
        owner = engine.kv.blocks.ddr_owner
        assert (owner[ddr.usable :] == FREE).all()
        if register:
            assert ddr.pinning is not None and ddr.pinning.error is None
            assert engine.kv.blocks.ddr_alloc.capacity > 8, "the session's DDR grew as it registered"
        engine.close()
        assert cuda.ranges == {}
        return list(done.token_ids)

    assert run(True) == run(False)


def test_a_wait_returns_when_the_pool_is_closed() -> None:
    """`close` while the rest is still registering: a `wait` for all of it returns (a daemon that
    stops before its DDR is all registered exits, its waiter no longer blocked), the pieces under
    way finish, and every piece registered is unregistered."""
    k = torch.zeros(2, 256, 16, 64, dtype=torch.bfloat16)
    cuda = FakeCuda(delay=0.02)
    p = Pinning([k], cuda.register, cuda.unregister, first_bytes=PAGE, piece_bytes=2 * PAGE, threads=1)
    got: list[int] = []
    waiter = threading.Thread(target=lambda: got.append(p.wait(256)))
    waiter.start()
    time.sleep(0.05)
    p.close()
    waiter.join(timeout=5)
    assert not waiter.is_alive() and got and got[0] < 256 and p.done_s is None
    assert cuda.ranges == {}


def test_the_kernels_take_a_host_pool_in_an_open_mapped_range(monkeypatch: pytest.MonkeyPatch) -> None:
    """The decode kernels refuse host memory the GPU cannot address: a mapped pool (`hostmem`) is
    known by the ranges this process opened (no driver call at each launch), the rest by torch."""
    from h3d.kernels import loader
    from h3d.kv import hostmem

    t = torch.zeros(2, 8, 16, 4)
    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="must be pinned"):
        loader.addressable(t, cuda)
    monkeypatch.setitem(hostmem._live, t.data_ptr() - 64, t.numel() * t.element_size() + 64)  # an open range
    assert hostmem.mapped(t[1].data_ptr()) and loader.addressable(t, cuda) is t
    monkeypatch.delitem(hostmem._live, t.data_ptr() - 64)  # closed
    assert not hostmem.mapped(t.data_ptr())
