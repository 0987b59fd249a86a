"""The SSD cold tier: codecs round-trip (bit-exact or within the documented bound), and the archive
survives reopen, corruption, foreign stores and a crash between the data and manifest writes."""

from __future__ import annotations

import errno
import json
import os
import tempfile
import threading
import time
import zlib
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from h3d.store.files import FileOps
from h3d.tiers import codecs
from h3d.tiers.archive import Archive
from h3d.tiers.codecs import (
    INT8_MAX_REL_ERROR,
    INT8_MIN_SCALE,
    Codec,
    decode,
    decode_int8_many,
    encode,
    encode_int8_many,
)
from h3d.tiers.compaction import COPY_CHUNK_BYTES, CompactionHooks
from h3d.tiers.identity import ArchiveCorrupt, ArchiveError, ArchiveMismatch, BlockKey, CacheIdentity

NAMES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
BITS = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}
HUGE = {torch.float32: 1e30, torch.bfloat16: 1e30, torch.float16: 6e4}
TINY = {torch.float32: 1e-40, torch.bfloat16: 1e-40, torch.float16: 1e-7}  # denormal in each dtype
IDENT = CacheIdentity(fingerprint="ab12", dtype="fp32", block_size=32, num_kv_heads=3, head_dim=64)


def values(shape: tuple[int, ...], dtype: torch.dtype, kind: str, seed: int) -> torch.Tensor:
    """Finite values of one magnitude class; rows of 'mixed' span many orders of magnitude."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "huge":
        x = x.clamp(-1, 1) * HUGE[dtype]
    elif kind == "tiny":
        x = x * TINY[dtype]
    elif kind == "mixed":
        x = x * 10.0 ** torch.randint(-6, 7, (*shape[:-1], 1), generator=g).to(torch.float64)
    x = x.clamp(-HUGE[dtype], HUGE[dtype]).to(dtype)
    x[torch.rand(shape, generator=g) < 0.1] = 0.0
    x[torch.rand(shape, generator=g) < 0.05] = -0.0
    return x


def any_bits(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Every bit pattern is fair: ±0, ±inf, NaNs with payloads, denormals."""
    g = torch.Generator().manual_seed(seed)
    bits = BITS[dtype]
    info = torch.iinfo(bits)
    x = torch.randint(info.min, info.max, shape, generator=g, dtype=torch.int64).to(bits).view(dtype)
    specials = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan")], dtype=dtype)
    x.view(-1)[: specials.numel()] = specials[: x.numel()]
    return x


