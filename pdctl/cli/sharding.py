"""`pdctl inspect-sharding`: the command over `pdctl.inspect`."""

from __future__ import annotations

import json
from typing import Annotated

import typer

from pdctl.cli.base import console, err_console, project


def inspect_sharding(
    ctx: typer.Context,
    stage: Annotated[
        str, typer.Option("--stage", help="init_weights | pretrain | warmup | train.")
    ] = "train",
    devices: Annotated[
        int | None,
        typer.Option("--devices", help="Preview a mesh of N devices (simulated CPU devices)."),
    ] = None,
    mesh: Annotated[
        str | None,
        typer.Option("--mesh", help="Override [mesh]: data=A,fsdp=B,tp=C (-1 = the rest)."),
    ] = None,
    compile_step: Annotated[
        bool,
        typer.Option("--compile", help="Compile the step; print XLA's per-device memory."),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object: rows, totals, memory.")
    ] = False,
    show_all: Annotated[
        bool, typer.Option("--all", help="One row per array (no grouping of same-shaped sites).")
    ] = False,
    device_memory: Annotated[
        str | None,
        typer.Option(
            "--device-memory",
            help="Fit check: compile the step and the evaluation's programs and compare each "
            "one's per-device peak with this much memory (80GiB, 40GB).",
        ),
    ] = None,
    device_kind: Annotated[
        str | None,
        typer.Option(
            "--device-kind",
            help="Fit check against a device's memory: a100-40, a100-80, h100, h200, b200, "
            "tpu-v5e, tpu-v5p, tpu-v6e, tpu-v4 (a TPU kind compiles with XLA:TPU when libtpu "
            "is installed: --devices N chips).",
        ),
    ] = None,
    tpu_topology: Annotated[
        str | None,
        typer.Option(
            "--topology",
            help="Fit check compiled by XLA:TPU for this slice (v5e:2x4, v5p:2x2x2), against "
            'its chips\' HBM; needs libtpu: pip install -e ".[tpu-aot]".',
        ),
    ] = None,
) -> None:
    """Show each array's shape, PartitionSpec and bytes per device, without allocating."""
    from pdctl import inspect as insp
    from pdctl.engine import runtime

    runtime.configure_devices()  # the devices a stage would see
    runtime.check_backend()  # JAX_PLATFORMS=gpu without a GPU: one line, exit 2

    stage = insp.parse_stage(stage)
    override = insp.parse_mesh(mesh)
    budget = insp.fit.device_budget(device_memory, device_kind)
    tpu, limits = insp.tpu_target(tpu_topology, device_kind, devices)
    proj = project(ctx)
    if tpu is None and devices is not None and insp.needs_child(devices, proj.config, override):
        code, died = insp.relay(
            devices,
            ctx.obj.project if ctx.obj else None,
            stage,
            mesh,
            compile_step,
            as_json,
            show_all,
            columns=console.width,
            device_memory=device_memory,
            device_kind=device_kind,
        )
        if died:
            err_console.print(f"error: {died}", markup=False)
        raise typer.Exit(code)
    report = insp.inspect(
        proj.config,
        stage,
        override,
        compile=compile_step,
        expand=show_all,
        root=proj.root,
        budget=budget,
        tpu=tpu,
        limits=limits,
        # a TPU kind without libtpu: XLA:CPU's peaks scaled by the largest ratio measured
        peak_factor=insp.topology.CPU_PEAK_MARGIN if limits == insp.topology.NO_LIBTPU else 1.0,
    )
    if as_json:
        typer.echo(json.dumps(report))
        return
    insp.render(report, console)
