"""deploy/Containerfile, read as a builder would: one multi-stage image per role.

No container engine runs here, so the recipe is parsed and checked for what a
review asks of it: each role (control-plane, gateway, worker) is a target
whose image copies a finished venv from its own build stage; every install is
from that role's hashed lock, with --no-deps, and Hedgerow itself as a wheel,
never editable; the images that run hold no compiler, run no pip, carry no test
tool and no torch; they run as the numeric user the manifests use; llama.cpp
is built with the Makefile's flags; the gateway carries the ONNX export made
in its build stage and points the embedder at it.
"""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from tests.support.deploy_recipes import DEPLOY, HEDGEROW, ROOT, hedgerow_containers

ROLES = ("control-plane", "gateway", "worker")
TOOLCHAIN = re.compile(r"build-essential|\bgcc\b|\bg\+\+|\bclang\b|\bcmake\b|\bgit\b|\bmake\b")
TEST_TOOLS = ("pytest", "mypy", "hypothesis", "playwright", "trustme", "kubernetes-validate")
SECRET_NAME = re.compile(r"TOKEN|PASSWORD|SECRET|(^|_)KEY($|_)", re.I)


@dataclass
class Stage:
    name: str
    base: str
    instructions: list[tuple[str, str]] = field(default_factory=list)  # (INSTRUCTION, rest)

    def all(self, kind: str) -> list[str]:
        return [rest for instruction, rest in self.instructions if instruction == kind]


def stages() -> dict[str, Stage]:
    text = re.sub(r"\\\n\s*", " ", (DEPLOY / "Containerfile").read_text())
    found: dict[str, Stage] = {}
    current: Stage | None = None
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        instruction, _, rest = line.partition(" ")
        if instruction == "FROM":
            words = rest.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else f"#{len(found)}"
            current = found[name] = Stage(name, words[0])
        elif current is not None:
            current.instructions.append((instruction, rest))
    return found


def chain(name: str) -> list[Stage]:
    """A stage and the stages it is built FROM, down to the base image."""
    known = stages()
    lineage = [known[name]]
    while lineage[-1].base in known:
        lineage.append(known[lineage[-1].base])
    return lineage


def runs(stage_chain: list[Stage]) -> list[str]:
    return [command for stage in stage_chain for command in stage.all("RUN")]


def pip_installs() -> list[tuple[str, list[str]]]:
    found = []
    for stage in stages().values():
        for command in stage.all("RUN"):
            for part in re.split(r"&&|;", command):
                words = shlex.split(part)
                if "pip" in " ".join(words[:3]) and "install" in words:
                    found.append((stage.name, words[words.index("install") + 1:]))
    return found


def test_each_role_is_a_target_that_copies_its_venv_from_its_own_build_stage() -> None:
    known = stages()
    for role in ROLES:
        assert role in known, f"no target {role}"
        lineage = chain(role)
        assert lineage[-1].base == "${BASE}"
        sources = {re.match(r"--from=(\S+)", rest)[1]  # type: ignore[index]
                   for stage in lineage for rest in stage.all("COPY") if rest.startswith("--from=")}
        assert sources == {f"build-{role}"}, f"{role} copies from {sources}"
        assert any("/opt/hedgerow/.venv" in rest for rest in known[role].all("COPY"))


def test_the_images_that_run_have_no_compiler_no_pip_and_no_test_tool() -> None:
    for role in ROLES:
        for command in runs(chain(role)):
            assert not TOOLCHAIN.search(command), f"{role}: {command}"
            assert "pip " not in command, f"{role} installs at its own stage: {command}"
            assert not any(tool in command for tool in TEST_TOOLS), f"{role}: {command}"
    for role in ROLES:  # and what they copy was built from a lock with no test tool, no torch
        lock = (ROOT / "locks" / f"{role}.txt").read_text()
        for tool in (*TEST_TOOLS, "torch", "sentence-transformers"):
            assert not re.search(rf"^{re.escape(tool)}==", lock, re.M), f"{tool} in {role}.txt"


