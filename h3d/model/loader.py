"""Load a Hugging Face model folder: config, safetensors weights (single file or sharded index);
of a multimodal checkpoint (Gemma 3), the text model only.

`start_model` checks the folder (config, every shard's header, the names and shapes the config
wants), allocates the parameters on the device and reads the weights into them on a thread of its
own (`Weights`), so that the engine sizes its tiers, opens the archive and restores its sessions
meanwhile; `Weights.wait()` comes before anything runs the model. `load_model` is both at once.

The weights go from the files to the device in parallel (`fill_weights`): each shard's header
(the safetensors format: a little-endian u64 length, then a JSON table of every tensor's dtype,
shape and byte range) says where each tensor lies, and `READ_THREADS` threads read pieces of at
most `PIECE_BYTES` into pinned staging buffers (on CUDA; on the CPU into the tensors themselves)
and copy them to the device, each thread on its own stream, so that reading the files, copying to
the device and converting on it overlap. One thread reading tensor by tensor
(`safetensors.safe_open`, then `.to(device)` from pageable memory) took 7-11 s for a 16 GB model
on H100 hosts, this 1.4-1.6 s from the page cache (docs/BENCHMARKS.md). A tensor stored as the
model keeps it is read straight into its parameter; q/k/v and gate/up are read into their rows of
one stacked buffer, and projections transposed and cast on the device into the parameter
(`AHEAD_BYTES` of such buffers in flight).
Missing files, missing tensors, unexpected ones, and a shard whose header or size does not hold
together are reported with the folder and the names.
"""

from __future__ import annotations

