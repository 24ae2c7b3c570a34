"""What XLA says a compiled program needs per device (`memory_report`), and bytes as text."""

from __future__ import annotations

from typing import Any

from pdctl.engine import donation


def memory_report(compiled: Any, donated_bytes: int) -> dict[str, Any]:
    """XLA's per-device sizes, the estimated peak and how much of the donated state aliases."""
    m = compiled.memory_analysis()
    if m is None:
        return {"available": False}
    arg, out = int(m.argument_size_in_bytes), int(m.output_size_in_bytes)
    alias, temp = int(m.alias_size_in_bytes), int(m.temp_size_in_bytes)
    frac = alias / donated_bytes if donated_bytes else 1.0
    rep = {
        "available": True,
        "argument_bytes": arg,
        "output_bytes": out,
        "alias_bytes": alias,
        "temp_bytes": temp,
        "generated_code_bytes": int(m.generated_code_size_in_bytes),
        "peak_bytes_estimate": arg + out + temp - alias,
        "donated_bytes": donated_bytes,
        "alias_fraction": frac,
        "donation_ok": frac >= donation.THRESHOLD,
    }
    xla_peak = int(getattr(m, "peak_memory_in_bytes", 0) or 0)
    if xla_peak:
        rep["xla_peak_bytes"] = xla_peak
    return rep


def fmt_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n:.2f} TiB"
