"""The fit check: does a stage's step, and every program its evaluation compiles, fit a device?

`pdctl inspect-sharding --device-memory 80GiB` (or `--device-kind h100`) compiles, from
abstract sharded arguments (nothing is allocated, a `config.json` is enough for an imported
model), the train step and the evaluation's programs for the mesh at hand (simulated CPU
devices with `--devices N`), and compares each program's per-device peak as XLA's
`memory_analysis()` states it (arguments + outputs + temporaries - aliased donated buffers)
with the device's memory. Compiling is not fitting: a program that compiles for 64 devices
can still need more than a device has.

XLA:CPU plans the same HLO as a GPU backend would after SPMD partitioning, so argument, output
and alias sizes are exact; temporaries can differ, because each backend fuses, schedules and
rematerialises on its own (a GPU compile adds cuDNN / cuBLAS workspaces and its own collective
buffers; XLA:CPU has none of them), in either direction. The verdict is an estimate to
keep a margin against, not a promise: see docs/performance.md. For a TPU, with libtpu
installed, the programs compile with XLA:TPU itself for a topology (`pdctl.inspect.topology`):
its figures are the chip's, and a program it refuses for want of HBM does not fit.
"""

from __future__ import annotations

import re
import time
from typing import Any

from pdctl.errors import PdctlError
from pdctl.inspect import topology
from pdctl.inspect.memory import fmt_bytes, memory_report

GIB = 2**30
# Memory per device (bytes) by kind: what `--device-kind` accepts.
DEVICE_MEMORY: dict[str, int] = {
    "a100-40": 40 * GIB,
    "a100-80": 80 * GIB,
    "h100": 80 * GIB,
    "h200": 141 * GIB,
    "b200": 180 * GIB,
    # a TPU's HBM as XLA:TPU states it (pdctl.inspect.topology.HBM_BYTES), not its marketing
    # figure: 15.75 GiB on a v5e, where 16 GiB would pass a step that does not fit
    **{f"tpu-{g}": b for g, b in topology.HBM_BYTES.items()},
}
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}  # fmt: skip


