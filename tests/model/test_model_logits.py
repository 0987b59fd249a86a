"""Teacher-forced logits of h3d equal transformers' on the same checkpoint (fp32, max |Δ| <= 1e-4).

Every tiny checkpoint (MHA and GQA, tied and untied heads, Llama / Qwen2 / Qwen3 / Mistral, default,
llama3, linear and dynamic RoPE) is fed a 300-token prompt in one chunk, in seven chunks of uneven
sizes, and as a prefill followed by 50 one-token decode steps, with blocks of 16 and 32 tokens; the
logits of every fed token are compared with `model(input_ids).logits`.

Dynamic NTK RoPE depends on the sequence length at the time a token is fed, so its chunked
reference is transformers run chunk by chunk through its own cache (which is what its `generate`
does); a check below makes sure that this reference really differs from the one-forward one, so the
dynamic case cannot pass by accident.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import SPECS, hf_logits, make_engine, random_prompt, runner_logits, top2_margins

from h3d.errors import ModelLoadError
from h3d.kv.attention import reference_attention
from h3d.kv.blocks import SeqId
from h3d.model.config import load_model_config, parse_model_config
from h3d.model.rope import RotaryEmbedding

TOL = 1e-4
PROMPT_LEN = 300
CHUNKINGS: dict[str, list[int]] = {
    "one_chunk": [PROMPT_LEN],
    "seven_chunks": [1, 45, 7, 100, 1, 96, 50],
    "decode_tail": [250] + [1] * 50,
}
assert all(sum(c) == PROMPT_LEN for c in CHUNKINGS.values())


@pytest.fixture(scope="session")
def reference(hf_model: Callable[[str], Any]) -> Callable[[str, str], torch.Tensor]:
    """reference(name, chunking) -> transformers' logits [300, V] for the test prompt, cached."""
    cache: dict[tuple[str, str], torch.Tensor] = {}

    def get(name: str, chunking: str) -> torch.Tensor:
        dynamic = SPECS[name].rope.get("rope_type") == "dynamic"
        key = (name, chunking if dynamic else "one_chunk")
        if key not in cache:
            ids = random_prompt(PROMPT_LEN, hf_model(name).config.vocab_size, seed=123)
            sizes = CHUNKINGS[key[1]] if dynamic and key[1] != "one_chunk" else None
            cache[key] = hf_logits(hf_model(name), ids, sizes)
        return cache[key]

    return get


@pytest.mark.parametrize("chunking", list(CHUNKINGS))
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("name", list(SPECS))
def test_teacher_forced_logits_match_transformers(
    name: str, block_size: int, chunking: str, checkpoint: Callable[[str], Path], reference: Callable[..., torch.Tensor]
) -> None:
    engine = make_engine(checkpoint(name), block_size=block_size, max_context_tokens=1024)
    ids = random_prompt(PROMPT_LEN, engine.model.config.vocab_size, seed=123)
    got = runner_logits(engine, 1, ids, CHUNKINGS[chunking])
    want = reference(name, chunking)
    assert got.shape == want.shape == (PROMPT_LEN, engine.model.config.vocab_size)
    assert torch.isfinite(got).all()
    delta = (got - want).abs().max().item()
    assert delta <= TOL, f"{name}: max |Δ logits| = {delta:.3g} > {TOL}"
    # The comparison means something only if the logits are not flat.
    assert want.std().item() > 0.5
    assert engine.runner.cached_tokens(1) == PROMPT_LEN


