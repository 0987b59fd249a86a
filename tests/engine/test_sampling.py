"""Sampling parameters through the engine, and the sampler's distribution itself.

Seeded requests are reproducible (and independent of what else runs in the batch); top_k=1, a tiny
top_p and temperature 0 are greedy; stop strings, stop token ids, EOS ids from
generation_config.json and max_tokens end a generation with the right reason and text; bad
parameters raise InvalidRequest before anything changes. The presence and frequency penalties
equal OpenAI's formula written out by hand, count only the request's own tokens, and change a
greedy generation the way they should (a frequency penalty repeats less).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import EOS_ID, VOCAB_SIZE, make_engine, random_prompt, write_generation_config

from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams, make_generator, penalize, sample, sample_batch
from h3d.engine.session import FinishReason, GenerationDone, TokenDelta
from h3d.errors import InvalidRequest

MODEL = "llama_gqa4_tied"
PROMPT_TEXT = "Once upon a time there was a small model that"


@pytest.fixture(scope="module")
def engine(checkpoint: Callable[[str], Path]) -> Iterator[Engine]:
    yield make_engine(checkpoint(MODEL))


def run(engine: Engine, params: SamplingParams, prompt: str = PROMPT_TEXT) -> tuple[GenerationDone, list[TokenDelta]]:
    sid = engine.create_session()
    events = list(engine.generate(sid, prompt, params))
    engine.close_session(sid)
    done = events[-1]
    assert isinstance(done, GenerationDone)
    deltas = [e for e in events if isinstance(e, TokenDelta)]
    assert [d.token_id for d in deltas] == list(done.token_ids)
    assert "".join(d.text for d in deltas) == done.text, "the streamed text differs from the final text"
    return done, deltas


def greedy(engine: Engine, n: int = 32) -> GenerationDone:
    done, _ = run(engine, SamplingParams(max_tokens=n, ignore_eos=True))
    assert len(done.token_ids) == n
    return done


def test_same_seed_same_tokens_different_seed_different_tokens(engine: Engine) -> None:
    params = SamplingParams(max_tokens=32, temperature=1.0, seed=1234, ignore_eos=True)
    a, _ = run(engine, params)
    b, _ = run(engine, params)
    assert a.token_ids == b.token_ids
    c, _ = run(engine, SamplingParams(max_tokens=32, temperature=1.0, seed=1235, ignore_eos=True))
    assert c.token_ids != a.token_ids
    # Sampling really samples: at temperature 1 it does not follow the greedy path.
    assert a.token_ids != greedy(engine).token_ids
    filtered = SamplingParams(max_tokens=32, temperature=0.8, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    assert run(engine, filtered)[0].token_ids == run(engine, filtered)[0].token_ids


def test_seeded_request_does_not_depend_on_the_batch(engine: Engine) -> None:
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=99, ignore_eos=True)
    alone, _ = run(engine, params)
    sessions = [engine.create_session() for _ in range(3)]
    others = [
        SamplingParams(max_tokens=30, temperature=1.0, ignore_eos=True),  # unseeded
        params,
        SamplingParams(max_tokens=10, temperature=0.7, seed=5, ignore_eos=True),
    ]
    prompts = [random_prompt(57, VOCAB_SIZE, seed=1), None, random_prompt(140, VOCAB_SIZE, seed=2)]
    rids = []
    for sid, p, prompt in zip(sessions, others, prompts, strict=True):
        if prompt is None:
            rids.append(engine.submit(sid, text=PROMPT_TEXT, params=p))
        else:
            rids.append(engine.submit(sid, token_ids=prompt, params=p))
    done: dict[int, GenerationDone] = {}
    while engine.has_work:
        for event in engine.step():
            if isinstance(event, GenerationDone):
                done[event.request_id] = event
    assert done[rids[1]].token_ids == alone.token_ids
    for sid in sessions:
        engine.close_session(sid)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_tokens=32, temperature=1.5, top_k=1, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=1.0, top_p=1e-6, seed=4, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=0.0, top_p=0.5, top_k=7, seed=5, ignore_eos=True),
        SamplingParams(max_tokens=32, temperature=1e-4, seed=6, ignore_eos=True),
    ],
    ids=["top_k_1", "tiny_top_p", "temperature_0", "tiny_temperature"],
)
def test_degenerate_sampling_is_greedy(engine: Engine, params: SamplingParams) -> None:
    assert run(engine, params)[0].token_ids == greedy(engine).token_ids


def _stop_candidate(text: str) -> tuple[str, int]:
    """A 2-character ASCII alphanumeric substring of `text`, first occurring at index >= 4."""
    for i in range(len(text) - 2, 3, -1):
        s = text[i : i + 2]
        if s.isascii() and s.isalnum() and text.find(s) == i:
            return s, i
    pytest.fail(f"no usable stop string in {text!r}")


def test_stop_string_cuts_the_text(engine: Engine) -> None:
    full = greedy(engine, 48)
    stop, index = _stop_candidate(full.text)
    done, deltas = run(engine, SamplingParams(max_tokens=48, stop=(stop,), ignore_eos=True))
    assert done.finish_reason is FinishReason.STOP
    assert done.text == full.text[:index]
    assert stop not in done.text
    # Generation stopped at the token that completed the stop string.
    n = len(done.token_ids)
    assert done.token_ids == full.token_ids[:n]
    assert n < len(full.token_ids)
    assert stop in engine.tokenizer.decode(list(full.token_ids[:n]))
    assert stop not in engine.tokenizer.decode(list(full.token_ids[: n - 1]))
    # No delta ever showed a part of the stop string that was later cut.
    assert "".join(d.text for d in deltas) == full.text[:index]


def test_stop_string_that_never_occurs(engine: Engine) -> None:
    full = greedy(engine, 20)
    done, _ = run(engine, SamplingParams(max_tokens=20, stop=("\x00no such text\x00",), ignore_eos=True))
    assert done.finish_reason is FinishReason.LENGTH
    assert done.text == full.text and done.token_ids == full.token_ids


def test_stop_token_ids(engine: Engine) -> None:
    full = greedy(engine, 32)
    ids = list(full.token_ids)
    k = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    done, _ = run(engine, SamplingParams(max_tokens=32, stop_token_ids=(ids[k],), ignore_eos=True))
    assert done.finish_reason is FinishReason.STOP
    assert list(done.token_ids) == ids[: k + 1]


def test_eos_ids_from_generation_config(model_copy: Callable[[str], Path]) -> None:
    """generation_config.json's eos_token_id (a list) stops generation unless ignore_eos."""
    folder = model_copy(MODEL)
    plain = make_engine(folder)
    full = greedy(plain, 32)
    ids = list(full.token_ids)
    k = next(i for i in range(2, len(ids)) if ids[i] not in ids[:i])
    write_generation_config(folder, bos_token_id=0, eos_token_id=[EOS_ID, ids[k]])
    engine = make_engine(folder)
    assert engine.eos_ids == {EOS_ID, ids[k]}
    done, _ = run(engine, SamplingParams(max_tokens=32))
    assert done.finish_reason is FinishReason.STOP
    assert list(done.token_ids) == ids[: k + 1]
    ignored, _ = run(engine, SamplingParams(max_tokens=32, ignore_eos=True))
    assert ignored.finish_reason is FinishReason.LENGTH and list(ignored.token_ids) == ids


