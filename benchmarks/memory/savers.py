"""The train state's memory savers, measured: `moments_dtype = "bfloat16"` in `[train.optim]`
and `[train.ci_optim]` (Adam's first moment of V/U and of the CI functions in bfloat16) and
`[train.ppgd] dtype = "bfloat16"` (the PPGD sources and their first moment in bfloat16), alone
and together, against float32.

Two measurements, each side in a fresh child process, the sides interleaved:

- memory: the train step of a Llama shaped like SmolLM2-135M (d_model 576, MLP 1536, 9 heads,
  3 kv heads, vocab 49152; `--layers` of its 30 layers, every projection decomposed as the hf-lm
  template does: C 512 MLP, 256 attention, seq 256, batch 32, per-example-and-position sources),
  lowered and compiled from abstract arguments on pdctl's default devices (nothing is run):
  XLA's per-device argument bytes (the state and the frozen target), temporaries and peak, and
  the state's own bytes per device.
- numerics: benchmarks/startup/scan_compile.py's tiny random Llama (d_model 128, 2 layers, seq 32,
  batch 4, the same losses) trained `--steps` steps from the same start on the same batch:
  the loss at the end and its relative difference to float32, and the step time.

    python -m benchmarks.memory.savers [--layers 4] [--steps 200]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import _harness

ROOT = Path(__file__).resolve().parents[2]
BF16_MOMENTS = {"optim": {"moments_dtype": "bfloat16"}, "ci_optim": {"moments_dtype": "bfloat16"}}
SIDES = {
    "float32": {},
    "moments bf16": BF16_MOMENTS,
    "sources bf16": {"ppgd": {"dtype": "bfloat16"}},
    "both bf16": {**BF16_MOMENTS, "ppgd": {"dtype": "bfloat16"}},
}
SMOL = dict(
    architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
    intermediate_size=1536, num_attention_heads=9, num_key_value_heads=3,
    max_position_embeddings=8192, tie_word_embeddings=True,
)  # fmt: skip


def with_side(raw: dict, side: str) -> dict:
    """`raw` (a parsed pdctl.toml) with `side`'s keys set in its [train] tables."""
    for table, keys in SIDES[side].items():
        raw["train"].setdefault(table, {}).update(keys)
    return raw


def smol_config(side: str, layers: int):
    """The hf-lm template on a SmolLM2-135M-shaped config.json of `layers` layers (its sites,
    C and batch), seq 256, batch 32, layers scanned, with `side`'s keys."""
    import tomllib

    from pdctl.config import parse_config
    from pdctl.templates import templates_root

    d = Path(tempfile.mkdtemp(prefix="pdctl-savers-"))
    (d / "config.json").write_text(json.dumps({**SMOL, "num_hidden_layers": layers}))
    raw = tomllib.loads((templates_root() / "hf-lm" / "pdctl.toml").read_text())
    raw["target"]["path"] = str(d)
    raw["data"]["seq_len"] = 256
    raw["train"]["batch_size"] = raw["train"]["eval_batch_size"] = 32
    raw["train"]["scan_layers"] = True
    return parse_config(with_side(raw, side))


def child_memory(side: str, layers: int) -> dict:
    from pdctl.engine import runtime

    runtime.configure_devices()
    import jax

    from pdctl.engine import sharding
    from pdctl.inspect import memory_report
    from pdctl.stages import train
    from pdctl.stages.inputs import target_from_config

    cfg = smol_config(side, layers)
    mesh = sharding.make_mesh(-1, 1)
    target = target_from_config(cfg, need_weights=False)
    prog = train.program(cfg, mesh, target)

    t0 = time.perf_counter()
    compiled = prog.lower().compile()  # from abstract arguments, as inspect-sharding --compile
    compile_s = time.perf_counter() - t0

    def per_device(tree, shardings) -> int:
        total = 0
        for a, s in zip(jax.tree.leaves(tree), jax.tree.leaves(shardings), strict=True):
            shard = s.shard_shape(a.shape)
            n = 1
            for x in shard:
                n *= x
            total += n * a.dtype.itemsize
        return total

    by_item = {
        k: per_device(prog.abstract_state[k], prog.state_shardings[k]) for k in prog.abstract_state
    }
    rep = memory_report(compiled, sum(by_item.values()))
    return {
        "side": side,
        "layers": layers,
        "devices": mesh.size,
        "compile_s": compile_s,
        "state_bytes": by_item,
        **{k: rep[k] for k in ("argument_bytes", "temp_bytes", "peak_bytes_estimate")},
    }


