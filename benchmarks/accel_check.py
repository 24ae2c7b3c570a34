"""The Python half of `benchmarks/accel_check.sh` (run it through that script):

accel_check.py deps             pdctl's requirements that the benchmarks import and this
                                Python lacks (or has at a version pdctl does not accept),
                                one requirement a line; JAX itself must come from the machine
accel_check.py imports          import what the benchmarks import; one line naming the first
                                module that is missing, exit 2
accel_check.py probe            JAX's devices as one JSON line (opens the accelerator)
accel_check.py lm-step ARGS     `lm_step.py --child ARGS` in this process, the fortunes file it
                                reads by absolute path taken from PDCTL_TEXT instead
accel_check.py summary WORK OUT the step outputs under WORK as OUT/summary.md and
                                OUT/results.json
"""

from __future__ import annotations

import json
import os
import platform
import runpy
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The distributions of pyproject.toml's dependencies that the benchmarks import (wandb,
# matplotlib, starlette, uvicorn, pyarrow and flax they do not); jax, jaxlib, numpy, scipy and
# ml-dtypes come with the machine's JAX.
BENCH_DISTS = (
    "optax", "orbax-checkpoint", "grain", "typer", "tomli-w", "rich", "pydantic",
    "tokenizers", "safetensors", "gguf",
)  # fmt: skip
BENCH_MODULES = (
    "pdctl.stages.train", "pdctl.stages.warmup", "pdctl.stages.init_weights",
    "pdctl.science.targets.imported", "pdctl.science.data", "pdctl.science.spd.evaluate",
    "pdctl.engine.measure", "pdctl.templates", "tokenizers", "gguf",
)  # fmt: skip
FORTUNES = "/usr/share/games/fortunes/computers"  # what lm_step.py reads today


def _requirement(spec: str):
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip carries its own copy
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(spec)


def deps() -> None:
    from importlib import metadata

    specs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {_requirement(s).name: s for s in specs}
    for name in BENCH_DISTS:
        req = _requirement(wanted.get(name, name))
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            print(str(req))
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            print(str(req))


def imports() -> None:
    import importlib

    for mod in BENCH_MODULES:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            sys.exit(f"accel_check: importing {mod}: {e} (add its wheel to --wheels DIR)")


def probe() -> None:
    import jax

    from pdctl.engine import measure

    devices = jax.devices()
    d = devices[0]
    try:
        hbm = (d.memory_stats() or {}).get("bytes_limit")
    except Exception:  # not every backend reports memory
        hbm = None
    peak = measure.peak_flops_per_device(d)
    print(
        json.dumps(
            {
                "platform": d.platform,
                "device_kind": getattr(d, "device_kind", "?"),
                "devices": len(devices),
                "memory_gib": hbm / 2**30 if hbm else None,
                "peak_tflops": peak / 1e12 if peak else None,
                "jax": jax.__version__,
                "jaxlib": _jaxlib_version(),
                "python": platform.python_version(),
                "host_cpus": os.cpu_count(),
            }
        )
    )


def _jaxlib_version() -> str:
    from jaxlib.version import __version__

    return __version__


def lm_text_file(text: str) -> Path:
    """The file lm_step's 200 documents come from: PDCTL_TEXT itself if it is a file, else its
    `computers` (the fortunes file lm_step names), else its largest file."""
    p = Path(text)
    if p.is_file():
        return p
    if (p / "computers").is_file():
        return p / "computers"
    files = [f for f in p.iterdir() if f.is_file() and f.suffix != ".dat"]
    return max(files, key=lambda f: f.stat().st_size)


def lm_step(args: list[str]) -> None:
    """Work-around until lm_step.py takes its text from PDCTL_TEXT: its child reads
    `FORTUNES` by absolute path; here that one path reads PDCTL_TEXT's file instead."""
    text = lm_text_file(os.environ["PDCTL_TEXT"])
    read = Path.read_text

    def read_text(self, *a, **k):
        return read(text if str(self) == FORTUNES else self, *a, **k)

    Path.read_text = read_text  # type: ignore[method-assign]
    script = ROOT / "benchmarks" / "lm_step.py"
    sys.argv = [str(script), "--child", *args]
    runpy.run_path(str(script), run_name="__main__")


