"""The deployment recipes under deploy/ stay in step with the code, and safe.

Kubernetes manifests must be valid API objects and give each gateway a PoP of
the policy's topology, readiness on /readyz and time to drain; every
``hedgerow`` flag the manifests pass must exist in the CLI (or in the
zero-trust plane's contract, tests/support/deploy_recipes.py); each role
runs its own image (deploy/Containerfile: test_deploy_image.py). And what a security
review asks of them: every container unprivileged on a read-only root, images
pinned, only the gateway's client port public, Redis behind TLS and an ACL,
no anonymous tenant, secrets only from Secrets. NetworkPolicies:
test_deploy_network_policy.py; systemd units: test_deploy_systemd.py.
"""

from __future__ import annotations

import re
import shlex
import tomllib
from typing import Any
from urllib.parse import urlsplit

import kubernetes_validate
import pytest

from hedgerow.errors import AuthenticationFailed
from policies.schema import Policy, parse_policy
from policies.tenancy import identify
from tests.support.deploy_recipes import (
    DEPLOY,
    K8S,
    ROOT,
    all_containers,
    arg,
    check_command_line,
    containers,
    effective_image,
    env_of,
    flags_of,
    hedgerow_containers,
    manifests,
    mounted,
    named,
    of_kind,
    pod_labels,
    pod_spec,
    workloads,
)

K8S_VERSION = "1.31"
REDIS_URL = "rediss://hedgerow:$(HEDGEROW_REDIS_PASSWORD)@redis:6380/0"
# Flags whose value is a file or directory the process reads.
FILE_FLAGS = ("--join-token-file", "--ca-file", "--redis-ca-file", "--certfile", "--keyfile",
              "--admin-token-file", "--ca-cert", "--ca-key", "--policy-dir", "--tls-cert",
              "--tls-key")
# ... and the ones it writes to.
WRITABLE_FLAGS = ("--state-dir", "--identity-dir")


def test_every_manifest_is_a_valid_kubernetes_object() -> None:
    for name, doc in manifests():
        if doc["kind"] == "Kustomization":
            listed = set(doc["resources"])
            assert listed == {p.name for p in K8S.glob("*.yaml")} - {name}
            continue
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_every_hedgerow_flag_in_the_manifests_exists() -> None:
    seen = set()
    for doc, container in hedgerow_containers():
        command, *args = container["args"]
        seen.add(command)
        try:
            check_command_line(command, args)
        except AssertionError as error:
            raise AssertionError(f"{doc['metadata']['name']}: {error}") from error
    assert seen == {"gateway", "worker", "control-plane"}


def policy() -> Policy:
    config = named("ConfigMap", "hedgerow-policy")
    return parse_policy(config["data"]["policy.yaml"], "deploy/kubernetes/policy.yaml")


