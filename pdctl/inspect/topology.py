"""The fit check compiled by the TPU's own compiler, from any machine (issue 42).

With the `libtpu` wheel installed (`pip install -e ".[tpu-aot]"`), JAX describes a TPU topology
that this machine does not have (`jax.experimental.topologies.get_topology_desc`): compile-only
devices that a mesh can be built on. The stage's programs, lowered from `ShapeDtypeStruct`s with
their `NamedSharding`s on that mesh, then compile with XLA:TPU (nothing is allocated, the
default backend stays the CPU), and `memory_analysis()` states the chip's own layout: (8, 128)
tiles, its fusions and its schedule. A program whose temporaries exceed the chip's HBM does not
compile at all: XLA:TPU fails with the same line the chip prints (`RESOURCE_EXHAUSTED: Ran out
of memory on HBM, the total memory required for HLO temporaries (16.82G) exceeds available HBM
(15.75G)`), and the fit check reports that as the verdict.

Without libtpu the fit check compiles for XLA:CPU (`NO_LIBTPU` says what that can't know).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from dataclasses import dataclass
from typing import Any

from pdctl.errors import PdctlError

GIB = 2**30
# HBM per chip as XLA:TPU states it (libtpu 0.0.42.1, JAX 0.10.2): the "available HBM (...)"
# of its out-of-memory error when compiling an oversized program for a one-chip topology of
# each generation, in its units (G = GiB, two decimals). The v5e figure is also what the chip
# said in issue 42 ("exceeds available HBM (15.75G)").
HBM_BYTES: dict[str, int] = {
    "v5e": round(15.75 * GIB),
    "v5p": round(95.74 * GIB),
    "v6e": round(31.25 * GIB),
    "v4": round(30.75 * GIB),
}
# Topology dimensions (2 for the "lite" chips, 3 for the others) and the chip configuration:
# v4 / v5p fuse their two TensorCores into one device ("megacore"), as on the real slices.
DIMS = {"v5e": 2, "v6e": 2, "v5p": 3, "v4": 3}
CHIP_CONFIG = {"v5e": "default", "v6e": "default", "v5p": "megacore", "v4": "megacore"}
ACCELERATOR_TYPE = {"v5e": "v5litepod-{n}", "v6e": "v6e-{n}", "v5p": "v5p-{c}", "v4": "v4-{c}"}

# XLA:CPU's peaks scaled by this stand in for XLA:TPU's where libtpu is missing: the largest
# ratio XLA:TPU / XLA:CPU of a program's peak measured, over the programs of >= 0.1 GiB
# (benchmarks/memory/fit_margin.py, 2026-12-06: 1.02-1.57 for SmolLM2's, the toys' far below 1;
# docs/performance.md), rounded up. Temporaries alone vary more (0.1x-4x: a TPU pads and tiles)
CPU_PEAK_MARGIN = 1.6

NO_LIBTPU = (
    "estimate from XLA:CPU, not the TPU compiler: argument / output / alias bytes are exact, "
    f"temporaries are not, so the peaks are XLA:CPU's x {CPU_PEAK_MARGIN:g}, the largest ratio "
    "XLA:TPU / XLA:CPU measured (SmolLM2 programs: 1.02-1.57); "
    'pip install -e ".[tpu-aot]" adds libtpu and compiles for the chip'
)


def libtpu_available() -> bool:
    """Whether the libtpu wheel (the TPU compiler) is importable here."""
    return importlib.util.find_spec("libtpu") is not None


@dataclass(frozen=True)
class Topology:
    generation: str  # v5e, v5p, ...
    dims: tuple[int, ...]  # chips along each axis

    @property
    def name(self) -> str:
        return f"{self.generation}:{'x'.join(map(str, self.dims))}"

    @property
    def chips(self) -> int:
        return math.prod(self.dims)

    @property
    def hbm_bytes(self) -> int:
        return HBM_BYTES[self.generation]

    @property
    def budget(self) -> tuple[int, str]:
        return self.hbm_bytes, f"{self.name}, {self.hbm_bytes / GIB:.2f} GiB HBM per chip"


def parse_topology(value: str, flag: str = "--topology") -> Topology:
    """'v5e:2x4', 'v5p:2x2x2' -> Topology; a one-line error naming the flag."""
    m = re.fullmatch(r"\s*(v\d+[a-z]?)\s*:\s*(\d+(?:x\d+)*)\s*", value or "")
    gen = m.group(1).lower() if m else None
    dims = tuple(int(d) for d in m.group(2).split("x")) if m else ()
    if gen not in DIMS or len(dims) != DIMS[gen] or min(dims) < 1:
        kinds = ", ".join(f"{g}:{'x'.join(['2'] * n)}" for g, n in DIMS.items())
        raise PdctlError(f"{flag}: expected a TPU topology such as {kinds}, got {value!r}")
    return Topology(gen, dims)


MAX_CHIPS = 8192  # the largest power-of-two slice of any pod (v5p: 8960 chips)


def for_chips(generation: str, n: int) -> Topology:
    """The usual slice shape of `n` chips (a power of two): v5e 8 -> 2x4, v5p 32 -> 2x4x4."""
    if n < 1 or n & (n - 1):
        raise PdctlError(f"--devices: a TPU slice has a power-of-two number of chips, got {n}")
    if n > MAX_CHIPS:
        raise PdctlError(f"--devices: at most {MAX_CHIPS} chips (a whole pod), got {n}")
    dims = [1] * DIMS[generation]
    for i in range(n.bit_length() - 1):
        dims[i % len(dims)] *= 2
    return Topology(generation, tuple(sorted(dims)))


def generation_of(kind: str) -> str | None:
    """'tpu-v5e' -> 'v5e'; None for a kind that is not a TPU libtpu can compile for."""
    gen = kind.lower().removeprefix("tpu-")
    return gen if kind.lower().startswith("tpu-") and gen in DIMS else None


def _quiet_libtpu(topo: Topology) -> None:
    """libtpu asks the cloud metadata for the host's accelerator type and worker hostnames and
    prints warnings when there is none (every CPU machine); name them, for this process only,
    unless the environment already does (a real TPU VM). Read when libtpu loads: the first
    topology of a process sets them."""
    accel = ACCELERATOR_TYPE[topo.generation].format(n=topo.chips, c=2 * topo.chips)
    os.environ.setdefault("TPU_ACCELERATOR_TYPE", accel)
    os.environ.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
    # libtpu takes /tmp/libtpu_lockfile for the chips of this host; compiling touches no chip,
    # so a run on this host (or another process with libtpu loaded) must not stop it
    os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")


def devices(topo: Topology) -> list[Any]:
    """The topology's compile-only TPU devices (one per chip): a mesh over them lowers and
    compiles with XLA:TPU; nothing runs and JAX's default backend is unchanged."""
    if not libtpu_available():
        raise PdctlError(f'--topology: needs libtpu; pip install -e ".[tpu-aot]" ({topo.name})')
    from jax.experimental import topologies

    _quiet_libtpu(topo)
    # one host holds at most 2 x 2 chips of a slice (MaxText's AOT tables); the compiled
    # program does not depend on it, but libtpu requires the slice to divide into hosts
    per_host = (*(min(d, 2) for d in topo.dims[:2]), 1)
    try:
        desc = topologies.get_topology_desc(
            platform="tpu",
            topology_name=topo.name,
            chip_config_name=CHIP_CONFIG[topo.generation],
            chips_per_host_bounds=per_host,
            num_slices=1,
        )
    except Exception as e:  # libtpu's own words: an unknown or odd-shaped slice
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PdctlError(f"--topology: libtpu cannot describe {topo.name}: {first}") from None
    return list(desc.devices)


