"""Peak lookup by exact GPU model from the NVML name: a near name is another GPU, and an unknown GPU has no peak."""

import pytest

from hf_gpu_train.hardware.peaks import gpu_model, peak_flops
from hf_gpu_train.hardware.snapshot import load_machine, reference_machine_names

T = 1e12


@pytest.mark.parametrize("name, precision, tf32, tflops", [
    ("NVIDIA A100-SXM4-80GB", "bf16", False, 312.0),
    ("NVIDIA A100-SXM4-40GB", "fp32", True, 156.0),
    ("NVIDIA A100 80GB PCIe", "fp16", False, 312.0),
    ("NVIDIA A100-PCIE-40GB", "fp32", False, 19.5),
    ("NVIDIA H100 80GB HBM3", "bf16", False, 989.4),
    ("NVIDIA H100 PCIe", "bf16", False, 756.5),
    ("NVIDIA H100 NVL", "bf16", False, 835.5),
    ("NVIDIA H200", "bf16", False, 989.4),
    ("NVIDIA H200 NVL", "bf16", False, 835.5),
    ("NVIDIA B200", "bf16", False, 2250.0),
    ("NVIDIA L4", "bf16", False, 121.0),
    ("NVIDIA L40", "bf16", False, 181.05),
    ("NVIDIA L40S", "bf16", False, 362.05),
    ("NVIDIA A10", "bf16", False, 125.0),
    ("NVIDIA A30", "bf16", False, 165.0),
    ("NVIDIA A40", "bf16", False, 149.7),
    ("Tesla T4", "fp16", False, 65.0),
    ("Tesla V100-SXM2-16GB", "fp16", False, 125.0),
    ("Tesla V100-PCIE-32GB", "fp16", False, 112.0),
    ("Tesla V100S-PCIE-32GB", "fp16", False, 130.0),
    ("NVIDIA GeForce RTX 3090", "bf16", False, 71.0),
    ("NVIDIA GeForce RTX 4090", "bf16", False, 165.2),
    ("NVIDIA RTX A6000", "bf16", False, 154.8),
    ("NVIDIA RTX 6000 Ada Generation", "bf16", False, 364.2),
])
def test_exact_nvml_names_get_their_own_datasheet_peak(name, precision, tf32, tflops):
    assert peak_flops(name, precision, tf32=tf32) == pytest.approx(tflops * T)


@pytest.mark.parametrize("name, other", [
    ("NVIDIA L40", "NVIDIA L4"), ("NVIDIA L40S", "NVIDIA L40"), ("NVIDIA A10", "NVIDIA A100-SXM4-80GB"),
    ("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3"), ("NVIDIA H100 NVL", "NVIDIA H100 PCIe"),
])
def test_a_near_name_is_a_different_gpu(name, other):
    assert gpu_model(name) != gpu_model(other)
    assert peak_flops(name, "bf16") != peak_flops(other, "bf16")


@pytest.mark.parametrize("name", [
    "NVIDIA A10G",  # AWS part: NVIDIA publishes no datasheet for it; third-party figures disagree (70 vs 125 TFLOP/s)
    "NVIDIA A100-SXM4-40GB MIG 1g.5gb",  # a MIG slice has a fraction of the GPU's peak
    "NVIDIA GeForce RTX 4090 D", "NVIDIA GeForce RTX 3090 Ti", "Quadro RTX 6000", "NVIDIA H100",
    "NVIDIA Graphics Device", "", None,
])
def test_unknown_or_ambiguous_gpus_have_no_peak(name):
    assert peak_flops(name, "bf16") is None and peak_flops(name, "fp32", tf32=True) is None


def test_no_bf16_peak_on_gpus_without_bf16_units():
    assert peak_flops("Tesla T4", "bf16") is None and peak_flops("Tesla V100-SXM2-16GB", "bf16") is None
    assert peak_flops("Tesla T4", "fp32", tf32=True) == pytest.approx(8.1 * T)  # no TF32 before Ampere: plain fp32


def test_every_reference_machine_gpu_has_a_peak():
    names = {g.name for m in reference_machine_names() for g in load_machine(m).gpus}
    assert names and all(peak_flops(n, "fp16") for n in names), names
