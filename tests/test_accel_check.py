"""benchmarks/accel_check.sh: its flags are checked before anything is written, and its summary
shows what the benchmarks printed (the benchmarks themselves need an accelerator:
docs/performance.md)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"


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


def test_summary_tables(tmp_path):
    work, out = tmp_path / "work", tmp_path / "out"
    work.mkdir()
    tool = [sys.executable, str(BENCH / "accel_check.py")]
    subprocess.run(
        [*tool, "meta", str(work / "meta.json"), "commit=abc123", "budget_s=540", "sizes=full",
         "gguf=g.gguf", "text=/t", "peak_tflops=200", "peak_from=table", "lm_tokens=256",
         "lm_shape=4 x 64 tokens, C 256", "precision_shape=layer 15"],
        check=True,
    )  # fmt: skip
    (work / "probe.out").write_text(
        json.dumps({"platform": "tpu", "device_kind": "TPU v5 lite", "devices": 1,
                    "memory_gib": 15.75, "peak_tflops": 197.0, "jax": "0.10.2",
                    "jaxlib": "0.10.2", "python": "3.11.7", "host_cpus": 13})
    )  # fmt: skip
    (work / "steps.tsv").write_text("lm_step:3\tok\t80\t108\nlm_step:90\tskipped: budget\t0\t-\n")
    lm = {"sites": 3, "devices": 1, "step_ms": 10.0, "forward_ms": 4.0, "compile_s": 70.0,
          "gflop": 100.0, "peak_rss_gib": 2.0, "loss": 1.5, "top_ops_ms": []}  # fmt: skip
    (work / "lm_step_3.out").write_text("a warning\n" + json.dumps(lm) + "\n")
    (work / "precision.out").write_text("# tpu x1\n| arm | ms |\n| --- | --- |\n| new | 9 |\n")
    new = {"step_ms": 50.0, "tokens_per_s": 163840.0, "mfu": 0.4}
    (work / "precision.json").write_text(json.dumps({"new": new}))
    subprocess.run([*tool, "summary", str(work), str(out)], check=True)
    md = (out / "summary.md").read_text().splitlines()
    assert "- commit: abc123" in md
    assert any(x.startswith("- device: 1 x TPU v5 lite (tpu, 15.8 GiB)") for x in md)
    assert "| lm_step:90 | skipped: budget | 0 | - |" in md
    # 256 tokens in 10 ms; 100 GFLOP in 10 ms against 200 TFLOP/s (the meta's peak wins)
    assert "| 3 | 1 | 10.0 | 4.0 | 2.50 | 25600 | 100.0 | 0.050 | 70.0 | 1.5 |" in md
    assert "- tpu x1" in md and "| new | 9 |" in md
    assert any("50.0 ms, 163,840 tokens/s, MFU 0.40" in x for x in md)
    assert json.loads((out / "results.json").read_text())["lm_step"][0]["tokens_per_s"] == 25600
