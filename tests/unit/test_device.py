from __future__ import annotations

import pytest

from workers.device import CPU_DEVICE, DeviceInfo, classify_device

H200_SMI = "NVIDIA H200, 143771\n"
MIB = 1024 * 1024


def test_gpu_when_llama_offloads_and_nvidia_smi_lists_a_device() -> None:
    assert classify_device(True, H200_SMI) == DeviceInfo("gpu", "NVIDIA H200", 143771 * MIB)


def test_cpu_when_llama_was_built_without_gpu_offload_even_on_a_gpu_machine() -> None:
    assert classify_device(False, H200_SMI) == CPU_DEVICE


def test_cpu_when_nvidia_smi_is_missing_or_failed() -> None:
    assert classify_device(True, None) == CPU_DEVICE


@pytest.mark.parametrize(
    "smi_output",
    [
        "",
        "\n",
        "No devices were found\n",
        "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
        "NVIDIA H200, [N/A]\n",
        ", 143771\n",
    ],
)
def test_cpu_when_nvidia_smi_reports_no_usable_device(smi_output: str) -> None:
    assert classify_device(True, smi_output) == CPU_DEVICE


def test_first_gpu_is_the_one_llama_uses() -> None:
    smi = "NVIDIA A100-SXM4-80GB, 81920\nNVIDIA L4, 23034\n"
    assert classify_device(True, smi) == DeviceInfo("gpu", "NVIDIA A100-SXM4-80GB", 81920 * MIB)


def test_unparseable_lines_before_a_device_line_are_skipped() -> None:
    smi = "WARNING: infoROM is corrupted at gpu 0000:00:04.0\nTesla T4, 15360\n"
    assert classify_device(True, smi) == DeviceInfo("gpu", "Tesla T4", 15360 * MIB)


def test_whitespace_around_fields_is_ignored() -> None:
    assert classify_device(True, "  NVIDIA L4 ,  23034  \r\n") == DeviceInfo("gpu", "NVIDIA L4", 23034 * MIB)


def test_gpu_layers_offload_everything_on_a_gpu_and_nothing_on_a_cpu() -> None:
    assert classify_device(True, H200_SMI).gpu_layers == -1
    assert CPU_DEVICE.gpu_layers == 0
