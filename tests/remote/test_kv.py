"""KV blocks carried between two daemons' archives through the store's values (`h3d.remote.kv`):
content keys that agree exactly where the tokens do, values checked on the way, records that read
back bit for bit under the new session's name (the partial last block's too, and only the one of
the tokens taken over), and nothing taken that the archive would refuse."""

from __future__ import annotations

from pathlib import Path

import torch

from h3d.remote.kv import Chains, digests, incoming, outgoing, pack, tail_digest, unpack, wanted
from h3d.tiers.archive import Archive
from h3d.tiers.codecs import Codec
from h3d.tiers.identity import BlockKey, CacheIdentity

IDENT = CacheIdentity(fingerprint="ab12", dtype="fp32", block_size=4, num_kv_heads=2, head_dim=8)


def test_the_keys_agree_exactly_where_the_tokens_do() -> None:
    a = digests(list(range(20)), 4, 5)
    b = digests([*range(10), 99, *range(11, 20)], 4, 5)  # differs in block 2
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:], strict=True))
    assert digests(list(range(20)), 4, 3) == a[:3] and len(set(a)) == 5
    # A partial block's key: its whole blocks' chain, then its own tokens (never a whole block's key).
    assert tail_digest(list(range(8)), 4) is None
    tails = {tail_digest(list(range(n)), 4) for n in (9, 10, 11)} | {tail_digest([*range(8), 99], 4)}
    assert len(tails) == 4 and not tails & set(a) and tail_digest([*range(10)], 4) != tail_digest([7, *range(1, 10)], 4)


def test_a_sessions_chain_grows_with_it_and_is_taken_again_after_a_cut() -> None:
    chains, tokens = Chains(4), list(range(9))
    assert chains.of("s", tokens, 5) == digests(tokens, 4, 2)  # (only whole blocks)
    tokens += list(range(9, 20))
    assert chains.of("s", tokens, 5) == digests(tokens, 4, 5) and chains.of("s", tokens, 2) == digests(tokens, 4, 2)
    del tokens[6:]
    tokens += [99] * 14  # block 1 on: other tokens
    chains.forget("s")
    assert chains.of("s", tokens, 5) == digests(tokens, 4, 5) != digests(list(range(20)), 4, 5)


def test_a_value_that_fails_its_check_is_not_used() -> None:
    value = pack(4, Codec.RAW_ZSTD, b"payload")
    assert unpack(value) == (4, Codec.RAW_ZSTD, b"payload")
    assert unpack(value[:-1] + b"X") is None and unpack(b"H3") is None and unpack(b"XXXX" + value[4:]) is None


def test_blocks_travel_between_archives_bit_for_bit(tmp_path: Path) -> None:
    tokens = list(range(11))  # the KV of its first 10: two whole blocks and a partial one (the last: fed next)
    g = torch.Generator().manual_seed(0)
    src = Archive(tmp_path / "a", IDENT)
    kv = {}
    for layer in range(3):
        for j in range(3):
            n = 4 if j < 2 else 2
            k, v = torch.randn(2, n, 8, generator=g), torch.randn(2, n, 8, generator=g)
            src.put([(BlockKey("s", layer, j), k, v)])
            kv[(layer, j)] = (k, v)
    out = outgoing(src, "s", tokens)
    assert sorted((layer, d) for layer, d, _ in out) == sorted(wanted(IDENT, tokens[:-1], 3))  # the partial one too
    assert len(out) == 9 and len(outgoing(src, "s", [*tokens, 11])) == 6  # (a partial one of other tokens: not)
    asked: list[tuple[int, str]] = []

    def lacks(blocks: list[tuple[int, str]]) -> list[bool]:  # (a store that has layer 1's)
        asked.extend(blocks)
        return [layer != 1 for layer, _ in blocks]

    some = outgoing(src, "s", tokens, lacks)
    assert sorted(asked) == sorted(wanted(IDENT, tokens[:-1], 3))
    assert sorted((layer, d, v) for layer, d, v in some) == sorted(x for x in out if x[0] != 1)
    store = {f"{layer}:{d}": v for layer, d, v in out}
    dst = Archive(tmp_path / "b", IDENT)
    values = [store.get(f"{layer}:{d}") for layer, d in wanted(IDENT, tokens[:-1], 3)]
    values[1] = None  # (one the store lost: left to be computed again)
    assert incoming(dst, "t", tokens[:-1], 3, values) == 8
    assert (0, 1) not in dst.blocks_of("t") and len(dst.blocks_of("t")) == 8
    for (layer, j), n in dst.blocks_of("t").items():
        k, v = dst.get(BlockKey("t", layer, j))
        assert n == (4 if j < 2 else 2) and torch.equal(k, kv[(layer, j)][0]) and torch.equal(v, kv[(layer, j)][1])
    # A partial block's value is taken only for the tokens it was written for.
    other = Archive(tmp_path / "e", IDENT)
    assert incoming(other, "t", tokens[:-2], 3, values) == 5 and all(j < 2 for _, j in other.blocks_of("t"))
    # An int8 record is not taken into an archive that keeps its layer lossless (a read would refuse it).
    lossy = Archive(tmp_path / "c", IDENT, codec=Codec.INT8_DELTA_ZSTD)
    lossy.put([(BlockKey("s", 0, 0), *kv[(0, 0)])])
    [(_, _, value)] = outgoing(lossy, "s", tokens[:5])
    strict = Archive(tmp_path / "d", IDENT, lossless_layers=frozenset({0}))
    assert incoming(strict, "t", tokens[:4], 1, [value]) == 0 and not strict.blocks_of("t")
    for a in (src, dst, lossy, strict, other):
        a.close()