@pytest.mark.parametrize("one_launch_writes", [False, True])
@pytest.mark.parametrize("name", list(SPECS))
def test_a_long_chunk_in_slices_matches_transformers(
    name: str, one_launch_writes: bool, checkpoint: Callable[[str], Path], reference: Callable[..., torch.Tensor]
) -> None:
    """The whole prompt in one chunk, run layer by layer in slices of 32 tokens
    (`DecoderLayer.forward_rows`: attention once over the chunk's own K/V, `causal_attention`),
    with most blocks placed in DDR; and with K/V written in one launch as on CUDA (`paged_write`)."""
    engine = make_engine(checkpoint(name), max_context_tokens=1024)
    slot = engine.runner.hbm.slot_bytes * engine.model.config.num_layers
    engine = make_engine(checkpoint(name), max_context_tokens=1024, hbm_mb=6 * slot / 2**20, policy="exact")
    assert engine.runner.blocks.slots_per_layer == 6  # 6 of the prompt's 19 blocks in HBM (equal regions)
    engine.model.rows = 32
    engine.runner.plan_on_device = one_launch_writes
    ids = random_prompt(PROMPT_LEN, engine.model.config.vocab_size, seed=123)
    got = runner_logits(engine, 1, ids, [PROMPT_LEN])
    delta = (got - reference(name, "one_chunk")).abs().max().item()
    assert delta <= TOL, f"{name}: max |Δ logits| = {delta:.3g} > {TOL}"
    assert engine.kv.residency(SeqId(1)).ddr > 0  # blocks were written to DDR


def test_dynamic_rope_reference_depends_on_chunking(reference: Callable[..., torch.Tensor]) -> None:
    """Past max_position_embeddings, dynamic NTK makes chunked and one-forward logits differ."""
    one = reference("dynamic_rope", "one_chunk")
    chunked = reference("dynamic_rope", "seven_chunks")
    assert SPECS["dynamic_rope"].max_pos < PROMPT_LEN
    # One forward rotates every token with the base for 300 tokens; chunk by chunk, early tokens
    # were rotated with the bases of shorter lengths (unscaled below 128).
    assert (one - chunked).abs().max().item() > 100 * TOL


def test_rope_scaling_configs_are_parsed_and_matter(checkpoint: Callable[[str], Path]) -> None:
    """Both config formats (transformers 5 rope_parameters, 4.x rope_scaling) reach the rotary tables."""
    base = RotaryEmbedding(load_model_config(checkpoint("llama_mha_untied")).rope, 16, 1024, torch.device("cpu"))
    llama3_cfg = load_model_config(checkpoint("llama3_rope"))
    assert llama3_cfg.rope.rope_type == "llama3"
    assert llama3_cfg.rope.original_max_position_embeddings == 64
    assert (llama3_cfg.rope.factor, llama3_cfg.rope.low_freq_factor, llama3_cfg.rope.high_freq_factor) == (8, 1, 4)
    llama3 = RotaryEmbedding(llama3_cfg.rope, 16, 1024, torch.device("cpu"))
    # head_dim 16, theta 1e4: wavelengths 2π·10^(i/2); original context 64 -> high band < 16, low band > 64.
    wavelen = 2 * math.pi / base.inv_freq
    high = wavelen < 16
    low = wavelen > 64
    medium = ~high & ~low
    assert high.any() and low.any() and medium.any()
    torch.testing.assert_close(llama3.inv_freq[high], base.inv_freq[high])
    torch.testing.assert_close(llama3.inv_freq[low], base.inv_freq[low] / 8)
    assert (
        (llama3.inv_freq[medium] < base.inv_freq[medium]) & (llama3.inv_freq[medium] > base.inv_freq[medium] / 8)
    ).all()

    linear_cfg = load_model_config(checkpoint("linear_rope"))
    assert (linear_cfg.rope.rope_type, linear_cfg.rope.factor) == ("linear", 4.0)
    linear = RotaryEmbedding(linear_cfg.rope, 16, 1024, torch.device("cpu"))
    torch.testing.assert_close(linear.inv_freq, base.inv_freq / 4)
    dynamic_cfg = load_model_config(checkpoint("dynamic_rope"))
    assert (dynamic_cfg.rope.rope_type, dynamic_cfg.rope.factor) == ("dynamic", 2.0)

    # YaRN: the fastest frequencies kept, the slowest divided by the factor, a ramp between; cos and
    # sin scaled by 0.1 ln(factor) + 1 (the logits tests check the whole against transformers).
    yarn_cfg = load_model_config(checkpoint("qwen3_yarn"))
    assert (yarn_cfg.rope.rope_type, yarn_cfg.rope.factor, yarn_cfg.rope.original_max_position_embeddings) == (
        "yarn",
        4.0,
        64,
    )
    yarn = RotaryEmbedding(yarn_cfg.rope, 16, 1024, torch.device("cpu"))
    torch.testing.assert_close(yarn.inv_freq[0], base.inv_freq[0])
    torch.testing.assert_close(yarn.inv_freq[-1], base.inv_freq[-1] / 4)
    ramp = (yarn.inv_freq < base.inv_freq) & (yarn.inv_freq > base.inv_freq / 4)
    assert ramp.any()
    assert yarn.attention_scaling == pytest.approx(0.1 * math.log(4.0) + 1.0)


