"""Sharded load of a Hugging Face checkpoint: wall time and peak host memory per process.

Creates a random ~150M-parameter Llama with transformers (float32, `save_pretrained` in shards
of 200 MB), then loads it with `pdctl.science.targets.hf.load.load_hf_params` in fresh
processes:
  (a) 1 process with 1 CPU device (mesh data=1 x fsdp=1: the whole model on that device);
  (b) 2 processes x 2 CPU devices each, `jax.distributed` on localhost with gloo, mesh fsdp=4:
      each process reads and holds the slices of its 2 devices.
Each configuration is also run without the load ("idle": imports, backend and mesh up, abstract
params traced, nothing read) so the baseline RSS of a JAX process is on the table beside it.
Peak RSS is the kernel's high-water mark, VmHWM of /proc/self/status, which counts file pages
mapped while reading as well as anonymous memory. Nothing is subtracted from it.

On the CPU backend the devices' buffers are host memory: a process that holds a quarter of the
model per device holds `resident` bytes in RSS whatever the loader does, so that column is the
floor under the peak beside the idle baseline.

    python -m benchmarks.startup.hf_load [--dir DIR] [--layers 16] [--keep]
"""

from __future__ import annotations

import argparse
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks._harness import child_env, machine_line, module_argv

CONFIG = dict(
    vocab_size=32000,
    hidden_size=768,
    intermediate_size=2048,
    num_attention_heads=12,
    num_key_value_heads=4,
    tie_word_embeddings=False,
)
MIN_SIZE = 1024  # the [mesh] fsdp_min_param_size default


def vm(field: str) -> int:
    """A /proc/self/status memory field in bytes (VmHWM: peak RSS; VmRSS: current)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def make_model(path: Path, layers: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=layers, **CONFIG))
    n = sum(p.numel() for p in model.parameters())
    print(f"created a random Llama: {n / 1e6:.1f}M parameters, {layers} layers", flush=True)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="200MB")


def worker(args: argparse.Namespace) -> None:
    """One process: bring JAX up, build the mesh and shardings, load (unless --idle), report."""
    import jax

    if args.num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
        jax.distributed.initialize(
            coordinator_address=args.coordinator,
            num_processes=args.num_processes,
            process_id=args.process_id,
        )
    import numpy as np
    from jax.sharding import Mesh

    from pdctl.engine.sharding import tree_shardings
    from pdctl.science.targets.hf import HFCausalLM
    from pdctl.science.targets.hf.load import load_hf_params

    devices = jax.devices()
    mesh = Mesh(np.array(devices).reshape(1, len(devices)), ("data", "fsdp"))
    target = HFCausalLM.from_dir(args.model, seq_len=128)
    shardings = tree_shardings(jax.eval_shape(target.init, jax.random.key(0)), mesh, MIN_SIZE)
    out = {"process": jax.process_index(), "devices": len(jax.local_devices())}
    if not args.idle:
        t0 = time.perf_counter()
        params, info = load_hf_params(args.model, target, shardings)
        jax.block_until_ready(params)
        out["wall_s"] = time.perf_counter() - t0
        leaves = jax.tree.leaves(params)
        out["resident"] = sum(s.data.nbytes for x in leaves for s in x.addressable_shards)
        assert all(x.sharding == s for x, s in zip(leaves, jax.tree.leaves(shardings), strict=True))
        out["bytes"] = info["bytes"]
    out["hwm"], out["rss"] = vm("VmHWM"), vm("VmRSS")
    print("RESULT " + json.dumps(out), flush=True)
    if args.num_processes > 1:
        jax.distributed.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(model: Path, processes: int, devices: int, idle: bool) -> list[dict]:
    env = child_env(JAX_PLATFORMS="cpu")
    env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={devices}"
    base = [sys.executable, *module_argv(__spec__.name, "--worker", "--model", model)]
    base += ["--num-processes", str(processes)] + (["--idle"] if idle else [])
    port = _free_port()
    procs = [
        subprocess.Popen(
            [*base, "--process-id", str(i), "--coordinator", f"127.0.0.1:{port}"],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(processes)
    ]
    results = []
    for p in procs:
        text, _ = p.communicate(timeout=1200)
        lines = [line for line in text.splitlines() if line.startswith("RESULT ")]
        if p.returncode or not lines:
            raise SystemExit(f"worker failed ({p.returncode}):\n{text}")
        results.append(json.loads(lines[-1][len("RESULT ") :]))
    return sorted(results, key=lambda r: r["process"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, help="model directory (created if it has no config.json)")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--keep", action="store_true", help="keep the temporary model directory")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--idle", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--make-model", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--num-processes", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--process-id", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--coordinator", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    print(machine_line())
    if args.make_model:
        make_model(args.model, args.layers)
        return

    tmp = None
    model = args.dir
    if model is None:
        tmp = Path(tempfile.mkdtemp(prefix="pdctl-hf-load-"))
        model = tmp / "llama"
    try:
        if not (model / "config.json").is_file():
            # In a subprocess, so that torch's memory is not this process's concern.
            cmd = [sys.executable, *module_argv(__spec__.name, "--make-model", "--model", model)]
            subprocess.run([*cmd, "--layers", str(args.layers)], check=True, env=child_env())
        ckpt = sum(f.stat().st_size for f in model.glob("*.safetensors"))
        n_files = len(list(model.glob("*.safetensors")))
        from pdctl.science.targets.hf.load import read_index

        largest = max(t.nbytes for t in read_index(model).tensors.values())
        print(
            f"checkpoint: {model} ({n_files} files, {ckpt / 2**20:.1f} MiB, largest tensor "
            f"{largest / 2**20:.1f} MiB)\n"
        )
        rows = []
        for label, procs, devs, target in (
            ("(a) 1 proc x 1 dev", 1, 1, 1.3),
            ("(b) 2 procs x 2 devs, fsdp=4", 2, 2, 0.5),
        ):
            idle = launch(model, procs, devs, idle=True)
            loaded = launch(model, procs, devs, idle=False)
            for i, r in zip(idle, loaded, strict=True):
                rows.append((label, r["process"], r["wall_s"], r["hwm"], i["hwm"], r["resident"],
                             ckpt, r["hwm"] / ckpt, target))  # fmt: skip
        mib = 2**20
        head = (
            f"{'configuration':30} {'proc':>4} {'load s':>7} {'peak RSS':>9} {'idle RSS':>9} "
            f"{'resident':>9} {'ckpt':>8} {'peak/ckpt':>9} {'target':>7}"
        )
        print(head)
        print("-" * len(head))
        for label, proc, wall, hwm, idle_hwm, res, ck, ratio, target in rows:
            print(
                f"{label:30} {proc:>4} {wall:>7.2f} {hwm / mib:>8.0f}M {idle_hwm / mib:>8.0f}M "
                f"{res / mib:>8.0f}M {ck / mib:>7.0f}M {ratio:>9.2f} {'<= ' + str(target):>7}"
            )
        print(
            "\npeak RSS: VmHWM of the loading process; idle RSS: VmHWM of the same process "
            "without the load; resident: bytes of the shards its devices hold after the load "
            "(host memory on CPU)"
        )
    finally:
        if tmp is not None and not args.keep:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    main()
