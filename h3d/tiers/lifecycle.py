"""A session's blocks moved as a whole, between steps: demoted, archived (snapshot, park),
forgotten, adopted after a restart. The KV cache's lifecycle calls these (`h3d.kv.cache`); the
tier manager's primitives do the moves.

What must stay true: a DDR copy is dropped only once an archive copy is durable; a parked
session's every block, the partial last one included, is durable in the archive before its HBM
and DDR copies go; adoption takes only a prefix whose blocks the archive holds in every layer.
Blocks a session shares with others stay where they are (`h3d.kv.blocks`): a demotion or a park
leaves them. A snapshot gives the session a record of each under its own name, so that its
records restore it alone, without writing one twice: a block archived already (under its home's
name) is linked (`Archive.link`: one manifest line, no KV written), one not archived yet is
written and the session becomes its home.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from h3d.errors import NoArchive, SsdDegraded
from h3d.kv.blocks import NONE, SeqId
from h3d.tiers.archive import ArchiveWriteFailed, BlockKey
from h3d.tiers.manager import TierManager

SNAPSHOT_WRITE_MB = 64  # the most KV one snapshot write holds (a long session takes several)


def demote(tiers: TierManager, seq: SeqId, to_ssd: bool) -> int:
    """Move `seq`'s blocks down now (an idle session; between steps): to DDR (HBM copies
    dropped, copied to DDR first where needed), or to the archive (every full block archived,
    then its HBM and DDR copies dropped; the partial last block goes to DDR). Returns the block
    copies moved or dropped."""
    b = tiers.blocks
    t = b.table(seq)
    full = t.num_tokens // b.block_size
    moved = 0
    if to_ssd:
        if tiers.archive is None:
            raise NoArchive("evicting to SSD needs an archive: configure ssd_path")
        moved += snapshot(tiers, seq)
    for layer in range(b.num_layers):
        mine = ~b.shared(t.ids[layer, : t.num_blocks])  # a block shared with others stays put
        idx = np.flatnonzero((t.layer_hbm(layer) != NONE) & mine)
        if to_ssd:
            idx = idx[idx >= full]  # the full ones are archived: dropped below
        copy = idx[t.layer_ddr(layer)[idx] == NONE]
        if len(copy) > b.ddr_free:
            order = [p for p in tiers.eviction_order([seq], None) if p[0] != seq]
            tiers.free_ddr(len(copy) - b.ddr_free, order, {}, [seq])
        if len(copy):
            slots = b.add_ddr(seq, layer, copy)
            tiers.mover.hbm_to_ddr(t.layer_hbm(layer)[copy].copy(), slots)
        if len(idx):
            b.drop_hbm(seq, layer, idx)
            tiers.counters.hbm_evict_count += len(idx)
            moved += len(idx)
        if to_ssd:
            ddr = np.flatnonzero((t.layer_ddr(layer)[:full] != NONE) & mine[:full])
            gone = np.flatnonzero((t.layer_hbm(layer)[:full] != NONE) & mine[:full])
            if len(gone):
                b.drop_hbm(seq, layer, gone)
                tiers.counters.hbm_evict_count += len(gone)
                moved += len(gone)
            if len(ddr):
                b.drop_ddr(seq, layer, ddr)
                tiers.counters.ddr_evict_count += len(ddr)
                moved += len(ddr)
    return moved


def snapshot(tiers: TierManager, seq: SeqId, partial: bool = False) -> int:
    """Write every full block of `seq` without an archive copy to the archive, durably, from
    wherever it is (its copies stay). With `partial` (a checkpoint before shutdown) the last,
    partial block is written too, without being marked archived: it stays the block new
    tokens go to, and only a restart reads that record. Returns the blocks written."""
    if tiers.archive is None:
        raise NoArchive("a snapshot needs an archive: configure ssd_path")
    tiers.settle_spills()
    tiers.behind.wait(seq)  # its blocks written behind are archived already: not written twice
    if tiers.ssd_degraded is not None and not tiers.retry_ssd():
        raise SsdDegraded(f"the SSD tier takes no writes now: {tiers.ssd_degraded}")
    try:
        return _snapshot(tiers, seq, partial)
    except ArchiveWriteFailed as e:
        tiers.degrade(e)
        raise SsdDegraded(f"the SSD tier takes no writes now: {e}") from e


@dataclass(slots=True)
class _Write:
    """One archive write being gathered: its blocks' keys, slots and token counts, and the
    (layer -> blocks) to mark archived once it is durable."""

    keys: list[BlockKey] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    marks: dict[int, list[int]] = field(default_factory=dict)


def _snapshot(tiers: TierManager, seq: SeqId, partial: bool) -> int:
    """The blocks of every layer gathered into few durable writes, per pool and kind (full
    blocks, the partial last one), each at most `SNAPSHOT_WRITE_MB` of KV: a short session is
    a couple of archive appends (and their fsyncs), not a couple per layer; a long one never
    holds its whole KV in host memory at once."""
    b = tiers.blocks
    t = b.table(seq)
    name = tiers.sessions[seq].name
    full = t.num_tokens // b.block_size
    pools = (tiers.hbm, tiers.ddr)
    per_write = max(1, (SNAPSHOT_WRITE_MB << 20) // tiers.hbm.slot_bytes)
    pending: dict[tuple[int, bool], _Write] = {}
    written = 0

    def flush(group: tuple[int, bool]) -> None:
        nonlocal written
        w = pending.pop(group)
        tiers.mover.write_now(w.keys, pools[group[0]], np.array(w.slots, dtype=np.int64), w.tokens)
        for layer, blocks in w.marks.items():
            b.set_archived(seq, layer, np.array(blocks, dtype=np.int64))
        written += len(w.keys)

    def add(group: tuple[int, bool], layer: int, block: int, slot: int, tokens: int) -> None:
        w = pending.setdefault(group, _Write())
        w.keys.append(BlockKey(name, layer, block))
        w.slots.append(slot)
        w.tokens.append(tokens)
        if not group[1]:  # a full block: archived once durable (the partial one stays the tail)
            w.marks.setdefault(layer, []).append(block)
        if len(w.keys) >= per_write:
            flush(group)

    ids = t.ids[:, :full]
    shared = b.shared(ids)  # [L, full]: another session's record linked where there is one, else written here
    have = tiers.archive.blocks_of(name) if shared.any() and tiers.archive is not None else {}
    e = b.entries
    own = e.archived[ids] & (e.home[ids] == seq)
    links: dict[SeqId, list[tuple[int, int]]] = {}  # home -> the (layer, block)s of its records to link
    mine: dict[int, list[int]] = {}  # layer -> shared blocks whose record under this name is current
    for layer in range(b.num_layers):
        todo = np.flatnonzero(~own[layer])
        todo = todo[todo >= t.floor[layer]]  # (a window layer's blocks before its floor are freed)
        where = (t.layer_hbm(layer), t.layer_ddr(layer))
        skip = []
        for j in todo[shared[layer, todo]].tolist():
            if have.get((layer, j)) == b.block_size:  # (a full block's record holds its tokens' KV)
                mine.setdefault(layer, []).append(j)
            elif e.archived[ids[layer, j]]:
                links.setdefault(SeqId(int(e.home[ids[layer, j]])), []).append((layer, j))
            else:
                continue
            skip.append(j)
        if skip:
            todo = np.setdiff1d(todo, skip, assume_unique=True)
        for p, slots in enumerate(where):
            here = todo[slots[todo] != NONE]
            for j in here.tolist():
                add((p, False), layer, j, int(slots[j]), b.block_size)
            todo = todo[slots[todo] == NONE]
        if partial and full < t.num_blocks and (where[0][full] != NONE or where[1][full] != NONE):
            # (in the archive only, a parked session's: its record is current, and no slot holds it)
            p = 0 if where[0][full] != NONE else 1
            add((p, True), layer, full, int(where[p][full]), t.num_tokens - full * b.block_size)
    for home, pairs in links.items():  # one manifest line each, no KV written again
        assert tiers.archive is not None
        tiers.archive.link(name, tiers.sessions[home].name, pairs)
    for layer, blocks in mine.items():
        b.set_archived(seq, layer, np.array(blocks, dtype=np.int64))  # (the record is this session's now)
    for group in list(pending):
        flush(group)
    tiers.counters.ssd_write_count += written
    return written


def to_recompute(tiers: TierManager, seq: SeqId) -> int:
    """The blocks of `seq` a restart would compute again from its token log as things stand: those
    from the first one the archive lacks in some layer on (`adopt` takes the longest prefix held in
    every layer; the partial last block counts as lacking: only a checkpoint writes it)."""
    t = tiers.blocks.table(seq)
    full = t.num_tokens // tiers.blocks.block_size
    own = t.archived[:, :full] & (tiers.blocks.entries.home[t.ids[:, :full]] == seq)  # (a shared one: maybe not)
    held = (own | ~t.live()[:, :full]).all(axis=0)
    prefix = full if held.all() else int(np.argmin(held))
    return t.num_blocks - prefix


def park(tiers: TierManager, seq: SeqId) -> int:
    """A closed session: every block, the partial last one included, durable in the archive,
    then every HBM and DDR copy dropped (the state a restart leaves: the next step that uses
    it stages its blocks back). Returns the blocks written."""
    tiers.ahead.drop(seq)  # nothing read back into DDR after the drop
    written = snapshot(tiers, seq, partial=True)
    b = tiers.blocks
    t = b.table(seq)
    if t.num_tokens % b.block_size:
        for layer in range(b.num_layers):  # its record is current: it is the partial block's only copy now
            b.set_archived(seq, layer, np.array([t.num_blocks - 1]))
    b.drop_to_archive(seq)
    return written


def forget(tiers: TierManager, seq: SeqId) -> int:
    """Forget all of `seq`'s KV (its archived records too): computed again from its tokens
    when it is used next. Returns the block copies dropped."""
    b = tiers.blocks
    t = b.table(seq)
    nb = t.num_blocks
    copies = int((t.hbm[:, :nb] != NONE).sum() + (t.ddr[:, :nb] != NONE).sum())
    tiers.truncate(seq, 0)
    if tiers.writable:
        assert tiers.archive is not None
        tiers.archive.remove(tiers.sessions[seq].name)
    tiers.counters.recompute_evict_count += copies
    return copies


def adopt(tiers: TierManager, seq: SeqId, num_tokens: int) -> int:
    """After a restart: give `seq` the longest prefix of its first `num_tokens` tokens whose
    blocks the archive holds in every layer (read lazily, when a step first needs them); a
    sliding-window layer needs only those from its floor on (`BlockManager.floors`): a prefix
    shorter than what the full layers hold needs older window blocks, which are freed, so
    that prefix is taken whole or not at all. Returns the tokens adopted; the rest are to be
    prefilled again."""
    if tiers.archive is None or num_tokens <= 0:
        return 0
    b = tiers.blocks
    have = tiers.archive.blocks_of(tiers.sessions[seq].name)
    full_layers, window_layers = b.full_layers.tolist(), b.window_layers.tolist()

    def held(j: int, layers: list[int], tokens: int) -> bool:
        want = min(b.block_size, tokens - j * b.block_size)
        return all(have.get((layer, j)) == want for layer in layers)

    done = 0
    for j in range(b.blocks_for(num_tokens)):
        if not held(j, full_layers, num_tokens):
            break
        done = min(num_tokens, (j + 1) * b.block_size)
    if window_layers and done:
        floor = b.floors(done)
        if not all(held(j, [layer], done) for layer in window_layers for j in range(floor[layer], b.blocks_for(done))):
            done = 0  # (a shorter prefix reads window blocks older still)
    if done:
        b.adopt_archived(seq, done)
    return done
