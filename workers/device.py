"""What a worker runs its model on: a GPU (llama.cpp offload) or the CPU.

The decision is the pure ``classify_device``; ``detect_device`` only gathers
its two inputs (does this llama.cpp build offload to a GPU, and which GPU:
``nvidia-smi``'s report, or where nvidia-smi is missing, the GPUs llama.cpp's
own ggml backends list, in the same ``name, MiB`` form) and never raises.

A GPU worker runs ``DEFAULT_GPU_SLOTS`` slots unless told otherwise: each slot
is its own model instance with its own KV cache on the GPU, and one GPU
decodes several streams at once with little loss per stream, where a CPU's
cores are better spent on one.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

from hedgerow.decimal_text import parse_decimal

NVIDIA_SMI_QUERY = ("--query-gpu=name,memory.total", "--format=csv,noheader,nounits")
NVIDIA_SMI_TIMEOUT_S = 5.0
_MIB = 1024 * 1024
DEFAULT_GPU_SLOTS = 4
_GGML_DEVICE_TYPE_GPU = 1  # enum ggml_backend_dev_type: CPU, GPU, IGPU, ACCEL


@dataclass(frozen=True)
class DeviceInfo:
    kind: Literal["gpu", "cpu"]
    name: str | None
    memory_bytes: int | None

    @property
    def gpu_layers(self) -> int:
        """llama.cpp's ``n_gpu_layers`` for this device: all layers on a GPU, none on a CPU."""
        return -1 if self.kind == "gpu" else 0

    @property
    def default_slots(self) -> int:
        """Model instances (concurrent generations) when ``--slots`` is not given."""
        return DEFAULT_GPU_SLOTS if self.kind == "gpu" else 1


CPU_DEVICE = DeviceInfo(kind="cpu", name=None, memory_bytes=None)


def classify_device(supports_offload: bool, smi_output: str | None) -> DeviceInfo:
    """GPU only when llama.cpp can offload and nvidia-smi lists a device.

    ``smi_output`` is nvidia-smi's ``name, memory.total`` CSV (MiB, no header),
    or None when nvidia-smi is missing or failed. The first listed GPU is the
    one llama.cpp uses by default (main_gpu=0). Lines that are not
    ``<name>, <integer>`` (driver error messages) are ignored.
    """
    if not supports_offload or smi_output is None:
        return CPU_DEVICE
    for line in smi_output.splitlines():
        device = _parse_smi_line(line)
        if device is not None:
            return device
    return CPU_DEVICE


def detect_device() -> DeviceInfo:
    if not llama_supports_gpu_offload():  # a CPU build: never touch the GPU stack
        return CPU_DEVICE
    return classify_device(True, query_nvidia_smi() or query_ggml_gpus())


def llama_supports_gpu_offload() -> bool:
    try:
        import llama_cpp
    except ImportError:
        return False
    return bool(llama_cpp.llama_supports_gpu_offload())


def query_nvidia_smi() -> str | None:
    binary = shutil.which("nvidia-smi")
    if binary is None:
        return None
    try:
        completed = subprocess.run(
            [binary, *NVIDIA_SMI_QUERY],
            capture_output=True,
            text=True,
            timeout=NVIDIA_SMI_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return completed.stdout if completed.returncode == 0 else None


def query_ggml_gpus() -> str | None:
    """The GPUs llama.cpp's ggml backends list, as ``name, MiB`` lines (like nvidia-smi's).

    None when none is listed or the library lacks the device API. Asking a
    CUDA device for its memory creates its CUDA context, as loading a model
    would anyway.
    """
    try:
        from llama_cpp._ggml import libggml

        return "".join(f"{name}, {total // _MIB}\n" for name, total in _ggml_gpus(libggml)) or None
    except (ImportError, OSError, AttributeError):
        return None


def _ggml_gpus(lib: ctypes.CDLL) -> list[tuple[str, int]]:
    lib.ggml_backend_dev_count.restype = ctypes.c_size_t
    lib.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    lib.ggml_backend_dev_get.restype = ctypes.c_void_p
    lib.ggml_backend_dev_type.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_type.restype = ctypes.c_int
    lib.ggml_backend_dev_description.argtypes = [ctypes.c_void_p]
    lib.ggml_backend_dev_description.restype = ctypes.c_char_p
    lib.ggml_backend_dev_memory.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t),
                                            ctypes.POINTER(ctypes.c_size_t)]
    lib.ggml_backend_dev_memory.restype = None
    gpus = []
    for index in range(lib.ggml_backend_dev_count()):
        device = lib.ggml_backend_dev_get(index)
        if lib.ggml_backend_dev_type(device) != _GGML_DEVICE_TYPE_GPU:
            continue
        free, total = ctypes.c_size_t(), ctypes.c_size_t()
        lib.ggml_backend_dev_memory(device, ctypes.byref(free), ctypes.byref(total))
        name = (lib.ggml_backend_dev_description(device) or b"").decode(errors="replace")
        gpus.append((name.replace(",", " "), int(total.value)))
    return gpus


def _parse_smi_line(line: str) -> DeviceInfo | None:
    name, separator, memory = line.rpartition(",")
    name, memory = name.strip(), memory.strip()
    mib = parse_decimal(memory)
    if not separator or not name or mib is None:
        return None
    return DeviceInfo(kind="gpu", name=name, memory_bytes=mib * _MIB)