@st.composite
def blocks(draw: st.DrawFn, finite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = draw(st.sampled_from(list(NAMES)))
    shape = (draw(st.integers(1, 4)), draw(st.integers(1, 32)), draw(st.sampled_from([8, 16, 64])))
    kinds = ["unit", "huge", "tiny", "mixed"] + ([] if finite else ["bits"])
    kind, seed = draw(st.sampled_from(kinds)), draw(st.integers(0, 2**31))
    if kind == "bits":
        return any_bits(shape, dtype, seed), any_bits(shape, dtype, seed + 1)
    return values(shape, dtype, kind, seed), values(shape, dtype, kind, seed + 1)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality, so that -0 != +0 and NaN == NaN (same payload)."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def identity_for(k: torch.Tensor, block_size: int = 32) -> CacheIdentity:
    return CacheIdentity("f00d", NAMES[k.dtype], block_size, k.shape[0], k.shape[2])


def check_int8_bound(x: torch.Tensor, y: torch.Tensor) -> None:
    """Per element |x - x̂| <= max|row| / 254 (or INT8_MIN_SCALE / 2 for rows below ~1.5e-36), plus
    rounding: float32 arithmetic in the codec (2^-22 of the row max) and the cast of x̂ back to the
    output dtype (half an ulp of x̂ <= eps/2 * max|row|, or half the smallest denormal)."""
    info = torch.finfo(x.dtype)
    x64, y64 = x.to(torch.float64), y.to(torch.float64)  # [Hkv, n, D]
    amax = x64.abs().amax(dim=-1, keepdim=True)  # [Hkv, n, 1]
    bound = torch.clamp(amax * INT8_MAX_REL_ERROR, min=INT8_MIN_SCALE / 2)
    tol = bound + amax * (info.eps + 2.0**-22) + info.smallest_normal * info.eps
    err = (x64 - y64).abs()
    assert bool((err <= tol).all()), f"max excess {(err - tol).max().item()}"
    assert bool((y64[amax.expand_as(x64) == 0] == 0).all())  # zero rows decode to zeros


@settings(max_examples=300, deadline=None)
@given(blocks())
def test_raw_codec_is_bit_exact(kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    k, v = kv
    k2, v2 = decode(Codec.RAW_ZSTD, encode(Codec.RAW_ZSTD, k, v), k.dtype, *k.shape)
    assert same_bits(k, k2) and same_bits(v, v2)


@settings(max_examples=300, deadline=None)
@given(blocks(finite=True))
def test_int8_codec_within_bound(kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    k, v = kv
    k2, v2 = decode(Codec.INT8_DELTA_ZSTD, encode(Codec.INT8_DELTA_ZSTD, k, v), k.dtype, *k.shape)
    assert k2.dtype == k.dtype and k2.shape == k.shape
    check_int8_bound(k, k2)
    check_int8_bound(v, v2)


@settings(max_examples=100, deadline=None)
@given(st.lists(blocks(finite=True), min_size=1, max_size=4))
def test_int8_records_decoded_together_equal_each_decoded_alone(kvs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """`encode_int8_many` and `decode_int8_many` (a bulk write's and read's) against `encode` and
    `decode` a record at a time: the same bytes, and bit for bit the same values."""
    hkv, n, d = kvs[0][0].shape
    dtype = kvs[0][0].dtype
    same = [(k, v) for k, v in kvs if k.shape == (hkv, n, d) and k.dtype == dtype]
    payloads = [encode(Codec.INT8_DELTA_ZSTD, k, v) for k, v in same]
    assert encode_int8_many(same) == payloads
    together = decode_int8_many(payloads, dtype, hkv, n, d)
    assert together.shape == (len(same), 2 * hkv, n, d) and together.dtype == dtype
    for i, payload in enumerate(payloads):
        k, v = decode(Codec.INT8_DELTA_ZSTD, payload, dtype, hkv, n, d)
        assert same_bits(together[i, :hkv], k) and same_bits(together[i, hkv:], v)
    with pytest.raises(ValueError, match=f"payload {len(payloads)}"):
        decode_int8_many([*payloads, b"not zstd"], dtype, hkv, n, d)


def test_int8_codec_refuses_non_finite() -> None:
    k = torch.zeros(1, 2, 8)
    k[0, 1, 3] = float("nan")
    with pytest.raises(ValueError, match="raw-zstd"):
        encode(Codec.INT8_DELTA_ZSTD, k, torch.zeros(1, 2, 8))


@settings(max_examples=60, deadline=None)
@given(blocks(), st.sampled_from(list(Codec)))
def test_archive_round_trip(kv: tuple[torch.Tensor, torch.Tensor], codec: Codec) -> None:
    k, v = kv
    finite = bool(torch.isfinite(k).all() and torch.isfinite(v).all())
    with tempfile.TemporaryDirectory() as d:
        key = BlockKey("s", 1, 2)
        with Archive(Path(d), identity_for(k), codec) as a:
            if codec is Codec.INT8_DELTA_ZSTD and not finite:
                with pytest.raises(ValueError):
                    a.put([(key, k, v)])
                return
            a.put([(key, k, v)])
        with Archive(Path(d), identity_for(k), codec) as a:
            k2, v2 = a.get(key)
    if codec is Codec.RAW_ZSTD:
        assert same_bits(k, k2) and same_bits(v, v2)
    else:
        check_int8_bound(k, k2)
        check_int8_bound(v, v2)


def test_lossless_layers_are_bit_exact_under_int8(tmp_path: Path) -> None:
    k, v = any_bits((3, 32, 64), torch.float32, 1), any_bits((3, 32, 64), torch.float32, 2)
    with Archive(tmp_path, IDENT, Codec.INT8_DELTA_ZSTD, lossless_layers=frozenset({0, 5})) as a:
        a.put([(BlockKey("s", 0, 0), k, v), (BlockKey("s", 5, 0), k, v)])
        for layer in (0, 5):
            k2, v2 = a.get(BlockKey("s", layer, 0))
            assert same_bits(k, k2) and same_bits(v, v2)
        with pytest.raises(ValueError):  # layer 1 is int8, which cannot hold NaN
            a.put([(BlockKey("s", 1, 0), k, v)])
        kf = values((3, 32, 64), torch.float32, "unit", 3)
        a.put([(BlockKey("s", 1, 0), kf, kf)])
        assert not same_bits(a.get(BlockKey("s", 1, 0))[0], kf)  # lossy indeed
        check_int8_bound(kf, a.get(BlockKey("s", 1, 0))[0])


def block(seed: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    return values((3, n, 64), torch.float32, "unit", seed), values((3, n, 64), torch.float32, "unit", seed + 1)


def put(a: Archive, key: BlockKey, seed: int, n: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    k, v = block(seed, n)
    a.put([(key, k, v)])
    return k, v


def assert_holds(a: Archive, key: BlockKey, kv: tuple[torch.Tensor, torch.Tensor]) -> None:
    k2, v2 = a.get(key)
    assert same_bits(kv[0], k2) and same_bits(kv[1], v2)


def manifest_entries(path: Path) -> list[dict[str, object]]:
    return [json.loads(line[9:]) for line in (path / "manifest.log").read_text().splitlines()]


def test_persistence_supersede_and_delete(tmp_path: Path) -> None:
    with Archive(tmp_path, IDENT) as a:
        a1 = put(a, BlockKey("a", 0, 0), 1)
        a2 = put(a, BlockKey("a", 1, 0), 2, n=5)  # partial block: 5 tokens
        b1 = put(a, BlockKey("b", 0, 0), 3)
        newer = put(a, BlockKey("a", 0, 0), 4)  # supersedes a1
        assert_holds(a, BlockKey("a", 0, 0), newer)
        assert a.stats().records == 4 and a.stats().live_records == 3
    with Archive(tmp_path, IDENT) as a:
        assert a.keys() == {BlockKey("a", 0, 0), BlockKey("a", 1, 0), BlockKey("b", 0, 0)}
        assert_holds(a, BlockKey("a", 0, 0), newer)
        assert_holds(a, BlockKey("a", 1, 0), a2)
        assert a.get(BlockKey("a", 1, 0))[0].shape == (3, 5, 64)
        assert a.remove("a") == 2 and a.remove("a") == 0
        assert not a.contains(BlockKey("a", 0, 0)) and a.contains(BlockKey("b", 0, 0))
        with pytest.raises(KeyError):
            a.get(BlockKey("a", 0, 0))
    with Archive(tmp_path, IDENT) as a:
        assert a.keys() == {BlockKey("b", 0, 0)}
        assert_holds(a, BlockKey("b", 0, 0), b1)
        again = put(a, BlockKey("a", 0, 0), 5)  # a deleted session can come back
    with Archive(tmp_path, IDENT) as a:
        assert_holds(a, BlockKey("a", 0, 0), again)
        assert a.stats().reads == 1
    del a1


def test_bulk_reads_give_each_block_as_get_does(tmp_path: Path) -> None:
    """`get_bytes` (a bulk read): each lossless record's K then V bytes as put, a partial block's
    too; an int8 record's as `get` decodes it (bit for bit, decoded together with the others of
    its token count); a key not archived is a KeyError; a read of the kept session's blocks after
    a tail is deleted (`remove` from a block on) finds only those."""
    with Archive(tmp_path, IDENT, Codec.INT8_DELTA_ZSTD, lossless_layers=frozenset({0})) as a:
        full = put(a, BlockKey("s", 0, 0), 1)
        part = put(a, BlockKey("s", 0, 1), 2, n=5)
        lossy = [BlockKey("s", 1, 0), BlockKey("s", 1, 1), BlockKey("s", 1, 2)]
        put(a, lossy[0], 3)
        put(a, lossy[1], 4, n=7)
        put(a, lossy[2], 5)
        got = a.get_bytes([BlockKey("s", 0, 0), BlockKey("s", 0, 1), *lossy])

        def kv(one: tuple[int, bytes | memoryview]) -> torch.Tensor:
            return torch.frombuffer(bytearray(one[1]), dtype=torch.float32).view(2, 3, one[0], 64)

        for (k, v), one in zip((full, part), got[:2], strict=True):
            assert one[0] == k.shape[1] and same_bits(kv(one)[0], k) and same_bits(kv(one)[1], v)
        for key, one in zip(lossy, got[2:], strict=True):
            k, v = a.get(key)
            assert one[0] == k.shape[1] and same_bits(kv(one)[0], k) and same_bits(kv(one)[1], v)
        assert [one[0] for one in got[2:]] == [32, 7, 32]
        with pytest.raises(KeyError):
            a.get_bytes([BlockKey("s", 0, 0), BlockKey("s", 0, 7)])
        assert a.remove("s", first=1) == 3 and a.blocks_of("s") == {(0, 0): 32, (1, 0): 32}
    with Archive(tmp_path, IDENT, Codec.INT8_DELTA_ZSTD, lossless_layers=frozenset({0})) as a:
        assert a.blocks_of("s") == {(0, 0): 32, (1, 0): 32}  # the deleted tail stays deleted
        assert_holds(a, BlockKey("s", 0, 0), full)


def test_corrupt_payload_is_named(tmp_path: Path) -> None:
    with Archive(tmp_path, IDENT) as a:
        put(a, BlockKey("sess-x", 3, 7), 1)
        kv = put(a, BlockKey("sess-x", 3, 8), 2)
    entry = manifest_entries(tmp_path)[0]
    seg = tmp_path / f"seg-{entry['seg']:06d}.h3kv"
    data = bytearray(seg.read_bytes())
    data[entry["off"] + entry["len"] - 10] ^= 0x40  # type: ignore[operator]
    seg.write_bytes(bytes(data))
    with Archive(tmp_path, IDENT) as a:
        with pytest.raises(ArchiveCorrupt) as err:
            a.get(BlockKey("sess-x", 3, 7))
        msg = str(err.value)
        assert "sess-x" in msg and "layer 3" in msg and "block 7" in msg and str(seg) in msg
        assert_holds(a, BlockKey("sess-x", 3, 8), kv)  # its neighbour is untouched


def test_corrupt_header_is_caught(tmp_path: Path) -> None:
    with Archive(tmp_path, IDENT) as a:
        put(a, BlockKey("s", 3, 7), 1)
    seg = tmp_path / "seg-000001.h3kv"
    data = bytearray(seg.read_bytes())
    data[8] ^= 0x01  # the layer field
    seg.write_bytes(bytes(data))
    with Archive(tmp_path, IDENT) as a, pytest.raises(ArchiveCorrupt, match="checksum"):
        a.get(BlockKey("s", 3, 7))


def test_foreign_store_refused_at_open(tmp_path: Path) -> None:
    with Archive(tmp_path, IDENT) as a:
        put(a, BlockKey("s", 0, 0), 1)
    other = CacheIdentity("beef", "fp32", 32, 3, 64)
    with pytest.raises(ArchiveMismatch, match="fingerprint") as err:
        Archive(tmp_path, other)
    assert "'ab12'" in str(err.value) and "'beef'" in str(err.value)
    with pytest.raises(ArchiveMismatch, match="dtype"):
        Archive(tmp_path, CacheIdentity("ab12", "bf16", 32, 3, 64))
    with pytest.raises(ArchiveMismatch, match="block_size"):
        Archive(tmp_path, CacheIdentity("ab12", "fp32", 16, 3, 64))
    Archive(tmp_path, IDENT).close()  # refusals left the lock free


def test_foreign_records_refused_at_get(tmp_path: Path) -> None:
    """identity.json rewritten (say, a store copied over another): each record still knows its cache."""
    with Archive(tmp_path, IDENT) as a:
        put(a, BlockKey("s", 0, 0), 1)
    other = CacheIdentity("beef", "fp32", 32, 3, 64)
    ident = json.loads((tmp_path / "identity.json").read_text())
    (tmp_path / "identity.json").write_text(json.dumps(ident | {"fingerprint": "beef"}))
    with Archive(tmp_path, other) as a, pytest.raises(ArchiveMismatch, match="fingerprint expected 'beef'"):
        a.get(BlockKey("s", 0, 0))


def test_lossy_record_refused_when_layer_now_lossless(tmp_path: Path) -> None:
    with Archive(tmp_path, IDENT, Codec.INT8_DELTA_ZSTD) as a:
        put(a, BlockKey("s", 0, 0), 1)
        raw = put(a, BlockKey("s", 1, 0), 2)
    with Archive(tmp_path, IDENT, Codec.INT8_DELTA_ZSTD, lossless_layers=frozenset({0})) as a:
        with pytest.raises(ArchiveMismatch, match="codec"):
            a.get(BlockKey("s", 0, 0))
        a.get(BlockKey("s", 1, 0))  # still int8 for layer 1
    with Archive(tmp_path, IDENT, Codec.INT8_DELTA_ZSTD, lossless_layers=frozenset({1})) as a:
        a.put([(BlockKey("s", 1, 0), *raw)])
    with Archive(tmp_path, IDENT, Codec.INT8_DELTA_ZSTD) as a:  # a lossless record is always acceptable
        assert_holds(a, BlockKey("s", 1, 0), raw)


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so nothing on the way catches it."""


def is_file(fd: int, path: Path) -> bool:
    """Whether `fd` is open on the file now at `path`."""
    return os.path.samestat(os.fstat(fd), path.stat())


class FullDisk(FileOps):
    """Every write fails as on a full disk (nothing of it reaches the file)."""

    def write_all(self, fd: int, data: bytes, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")


class CrashAtManifestAppend(FileOps):
    """The process dies as a write to the manifest begins: what came before it (the records, written
    and fsynced) is on disk, nothing of the manifest's lines is."""

    def __init__(self, manifest: Path) -> None:
        self.manifest = manifest

    def write_all(self, fd: int, data: bytes, offset: int) -> None:
        if is_file(fd, self.manifest):
            raise Crash
        super().write_all(fd, data, offset)


def until(condition: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Wait for `condition` to hold. -> False if `timeout` seconds passed first."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


@pytest.mark.parametrize("tail", [b"", b'1234abcd {"op":"put","s":"zz",', b'deadbeef {"op":"del","s":"a"}\n'])
def test_crash_between_data_and_manifest(tmp_path: Path, tail: bytes) -> None:
    a = Archive(tmp_path, IDENT)
    committed = put(a, BlockKey("a", 0, 0), 1)
    manifest, seg = tmp_path / "manifest.log", tmp_path / "seg-000001.h3kv"
    good_manifest, good_seg = manifest.stat().st_size, seg.stat().st_size

    a.files = CrashAtManifestAppend(manifest)
    with pytest.raises(Crash):
        put(a, BlockKey("a", 1, 0), 2)  # its record reached the segment and was fsynced, not the manifest
    a.files = FileOps()
    a.close()
    assert seg.stat().st_size > good_seg
    with open(manifest, "ab") as f:
        f.write(tail)
    with open(seg, "ab") as f:
        f.write(b"H3KV\x01\x00partial record")

    with Archive(tmp_path, IDENT) as a:
        assert a.keys() == {BlockKey("a", 0, 0)}
        assert_holds(a, BlockKey("a", 0, 0), committed)
        assert manifest.stat().st_size == good_manifest and seg.stat().st_size == good_seg
        later = put(a, BlockKey("b", 0, 0), 3)
    with Archive(tmp_path, IDENT) as a:
        assert a.keys() == {BlockKey("a", 0, 0), BlockKey("b", 0, 0)}
        assert_holds(a, BlockKey("a", 0, 0), committed)
        assert_holds(a, BlockKey("b", 0, 0), later)


def test_garbled_manifest_middle_refuses_to_open(tmp_path: Path) -> None:
    with Archive(tmp_path, IDENT) as a:
        for i in range(3):
            put(a, BlockKey("a", 0, i), i)
    manifest = tmp_path / "manifest.log"
    lines = manifest.read_bytes().splitlines(keepends=True)
    manifest.write_bytes(lines[0] + lines[1].replace(b'"a"', b'"b"') + lines[2])
    with pytest.raises(ArchiveCorrupt, match=r"manifest\.log is corrupt at offset"):
        Archive(tmp_path, IDENT)


def test_segments_roll_and_reopen(tmp_path: Path) -> None:
    kept = {}
    with Archive(tmp_path, IDENT, segment_bytes=50_000) as a:
        for i in range(6):
            kept[i] = put(a, BlockKey("s", 0, i), i)
    assert len(list(tmp_path.glob("seg-*.h3kv"))) >= 3
    with Archive(tmp_path, IDENT, segment_bytes=50_000) as a:
        kept[6] = put(a, BlockKey("s", 0, 6), 6)
        for i, kv in kept.items():
            assert_holds(a, BlockKey("s", 0, i), kv)


def test_one_owner_at_a_time(tmp_path: Path) -> None:
    a = Archive(tmp_path, IDENT)
    with pytest.raises(ArchiveError, match="already open"):
        Archive(tmp_path, IDENT)
    a.close()
    a.close()
    with pytest.raises(ArchiveError, match="closed"):
        a.get(BlockKey("s", 0, 0))
    Archive(tmp_path, IDENT).close()


def test_rejects_bad_blocks(tmp_path: Path) -> None:
    with Archive(tmp_path, IDENT) as a:
        k, v = block(1)
        for bad in [(k.to(torch.float16), v.to(torch.float16)), (k[:2], v[:2]), (k[:, :0], v[:, :0])]:
            with pytest.raises(ValueError):
                a.put([(BlockKey("s", 0, 0), *bad)])
        with pytest.raises(ValueError):
            a.put([(BlockKey("s", 0, 0), torch.zeros(3, 33, 64), torch.zeros(3, 33, 64))])
        assert a.keys() == frozenset()


def test_threads_put_and_get(tmp_path: Path) -> None:
    errors: list[BaseException] = []
    with Archive(tmp_path, IDENT) as a:

        def worker(t: int) -> None:
            try:
                for i in range(10):
                    kv = put(a, BlockKey(f"t{t}", 0, i), 100 * t + i)
                    assert_holds(a, BlockKey(f"t{t}", 0, i), kv)
                    assert_holds(a, BlockKey(f"t{t}", 0, i // 2), block(100 * t + i // 2))
            except BaseException as e:
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        assert not errors and len(a.keys()) == 40


def test_strided_views_are_archived(tmp_path: Path) -> None:
    """Callers slice blocks out of a pool read ([Hkv, blocks, bs, D] -> k[:, i, :n]): not contiguous."""
    pool = torch.randn(3, 4, 32, 64, generator=torch.Generator().manual_seed(0))  # [Hkv, blocks, bs, D]
    k, v = pool[:, 1, :20], pool[:, 2, :20]
    assert not k.is_contiguous()
    for codec in Codec:
        with Archive(tmp_path / codec.value, IDENT, codec) as a:
            a.put([(BlockKey("s", 0, 0), k, v)])
            k2, v2 = a.get(BlockKey("s", 0, 0))
        if codec is Codec.RAW_ZSTD:
            assert same_bits(k, k2) and same_bits(v, v2)
        else:
            check_int8_bound(k, k2)


def test_failed_write_refuses_more_writes(tmp_path: Path) -> None:
    with Archive(tmp_path, IDENT) as a:
        kept = put(a, BlockKey("a", 0, 0), 1)
        a.files = FullDisk()
        with pytest.raises(ArchiveError, match="No space left"):
            put(a, BlockKey("a", 1, 0), 2)
        a.files = FileOps()  # space is back, but nothing says what the failed write left
        with pytest.raises(ArchiveError, match="earlier write failed"):
            put(a, BlockKey("a", 1, 0), 2)
        assert_holds(a, BlockKey("a", 0, 0), kept)  # reads still work
    with Archive(tmp_path, IDENT) as a:
        assert_holds(a, BlockKey("a", 0, 0), kept)
        put(a, BlockKey("a", 1, 0), 2)


# ---- reclaiming space: compaction beside writers and readers, at every crash point -----------------


def sessions_of(a: Archive, names: list[str], blocks_each: int = 4, seed: int = 0) -> dict[BlockKey, tuple]:
    """Put `blocks_each` blocks of each session, one batch per session. -> what each key holds."""
    out = {}
    for s, name in enumerate(names):
        items = [(BlockKey(name, 0, i), *block(seed + 100 * s + i)) for i in range(blocks_each)]
        a.put(items)
        out.update({key: (k, v) for key, k, v in items})
    return out


def assert_store(a: Archive, held: dict[BlockKey, tuple]) -> None:
    assert a.keys() == frozenset(held)
    for key, kv in held.items():
        assert_holds(a, key, kv)


def test_a_segment_with_no_live_record_goes_without_copies(tmp_path: Path) -> None:
    """Segment-granular deletion: with one segment per session, purging one deletes its segment
    outright, no record copied and the manifest left as it is (its lines about the segment are
    dead: the store reopens the same)."""
    a = Archive(tmp_path, IDENT, segment_bytes=1)  # every batch starts a segment
    held = sessions_of(a, ["a", "b", "c"])
    segments = sorted(tmp_path.glob("seg-*.h3kv"))
    assert len(segments) == 3
    manifest = (tmp_path / "manifest.log").stat()
    disk, b_size = a.disk_bytes(), segments[1].stat().st_size
    a.remove("b")
    a.compact_later()
    assert a.wait_compactions(timeout=30)
    assert sorted(tmp_path.glob("seg-*.h3kv")) == [segments[0], segments[2]]
    assert a.disk_bytes() == disk - b_size == a.live_bytes()
    assert (tmp_path / "manifest.log").stat().st_ino == manifest.st_ino
    held = {key: kv for key, kv in held.items() if key.session != "b"}
    assert_store(a, held)
    held |= sessions_of(a, ["d"], seed=7)  # appends go on in a segment of a new number
    a.close()
    with Archive(tmp_path, IDENT, segment_bytes=1) as reopened:
        assert_store(reopened, held)
        assert reopened.disk_bytes() == reopened.live_bytes()


def test_compaction_beside_puts_deletes_and_reads(tmp_path: Path) -> None:
    """While a background compaction copies records (held there by the test, its copies made and
    its switch not begun), another thread supersedes a block being moved, deletes a session being
    moved, puts a new one and reads: none of it is undone by the compaction's switch (the
    superseded block keeps its new value, the deleted session stays deleted), the dead bytes are
    gone after it, and the store reopens equal."""
    copied, go_on = threading.Event(), threading.Event()

    class HeldAfterCopying(CompactionHooks):
        def copied(self, segment: int, records: int) -> None:
            copied.set()
            assert go_on.wait(30)

    a = Archive(tmp_path, IDENT, compaction_hooks=HeldAfterCopying())
    held = sessions_of(a, ["dead", "s1", "s2", "s3"])
    a.remove("dead")
    a.compact_later(keep_ratio=1.0)
    assert copied.wait(30) and a.compacting
    held = {key: kv for key, kv in held.items() if key.session not in ("dead", "s2")}
    held[BlockKey("s1", 0, 1)] = put(a, BlockKey("s1", 0, 1), 999)  # supersedes a block in flight
    assert a.remove("s2") == 4  # a session in flight
    held |= sessions_of(a, ["s4"], seed=50)
    assert_store(a, held)  # reads while the copies wait
    go_on.set()
    assert a.wait_compactions(timeout=30) and not a.compacting
    assert a.compaction_stats().last_error is None and a.compaction_stats().runs == 1
    assert_store(a, held)
    a.compact(keep_ratio=1.0)  # the records deleted or superseded during the first: gone too
    assert a.disk_bytes() == a.live_bytes()
    a.close()
    with Archive(tmp_path, IDENT) as reopened:
        assert_store(reopened, held)
        assert reopened.disk_bytes() == reopened.live_bytes()


def test_reads_race_compactions(tmp_path: Path) -> None:
    """Readers on other threads never see a segment vanish under them: `get` opens the segment
    while holding the index lock, and a compaction deletes a segment only after the index has left
    it. (Readers dawdle between finding a record and opening its segment, to widen the window.)"""

    class DawdlingReaders(FileOps):
        def open(self, path: Path, flags: int) -> int:
            if threading.current_thread().name.startswith("reader"):
                time.sleep(0.002)
            return super().open(path, flags)

    a = Archive(tmp_path, IDENT, segment_bytes=1, files=DawdlingReaders())
    stable = sessions_of(a, ["stable"], blocks_each=6)
    errors: list[BaseException] = []
    stop = threading.Event()

    def reader() -> None:
        try:
            while not stop.is_set():
                for key, kv in stable.items():
                    assert_holds(a, key, kv)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=reader, name=f"reader-{i}") for i in range(2)]
    for th in threads:
        th.start()
    try:
        for r in range(12):
            churn = [(BlockKey(f"churn{r}", 0, i), *block(1000 + 10 * r + i)) for i in range(6)]
            a.put([(key, *kv) for key, kv in stable.items()] + churn)  # the same bytes, in a mixed segment
            a.remove(f"churn{r}")
            assert a.compact(keep_ratio=1.0) > 0  # moves the stable records, deletes the segments they were in
    finally:
        stop.set()
        for th in threads:
            th.join()
    assert not errors, errors[0]
    a.close()


@pytest.mark.parametrize("point", ["copying", "before the rename", "before the deletes", "between deletes", "close"])
def test_compaction_stopped_at_any_point_leaves_the_same_store(tmp_path: Path, point: str) -> None:
    """A crash (the process dies: nothing after it runs) at each point of a compaction, or a close
    during its copy: the store reopens to the same blocks with the same bytes, cleans up what the
    compaction left (at open, or by compacting again) and takes writes."""
    chunk = 1 if point == "close" else COPY_CHUNK_BYTES  # "close": a write after each record copied
    a = Archive(tmp_path, IDENT, segment_bytes=150_000, copy_chunk_bytes=chunk)  # two sessions a segment
    held = sessions_of(a, ["a", "b", "c", "d", "e", "f"], blocks_each=2)
    assert len(list(tmp_path.glob("seg-*.h3kv"))) == 3  # three victims
    for name in ("a", "c", "e"):
        a.remove(name)
    held = {key: kv for key, kv in held.items() if key.session in ("b", "d", "f")}
    started = threading.Event()

    class Dying(FileOps):
        """The process dies at `point` (or, for "close", each write waits for `close` to begin)."""

        deletes = 0  # the segments deleted so far

        def write_all(self, fd: int, data: bytes, offset: int) -> None:
            if point == "copying":  # half the copies written
                super().write_all(fd, data[: len(data) // 2], offset)
                raise Crash
            if point == "close":
                started.set()
                assert until(lambda: a.closing)
            super().write_all(fd, data, offset)

        def replace(self, src: Path, dst: Path) -> None:
            if point == "before the rename" and dst.name == "manifest.log":
                raise Crash
            super().replace(src, dst)

        def unlink(self, path: Path, missing_ok: bool = False) -> None:
            if point in ("before the deletes", "between deletes") and path.name.startswith("seg-"):
                self.deletes += 1
                if point == "before the deletes" or self.deletes > 1:
                    raise Crash
            super().unlink(path, missing_ok)

    a.files = Dying()
    names = {p.name for p in tmp_path.glob("seg-*.h3kv")}
    if point == "close":
        a.compact_later(keep_ratio=1.0)
        assert started.wait(30)
        a.close()  # stops it between two records: its copies are deleted
        assert a.compaction_stats().runs == 1 and a.compaction_stats().freed_bytes == 0
        assert {p.name for p in tmp_path.glob("seg-*.h3kv")} <= names | {f"seg-{a.active_segment:06d}.h3kv"}
    else:
        with pytest.raises(Crash):
            a.compact(keep_ratio=1.0)
        a.abandon()  # the process is gone: its descriptors and its lock with it
    with Archive(tmp_path, IDENT, segment_bytes=150_000) as reopened:
        assert_store(reopened, held)
        reopened.compact(keep_ratio=1.0)
        assert reopened.disk_bytes() == reopened.live_bytes()
        held |= sessions_of(reopened, ["g"], seed=70)
    with Archive(tmp_path, IDENT, segment_bytes=150_000) as reopened:
        assert_store(reopened, held)
        assert not (tmp_path / "manifest.tmp").exists()


@pytest.mark.parametrize("umask", [0o000, 0o022, 0o277])
def test_archive_files_are_private_whatever_the_umask(tmp_path: Path, umask: int) -> None:
    """Segments, manifest (and a compaction's rewritten one), identity and lock: 0600; the folders
    the archive creates: 0700, whatever the umask (a permissive one cannot widen them, a strict one
    cannot make them unusable)."""
    root = tmp_path / "state"
    old = os.umask(umask)
    try:
        a = Archive(root / "kv" / "archive", IDENT, segment_bytes=1)
        sessions_of(a, ["a", "b", "c"])
        a.remove("a")
        a.put([(BlockKey("b", 0, 0), *block(5))])  # b's segment is part dead now
        assert a.compact(keep_ratio=1.0) > 0  # copies to a new segment, rewrites the manifest
        a.close()
        with Archive(root / "kv" / "archive", IDENT, segment_bytes=1) as reopened:
            sessions_of(reopened, ["d"])
    finally:
        os.umask(old)
    files = [p for p in root.rglob("*") if p.is_file()]
    assert {p.name for p in files} >= {"identity.json", "manifest.log", "lock"}
    assert len([p for p in files if p.suffix == ".h3kv"]) >= 3
    for p in files:
        assert p.stat().st_mode & 0o777 == 0o600, f"{p.name}: {oct(p.stat().st_mode & 0o777)}"
    for d in (root, root / "kv", root / "kv" / "archive"):
        assert d.stat().st_mode & 0o777 == 0o700, f"{d}: {oct(d.stat().st_mode & 0o777)}"


def test_bulk_codec_paths_in_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """More blocks than one pass takes (`BULK_BLOCKS`) are coded in chunks, each as alone; a bad
    payload is named by its chunk and place."""
    monkeypatch.setattr(codecs, "BULK_BLOCKS", 2)
    blocks = [block(seed, 32) for seed in range(5)]
    payloads = [encode(Codec.INT8_DELTA_ZSTD, k, v) for k, v in blocks]
    assert encode_int8_many(blocks) == payloads
    together = decode_int8_many(payloads, torch.float32, 3, 32, 64)
    for i, payload in enumerate(payloads):
        k, v = decode(Codec.INT8_DELTA_ZSTD, payload, torch.float32, 3, 32, 64)
        assert same_bits(together[i, :3], k) and same_bits(together[i, 3:], v)
    with pytest.raises(ValueError, match="from 2: payload 1"):
        decode_int8_many([*payloads[:3], b"not zstd", payloads[4]], torch.float32, 3, 32, 64)


def test_a_bulk_read_that_cannot_decode_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure of the int8 records' joint decode is an ArchiveCorrupt naming a block of the
    read, never a bare ValueError."""
    from h3d.tiers import archive as archive_mod

    def broken(*args: object) -> torch.Tensor:
        raise ValueError("payload 0: broken")

    with Archive(tmp_path, IDENT, Codec.INT8_DELTA_ZSTD) as a:
        put(a, BlockKey("s", 2, 0), 1)
        put(a, BlockKey("s", 2, 1), 2)
        monkeypatch.setattr(archive_mod, "decode_int8_many", broken)
        with pytest.raises(ArchiveCorrupt, match="broken") as err:
            a.get_bytes([BlockKey("s", 2, 0), BlockKey("s", 2, 1)])
        assert err.value.key == BlockKey("s", 2, 0)


@pytest.mark.parametrize("multi", [True, False])
def test_bulk_puts_write_the_records_one_by_one_puts_do(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, multi: bool
) -> None:
    """`put_blocks` (write-behind's bulk path) leaves a segment byte for byte as the same blocks
    `put` one by one do, lossless layers (every bit pattern) beside int8 ones, with zstandard's
    bulk compression and without it (a backend that lacks it); the blocks read back as put."""
    if not multi:
        monkeypatch.setattr(codecs, "_compressor", lambda: _NoBulk(codecs.ZSTD_LEVEL))
    n = 7
    k = torch.stack([any_bits((3, 32, 64), torch.float32, 10 + i) for i in range(n)], 1)
    v = torch.stack([any_bits((3, 32, 64), torch.float32, 20 + i) for i in range(n)], 1)
    lossy = torch.stack([values((3, 32, 64), torch.float32, "unit", 30 + i) for i in range(n)], 1)
    layers = torch.tensor([0, 0, 1, 2, 2, 0, 1]).numpy()  # layer 1 lossy (int8), 0 and 2 lossless
    indices = torch.tensor([0, 1, 0, 0, 3, 9, 1]).numpy()
    k[:, layers == 1], v[:, layers == 1] = lossy[:, layers == 1], lossy[:, layers == 1]
    segments: list[bytes] = []  # the bulk archive's records, then the other's
    held: list[dict[tuple[int, int], int]] = []
    for bulk in (True, False):
        folder = tmp_path / str(bulk)
        with Archive(folder, IDENT, Codec.INT8_DELTA_ZSTD, lossless_layers=frozenset({0, 2})) as a:
            if bulk:
                a.put_blocks("s", layers, indices, k, v)
            else:
                a.put(
                    [
                        (BlockKey("s", int(layer), int(i)), k[:, j], v[:, j])
                        for j, (layer, i) in enumerate(zip(layers, indices, strict=True))
                    ]
                )
            for j, (layer, i) in enumerate(zip(layers, indices, strict=True)):
                k2, v2 = a.get(BlockKey("s", int(layer), int(i)))
                if layer == 1:
                    check_int8_bound(k[:, j], k2)
                else:
                    assert same_bits(k[:, j], k2) and same_bits(v[:, j], v2)
            assert a.stats().raw_bytes == n * 2 * 3 * 32 * 64 * 4
        segments.append(b"".join(p.read_bytes() for p in sorted(folder.glob("seg-*"))))
        lines = [json.loads(line[9:]) for line in (folder / "manifest.log").read_bytes().splitlines()]
        assert [e["op"] for e in lines] == (["puts"] if bulk else ["put"] * n)  # one line for a bulk write
        with Archive(folder, IDENT, Codec.INT8_DELTA_ZSTD, lossless_layers=frozenset({0, 2})) as a:
            held.append(a.blocks_of("s"))  # the manifest read back
            for j, (layer, i) in enumerate(zip(layers, indices, strict=True)):
                if layer != 1:
                    assert same_bits(k[:, j], a.get(BlockKey("s", int(layer), int(i)))[0])
    assert segments[0] == segments[1] and len(segments[0]) > n * 3 * 32 * 64
    assert held[0] == held[1] == {(int(layer), int(i)): 32 for layer, i in zip(layers, indices, strict=True)}


def test_bulk_puts_refuse_blocks_of_the_wrong_shape(tmp_path: Path) -> None:
    with Archive(tmp_path, IDENT) as a:
        k = torch.zeros(3, 2, 31, 64)  # not whole blocks
        with pytest.raises(ValueError, match="block"):
            a.put_blocks("s", torch.tensor([0, 0]).numpy(), torch.tensor([0, 1]).numpy(), k, k)
        k = torch.zeros(3, 2, 32, 64, dtype=torch.float16)
        with pytest.raises(ValueError, match="dtype"):
            a.put_blocks("s", torch.tensor([0, 0]).numpy(), torch.tensor([0, 1]).numpy(), k, k)
        assert a.stats().records == 0


def test_a_list_of_buffers_is_written_whole(tmp_path: Path) -> None:
    """`FileOps.write_all` of buffers (the archive's records as prefix and payload) writes them one
    after another at the offset, more of them than one pwritev takes, empty ones among them."""
    from h3d.store import files

    parts = [bytes([i % 251]) * (i % 5) for i in range(files._IOV_MAX * 2 + 3)]
    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    fd = os.open(path, os.O_WRONLY)
    try:
        FileOps().write_all(fd, [memoryview(p) for p in parts], 4)
    finally:
        os.close(fd)
    assert path.read_bytes() == b"xxxx" + b"".join(parts)


class _NoBulk:
    """A zstd compressor without `multi_compress_to_buffer` (zstandard's CFFI backend)."""

    def __init__(self, level: int) -> None:
        import zstandard

        self._c = zstandard.ZstdCompressor(level=level)

    def compress(self, data: bytes) -> bytes:
        return self._c.compress(data)


def test_linked_records_are_stored_once_and_outlive_their_home(tmp_path: Path) -> None:
    """`link` gives a session another's records: its keys read the same bytes, no KV is written
    again (the segments do not grow), the bytes count once, and the record stays while any key
    points at it: deleting the home leaves it to the others, superseding a link leaves the home's."""
    a = Archive(tmp_path, IDENT)
    held, size = {}, []  # size[i]: block i's record
    for i in range(4):
        held[BlockKey("doc", 0, i)] = put(a, BlockKey("doc", 0, i), i)
        size.append(a.live_bytes() - sum(size))
    disk, live = a.disk_bytes(), a.live_bytes()
    blocks = [(0, i) for i in range(3)] + [(5, 0)]  # (a block the source lacks is skipped)
    assert a.link("fork1", "doc", blocks) == 3
    assert a.link("fork2", "fork1", [(0, 0), (0, 1)]) == 2  # a link of a link: the home's record
    assert a.disk_bytes() == disk and a.live_bytes() == live
    for name, n in (("fork1", 3), ("fork2", 2)):
        for i in range(n):
            assert_holds(a, BlockKey(name, 0, i), held[BlockKey("doc", 0, i)])
    assert a.blocks_of("fork2") == {(0, 0): 32, (0, 1): 32}
    assert manifest_entries(tmp_path)[-1]["h"] == ["doc", "doc"]
    with pytest.raises(ValueError, match="its own"):
        a.link("doc", "doc", [(0, 0)])
    a.remove("doc")  # the home goes: its block 3 with it, blocks 0-2 stay for the forks
    assert a.live_bytes() == live - size[3]
    new = put(a, BlockKey("fork1", 0, 0), 77)  # superseded in fork1: fork2 still points at the old one
    mine = a.live_bytes() - (live - size[3])
    a.close()
    with Archive(tmp_path, IDENT) as b:
        assert b.live_bytes() == live - size[3] + mine
        assert_holds(b, BlockKey("fork1", 0, 0), new)
        assert_holds(b, BlockKey("fork2", 0, 0), held[BlockKey("doc", 0, 0)])
        assert_holds(b, BlockKey("fork1", 0, 2), held[BlockKey("doc", 0, 2)])
        b.remove("fork1")
        assert b.live_bytes() == size[0] + size[1]  # fork2's two
        b.remove("fork2", first=1)
        assert b.live_bytes() == size[0]
        b.remove("fork2")
        assert b.live_bytes() == 0 and not b.keys()


def test_a_linked_record_is_checked_against_its_home(tmp_path: Path) -> None:
    """A linked key reads its home's record, whose header names the home: the check is against
    the home's key (another record under the linked name would not pass)."""
    with Archive(tmp_path, IDENT) as a:
        put(a, BlockKey("doc", 1, 0), 1)
        a.link("fork", "doc", [(1, 0)])
        entry = manifest_entries(tmp_path)[-1]
    with open(tmp_path / "manifest.log", "ab") as f:  # the link's line, naming no home: a forged one
        body = json.dumps({k: v for k, v in entry.items() if k != "h"}, separators=(",", ":")).encode()
        f.write(b"%08x %s\n" % (zlib.crc32(body), body))
    with Archive(tmp_path, IDENT) as a, pytest.raises(ArchiveMismatch, match="session expected 'fork', found 'doc'"):
        a.get(BlockKey("fork", 1, 0))


def test_compaction_copies_a_linked_record_once(tmp_path: Path) -> None:
    """A compaction moves a record several keys point at once, every key follows it, and the
    rewritten manifest keeps the links (the store reopens the same, the bytes counted once)."""
    a = Archive(tmp_path, IDENT, segment_bytes=1)  # every batch starts a segment
    held = sessions_of(a, ["doc", "dead"], blocks_each=4)
    a.remove("dead")
    doc = a.live_bytes()
    for name in ("f1", "f2", "f3"):
        a.link(name, "doc", [(0, i) for i in range(4)])
        held |= {BlockKey(name, 0, i): held[BlockKey("doc", 0, i)] for i in range(4)}
    a.remove("doc", first=2)  # blocks 2 and 3 live on through the links only
    gone = {BlockKey("doc", 0, 2), BlockKey("doc", 0, 3)}
    held = {key: kv for key, kv in held.items() if key.session != "dead" and key not in gone}
    assert a.live_bytes() == doc
    a.compact(keep_ratio=1.0)
    assert_store(a, held)
    assert a.disk_bytes() == a.live_bytes() == doc
    a.close()
    with Archive(tmp_path, IDENT) as b:
        assert_store(b, held)
        assert b.disk_bytes() == b.live_bytes() == doc
        b.remove("f1")
        b.remove("f2")
        assert b.live_bytes() == doc
        b.remove("f3")
        assert 0 < b.live_bytes() < doc  # doc's blocks 0 and 1
        b.remove("doc")
        assert b.live_bytes() == 0


def test_a_store_of_format_1_is_migrated_and_a_newer_one_refused(tmp_path: Path) -> None:
    """A store written before links (format 1) opens with its records, and its identity.json says
    format 2 afterwards; a store of a format newer than this h3d reads is refused by name."""
    with Archive(tmp_path, IDENT) as a:
        kv = put(a, BlockKey("s", 0, 0), 1)
    ident = json.loads((tmp_path / "identity.json").read_text())
    assert ident["format"] == 2
    (tmp_path / "identity.json").write_text(json.dumps(ident | {"format": 1}))
    with Archive(tmp_path, IDENT) as a:
        assert_holds(a, BlockKey("s", 0, 0), kv)
    assert json.loads((tmp_path / "identity.json").read_text()) == ident
    (tmp_path / "identity.json").write_text(json.dumps(ident | {"format": 3}))
    with pytest.raises(ArchiveMismatch, match="format 3, written by a newer h3d"):
        Archive(tmp_path, IDENT)
    (tmp_path / "identity.json").write_text(json.dumps(ident | {"format": 1, "fingerprint": "beef"}))
    with pytest.raises(ArchiveMismatch, match="fingerprint"):
        Archive(tmp_path, IDENT)


def test_a_damaged_linked_record_is_named_by_the_block_asked_for(tmp_path: Path) -> None:
    """A linked record that fails its checksum is reported as the reading session's block (whose
    step repairs it for that session), naming the record it is linked to."""
    with Archive(tmp_path, IDENT) as a:
        put(a, BlockKey("doc", 2, 4), 1)
        a.link("fork", "doc", [(2, 4)])
    entry = manifest_entries(tmp_path)[0]
    seg = tmp_path / f"seg-{entry['seg']:06d}.h3kv"
    data = bytearray(seg.read_bytes())
    data[entry["off"] + entry["len"] - 10] ^= 0x40  # type: ignore[operator]
    seg.write_bytes(bytes(data))
    with Archive(tmp_path, IDENT) as a:
        with pytest.raises(ArchiveCorrupt) as err:
            a.get_bytes([BlockKey("fork", 2, 4)])
        assert err.value.key == BlockKey("fork", 2, 4)
        assert "session 'fork'" in str(err.value) and "linked to session 'doc'" in str(err.value)
        kv = put(a, BlockKey("fork", 2, 4), 5)  # the fork's block written again (a repair): its own record
        assert_holds(a, BlockKey("fork", 2, 4), kv)
        with pytest.raises(ArchiveCorrupt):
            a.get(BlockKey("doc", 2, 4))


def test_raw_payloads_decompressed_together_equal_each_decompressed_alone() -> None:
    """`decompress_raw_many` (one call for many records, outside the GIL) gives each payload's
    `decompress_raw` bytes, blocks of several sizes mixed; a payload that is not zstd, or of
    another size than its block's, is a ValueError."""
    blocks = [block(seed, n) for seed, n in enumerate([32, 7, 32, 1, 19])]
    payloads = [encode(Codec.RAW_ZSTD, k, v) for k, v in blocks]
    sizes = [2 * k.numel() * 4 for k, _ in blocks]
    together = codecs.decompress_raw_many(payloads, sizes)
    assert [bytes(b) for b in together] == [codecs.decompress_raw(p, n) for p, n in zip(payloads, sizes, strict=True)]
    assert codecs.decompress_raw_many([], []) == []
    with pytest.raises(ValueError):
        codecs.decompress_raw_many([payloads[0], b"not zstd"], sizes[:2])
    with pytest.raises(ValueError):
        codecs.decompress_raw_many(payloads[:2], [sizes[0], sizes[1] + 4])


def test_a_bulk_read_whose_raw_records_cannot_decode_together_names_the_bad_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where the joint decompression fails, the records are decompressed one by one: the read gives
    each block's bytes if they all decode alone, else an ArchiveCorrupt naming the one that does not."""
    from h3d.tiers import archive as archive_mod

    def broken(*args: object) -> list[bytes]:
        raise ValueError("broken")

    with Archive(tmp_path, IDENT) as a:
        held = [put(a, BlockKey("s", 2, i), i + 5) for i in range(3)]
        keys = [BlockKey("s", 2, i) for i in range(3)]
        want = [bytes(raw) for _, raw in a.get_bytes(keys)]
        assert want == [torch.cat([k.reshape(-1), v.reshape(-1)]).numpy().tobytes() for k, v in held]
        monkeypatch.setattr(archive_mod, "decompress_raw_many", broken)
        assert [bytes(raw) for _, raw in a.get_bytes(keys)] == want
        real = archive_mod.decompress_raw
        monkeypatch.setattr(archive_mod, "decompress_raw", lambda p, n: real(p, n + 4) if n else b"")
        with pytest.raises(ArchiveCorrupt, match="does not decode") as err:
            a.get_bytes(keys)
        assert err.value.key == keys[0]


def test_bulk_reads_read_neighbouring_records_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`get_bytes` reads records that lie together in a segment (or a gap of dead records apart)
    with one pread a run: in any order of keys, a key twice, over several segments, each record
    comes back as `get` reads it, with fewer preads than records. A damaged record in the middle
    of a run is named, and so is the first record of a run that a cut segment ends short of."""
    from h3d.tiers import archive as archive_mod

    monkeypatch.setattr(archive_mod, "READ_RUN_BYTES", 6 * 2 * 3 * 32 * 64 * 4)  # about 6 records
    with Archive(tmp_path, IDENT, segment_bytes=10 * 2 * 3 * 32 * 64 * 4) as a:
        keys = [BlockKey("s", layer, i) for i in range(12) for layer in range(2)]
        for j, key in enumerate(keys):
            put(a, key, j, n=32 if j % 7 else 9)
        for j in (3, 4, 17):  # superseded: dead records left between live ones
            put(a, keys[j], 100 + j)
        want = {key: a.get(key) for key in keys}
        order = [keys[j] for j in torch.randperm(len(keys), generator=torch.Generator().manual_seed(1)).tolist()]
        order.append(order[0])
        reads = 0
        pread = os.pread

        def counted(fd: int, n: int, offset: int) -> bytes:
            nonlocal reads
            reads += 1
            return pread(fd, n, offset)

        monkeypatch.setattr(os, "pread", counted)
        got = a.get_bytes(order)
        monkeypatch.setattr(os, "pread", pread)
        assert reads < len(order) // 2
        for key, (n, data) in zip(order, got, strict=True):
            k, v = want[key]
            kv = torch.frombuffer(bytearray(data), dtype=torch.float32).view(2, 3, n, 64)
            assert n == k.shape[1] and same_bits(kv[0], k) and same_bits(kv[1], v)
    loc_of = {(e["l"], e["i"]): e for e in manifest_entries(tmp_path) if e.get("op") == "put"}
    assert len({e["seg"] for e in loc_of.values()}) > 1  # over several segments
    victim = loc_of[(1, 5)]
    seg = tmp_path / f"seg-{victim['seg']:06d}.h3kv"
    data = bytearray(seg.read_bytes())
    data[victim["off"] + victim["len"] // 2] ^= 0x10  # type: ignore[operator]
    seg.write_bytes(bytes(data))
    with Archive(tmp_path, IDENT) as a, pytest.raises(ArchiveCorrupt, match="corrupt") as err:
        a.get_bytes(keys)
    assert err.value.key == BlockKey("s", 1, 5)
    data[victim["off"] + victim["len"] // 2] ^= 0x10  # type: ignore[operator]
    seg.write_bytes(bytes(data[: victim["off"] + 10]))  # the segment cut inside that record
    with Archive(tmp_path, IDENT) as a, pytest.raises(ArchiveCorrupt, match="truncated") as err:
        a.get_bytes(keys)
    assert err.value.key == BlockKey("s", 1, 5)
