"""The KV cache: the one owner of every session's KV state.

For each session (`SessionKV`): its block table (pointing to its blocks' entries, whose
residency `BlockManager` alone writes), its digests (`DigestStore`), its HBF selection state
(`SelectionState`, with its policy object), and the tier bookkeeping the tier manager reads and
updates (the archive name, the pin, the last use, the read counters). A block's own metadata
(residency, hotness) is its entry's (`h3d.kv.entries`). The engine and the daemon ask about a
session's KV and change it here, through one lifecycle API (`open`, `adopt`, `truncate`, `park`,
`forget`, `pin`, `set_policy`, `demote`, `snapshot`, `release`) and read-only queries
(`residency`, `archive_only`, `cached_tokens`, `counters`, `selection`); they never
reach into the block tables, the tier manager's maps or the selection states.

Below the cache: the pools (`KVPool`, bytes), the tier manager (`h3d.tiers.manager`: which block
moves where), HBF promotion (`h3d.tiers.promotion`) and the archive behind its tier interface.
The model runner uses them for a step; HBF picks of a step replayed as a CUDA graph reach the
host one step late (`lagged`), and are promoted before anything else changes a table.

What must stay true:
- a session is in `sessions` exactly when it has a block table; `release` forgets every
  structure of it in one call;
- every truncation (a rewind, a failed step, KV dropped to be computed again, a damaged block)
  goes through `truncate`, which keeps the digests exact: each part's min and max of its kept keys;
- a session whose policy keeps no digests has none; one adopted from the archive or parked has
  `stale_digests` until its next step takes them from its snapshot (`h3d.tiers.digestfile`;
  the blocks past it rebuilt from their keys) or rebuilds them all; a snapshot never covers a
  block whose keys changed (`cut` deletes it);
- only the engine's thread calls it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from h3d.errors import OutOfBlocks, SsdDegraded
from h3d.hbf.digests import DIGEST_ROOM_ADVICE, DigestStore, digest_layers
from h3d.hbf.policy import HbfConfig, Policy, SelectionState, base_blocks, policy_named, take_state
from h3d.kv.blocks import BlockManager, BlockTable, SeqId
from h3d.kv.pool import KVPool, Registrar
from h3d.kv.slots import SlotAllocator
from h3d.tiers import lifecycle
from h3d.tiers.archive import Archive, ArchiveWriteFailed
from h3d.tiers.digestfile import DATA_ALIGN, DigestFiles, Layout, host_copy, snapshots_folder
from h3d.tiers.identity import ArchiveCorrupt
from h3d.tiers.manager import TierManager
from h3d.tiers.promotion import Promoter
from h3d.tiers.shares import HbmShares
from h3d.tiers.stats import SessionCounters, TierStats

PARK_WAIT_S = 30.0  # the longest a closed session waits for write-behind before it is parked on the engine thread


@dataclass(slots=True)
class SessionKV:
    """One session's KV state. The cache adds and removes records; the tier manager and the
    promoter write the tier fields (`last_used`, `counters`)."""

    seq: SeqId
    name: str  # keys its blocks in the archive (the session id)
    table: BlockTable
    selection: SelectionState
    counters: SessionCounters = field(default_factory=SessionCounters)
    last_used: int = 0  # the tier manager's step of its last use
    pinned_until: float | None = None  # Unix time, inf: until unpinned; None: not pinned
    stale_digests: bool = False  # rebuilt from its keys at its next step

    @property
    def pinned(self) -> bool:
        """Its HBM blocks are never demoted while it is idle."""
        return self.pinned_until is not None


@dataclass(frozen=True, slots=True)
class Residency:
    """A session's block copies per tier, over all layers."""

    hbm: int
    ddr: int
    archived: int


# A resumed session's read-ahead starts with the blocks its last steps read most, up to this many
# times its window's blocks per layer (`KVCache.note_hot`): its KV heads select apart, so a step
# reads more blocks than one window's
HOT_WINDOWS = 2


