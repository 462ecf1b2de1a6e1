"""The memory scenario, tiny: the shipped policy's gateway holds an embedding
sidecar and it is counted; a gateway whose policy turns the cache off starts none."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.memory import measure_case

pytestmark = pytest.mark.e2e


def test_the_default_gateway_is_measured_with_its_sidecar(tmp_path: Path) -> None:
    default = measure_case("default", tmp_path, requests=3)
    assert default["processes"] == 2  # the gateway and its embedding sidecar
    assert default["semantic_entries"] == 3 and default["cache_stored"] == 3
    # The sidecar holds the model: the tree is far more than the gateway alone.
    assert default["tree_rss_mb"] > default["gateway_rss_mb"] + 100
    assert 0 < default["tree_pss_mb"] <= default["tree_rss_mb"]


def test_a_gateway_with_the_cache_off_starts_no_sidecar(tmp_path: Path) -> None:
    off = measure_case("cache_off", tmp_path, requests=3)
    assert off["processes"] == 1
    assert off["tree_rss_mb"] == off["gateway_rss_mb"]
    assert off["cache_stored"] == 0
