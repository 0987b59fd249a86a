"""Sessions and the requests that run on them (engine-internal state, owned by `Engine`).

A session's context is the concatenation of the token lists of what it was given, each piece
tokenized on its own; the token list is the truth and the KV cache a rebuildable copy of its
first `cached` tokens.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, NewType

import torch

from h3d.engine.chat import Conversation
from h3d.engine.detok import IncrementalDetokenizer
from h3d.engine.sampling import SamplingParams
from h3d.errors import H3Error
from h3d.kv.blocks import SeqId

if TYPE_CHECKING:
    from h3d.hbf.policy import SelectionState

SessionId = NewType("SessionId", str)
RequestId = NewType("RequestId", int)


class FinishReason(enum.Enum):
    STOP = "stop"  # an EOS id, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or max_context_tokens
    CANCELLED = "cancelled"


@dataclass(slots=True)
class Session:
    """A session as the engine keeps it: its tokens (the truth: KV is a copy of its first
    `cached` tokens), sampling defaults, owner and chat state. Its KV state (policy, pin,
    residency) is the KV cache's, asked by `seq` (`h3d.kv.cache.KVCache`)."""

    id: SessionId
    seq: SeqId
    sampling: SamplingParams
    tokens: list[int] = field(default_factory=list)
    pieces: int = 0
    created_at: float = field(default_factory=time.time)
    last_used_at: float = field(default_factory=time.time)
    busy: bool = False
    leaving: bool = False  # being handed over to another daemon (`Engine.begin_hand_over`): busy until it is gone
    owner: str = ""  # who may use it (the daemon's token hash); kept in the token log
    closed: bool = False  # closed (not purged): its KV is in the archive only; its next request reopens it
    chat: Conversation | None = None  # a chat session: what is appended are messages (h3d.engine.chat)
    # What a front end keeps with the session, in its log (JSON values): the OpenAI API's stored
    # responses (h3d.daemon.http.responses). The engine only keeps it.
    extra: dict[str, Any] = field(default_factory=dict)
    anchors_logged: int = -1  # the HBF anchors' version its log holds (written again only once they change)


@dataclass(frozen=True, slots=True)
class NewSession:
    """A session `Engine.prepare_session` made (off the engine's thread: its token log is already
    durable) that `Engine.add_session` takes in: its HBF state, and its log's size in bytes."""

    session: Session
    selection: SelectionState
    log_bytes: int


@dataclass(frozen=True, slots=True)
class TokenDelta:
    """One generated token and the text it completed (may be empty: held back or partial)."""

    request_id: RequestId
    session_id: SessionId
    token_id: int
    text: str


@dataclass(frozen=True, slots=True)
class GenerationDone:
    """The end of a generation: what was produced, why it stopped, and its timings."""

    request_id: RequestId
    session_id: SessionId
    text: str
    token_ids: tuple[int, ...]
    finish_reason: FinishReason
    prompt_tokens: int
    ttft_s: float
    decode_tokens_per_s: float


@dataclass(frozen=True, slots=True)
class PrefillProgress:
    request_id: RequestId
    session_id: SessionId
    done: int
    total: int


@dataclass(frozen=True, slots=True)
class AppendDone:
    request_id: RequestId
    session_id: SessionId
    tokens_added: int
    prefill_s: float


@dataclass(frozen=True, slots=True)
class RequestFailed:
    """A request ended by an expected error (no room in the tiers, an unreadable archive record):
    the session keeps its context; its KV is rebuilt by the next request."""

    request_id: RequestId
    session_id: SessionId
    error: H3Error


Event = TokenDelta | GenerationDone | PrefillProgress | AppendDone | RequestFailed


@dataclass(slots=True)
class Request:
    """An append (prefill only) or a generation in flight on one session."""

    id: RequestId
    session: Session
    generate: bool
    params: SamplingParams
    generator: torch.Generator | None
    detok: IncrementalDetokenizer | None
    tokens_added: int
    prefill_total: int
    submitted_at: float = field(default_factory=time.perf_counter)
    first_token_at: float | None = None
    output_ids: list[int] = field(default_factory=list)
    emitted_chars: int = 0
    finish_reason: FinishReason | None = None
    cancelled: bool = False