class KVCache:
    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        hbm_regions: int | Sequence[int],
        ddr_slots: int,
        block_size: int,
        hbf: HbfConfig,
        archive: Archive | None = None,
        high_watermark: float = 0.85,
        promote_bytes_per_step: int | None = None,
        rebalance_bytes_per_step: int | None = None,
        windows: Sequence[int | None] | None = None,
        window_keep_tokens: int = 0,
        ssd_retry_interval_s: float = 10.0,
        write_behind_dirty_mb: float | None = None,
        ssd_capacity: int | None = None,
        ddr_register: tuple[Registrar, Callable[[int], None]] | None = None,
        ddr_memory: str = "registered",
    ) -> None:
        """`hbm_regions`: every layer's HBM region in blocks, or one size per layer; `windows`: each
        layer's sliding window, None for full attention (`ModelConfig.windows`; all full by default),
        whose blocks are freed `window_keep_tokens` past it (`BlockManager`);
        `write_behind_dirty_mb`, `ssd_capacity`: see `TierManager`; `ddr_register`, `ddr_memory` (its
        `host_memory`): see `KVPool`."""
        self.sessions: dict[SeqId, SessionKV] = {}
        self._archive = archive
        self.blocks = BlockManager(hbm_regions, ddr_slots, num_layers, block_size, windows, window_keep_tokens)
        shape = (block_size, num_kv_heads, head_dim, dtype)
        self.hbm = KVPool(self.blocks.num_slots, *shape, device)
        self.ddr = KVPool(
            len(self.blocks.ddr_owner), *shape, torch.device("cpu"), pin_memory=device.type == "cuda",
            register=ddr_register, host_memory=ddr_memory, gpu=device if device.type == "cuda" else None,
        )  # fmt: skip
        if self.ddr.usable < self.ddr.num_slots:  # the rest is registered in the background (`TierManager.grow_ddr`)
            a = self.blocks.ddr_alloc
            self.blocks.ddr_alloc = SlotAllocator(a.first, a.size, a.owner, usable=self.ddr.usable - 1)
        self.tiers = TierManager(
            self.blocks, self.hbm, self.ddr, archive, high_watermark, self.sessions, self.cut, ssd_retry_interval_s,
            write_behind_dirty_mb, ssd_capacity,
        )  # fmt: skip
        self.promoter = Promoter(self.tiers, promote_bytes_per_step)
        self.hbf = hbf
        self.frozen: dict[SeqId, int] = {}  # seq -> its first block no step may move (ModelRunner.begin)
        # Closed sessions whose full blocks write-behind archives before they are parked (`park_later`),
        # and since when (time.monotonic())
        self.parking: dict[SeqId, float] = {}
        self.tiers.frozen = self.frozen  # (never cut to make room)
        self.shares = HbmShares(self.tiers, self.promoter, self.demand)  # fair HBM between active sessions
        self.promoter.room = self.shares.room
        # Blocks moved toward the shares per step (both ways); None: no limit.
        self.rebalance_blocks = (
            None if rebalance_bytes_per_step is None else max(1, rebalance_bytes_per_step // self.tiers.block_bytes)
        )
        self.device = device
        # On CUDA the arena holds the digests of every block HBM and DDR can hold from the start
        # (the sizing reserved their memory, h3d.kv.sizing): captured steps read it by address,
        # and each growth would capture them again. A CPU host grows it as sessions come.
        # (A session holds as many blocks in each full-attention layer, and few in a sliding one.)
        full = self.blocks.full_layers.tolist()
        held = self.blocks.num_slots + len(self.blocks.ddr_owner)
        per_layer = held // max(1, len(full)) if device.type == "cuda" else 0
        self.digests = DigestStore(
            num_layers, num_kv_heads, head_dim, block_size, dtype, device, hbf.digest_tokens, blocks=per_layer,
            layers=digest_layers(full, hbf.dense_layers),
        )  # fmt: skip
        self.digests.rebuild = self._rebuild_layer
        # Digest snapshots beside the archive (`h3d.tiers.digestfile`): a resumed session's
        # digests read first, not rebuilt from every key.
        self.digest_files = (
            DigestFiles(snapshots_folder(archive.path), archive.identity.fingerprint) if archive is not None else None
        )
        if self.digest_files is not None:
            self.digest_files.clean()
            self.tiers.side_bytes = self.snapshot_bytes
        # The HBF picks of the last step replayed as a CUDA graph, not yet promoted (the runner's
        # graphs hand them over: `DecodeGraphs.take_lagged`).
        self.lagged: Callable[[], dict[SeqId, np.ndarray]] = dict

    # ---- queries ------------------------------------------------------------------------------

    @property
    def block_size(self) -> int:
        return self.blocks.block_size

    def has(self, seq: SeqId) -> bool:
        return seq in self.sessions

    def selection(self, seq: SeqId) -> SelectionState:
        return self.sessions[seq].selection

    def policy(self, seq: SeqId) -> Policy:
        return self.sessions[seq].selection.policy

    def counters(self, seq: SeqId) -> SessionCounters:
        return self.sessions[seq].counters

    def cached_tokens(self, seq: SeqId) -> int:
        """Tokens whose KV is written."""
        return self.sessions[seq].table.num_tokens

    def residency(self, seq: SeqId) -> Residency:
        """`seq`'s block copies per tier; its archive copies are its own records (a block it
        shares may have another session's)."""
        table = self.sessions[seq].table
        hbm, ddr, _ = table.copies()
        ids = table.ids[:, : table.num_blocks]
        e = self.blocks.entries
        return Residency(hbm, ddr, int((e.archived[ids] & (e.home[ids] == seq)).sum()))

    def archive_only(self, seq: SeqId) -> bool:
        """Whether some block of `seq` is in the archive only (a step must stage it first)."""
        if not self.blocks.entries.num_archived:  # every block has a copy in HBM or DDR
            return False
        return self.sessions[seq].table.any_archive_only()

    def window_tokens(self, seq: SeqId) -> int:
        """The session's HBF window now (it adapts under `attention_entropy`)."""
        return self.sessions[seq].selection.window_tokens

    def stats(self) -> TierStats:
        """The tiers' counters and occupancy (`h3d.tiers.stats`), and the digests'."""
        d = self.digests
        return replace(
            self.tiers.stats(), digest_bytes=d.nbytes(), digest_shared_saved_bytes=d.shared_parts() * d.row_bytes
        )

    def hbf_latency_us(self) -> tuple[float, float]:
        """p50 and p99 of the host-side HBF planning per step (`Promoter.latency_us`)."""
        return self.promoter.latency_us()

    # ---- the archive's health (the tier manager decides; callers ask) ------------------------

    @property
    def archive(self) -> Archive | None:
        """The SSD archive (the cold tier today), whose space the engine keeps within
        `ssd_capacity_mb`."""
        return self._archive

    @property
    def writable(self) -> bool:
        """Whether blocks can be archived now (an archive, not degraded)."""
        return self.tiers.writable

    @property
    def ssd_degraded(self) -> str | None:
        """Why the archive takes no writes now (None: it does, or there is none)."""
        return self.tiers.ssd_degraded

    def degrade(self, error: ArchiveWriteFailed) -> None:
        self.tiers.degrade(error)

    def retry_ssd(self) -> bool:
        return self.tiers.retry_ssd()

    def take_notices(self) -> list[tuple[str, dict[str, object]]]:
        """What the tiers noted for the daemon's log (log event, fields), once."""
        notices, self.tiers.notices = self.tiers.notices, []
        return notices

    # ---- admission ----------------------------------------------------------------------------

    def admit(self, seq: SeqId, n_tokens: int, active: Collection[SeqId] = ()) -> None:
        """Refuse (OutOfBlocks) `n_tokens` more tokens of `seq` that the tiers cannot hold, or
        whose digests the device cannot (every open session's stay on it: `DigestStore.missing`)
        even once the idle sessions' digests are set aside (`set_aside_digests`; never those of
        `seq`, of the `active` sessions, which have requests, of pinned ones or of a long prompt
        in flight). A session whose digests were set aside or parked counts their return too, and
        so does every `active` one's whose digests have not come back yet: their next step (the
        one they share with this request) brings them all back at once."""
        self.tiers.admit(seq, n_tokens)
        d = self.digests
        record = self.sessions[seq]
        if d.free_bytes is None or not d.layers or not record.selection.policy.keeps_digests:
            return
        parts = -(-n_tokens // d.part_tokens) + d.parts  # (and the partial block's parts)
        for s in {seq, *active}:
            r = self.sessions.get(s)
            if r is not None and r.stale_digests and r.selection.policy.keeps_digests:  # back at its next step
                parts += -(-r.table.num_tokens // d.part_tokens)
        short = d.missing(parts)
        if short:
            keep = {seq, *active, *self.frozen}
            idle = [  # (not one whose rows others read: each of them would take a copy)
                s for s, r in self.sessions.items() if s not in keep and not r.pinned and d.has(s) and not d.lends(s)
            ]
            for s in sorted(idle, key=lambda s: self.sessions[s].last_used):  # the least recent first
                self.set_aside_digests(s)
                short = d.missing(parts)
                if not short:
                    break
        if short:
            raise OutOfBlocks(
                f"the device cannot hold the digests of {n_tokens} more tokens beside those of the sessions in use, "
                f"idle ones' set aside ({short >> 20} MiB more than it has free; HBF's selection reads them each "
                f"step): {DIGEST_ROOM_ADVICE}"
            )

    def set_aside_digests(self, seq: SeqId) -> None:
        """An idle session's digests off the device to make room for another's: its full blocks'
        snapshot written (`save_digests_later`: copied to the host here, written on a thread) and
        its rows dropped; its next step takes them back from the snapshot and rebuilds its
        partial block's from its keys (`refresh_digests`), as a reopened session's."""
        d = self.digests
        if not d.has(seq):
            return
        freed = d.row_bytes * d.extent_rows(seq)
        self.save_digests_later(seq)
        d.drop(seq)
        record = self.sessions[seq]
        record.stale_digests = record.selection.policy.keeps_digests
        self.tiers.counters.digests_set_aside += 1
        self.tiers.notices.append(
            ("digests_set_aside", {"session": record.name, "bytes": freed, "blocks": record.table.num_blocks})
        )

    def chunk_limit(self, seq: SeqId) -> int:
        """Most tokens of `seq` one step may write (`TierManager.chunk_limit`)."""
        return self.tiers.chunk_limit(seq)

    def count_rebuilt(self, blocks: int) -> None:
        """Blocks (all layers) computed again: missing or damaged in the archive."""
        self.tiers.counters.kv_rebuild_blocks += blocks

    def footprint(self, seq: SeqId) -> int:
        """The blocks (one layer's each) `seq` keeps: what its steps may read, in every layer (a
        sliding-window layer's blocks behind its floor, freed, not counted). O(layers)."""
        t = self.blocks.table(seq)
        return int((t.num_blocks - np.minimum(self.blocks.floors(t.num_tokens), t.num_blocks)).sum())

    def demand(self, seq: SeqId) -> np.ndarray:
        """The blocks `seq`'s policy reads in each layer per step, [L] (its claim on HBM,
        h3d.tiers.shares): every block under a policy that reads them all and in the dense layers,
        else sinks + the recent window + its window."""
        record = self.sessions[seq]
        nb = record.table.num_blocks
        out = np.full(self.blocks.num_layers, nb, dtype=np.int64)
        if record.selection.policy.selects:
            window = -(-record.selection.window_tokens // self.block_size) + len(self.keep(seq))
            out[self.hbf.dense_layers :] = min(nb, window)
        slide = self.blocks.window_layers  # a sliding-window layer reads its window's blocks, whatever the policy
        out[slide] = nb - self.blocks.floors(max(record.table.num_tokens - 1, 0), keep=0)[slide]
        return out

    def rebalance(self, active: list[SeqId]) -> int:
        """Between steps: HBM moved toward the fair shares of the `active` sessions (a request in
        flight), within `rebalance_mb_per_step` (h3d.tiers.shares); the blocks moved."""
        self.shares.plan(active)
        budget = self.rebalance_blocks or self.blocks.hbm_capacity
        return self.shares.rebalance(budget, self.frozen)

    def hbm_share(self, seq: SeqId) -> int:
        """`seq`'s fair share of HBM now, blocks over all layers (0: none, idle or pinned)."""
        share = self.shares.target.get(seq)
        return 0 if share is None else int(share.sum())

    def keep(self, seq: SeqId) -> np.ndarray:
        """Blocks of `seq` that HBF never evicts from HBM: sinks and the recent window."""
        return base_blocks(self.sessions[seq].table.num_blocks, self.hbf, self.block_size)

    # ---- lifecycle ----------------------------------------------------------------------------

    def open(
        self, seq: SeqId, name: str | None = None, policy: Policy | None = None, state: SelectionState | None = None
    ) -> None:
        """An empty cache for `seq`; `name` keys its blocks in the archive (the session id;
        `seq-N` by default); `policy`: the configured one by default; `state`: a `new_selection`
        made beforehand (its policy then)."""
        table = self.blocks.allocate(seq)
        self.sessions[seq] = SessionKV(seq, name or f"seq-{seq}", table, state or self.new_selection(policy))

    def new_selection(self, policy: Policy | None = None) -> SelectionState:
        """A new session's HBF state (`policy`: the configured one by default). Reads only the
        configuration: any thread may call it."""
        return SelectionState(policy or policy_named(self.hbf.policy), self.hbf.window_tokens)

    def pin(self, seq: SeqId, until: float | None) -> None:
        """Keep `seq`'s HBM blocks while it is idle until the Unix time `until` (math.inf: until
        unpinned), or no longer (None)."""
        self.sessions[seq].pinned_until = until

    def pinned_until(self, seq: SeqId) -> float | None:
        return self.sessions[seq].pinned_until

    def set_policy(self, seq: SeqId, policy: Policy) -> None:
        """Switch `seq`'s selection policy (from its next step); digests are built where the new
        policy keeps them and the old one did not."""
        self.flush_lagged()
        state = self.sessions[seq].selection
        if policy.keeps_digests and not state.policy.keeps_digests:
            self._rebuild_digests(seq)
        state.policy = policy

    def adopt(self, seq: SeqId, num_tokens: int) -> int:
        """After a restart: take the KV of `seq`'s first tokens from the archive (read lazily,
        `h3d.tiers.lifecycle.adopt`); digests follow at its first step; the blocks left to prefill again
        are counted (`kv_rebuild_blocks`). Returns the tokens adopted."""
        self.flush_lagged()
        record = self.sessions[seq]
        adopted = lifecycle.adopt(self.tiers, seq, num_tokens)
        if adopted and record.selection.policy.keeps_digests:
            record.stale_digests = True
        bs = self.block_size
        self.count_rebuilt(-(-num_tokens // bs) - -(-adopted // bs))
        return adopted

    @torch.inference_mode()
    def fork(self, parent: SeqId, child: SeqId, num_tokens: int) -> int:
        """A fork's KV (`child`: open, empty): `parent`'s blocks of its first `num_tokens` tokens,
        whole blocks only, shared (`BlockManager.share`: no byte is copied; while shared, the
        blocks stay where they are, in HBM or DDR, for both).
        - The parent's blocks in the archive only are read back into DDR first
          (`TierManager.load`, below the high watermark): the sharing ends at the first left there.
        - Nothing is shared where a sliding-window layer freed a block the child would read
          (`BlockManager.keepable`), or while the parent's long prompt is in flight (`frozen`: its
          table holds blocks not written yet).
        - The spills in flight land first: one finishing later would drop a shared copy. Write-behind's
          batches are not waited for (up to `WRITE_BEHIND_IN_FLIGHT_MB` of them, a second's writes on
          a GPU host, with every stream stalled): they drop no copy, and the block they mark archived
          is the same entry for both sessions, its record the writer's (`home`).
        - The shared blocks' digests are the parent's, copied (rebuilt from the keys at the
          child's first step where the parent's are not at hand).
        What it leaves is prefilled again. Returns the tokens shared."""
        self.flush_lagged()
        b, bs = self.blocks, self.block_size
        src = self.sessions[parent].table
        n = min(num_tokens, src.num_tokens) // bs
        if parent in self.frozen:  # a long prompt in flight: its table holds blocks not written yet
            n = 0
        if n and b.keepable(parent, n * bs) < n * bs:
            n = 0
        if not n:
            return 0
        self.tiers.settle_spills()
        if self.archive_only(parent):  # read back into DDR first, as many as fit
            self.tiers.load(parent, upto=n)
            n = min(n, self.resident_head(parent))
        if not n:
            return 0
        b.share(parent, child, n)
        b.drop_behind(child, n * bs)  # (a window layer's blocks the child's next token no longer reads)
        record, source = self.sessions[child], self.sessions[parent]
        record.last_used = source.last_used
        if record.selection.policy.keeps_digests:
            if not source.stale_digests and self.digests.has(parent):  # the same keys: the same digests, shared
                self.digests.share(child, parent, n)
            else:
                record.stale_digests = True  # rebuilt from the keys at its next step
        return n * bs

    @torch.inference_mode()
    def fork_whole(self, parent: SeqId, child: SeqId) -> int:
        """A fork of all of `parent`'s KV (`child`: open, empty), the parent's twin: its full
        blocks shared (as `fork` does), its partial last block copied into a block of the child's
        own (new tokens are never written into a shared block) and its HBF state taken over
        (window, entropies, the prompt's anchors): the child selects and computes what the parent
        would, nothing prefilled again. The parent's blocks in the archive only (a closed parent, a
        restart) are read back into DDR first (`TierManager.load`, below the high watermark). All
        or nothing: 0 where some are left there (`fork` shares what it can and the caller
        prefills the rest), or the parent's long prompt is in flight. Returns the tokens the
        child holds."""
        self.flush_lagged()  # (a replayed step's picks, and its entropy, into the parent's state first)
        b, bs = self.blocks, self.block_size
        src, record, source = self.sessions[parent].table, self.sessions[child], self.sessions[parent]
        total, n = src.num_tokens, src.num_tokens // bs
        if not total or parent in self.frozen:
            return 0
        self.tiers.settle_spills()  # (one finishing later would drop a shared copy)
        if self.archive_only(parent):
            self.tiers.load(parent)
            if self.archive_only(parent):
                return 0
        tail = total - n * bs
        if tail:  # room for the child's copy of the partial block, in every layer (may demote the idle)
            self.tiers.prepare_append(child, bs, [child, parent], {parent: 0, child: 0})
            if not b.can_append(child, bs) or self.archive_only(parent):
                return 0
        b.share(parent, child, n)
        if tail:
            at = np.full(tail, n, dtype=np.int64), np.arange(tail, dtype=np.int64)
            self._copy_tokens(b._rows(src, *at), b.append(child, tail))
        record.last_used = source.last_used
        take_state(record.selection, source.selection)
        if record.selection.policy.keeps_digests:
            if not source.stale_digests and self.digests.has(parent):  # shared, the partial block's copied
                self.digests.share(child, parent, n, b.blocks_for(total) - n)
            else:
                record.stale_digests = True
        return total

    def _copy_tokens(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy tokens' K and V from pool rows `src` to `dst` (as `BlockManager.append` gives them:
        [L, n], >= 0 a row of HBM, else -(row + 1) of DDR)."""
        src, dst = src.ravel(), dst.ravel()
        hkv, d = self.hbm.k.shape[0], self.hbm.k.shape[-1]
        k = torch.empty(len(src), hkv, d, dtype=self.hbm.k.dtype, device=self.device)
        v = torch.empty_like(k)
        pools = ((self.hbm, src >= 0, src, dst >= 0, dst), (self.ddr, src < 0, -src - 1, dst < 0, -dst - 1))
        for pool, at, rows, _, _ in pools:
            if at.any():
                i = torch.from_numpy(np.flatnonzero(at)).to(self.device)
                r = torch.from_numpy(rows[at]).to(pool.k.device)
                k[i] = pool.k.view(hkv, -1, d)[:, r].transpose(0, 1).to(self.device)
                v[i] = pool.v.view(hkv, -1, d)[:, r].transpose(0, 1).to(self.device)
        for pool, _, _, at, rows in pools:
            if at.any():
                i = torch.from_numpy(np.flatnonzero(at)).to(self.device)
                dev = pool.k.device
                pool.write(torch.from_numpy(rows[at]).to(dev), k[i].to(dev), v[i].to(dev))

    def resident_head(self, seq: SeqId) -> int:
        """The leading full blocks of `seq` that HBM or DDR hold in every layer (what a session
        that shares them reads without the archive)."""
        t = self.sessions[seq].table
        full = t.num_tokens // self.block_size
        if not self.blocks.entries.num_archived:
            return full
        homeless = t.archive_only(upto=full).any(axis=0)
        return int(np.argmax(homeless)) if homeless.any() else full

    @torch.inference_mode()
    def rebase(self, donor: SeqId, seq: SeqId, num_tokens: int) -> int:
        """`seq`'s KV of its first `num_tokens` tokens (whole blocks) replaced by `donor`'s, which
        holds the same tokens in HBM or DDR (`BlockManager.rebase`): a session whose KV the
        archive alone holds (resumed after a restart, or reopened) reads the donor's blocks
        rather than its own records, and shares them. Nothing where either's long prompt is in
        flight, where a window layer of `seq` reads a block the donor freed, or where the donor's
        blocks are in the archive only. The archive writes and reads ahead of `seq` in flight
        land or are given back first. Returns the tokens whose blocks are shared now."""
        self.flush_lagged()
        if donor in self.frozen or seq in self.frozen:
            return 0
        self.tiers.settle()  # (a spill in flight may leave a donor's block in the archive only)
        b, bs = self.blocks, self.block_size
        n = min(num_tokens // bs, self.resident_head(donor), self.sessions[seq].table.num_tokens // bs)
        if n <= 0 or (b.table(donor).floor > np.minimum(b.table(seq).floor, n)).any():
            return 0
        self.tiers.ahead.drop(seq, stop=False)
        peers = b.peers(seq)  # what `seq` let go of may be theirs alone now
        if not b.rebase(donor, seq, n):
            return 0
        self.tiers.behind.look_again(peers | {seq})
        # (Its digests, if kept, stay its own: the donor's keys are those of the same tokens.)
        return n * bs

    def truncate(self, seq: SeqId, num_tokens: int) -> None:
        """Forget `seq`'s KV past its first `num_tokens` tokens, and the cut keys' share of its
        digests (the bounds stay those of the kept keys)."""
        self.flush_lagged()
        self.cut(seq, num_tokens)

    def drop_behind(self, seq: SeqId, num_tokens: int) -> int:
        """Before `seq`'s tokens from position `num_tokens` on are computed: its sliding-window
        layers' blocks that none of them reads are freed, in every tier (`BlockManager.drop_behind`).
        Returns the blocks freed."""
        freed = self.blocks.drop_behind(seq, num_tokens)
        self.tiers.counters.window_freed_blocks += freed
        return freed

    @torch.inference_mode()
    def cut(self, seq: SeqId, num_tokens: int) -> None:
        """`truncate` within a step (a step that failed midway, KV the tier manager drops to be
        computed again): the lagged picks wait for the step's end. A cut that a sliding-window
        layer's freed blocks would be read after drops the whole KV (`BlockManager.keepable`); a cut
        inside a block shared with other sessions keeps the whole blocks before it (new tokens are
        never written into a shared block)."""
        record = self.sessions[seq]
        if num_tokens >= record.table.num_tokens:
            return
        bs = self.block_size
        if num_tokens % bs and self.blocks.shared(record.table.ids[:, num_tokens // bs]).any():
            num_tokens -= num_tokens % bs  # a block other sessions share is never written to: computed again
        num_tokens = self.blocks.keepable(seq, num_tokens)
        self.tiers.behind.look_again(self.blocks.peers(seq))  # what it shared may be theirs alone now
        if self.digest_files is not None:  # its snapshot holds the digests of the blocks cut
            self.digest_files.cut(record.name, num_tokens // self.block_size)
        self.tiers.behind.cut(seq, num_tokens)  # its records in flight land before the blocks go
        self.tiers.ahead.drop(seq, stop=False)  # and its reads ahead are given back
        self.blocks.truncate(seq, num_tokens)
        if not record.selection.policy.keeps_digests or record.stale_digests:
            return  # no digests kept, or rebuilt at the next step
        if num_tokens == 0:
            self.digests.drop(seq)
            return

        def tail(layer: int, start: int) -> torch.Tensor:
            keys = self.tiers.read_keys(seq, layer, first_block=start // bs)  # [Hkv, t, D]
            return keys[:, start % bs :].transpose(0, 1).to(self.device)

        self.digests.truncate(seq, num_tokens, tail)

    def forget_archived(self, seq: SeqId, first: int) -> None:
        """Delete `seq`'s archive records of block `first` and later (its tokens there change: a
        restart must not take them for the new tokens' KV), after its KV was cut to before them.
        Raises SsdDegraded if the archive takes no writes."""
        archive = self.tiers.archive
        if archive is None or not archive.blocks_of(self.sessions[seq].name):
            return
        if not self.writable and not self.retry_ssd():
            raise SsdDegraded(f"the SSD tier takes no writes now: {self.ssd_degraded}")
        self.tiers.stage_partial(seq, [seq], {})  # a partial last block the archive alone holds: to DDR first
        try:
            archive.remove(self.sessions[seq].name, first)
        except ArchiveWriteFailed as e:
            self.degrade(e)
            raise SsdDegraded(f"the SSD tier takes no writes now: {e}") from e

    def rebuild_from(self, seq: SeqId, block: int) -> int:
        """Forget `seq`'s KV from `block` on (a damaged block that could not be rewritten): its
        next step prefills it again. Returns the blocks dropped (counted in `kv_rebuild_blocks`)."""
        self.flush_lagged()
        before = self.sessions[seq].table.num_blocks
        self.cut(seq, block * self.block_size)
        dropped = before - self.sessions[seq].table.num_blocks
        self.count_rebuilt(dropped)
        return dropped

    def park_later(self, seq: SeqId) -> bool:
        """`park` a closed session once write-behind has archived its full blocks, whatever its
        dirty budget, on its own threads (`WriteBehind.urgent`): the engine thread then writes only
        its partial last block (`parked`); until then its copies stay, and a request reopens it
        as it was (`unpark`). False where write-behind is off or the archive takes no writes (the
        caller parks it now)."""
        behind = self.tiers.behind
        if not behind.enabled or not self.writable:
            return False
        self.pin(seq, None)  # (as `park` leaves it)
        self.parking.setdefault(seq, time.monotonic())
        behind.urgent.add(seq)
        return True

    def unpark(self, seq: SeqId) -> None:
        """A session being parked (`park_later`) used again: its KV stays where it is."""
        self.parking.pop(seq, None)
        self.tiers.behind.urgent.discard(seq)

    def parked(self) -> list[SeqId]:
        """The sessions being parked whose full blocks are all archived now (or that will not be
        soon: the archive takes no writes, refused them for its capacity, or `PARK_WAIT_S` passed):
        `park` them."""
        behind = self.tiers.behind
        b = self.blocks
        ready = []
        now = time.monotonic()
        for seq, since in self.parking.items():
            t = b.table(seq)
            ids = t.ids[b.full_layers, : t.num_tokens // b.block_size]
            stuck = not self.writable or behind.wants_room > 0 or now - since > PARK_WAIT_S
            if stuck or (b.entries.archived[ids].all() and not any(x.seq == seq for x in behind.batches)):
                ready.append(seq)
        return ready

    def park(self, seq: SeqId) -> None:
        """A closed session: its KV to the archive only (`h3d.tiers.lifecycle.park`), unpinned, its
        digests snapshot (written on a thread of its own) and dropped: read back from the snapshot
        if it is reopened."""
        self.flush_lagged()
        self.unpark(seq)
        record = self.sessions[seq]
        lifecycle.park(self.tiers, seq)
        record.pinned_until = None
        self.save_digests_later(seq)
        self.digests.drop(seq)
        record.stale_digests = record.selection.policy.keeps_digests

    def forget(self, seq: SeqId) -> int:
        """Forget all of `seq`'s KV, its archived records too: computed again from its tokens when
        it is used next. Returns the block copies dropped."""
        self.flush_lagged()
        self.unpark(seq)
        if self.digest_files is not None:
            self.digest_files.remove(self.sessions[seq].name)
        return lifecycle.forget(self.tiers, seq)

    def demote(self, seq: SeqId, to_ssd: bool) -> int:
        """Move an idle session's blocks down now (`h3d.tiers.lifecycle.demote`); returns the copies moved."""
        self.flush_lagged()
        return lifecycle.demote(self.tiers, seq, to_ssd)

    def snapshot(self, seq: SeqId, partial: bool = False) -> int:
        """Archive `seq`'s blocks durably (`h3d.tiers.lifecycle.snapshot`); returns the blocks written."""
        return lifecycle.snapshot(self.tiers, seq, partial)

    def to_recompute(self, seq: SeqId) -> int:
        """The blocks of `seq` a restart would compute again now (`h3d.tiers.lifecycle.to_recompute`)."""
        return lifecycle.to_recompute(self.tiers, seq)

    def release(self, seq: SeqId, purge_archive: bool = True) -> None:
        """Forget `seq` entirely: its table and slots, digests, HBF state, tier bookkeeping, and
        (with `purge_archive`) its archived records."""
        self.flush_lagged()
        self.unpark(seq)
        record = self.sessions.get(seq)
        try:
            self.tiers.release(seq, purge_archive and record is not None)
            if purge_archive and record is not None and self.digest_files is not None:
                self.digest_files.remove(record.name)
        finally:
            self.digests.drop(seq)
            self.sessions.pop(seq, None)

    # ---- upkeep -------------------------------------------------------------------------------

    def promote(self, picks: dict[SeqId, np.ndarray], protect: dict[SeqId, int], counted: bool = False) -> None:
        """HBF's promotion of what a step's selections read (`Promoter.promote`), which counts
        those reads unless they were (`counted`); the sinks and recent windows are kept."""
        self.promoter.promote(picks, protect, {s: self.keep(s) for s in picks}, counted)

    def flush_lagged(self, protect: dict[SeqId, int] | None = None) -> None:
        """Promote the last replayed step's HBF picks, if they wait, before anything else changes
        the sessions' tables (a step's commit applies them otherwise)."""
        lagged = self.lagged()
        if lagged:
            self.promote(lagged, protect or {}, counted=True)

    def refresh_digests(self, seq: SeqId) -> None:
        """Rebuild `seq`'s digests if they are stale (adopted or parked): from its snapshot where
        there is one (the blocks past it from their keys), else from all its keys, its KV read
        from the archive in parallel first. May meet a damaged record, and is done again at the
        step after its repair."""
        record = self.sessions[seq]
        if record.stale_digests:
            t0 = time.perf_counter()
            snapshot = self.digest_files is not None and self.digest_files.header(record.name) is not None
            if snapshot:  # its KV read back into DDR beside the snapshot's read, what its step reads for sure first
                self.tiers.ahead.start(seq, self._known(seq))
            covered = self._load_digests(seq)
            t1 = time.perf_counter()
            staged = self.tiers.load(seq, covered)  # the keys the digests are rebuilt from (all, without a snapshot)
            self._rebuild_digests(seq, covered)
            record.stale_digests = False
            self.tiers.ahead.start(seq)  # (the rest of) its KV back into DDR
            blocks = record.table.num_blocks
            self.tiers.notices.append(("digests_restored", {
                "session": record.name, "blocks": blocks, "from_snapshot": covered, "rebuilt": blocks - covered,
                "blocks_read_first": staged, "snapshot_s": round(t1 - t0, 3),
                "seconds": round(time.perf_counter() - t0, 3),
            }))  # fmt: skip

    def _known(self, seq: SeqId) -> np.ndarray:
        """[L, blocks] what `seq`'s next decode step reads whatever its query (`Policy.known`),
        and the blocks its last steps before it was checkpointed or closed read most (`note_hot`),
        which the next step's selections are likely to read again."""
        record = self.sessions[seq]
        state, nb = record.selection, record.table.num_blocks
        mask = np.zeros((self.blocks.num_layers, nb), dtype=bool)
        for layer in range(self.blocks.num_layers):
            known = state.policy.known(state, self.hbf, layer, nb, self.block_size)
            if known is None:
                mask[layer] = True
            else:
                mask[layer, known[known < nb]] = True
                hot = state.hot.get(layer)
                if hot is not None:
                    mask[layer, hot[hot < nb]] = True
        return mask

    def resume_ahead(self, seqs: Sequence[SeqId]) -> None:
        """A restart's open sessions (`seqs`, the first to be asked for first) brought back before
        their first steps: their archived KV read back into DDR (`h3d.tiers.readahead`: what each
        first step reads for sure and its hot blocks first, `_known`, then the rest), then their
        digests taken from their snapshots (`_digests_ahead`). What a session links to another
        session's records (a fork's, a reused prefix's) is left to its first use, which shares
        that one's copies (`rebase`) and rebuilds its digests' sharing."""
        linked = {seq: self._linked(seq) for seq in seqs}
        for seq in seqs:
            known = self._known(seq)
            skip = np.zeros_like(known)
            if linked[seq]:
                layers, blocks = np.array(linked[seq]).T
                keep = blocks < skip.shape[1]
                skip[layers[keep], blocks[keep]] = True
            self.tiers.ahead.start(seq, known & ~skip, skip)
        for seq in seqs:
            if not linked[seq]:
                self._digests_ahead(seq)

    def _linked(self, seq: SeqId) -> list[tuple[int, int]]:
        return self.archive.linked_of(self.sessions[seq].name) if self.archive is not None else []

    def _digests_ahead(self, seq: SeqId) -> None:
        """A restored session's digests taken from its snapshot now (`refresh_digests`: read on a
        thread, each layer copied in when first read), rather than by its first step, which would
        wait for them: where its snapshot covers every full block (else the rest would be rebuilt
        from their keys, read now) and the arena holds them as it is (on a GPU at the start,
        growing it would take the device memory the warm-up needs). A record that fails here is
        left to that step, which repairs it."""
        record = self.sessions[seq]
        d = self.digests
        if not record.stale_digests or self.digest_files is None:
            return
        meta = self.digest_files.header(record.name)
        if meta is None or meta.get("blocks") != record.table.num_tokens // self.block_size:
            return  # none, or one of fewer blocks: the rest rebuilt from their keys would be read now
        if d.free_bytes is not None and not d.holds(-(-record.table.num_tokens // d.part_tokens) + d.parts):
            return  # (a CPU's arena grows where it must: host memory)
        try:
            self.refresh_digests(seq)
        except (ArchiveCorrupt, KeyError, OSError):
            d.drop(seq)  # its first step takes them again, and meets the damage there
            record.stale_digests = True

    def note_hot(self, seq: SeqId) -> None:
        """Note in `seq`'s HBF state (kept in its log: `session_meta`) the blocks its last steps
        read most in each layer that selects: those with a rank (`Promoter.rank`: recency and
        hotness), at most HOT_WINDOWS x its window's blocks, the best first. A hint: a resumed
        session reads them ahead with what it reads for sure (`_known`), so that its first step's
        selections find most of their blocks read; what it reads is decided as ever."""
        record = self.sessions[seq]
        state, nb = record.selection, record.table.num_blocks
        self.flush_lagged()  # (a replayed step's picks counted first)
        rank = self.promoter.rank(seq)  # [L, nb]
        most = HOT_WINDOWS * -(-state.window_tokens // self.block_size)
        hot: dict[int, np.ndarray] = {}
        if state.policy.selects:
            for layer in range(self.blocks.num_layers):
                if state.policy.known(state, self.hbf, layer, nb, self.block_size) is None:
                    continue  # read whole
                r = rank[layer]
                used = np.flatnonzero(r > 0)
                if len(used) > most:
                    used = used[np.argpartition(-r[used], most)[:most]]
                if len(used):
                    hot[layer] = np.sort(used)
        state.hot = hot

    @torch.inference_mode()
    def _load_digests(self, seq: SeqId) -> int:
        """`seq`'s digests from its snapshot into the arena, a layer at a time as they are read
        (`DigestStore.load_later`: its first step selects in a layer while the next ones' are still
        read); returns the blocks it covers (0: none, or one that does not match). A layer whose
        rows fail their checksum is rebuilt from its keys when it is first read (`_rebuild_layer`)."""
        record = self.sessions[seq]
        if self.digest_files is None:
            return 0
        d = self.digests
        full = tuple(self.blocks.full_layers.tolist())  # a version-1 snapshot's layers
        layout = Layout((*d.shape, 2, d.head_dim), d.dtype, d.part_tokens, d.layers, full)
        got = self.digest_files.read_later(record.name, layout, record.table.num_tokens // self.block_size)
        if got is None:
            return 0
        blocks, rows, layer = got
        d.load_later(seq, rows.shape[2], layer)
        return blocks

    @torch.inference_mode()
    def _rebuild_layer(self, seq: SeqId, layer: int) -> None:
        """One layer's digests of `seq`'s written blocks from their keys (its snapshot failed there)."""
        if seq in self.sessions and self.digests.has(seq) and self.sessions[seq].table.num_tokens:
            k = self.tiers.read_keys(seq, layer, 0)  # [Hkv, num_tokens, D]
            self.digests.update(seq, layer, 0, k.transpose(0, 1).to(self.device))

    def save_digests(self, seq: SeqId) -> int:
        """Snapshot `seq`'s digests of its full blocks (a shutdown's checkpoint) unless its snapshot
        covers them already; returns the bytes written. Raises OSError if the write fails."""
        full = self._unsaved_digests(seq)
        if not full:
            return 0
        assert self.digest_files is not None
        rows = self.digests.head(seq, full)
        d = self.digests
        return self.digest_files.write(self.sessions[seq].name, full, d.part_tokens, rows, d.layers)

    def snapshot_bytes(self) -> int:
        """The digest snapshots' bytes beside the archive's records, counted against
        `ssd_capacity_mb` (`TierManager.ssd_used`): those on disk, and for each session whose
        digests are on the device what its next snapshot would add (one is written when it is
        closed, when its digests are set aside, at a shutdown's checkpoint: an eighth of its KV
        by default, `digest_tokens`), so that write-behind leaves them room."""
        files, d = self.digest_files, self.digests
        if files is None:
            return 0
        total = files.disk_bytes()
        per_block = d.row_bytes * d.parts
        for seq, record in self.sessions.items():
            if d.has(seq) and record.selection.policy.keeps_digests:
                full = record.table.num_tokens // self.block_size
                total += max(0, full * per_block + DATA_ALIGN - files.disk_bytes(record.name))  # (its header)
        return total

    def save_digests_later(self, seq: SeqId) -> None:
        """`save_digests` with the write on a thread (`DigestFiles.write_later`): only the copy to
        the host is done here."""
        full = self._unsaved_digests(seq)
        if full:
            assert self.digest_files is not None
            rows = host_copy(self.digests.head(seq, full))
            self.digest_files.write_later(
                self.sessions[seq].name, full, self.digests.part_tokens, rows, self.digests.layers
            )

    def _unsaved_digests(self, seq: SeqId) -> int:
        """The full blocks whose digests `seq`'s snapshot would hold, if it lacks some (else 0)."""
        record = self.sessions[seq]
        full = record.table.num_tokens // self.block_size
        if self.digest_files is None or record.stale_digests or not self.digests.has(seq) or not full:
            return 0
        meta = self.digest_files.header(record.name)
        return 0 if meta is not None and meta.get("blocks") == full else full

    @torch.inference_mode()
    def _rebuild_digests(self, seq: SeqId, first_block: int = 0) -> None:
        """Digests of `seq`'s written blocks from `first_block` on, from their K wherever it is
        (those before it are loaded already)."""
        table = self.sessions[seq].table
        if not first_block:
            self.digests.drop(seq)
        start = first_block * self.block_size
        if table.num_tokens <= start:
            return
        for layer in self.digests.layers:
            k = self.tiers.read_keys(seq, layer, first_block)  # [Hkv, num_tokens - start, D]
            self.digests.update(seq, layer, start, k.transpose(0, 1).to(self.device))

    def check(self) -> None:
        """Every invariant of the bookkeeping and the copies (tests switch this on)."""
        assert set(self.sessions) == set(self.blocks.tables()), "a session without a table, or the reverse"
        self.tiers.check()

    def close(self) -> None:
        """Finish the archive writes in flight and release the archive (its folder stays)."""
        if self.digest_files is not None:
            self.digest_files.close()
        self.tiers.close()
        if self.tiers.archive is not None:
            self.tiers.archive.close()
        self.ddr.close()
