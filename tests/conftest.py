"""Fixtures: tiny random Llama / Qwen2 / Qwen3 / Mistral / Gemma 3 checkpoints built with transformers' save_pretrained.

Every checkpoint is a complete Hugging Face folder (config.json, model.safetensors in fp32,
tokenizer.json, tokenizer_config.json) that both h3d and transformers load. The tokenizer is a
byte-level BPE trained here on the inline text below, its vocabulary as large as the models'.
Weights are drawn with a large std (initializer_range 0.2, plus random norm weights and biases)
so that the logits are far from flat and greedy decoding is decided by clear margins.

The checkpoints are built lazily, once per test session, into a session temporary folder.
"""

from __future__ import annotations

import os

# The Triton kernels' CPU twins: the interpreter mode is fixed when Triton is first imported, so it
# is set before anything can import it. Only code that asks for a kernel on the CPU (the tests of
# the GPU path) runs through it; the engine uses the kernels on CUDA only.
os.environ.setdefault("TRITON_INTERPRET", "1")

import json
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import BOS, BOS_ID, EOS, EOS_ID, PAD, PAD_ID, SPECS, VOCAB_SIZE, Spec
from hypothesis import settings

# Property tests: reproducible from run to run (CI), and no example database in the work tree.
settings.register_profile("h3d", derandomize=True, database=None, deadline=None)
settings.load_profile("h3d")


# Training text for the tokenizer: plain English, some punctuation and digits, and a few
# multi-byte characters (accents, CJK, emoji) so that merges split and join UTF-8 sequences.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A long conversation needs a large cache: every
token that the model has read leaves a key and a value in every layer, and the next token attends
to all of them. When the cache does not fit in the memory of the accelerator, some of it must live
elsewhere, in the host's memory or on a fast disk, and be brought back before it is needed.

Paged attention keeps the cache in blocks of a fixed number of tokens. A table per sequence says
which block of the pool holds which part of the sequence, so sequences grow one block at a time
and never need one contiguous region. Freed blocks go back to a free list and are handed to the
next sequence that asks for room. Nothing is copied when a sequence grows; only the table changes.

Sampling turns the logits of the last position into one token. Greedy decoding takes the largest
logit; temperature divides the logits before the softmax; top-k keeps the k largest; top-p keeps
the smallest set of tokens whose probability reaches p. A seed makes a request reproducible: the
same prompt, the same parameters and the same seed give the same tokens, whatever else is running.

Numbers appear too: 1, 2, 3, 10, 42, 100, 2048, 3.14159 and 1e-4. So do symbols such as (), [],
{}, <>, =, +, -, *, /, %, #, @, & and the quotes "double" and 'single'. Café, naïve, résumé,
Übermaß and façade carry accents. 你好，世界。这是一个测试。 日本語のテキストも少しあります。
Emoji: 🙂 🚀 🎉 👍🏽 ❤️ and the flag 🇫🇷 are several bytes long, some several code points.

