"""The memory scenario, tiny: the shipped policy's gateway (semantic cache off)
is one process; a policy that turns the semantic cache on starts an embedding
sidecar and it is counted; one that turns the cache off starts none."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.memory import measure_case

pytestmark = pytest.mark.e2e


def test_the_default_gateway_starts_no_sidecar(tmp_path: Path) -> None:
    default = measure_case("default", tmp_path, requests=3)
    assert default["processes"] == 1  # the gateway alone: no embedding model loaded
    assert default["tree_rss_mb"] == default["gateway_rss_mb"]
    assert default["cache_stored"] == 3 and default["semantic_entries"] == 0


def test_the_semantic_cache_on_is_measured_with_its_sidecar(tmp_path: Path) -> None:
    semantic = measure_case("semantic_on", tmp_path, requests=3)
    assert semantic["processes"] == 2  # the gateway and its embedding sidecar
    assert semantic["semantic_entries"] == 3 and semantic["cache_stored"] == 3
    # The sidecar holds the model: the tree is far more than the gateway alone.
    assert semantic["tree_rss_mb"] > semantic["gateway_rss_mb"] + 100
    assert 0 < semantic["tree_pss_mb"] <= semantic["tree_rss_mb"]


def test_a_gateway_with_the_cache_off_starts_no_sidecar(tmp_path: Path) -> None:
    off = measure_case("cache_off", tmp_path, requests=3)
    assert off["processes"] == 1
    assert off["tree_rss_mb"] == off["gateway_rss_mb"]
    assert off["cache_stored"] == 0
