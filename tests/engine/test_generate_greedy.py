"""Greedy generation of h3d equals transformers' `generate(do_sample=False)` token for token.

Two fp32 implementations agree to ~1e-5 on each logit, so their argmax can legitimately differ
where the reference's two best logits are closer than that. Tokens are therefore compared up to the
first step whose top-2 margin (from `generate`'s raw `output_logits`) is below 1e-3, and each test
requires that at least 16 steps were compared.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SPECS, STATIC_ROPE, assert_greedy_match, make_engine, random_prompt, top2_margins

from h3d.engine.sampling import SamplingParams
from h3d.engine.session import FinishReason, GenerationDone, TokenDelta

NEW_TOKENS = 64


def hf_greedy(model: Any, prompt: list[int], n: int = NEW_TOKENS) -> tuple[list[int], list[float]]:
    """transformers' greedy continuation of `prompt` (EOS disabled) and each step's top-2 margin."""
    config = copy.deepcopy(model.generation_config)
    config.eos_token_id = None  # never stop early: h3d runs with ignore_eos
    config.pad_token_id = 2
    config.do_sample = False
    config.max_new_tokens = n
    config.output_logits = True
    config.return_dict_in_generate = True
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), generation_config=config)
    tokens = out.sequences[0, len(prompt) :].tolist()
    assert len(tokens) == n, "transformers stopped early"
    margins = top2_margins(torch.cat(out.logits, dim=0))
    # The raw logits' argmax is what greedy search picks (no processor is active).
    assert torch.cat(out.logits).argmax(-1).tolist() == tokens
    return tokens, margins


def h3d_greedy(engine: Any, prompt: list[int], n: int = NEW_TOKENS) -> GenerationDone:
    sid = engine.create_session()
    events = list(engine.generate(sid, token_ids=prompt, params=SamplingParams(max_tokens=n, ignore_eos=True)))
    done = events[-1]
    assert isinstance(done, GenerationDone)
    deltas = [e for e in events[:-1] if isinstance(e, TokenDelta)]
    assert [d.token_id for d in deltas] == list(done.token_ids)
    assert done.finish_reason is FinishReason.LENGTH
    assert len(done.token_ids) == n
    return done


@pytest.mark.parametrize("name", list(SPECS))
def test_greedy_matches_transformers(
    name: str, checkpoint: Callable[[str], Path], hf_model: Callable[[str], Any]
) -> None:
    # 100 prompt tokens + 64 new ones: the dynamic-RoPE model (max_position_embeddings 128) is run
    # past its scaling threshold while decoding.
    prompt = random_prompt(100, hf_model(name).config.vocab_size, seed=7)
    want, margins = hf_greedy(hf_model(name), prompt)
    engine = make_engine(checkpoint(name), max_context_tokens=1024)
    done = h3d_greedy(engine, prompt)
    assert_greedy_match(done.token_ids, want, margins)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", [n for n in ("llama_gqa4_tied", "qwen2_mha_tied", "llama3_rope") if n in STATIC_ROPE])
def test_greedy_with_chunked_prefill_matches_transformers(
    name: str, block_size: int, checkpoint: Callable[[str], Path], hf_model: Callable[[str], Any]
) -> None:
    """A 150-token prompt prefilled 16 tokens per step still decodes as transformers does."""
    prompt = random_prompt(150, hf_model(name).config.vocab_size, seed=11)
    want, margins = hf_greedy(hf_model(name), prompt)
    engine = make_engine(checkpoint(name), block_size=block_size, prefill_chunk_tokens=16)
    done = h3d_greedy(engine, prompt)
    assert_greedy_match(done.token_ids, want, margins)


def test_greedy_from_text_prompt_matches_transformers(
    checkpoint: Callable[[str], Path], hf_model: Callable[[str], Any]
) -> None:
    """The text path: h3d's tokenization (BOS added by the post-processor) feeds what transformers' does."""
    from transformers import AutoTokenizer

    name = "qwen2_gqa4_untied"
    text = "Paged attention keeps the cache in blocks; a table per sequence says where each block lives."
    hf_tok = AutoTokenizer.from_pretrained(checkpoint(name))
    prompt = hf_tok(text).input_ids
    assert prompt[0] == hf_tok.bos_token_id
    want, margins = hf_greedy(hf_model(name), prompt)
    engine = make_engine(checkpoint(name))
    sid = engine.create_session()
    done = engine.complete(sid, text, SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True))
    assert engine.session(sid).tokens[: len(prompt)] == prompt
    assert done.prompt_tokens == len(prompt)
    assert_greedy_match(done.token_ids, want, margins)
    assert done.text == engine.tokenizer.decode(list(done.token_ids))
