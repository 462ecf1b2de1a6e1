"""The shipped policy (``policies/default.yaml``) with parts of its ``cache:``
section changed, for scenarios and tests that need, say, the semantic cache on
(it ships off) and everything else as a user gets it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import yaml

from policies.loader import parse_policy_document
from policies.schema import DEFAULT_POLICY_PATH, Policy

SEMANTIC_ON: Mapping[str, Any] = {"semantic": {"enabled": True}}


def shipped_policy_text(cache: Mapping[str, Any] | None = None) -> str:
    """The shipped policy as YAML, ``cache``'s keys set over its ``cache:`` section
    (a mapping value updates that subsection: ``{"semantic": {"enabled": True}}``
    keeps the semantic threshold and bounds as shipped)."""
    document = yaml.safe_load(DEFAULT_POLICY_PATH.read_text())
    section = document.setdefault("cache", {})
    for key, value in (cache or {}).items():
        if isinstance(value, Mapping):
            section.setdefault(key, {}).update(value)
        else:
            section[key] = value
    return yaml.safe_dump(document)


def shipped_policy(cache: Mapping[str, Any] | None = None) -> Policy:
    """``shipped_policy_text(cache)``, validated."""
    return parse_policy_document(shipped_policy_text(cache), "shipped policy (changed)")
