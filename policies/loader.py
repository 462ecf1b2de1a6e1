"""Policy documents: YAML text in, a validated ``Policy`` out, or every reason why not.

Sans-IO: it takes text and a source name (used in messages) and never opens a
file. Each problem becomes a ``PolicyIssue`` at ``source:line:column`` with the
field path (``tenants[1].limits.max_concurrency``). pydantic says what is wrong
and where in the data (its error ``loc``); the composed YAML node graph, whose
nodes keep their start marks, says where that data was written.

Before validation the node graph is checked for what YAML allows but a policy
must not: duplicate keys (YAML silently keeps the last), recursive aliases, and
alias expansions so large that validating them would stall the control plane.
"""

from __future__ import annotations

import difflib
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, get_args

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from policies.schema import Loc, Policy, PolicyError, PolicyIssue, SchemaRuleError

MAX_POLICY_CHARS = 1_048_576
MAX_ISSUES = 20  # reported per document; the rest are counted
MAX_NODES = 100_000  # visited with aliases expanded
MAX_DEPTH = 32
DOCUMENT = "(document)"
_MERGE_TAG = "tag:yaml.org,2002:merge"


def parse_policy_document(text: str, source: str = "<policy>") -> Policy:
    """Validate a YAML policy; raise ``PolicyError`` listing every problem found."""
    if len(text) > MAX_POLICY_CHARS:
        raise PolicyError([PolicyIssue(source, 1, 1, DOCUMENT,
                                       f"document too large (over {MAX_POLICY_CHARS} characters)")])
    root = _compose(text, source)
    check = _NodeCheck(source)
    check.visit(root, (), 0)
    if check.fatal:
        raise PolicyError(check.issues)
    policy, invalid = _validate(_construct(root, source), root, source)
    issues = sorted(check.issues + invalid, key=lambda issue: (issue.line, issue.column))
    if policy is None or issues:
        raise PolicyError(issues[:MAX_ISSUES], omitted=max(0, len(issues) - MAX_ISSUES))
    return policy


