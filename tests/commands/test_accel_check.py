"""benchmarks/tpu/accel_check.sh: its flags are checked before anything is written, and its summary
shows what the benchmarks printed (the benchmarks themselves need an accelerator:
docs/performance.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks" / "tpu"
# the Python half, as accel_check.sh runs it (a module, from the checkout's root)
TOOL = [sys.executable, "-m", "benchmarks.tpu.accel_check"]


@pytest.mark.parametrize(
    "args, names",
    [
        (["--budget", "x"], "--budget"),
        (["--only", "spd_step,foo"], "--only"),
        (["--arms", "old bad"], "--arms"),
        (["--gguf", "/no/such.gguf", "--only", "lm_step"], "--gguf"),
        (["--gguf", str(ROOT / "pyproject.toml"), "--text", "/no/such/dir"], "--text"),
        (["--bogus"], "--bogus"),
    ],
)
def test_bad_flags_one_line_nothing_written(tmp_path, args, names):
    out = tmp_path / "out"
    r = subprocess.run(
        ["bash", str(BENCH / "accel_check.sh"), "--out", str(out), *args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and names in lines[0], r.stderr
    assert not out.exists()


def _meta(tool, work):
    subprocess.run(
        [*tool, "meta", str(work / "meta.json"), "commit=abc123", "budget_s=540", "sizes=full",
         "gguf=g.gguf", "text=/t", "peak_tflops=200", "peak_from=table",
         "lm_shape=4 x 64 tokens, C 256", "precision_shape=layer 15"],
        check=True, cwd=ROOT,
    )  # fmt: skip


def test_summary_tables(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    tool = TOOL
    _meta(tool, work)
    (work / "probe.out").write_text(
        json.dumps({"platform": "tpu", "device_kind": "TPU v5 lite", "devices": 1,
                    "memory_gib": 15.75, "peak_tflops": 197.0, "jax": "0.10.2",
                    "jaxlib": "0.10.2", "python": "3.11.7", "host_cpus": 13})
    )  # fmt: skip
    (work / "steps.tsv").write_text(
        "precision\tok\t250\t243\nlm_step:3\tok\t80\t108\nlm_step:90\tskipped: budget\t0\t-\n"
    )
    lm = {"item": "lm_step:3", "sites": 3, "devices": 1, "scan": False, "step_ms": 10.0,
          "forward_ms": 4.0, "compile_s": 70.0, "gflop": 100.0, "loss": 1.5,
          "tokens_per_s": 25600.0, "mfu": 0.05,
          "phases": {"setup_s": 6.0, "compile_s": 72.5, "run_s": 1.5}}  # fmt: skip
    (work / "driver.jsonl").write_text(json.dumps(lm) + "\n")
    (work / "precision.out").write_text("# tpu x1\n| arm | ms |\n| --- | --- |\n| new | 9 |\n")
    new = {"step_ms": 50.0, "tokens_per_s": 163840.0, "mfu": 0.4, "gflop": 4000.0,
           "train_compile_s": 80.0}  # fmt: skip
    (work / "precision.json").write_text(json.dumps({"new": new}))
    subprocess.run([*tool, "summary", str(work), str(out)], check=True, cwd=ROOT)
    md = (out / "summary.md").read_text().splitlines()
    assert "- commit: abc123" in md
    assert any(x.startswith("- device: 1 x TPU v5 lite (tpu, 15.8 GiB)") for x in md)
    assert "| lm_step:90 | skipped: budget | 0 | - | - | - | - |" in md
    # the parts of each step's time: the driver's phases, precision's compiles
    assert "| lm_step:3 | ok | 80 | 108 | 6.0 | 72.5 | 1.5 |" in md
    assert "| precision | ok | 250 | 243 | - | 80.0 | - |" in md
    assert "| 3 | no | 1 | 10.0 | 4.0 | 2.50 | 25600 | 100.0 | 0.050 | 70.0 | 1.5 |" in md
    assert "- tpu x1" in md and "| new | 9 |" in md
    # 4000 GFLOP in 50 ms against 200 TFLOP/s (the meta's peak wins over the probe's)
    assert any("50.0 ms, 163,840 tokens/s, MFU 0.40" in x for x in md)
    assert json.loads((out / "results.json").read_text())["lm_step"][0]["tokens_per_s"] == 25600


def test_item_limits_and_plan():
    from benchmarks.tpu import accel_check as ac

    names = [n for n, _ in ac.plan("full")]
    assert names[:4] == ["lm_step:3", "lm_step:90", "spd_step:tms", "spd_step:resid-mlp"]
    assert [n for n, _ in ac.plan("tiny")][1] == "lm_step:12"
    keys = [k for _, k in ac.plan("full")]
    assert set(keys) == set(ac.SHARES) and keys[: len(ac.PLANNED)] == list(ac.PLANNED)
    # a planned step: what is left but the later planned steps' shares (4 % and 5 % of 540)
    assert ac.item_limit(540, "lm_step:b", 200.0, keys[2:], whole=False) == 151  # 200-21.6-27
    # precision also leaves the driver's start; with no driver step after it, all that is left
    assert ac.item_limit(540, "precision", 520.0, keys, whole=False) == 520 - 162 - 20  # 30 %
    assert ac.item_limit(540, "precision", 520.0, [], whole=False) == 520
    # an unplanned step: at most its share, never more than is left
    assert ac.item_limit(540, "scan_compile:scan", 300.0, keys[5:], whole=False) == 37
    assert ac.item_limit(540, "scan_compile:scan", 30.5, keys[5:], whole=False) == 30
    assert ac.item_limit(540, "lm_step:a", 300.0, keys[1:], whole=True) == 300
    # the plan for 540 s: about 20 s of setup, precision, the planned steps and the reserve fit
    limit = ac.item_limit(540, "precision", 540 - 20 - ac.RESERVE_S, keys, whole=False)
    assert limit >= 300
    assert min(ac.SHARES.values()) * 540 / 100 >= ac.MIN_START_S


def test_driver_stops_an_item_at_its_limit_and_skips_what_does_not_fit(tmp_path, monkeypatch):
    """The driver's loop on this CPU, its items replaced: the first runs past its limit and
    is stopped there (SIGALRM), the next one has no time left and is skipped; both recorded."""
    import time

    from benchmarks.tpu import accel_check as ac

    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    _meta(TOOL, work)
    calls = []

    def item(self, name):
        calls.append(name)
        time.sleep(30)

    ac.probe_devices()  # JAX started here: the 3 s below are the items' alone
    monkeypatch.setattr(ac.Driver, "run_item", item)
    monkeypatch.setattr(ac, "MIN_START_S", 1)
    monkeypatch.setattr(ac, "RESERVE_S", 0)
    t0 = time.monotonic()
    ac.run([str(work), str(out), "--sizes", "tiny", "--budget", "100", "--seconds", "3",
            "--only", "scan_compile", "--allow-cpu"])  # fmt: skip
    assert time.monotonic() - t0 < 20
    assert calls == ["scan_compile:scan"]
    rows = [ln.split("\t") for ln in (work / "steps.tsv").read_text().splitlines()]
    assert rows[0][0] == "driver: start, open the device"
    assert rows[1][:2] == ["scan_compile:scan", "stopped at its limit"]
    assert rows[2][:2] == ["scan_compile:unrolled", "skipped: budget"]
    assert "| scan_compile:unrolled | skipped: budget |" in (out / "summary.md").read_text()


def test_stopped_records_the_running_item_and_the_rest(tmp_path):
    work = tmp_path
    (work / "steps.tsv").write_text("driver: start, open the device\tok\t20\t-\n"
                                    "lm_step:3\tok\t60\t91\n")  # fmt: skip
    (work / "driver.current").write_text("lm_step:90\t0\t64\n")
    tool = TOOL
    subprocess.run([*tool, "stopped", str(work), "full", "", "124"], check=True, cwd=ROOT)
    rows = [ln.split("\t")[:2] for ln in (work / "steps.tsv").read_text().splitlines()]
    assert rows[2] == ["lm_step:90", "stopped at the budget"]
    assert rows[3:] == [[n, "skipped: budget"] for n in (
        "spd_step:tms", "spd_step:resid-mlp", "scan_compile:scan",
        "scan_compile:unrolled", "spd_step:llama-mlp")]  # fmt: skip
    assert not (work / "driver.current").exists()


@pytest.mark.slow  # ~10-20 s: the imports check and JAX's own look at the devices
def test_cpu_only_refused_one_line_nothing_written(tmp_path):
    """Where neither the PCI bus nor JAX sees an accelerator, the check stops before anything
    runs or is written (--allow-cpu runs it anyway)."""
    out = tmp_path / "out"
    r = subprocess.run(
        ["bash", str(BENCH / "accel_check.sh"), "--out", str(out), "--only", "spd_step"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stdout + r.stderr
    # (from here on the script's output is one stream, kept for its log)
    last = (r.stdout + r.stderr).strip().splitlines()[-1]
    assert last.startswith("accel_check: JAX sees only the CPU") and "--allow-cpu" in last
    assert not out.exists()