def test_legacy_and_current_rope_formats_parse_the_same() -> None:
    common = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": 1024,
    }
    llama3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
    v4 = parse_model_config({**common, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **llama3}})
    v4_type = parse_model_config({**common, "rope_theta": 5e5, "rope_scaling": {"type": "llama3", **llama3}})
    v5 = parse_model_config({**common, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **llama3}})
    assert v4.rope == v4_type.rope == v5.rope
    assert v5.rope.theta == 5e5 and v5.rope.rope_type == "llama3"
    plain = parse_model_config(common)
    assert plain.rope.rope_type == "default" and plain.rope.theta == 10000.0
    assert plain.num_kv_heads == 4 and plain.head_dim == 16


@pytest.mark.parametrize(
    ("name", "layers"), [("mistral_window", (0, 1)), ("qwen2_window_layers", (1, 2)), ("gemma3_window", (0, 1))]
)
def test_sliding_windows_are_read_from_the_config_and_change_the_logits(
    name: str,
    layers: tuple[int, ...],
    checkpoint: Callable[[str], Path],
    hf_model: Callable[[str], Any],
    tmp_path: Path,
) -> None:
    """The sliding layers and their window as transformers decides them; and the window matters to
    the logits compared with transformers' (without it, transformers' own differ), so the
    teacher-forced tests above cannot pass by ignoring it."""
    import json
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = load_model_config(checkpoint(name))
    assert cfg.sliding_layers == layers and cfg.sliding_window == SPECS[name].window
    # A window longer than the context: the same layers (and RoPEs), nothing left to limit.
    raw = json.loads((checkpoint(name) / "config.json").read_text())
    unwindowed = parse_model_config({**raw, "sliding_window": 4096})
    assert unwindowed.sliding_layers == () and unwindowed.windows == (None,) * cfg.num_layers
    assert unwindowed.sliding_typed == cfg.sliding_typed == layers
    ids = random_prompt(PROMPT_LEN, 512, seed=123)
    windowed = hf_logits(hf_model(name), ids)
    config = AutoConfig.from_pretrained(checkpoint(name))
    config.sliding_window = 4096
    full = AutoModelForCausalLM.from_pretrained(
        checkpoint(name), config=config, dtype=torch.float32, attn_implementation="eager"
    )
    unlimited = hf_logits(full, ids)
    assert (unlimited - windowed).abs().max().item() > 1e-2
    # h3d on the same folder with that window: transformers' logits too (the layers keep their type,
    # so Gemma's sliding layers keep their RoPE).
    folder = tmp_path / name
    shutil.copytree(checkpoint(name), folder)
    (folder / "config.json").write_text(json.dumps({**raw, "sliding_window": 4096}))
    got = runner_logits(make_engine(folder, max_context_tokens=1024), 1, ids, CHUNKINGS["decode_tail"])
    assert (got - unlimited).abs().max().item() <= TOL


