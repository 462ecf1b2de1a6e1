"""Policy documents: every rejection says file:line:column, the field path and why."""

from __future__ import annotations

import hashlib
import textwrap

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from policies.loader import parse_policy_document, policy_checksum
from policies.schema import DEFAULT_POLICY_PATH, PolicyError, PolicyIssue, load_policy

CLASSES = """\
classes:
  - {name: interactive, ttft_slo_ms: 1000, deadline_ms: 10000}
  - {name: batch, ttft_slo_ms: 30000, deadline_ms: 120000}
"""


def issues_of(text: str) -> list[PolicyIssue]:
    with pytest.raises(PolicyError) as caught:
        parse_policy_document(textwrap.dedent(text), "ops/p.yaml")
    return list(caught.value.issues)


def only_issue(text: str) -> PolicyIssue:
    issues = issues_of(text)
    assert len(issues) == 1, issues
    return issues[0]


def test_a_typo_d_key_is_named_with_its_position_and_a_suggestion() -> None:
    issue = only_issue("""\
        limits:
          max_body_bytes: 2048
          max_tokenz: 5
        """)
    assert (issue.line, issue.column, issue.path) == (3, 3, "limits.max_tokenz")
    assert issue.message == "unknown key 'max_tokenz' (did you mean 'max_tokens'?)"
    assert str(issue).startswith("ops/p.yaml:3:3: limits.max_tokenz: unknown key")


def test_an_unknown_key_without_a_close_match_lists_the_known_ones() -> None:
    issue = only_issue("routing:\n  shortest_queue: true\n")
    assert issue.path == "routing.shortest_queue"
    assert "prefer_gpu_above_tokens" in issue.message and "allow_cpu_fallback" in issue.message


def test_a_wrong_type_points_at_the_value_deep_in_a_list() -> None:
    issue = only_issue(CLASSES + """\
tenants:
  - {name: a, class: batch}
  - name: b
    class: batch
    limits:
      max_concurrency: lots
""")
    assert (issue.line, issue.column) == (9, 24)
    assert issue.path == "tenants[1].limits.max_concurrency"
    assert "valid integer" in issue.message


def test_a_bad_enum_value_says_which_values_are_allowed() -> None:
    issue = only_issue("scheduling:\n  order: lifo\n")
    assert (issue.line, issue.column, issue.path) == (2, 10, "scheduling.order")
    assert issue.message == "Input should be 'edf' or 'fifo'"


def test_a_yaml_syntax_error_carries_its_line_and_column() -> None:
    issue = only_issue("limits:\n  max_tokens: 1\n bad: 2\n")
    assert (issue.line, issue.column, issue.path) == (3, 2, "(document)")
    assert issue.message.startswith("YAML syntax error")


def test_control_characters_are_located() -> None:
    issue = only_issue("limits:\n  max_tokens: \x07\n")
    assert (issue.line, issue.column) == (2, 15)
    assert "U+0007" in issue.message


def test_duplicate_names_are_rejected_at_the_second_one() -> None:
    issues = issues_of(CLASSES + """\
  - {name: batch, ttft_slo_ms: 1, deadline_ms: 1}
tenants:
  - {name: t, class: batch}
  - {name: t, class: interactive}
models:
  - {name: m}
  - {name: m}
""")
    assert [(i.line, i.path) for i in issues] == [
        (4, "classes[2].name"), (7, "tenants[1].name"), (10, "models[1].name")]
    assert issues[0].message == "duplicate class name 'batch' (also classes[1])"


def test_a_duplicate_yaml_key_is_an_error_not_silently_the_last_one() -> None:
    issue = only_issue("limits: {max_tokens: 5}\nlimits: {max_tokens: 6}\n")
    assert (issue.line, issue.column, issue.path) == (2, 1, "limits")
    assert issue.message == "duplicate key 'limits' (first set on line 1)"


def test_a_dangling_class_reference_points_at_the_reference() -> None:
    issue = only_issue(CLASSES + "tenants:\n  - name: t\n    class: interactiv\n")
    assert (issue.line, issue.column, issue.path) == (6, 12, "tenants[0].class")
    assert issue.message == ("tenant 't' uses unknown class 'interactiv' "
                             "(classes: interactive, batch)")


def test_an_unknown_anonymous_tenant_is_located() -> None:
    issue = only_issue("anonymous_tenant: ghost\n")
    assert (issue.line, issue.column, issue.path) == (1, 19, "anonymous_tenant")
    assert "is not a tenant" in issue.message


def test_a_missing_required_field_points_at_its_mapping() -> None:
    issues = issues_of("classes:\n  - name: c\n    deadline_ms: 5\n")
    assert [(i.line, i.column, i.path, i.message) for i in issues] == [
        (2, 5, "classes[0].ttft_slo_ms", "Field required")]


def test_api_keys_must_be_sha256_digests_never_raw_keys() -> None:
    issue = only_issue(CLASSES + "tenants: [{name: t, class: batch, api_key_sha256: [sk-demo]}]\n")
    assert issue.path == "tenants[0].api_key_sha256[0]"
    assert (issue.line, issue.column) == (4, 52)
    assert "sha256 hex digest" in issue.message