def parse_memory(value: str) -> int:
    """'80GiB', '40 GB', '1.5TiB', '123456' -> bytes; a one-line error naming the flag."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", value or "")
    unit = m.group(2).lower() if m else ""
    # at least a byte: '0.5B' is no memory at all, and every program would "fit" in 0 bytes
    if not m or unit not in _UNITS or float(m.group(1)) * _UNITS[unit] < 1:
        raise PdctlError(f"--device-memory: expected a size such as 80GiB or 40GB, got {value!r}")
    return int(float(m.group(1)) * _UNITS[unit])


def device_budget(memory: str | None, kind: str | None) -> tuple[int, str] | None:
    """(bytes, how it was given) from `--device-memory` or `--device-kind`, or None."""
    # `is not None`: an empty value given is a mistake to name, not "no check"
    if memory is not None and kind is not None:
        raise PdctlError("--device-memory and --device-kind: give one of them")
    if memory is not None:
        return parse_memory(memory), memory
    if kind is not None:
        key = kind.lower()
        if key not in DEVICE_MEMORY:
            raise PdctlError(
                f"--device-kind: unknown kind {kind!r}; one of {', '.join(DEVICE_MEMORY)} (or "
                f"give --device-memory)"
            )
        return DEVICE_MEMORY[key], f"{key}, {DEVICE_MEMORY[key] / GIB:.4g} GiB"
    return None


def eval_programs(p: Any) -> dict[str, Any]:
    """The evaluation's own programs for the train stage, lowered from abstract arguments
    (`stages.train.eval_programs`: the programs `pdctl run` compiles ahead)."""
    if p.stage != "train" or p.program is None:
        return {}
    from pdctl.stages import train

    return train.eval_programs(p.cfg, p.program, p.target, p.mesh)


def compile_or_oom(name: str, compile_fn: Any) -> tuple[Any, float, dict[str, Any] | None]:
    """(compiled or None, seconds, XLA:TPU's out-of-memory verdict or None): a program whose
    temporaries exceed a TPU's HBM does not compile for it, and that is the fit check's answer;
    any other compile error is one line naming the program."""
    t0 = time.perf_counter()
    try:
        return compile_fn(), time.perf_counter() - t0, None
    except Exception as e:
        oom = topology.out_of_memory(e)
        if oom is None:
            if not type(e).__name__.endswith("RuntimeError"):
                raise
            first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise PdctlError(f"inspect-sharding: {name} does not compile: {first}") from None
        return None, time.perf_counter() - t0, oom


def compile_all(
    p: Any, step_compiled: Any, step_s: float, step_oom: dict[str, Any] | None = None
) -> dict[str, tuple[Any, float, dict[str, Any] | None]]:
    """{program name: (compiled or None, seconds, out-of-memory verdict or None)}: the step
    (already compiled, or refused) and eval_programs."""
    out = {f"{p.stage} step": (step_compiled, step_s, step_oom)}
    for name, lowered in eval_programs(p).items():
        out[name] = compile_or_oom(name, lowered.compile)
    return out


# What the train stage keeps on the device while its evaluation runs and the evaluation's
# programs do not take as arguments (they take the target, the components, the CI functions
# and the evaluation batch): the optimizer states, the PPGD sources, the loop counters, the
# frequency state, the train batch.
HELD_DURING_EVAL = ("optimizer", "sources", "loop", "other", "batch")


def held_during_eval(rows: list[dict[str, Any]]) -> int:
    """Bytes per device of the train state that stay on the device beside an evaluation."""
    return sum(r["bytes_per_device"] for r in rows if r["kind"] in HELD_DURING_EVAL)


def check(p: Any, compiled: dict[str, tuple], budget: tuple[int, str],
          rows: list[dict[str, Any]], compiler: str = "XLA:CPU",
          peak_factor: float = 1.0) -> dict[str, Any]:  # fmt: skip
    """Per program XLA's per-device bytes and peak (`memory_report`, as --compile reports the
    step); the worst against the budget. An evaluation's peak adds what the train state holds
    beside it (`held_during_eval`: the stage evaluates with the whole state on the device). A
    program XLA:TPU refused for want of HBM does not fit; its peak is at least what the
    compiler said it needs. `peak_factor` scales each peak: another compiler's plan taken for the
    target's (`topology.CPU_PEAK_MARGIN`, XLA:CPU standing in for a TPU)."""
    programs = []
    held = held_during_eval(rows)
    for name, (c, secs, oom) in compiled.items():
        m = memory_report(c, donated_bytes=0) if oom is None else {"available": False}
        row: dict[str, Any] = {"program": name, "available": m["available"]}
        row["compile_s"] = round(secs, 3)
        row["held_bytes"] = held if name.startswith("eval") else 0
        if oom is not None:
            row["oom"] = oom["message"]
            row["peak_bytes"] = oom.get("required_bytes", budget[0] + 1) + row["held_bytes"]
        if m["available"]:
            for k in ("argument_bytes", "output_bytes", "temp_bytes", "alias_bytes"):
                row[k] = m[k]
            row["unscaled_peak_bytes"] = m["peak_bytes_estimate"] + row["held_bytes"]
            row["peak_bytes"] = round(peak_factor * row["unscaled_peak_bytes"])
        programs.append(row)
    known = [q for q in programs if "peak_bytes" in q]
    peak = max((q["peak_bytes"] for q in known), default=0)
    unscaled = max((q.get("unscaled_peak_bytes", q["peak_bytes"]) for q in known), default=0)
    oom = [q for q in programs if "oom" in q]
    largest = sorted(rows, key=lambda r: (-r["bytes_per_device"], r["path"]))[:10]
    return {
        "budget_bytes": budget[0],
        "budget": budget[1],
        "compiler": compiler,
        "peak_factor": peak_factor,
        "programs": programs,
        "peak_bytes": peak,
        "worst": max(known, key=lambda q: q["peak_bytes"])["program"] if known else None,
        "fits": bool(known) and not oom and peak <= budget[0],
        # the compiler's own plan, before `peak_factor` (the same as peak_bytes at 1)
        "unscaled_peak_bytes": unscaled,
        # each program XLA:TPU refused, in its words
        "out_of_memory": [{"program": q["program"], "message": q["oom"]} for q in oom],
        "margin_bytes": budget[0] - peak,
        "largest_arrays": [
            {"path": r["path"], "shape": r["shape"], "bytes_per_device": r["bytes_per_device"]}
            for r in largest
        ],
    }


