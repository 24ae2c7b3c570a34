"""Throughput and MFU: peak FLOP/s by device kind (dense bf16, per chip), overridable in
`[measure] peak_tflops`. FLOPs per step come from XLA's `compiled.cost_analysis()` of the step."""

from __future__ import annotations

from typing import Any

# Vendor datasheet dense (no sparsity) bf16 peak, TFLOP/s per device.
PEAK_TFLOPS = {
    "H200": 989.0,
    "H100": 989.0,
    "A100": 312.0,
    "L4": 121.0,
    "A10G": 125.0,
    "TPU v4": 275.0,
    "TPU v5 lite": 197.0,
    "TPU v5e": 197.0,
    "TPU v5p": 459.0,
    "TPU v6 lite": 918.0,
}


def peak_flops_per_device(device: Any, override_tflops: float = 0.0) -> float | None:
    if override_tflops > 0:
        return override_tflops * 1e12
    kind = getattr(device, "device_kind", "")
    for name, tflops in PEAK_TFLOPS.items():
        if name.lower() in kind.lower():
            return tflops * 1e12
    return None


def step_flops(compiled: Any) -> float | None:
    """FLOPs of one call of a compiled step ON ONE DEVICE: XLA's `cost_analysis()` counts the
    SPMD-partitioned program each device runs (None where the backend does not say)."""
    try:
        cost = compiled.cost_analysis()
        cost = cost[0] if isinstance(cost, list | tuple) else cost
        flops = float(cost.get("flops", 0.0)) if cost else 0.0
    except Exception:  # cost analysis is best effort on some backends
        return None
    return flops if flops > 0 else None


def mfu(flops_per_device_step: float, step_s: float, peak_per_device: float) -> float:
    """Model FLOPs utilisation: the FLOP/s one device achieves over its peak. Per device on
    both sides, so the same global batch gives the same MFU on 1 device or on N (each doing
    1/N of the work in, ideally, 1/N of the time)."""
    return flops_per_device_step / step_s / peak_per_device