def test_an_uppercase_digest_is_accepted_and_normalised() -> None:
    digest = hashlib.sha256(b"sk-x").hexdigest()
    policy = parse_policy_document(
        CLASSES + f"tenants: [{{name: t, class: batch, api_key_sha256: ['{digest.upper()}']}}]\n")
    assert policy.tenants[0].api_key_sha256 == (digest,)


def test_one_key_in_two_tenants_is_ambiguous() -> None:
    digest = hashlib.sha256(b"sk-x").hexdigest()
    issues = issues_of(CLASSES + f"""\
tenants:
  - {{name: a, class: batch, api_key_sha256: ['{digest}']}}
  - {{name: b, class: batch, api_key_sha256: ['{digest}']}}
""")
    assert [i.path for i in issues] == ["tenants[0].api_key_sha256[0]",
                                        "tenants[1].api_key_sha256[0]"]


def test_an_alias_may_not_shadow_another_model() -> None:
    issues = issues_of("models:\n  - {name: a, aliases: [x]}\n  - {name: b, aliases: [a, x]}\n")
    assert [(i.line, i.path, i.message) for i in issues] == [
        (3, "models[1].aliases[0]", "alias 'a' already names model 'a'"),
        (3, "models[1].aliases[1]", "alias 'x' already names model 'a'"),
    ]


def test_cross_field_rules_are_located_at_the_offending_field() -> None:
    issue = only_issue("hedging:\n  floor_ms: 100\n  ceiling_ms: 50\n")
    assert (issue.line, issue.path) == (2, "hedging.floor_ms")


def test_infinite_rates_are_rejected() -> None:
    issue = only_issue(CLASSES + "tenants: [{name: t, class: batch, limits: {requests_per_s: .inf}}]\n")
    assert issue.path == "tenants[0].limits.requests_per_s"


def test_every_problem_is_reported_in_document_order() -> None:
    issues = issues_of("""\
        routing: {prefer_gpu_above_tokens: many}
        limits:
          max_tokenz: 1
        scheduling: {order: lifo}
        """)
    assert [i.path for i in issues] == [
        "routing.prefer_gpu_above_tokens", "limits.max_tokenz", "scheduling.order"]
    message = str(PolicyError(issues))
    assert message.splitlines()[1].startswith("ops/p.yaml:3:3: limits.max_tokenz")


@pytest.mark.parametrize("text, message", [
    ("# only a comment\n", "empty"),
    ("- a list\n", "valid dictionary"),
    ("a: 1\n---\nb: 2\n", "single document"),
    ("limits: !!python/object:os.system {}\n", "constructor"),
    ("classes: &a [*a]\n", "recursive"),
    ("[" * 100 + "]" * 100, "nested too deeply"),
    ("[" * 1000 + "]" * 1000, "nested too deeply"),  # beyond what PyYAML can compose
])
def test_hostile_or_odd_documents_are_refused_cleanly(text: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy_document(text)


def test_an_alias_bomb_is_refused_before_validation() -> None:
    lines = ["a0: &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    with pytest.raises(PolicyError, match="too large after expanding aliases"):
        parse_policy_document("\n".join(lines) + "\n")


def test_anchors_and_merge_keys_work_for_shared_settings() -> None:
    policy = parse_policy_document(textwrap.dedent("""\
        classes:
          - &base {name: a, ttft_slo_ms: 100, deadline_ms: 1000}
          - <<: *base
            name: b
        """))
    assert [c.name for c in policy.classes] == ["a", "b"]
    assert policy.classes[1].deadline_ms == 1000


def test_the_shipped_default_is_valid() -> None:
    policy = load_policy(DEFAULT_POLICY_PATH)
    assert policy.anonymous_tenant == "local"


def test_checksum_ignores_formatting_comments_and_spelled_out_defaults() -> None:
    text = DEFAULT_POLICY_PATH.read_text()
    reformatted = yaml.safe_dump(yaml.safe_load(text), default_flow_style=True, sort_keys=True)
    # The shipped file spells out retries.before_first_token: 1, the default.
    default_left_out = text.replace("retries:\n  before_first_token: 1", "")
    assert "before_first_token" not in default_left_out
    checksums = {policy_checksum(parse_policy_document(t))
                 for t in (text, reformatted, default_left_out)}
    assert len(checksums) == 1
    changed = text.replace("max_tokens: 4096", "max_tokens: 4095")
    assert policy_checksum(parse_policy_document(changed)) not in checksums


YAML_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(),
                         st.text(max_size=8))
YAML_VALUES = st.recursive(
    YAML_SCALARS,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(
        st.sampled_from(["limits", "tenants", "classes", "name", "class", "max_tokens",
                         "models", "aliases", "hedging", "order", "x"]) | st.text(max_size=6),
        inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_arbitrary_text_is_accepted_or_refused_with_policy_errors_only(text: str) -> None:
    try:
        parse_policy_document(text, "fuzz.yaml")
    except PolicyError as error:
        assert all(issue.line >= 1 and issue.column >= 1 for issue in error.issues)


@settings(max_examples=300, deadline=None)
@given(YAML_VALUES)
def test_arbitrary_yaml_structures_never_raise_anything_but_policy_error(value: object) -> None:
    text = yaml.safe_dump(value)
    try:
        parse_policy_document(text, "fuzz.yaml")
    except PolicyError as error:
        lines = text.count("\n") + 1
        assert all(1 <= issue.line <= lines for issue in error.issues)
