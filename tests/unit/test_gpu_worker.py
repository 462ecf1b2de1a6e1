"""A worker on a GPU, without one: detection through ggml's device list, the
worker's defaults there (all layers offloaded, several slots), and its
registration as ``kind: gpu`` with the GPU's name and memory, seen through a
real in-process control plane (mutual TLS, as by default: the worker joins with a
token, the test and the CLI call as the admin)."""

from __future__ import annotations

import datetime
import sys
import types
from functools import partial
from pathlib import Path
from typing import Any

import anyio
import anyio.to_thread
import httpx
import pytest

from bench.stack import free_port
from control_plane.main import TrustOptions, run_control_plane
from hedgerow.cli import build_parser
from hedgerow.trust.credentials import Credentials, TlsContexts
from hedgerow.trust.identity import Identity
from hedgerow.trust.join import JoinOptions, ensure_identity
from hedgerow.trust.process import InternalTls
from hedgerow.wire import RegistrySnapshot
from workers import device as device_module
from workers.device import CPU_DEVICE, DEFAULT_GPU_SLOTS, DeviceInfo, _ggml_gpus, detect_device
from workers.main import WorkerOptions, build_llama_backend, run_worker
from workers.sim_backend import LatencyModel, SimBackend

MIB = 1024 * 1024
H200 = DeviceInfo("gpu", "NVIDIA H200", 143771 * MIB)
MODEL = "smollm2-135m-instruct"


# -- ggml's device list (the fallback when nvidia-smi is missing) -------------


class FakeGgml:
    """The five ggml device functions ``_ggml_gpus`` calls, over a list of devices."""

    def __init__(self, devices: list[tuple[int, bytes, int]]) -> None:  # (type, description, total)
        self.devices = devices
        self.ggml_backend_dev_count = lambda: len(devices)
        self.ggml_backend_dev_get = lambda index: index
        self.ggml_backend_dev_type = lambda dev: devices[dev][0]
        self.ggml_backend_dev_description = lambda dev: devices[dev][1]

        def memory(dev: int, free: Any, total: Any) -> None:  # free, total: ctypes.byref(c_size_t)
            total._obj.value = devices[dev][2]
            free._obj.value = devices[dev][2] // 2

        self.ggml_backend_dev_memory = memory


def test_ggml_lists_only_gpu_devices_with_their_total_memory() -> None:
    lib = FakeGgml([(0, b"AMD EPYC (CPU)", 64 << 30), (1, b"NVIDIA H200", 143771 * MIB),
                    (3, b"AMX", 0)])
    assert _ggml_gpus(lib) == [("NVIDIA H200", 143771 * MIB)]  # type: ignore[arg-type]


def test_a_cpu_only_ggml_lists_no_gpu() -> None:
    assert _ggml_gpus(FakeGgml([(0, b"CPU", 64 << 30)])) == []  # type: ignore[arg-type]


def test_the_installed_llama_cpp_lists_its_devices_through_the_same_calls() -> None:
    import llama_cpp
    from llama_cpp._ggml import libggml

    gpus = _ggml_gpus(libggml)
    assert libggml.ggml_backend_dev_count() >= 1  # the CPU, at least
    assert all(name and total > 0 for name, total in gpus)
    if not llama_cpp.llama_supports_gpu_offload():  # the CPU build `make` installs
        assert gpus == []


def test_detection_falls_back_to_ggml_when_nvidia_smi_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(device_module, "query_nvidia_smi", lambda: None)
    monkeypatch.setattr(device_module, "query_ggml_gpus", lambda: "NVIDIA H200, 143771\n")
    assert detect_device() == H200


def test_detection_prefers_nvidia_smi(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "llama_supports_gpu_offload", lambda: True)
    monkeypatch.setattr(device_module, "query_nvidia_smi", lambda: "NVIDIA L4, 23034\n")
    monkeypatch.setattr(device_module, "query_ggml_gpus", lambda: pytest.fail("ggml asked"))
    assert detect_device() == DeviceInfo("gpu", "NVIDIA L4", 23034 * MIB)


def test_a_cpu_build_never_queries_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(device_module, "llama_supports_gpu_offload", lambda: False)
    monkeypatch.setattr(device_module, "query_nvidia_smi", lambda: pytest.fail("nvidia-smi run"))
    monkeypatch.setattr(device_module, "query_ggml_gpus", lambda: pytest.fail("ggml asked"))
    assert detect_device() == CPU_DEVICE


def test_a_gpu_runs_several_slots_by_default_and_a_cpu_one() -> None:
    assert H200.default_slots == DEFAULT_GPU_SLOTS > 1
    assert CPU_DEVICE.default_slots == 1


# -- the worker's choices on a GPU ---------------------------------------------


class RecordedBackend:
    """Stands in for LlamaBackend: keeps what the worker asked it to load."""

    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