def policy_checksum(policy: Policy) -> str:
    """sha256 of the canonical JSON of a validated policy: formatting, comments,
    key order and spelled-out defaults do not change it."""
    canonical = json.dumps(policy.model_dump(mode="json", by_alias=True), sort_keys=True,
                           separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def decode_policy_bytes(data: bytes, source: str) -> str:
    """UTF-8 (a leading BOM is allowed) or a ``PolicyError`` saying where it is not."""
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        before = data[: error.start]
        line, column = before.count(b"\n") + 1, error.start - (before.rfind(b"\n") + 1) + 1
        raise PolicyError([PolicyIssue(source, line, column, DOCUMENT,
                                       f"not UTF-8 text (byte 0x{data[error.start]:02x})")]) from None


# -- YAML ------------------------------------------------------------------------


def _compose(text: str, source: str) -> Node:
    try:
        root = _single_node(text)
    except yaml.YAMLError as error:
        raise PolicyError([_yaml_issue(error, text, source)]) from None
    except RecursionError:
        raise PolicyError([PolicyIssue(source, 1, 1, DOCUMENT, "YAML nested too deeply")]) from None
    if root is None:
        raise PolicyError([PolicyIssue(source, 1, 1, DOCUMENT,
                                       "the policy document is empty (only comments or blanks)")])
    return root


def _single_node(text: str) -> Node | None:
    loader = yaml.SafeLoader(text)  # the reader refuses control characters right here
    try:
        node: Node | None = loader.get_single_node()
        return node
    finally:
        loader.dispose()


def _construct(root: Node, source: str) -> Any:
    loader = yaml.SafeLoader("")
    try:
        return loader.construct_document(root)
    except yaml.YAMLError as error:
        raise PolicyError([_yaml_issue(error, "", source)]) from None
    finally:
        loader.dispose()


def _yaml_issue(error: yaml.YAMLError, text: str, source: str) -> PolicyIssue:
    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        context = f" ({error.context})" if error.context else ""
        return PolicyIssue(source, mark.line + 1, mark.column + 1, DOCUMENT,
                           f"YAML syntax error: {error.problem}{context}")
    if isinstance(error, yaml.reader.ReaderError):
        before = text[: error.position]
        line, column = before.count("\n") + 1, error.position - (before.rfind("\n") + 1) + 1
        return PolicyIssue(source, line, column, DOCUMENT,
                           f"YAML syntax error: {error.reason} (character U+{error.character:04X})")
    return PolicyIssue(source, 1, 1, DOCUMENT, f"YAML syntax error: {error}")


@dataclass
class _NodeCheck:
    """Duplicate keys, recursion, depth and expanded size of a node graph."""

    source: str
    issues: list[PolicyIssue] = field(default_factory=list)
    fatal: bool = False
    _visited: int = 0
    _ancestors: set[int] = field(default_factory=set)

    def visit(self, node: Node, loc: Loc, depth: int) -> None:
        self._visited += 1
        if id(node) in self._ancestors:
            return self._stop(node, loc, "an alias refers to its own ancestor (recursive YAML)")
        if depth > MAX_DEPTH or self._visited > MAX_NODES:
            return self._stop(node, loc, "document nested too deeply or too large after "
                                         "expanding aliases")
        self._ancestors.add(id(node))
        for child_loc, child in self._children(node, loc):
            if self.fatal:
                break
            self.visit(child, child_loc, depth + 1)
        self._ancestors.discard(id(node))

    def _children(self, node: Node, loc: Loc) -> Iterator[tuple[Loc, Node]]:
        if isinstance(node, SequenceNode):
            yield from (((*loc, i), child) for i, child in enumerate(node.value))
        elif isinstance(node, MappingNode):
            seen: dict[str, Node] = {}
            for key, value in node.value:
                name = key.value if isinstance(key, ScalarNode) else None
                if isinstance(name, str) and key.tag != _MERGE_TAG:
                    self._check_unique(seen, key, name, loc)
                yield (*loc, name if name is not None else "?"), value

    def _check_unique(self, seen: dict[str, Node], key: Node, name: str, loc: Loc) -> None:
        if name in seen:
            first = seen[name].start_mark.line + 1
            self._add(key, (*loc, name), f"duplicate key {name!r} (first set on line {first})")
        seen.setdefault(name, key)

    def _stop(self, node: Node, loc: Loc, message: str) -> None:
        self._add(node, loc, message)
        self.fatal = True

    def _add(self, node: Node, loc: Loc, message: str) -> None:
        mark = node.start_mark
        self.issues.append(PolicyIssue(self.source, mark.line + 1, mark.column + 1,
                                       format_path(loc), message))


# -- pydantic errors → issues ------------------------------------------------------


def _validate(data: Any, root: Node, source: str) -> tuple[Policy | None, list[PolicyIssue]]:
    try:
        return Policy.model_validate(data), []
    except ValidationError as error:
        return None, [issue for detail in error.errors(include_url=False)
                      for issue in _issues_for(detail, root, source)]


def _issues_for(detail: ErrorDetails, root: Node, source: str) -> Iterator[PolicyIssue]:
    loc: Loc = tuple(detail["loc"])
    cause = detail.get("ctx", {}).get("error")
    if isinstance(cause, SchemaRuleError):
        for sub_loc, message in cause.violations:
            yield _located(root, (*loc, *sub_loc), message, source)
    elif detail["type"] == "extra_forbidden":
        yield _located(root, loc, _unknown_key_message(loc), source, at_key=True)
    else:
        yield _located(root, loc, detail["msg"].removeprefix("Value error, "), source)


def _located(root: Node, loc: Loc, message: str, source: str, *, at_key: bool = False) -> PolicyIssue:
    node = _node_at(root, loc, at_key)
    mark = node.start_mark
    return PolicyIssue(source, mark.line + 1, mark.column + 1, format_path(loc), message)


def _node_at(root: Node, loc: Loc, at_key: bool) -> Node:
    """The node written for ``loc``, or the deepest one that exists (e.g. the
    mapping a required key is missing from)."""
    node = root
    for depth, part in enumerate(loc, start=1):
        found = _child(node, part)
        if found is None:
            break
        key, node = found
        if at_key and depth == len(loc) and key is not None:
            return key
    return node


def _child(node: Node, part: str | int) -> tuple[Node | None, Node] | None:
    if isinstance(node, MappingNode):
        # The last occurrence wins, as it does in the constructed data.
        for key, value in reversed(node.value):
            if isinstance(key, ScalarNode) and key.value == str(part):
                return key, value
    elif isinstance(node, SequenceNode) and isinstance(part, int) and 0 <= part < len(node.value):
        return None, node.value[part]
    return None


def format_path(loc: Loc) -> str:
    """``("tenants", 1, "limits")`` → ``tenants[1].limits``."""
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text or DOCUMENT


def _unknown_key_message(loc: Loc) -> str:
    key = str(loc[-1]) if loc else "?"
    known = _known_keys(loc[:-1])
    close = difflib.get_close_matches(key, known, n=1)
    if close:
        return f"unknown key {key!r} (did you mean {close[0]!r}?)"
    return f"unknown key {key!r} (known keys: {', '.join(known)})" if known else f"unknown key {key!r}"


def _known_keys(loc: Loc) -> list[str]:
    model: type[BaseModel] | None = Policy
    for part in loc:
        if model is None:
            return []
        if isinstance(part, str):
            model = _field_model(model, part)
    return [] if model is None else [f.alias or name for name, f in model.model_fields.items()]


def _field_model(model: type[BaseModel], key: str) -> type[BaseModel] | None:
    for name, info in model.model_fields.items():
        if key in (name, info.alias):
            return _model_in(info.annotation)
    return None


def _model_in(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_in(arg)
        if found is not None:
            return found
    return None

