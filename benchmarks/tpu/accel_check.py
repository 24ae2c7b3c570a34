"""The Python half of `benchmarks/tpu/accel_check.sh` (run it through that script):

accel_check.py deps [DIST ...]  pdctl's requirements that the benchmarks import (or those
                                named) and this Python lacks (or has at a version pdctl does
                                not accept), one requirement a line; JAX itself must come from
                                the machine
accel_check.py imports [MODULE ...]
                                import what the benchmarks import (or the modules named); one
                                line naming the first module that is missing, exit 2
accel_check.py platform         what JAX will run on, told without opening the device (JSON)
accel_check.py limit BUDGET LEFT ONLY
                                precision's time limit, seconds (`item_limit`)
accel_check.py probe            JAX's devices as one JSON line (opens the accelerator)
accel_check.py run ARGS         the driver: lm_step, spd_step and scan_compile one after another
                                in one process (one opening of the device, the GGUF loaded
                                once), each under its time limit (see `run`)
accel_check.py stopped WORK SIZES ONLY RC
                                after the driver ended early: its items recorded as stopped
                                or skipped
accel_check.py summary WORK OUT the outcomes under WORK as OUT/summary.md and
                                OUT/results.json
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
import tomllib
from pathlib import Path

from benchmarks._harness import ROOT

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


def _requirement(spec: str):
    try:
        from packaging.requirements import Requirement
    except ImportError:  # pip carries its own copy
        from pip._vendor.packaging.requirements import Requirement
    return Requirement(spec)


def deps(names: tuple[str, ...] | list[str] = BENCH_DISTS) -> None:
    from importlib import metadata

    specs = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    wanted = {_requirement(s).name: s for s in specs}
    for name in names:
        req = _requirement(wanted.get(name, name))
        try:
            have = metadata.version(req.name)
        except metadata.PackageNotFoundError:
            print(str(req))
            continue
        if req.specifier and not req.specifier.contains(have, prereleases=True):
            print(str(req))


def imports(names: tuple[str, ...] | list[str] = BENCH_MODULES) -> None:
    import importlib

    for mod in names:
        try:
            importlib.import_module(mod)
        except ImportError as e:
            sys.exit(f"accel_check: importing {mod}: {e} (add its wheel to --wheels DIR)")


# --- the device, told without opening it ------------------------------------------------------


def platform_info() -> dict:
    """What JAX will run on, told without starting it (one process at a time holds a TPU chip,
    and opening it costs seconds): {platform, kind, chips, peak_tflops, libtpu_without_chips}.
    TPU chips and their generation come from the PCI bus, as JAX counts them; a GPU from
    pdctl's test (a GPU plugin installed) or NVIDIA's device files, its kind only once JAX
    runs. "cpu" when neither: the shell then asks JAX itself before it refuses."""
    import importlib.util

    from pdctl.engine import measure, runtime

    out: dict = {"platform": "cpu", "kind": None, "chips": 0, "peak_tflops": None}
    try:
        from jax._src import hardware_utils

        chips, version = hardware_utils.num_available_tpu_chips_and_device_id()
        nvidia = hardware_utils.has_visible_nvidia_gpu()
    except Exception:  # another JAX: the driver's probe says what it is
        chips, version, nvidia = 0, None, False
    libtpu = importlib.util.find_spec("libtpu") is not None
    out["libtpu_without_chips"] = libtpu and not chips
    if chips:
        out.update(platform="tpu", chips=int(chips))
        if version is not None:
            out["kind"] = f"TPU {version.name}"
            out["peak_tflops"] = measure.PEAK_TFLOPS.get(out["kind"])
    elif nvidia or (runtime.accelerator_host() and not libtpu):
        out["platform"] = "gpu"
    return out


def probe_devices() -> dict:
    """JAX's devices (this opens the accelerator): platform, kind, count, memory, peak."""
    import jax

    from pdctl.engine import measure

    devices = jax.devices()
    d = devices[0]
    try:
        hbm = (d.memory_stats() or {}).get("bytes_limit")
    except Exception:  # not every backend reports memory
        hbm = None
    peak = measure.peak_flops_per_device(d)
    return {
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


def _jaxlib_version() -> str:
    from jaxlib.version import __version__

    return __version__


# --- the driver: lm_step, spd_step and scan_compile in one process ---------------------------

# The driver's steps' shares of the budget (percent), in the order they run: what issue 41
# needs most first (precision.py, a process of its own, runs before them all). Estimates for
# one TPU v5e, not measurements: docs/performance.md, "Accelerator check", shows the
# arithmetic. The planned steps (PLANNED) keep their shares from the steps before them: a
# step may use what is left but for the shares of the planned steps after it (precision also
# leaves the driver's start), so an estimate that was short costs the unplanned tail, never a
# later planned step, and a hung compile cannot eat their time. The unplanned steps,
# scan_compile and spd_step:llama-mlp (whose train step alone compiles for about a minute on a
# v5e), run on what is left, each at most its share.
SHARES = {
    "lm_step:a": 12,  # 3 sites (the first of SIZES' lm_sites): the GGUF is loaded here
    "lm_step:b": 9,  # 90 sites, scanned
    "spd_step:tms": 4,
    "spd_step:resid-mlp": 5,
    "scan_compile:scan": 7,
    "scan_compile:unrolled": 8,
    "spd_step:llama-mlp": 15,
}
PLANNED = ("lm_step:a", "lm_step:b", "spd_step:tms", "spd_step:resid-mlp")
DRIVER_START_S = 20  # the driver's imports and its opening of the device (estimated, v5e)
MIN_START_S = 20  # a step with less time than this is skipped, not started
RESERVE_S = 10  # kept back: a stopped item's clean-up, the summary

SIZES = {
    # lm_step at 4 x 64 tokens, C 256 (the figures of docs/performance.md's issue 21 table);
    # the toys at their templates' batch, 20 warmup steps instead of 200 (the warmup's compile
    # is what is measured; its steps are dispatches of a sub-millisecond program); the tiny
    # Llama of scan_compile at 4 layers (at 8 its unrolled step alone compiles for ~45 s on a
    # v5e, estimated)
    "full": {
        "lm_sites": (3, 90), "lm_C": 256, "lm_steps": 3, "lm_windows": 3,
        "spd_steps": 20, "spd_warmup_steps": 20,
        "scan_layers": 4, "scan_steps": 3,
    },
    # a smoke test on a CPU: 12 sites (4 layers) take the scanned path as 90 do
    "tiny": {
        "lm_sites": (3, 12), "lm_C": 16, "lm_steps": 1, "lm_windows": 1,
        "spd_steps": 2, "spd_warmup_steps": 5,
        "scan_layers": 2, "scan_steps": 1,
    },
}  # fmt: skip


def plan(sizes: str) -> list[tuple[str, str]]:
    """[(item, its SHARES key)] of the driver, in the order they run."""
    a, b = SIZES[sizes]["lm_sites"]
    return [
        (f"lm_step:{a}", "lm_step:a"),
        (f"lm_step:{b}", "lm_step:b"),
        ("spd_step:tms", "spd_step:tms"),
        ("spd_step:resid-mlp", "spd_step:resid-mlp"),
        ("scan_compile:scan", "scan_compile:scan"),
        ("scan_compile:unrolled", "scan_compile:unrolled"),
        ("spd_step:llama-mlp", "spd_step:llama-mlp"),
    ]


def item_limit(budget: int, key: str, left: float, later: list[str], whole: bool) -> int:
    """A step's time limit in whole seconds: what is `left` of the budget but for the shares of
    the planned steps among `later` (the SHARES keys of the steps after it that will run; for
    precision also the driver's start), or, for an unplanned step, at most its own share.
    `whole` (--only, --tiny): all that is left."""
    if whole:
        return max(int(left), 0)
    if key == "precision" or key in PLANNED:
        keep = sum(budget * SHARES[k] / 100 for k in later if k in PLANNED)
        keep += DRIVER_START_S if key == "precision" and later else 0
        return max(int(left - keep), 0)
    return max(int(min(budget * SHARES[key] / 100, left)), 0)


class ItemLimit(BaseException):
    """Raised in the driver's main thread when an item's time is up (a BaseException: no
    `except Exception` in the code it interrupts keeps it running)."""


def _on_alarm(signum, frame):
    raise ItemLimit


class Driver:
    def __init__(self, work: Path, out: Path, sizes: str, peak: float):
        self.work, self.out, self.z, self.peak = work, out, SIZES[sizes], peak
        self.model = None  # lm_step's (target, params, tokens), loaded by the first lm item
        self.mesh = None

    def lm_step(self, n_sites: int) -> dict:
        from benchmarks.lm import step as lm_step
        from pdctl.engine import sharding

        z = self.z
        # [train] scan_layers as pdctl decides it ("auto"): 3 sites unrolled, 90 scanned
        cfg = lm_step.config(n_sites, z["lm_C"], scan="auto")
        load_s = 0.0
        if self.model is None:  # the GGUF and the text, once for every site count
            t = time.perf_counter()
            self.mesh = sharding.make_mesh(-1, 1)
            self.model = lm_step.load(cfg, self.mesh)
            load_s = time.perf_counter() - t
        r = lm_step.measure(cfg, self.mesh, *self.model, z["lm_steps"], windows=z["lm_windows"])
        r["load_s"] = load_s
        s = r["step_ms"] / 1e3
        r["tokens_per_s"] = r["tokens"] / s
        r["mfu"] = r["gflop"] * 1e9 / s / (self.peak * 1e12) if self.peak else None
        r["phases"] = {
            "setup_s": load_s + r["init_s"],
            "compile_s": r["compile_s"] + r["forward_compile_s"],
            "run_s": r["run_s"],
        }
        return r

    def spd_step(self, template: str) -> dict:
        from benchmarks.toys import spd_step

        z = self.z
        # no second, non-donating compile: donation is measured as pointer reuse
        r = spd_step.child(
            template, z["spd_steps"], self.peak, 0, z["spd_warmup_steps"], no_donation=False
        )
        r["phases"] = {
            "setup_s": r["init_s"],
            "compile_s": r["warmup_compile_s"] + r["train_compile_s"],
            "run_s": r["warmup_run_s"] + r["run_s"],
        }
        return r

    def scan_compile(self, side: str) -> dict:
        from benchmarks.startup import scan_compile

        z = self.z
        r = scan_compile.child(z["scan_layers"], side == "scan", z["scan_steps"])
        r["phases"] = {
            "setup_s": r["init_s"],
            "compile_s": r["compile_s"] + r["eval_first_s"],  # the evaluation: its compiles
            "run_s": r["run_s"],
        }
        return r

    def run_item(self, name: str) -> dict:
        kind, arg = name.split(":", 1)
        if kind == "lm_step":
            return self.lm_step(int(arg))
        if kind == "spd_step":
            return self.spd_step(arg)
        return self.scan_compile(arg)


def record(work: Path, name: str, status: str, wall: float, limit, result=None) -> None:
    with open(work / "steps.tsv", "a") as f:
        f.write(f"{name}\t{status}\t{wall:.0f}\t{limit}\n")
    if result is not None:
        with open(work / "driver.jsonl", "a") as f:
            f.write(json.dumps({"item": name, **result}) + "\n")


def run(argv: list[str]) -> None:
    """accel_check.py run WORK OUT --sizes S --budget B --seconds LEFT [--only NAMES]
    [--peak-tflops T] [--allow-cpu]: the driver's items one after another in this process,
    each under its time limit, every outcome recorded (WORK/steps.tsv, WORK/driver.jsonl) and
    the summary rewritten after each; exits 3 when JAX sees only the CPU and not --allow-cpu."""
    import argparse
    import signal

    ap = argparse.ArgumentParser(prog="accel_check.py run")
    ap.add_argument("work", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--sizes", choices=sorted(SIZES), default="full")
    ap.add_argument("--budget", type=int, required=True, help="the whole check's seconds")
    ap.add_argument("--seconds", type=float, required=True, help="what is left of it")
    ap.add_argument("--only", default="")
    ap.add_argument("--peak-tflops", type=float, default=0.0)
    ap.add_argument("--allow-cpu", action="store_true")
    a = ap.parse_args(argv)
    t_start = time.monotonic()
    deadline = t_start + a.seconds
    only = {n for n in a.only.replace(",", " ").split() if n}
    items = [(n, k) for n, k in plan(a.sizes) if not only or n.split(":")[0] in only]

    from pdctl.engine import runtime

    runtime.cpu_xla_flags()  # pdctl's XLA:CPU flags and devices, as every pdctl command
    runtime.configure_devices()
    dev = probe_devices()  # opens the accelerator: the one time this process does
    (a.work / "probe.out").write_text(json.dumps(dev) + "\n")
    record(a.work, "driver: start, open the device", "ok", time.monotonic() - t_start, "-")
    if dev["platform"] == "cpu" and not a.allow_cpu:
        print("accel_check: JAX sees only the CPU here (--allow-cpu runs it anyway)")
        sys.exit(3)
    peak = a.peak_tflops or dev["peak_tflops"] or 0.0
    driver = Driver(a.work, a.out, a.sizes, peak)
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        # --tiny (a CPU smoke test): the shares are the full sizes' plan for a v5e, and say
        # nothing about a CPU; every item may use what is left
        _run_items(a, driver, items, deadline, bool(only) or a.sizes == "tiny")
    finally:
        signal.signal(signal.SIGALRM, previous)


def _run_items(a, driver: Driver, items: list, deadline: float, only: bool) -> None:
    import signal

    for i, (name, key) in enumerate(items):
        left = deadline - time.monotonic() - RESERVE_S
        limit = item_limit(a.budget, key, left, [k for _, k in items[i + 1 :]], only)
        if limit < MIN_START_S:
            print(f"== {name}: skipped ({left:.0f} s of the budget left)", flush=True)
            record(a.work, name, "skipped: budget", 0, "-")
            summary(a.work, a.out)
            continue
        print(f"== {name}, at most {limit} s", flush=True)
        (a.work / "driver.current").write_text(f"{name}\t{time.time()}\t{limit}\n")
        t0 = time.monotonic()
        result, status = None, "ok"
        signal.setitimer(signal.ITIMER_REAL, limit)
        try:
            result = driver.run_item(name)
        except ItemLimit:
            status = "stopped at its limit"
        except Exception as e:  # recorded; the next item runs
            line = (str(e).strip().splitlines() or [""])[0][:200].replace("\t", " ")
            line = line.replace("|", "/")  # a table cell of the summary
            status = f"failed: {type(e).__name__}: {line}"
            import traceback

            traceback.print_exc()
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
        wall = time.monotonic() - t0
        (a.work / "driver.current").unlink(missing_ok=True)
        if result is not None:
            print(json.dumps(result), flush=True)
        print(f"== {name}: {status} after {wall:.0f} s", flush=True)
        record(a.work, name, status, wall, limit, result)
        summary(a.work, a.out)


def stopped(work: Path, sizes: str, only: str, rc: int) -> None:
    """After the driver process ended at the shell's hard limit (or crashed): its running item
    and every item it did not reach, recorded."""
    done = set()
    if (work / "steps.tsv").is_file():
        done = {ln.split("\t")[0] for ln in (work / "steps.tsv").read_text().splitlines()}
    cur = work / "driver.current"
    running = None
    if cur.is_file():
        running, t0, limit = cur.read_text().strip().split("\t")
        status = "stopped at the budget" if rc in (124, 137) else f"failed (driver exit {rc})"
        record(work, running, status, time.time() - float(t0), limit)
        cur.unlink()
        done.add(running)
    names = {n for n in only.replace(",", " ").split() if n}
    for name, _ in plan(sizes):
        if name not in done and (not names or name.split(":")[0] in names):
            why = "skipped: budget" if rc in (124, 137) else f"not run (driver exit {rc})"
            record(work, name, why, 0, "-")


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


def _driver_results(work: Path) -> dict[str, dict]:
    out = {}
    if (work / "driver.jsonl").is_file():
        for line in (work / "driver.jsonl").read_text().splitlines():
            r = json.loads(line)
            out[r["item"]] = r
    return out


def _precision_phases(prec: dict) -> dict:
    arms = [v for v in prec.values() if isinstance(v, dict) and "train_compile_s" in v]
    if not arms:
        return {}
    return {"compile_s": sum(a["train_compile_s"] for a in arms)}


def summary(work: Path, out: Path) -> None:
    meta = json.loads((work / "meta.json").read_text())
    dev = _last_json(work / "probe.out") or {}
    plat = _last_json(work / "platform.json") or {}
    done = _driver_results(work)
    prec = {}
    if (work / "precision.json").is_file():
        prec = json.loads((work / "precision.json").read_text())
    peak = meta.get("peak_tflops") or dev.get("peak_tflops") or None
    steps = []
    if (work / "steps.tsv").is_file():
        for line in (work / "steps.tsv").read_text().splitlines():
            name, status, wall, limit = line.split("\t")
            row = {"step": name, "status": status, "wall_s": int(wall), "limit_s": limit}
            ph = done.get(name, {}).get("phases") or (
                _precision_phases(prec) if name == "precision" else {}
            )
            steps.append({**row, **ph})
    results: dict = {"meta": meta, "device": dev or plat, "steps": steps}

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
    elif plat:
        kind = plat.get("kind") or plat["platform"]
        md.append(f"- device: {kind}, {plat.get('chips') or '?'} chips (not opened: the driver "
                  "did not start)")  # fmt: skip
    md.append(
        "- peak for MFU: "
        + (f"{peak:g} TFLOP/s per device" if peak else "unknown (MFU not given)")
        + (f" ({meta['peak_from']})" if peak and meta.get("peak_tflops") else "")
    )
    md.append(f"- sizes: {meta['sizes']}; budget {meta['budget_s']} s")
    md.append(f"- GGUF: {meta['gguf']}; text: {meta['text']}")
    if meta.get("cache"):
        md.append(f"- compilation cache: {meta['cache']}")
    md += [
        "",
        "Each step's wall time and, where it said, its parts: setup (the GGUF and text, the "
        "state's init programs), compile (the measured programs' compiles), run (warmup and "
        "timed steps).",
        "",
        "| step | status | wall s | limit s | setup s | compile s | run s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    md += [
        f"| {s['step']} | {s['status']} | {s['wall_s']} | {s['limit_s']} "
        f"| {_f(s.get('setup_s'))} | {_f(s.get('compile_s'))} | {_f(s.get('run_s'))} |"
        for s in steps
    ]
    skipped = [s["step"] for s in steps if s["status"] != "ok"]
    if skipped:
        md.append("")
        md.append(
            "Not measured in this run: " + ", ".join(skipped) + ". Each runs alone with "
            "`--only NAME` (the names before the colon)."
        )

    # precision: its printed table (and its JSON when it finished)
    p_out = work / "precision.out"
    if p_out.is_file():
        lines = p_out.read_text(errors="replace").splitlines()
        table = [x for x in lines if x.startswith(("|", "# "))]
        if prec:
            results["precision"] = prec
        if table:
            where = "`benchmarks/lm/precision.py`"
            md += ["", f"## precision: {meta['precision_shape']} ({where})", ""]
            md += [f"- {x[2:]}" for x in table if x.startswith("# ")] + [""]
            md += [x for x in table if x.startswith("|")]
            new = prec.get("new")
            if new and "step_ms" in new:
                mfu = ""
                if peak and new.get("gflop"):
                    mfu = f", MFU {new['gflop'] * 1e9 / (new['step_ms'] / 1e3) / (peak * 1e12):.2f}"
                elif new.get("mfu") is not None and peak:
                    mfu = f", MFU {new['mfu']:.2f}"
                md += [
                    "",
                    f"The layer-15 step (arm `new`, pdctl's policy): {new['step_ms']:.1f} ms, "
                    f"{new['tokens_per_s']:,.0f} tokens/s{mfu}.",
                ]
            if not peak:
                md.append("(MFU above is against a nominal 1 TFLOP/s: this device's peak is "
                          "not known.)")  # fmt: skip

    # lm_step: one driver item per site count
    rows = [r for n, r in done.items() if n.startswith("lm_step:")]
    results["lm_step"] = rows
    if rows:
        shape = f"{meta['lm_shape']}, [train] scan_layers = auto"
        md += ["", f"## lm_step: SmolLM2-135M, {shape} (`benchmarks/lm/step.py`)", ""]
        md.append(
            "| sites | scanned | devices | step ms | forward ms | step / forward | tokens/s "
            "| GFLOP | MFU | compile s | loss |"
        )
        md.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            md.append(
                f"| {r['sites']} | {'yes' if r.get('scan') else 'no'} | {r['devices']} "
                f"| {r['step_ms']:.1f} | {r['forward_ms']:.1f} "
                f"| {r['step_ms'] / r['forward_ms']:.2f} | {r['tokens_per_s']:.0f} "
                f"| {r['gflop']:.1f} | {_f(r.get('mfu'), '.3f')} | {r['compile_s']:.1f} "
                f"| {r['loss']:.6g} |"
            )

    # spd_step: one driver item per toy
    rows = [r for n, r in done.items() if n.startswith("spd_step:")]
    results["spd_step"] = rows
    if rows:
        md += ["", "## spd_step: the toys' SPD train step (`benchmarks/toys/spd_step.py`)", ""]
        md.append(
            "| config | devices | batch | train compile s | step ms | samples/s | GFLOP/device "
            "| MFU | peak MiB (donated) | donation reuse | warmup compile s | warmup steps s |"
        )
        md.append("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        for r in rows:
            gflop = r["flops_per_device"] / 1e9 if r["flops_per_device"] else None
            md.append(
                f"| {r['config']} | {r['devices']} | {r['batch']} | {r['train_compile_s']:.1f} "
                f"| {r['step_ms']:.3f} | {r['samples_per_s']:.0f} | {_f(gflop, '.2f')} "
                f"| {_f(r['mfu'], '.3f')} | {r['mem_peak_mib']:.1f} "
                f"| {r['donation_reuse']:.3f} | {r['warmup_compile_s']:.1f} "
                f"| {r['warmup_run_s']:.1f} ({r.get('warmup_steps', '?')}) |"
            )

    # scan_compile: one driver item per side
    rows = [r for n, r in done.items() if n.startswith("scan_compile:")]
    results["scan_compile"] = rows
    if rows:
        md += ["", "## scan_compile: a tiny Llama, unrolled and scanned", ""]
        md.append(
            "`benchmarks/startup/scan_compile.py` (d_model 128, every projection decomposed)."
        )
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

    out.mkdir(parents=True, exist_ok=True)
    (out / "summary.md").write_text("\n".join(md) + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=1) + "\n")


def main() -> None:
    cmd, rest = sys.argv[1], sys.argv[2:]
    if cmd == "deps":
        deps(rest or BENCH_DISTS)
    elif cmd == "imports":
        imports(rest or BENCH_MODULES)
    elif cmd == "platform":
        print(json.dumps(platform_info()))
    elif cmd == "limit":  # precision's: BUDGET LEFT ONLY (the driver's steps that will run)
        only = {n for n in rest[2].replace(",", " ").split() if n}
        later = [k for n, k in plan("full") if not only or n.split(":")[0] in only]
        print(item_limit(int(rest[0]), "precision", float(rest[1]), later, whole=False))
    elif cmd == "probe":
        from pdctl.engine import runtime

        runtime.configure_devices()  # libtpu without chips: the CPU, as pdctl's commands
        print(json.dumps(probe_devices()))
    elif cmd == "run":
        run(rest)
    elif cmd == "stopped":
        stopped(Path(rest[0]), rest[1], rest[2], int(rest[3]))
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
