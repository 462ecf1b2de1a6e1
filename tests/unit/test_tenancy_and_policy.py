from __future__ import annotations

import pytest

from hedgerow.errors import AuthenticationFailed
from policies.schema import PolicyError, load_policy, parse_policy
from policies.tenancy import identify


def test_default_policy_loads_and_serves_anonymous_locally() -> None:
    policy = load_policy()
    assert identify(policy, None).tenant == "local"
    assert policy.canonical_model("smollm2") == "smollm2-135m-instruct"
    assert policy.canonical_model("other") == "other"


def test_demo_key_maps_to_demo_tenant() -> None:
    assert identify(load_policy(), "Bearer sk-demo").tenant == "demo"


@pytest.mark.parametrize("header", ["Bearer wrong", "Basic abc", "Bearer ", "sk-demo"])
def test_bad_key_is_refused_never_served_as_anonymous(header: str) -> None:
    with pytest.raises(AuthenticationFailed) as caught:
        identify(load_policy(), header)
    assert caught.value.status == 401


def test_no_anonymous_tenant_requires_a_key() -> None:
    policy = parse_policy("classes: [{name: c, ttft_slo_ms: 1, deadline_ms: 1}]\n"
                          "tenants: [{name: t, class: c}]\n")
    with pytest.raises(AuthenticationFailed):
        identify(policy, None)


def test_unknown_key_is_an_error_naming_it() -> None:
    with pytest.raises(PolicyError, match="limitz"):
        parse_policy("limitz: {}\n")


def test_yaml_syntax_error_is_reported() -> None:
    with pytest.raises(PolicyError, match="YAML syntax error"):
        parse_policy("limits: [\n", "p.yaml")


def test_dangling_references_are_rejected() -> None:
    with pytest.raises(PolicyError, match="unknown class"):
        parse_policy("tenants: [{name: t, class: nope}]\n")
    with pytest.raises(PolicyError, match="is not a tenant"):
        parse_policy("anonymous_tenant: ghost\n")
