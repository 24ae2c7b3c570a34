"""`pdctl inspect-sharding`: how a stage's arrays are laid out on the mesh, without allocating.

Nothing takes the run lock or reads checkpoints, so it works on a fresh run directory and next
to a running stage. `--compile` lowers and compiles the stage's donating step from
`jax.ShapeDtypeStruct`s carrying their shardings and reports XLA's `memory_analysis()`;
`--devices N` previews another device count in a child process with N simulated CPU devices.

What's here (each module imports only the ones above it):
    memory   XLA's per-device memory of a compiled program (`memory_report`), `fmt_bytes`
    layout   the stage's abstract step arguments (`plan`), one row per array, totals
    fit      the fit check: the step and the evaluation's programs against a device's memory
    render   the report as text
    child    `--devices N`: the same inspection in a child process
    topology `--topology` / a TPU `--device-kind`: compile-only TPU devices from libtpu
    inspect  (below) the whole report as one JSON-ready dict
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax

from pdctl.config import Config
from pdctl.engine import sharding
from pdctl.inspect import fit, topology
from pdctl.inspect.child import (
    CHILD_CWD,
    child_argv,
    child_death,
    child_env,
    needs_child,
    relay,
    run_child,
)
from pdctl.inspect.layout import (
    Plan,
    array_rows,
    check_mesh_fits,
    compile_step,
    group_rows,
    mesh_config,
    parse_mesh,
    parse_stage,
    plan,
    totals,
)
from pdctl.inspect.memory import fmt_bytes, memory_report
from pdctl.inspect.render import render
from pdctl.inspect.topology import target as tpu_target

__all__ = [
    "CHILD_CWD",
    "Plan",
    "array_rows",
    "check_mesh_fits",
    "child_argv",
    "child_death",
    "child_env",
    "compile_step",
    "fit",
    "fmt_bytes",
    "group_rows",
    "inspect",
    "memory_report",
    "mesh_config",
    "needs_child",
    "parse_mesh",
    "parse_stage",
    "plan",
    "relay",
    "render",
    "run_child",
    "topology",
    "totals",
    "tpu_target",
]


def inspect(
    cfg: Config,
    stage: str = "train",
    mesh_override: dict[str, int] | None = None,
    compile: bool = False,
    expand: bool = False,
    devices: list[Any] | None = None,
    root: Path | None = None,
    budget: tuple[int, str] | None = None,
    tpu: topology.Topology | None = None,
    limits: str | None = None,
    peak_factor: float = 1.0,
) -> dict[str, Any]:
    """The `inspect-sharding` report as a JSON-ready dict: rows, totals and (with `compile`)
    the compiled step's memory; with a device `budget` (bytes, as given) also the fit check
    (`fit`: the step and the evaluation's programs against it). With a TPU topology `tpu`
    the programs compile with XLA:TPU for its chips (libtpu), against their HBM by default;
    `limits` is the line the fit check states about its compiler; `peak_factor` scales its peaks
    (`topology.CPU_PEAK_MARGIN` where XLA:CPU stands in for a TPU)."""
    stage = parse_stage(stage)
    if tpu is not None:
        devices = topology.devices(tpu)
        budget = budget or tpu.budget
    compile = compile or budget is not None
    devices = list(jax.devices() if devices is None else devices)
    mc = mesh_config(cfg, mesh_override)
    check_mesh_fits(mc, len(devices), from_flag=bool(mesh_override))
    cfg = cfg.model_copy(update={"mesh": mc})
    mesh = sharding.mesh_from_config(mc, devices)
    p = plan(cfg, stage, mesh, root)
    rows = array_rows(p)
    report: dict[str, Any] = {
        "stage": stage,
        "devices": len(devices),
        "platform": devices[0].platform,
        "topology": tpu.name if tpu is not None else None,
        "mesh": sharding.describe_mesh(mesh),
        "fsdp_min_param_size": mc.fsdp_min_param_size,
        # the axes V / U shard over by their component axis ([mesh] decomposition)
        "decomposition": list(p.decomp.axes) if p.decomp else ["fsdp"],
        "rows": rows if expand else group_rows(rows),
        "grouped": not expand,
        "totals": totals(rows, p),
        "notes": list(p.notes),
    }
    if compile:
        if p.program is None:
            report["notes"].append("--compile: init_weights has no step to compile")
            report["memory"] = None
        else:
            step = fit.compile_or_oom(f"the {stage} step", lambda: compile_step(p)[0])
            compiled, secs, oom = step
            if oom is None:
                report["memory"] = memory_report(compiled, report["totals"]["donated_per_device"])
            else:
                report["memory"] = {"available": False, "oom": oom["message"]}
            report["memory"]["compile_s"] = round(secs, 3)
            if budget is not None:
                compiler = f"XLA:TPU {tpu.name}" if tpu is not None else "XLA:CPU"
                report["fit"] = fit.check(p, fit.compile_all(p, *step), budget, rows, compiler,
                                          peak_factor)  # fmt: skip
                report["fit"]["limits"] = limits
    return report