@pytest.fixture
def on_h200(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """detect_device finds an H200; LlamaBackend records instead of loading (no llama.cpp needed)."""
    monkeypatch.setattr(device_module, "detect_device", lambda: H200)
    monkeypatch.setitem(sys.modules, "workers.llama_backend",
                        types.SimpleNamespace(LlamaBackend=RecordedBackend))
    model = tmp_path / "model.gguf"
    model.write_bytes(b"GGUF")
    return model


def test_gpu_worker_offloads_every_layer_with_several_slots(on_h200: Path) -> None:
    backend: Any = build_llama_backend(WorkerOptions(model_path=on_h200))
    assert backend.kwargs["n_gpu_layers"] == -1
    assert backend.kwargs["slots"] == DEFAULT_GPU_SLOTS
    assert backend.kwargs["device"] == H200


def test_gpu_layers_and_slots_can_be_set(on_h200: Path) -> None:
    backend: Any = build_llama_backend(WorkerOptions(model_path=on_h200, n_gpu_layers=12, slots=8))
    assert (backend.kwargs["n_gpu_layers"], backend.kwargs["slots"]) == (12, 8)


def test_zero_gpu_layers_makes_a_cpu_worker_on_a_gpu_machine(on_h200: Path) -> None:
    backend: Any = build_llama_backend(WorkerOptions(model_path=on_h200, n_gpu_layers=0))
    assert backend.kwargs["n_gpu_layers"] == 0
    assert backend.kwargs["slots"] == 1
    assert backend.kwargs["device"] == CPU_DEVICE


# -- registration ---------------------------------------------------------------


class GpuSimBackend(SimBackend):
    """A simulated model that says it runs on an H200, as a CUDA LlamaBackend would."""

    kind = "gpu"
    device = H200.name
    device_memory_bytes = H200.memory_bytes


def _join_as_worker(state: Path, control_plane: str, join_port: int, token: str,
                    worker_id: str) -> InternalTls:
    creds = ensure_identity(JoinOptions(
        identity=Identity("worker", worker_id), identity_dir=state / "worker-identity",
        control_plane=control_plane, join_url=f"https://127.0.0.1:{join_port}", token=token,
        ca_file=state / "ca" / "ca.pem"), datetime.datetime.now(datetime.UTC))
    return InternalTls(TlsContexts(creds), control_plane)


@pytest.mark.anyio
async def test_gpu_worker_registers_as_gpu_with_its_device_name_and_memory(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    backend = GpuSimBackend(MODEL, DEFAULT_GPU_SLOTS, LatencyModel(), 1)
    stop_cp, stop_worker = anyio.Event(), anyio.Event()
    state, join_port = tmp_path / "control-plane", free_port()
    trust = TrustOptions(state_dir=state, join_port=join_port)
    async with anyio.create_task_group() as tg:
        cp_port = await tg.start(partial(run_control_plane, trust_options=trust),
                                 "127.0.0.1", 0, stop_cp)
        control_plane = f"https://127.0.0.1:{cp_port}"
        admin = TlsContexts(Credentials(state / "admin")).client()
        async with httpx.AsyncClient(base_url=control_plane, verify=admin) as client:
            minted = await client.post("/v1/tokens", json={"role": "worker", "ttl_s": 600})
            assert minted.status_code == 201, minted.text
            tls = await anyio.to_thread.run_sync(
                _join_as_worker, state, control_plane, join_port, minted.json()["token"],
                "gpu-test")
            options = WorkerOptions(control_plane=control_plane, worker_id="gpu-test", tls=tls)
            async with anyio.create_task_group() as worker:
                await worker.start(run_worker, options, backend, stop_worker)
                with anyio.fail_after(10):
                    while not (snapshot := RegistrySnapshot.model_validate(
                            (await client.get("/v1/workers")).json())).workers:
                        await anyio.sleep(0.05)
                status = (await client.get("/v1/status")).json()
                cli = build_parser().parse_args(["status", "--control-plane", control_plane,
                                                 "--admin-identity", str(state / "admin")])
                assert await anyio.to_thread.run_sync(cli.run, cli) == 0
                stop_worker.set()  # drains and deregisters while the control plane still runs
        stop_cp.set()
    assert snapshot.workers[0].registration.url.startswith("https://127.0.0.1:")
    registration = snapshot.workers[0].registration
    assert (registration.kind, registration.device, registration.device_memory_bytes) == (
        "gpu", "NVIDIA H200", 143771 * MIB)
    assert registration.slots == DEFAULT_GPU_SLOTS
    row = status["workers"][0]
    assert (row["kind"], row["device"], row["device_memory_bytes"]) == ("gpu", "NVIDIA H200", 143771 * MIB)
    assert "gpu-test" in (printed := capsys.readouterr().out)
    assert "gpu  (NVIDIA H200, 140 GiB) slots 4" in printed