def test_gemma3_fields_are_read_from_the_config(checkpoint: Callable[[str], Path]) -> None:
    """What sets Gemma 3 apart, as parsed from the tiny checkpoint transformers wrote; and a sparse
    config in the hub's transformers-4 form (a multimodal checkpoint's `text_config`, a global RoPE
    scaling, `rope_local_base_freq`, `sliding_window_pattern`) with transformers' defaults."""
    cfg = load_model_config(checkpoint("gemma3_window"))
    assert (cfg.architecture, cfg.qk_norm, cfg.norm_offset, cfg.sandwich_norms, cfg.activation) == (
        "gemma3",
        True,
        True,
        True,
        "gelu_tanh",
    )
    assert cfg.embed_scale == 8.0 and cfg.attn_scale == 24**-0.5 and cfg.final_softcap == 30.0
    assert cfg.rope.theta == 1e6 and cfg.rope_local is not None and cfg.rope_local.theta == 1e4
    assert cfg.sliding_layers == (0, 1) and cfg.windows == (24, 24, None)
    hub = {
        "architectures": ["Gemma3ForConditionalGeneration"],
        "model_type": "gemma3",
        "eos_token_id": [1, 106],
        "text_config": {
            "model_type": "gemma3_text",
            "hidden_size": 2560,
            "intermediate_size": 10240,
            "num_hidden_layers": 34,
            "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
            "sliding_window": 1024,
        },
        "vision_config": {"model_type": "siglip_vision_model"},
    }
    cfg = parse_model_config(hub)
    assert (cfg.num_layers, cfg.head_dim, cfg.num_heads, cfg.num_kv_heads, cfg.vocab_size) == (34, 256, 8, 4, 262208)
    assert cfg.sliding_layers == tuple(i for i in range(34) if (i + 1) % 6) and cfg.sliding_window == 1024
    assert (cfg.rope.rope_type, cfg.rope.factor, cfg.rope.theta) == ("linear", 8.0, 1e6)
    assert cfg.rope_local is not None and (cfg.rope_local.rope_type, cfg.rope_local.theta) == ("default", 1e4)
    assert cfg.eos_token_ids == (1, 106) and cfg.attn_scale == 256**-0.5 and cfg.tie_word_embeddings
    with pytest.raises(ModelLoadError, match="attn_logit_softcapping"):
        parse_model_config({**hub, "text_config": {**hub["text_config"], "attn_logit_softcapping": 50.0}})


def test_a_gemma3_multimodal_checkpoint_serves_its_text_model(tmp_path: Path, tokenizer_dir: Path) -> None:
    """A Gemma3ForConditionalGeneration folder (a vision tower beside the text model, the text
    weights under `language_model.`): h3d loads the text model alone and its logits equal
    transformers' multimodal model's on text."""
    import shutil

    import transformers as tf

    text = tf.Gemma3TextConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, sliding_window=24, max_position_embeddings=1024, query_pre_attn_scalar=24,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], bos_token_id=0, eos_token_id=1,
        pad_token_id=2,
    )  # fmt: skip
    vision = tf.SiglipVisionConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    config = tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=4, image_token_index=5, boi_token_index=6,
        eoi_token_index=7,
    )  # fmt: skip
    torch.manual_seed(15)
    model = tf.Gemma3ForConditionalGeneration(config).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(0.1 * torch.randn_like(p))
            elif name.endswith("embed_tokens.weight"):
                p.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, tmp_path / name)
    (tmp_path / "generation_config.json").unlink(missing_ok=True)
    ids = random_prompt(PROMPT_LEN, 512, seed=123)
    want = hf_logits(model.eval(), ids)
    engine = make_engine(tmp_path, max_context_tokens=1024)
    got = runner_logits(engine, 1, ids, CHUNKINGS["decode_tail"])
    assert want.std().item() > 0.5
    assert (got - want).abs().max().item() <= TOL


