"""`JAX_PLATFORMS` naming a platform this machine does not have is an input mistake: one line,
exit 2, for `inspect-sharding` as for the stage commands (`gpu` used to print a
traceback and exit 1)."""

from __future__ import annotations

import importlib.util

import pytest
from helpers import make_run, pdctl_process


@pytest.mark.slow
@pytest.mark.parametrize("platform", ["gpu", "bogus"])
@pytest.mark.parametrize("extra", [(), ("--devices", "8")])
def test_inspect_sharding_on_a_missing_platform_is_one_line(tmp_path, platform, extra):
    gpu_plugins = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin")
    if platform == "gpu" and any(importlib.util.find_spec(m) for m in gpu_plugins):
        pytest.skip("a GPU build of jaxlib is installed: JAX_PLATFORMS=gpu may be valid here")
    run = make_run(tmp_path, "tms")
    r = pdctl_process("inspect-sharding", *extra, project=run, env={"JAX_PLATFORMS": platform})
    lines = [line for line in r.stderr.splitlines() if line.strip()]
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr + r.stdout
    assert len(lines) == 1 and f"JAX_PLATFORMS={platform}" in lines[0], lines
