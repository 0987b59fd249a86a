"""The end of a generation: its stop rules, the text it shows, and its summary.

A generation stops at an EOS id (unless `ignore_eos`), a stop token id or a stop string
(`FinishReason.STOP`), or at `max_tokens` / `max_context_tokens` (`FinishReason.LENGTH`). While it
runs, the text that could be the start of a stop string is held back (what was shown is never
taken back); its final text is cut before the first stop string it contains.
`generation_done` sums it up once it has ended. Plain functions over a `Request` (the engine calls
them after each token it accepts and when it ends the request).
"""

from __future__ import annotations

import time

from h3d.engine.session import FinishReason, GenerationDone, Request


def stop_reason(req: Request, token: int, eos_ids: frozenset[int], max_context: int) -> FinishReason | None:
    """Why `req` stops at its new `token` (already in its output and its session), if it does."""
    p = req.params
    if (token in eos_ids and not p.ignore_eos) or token in p.stop_token_ids:
        return FinishReason.STOP
    if p.stop and any(s in req.detok.text for s in p.stop if req.detok is not None):
        return FinishReason.STOP
    if len(req.output_ids) >= p.max_tokens or len(req.session.tokens) >= max_context:
        return FinishReason.LENGTH
    return None


def visible_text(req: Request, reason: FinishReason | None) -> str:
    """The text `req` may have shown so far (`reason`: why it stops now, if it does)."""
    assert req.detok is not None
    if reason is None:
        # Hold back what could be the start of a stop string.
        text = req.detok.text
        hold = max((len(s) - 1 for s in req.params.stop), default=0)
        return text[: max(len(text) - hold, req.emitted_chars)]
    return final_text(req)


def final_text(req: Request) -> str:
    """The whole text of `req`'s generation, cut before its first stop string."""
    assert req.detok is not None
    req.detok.flush()
    text = req.detok.text
    cuts = [text.find(s) for s in req.params.stop if s in text]
    return text[: min(cuts)] if cuts else text


def generation_done(req: Request, reason: FinishReason) -> GenerationDone:
    """The summary of `req`'s generation, which has just ended for `reason`."""
    start = req.first_token_at or time.perf_counter()
    decode_s = time.perf_counter() - start
    n = len(req.output_ids)
    return GenerationDone(
        request_id=req.id,
        session_id=req.session.id,
        text=final_text(req) if req.detok is not None else "",
        token_ids=tuple(req.output_ids),
        finish_reason=reason,
        prompt_tokens=len(req.session.tokens) - n,
        ttft_s=start - req.submitted_at,
        decode_tokens_per_s=(n - 1) / decode_s if n > 1 and decode_s > 0 else 0.0,
    )