def test_qwen3_configs_parse_and_what_h3d_cannot_run_is_refused() -> None:
    """Qwen3: QK-norm on, no q/k/v bias unless `attention_bias`; Qwen's sliding layers from
    `max_window_layers` on; layer types h3d does not run, or sliding layers without a window, are
    refused with what is wrong named, never run as full attention."""
    qwen3 = {
        "architectures": ["Qwen3ForCausalLM"],
        "vocab_size": 512,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "layer_types": ["full_attention", "full_attention"],
        "use_sliding_window": False,
    }
    cfg = parse_model_config(qwen3)
    assert (cfg.architecture, cfg.qk_norm, cfg.qkv_bias, cfg.o_bias, cfg.head_dim) == ("qwen3", True, False, False, 16)
    assert parse_model_config({**qwen3, "attention_bias": True}).qkv_bias
    assert not parse_model_config({**qwen3, "architectures": ["Qwen2ForCausalLM"]}).qk_norm
    with pytest.raises(ModelLoadError, match="layer types chunked_attention are not supported"):
        parse_model_config({**qwen3, "layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ModelLoadError, match="need a positive integer sliding_window, got None"):
        parse_model_config({**qwen3, "layer_types": ["sliding_attention", "full_attention"]})
    with pytest.raises(ModelLoadError, match="layer_types lists 1 layers, the model has 2"):
        parse_model_config({**qwen3, "layer_types": ["full_attention"]})
    windowed = {**qwen3, "layer_types": None, "use_sliding_window": True, "sliding_window": 16, "max_window_layers": 1}
    assert parse_model_config(windowed).windows == (None, 16)
    with pytest.raises(ModelLoadError, match="unsupported architecture"):
        parse_model_config({**qwen3, "architectures": ["Phi3ForCausalLM"]})
    with pytest.raises(ModelLoadError, match=r"partial_rotary_factor 0\.5 is not supported"):
        parse_model_config({**qwen3, "partial_rotary_factor": 0.5})
    yarn = parse_model_config({**qwen3, "max_position_embeddings": 131072, "rope_scaling": {"rope_type": "yarn"}})
    assert (yarn.rope.factor, yarn.rope.original_max_position_embeddings) == (1.0, 131072)  # transformers' defaults
    yarn = parse_model_config(
        {
            **qwen3,
            "max_position_embeddings": 131072,
            "original_max_position_embeddings": 32768,
            "rope_scaling": {"rope_type": "yarn"},
        }
    )
    assert (yarn.rope.factor, yarn.rope.original_max_position_embeddings) == (4.0, 32768)


@pytest.mark.parametrize("name", ["llama_gqa4_tied", "qwen2_mha_tied", "qwen3_gqa4_tied", "dynamic_rope"])
def test_fast_attention_equals_reference_attention_in_the_model(name: str, checkpoint: Callable[[str], Path]) -> None:
    """The whole model with `reference_attention` (gather) and with the default fast path agree."""
    ids = random_prompt(PROMPT_LEN, 512, seed=5)
    fast = make_engine(checkpoint(name), max_context_tokens=1024)
    slow = make_engine(checkpoint(name), max_context_tokens=1024)
    slow.model.use_attention(reference_attention)
    for chunking in CHUNKINGS.values():
        seq = len(chunking)
        delta = (runner_logits(fast, seq, ids, chunking) - runner_logits(slow, seq, ids, chunking)).abs().max()
        assert delta.item() <= 5e-5  # fp32 rounding only (summation order differs)


@pytest.mark.parametrize("name", ["llama_gqa4_tied", "qwen2_gqa4_untied"])
def test_bf16_smoke(name: str, checkpoint: Callable[[str], Path], reference: Callable[..., torch.Tensor]) -> None:
    """bf16 weights and KV cache: close to the fp32 reference, same argmax where it is clear.

    The bounds are empirical (bf16 keeps 8 significant bits and these weights are large): the mean
    |Δ| measures ~0.04 against logits of std ~1.6; 0.1 leaves room without hiding a real bug, which
    shifts logits by O(1).
    """
    engine = make_engine(checkpoint(name), dtype="bf16")
    assert engine.model.lm_head.weight_t.dtype == torch.bfloat16
    ids = random_prompt(PROMPT_LEN, engine.model.config.vocab_size, seed=123)
    want = reference(name, "one_chunk")
    for seq, chunking in enumerate(CHUNKINGS.values(), start=1):
        got = runner_logits(engine, seq, ids, chunking)
        assert got.dtype == torch.float32 and torch.isfinite(got).all()
        assert (got - want).abs().mean().item() < 0.1
        clear = torch.tensor(top2_margins(want)) > 0.3
        agree = (got.argmax(-1) == want.argmax(-1))[clear].float().mean().item()
        assert agree >= 0.98


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_rms_norm_is_within_one_rounding_of_transformers_form(dtype: torch.dtype) -> None:
    """The GPU's fused RMSNorm (fp32 inside, one rounding) and transformers' form (normalize in
    fp32, round, times the weight, round) differ by at most about one ulp of the output."""
    from h3d.model.llama import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(256, 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(256, generator=g) * 2)
    norm = norm.to(dtype)
    x = (torch.randn(7, 256, generator=g) * 3).to(dtype)
    hf, fused = norm(x).float(), norm.fused(x).float()
    ulp = torch.finfo(dtype).eps * hf.abs().clamp_min(torch.finfo(dtype).tiny)
    assert ((fused - hf).abs() <= 2 * ulp).all()
    assert not torch.equal(fused, torch.zeros_like(fused))
