"""The fit check of a Llama-3.1-8B decomposition from its config.json alone, per mesh.

A run directory from the hf-lm template whose `[target] path` holds only Llama-3.1-8B's
`config.json` (32 layers, d 4096, MLP 14,336, 32 heads / 8 kv heads, vocab 128,256, llama3
RoPE): every attention and MLP projection decomposed (224 sites, the template's C: 512 per MLP
site, 256 per attention site), seq_len 512, batch 64, bfloat16 params and compute, layers
scanned. Per mesh, in a child process of `pdctl inspect-sharding --devices N --mesh M
--device-kind h100 --json` (simulated CPU devices, nothing allocated): the train step's compile
s, its per-device peak and temporaries, the evaluation programs' peaks, the verdict, and the
child's wall time. Meshes run one after the other (each takes minutes and both cores).
`--device-kind` (default h100) names the device; a TPU kind or `--topology` (e.g. v5p:2x4x4,
v5e:4x8: 32 chips) compiles with XLA:TPU for that slice where libtpu is installed (the
`tpu-aot` extra), against the chip's HBM.

    python -m benchmarks.memory.fit_8b [--devices 32] [--mesh data=4,tp=8 --mesh data=4,fsdp=8]
        [--device-kind h100 | --topology v5p:2x4x4] [--remat full] [--grad-accum K]

Over 32 simulated devices raise the memory-map limit first (`sysctl -w
vm.max_map_count=262144`; README, "GPUs, TPUs and several hosts").
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import machine_line

LLAMA_31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}
GIB = 2**30


def make_run(root: Path, train: dict | None = None) -> Path:
    model = root / "llama-3.1-8b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_31_8B))
    subprocess.run(
        [sys.executable, "-m", "pdctl", "new", "run", "--template", "hf-lm"],
        cwd=root,
        check=True,
        capture_output=True,
    )
    run = root / "run"
    from pdctl.testing.runs import edit_config

    edit_config(
        run,
        {
            "target": {"path": str(model)},
            "data": {"seq_len": 512},
            "precision": {"param_dtype": "bfloat16", "compute_dtype": "bfloat16"},
            "train": {"batch_size": 64, "scan_layers": True, **(train or {})},
        },
    )
    return run


def fit(run: Path, devices: int, mesh: str, device: list[str]) -> dict:
    from pdctl.inspect.fit import verdict

    cmd = [sys.executable, "-m", "pdctl", "--project", str(run), "inspect-sharding",
           "--stage", "train", "--devices", str(devices), "--mesh", mesh, *device,
           "--json"]  # fmt: skip
    t0 = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if out.returncode:
        return {"mesh": mesh, "error": out.stderr.strip().splitlines()[-1:], "wall_s": wall}
    rep = json.loads(out.stdout)
    progs = rep["fit"]["programs"]
    step, evals = progs[0], progs[1:]  # the train step first, then the evaluation's programs
    return {
        "mesh": mesh,
        "shape": rep["mesh"],
        "compiler": rep["fit"].get("compiler"),
        "budget": rep["fit"].get("budget"),
        "compile_s": step["compile_s"],
        "peak_gib": step["peak_bytes"] / GIB,
        # a program XLA:TPU refused states no parts, only what it needs at least
        "refused": "oom" in step,
        "temp_gib": step.get("temp_bytes", float("nan")) / GIB,
        "args_gib": step.get("argument_bytes", float("nan")) / GIB,
        # what the arguments are, by kind (target, components, sources, optimizer, ...)
        "per_device_gib": {k: v / GIB for k, v in rep["totals"]["per_device"].items()},
        "eval_gib": {q["program"]: q["peak_bytes"] / GIB for q in evals if "peak_bytes" in q},
        # peaks are XLA:CPU's x this where it stands in for a TPU without libtpu (else 1)
        "peak_factor": rep["fit"].get("peak_factor", 1.0),
        "verdict": verdict(rep["fit"]),  # as inspect-sharding prints it
        "margin_gib": rep["fit"]["margin_bytes"] / GIB,
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--devices", type=int, default=32)
    ap.add_argument("--mesh", action="append", default=None)
    ap.add_argument("--device-kind", default="h100", help="h100, tpu-v5p, tpu-v5e, ...")
    ap.add_argument("--topology", help="a TPU slice, e.g. v5p:2x4x4 (XLA:TPU, needs libtpu)")
    ap.add_argument("--remat", help="[train] remat (the template's: none)")
    ap.add_argument("--grad-accum", type=int, help="[train] grad_accum_steps (the template's: 1)")
    args = ap.parse_args()
    print(machine_line())
    device = ["--topology", args.topology] if args.topology else ["--device-kind", args.device_kind]
    meshes = args.mesh or ["data=4,tp=8", "data=4,fsdp=8"]
    os.environ.setdefault("PDCTL_LOG", "warning")
    rows = []
    with tempfile.TemporaryDirectory(prefix="pdctl-fit8b-") as tmp:
        train = {"remat": args.remat} if args.remat else {}
        if args.grad_accum:
            train["grad_accum_steps"] = args.grad_accum
        run = make_run(Path(tmp), train)
        for mesh in meshes:
            row = fit(run, args.devices, mesh, device)
            print(json.dumps(row), flush=True)
            rows.append(row)
    where = rows[0].get("budget") if rows and "budget" in rows[0] else " ".join(device[1:])
    compiler = rows[0].get("compiler") if rows and "compiler" in rows[0] else "?"
    print(f"\nLlama-3.1-8B, 224 sites, {args.devices} devices ({compiler}), budget {where}")
    print("| mesh | compile s | step peak GiB | temporaries GiB | arguments GiB | eval peaks GiB "
          "| verdict | wall s |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['mesh']} | error: {r['error']} | | | | | | {r['wall_s']:.0f} |")
            continue
        ev = ", ".join(f"{k} {v:.2f}" for k, v in r["eval_gib"].items())
        ge = ">= " if r["refused"] else ""
        print(f"| {r['mesh']} | {r['compile_s']:.1f} | {ge}{r['peak_gib']:.2f} "
              f"| {r['temp_gib']:.2f} "
              f"| {r['args_gib']:.2f} | {ev} | {r['verdict']} ({r['margin_gib']:.2f}) "
              f"| {r['wall_s']:.0f} |")  # fmt: skip
    ok = [r for r in rows if "error" not in r]
    if len(ok) == 2:
        print(f"\npeak ratio {ok[0]['mesh']} / {ok[1]['mesh']}: "
              f"{ok[0]['peak_gib'] / ok[1]['peak_gib']:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