import json
import os
import struct
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from h3d.errors import ModelLoadError
from h3d.model.config import ModelConfig, load_model_config
from h3d.model.llama import CausalLM
from h3d.model.rope import RotaryEmbedding

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# safetensors' dtype names (those a checkpoint's weights come in)
FILE_DTYPES = {
    "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "F64": torch.float64,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip
READ_THREADS = 8  # threads reading the shards (each with its own staging buffer and stream)
PIECE_BYTES = 32 << 20  # the most one read and one copy move
AHEAD_BYTES = 512 << 20  # buffers read ahead of the one being converted (within the HBM margin)
HEADER_MAX = 100 << 20  # a header longer than this is not a safetensors file's


@dataclass(frozen=True, slots=True)
class Stored:
    """One tensor as a shard holds it: its dtype and shape, and its bytes' place in the file."""

    shard: Path
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the file
    nbytes: int


def _shards(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    if single.is_file():
        return [single]
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise ModelLoadError(f"{index} is not a valid safetensors index: {exc!r}") from exc
        shards = [model_dir / str(name) for name in names]
        missing = [s.name for s in shards if not s.is_file()]
        if missing:
            raise ModelLoadError(f"{model_dir} lacks weight shards named in its index: {', '.join(missing)}")
        return shards
    raise ModelLoadError(f"{model_dir} has no model.safetensors nor model.safetensors.index.json")


def read_header(shard: Path) -> dict[str, Stored]:
    """The tensors of one safetensors file, from its header; a header that does not hold together
    (cut short, not JSON, a dtype not listed, a byte range outside the file or not the size its
    shape says) is a ModelLoadError naming the file."""
    try:
        with shard.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            (n,) = struct.unpack("<Q", head) if len(head) == 8 else (-1,)
            if not 0 < n <= min(HEADER_MAX, size - 8):
                raise ModelLoadError(
                    f"cannot read {shard}: not a safetensors file (header length {n}, file {size} bytes)"
                )
            table = json.loads(f.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot read {shard}: {exc}") from exc
    if not isinstance(table, dict):
        raise ModelLoadError(f"cannot read {shard}: its header is not a table of tensors")
    out: dict[str, Stored] = {}
    for name, entry in table.items():
        if name == "__metadata__":
            continue
        try:
            dtype = FILE_DTYPES[entry["dtype"]]
            shape = tuple(int(x) for x in entry["shape"])
            begin, end = (int(x) for x in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelLoadError(f"cannot read {shard}: tensor {name!r} has a malformed entry ({exc!r})") from exc
        nbytes = dtype.itemsize
        for x in shape:
            nbytes *= x
        if min(shape, default=1) < 0 or end - begin != nbytes or begin < 0 or 8 + n + end > size:
            raise ModelLoadError(
                f"cannot read {shard}: tensor {name!r} ({entry['dtype']} {list(shape)}) lies at bytes "
                f"{begin}-{end} of a {size - 8 - n}-byte data section"
            )
        out[name] = Stored(shard, dtype, shape, 8 + n + begin, nbytes)
    return out


def _stored(model_dir: Path) -> dict[str, Stored]:
    out: dict[str, Stored] = {}
    for shard in _shards(model_dir):
        out.update(read_header(shard))
    return out


@dataclass(frozen=True, slots=True)
class Recipe:
    """How one parameter is made: its stored parts stacked along the first dimension (one part:
    the tensor as stored), transposed or not (a projection's `weight_t`)."""

    parts: tuple[Stored, ...]
    transpose: bool

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.parts)


def _recipes(stored: dict[str, Stored], cfg: ModelConfig) -> dict[str, Recipe]:
    """HF names -> h3d parameters (q/k/v and gate/up stacked, projections transposed)."""
    raw = dict(stored)
    out: dict[str, tuple[Stored, ...]] = {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        for kind in ("weight", "bias") if cfg.qkv_bias else ("weight",):
            out[f"{p}self_attn.qkv_proj.{kind}"] = tuple(raw.pop(f"{p}self_attn.{x}_proj.{kind}") for x in "qkv")
        out[f"{p}mlp.gate_up_proj.weight"] = tuple(raw.pop(f"{p}mlp.{x}_proj.weight") for x in ("gate", "up"))
    out.update((k, (v,)) for k, v in raw.items())
    if cfg.tie_word_embeddings:  # the head reads the embedding matrix
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    recipes = {}
    for k, parts in out.items():
        if len({p.shape[1:] for p in parts}) != 1 or len({p.dtype for p in parts}) != 1:
            raise ModelLoadError(f"{parts[0].shard.parent}: the parts of {k} differ in shape or dtype")
        # Projections are stored transposed: [out, in] -> [in, out] (see h3d.model.llama.Linear).
        projection = k.endswith("proj.weight") or k == "lm_head.weight"
        recipes[k[: -len("weight")] + "weight_t" if projection else k] = Recipe(parts, projection)
    return recipes


# A multimodal checkpoint's text model (Gemma 3 4B-27B): its names under these prefixes (transformers
# 4 wrote the first, 5 the second) become a causal LM's; the vision tower and the projector are
# not loaded.
_TEXT_PREFIXES = {
    "language_model.model.": "model.",
    "language_model.lm_head.": "lm_head.",
    "model.language_model.": "model.",
}
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.", "model.multi_modal_projector.")


def _text_model(raw: dict[str, Stored]) -> dict[str, Stored]:
    """The tensors of the text model, under a causal LM's names (see `_TEXT_PREFIXES`)."""
    out = {}
    for name, t in raw.items():
        if name.startswith(_VISION_PREFIXES):
            continue
        prefix = next((p for p in _TEXT_PREFIXES if name.startswith(p)), None)
        out[name if prefix is None else _TEXT_PREFIXES[prefix] + name[len(prefix) :]] = t
    return out


class _Reader:
    """Threads that read byte ranges of the shards into device tensors (the module docstring):
    `read(stored, into)` queues one stored tensor's pieces and returns their futures."""

    def __init__(self, device: torch.device, threads: int, piece: int) -> None:
        self.device = device
        self.piece = piece
        self.cuda = device.type == "cuda"
        self._local = threading.local()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="h3d-weights")
        self._files: dict[Path, int] = {}
        self._lock = threading.Lock()

    def _fd(self, path: Path) -> int:
        with self._lock:
            fd = self._files.get(path)
            if fd is None:
                fd = self._files[path] = os.open(path, os.O_RDONLY)
            return fd

    def read(self, stored: Stored, into: torch.Tensor) -> list[Future[None]]:
        """Read `stored`'s bytes into `into` (contiguous, as many bytes), in pieces."""
        dst = into.view(-1).view(torch.uint8)
        return [
            self._pool.submit(self._piece, stored, dst, at, min(self.piece, stored.nbytes - at))
            for at in range(0, stored.nbytes, self.piece)
        ]

    def _piece(self, stored: Stored, dst: torch.Tensor, at: int, n: int) -> None:
        try:
            self._copy(stored, dst, at, n)
        except OSError as exc:
            raise ModelLoadError(f"cannot read {stored.shard}: {exc}") from exc

    def _copy(self, stored: Stored, dst: torch.Tensor, at: int, n: int) -> None:
        fd = self._fd(stored.shard)
        if not self.cuda:
            self._fill(fd, dst[at : at + n].numpy(), stored, at)
            return
        local = self._local
        if getattr(local, "stage", None) is None:
            local.stage = torch.empty(self.piece, dtype=torch.uint8, pin_memory=True)
            local.stream = torch.cuda.Stream(self.device)
        stage = local.stage[:n]
        self._fill(fd, stage.numpy(), stored, at)
        with torch.cuda.stream(local.stream):
            dst[at : at + n].copy_(stage, non_blocking=True)
        local.stream.synchronize()  # the staging buffer is free again; the piece is on the device

    @staticmethod
    def _fill(fd: int, buf: object, stored: Stored, at: int) -> None:
        view = memoryview(buf).cast("B")  # type: ignore[arg-type]
        done = 0
        while done < len(view):
            got = os.preadv(fd, [view[done:]], stored.offset + at + done)
            if got <= 0:
                raise ModelLoadError(f"cannot read {stored.shard}: it ends before byte {stored.offset + at + done}")
            done += got

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        for fd in self._files.values():
            os.close(fd)


def fill_weights(
    recipes: dict[str, Recipe],
    params: dict[str, torch.Tensor],
    threads: int = READ_THREADS,
    piece: int = PIECE_BYTES,
    ahead: int = AHEAD_BYTES,
) -> None:
    """Fill each of `params` (on its device, in its dtype) from its recipe, in the recipes' order:
    a tensor stored as it is kept is read straight into its parameter; the others (stacked parts
    of another dtype, projections to transpose) into a buffer of the stored dtype on the device,
    then converted into the parameter, with the reads `ahead` bytes in front of the conversion. A
    recipe of the same stored parts as an earlier one (a tied head: the embedding matrix) is
    copied from that one's parameter on the device, not read again."""
    device = next(iter(params.values())).device
    reader = _Reader(device, threads, piece)
    queued: deque[tuple[str, Recipe, torch.Tensor | None, list[Future[None]]]] = deque()
    names = iter(recipes.items())
    read_as: dict[tuple[Stored, ...], tuple[str, Recipe]] = {}  # stored parts -> the parameter read from them
    in_flight = 0
    try:
        while True:
            while in_flight < ahead or not queued:
                item = next(names, None)
                if item is None:
                    break
                name, recipe = item
                if recipe.parts in read_as:
                    queued.append((name, recipe, None, []))  # (its twin comes first in the queue)
                    continue
                read_as[recipe.parts] = (name, recipe)
                first, param = recipe.parts[0], params[name]
                direct = not recipe.transpose and first.dtype == param.dtype
                rows = sum(p.shape[0] for p in recipe.parts) if first.shape else 0
                shape = (rows, *first.shape[1:]) if first.shape else ()
                raw = param if direct else torch.empty(shape, dtype=first.dtype, device=device)
                futures: list[Future[None]] = []
                at = 0
                for part in recipe.parts:
                    span = part.shape[0] if part.shape else 1
                    futures += reader.read(part, raw[at : at + span] if part.shape else raw)
                    at += span
                queued.append((name, recipe, raw, futures))
                in_flight += 0 if direct else recipe.nbytes
            if not queued:
                return
            name, recipe, buffer, futures = queued.popleft()
            for f in futures:
                f.result()
            param = params[name]
            if buffer is None:
                twin, made = read_as[recipe.parts]
                param.copy_(params[twin].t() if recipe.transpose != made.transpose else params[twin])
            elif buffer is not param:
                in_flight -= recipe.nbytes
                param.copy_(buffer.t() if recipe.transpose else buffer)
                if reader.cuda:
                    # the buffer is free once the copy has read it: its memory may go to the next
                    # buffer, written on a reader's stream, not after this stream's work
                    torch.cuda.current_stream(device).synchronize()
    finally:
        reader.close()


class Weights:
    """The weights of a model being read in the background (`start_model`): `wait()` returns
    once every parameter holds its values, or raises what stopped the reading."""

    def __init__(
        self, recipes: dict[str, Recipe], params: dict[str, torch.Tensor], gpu_free: int | None, device_s: float = 0.0
    ) -> None:
        self.seconds = 0.0  # how long the reading took
        self.device_s = device_s  # how long the device's start took before it (the CUDA context; 0 on a CPU)
        # The card's free memory with the parameters allocated, before the reading's buffers
        # (what sizes the HBM tier: `h3d.engine.build.budgets`); None on a CPU
        self.gpu_free = gpu_free
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(recipes, params), name="h3d-weights", daemon=True)
        self._thread.start()

    def _run(self, recipes: dict[str, Recipe], params: dict[str, torch.Tensor]) -> None:
        t0 = time.perf_counter()
        device = next(iter(params.values())).device
        try:
            if device.type == "cuda":
                torch.cuda.set_device(device)
                with torch.cuda.stream(torch.cuda.Stream(device)):
                    fill_weights(recipes, params)
                torch.cuda.synchronize(device)
                torch.cuda.empty_cache()  # the buffers it converted through, back to the card
            else:
                fill_weights(recipes, params)
        except BaseException as exc:  # handed to `wait`
            self._error = exc
        self.seconds = time.perf_counter() - t0

    def join(self) -> None:
        """Until the reading has ended, whatever its outcome."""
        self._thread.join()

    def wait(self) -> None:
        """`join`, then raise what stopped the reading, as a ModelLoadError."""
        self.join()
        if self._error is not None:
            if isinstance(self._error, ModelLoadError):
                raise self._error
            raise ModelLoadError(f"cannot read the weights: {self._error!r}") from self._error


def start_model(model_dir: str | Path, dtype: str, device: str | torch.device) -> tuple[CausalLM, Weights]:
    """The model for `model_dir` with weights in `dtype` ('fp32'|'bf16'|'fp16') on `device`, its
    parameters allocated and being read in the background: nothing may run the model before
    `Weights.wait()` returns. What the folder lacks or holds wrong is raised here."""
    path = Path(model_dir)
    if not path.is_dir():
        raise ModelLoadError(f"model folder not found: {path}")
    if dtype not in DTYPES:
        raise ModelLoadError(f"unsupported dtype {dtype!r} (supported: {', '.join(DTYPES)})")
    cfg = load_model_config(path)
    dev = torch.device(device)
    t0 = time.perf_counter()
    if dev.type == "cuda":
        torch.zeros(1, device=dev)  # the device's start (its context), timed apart from the rest
    device_s = time.perf_counter() - t0
    stored = _text_model(_stored(path))
    if cfg.tie_word_embeddings:
        stored.pop("lm_head.weight", None)
    try:
        recipes = _recipes(stored, cfg)
    except KeyError as exc:
        raise ModelLoadError(f"{path}: weights lack tensor {exc.args[0]!r}") from exc
    with torch.device("meta"):
        model = CausalLM(cfg, torch.device("meta"))
    model.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_position_embeddings, dev)
    if cfg.rope_local is not None:
        model.rotary_local = RotaryEmbedding(cfg.rope_local, cfg.head_dim, cfg.max_position_embeddings, dev)
    expected = model.state_dict()
    missing = sorted(expected.keys() - recipes.keys())
    unexpected = sorted(recipes.keys() - expected.keys())
    if missing or unexpected:
        raise ModelLoadError(
            f"{path}: weights do not fit the config; missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    wrong = [
        f"{k} {list(expected[k].shape)} (stored {[r.shape for r in recipes[k].parts]})"
        for k in recipes
        if _shape(recipes[k]) != tuple(expected[k].shape)
    ]
    if wrong:
        raise ModelLoadError(f"{path}: weights do not fit the config's shapes: {', '.join(wrong[:3])}")
    torch_dtype = DTYPES[dtype]
    params = {k: torch.empty(expected[k].shape, dtype=torch_dtype, device=dev) for k in recipes}
    model.load_state_dict(params, strict=True, assign=True)
    model.eval().requires_grad_(False)
    gpu_free = torch.cuda.mem_get_info(dev)[0] if dev.type == "cuda" else None
    return model, Weights(recipes, dict(model.state_dict()), gpu_free, device_s)


def load_model(model_dir: str | Path, dtype: str, device: str | torch.device) -> CausalLM:
    """Build the model for `model_dir` with weights in `dtype` ('fp32'|'bf16'|'fp16') on `device`."""
    model, weights = start_model(model_dir, dtype, device)
    weights.wait()
    return model


def _shape(recipe: Recipe) -> tuple[int, ...]:
    first = recipe.parts[0]
    if not first.shape:
        return ()
    shape = (sum(p.shape[0] for p in recipe.parts), *first.shape[1:])
    return (shape[1], shape[0]) if recipe.transpose and len(shape) == 2 else shape