def verdict(fit: dict[str, Any]) -> str:
    """FITS, DOES NOT FIT, or MAY NOT FIT: the peak fits only before `peak_factor`."""
    if fit["fits"]:
        return "FITS"
    if (
        not fit.get("out_of_memory")
        and fit["worst"] is not None
        and fit.get("peak_factor", 1.0) != 1.0
        and fit.get("unscaled_peak_bytes", fit["peak_bytes"]) <= fit["budget_bytes"]
    ):
        return "MAY NOT FIT"
    return "DOES NOT FIT"


def render(fit: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    table = Table(
        title=f"fit check ({fit.get('compiler', 'XLA:CPU')}) against {fit['budget']} per device",
        title_justify="left",
    )
    cols = ("program", "compile s", "arguments", "outputs", "temporaries", "aliased",
            "state held", "peak")  # fmt: skip
    for col in cols:
        table.add_column(col, justify="left" if col == "program" else "right")
    for q in fit["programs"]:
        held = fmt_bytes(q.get("held_bytes", 0))
        if "oom" in q:  # XLA:TPU refused it: what it said it needs is the peak's lower bound
            need = f">= {fmt_bytes(q['peak_bytes'] - q.get('held_bytes', 0))}"
            peak = f">= {fmt_bytes(q['peak_bytes'])}"
            table.add_row(q["program"], f"{q['compile_s']:.1f}", *["n/a"] * 2, need, "n/a", held,
                          peak)  # fmt: skip
            continue
        if not q["available"]:
            table.add_row(q["program"], f"{q['compile_s']:.1f}", *["n/a"] * 6)
            continue
        table.add_row(
            q["program"], f"{q['compile_s']:.1f}",
            *(fmt_bytes(q[k]) for k in ("argument_bytes", "output_bytes", "temp_bytes",
                                         "alias_bytes")),
            held, fmt_bytes(q["peak_bytes"]),
        )  # fmt: skip
    console.print(table)
    k = fit.get("peak_factor", 1.0)
    peak = "arguments + outputs + temporaries - aliased + state held"
    peak = peak if k == 1.0 else f"({peak}) x {k:g}"
    console.print("state held: the train state an evaluation runs beside and does not take "
                  f"(optimizer, PPGD sources, counters); peak = {peak}", markup=False)  # fmt: skip
    console.print("`pdctl run` runs the stages in one process and frees the device between "
                  "them: it needs the largest of their peaks (check another with --stage)",
                  markup=False)  # fmt: skip
    console.print("largest arrays per device (arguments; XLA states temporaries only in sum):",
                  markup=False)  # fmt: skip
    for r in fit["largest_arrays"]:
        console.print(f"  {r['path']} {tuple(r['shape'])} {fmt_bytes(r['bytes_per_device'])}",
                      markup=False)  # fmt: skip
    margin = fit["margin_bytes"]
    for q in fit.get("out_of_memory") or ():
        console.print(f"{fit['compiler']}, {q['program']}: {q['message']}", markup=False)
    if fit.get("limits"):
        console.print(f"note: {fit['limits']}", markup=False)
    word = verdict(fit)
    if fit.get("out_of_memory"):
        refused = ", ".join(q["program"] for q in fit["out_of_memory"])
        line = (
            f"DOES NOT FIT: {fit['compiler']} refused {refused} for want of HBM; peak at least "
            f"{fmt_bytes(fit['peak_bytes'])} ({fit['worst']}) of {fmt_bytes(fit['budget_bytes'])}"
        )
    elif word == "MAY NOT FIT":
        line = (
            f"MAY NOT FIT: peak {fmt_bytes(fit['peak_bytes'])} ({fit['worst']}) of "
            f"{fmt_bytes(fit['budget_bytes'])} with {fit['compiler']}'s peak x "
            f"{fit['peak_factor']:g}, {fmt_bytes(fit['unscaled_peak_bytes'])} by its own plan; "
            'the TPU compiler decides: pip install -e ".[tpu-aot]" and check again'
        )
    elif word == "FITS":
        line = (
            f"FITS: peak {fmt_bytes(fit['peak_bytes'])} ({fit['worst']}), margin "
            f"{fmt_bytes(margin)} ({margin / fit['budget_bytes']:.0%} of the device)"
        )
    else:
        line = (
            f"DOES NOT FIT: peak {fmt_bytes(fit['peak_bytes'])} ({fit['worst']}) is "
            f"{fmt_bytes(-margin)} over {fmt_bytes(fit['budget_bytes'])}"
        )
    console.print(line, markup=False)