def test_max_tokens_finishes_with_length(engine: Engine) -> None:
    for n in (1, 5):
        done, deltas = run(engine, SamplingParams(max_tokens=n, ignore_eos=True))
        assert done.finish_reason is FinishReason.LENGTH
        assert len(done.token_ids) == len(deltas) == n


BAD_PARAMS = {
    "max_tokens_0": SamplingParams(max_tokens=0),
    "max_tokens_negative": SamplingParams(max_tokens=-3),
    "temperature_negative": SamplingParams(temperature=-0.1),
    "top_p_0": SamplingParams(top_p=0.0),
    "top_p_above_1": SamplingParams(top_p=1.5),
    "top_p_negative": SamplingParams(top_p=-1.0),
    "top_k_negative": SamplingParams(top_k=-1),
    "empty_stop": SamplingParams(stop=("",)),
    "one_empty_stop": SamplingParams(stop=("ok", "")),
    "presence_penalty_above_2": SamplingParams(presence_penalty=2.5),
    "frequency_penalty_below_-2": SamplingParams(frequency_penalty=-2.01),
}


@pytest.mark.parametrize("params", BAD_PARAMS.values(), ids=BAD_PARAMS.keys())
def test_invalid_params_raise_invalid_request(engine: Engine, params: SamplingParams) -> None:
    with pytest.raises(InvalidRequest):
        params.validate()
    with pytest.raises(InvalidRequest):
        engine.create_session(sampling=params)
    sid = engine.create_session()
    with pytest.raises(InvalidRequest):
        engine.submit(sid, text=PROMPT_TEXT, params=params)
    # Nothing changed: the session is empty and free for a valid request.
    assert engine.session(sid).tokens == []
    assert not engine.session(sid).busy
    done = engine.complete(sid, PROMPT_TEXT, SamplingParams(max_tokens=2))
    assert len(done.token_ids) >= 1
    engine.close_session(sid)


def test_with_sampling_validates(engine: Engine) -> None:
    assert engine.with_sampling(temperature=0.5).temperature == 0.5
    with pytest.raises(InvalidRequest):
        engine.with_sampling(top_p=2.0)


