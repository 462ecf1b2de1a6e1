"""What a worker runs its model on: a GPU (llama.cpp offload) or the CPU.

The decision is the pure ``classify_device``; ``detect_device`` only gathers
its two inputs (does this llama.cpp build offload to a GPU, and what does
``nvidia-smi`` report) and never raises.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from typing import Literal

NVIDIA_SMI_QUERY = ("--query-gpu=name,memory.total", "--format=csv,noheader,nounits")
NVIDIA_SMI_TIMEOUT_S = 5.0
_MIB = 1024 * 1024


@dataclass(frozen=True)
class DeviceInfo:
    kind: Literal["gpu", "cpu"]
    name: str | None
    memory_bytes: int | None

    @property
    def gpu_layers(self) -> int:
        """llama.cpp's ``n_gpu_layers`` for this device: all layers on a GPU, none on a CPU."""
        return -1 if self.kind == "gpu" else 0


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
    return classify_device(llama_supports_gpu_offload(), query_nvidia_smi())


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


def _parse_smi_line(line: str) -> DeviceInfo | None:
    name, separator, memory = line.rpartition(",")
    name, memory = name.strip(), memory.strip()
    if not separator or not name or not memory.isdigit():
        return None
    return DeviceInfo(kind="gpu", name=name, memory_bytes=int(memory) * _MIB)
