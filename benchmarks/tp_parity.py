"""Tensor parallelism against one device: the train step's metrics over 5 steps from the same
start, and what the split costs in collectives and per-device bytes.

A tiny random Llama (d 32, 4 heads / 4 kv heads, MLP 64, 2 layers, layers scanned) and a tiny
GPT-2 (d 32, 4 heads, unrolled), every projection decomposed with the hf-lm template's losses,
on 4 simulated CPU devices. Per mesh: the largest relative difference of any scalar metric
from the one-device run (and whether the L0 counts are equal), the compiled step's
all-reduce / all-gather / collective-permute counts, and XLA's per-device argument and
temporary bytes.

    python benchmarks/tp_parity.py
"""

from __future__ import annotations

import collections
import json
import os
import re
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=4"
).strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

MESHES = [(1, 1, 1), (1, 1, 2), (1, 1, 4), (2, 1, 2), (1, 2, 2)]
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")


def main() -> None:
    from test_tensor_parallel import GPT2, LLAMA, _raw, _trajectory

    print("| model | mesh (data, fsdp, tp) | max rel. diff of a metric | L0 equal | collectives "
          "| arguments KiB / device | temporaries KiB / device |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, config, scan in (("llama", LLAMA, True), ("gpt2", GPT2, False)):
        d = Path(tempfile.mkdtemp(prefix="pdctl-tp-"))
        (d / "config.json").write_text(json.dumps(config))
        raw = _raw(d, scan)
        ref = None
        for mesh in MESHES:
            rows, prog = _trajectory(raw, *mesh)
            if ref is None:
                ref = rows
            rel, l0_equal = 0.0, True
            for a, b in zip(rows, ref, strict=True):
                for k in b:
                    if k.startswith("l0/"):
                        l0_equal &= a[k] == b[k]
                    else:
                        rel = max(rel, abs(a[k] - b[k]) / max(abs(b[k]), 1e-6))
            compiled = (
                prog.jit()
                .lower(prog.frozen_abstract[0], prog.abstract_state, prog.batch_abstract)
                .compile()
            )
            text = compiled.as_text()
            ops = collections.Counter(re.findall(r"= \S+ (" + "|".join(COLLECTIVES) + r")\(", text))
            m = compiled.memory_analysis()
            counts = ", ".join(f"{k} {v}" for k, v in sorted(ops.items())) or "none"
            print(f"| {name} | {mesh} | {rel:.1e} | {l0_equal} | {counts} "
                  f"| {m.argument_size_in_bytes / 1024:.0f} "
                  f"| {m.temp_size_in_bytes / 1024:.0f} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