# ---- the sampler itself --------------------------------------------------------------------

PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
LOGITS = PROBS.log()


def _draw(params: SamplingParams, n: int = 4000, logits: torch.Tensor = LOGITS) -> Counter[int]:
    gen = make_generator(params, torch.device("cpu"))
    return Counter(sample(logits, params, gen) for _ in range(n))


def _assert_freqs(counts: Counter[int], want: dict[int, float], n: int = 4000) -> None:
    assert set(counts) == {i for i, p in want.items() if p > 0}, f"support {sorted(counts)} != {want}"
    for i, p in want.items():
        sigma = math.sqrt(p * (1 - p) / n)
        assert abs(counts[i] / n - p) <= 5 * sigma + 1e-9, f"token {i}: {counts[i] / n:.3f} vs {p:.3f}"


def test_sampler_distribution_matches_softmax() -> None:
    _assert_freqs(_draw(SamplingParams(temperature=1.0, seed=0)), dict(enumerate(PROBS.tolist())))
    # Temperature 0.5 squares the probabilities (renormalized).
    sq = PROBS**2 / (PROBS**2).sum()
    _assert_freqs(_draw(SamplingParams(temperature=0.5, seed=1)), dict(enumerate(sq.tolist())))


@pytest.mark.parametrize(
    ("top_k", "top_p", "support"),
    [(2, 1.0, [0, 1]), (3, 1.0, [0, 1, 2]), (0, 0.7, [0, 1]), (0, 0.85, [0, 1, 2]), (0, 0.4, [0]), (2, 0.9, [0, 1])],
)
def test_top_k_and_top_p_truncate_then_renormalize(top_k: int, top_p: float, support: list[int]) -> None:
    # Shuffle the vocabulary order so that the filters must sort, not rely on positions.
    perm = torch.tensor([2, 0, 3, 1])
    logits = torch.empty(4)
    logits[perm] = LOGITS
    counts = _draw(SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=2), logits=logits)
    kept = PROBS[support]
    want = {int(perm[i]): float(p) for i, p in zip(support, kept / kept.sum(), strict=True)}
    want.update({int(perm[i]): 0.0 for i in range(4) if i not in support})
    _assert_freqs(counts, want)


def test_sample_batch_mixes_greedy_and_sampled_rows() -> None:
    logits = torch.stack([LOGITS, LOGITS.flip(0), LOGITS])
    params = [SamplingParams(), SamplingParams(), SamplingParams(temperature=1.0, top_k=1, seed=0)]
    gens = [make_generator(p, torch.device("cpu")) for p in params]
    assert gens[0] is None and gens[2] is not None
    assert sample_batch(logits, params, gens) == [0, 3, 0]


# ---- presence and frequency penalties ------------------------------------------------------


def test_penalties_are_openais_formula() -> None:
    logits = torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0])
    outputs = [4, 4, 4, 1, 0, 4]
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    want = logits.clone()
    for token in set(outputs):  # logit[t] -= count[t] * frequency + (count[t] > 0) * presence
        want[token] -= outputs.count(token) * 0.25 + 0.5
    assert torch.equal(penalize(logits, params, outputs), want)
    assert penalize(logits, SamplingParams(), outputs) is logits  # no penalty: untouched
    assert penalize(logits, params, []) is logits
    negative = penalize(logits, SamplingParams(presence_penalty=-1.0), [0])
    assert negative[0] == 2.0 and torch.equal(negative[1:], logits[1:])  # a negative penalty favours repeats


def test_penalties_in_a_batch_apply_to_their_rows_only() -> None:
    logits = torch.tensor([[0.0, 1.0, 0.9], [0.0, 1.0, 0.9]])
    plain, penalized = SamplingParams(), SamplingParams(frequency_penalty=0.5)
    picked = sample_batch(logits, [plain, penalized], [None, None], [[1], [1]])
    assert picked == [1, 2]  # greedy: the penalized row's token 1 falls below token 2


def test_a_frequency_penalty_repeats_less(engine: Engine) -> None:
    def repeats(params: SamplingParams) -> int:
        done, _ = run(engine, params)
        ids = list(done.token_ids)
        return len(ids) - len(set(ids))

    plain = SamplingParams(max_tokens=48, ignore_eos=True)
    penalized = SamplingParams(max_tokens=48, ignore_eos=True, frequency_penalty=2.0, presence_penalty=2.0)
    assert repeats(penalized) < repeats(plain)
    # Only the request's own tokens count: the prompt's repeated tokens are not penalized.
    first, _ = run(engine, SamplingParams(max_tokens=1, frequency_penalty=2.0, presence_penalty=2.0))
    assert first.token_ids == greedy(engine, 1).token_ids
