"""Throughput and MFU: peak FLOP/s by device kind (dense bf16, per chip), overridable in
`[measure] peak_tflops`. FLOPs per step are the step's matmul FLOPs counted from its jaxpr
(`matmul_flops`: a scan's body once per iteration, recomputed blocks as often as they run), one
device's share of them; XLA's `compiled.cost_analysis()` only where the step has no matmul."""

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


def flops_per_device(closed_jaxpr: Any | None, compiled: Any, n_devices: int) -> float | None:
    """One device's FLOPs of one step: the traced step's matmul FLOPs (the whole, global batch)
    over the devices that share it; XLA's count of the partitioned program (`step_flops`) for a
    step without a matmul. XLA's count is not used otherwise: it counts a loop's body once, so a
    step with scanned layers, micro-batches or PGD steps read ~10-30x low on it."""
    total = matmul_flops(closed_jaxpr) if closed_jaxpr is not None else 0.0
    if total > 0:
        return total / max(n_devices, 1)
    return step_flops(compiled)


def device_peak_bytes(devices: Any) -> int | None:
    """The largest peak device memory of `devices` since the process started: buffers
    (`peak_bytes_in_use`) plus the runtime's reservations (`peak_bytes_reserved`), since a TPU
    runtime reserves an executable's temporaries apart from the buffers in use (on a v5e a
    program with 0.375 GiB of temporaries left peak_bytes_in_use unchanged). The two maxima may
    come at different moments: an upper bound of the real peak. None where the backend keeps
    no statistics (XLA:CPU)."""
    peaks = []
    for d in devices:
        m = d.memory_stats() if hasattr(d, "memory_stats") else None
        if m and "peak_bytes_in_use" in m:
            peaks.append(int(m["peak_bytes_in_use"]) + int(m.get("peak_bytes_reserved", 0)))
    return max(peaks) if peaks else None


def mfu(flops_per_device_step: float, step_s: float, peak_per_device: float) -> float:
    """Model FLOPs utilisation: the FLOP/s one device achieves over its peak. Per device on
    both sides, so the same global batch gives the same MFU on 1 device or on N (each doing
    1/N of the work in, ideally, 1/N of the time)."""
    return flops_per_device_step / step_s / peak_per_device


def matmul_flops(closed_jaxpr: Any) -> float:
    """2 M N K of every `dot_general` of a traced program (`jax.make_jaxpr(fn)(*args)`, for the
    shapes it was traced with), a scan's body counted once per iteration, a `cond` by its
    costliest branch, rematerialised blocks as often as they run. XLA's `cost_analysis()`
    counts a loop's body once (XLA:TPU states one matmul's FLOPs for a 10-step scan of them),
    so a step whose layers, micro-batches or ascent steps run as scans is undercounted there;
    this is the count to put over a device's peak. A `while` loop (no static trip count)
    counts its body once."""
    import math

    def walk(jaxpr: Any) -> float:
        total = 0.0
        for eqn in jaxpr.eqns:
            name = eqn.primitive.name
            if name == "dot_general":
                (_, rc), (_, rb) = eqn.params["dimension_numbers"]
                lhs, rhs = eqn.invars[0].aval.shape, eqn.invars[1].aval.shape
                n = math.prod(d for i, d in enumerate(rhs) if i not in (*rc, *rb))
                total += 2.0 * math.prod(lhs) * n  # lhs = batch x M x K
            elif name == "scan":
                total += eqn.params["length"] * walk(eqn.params["jaxpr"].jaxpr)
            elif name == "cond":
                total += max(walk(b.jaxpr) for b in eqn.params["branches"])
            else:
                for v in eqn.params.values():
                    if hasattr(v, "eqns"):  # a Jaxpr (remat, shard_map)
                        total += walk(v)
                    elif hasattr(v, "jaxpr") and hasattr(v.jaxpr, "eqns"):  # a ClosedJaxpr
                        total += walk(v.jaxpr)
        return total

    return walk(closed_jaxpr.jaxpr)