def meta(file: Path, pairs: list[str]) -> None:
    import datetime

    out: dict = {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC")}
    for pair in pairs:
        k, v = pair.split("=", 1)
        try:
            out[k] = json.loads(v)  # numbers
        except json.JSONDecodeError:
            out[k] = v
    file.write_text(json.dumps(out))


# --- the summary --------------------------------------------------------------------------


def _last_json(path: Path):
    """The last line of a step's output that parses as JSON (a benchmark child's result)."""
    if not path.is_file():
        return None
    for line in reversed(path.read_text(errors="replace").splitlines()):
        line = line.strip()
        if line.startswith(("{", "[")):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return None


def _f(x, fmt: str = ".1f") -> str:
    return "-" if x is None else format(x, fmt)


def summary(work: Path, out: Path) -> None:
    meta = json.loads((work / "meta.json").read_text())
    dev = _last_json(work / "probe.out") or {}
    steps = []
    if (work / "steps.tsv").is_file():
        for line in (work / "steps.tsv").read_text().splitlines():
            name, status, wall, limit = line.split("\t")
            steps.append({"step": name, "status": status, "wall_s": int(wall), "limit_s": limit})
    peak = meta.get("peak_tflops") or None
    results: dict = {"meta": meta, "device": dev, "steps": steps}

    md = ["# pdctl accel_check", ""]
    md.append(f"- date: {meta['date']}")
    md.append(f"- commit: {meta['commit']}")
    if dev:
        mem = f", {dev['memory_gib']:.1f} GiB" if dev.get("memory_gib") else ""
        md.append(
            f"- device: {dev['devices']} x {dev['device_kind']} ({dev['platform']}{mem}); "
            f"jax {dev['jax']}, jaxlib {dev['jaxlib']}, Python {dev['python']}, "
            f"{dev['host_cpus']} host CPUs"
        )
    md.append(
        "- peak for MFU: "
        + (f"{peak:g} TFLOP/s per device" if peak else "unknown (MFU not given)")
        + (f" ({meta['peak_from']})" if peak else "")
    )
    md.append(f"- sizes: {meta['sizes']}; budget {meta['budget_s']} s")
    md.append(f"- GGUF: {meta['gguf']}; text: {meta['text']}")
    md += ["", "| step | status | wall s | limit s |", "| --- | --- | --- | --- |"]
    md += [f"| {s['step']} | {s['status']} | {s['wall_s']} | {s['limit_s']} |" for s in steps]
    skipped = [s["step"] for s in steps if s["status"] != "ok"]
    if skipped:
        md.append("")
        md.append(
            "Not measured in this run: " + ", ".join(skipped) + ". Each runs alone with "
            "`--only NAME` (the names before the colon)."
        )

    # spd_step: one JSON per config (spd_step.py --json)
    rows = []
    for p in sorted(work.glob("spd_step_*.json"), key=lambda p: p.stat().st_mtime):
        rows += json.loads(p.read_text())["rows"]
    results["spd_step"] = rows
    if rows:
        md += ["", "## spd_step: the toys' SPD train step (`benchmarks/spd_step.py`)", ""]
        md.append(
            "| config | devices | batch | train compile s | step ms | samples/s | GFLOP/device "
            "| MFU | peak MiB donated / not | donation reuse | warmup s |"
        )
        md.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            gflop = r["flops_per_device"] / 1e9 if r["flops_per_device"] else None
            md.append(
                f"| {r['config']} | {r['devices']} | {r['batch']} | {r['train_compile_s']:.1f} "
                f"| {r['step_ms']:.3f} | {r['samples_per_s']:.0f} | {_f(gflop, '.2f')} "
                f"| {_f(r['mfu'], '.3f')} | {r['mem_peak_mib']:.1f} / "
                f"{r['mem_peak_no_donation_mib']:.1f} | {r['donation_reuse']:.3f} "
                f"| {r['warmup_compile_s'] + r['warmup_run_s']:.1f} |"
            )

    # lm_step: one child's JSON per site count
    rows = []
    for p in sorted(work.glob("lm_step_*.out"), key=lambda p: int(p.stem.split("_")[-1])):
        r = _last_json(p)
        if r:
            s = r["step_ms"] / 1e3
            r["tokens_per_s"] = meta["lm_tokens"] / s
            r["mfu"] = r["gflop"] * 1e9 / s / (peak * 1e12) if peak else None
            rows.append(r)
    results["lm_step"] = rows
    if rows:
        md += ["", f"## lm_step: SmolLM2-135M, {meta['lm_shape']} (`benchmarks/lm_step.py`)", ""]
        md.append(
            "| sites | devices | step ms | forward ms | step / forward | tokens/s | GFLOP "
            "| MFU | compile s | loss |"
        )
        md.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            md.append(
                f"| {r['sites']} | {r['devices']} | {r['step_ms']:.1f} | {r['forward_ms']:.1f} "
                f"| {r['step_ms'] / r['forward_ms']:.2f} | {r['tokens_per_s']:.0f} "
                f"| {r['gflop']:.1f} | {_f(r['mfu'], '.3f')} | {r['compile_s']:.1f} "
                f"| {r['loss']:.6g} |"
            )

    # scan_compile: one child's JSON per side
    outs = sorted(work.glob("scan_compile_*.out"), key=lambda p: p.stat().st_mtime)
    rows = [r for p in outs if (r := _last_json(p))]
    results["scan_compile"] = rows
    if rows:
        md += ["", "## scan_compile: a tiny Llama, unrolled and scanned", ""]
        md.append("`benchmarks/scan_compile.py` (d_model 128, every projection decomposed).")
        md.append("")
        md.append(
            "| layers | sites | side | compile s | evaluation's first call s | step ms "
            "| loss after 1, 2, 3 steps |"
        )
        md.append("| --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            side = "scan" if r["scan"] else "unrolled"
            loss = ", ".join(f"{v:.6g}" for v in r["losses"])
            md.append(
                f"| {r['layers']} | {r['sites']} | {side} | {r['compile_s']:.1f} "
                f"| {r['eval_first_s']:.1f} | {r['step_ms']:.1f} | {loss} |"
            )

    # precision: its printed table (and its JSON when it finished)
    prec = work / "precision.out"
    if prec.is_file():
        lines = prec.read_text(errors="replace").splitlines()
        table = [x for x in lines if x.startswith(("|", "# "))]
        if (work / "precision.json").is_file():
            results["precision"] = json.loads((work / "precision.json").read_text())
        if table:
            md += ["", f"## precision: {meta['precision_shape']} (`benchmarks/precision.py`)", ""]
            md += [f"- {x[2:]}" for x in table if x.startswith("# ")] + [""]
            md += [x for x in table if x.startswith("|")]
            new = results.get("precision", {}).get("new")
            if new:
                mfu = f", MFU {new['mfu']:.2f}" if peak else ""
                md += [
                    "",
                    f"The layer-15 step (arm `new`, pdctl's policy): {new['step_ms']:.1f} ms, "
                    f"{new['tokens_per_s']:,.0f} tokens/s{mfu}.",
                ]
            if not peak:
                md.append("(MFU above is against a nominal 1 TFLOP/s: this device's peak is "
                          "not known.)")  # fmt: skip

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "deps":
        deps()
    elif cmd == "imports":
        imports()
    elif cmd == "probe":
        probe()
    elif cmd == "lm-step":
        lm_step(rest)
    elif cmd == "meta":
        meta(Path(rest[0]), rest[1:])
    elif cmd == "summary":
        summary(Path(rest[0]), Path(rest[1]))
    else:
        sys.exit(f"accel_check.py: unknown command {cmd!r} (see its docstring)")


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main()