def child_numerics(side: str, steps: int) -> dict:
    from pdctl.engine import runtime

    runtime.configure_devices()
    import jax

    from benchmarks.startup import scan_compile
    from pdctl.config import parse_config

    raw = scan_compile.tiny_raw(2, scan=True)
    with_side(raw, side)
    _, _, prog, params, state, batch, _ = scan_compile.fresh_train(parse_config(raw))
    step = prog.jit().lower(params, state, batch).compile()
    losses = []
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(params, state, batch)
        losses.append(m["total"])
    jax.block_until_ready(losses)
    step_ms = (time.perf_counter() - t0) / steps * 1e3
    losses = [float(x) for x in jax.device_get(losses)]
    return {"side": side, "steps": steps, "step_ms": step_ms, "losses": losses}


def run_child(*args: str) -> dict:
    argv = _harness.module_argv(__spec__.name, "--child", *args)
    return _harness.run_child(argv, what=f"child {args}")


def mib(n: float) -> str:
    return f"{n / 2**20:9.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", type=Path)
    ap.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        kind, side, n = a.child
        fn = child_memory if kind == "memory" else child_numerics
        print(json.dumps(fn(side, int(n))))
        return
    mem, num = [], []
    for side in SIDES:  # interleaved: one side's memory and numerics children back to back
        mem.append(run_child("memory", side, str(a.layers)))
        print(json.dumps(mem[-1]), file=sys.stderr, flush=True)
        num.append(run_child("numerics", side, str(a.steps)))
        print(json.dumps({k: v for k, v in num[-1].items() if k != "losses"}), file=sys.stderr)
    base = mem[0]
    print(f"memory: SmolLM2-135M shape, {a.layers} layers, {base['devices']} devices, "
          "MiB per device")  # fmt: skip
    items = list(base["state_bytes"])
    print(f"{'side':<13}" + "".join(f"{k:>12}" for k in items)
          + f"{'argument':>10}{'temp':>10}{'peak':>10}{'vs f32':>8}")  # fmt: skip
    for r in mem:
        sb = r["state_bytes"]
        print(f"{r['side']:<13}" + "".join(f"{mib(sb[k]):>12}" for k in items)
              + f"{mib(r['argument_bytes']):>10}{mib(r['temp_bytes']):>10}"
              f"{mib(r['peak_bytes_estimate']):>10}"
              f"{r['peak_bytes_estimate'] / base['peak_bytes_estimate']:>8.3f}")  # fmt: skip
    ref = num[0]["losses"]
    print(f"numerics: tiny Llama, {a.steps} steps from the same start on one batch")
    print(f"{'side':<13}{'loss 1':>12}{'loss end':>12}{'rel. diff end':>15}"
          f"{'max rel. diff':>15}{'step ms':>9}")  # fmt: skip
    for r in num:
        ls = r["losses"]
        rel = [abs(x - y) / abs(y) for x, y in zip(ls, ref, strict=True)]
        print(f"{r['side']:<13}{ls[0]:>12.6g}{ls[-1]:>12.6g}{rel[-1]:>15.2e}{max(rel):>15.2e}"
              f"{r['step_ms']:>9.1f}")  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps({"memory": mem, "numerics": num}, indent=1))


if __name__ == "__main__":
    main()
