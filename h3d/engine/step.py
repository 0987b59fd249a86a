"""A step as values: what the scheduler chose, what the planner made of it, what the forward did.

    out = engine.schedule()        SchedulerOutput: the chunks of this step and their requests
    plan = runner.plan(out.chunks) StepPlan: allocations, the path, each chunk's selection
    report = runner.execute(plan)  StepReport: logits, the reads as they were made, the picks
    runner.commit(report)          promotion, read counters, the window, DDR spill
    engine.commit(out, report)     sampling, stop rules, events

(vLLM v1's engine core: `schedule()`, `execute_model()`, `update_from_output()`.) The plan is made
once, by one planner (`ModelRunner.plan`); the three paths differ only in where the plan's
selection runs: the host (`Path.HOST`: each layer planned as it runs, archived blocks staged between
layers), the device (`Path.DEVICE`: every layer's locations uploaded once, selections and lists
on the device) or a captured graph (`Path.GRAPH`: the same on static buffers, replayed). Nothing
in the forward counts or promotes: the report carries the reads and the picks, and the commit
counts them once.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from h3d.kv.blocks import SeqId

if TYPE_CHECKING:
    from h3d.engine.graphs import GraphKey


@dataclass(frozen=True, slots=True)
class Chunk:
    """`token_ids` of `seq` to feed now, the first at position `start` (= its cached length).
    `final`: the chunk ends what the session has been given so far (its prompt's end: HBF's
    prefill probes read its last queries, `h3d.hbf.policy.probe_anchors`)."""

    seq: SeqId
    token_ids: tuple[int, ...]
    start: int
    want_logits: bool
    final: bool = True


@dataclass(frozen=True, slots=True)
class SchedulerOutput:
    """The engine's choice for one step: the chunks, and the request each belongs to."""

    chunks: tuple[Chunk, ...]
    requests: tuple[Any, ...]  # h3d.engine.session.Request, one per chunk
    # A chunk for the layer-by-layer path, to run in pieces beside the batch (h3d.engine.prefill),
    # and its request.
    long: tuple[Any, Chunk] | None = None


class Path(enum.Enum):
    """Where a step's plan is carried out (see the module docstring)."""

    HOST = "host"
    DEVICE = "device"
    GRAPH = "graph"


@dataclass(slots=True)
class StepPlan:
    """What a step does, decided before its forward (`ModelRunner.plan`). The chunks' blocks are
    allocated (`rows`); nothing moves during the step but the archived blocks the host path
    stages, layer by layer, and blocks written this step never move (`protect`)."""

    chunks: tuple[Chunk, ...]
    rows: np.ndarray  # [L, N] the new tokens' cache rows: >= 0 HBM pool row, else -(DDR row + 1)
    protect: dict[SeqId, int]  # seq -> its first block written this step
    path: Path
    selects: tuple[bool, ...]  # per chunk: a decode token whose policy selects blocks (HBF)
    probes: tuple[bool, ...]  # per chunk: a prompt's end, probed for HBF anchors
    staging: bool  # some block of the batch is in the archive only (the host path stages it)
    locations: np.ndarray | None = None  # [L, B, W] every layer's block locations (`Path.DEVICE`)
    graph: GraphKey | None = None  # the captured step it replays (`Path.GRAPH`)

    @property
    def seqs(self) -> list[SeqId]:
        return [c.seq for c in self.chunks]

    @property
    def query_lens(self) -> tuple[int, ...]:
        return tuple(len(c.token_ids) for c in self.chunks)

    @property
    def decode(self) -> bool:
        """Every chunk is one decode token."""
        return all(len(c.token_ids) == 1 for c in self.chunks)


@dataclass(frozen=True, slots=True)
class Reads:
    """Blocks one session's attention read in a step where it read whole tables (all of it, or
    an HBF session's dense layers): `total`, of which `below` not in HBM, of which `staged` came
    from the archive during the step (the rest from DDR)."""

    seq: SeqId
    total: int
    below: int
    staged: int = 0


@dataclass(slots=True)
class StepReport:
    """What a step's forward did (`ModelRunner.execute`), for its commit."""

    plan: StepPlan
    logits: torch.Tensor  # fp32 [M, vocab]: each chunk's last token where `want_logits` (or every token)
    reads: list[Reads] = field(default_factory=list)
    # HBF selections' reads as (layer, block) keys, one per reading KV head
    # (`layer * BlockTable.capacity + block`), against the tables as they are now: counted and
    # promoted by the commit. A replayed graph's picks reach the host a step later: the next
    # step's report carries them (`earlier`).
    picks: dict[SeqId, np.ndarray] = field(default_factory=dict)
    replay: Any = None  # the captured step it replayed (`Path.GRAPH`), whose picks the commit reads
    earlier: Any = None  # an earlier step's picks this commit applies (`DecodeGraphs`' pending copy)


@dataclass(frozen=True, slots=True)
class StepTiming:
    """Where the host's time of one `Engine.step` went (the daemon logs a slow one): the batch's
    chunks and their plan, forward and commit (`batch_s`; on a GPU they include waiting for the
    device, as sampling reads the logits), and the pieces of a long prompt run beside it."""

    chunks: int = 0
    batch_s: float = 0.0
    pieces: int = 0
    long_s: float = 0.0
    host: HostTimes | None = None  # of the batch's forward, where the host planned it layer by layer


@dataclass(slots=True)
class HostTimes:
    """Inside a forward planned layer by layer by the host (`Path.HOST`: a resumed session's first
    steps stage what they select from the archive), summed over its layers: waiting for the
    digests (a resumed session's snapshot still being read), selecting (on a GPU: waiting for the
    layer's queries), and staging blocks from the archive (waiting for read-ahead pieces in flight
    included), with the blocks staged."""

    digests_s: float = 0.0
    select_s: float = 0.0
    stage_s: float = 0.0
    staged_blocks: int = 0
    layers: int = 0

    def fields(self) -> dict[str, float]:
        return {"digests_ms": round(self.digests_s * 1e3, 1), "select_ms": round(self.select_s * 1e3, 1),
                "stage_ms": round(self.stage_s * 1e3, 1), "staged_blocks": self.staged_blocks}  # fmt: skip
