"""Dense peak tensor throughput by GPU model and precision, for MFU.

TFLOP/s, dense (no sparsity), from NVIDIA datasheets; GeForce figures are fp16/bf16 tensor with
fp32 accumulate (what PyTorch autocast uses). "tf32" applies to fp32 training with TF32 matmuls on
(Ampere and newer); "fp32" to plain fp32. Order matters: the first matching name wins, so the
specific spellings come before the general ones ("A100" before "A10", "H100 NVL" before "H100").
"""

from __future__ import annotations

# name fragment -> {precision: TFLOP/s}
PEAK_TFLOPS: list[tuple[str, dict[str, float]]] = [
    ("B200", {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0}),  # B200 datasheet (dense)
    ("H200", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # H200 SXM datasheet
    ("H100 NVL", {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0}),
    ("H100 PCIe", {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2}),
    ("H100", {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9}),  # SXM5 (HBM3)
    ("A100", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
    ("L40S", {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6}),
    ("L4", {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3}),
    ("A10", {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2}),
    ("RTX 4090", {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6}),
    ("RTX 3090", {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6}),
    ("V100", {"fp16": 125.0, "fp32": 15.7}),  # SXM2
    ("T4", {"fp16": 65.0, "fp32": 8.1}),
]


def peak_flops(gpu_name: str | None, precision: str, tf32: bool = False) -> float | None:
    """Peak FLOP/s for this GPU and training precision (bf16 | fp16 | fp32); None when unknown."""
    if not gpu_name:
        return None
    key = precision if precision in ("bf16", "fp16") else ("tf32" if tf32 else "fp32")
    for fragment, table in PEAK_TFLOPS:
        if fragment in gpu_name:
            value = table.get(key)
            return None if value is None else value * 1e12
    return None
