"""Dense peak tensor throughput by exact GPU model and precision, for MFU.

Why exact: a fragment match gives a *wrong* MFU without a word ("NVIDIA L40" contains "L4", "NVIDIA A10G"
contains "A10", a MIG slice contains "A100"). The NVML name is split into words, vendor words and memory sizes
("NVIDIA", "Tesla", "GeForce", "Quadro", "80GB") are dropped, and what is left must equal a known model's words.
Anything else (a new GPU, a MIG slice, an H100 whose form factor the name does not say) gets no peak, so no MFU:
none is better than a wrong one.

Figures are TFLOP/s, dense (the datasheets' "with sparsity" figures halved), from NVIDIA's datasheets and
architecture whitepapers. GeForce and the L40 run fp16/bf16 tensor math with fp32 accumulate (what PyTorch
autocast uses) at half the fp16-accumulate rate; that is the figure here. "tf32" applies to fp32 training with
TF32 matmuls on (Ampere and newer); "fp32" to plain fp32. GPUs without bf16 units (Turing, Volta) have no bf16
entry: bf16 there is emulated and has no meaningful peak.
"""

from __future__ import annotations

import re

# model -> {precision: dense TFLOP/s}
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    # Blackwell. HGX B200 datasheet: 8 GPUs give FP16/BF16 36 PF, TF32 18 PF (sparse), FP32 600 TF -> per GPU, dense.
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    # Hopper. H100 datasheet (SXM | PCIe | NVL): BF16 1979 | 1513 | 1671, TF32 989 | 756 | 835 (sparse); FP32 67 | 51 | 60.
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # H200 datasheet (SXM | NVL): the H100 SXM | NVL compute figures.
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    # Ada. L4 datasheet: BF16 242, TF32 120 (sparse), FP32 30.3. L40 / L40S datasheets: BF16 181.05 / 362.05,
    # TF32 90.5 / 183 (dense), FP32 90.5 / 91.6. Ada whitepaper: RTX 4090 (fp32 accumulate) 165.2, TF32 82.6,
    # FP32 82.6; RTX 6000 Ada 364.2, TF32 182.1, FP32 91.1.
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "L40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX 6000 Ada": {"bf16": 364.2, "fp16": 364.2, "tf32": 182.1, "fp32": 91.1},
    # Ampere. A100 datasheet (SXM and PCIe alike): BF16 312, TF32 156, FP32 19.5. A30 / A40 / A10 datasheets:
    # BF16 165 / 149.7 / 125, TF32 82 / 74.8 / 62.5, FP32 10.3 / 37.4 / 31.2. GA102 whitepaper: RTX 3090
    # (fp32 accumulate) 71, TF32 35.6, FP32 35.6; RTX A6000 154.8, TF32 77.4, FP32 38.7.
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A30": {"bf16": 165.0, "fp16": 165.0, "tf32": 82.0, "fp32": 10.3},
    "A40": {"bf16": 149.7, "fp16": 149.7, "tf32": 74.8, "fp32": 37.4},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "RTX A6000": {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7},
    # Turing and Volta: no bf16, no TF32. T4 datasheet: FP16 mixed precision 65, FP32 8.1. V100 datasheet
    # (SXM2 | PCIe | V100S PCIe): tensor 125 | 112 | 130, FP32 15.7 | 14 | 16.4.
    "T4": {"fp16": 65.0, "fp32": 8.1},
    "V100 SXM2": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
    "V100S PCIe": {"fp16": 130.0, "fp32": 16.4},
    # Not here on purpose: the A10G (an AWS part; NVIDIA publishes no datasheet for it and third-party figures
    # disagree), GH200, consumer cards not listed. They get no MFU.
}

# the words an NVML name leaves after normalisation -> model
_MODEL_BY_WORDS: dict[tuple[str, ...], str] = {
    ("B200",): "B200",
    ("H100", "HBM3"): "H100 SXM", ("H100", "SXM5"): "H100 SXM",  # "NVIDIA H100 80GB HBM3" is the SXM5 board
    ("H100", "PCIE"): "H100 PCIe", ("H100", "HBM2E"): "H100 PCIe",
    ("H100", "NVL"): "H100 NVL",
    ("H200",): "H200", ("H200", "NVL"): "H200 NVL",
    ("L4",): "L4", ("L40",): "L40", ("L40S",): "L40S",
    ("RTX", "4090"): "RTX 4090", ("RTX", "6000", "ADA", "GENERATION"): "RTX 6000 Ada",
    ("A100", "SXM4"): "A100", ("A100", "SXM"): "A100", ("A100", "PCIE"): "A100", ("A100",): "A100",
    ("A30",): "A30", ("A40",): "A40", ("A10",): "A10",
    ("RTX", "3090"): "RTX 3090", ("RTX", "A6000"): "RTX A6000",
    ("T4",): "T4",
    ("V100", "SXM2"): "V100 SXM2", ("V100", "PCIE"): "V100 PCIe", ("V100S", "PCIE"): "V100S PCIe",
}
_VENDOR_WORDS = frozenset({"NVIDIA", "TESLA", "GEFORCE", "QUADRO"})
_MEMORY_SIZE = re.compile(r"\d+GB")


def gpu_model(gpu_name: str | None) -> str | None:
    """The model key of ``PEAK_TFLOPS`` for an NVML name ("NVIDIA A100-SXM4-80GB" -> "A100"), or None."""
    if not gpu_name:
        return None
    words = tuple(w for w in re.split(r"[\s\-_]+", gpu_name.upper())
                  if w and w not in _VENDOR_WORDS and not _MEMORY_SIZE.fullmatch(w))
    return _MODEL_BY_WORDS.get(words)


def peak_flops(gpu_name: str | None, precision: str, tf32: bool = False) -> float | None:
    """Peak FLOP/s for this GPU and training precision (bf16 | fp16 | fp32); None when unknown."""
    model = gpu_model(gpu_name)
    if model is None:
        return None
    table = PEAK_TFLOPS[model]
    key = precision if precision in ("bf16", "fp16") else ("tf32" if tf32 and "tf32" in table else "fp32")
    value = table.get(key)
    return None if value is None else value * 1e12
