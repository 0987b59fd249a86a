"""What a session's token log keeps beside its tokens, and how sessions are read back from it.

The token log (`h3d.store.tokenlog.TokenStore`, `Engine.journal`) is the truth of every session:
its tokens, its chat messages (`log_piece`: a message and its tokens in one record) and its
metadata (`session_meta`: owner, policy, pin, sampling, HBF state...). `restore_sessions` reopens
each logged session at start as it was left, its conversation replayed from its message records
(`replay_chat`). What is written here must be what is read back: a key added to one is read by
the other (a missing key reads as its default: logs written before it still restore).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict

import torch

from h3d.engine.chat import Conversation
from h3d.engine.sampling import SamplingParams
from h3d.engine.session import Session, SessionId
from h3d.hbf.policy import (
    POLICIES,
    SelectionState,
    anchors_to_meta,
    hot_to_meta,
    policy_named,
    state_from_meta,
    state_to_meta,
)
from h3d.kv.blocks import SeqId
from h3d.kv.cache import KVCache
from h3d.model.tokenizer import Tokenizer
from h3d.store.tokenlog import Restored, TokenStore


def session_meta(session: Session, kv: KVCache, anchors: bool = True, hot: bool = False) -> dict[str, object]:
    """The metadata `session`'s log keeps (JSON), its KV state asked of `kv`. A log's metadata
    records add up (each one's keys replace the earlier ones': `TokenStore`), so that `anchors`
    False leaves out the HBF anchors, which keep the value last written; `hot`: with the blocks
    its last steps read most, as last noted (`KVCache.note_hot`: a checkpoint, a close)."""
    return meta_of(session, kv.selection(session.seq), kv.pinned_until(session.seq), anchors, hot)


def meta_of(
    session: Session, state: SelectionState, pin: float | None, anchors: bool = True, hot: bool = False
) -> dict[str, object]:
    """`session_meta` from the session's HBF state and pin (a session the KV cache does not hold yet)."""
    sampling = asdict(session.sampling)
    sampling["stop"], sampling["stop_token_ids"] = list(sampling["stop"]), list(sampling["stop_token_ids"])
    return (
        {
            "policy": state.policy.name,
            "owner": session.owner,
            "closed": session.closed,
            "created_at": session.created_at,
            "last_used_at": session.last_used_at,
            "pinned_until": "forever" if pin == math.inf else pin,
            "chat": session.chat is not None,
            "sampling": sampling,
            "hbf": state_to_meta(state),
            "extra": session.extra,
        }
        | ({"hbf_anchors": anchors_to_meta(state)} if anchors else {})
        | ({"hbf_hot": hot_to_meta(state)} if hot else {})
    )


def log_piece(store: TokenStore, session_id: SessionId, ids: list[int], message: Mapping[str, object] | None) -> None:
    """Log a piece of `session_id`'s context: its tokens `ids`, with the chat message they render."""
    if message is None:
        store.append(session_id, ids)
    else:  # a chat message and its tokens in one record: never one without the other
        store.append_message(session_id, {**message, "n": len(ids)}, ids)


def replay_chat(tok: Tokenizer, messages: list[tuple[dict[str, object], int]], tokens: list[int]) -> Conversation:
    """A chat session's conversation from its log's message records (see `log_piece`)."""
    chat = Conversation()
    for message, at in messages:
        chat.close_turn(tok, tokens[:at])
        chat.tail = ""  # what closed the previous turn came with this record
        if "turn" in message:
            chat.begin(at + int(str(message.get("n", 0))))
        else:
            chat.messages.append({"role": str(message.get("role")), "content": str(message.get("content"))})
    return chat


def restore_sessions(
    store: TokenStore,
    kv: KVCache,
    tokenizer: Tokenizer,
    default_policy: str,
    seq_ids: Iterator[int],
    device: torch.device,
) -> Iterator[Session]:
    """Reopen every session of the token logs; adopt the KV their blocks have in the archive
    (read lazily); the tokens without it are prefilled again by the session's next request.
    Yields each session once its KV state is open in `kv` (`seq_ids`: the engine's counter)."""
    for r in store.load_all():
        yield restore_session(r, kv, tokenizer, default_policy, SeqId(next(seq_ids)), device)


def restore_session(
    r: Restored, kv: KVCache, tokenizer: Tokenizer, default_policy: str, seq: SeqId, device: torch.device
) -> Session:
    """One session as its log tells it (`r`), its KV state opened in `kv` as `seq`, adopting what
    the archive holds of it."""
    meta = r.meta
    saved = dict(meta.get("sampling", {}))
    saved["stop"] = tuple(saved.get("stop", ()))
    saved["stop_token_ids"] = tuple(saved.get("stop_token_ids", ()))
    sampling = SamplingParams(**saved)
    policy = POLICIES.get(str(meta.get("policy"))) or policy_named(default_policy)
    session = Session(
        id=SessionId(r.session_id),
        seq=seq,
        sampling=sampling,
        tokens=list(r.tokens),
        pieces=int(bool(r.tokens)),
        created_at=float(meta.get("created_at", time.time())),
        owner=str(meta.get("owner", "")),
        closed=bool(meta.get("closed", False)),
        extra=dict(meta.get("extra") or {}),
    )
    session.last_used_at = float(meta.get("last_used_at", session.created_at))
    if meta.get("chat"):
        session.chat = replay_chat(tokenizer, r.messages, session.tokens)
    kv.open(session.seq, session.id, policy)
    pin = meta.get("pinned_until")
    kv.pin(session.seq, math.inf if pin == "forever" else float(pin) if pin is not None else None)
    selection = kv.selection(session.seq)  # (logs written before "hbf_anchors" keep them in "hbf")
    hbf = {**(meta.get("hbf") or {}), **(meta.get("hbf_anchors") or {}), **(meta.get("hbf_hot") or {})}
    state_from_meta(selection, hbf, device)
    session.anchors_logged = selection.anchors_version
    kv.adopt(session.seq, max(len(session.tokens) - 1, 0))  # the last token: fed by the next request
    return session
