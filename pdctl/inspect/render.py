"""The `inspect-sharding` report as text: the table of arrays, the totals per kind, the notes,
the compiled step's memory and the fit check."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pdctl.engine import donation
from pdctl.inspect import fit
from pdctl.inspect.layout import KIND_LABEL
from pdctl.inspect.memory import fmt_bytes

if TYPE_CHECKING:
    from rich.console import JustifyMethod


def render(report: dict[str, Any], console: Any) -> None:
    from rich.table import Table

    mesh = report["mesh"]
    t = report["totals"]
    console.print(
        f"{report['stage']}: {report['devices']} {report['platform']} devices"
        + (f" ({report['topology']}, compile only)" if report.get("topology") else "")
        + ", mesh "
        f"data={mesh['data']} x fsdp={mesh['fsdp']} x tp={mesh.get('tp', 1)}, "
        "fsdp_min_param_size="
        f"{report['fsdp_min_param_size']}, components over "
        f"{' x '.join(report['decomposition'])}, {t['arrays']} arrays",
        markup=False,
    )
    table = Table(title_justify="left")
    columns: tuple[tuple[str, JustifyMethod], ...] = (
        ("path", "left"),
        ("n", "right"),
        ("shape", "left"),
        ("dtype", "left"),
        ("spec", "left"),
        ("bytes", "right"),
        ("per device", "right"),
        ("layout", "left"),
        ("rule", "left"),
    )
    for col, just in columns:
        table.add_column(col, justify=just, overflow="fold")
    for r in report["rows"]:
        layout = f"sharded /{r['shards']}" if r["sharded"] else "replicated"
        if r["donated"]:
            layout += ", donated"
        table.add_row(
            r["path"],
            str(r["count"]),
            str(tuple(r["shape"])),
            r["dtype"],
            r["spec_str"],
            fmt_bytes(r["bytes"]),
            fmt_bytes(r["bytes_per_device"]),
            layout,
            r["rule"],
        )
    console.print(table)
    if report["grouped"]:
        console.print("(rows with n > 1 group same-shaped sites/layers; --all lists every array)")
    kinds = Table(title="per device", title_justify="left")
    kinds.add_column("kind")
    kinds.add_column("per device", justify="right")
    kinds.add_column("total", justify="right")
    for k, v in t["per_device"].items():
        kinds.add_row(KIND_LABEL[k], fmt_bytes(v), fmt_bytes(t["bytes"][k]))
    kinds.add_row("all", fmt_bytes(t["per_device_total"]), fmt_bytes(t["bytes_total"]))
    console.print(kinds)
    console.print(
        f"sharded {fmt_bytes(t['sharded_per_device'])} / replicated "
        f"{fmt_bytes(t['replicated_per_device'])} per device; donated state "
        f"{fmt_bytes(t['donated_per_device'])} per device",
        markup=False,
    )
    if t["largest_replicated"]:
        console.print("largest replicated arrays (what to shard next):", markup=False)
        for r in t["largest_replicated"]:
            console.print(
                f"  {r['path']} {tuple(r['shape'])} {fmt_bytes(r['bytes_per_device'])} "
                f"({r['why']})",
                markup=False,
            )
    for note in report["notes"]:
        console.print(f"note: {note}", markup=False)
    m = report.get("memory")
    if m:
        if m.get("oom"):
            console.print(f"compiled step: out of memory: {m['oom']}", markup=False)
        elif not m.get("available"):
            console.print("compiled: memory_analysis() is not available here", markup=False)
            return
        else:
            _step_memory(m, console)
    if report.get("fit"):
        fit.render(report["fit"], console)


def _step_memory(m: dict[str, Any], console: Any) -> None:
    """The compiled step's memory and whether its donation held."""
    console.print(
        f"compiled step ({m['compile_s']:.2f} s), per device: argument "
        f"{fmt_bytes(m['argument_bytes'])}, output {fmt_bytes(m['output_bytes'])}, alias "
        f"{fmt_bytes(m['alias_bytes'])}, temp {fmt_bytes(m['temp_bytes'])}; estimated peak "
        f"{fmt_bytes(m['peak_bytes_estimate'])} (argument + output + temp - alias)",
        markup=False,
    )
    verdict = "ok" if m["donation_ok"] else "DONATION FAILED"
    console.print(
        f"donation: aliased {fmt_bytes(m['alias_bytes'])} of "
        f"{fmt_bytes(m['donated_bytes'])} donated state = {m['alias_fraction']:.1%} "
        f"({verdict}, threshold {donation.THRESHOLD:.0%})",
        markup=False,
    )