def test_one_gateway_per_pop_of_the_topology_ready_on_readyz_with_time_to_drain() -> None:
    pops = {p.name for p in policy().topology.pops}
    gateways = hedgerow_containers("gateway")
    assert sorted(p for _, c in gateways for p in arg(c["args"], "--pop")) == sorted(pops)
    for doc, container in gateways:
        spec = doc["spec"]
        assert spec["replicas"] == 1
        assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
        drain = float(arg(container["args"], "--drain-timeout-s")[0])
        pre_stop = float(container["lifecycle"]["preStop"]["exec"]["command"][1])
        grace = spec["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace > pre_stop + drain + 2, "SIGKILL would cut streams still draining"


def test_workers_are_labelled_with_a_declared_pop_and_drain_before_sigkill() -> None:
    pops = {p.name for p in policy().topology.pops}
    workers = hedgerow_containers("worker")
    assert workers
    for doc, container in workers:
        labels = dict(v.split("=", 1) for v in arg(container["args"], "--label"))
        assert labels["pop"] in pops
        assert labels["pop"] == pod_spec(doc)["nodeSelector"]["hedgerow.dev/pop"]
        drain = float(arg(container["args"], "--drain-timeout-s")[0])
        assert pod_spec(doc)["terminationGracePeriodSeconds"] > drain


def test_each_gateway_process_has_its_admin_port_declared() -> None:
    """``--processes`` defaults to the pod's CPU limit and process i serves
    /metrics on --admin-port + i: the count must be explicit, and every admin
    port declared (Prometheus' pod discovery scrapes declared ports), or
    metrics undercount by the processes no one scrapes."""
    for doc, container in hedgerow_containers("gateway"):
        name = doc["metadata"]["name"]
        (processes,) = arg(container["args"], "--processes") or [None]
        assert processes is not None, f"{name}: --processes left to the CPU limit"
        first = int(arg(container["args"], "--admin-port")[0])
        declared = {p["containerPort"] for p in container["ports"]
                    if p["name"].startswith("admin")}
        assert declared == set(range(first, first + int(processes))), name


def test_probes_reach_a_listener_that_answers_without_a_client_certificate() -> None:
    """The kubelet presents no client certificate: a probe of a mutual-TLS
    listener would fail its handshake for ever and the pod never be ready."""
    for doc, container in hedgerow_containers():
        command = container["args"][0]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        if command == "worker":  # mutual TLS only: the port is all a kubelet can check
            for probe in ("readinessProbe", "livenessProbe"):
                assert ports[container[probe]["tcpSocket"]["port"]] == int(
                    arg(container["args"], "--port")[0])
            continue
        ready = container["readinessProbe"]["httpGet"]
        live = container["livenessProbe"]["httpGet"]
        assert ready["scheme"] == live["scheme"] == "HTTPS", doc["metadata"]["name"]
        if command == "control-plane":  # its join listener: TLS, server-auth only
            assert ready["path"] == live["path"] == "/healthz"
            assert ports[ready["port"]] == ports[live["port"]] == int(
                arg(container["args"], "--join-port")[0])
        else:  # the gateway's public port
            assert (ready["path"], live["path"]) == ("/readyz", "/healthz")
            assert ports[ready["port"]] == int(arg(container["args"], "--port")[0])


# --- every container unprivileged, on a read-only root -------------------------------------


def test_every_container_runs_unprivileged_on_a_read_only_root() -> None:
    found = 0
    for doc in workloads():
        spec = pod_spec(doc)
        name = doc["metadata"]["name"]
        assert spec["automountServiceAccountToken"] is False, name
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC")
        pod_context = spec.get("securityContext", {})
        for container in all_containers(spec):
            found += 1
            context = container["securityContext"]
            where = f"{name}/{container['name']}"
            assert context["runAsNonRoot"] is True, where
            uid = context.get("runAsUser", pod_context.get("runAsUser"))
            assert isinstance(uid, int) and uid > 0, f"{where}: a fixed non-root UID"
            assert context["readOnlyRootFilesystem"] is True, where
            assert context["allowPrivilegeEscalation"] is False, where
            assert context["capabilities"]["drop"] == ["ALL"], where
            assert not context["capabilities"].get("add"), where
            assert not context.get("privileged"), where
            seccomp = context.get("seccompProfile", pod_context.get("seccompProfile"))
            assert seccomp == {"type": "RuntimeDefault"}, where
    assert found >= 4


def test_every_container_has_requests_and_limits() -> None:
    for doc, container in containers():
        resources = container["resources"]
        where = f"{doc['metadata']['name']}/{container['name']}"
        assert {"cpu", "memory"} <= set(resources["requests"]), where
        assert {"cpu", "memory"} <= set(resources["limits"]), where


def test_what_hedgerow_writes_is_on_a_volume_and_what_it_reads_is_mounted() -> None:
    for doc, container in hedgerow_containers():
        args = container["args"]
        where = f"{doc['metadata']['name']}"
        tmp = mounted(doc, container, "/tmp")
        assert tmp is not None and "emptyDir" in tmp, f"{where}: Python and tempfile need /tmp"
        for flag in WRITABLE_FLAGS:
            for path in arg(args, flag):
                volume = mounted(doc, container, path)
                assert volume is not None and not volume["mount"].get("readOnly"), \
                    f"{where}: {flag} {path} is on the read-only root"
                assert {"emptyDir", "persistentVolumeClaim"} & set(volume), where
        for flag in FILE_FLAGS:
            for path in arg(args, flag):
                volume = mounted(doc, container, path)
                assert volume is not None and volume["mount"].get("readOnly"), \
                    f"{where}: {flag} {path} is not mounted read-only"


def test_identities_are_kept_in_memory() -> None:
    for doc, container in hedgerow_containers():
        for path in arg(container["args"], "--identity-dir"):
            volume = mounted(doc, container, path)
            assert volume is not None and volume["emptyDir"].get("medium") == "Memory"


def test_the_namespace_enforces_the_restricted_pod_security_standard() -> None:
    (namespace,) = of_kind("Namespace")
    assert namespace["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "restricted"


# --- images pinned -------------------------------------------------------------------------


def test_every_image_is_pinned_to_a_version() -> None:
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for doc, container in containers():
        image = effective_image(container["image"])
        where = f"{doc['metadata']['name']}: {image}"
        if "@sha256:" in image:
            continue
        name, _, tag = image.rpartition("/")[2].partition(":")
        assert tag and tag != "latest", f"{where}: no tag or :latest"
        assert re.fullmatch(r"v?\d+\.\d+\.\d+([.-][\w.-]+)?", tag), f"{where}: not a version"
        if container["image"].startswith("hedgerow-"):
            assert tag == version, f"{where}: the image of this release is {version}"
            assert container["image"] == f"hedgerow-{container['args'][0]}", \
                f"{where}: each role runs its own image (deploy/Containerfile's targets)"


# --- only the gateway's client port is public -----------------------------------------------


def selected(service: dict[str, Any]) -> list[dict[str, Any]]:
    wanted = service["spec"]["selector"].items()
    return [d for d in workloads() if wanted <= pod_labels(d).items()]


def test_only_the_gateways_client_port_is_exposed_outside_the_cluster() -> None:
    public = []
    for service in of_kind("Service"):
        spec = service["spec"]
        assert not spec.get("externalIPs"), service["metadata"]["name"]
        if spec.get("type", "ClusterIP") == "ClusterIP":
            continue
        public.append(service)
        assert {d["metadata"]["name"] for d in selected(service)} <= {
            d["metadata"]["name"] for d, _ in hedgerow_containers("gateway")}
        (gateway,) = selected(service)
        client_port = int(arg(pod_spec(gateway)["containers"][0]["args"], "--port")[0])
        assert {(p["targetPort"], p["protocol"]) for p in spec["ports"]} == {
            (client_port, "TCP"), (client_port, "UDP")}, service["metadata"]["name"]
    assert len(public) == len(hedgerow_containers("gateway"))


def test_no_workload_uses_the_host_network_or_host_ports() -> None:
    for doc, container in containers():
        assert not pod_spec(doc).get("hostNetwork")
        assert all("hostPort" not in p for p in container.get("ports", []))


def test_internal_listeners_bind_the_pod_address_not_every_address() -> None:
    for doc, container in hedgerow_containers():
        args = container["args"]
        for flag in ("--host", "--admin-host"):
            assert all(v == "$(POD_IP)" for v in arg(args, flag)), doc["metadata"]["name"]
        assert arg(args, "--host"), doc["metadata"]["name"]
        assert env_of(container)["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


# --- Redis: TLS only, ACL, and every client on rediss:// ------------------------------------


def redis_config() -> dict[str, str]:
    data: dict[str, str] = named("ConfigMap", "redis-config")["data"]
    return data


def redis_directives() -> dict[str, list[str]]:
    found: dict[str, list[str]] = {}
    for line in redis_config()["redis.conf"].splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, *values = shlex.split(line)
            found.setdefault(key, []).append(" ".join(values))
    return found


def test_redis_listens_on_tls_only() -> None:
    conf = redis_directives()
    assert conf["port"] == ["0"], "a plaintext port is open"
    (tls_port,) = conf["tls-port"]
    assert int(tls_port) > 0
    assert conf["tls-cert-file"] and conf["tls-key-file"]
    (redis,) = [d for d in workloads() if d["metadata"]["name"] == "redis"]
    (container,) = pod_spec(redis)["containers"]
    assert [p["containerPort"] for p in container["ports"]] == [int(tls_port)]
    service = named("Service", "redis")
    assert [p["port"] for p in service["spec"]["ports"]] == [int(tls_port)]
    for path in (conf["tls-cert-file"][0], conf["tls-key-file"][0]):
        volume = mounted(redis, container, path)
        assert volume is not None and volume["secret"]["secretName"] == "hedgerow-redis-tls"


def acl_users() -> dict[str, list[str]]:
    users = {}
    for line in redis_config()["users.acl.in"].splitlines():
        if line.strip():
            keyword, name, *rules = line.split()
            assert keyword == "user"
            users[name] = rules
    return users


def test_redis_admits_only_the_hedgerow_user_to_its_own_keys() -> None:
    users = acl_users()
    assert users["default"] == ["off"]
    assert set(users) == {"default", "hedgerow"}
    rules = users["hedgerow"]
    assert "on" in rules and "nopass" not in rules
    assert [r for r in rules if r.startswith("#")] == ["#@PASSWORD_SHA256@"]
    keys = [r for r in rules if r.startswith(("~", "%", "allkeys"))]
    assert "resetkeys" in rules and keys == ["~hedgerow:*"]
    assert "-@dangerous" in rules and "-@admin" in rules
    assert "aclfile" in redis_directives()


def test_every_redis_client_uses_rediss_with_the_password_from_a_secret() -> None:
    tls_port = int(redis_directives()["tls-port"][0])
    clients = 0
    for doc, container in hedgerow_containers():
        args, env = container["args"], env_of(container)
        assert not arg(args, "--redis"), "a Redis URL in the arguments shows its password"
        if "HEDGEROW_REDIS_URL" not in env:
            continue
        clients += 1
        url = urlsplit(env["HEDGEROW_REDIS_URL"]["value"])
        assert (url.scheme, url.hostname, url.port) == ("rediss", "redis", tls_port)
        assert (url.username, url.password) == ("hedgerow", "$(HEDGEROW_REDIS_PASSWORD)")
        names = list(env)
        assert names.index("HEDGEROW_REDIS_PASSWORD") < names.index("HEDGEROW_REDIS_URL")
        assert env["HEDGEROW_REDIS_PASSWORD"]["valueFrom"]["secretKeyRef"] == {
            "name": "hedgerow-redis-auth", "key": "password"}
        (ca,) = arg(args, "--redis-ca-file")
        volume = mounted(doc, container, ca)
        assert volume is not None
        assert volume.get("secret", {}).get("secretName") != "hedgerow-redis-tls", \
            "a Redis client gets the CA, never Redis' own key"
    assert clients == len(hedgerow_containers("gateway")) + len(hedgerow_containers("control-plane"))


def test_redis_hashes_the_same_password_its_clients_send() -> None:
    (redis,) = [d for d in workloads() if d["metadata"]["name"] == "redis"]
    (container,) = pod_spec(redis)["containers"]
    script = container["command"][-1]
    password_file = re.search(r"sha256sum < (\S+)", script)
    assert password_file is not None
    volume = mounted(redis, container, password_file[1])
    assert volume is not None
    assert volume["secret"]["secretName"] == "hedgerow-redis-auth"
    assert {"key": "password", "path": password_file[1].rsplit("/", 1)[1]} in volume["secret"]["items"]
    acl_file = redis_directives()["aclfile"][0]
    assert f"> {acl_file}" in script
    acl_volume = mounted(redis, container, acl_file)
    assert acl_volume is not None and acl_volume["emptyDir"]["medium"] == "Memory"


# --- tenants: no anonymous access on the public port ----------------------------------------


def test_the_shipped_policy_serves_no_anonymous_tenant() -> None:
    shipped = policy()
    assert shipped.anonymous_tenant is None
    with pytest.raises(AuthenticationFailed):
        identify(shipped, None)
    # No tenant with a key anyone could know: keys are added by the operator.
    assert all(not t.api_key_sha256 for t in shipped.tenants)


# --- secrets come from Secrets --------------------------------------------------------------


SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|(^|_)KEY($|_)", re.I)


def test_secrets_reach_containers_only_from_secrets() -> None:
    for doc, container in containers():
        where = f"{doc['metadata']['name']}/{container['name']}"
        for name, env in env_of(container).items():
            if SECRET_NAME.search(name):
                assert "secretKeyRef" in env.get("valueFrom", {}), f"{where}: {name} is a literal"
            assert not re.search(r"://[^:/@]+:[^$@/][^@/]*@", env.get("value", "")), \
                f"{where}: {name} has a password in it"
        for flag in flags_of(container.get("args", []) + container.get("command", [])):
            if flag not in FILE_FLAGS and not flag.endswith("-file"):
                assert not SECRET_NAME.search(flag), f"{where}: {flag} passes a secret as an argument"


def test_join_tokens_are_files_from_secrets() -> None:
    for doc, container in hedgerow_containers():
        command, *args = container["args"]
        if command == "control-plane":
            continue
        (token_file,) = arg(args, "--join-token-file")
        volume = mounted(doc, container, token_file)
        assert volume is not None and volume["mount"]["readOnly"]
        secret = volume["secret"]
        assert secret["secretName"] == f"hedgerow-join-{command}", "one token Secret per role"
        assert secret["defaultMode"] & 0o007 == 0, "a token readable by every user"
        assert "HEDGEROW_JOIN_TOKEN" not in env_of(container)
        (ca_file,) = arg(args, "--ca-file")
        ca = mounted(doc, container, ca_file)
        assert ca is not None and ca.get("secret", {}).get("secretName") != "hedgerow-ca", \
            "only the control plane may mount the CA's key"
        for url_flag in ("--control-plane", "--join-url"):
            assert urlsplit(arg(args, url_flag)[0]).scheme == "https"


def test_the_control_plane_keeps_its_state_and_brings_the_ca_from_a_secret() -> None:
    for doc, container in hedgerow_containers("control-plane"):
        args = container["args"]
        (state,) = arg(args, "--state-dir")
        volume = mounted(doc, container, state)
        assert volume is not None and "persistentVolumeClaim" in volume
        for flag in ("--ca-cert", "--ca-key"):
            (path,) = arg(args, flag)
            ca = mounted(doc, container, path)
            assert ca is not None and ca["secret"]["secretName"] == "hedgerow-ca"
        assert "--insecure-internal" not in args
    # Joins all reach the replica whose state holds the tokens.
    join = named("Service", "hedgerow-control-plane-join")
    assert join["spec"]["selector"]["statefulset.kubernetes.io/pod-name"].endswith("-0")


def test_no_secret_object_is_committed() -> None:
    assert not of_kind("Secret"), "create Secrets at deploy time; never commit them"
    kustomization = next(d for _, d in manifests() if d["kind"] == "Kustomization")
    assert "secretGenerator" not in kustomization