def test_every_install_is_from_a_hashed_lock_or_hedgerows_wheel_never_editable() -> None:
    installs = pip_installs()
    assert installs
    locks_used = set()
    for stage, options in installs:
        assert "-e" not in options and "--editable" not in options, stage
        assert "--no-deps" in options, f"{stage}: pip would resolve beyond the lock"
        if "-r" in options:
            lock = options[options.index("-r") + 1]
            assert lock.startswith("/src/locks/") and "--require-hashes" in options, stage
            assert (ROOT / "locks" / lock.removeprefix("/src/locks/")).is_file(), lock
            locks_used.add((stage, lock.rsplit("/", 1)[1]))
        else:
            assert options[-1] == "/wheels/hedgerow-*.whl", f"{stage}: {options}"
    for role in ROLES:
        assert (f"build-{role}", f"{role}.txt") in locks_used
    assert ("build-gateway", "export.txt") in locks_used
    assert not any(lock == "dev.txt" for _, lock in locks_used), "dev.txt is for development"


def test_the_worker_builds_llama_cpp_with_the_makefiles_flags_and_version() -> None:
    makefile = (ROOT / "Makefile").read_text()
    flags = re.search(r"^LLAMA_CMAKE_ARGS := (.*)$", makefile, re.M)
    version = re.search(r"^LLAMA_VERSION := (.*)$", makefile, re.M)
    assert flags is not None and version is not None
    build = stages()["build-worker"]
    (arg,) = [a for a in build.all("ARG") if a.startswith("LLAMA_CMAKE_ARGS=")]
    assert " ".join(shlex.split(arg.partition("=")[2])) == flags[1].strip()
    assert any('CMAKE_ARGS="$LLAMA_CMAKE_ARGS"' in command for command in build.all("RUN"))
    lock = (ROOT / "locks" / "worker.txt").read_text()
    assert re.search(rf"^llama-cpp-python=={re.escape(version[1].strip())} ", lock, re.M)


def test_the_gateway_image_carries_the_onnx_export_and_points_the_embedder_at_it() -> None:
    build = stages()["build-gateway"]
    assert any("HEDGEROW_ONNX_CACHE=/opt/hedgerow/onnx" in c and "cache export-model" in c
               and "rm -rf /tmp/export" in c for c in build.all("RUN"))
    gateway = stages()["gateway"]
    assert "--from=build-gateway /opt/hedgerow/onnx /opt/hedgerow/onnx" in gateway.all("COPY")
    assert "HEDGEROW_ONNX_CACHE=/opt/hedgerow/onnx" in gateway.all("ENV")


def test_the_images_run_as_a_fixed_unprivileged_user_the_manifests_use() -> None:
    uids = set()
    for role in ROLES:
        users = [u for stage in reversed(chain(role)) for u in stage.all("USER")]
        assert users, f"{role} would run as root"
        uid, _, _ = users[-1].partition(":")
        assert uid.isdigit() and int(uid) > 0, "numeric, so runAsNonRoot can check it"
        uids.add(int(uid))
        entrypoint = [e for stage in reversed(chain(role)) for e in stage.all("ENTRYPOINT")]
        assert entrypoint and HEDGEROW in entrypoint[-1]
    (uid,) = uids
    for doc, container in hedgerow_containers():
        assert container["securityContext"]["runAsUser"] == uid


def test_the_image_holds_no_secret_and_copies_what_the_package_needs() -> None:
    import tomllib

    for stage in stages().values():
        for kind in ("ARG", "ENV"):
            for rest in stage.all(kind):
                assert not SECRET_NAME.search(rest.split("=")[0]), rest
        for rest in stage.all("COPY"):
            assert not re.search(r"\.hedgerow|\.pem|\.key|\.env|token", rest), rest
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = {p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]["include"]}
    copied = {part.strip("./") for rest in stages()["source"].all("COPY")
              for part in rest.split()[:-1]}
    assert packages | {"pyproject.toml", "locks", pyproject["project"]["readme"]} <= copied