Once upon a time there was a small model that could only say a few words. It read the same
paragraphs again and again, and slowly it learned which letters liked to stand next to each other.
The end of a story is marked by a special token, and a reader that sees it stops reading.
"""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{{ eos_token }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def _train_tokenizer(out_dir: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=1,
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    assert tok.token_to_id(BOS) == BOS_ID and tok.token_to_id(EOS) == EOS_ID and tok.token_to_id(PAD) == PAD_ID
    # Like Llama 3: BOS prepended by the post-processor; byte-level offsets kept.
    tok.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, BOS_ID)]
            ),
        ]
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "model_max_length": 1024,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))
    return int(tok.get_vocab_size(with_added_tokens=True))


def _model_classes(arch: str) -> tuple[Any, Any]:
    import transformers as tf

    return {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "gemma3": (tf.Gemma3TextConfig, tf.Gemma3ForCausalLM),
        "mistral": (tf.MistralConfig, tf.MistralForCausalLM),
    }[arch]


def _build_checkpoint(out_dir: Path, spec: Spec, tokenizer_dir: Path, vocab: int) -> None:
    config_cls, model_cls = _model_classes(spec.arch)
    rope = {"rope_theta": 10000.0, "rope_type": "default", **spec.rope}
    kw: dict[str, Any] = {
        "vocab_size": vocab,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "max_position_embeddings": spec.max_pos,
        "rms_norm_eps": 1e-6,
        "initializer_range": 0.2,
        "tie_word_embeddings": spec.tied,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
        "rope_parameters": rope,
    }
    if spec.arch in ("llama", "qwen3", "gemma3"):
        kw["head_dim"] = 16
    else:
        assert 64 // spec.heads == 16
    if spec.arch == "gemma3":  # every third layer full, the others sliding; two RoPE bases
        kw.update(
            sliding_window=spec.window,
            layer_types=["full_attention" if (i + 1) % 3 == 0 else "sliding_attention" for i in range(spec.layers)],
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1e6, **spec.rope},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
            query_pre_attn_scalar=24,  # not head_dim: the attention scale is its own
            final_logit_softcapping=spec.softcap,
        )
    elif spec.arch == "mistral":
        kw["sliding_window"] = spec.window
    elif spec.window is not None:
        kw.update(use_sliding_window=True, sliding_window=spec.window, max_window_layers=spec.window_from)
    torch.manual_seed(spec.seed)
    model = model_cls(config_cls(**kw)).float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith(".bias"):  # Qwen2's q/k/v biases are zero at init: make them count
                p.normal_(0.0, 0.2)
    model.save_pretrained(out_dir)
    # Tests that need generation_config.json write their own (write_generation_config).
    (out_dir / "generation_config.json").unlink(missing_ok=True)
    if spec.rope_format == "v4":
        raw = json.loads((out_dir / "config.json").read_text())
        params = dict(raw.pop("rope_parameters"))
        raw["rope_theta"] = params.pop("rope_theta")
        params["type"] = params.pop("rope_type")
        raw["rope_scaling"] = params
        (out_dir / "config.json").write_text(json.dumps(raw, indent=2))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out_dir / name)


@pytest.fixture(autouse=True)
def _one_torch_thread(request: pytest.FixtureRequest) -> Iterator[None]:
    """Tiny models gain nothing from intra-op threads, and spinning OpenMP threads on a busy 2-core
    machine can slow every op tenfold. Tests marked slow (real models) keep torch's setting."""
    if request.node.get_closest_marker("slow"):
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    vocab = _train_tokenizer(out)
    assert vocab == VOCAB_SIZE, f"the corpus is too small for {VOCAB_SIZE} tokens ({vocab})"
    return out


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory, tokenizer_dir: Path) -> Callable[[str], Path]:
    """checkpoint(name) -> folder of the tiny checkpoint `name` (a key of helpers.SPECS), built once."""
    root = tmp_path_factory.mktemp("checkpoints")
    built: dict[str, Path] = {}

    def get(name: str) -> Path:
        if name not in built:
            out = root / name
            _build_checkpoint(out, SPECS[name], tokenizer_dir, VOCAB_SIZE)
            built[name] = out
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_model(checkpoint: Callable[[str], Path]) -> Callable[[str], Any]:
    """hf_model(name) -> transformers' model loaded from the same folder (fp32, eager attention)."""
    from transformers import AutoModelForCausalLM

    loaded: dict[str, Any] = {}

    def get(name: str) -> Any:
        if name not in loaded:
            model = AutoModelForCausalLM.from_pretrained(
                checkpoint(name), dtype=torch.float32, attn_implementation="eager"
            )
            loaded[name] = model.eval()
        return loaded[name]

    return get


@pytest.fixture
def model_copy(checkpoint: Callable[[str], Path], tmp_path: Path) -> Callable[[str], Path]:
    """model_copy(name) -> a private copy of a checkpoint, free to edit."""

    copies = iter(range(1_000))

    def get(name: str) -> Path:
        dst = tmp_path / f"{name}-{next(copies)}"
        shutil.copytree(checkpoint(name), dst)
        return dst

    return get


ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def smol_dir() -> Path:
    """The embedded SmolLM2 model as an HF folder: from `make run`'s data/, else converted once into
    .cache/ (under a lock: pytest-xdist's workers each ask for it, and a second conversion would
    replace the folder under the first one's readers)."""
    import fcntl

    out = ROOT / ".cache/models/smollm2-135m-instruct"
    for candidate in (ROOT / "data/models/smollm2-135m-instruct", out):
        if (candidate / "config.json").is_file():
            return candidate
    from h3d.convert.embedded import embedded_gguf
    from h3d.convert.gguf import convert_gguf

    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / ".convert.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (out / "config.json").is_file():
            convert_gguf(embedded_gguf(), out)
    return out