_HBM_OOM = re.compile(
    r"(?:total memory required for (?P<what>[\w ]+?) \((?P<need>[\d.]+[KMGTP]?)\) exceeds "
    r"available HBM \((?P<have>[\d.]+[KMGTP]?)\))|(?:Used (?P<used>[\d.]+[KMGTP]?) of "
    r"(?P<cap>[\d.]+[KMGTP]?) hbm)"
)


def _size(text: str) -> int:
    """XLA's '16.82G' (powers of 1024) -> bytes."""
    unit = text[-1] if text[-1].isalpha() else ""
    return round(float(text.rstrip("KMGTP")) * 1024 ** (" KMGTP".index(unit or " ")))


def out_of_memory(error: BaseException) -> dict[str, Any] | None:
    """XLA:TPU's compile-time HBM verdict from its error, or None for any other error:
    {'message': its line, 'required_bytes', 'available_bytes'} (XLA's rounding)."""
    text = str(error)
    if "RESOURCE_EXHAUSTED" not in text and "Ran out of memory" not in text:
        return None
    m = _HBM_OOM.search(text)
    line = next((ln.strip() for ln in text.splitlines() if "HBM" in ln or "hbm" in ln), text)
    out: dict[str, Any] = {"message": line[:400]}
    if m:
        out["required_bytes"] = _size(m.group("need") or m.group("used"))
        out["available_bytes"] = _size(m.group("have") or m.group("cap"))
    return out


def target(flag: str | None, kind: str | None, n: int | None) -> tuple[Topology | None, str | None]:
    """(the TPU topology to compile for, or None; the line stating the fit check's limits, or
    None) from `--topology`, `--device-kind` and `--devices`: a TPU kind compiles with XLA:TPU
    for `--devices` chips (default one) when libtpu is installed, else says what XLA:CPU
    cannot know."""
    gen = generation_of(kind) if kind else None
    if flag is not None:
        topo = parse_topology(flag)
        if kind is not None and gen != topo.generation:
            raise PdctlError(f"--topology: {topo.name} is not a {kind}; give one of them")
        if n is not None and n != topo.chips:
            raise PdctlError(f"--devices: {n}, but --topology {topo.name} has {topo.chips} chips")
        return topo, None
    if gen is None:
        return None, None
    if libtpu_available():
        return for_chips(gen, 1 if n is None else n), None
    return None, NO_LIBTPU
