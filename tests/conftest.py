"""Test setup: 4 simulated CPU devices, set before JAX initialises, and one persistent
compilation cache for the session.

Tests that need one device build their mesh over ``jax.devices()[:1]``; tests that need a
fresh JAX with another device count run a subprocess.

Layout: the tests by floor (`science/`, `engine/`, `stages/`, `commands/`, `faults/`), the
import-layering test and the shared helpers (`helpers.py`, `fixtures.py`, `real_model.py`) here;
pyproject's `pythonpath` puts tests/ and the floors on sys.path. What the benchmarks build on too
(tiny runs, models, a synthetic harvest, a browser) is in pdctl/testing/.

Tiers: `python -m pytest -q` runs the fast tier (pyproject's `addopts` deselects tests marked
`slow`); `-m slow` runs the rest and `-m ""` everything. The one rule: a test over ~2.5 s on 2
CPU cores, set-up included (`pytest --durations`), is marked `@pytest.mark.slow` where it is
defined (`pytest.param(..., marks=pytest.mark.slow)` for one case of a parametrized test), so
that the fast tier stays within ~4 minutes on a 2-core machine.

Workers: pyproject's `addopts` runs the tests in pytest-xdist workers (`-n auto`, capped below
at 4: each worker is a JAX process with 4 simulated devices), one test file per worker at a
time; CI runs the slow tier with `-n 2` (the README has both tiers' timings).
"""

import os

import pytest

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_flags = os.environ.get("XLA_FLAGS", "")
if "xla_force_host_platform_device_count" not in _flags:
    os.environ["XLA_FLAGS"] = (_flags + " --xla_force_host_platform_device_count=4").strip()
os.environ.setdefault("WANDB_MODE", "disabled")
# pdctl's XLA:CPU options, as `pdctl` sets them, in this process and in the ones tests start
from pdctl.engine.runtime import cpu_xla_flags  # noqa: E402

cpu_xla_flags()

# tests/fixtures.py's shared fixtures (the tiny models, built once per session), for every test
# file. (Imported by name: `pytest_plugins = ("fixtures",)` would name pytest's own plugin.)
from fixtures import hf_llama  # noqa: E402, F401


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto`: one worker per core this process may use, at most 4 (each holds a JAX
    runtime and the session's fixtures; more cost memory, not time, on these tests)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(4, cores or 1))


@pytest.fixture(scope="session", autouse=True)
def _session_compile_cache(tmp_path_factory: pytest.TempPathFactory):
    """In this process, compiled programs go through a persistent cache under the session's
    temporary directory: many tests run the same tiny stage again (a copied run resumed,
    retrained or failed on purpose), and each run builds new jit objects, so without it every
    one of them recompiles the same step. A cache hit loads the executable XLA compiled for
    the identical program, so numerics are unchanged (test_resume's bit-exact resumes already
    run through such a cache). Child processes are not affected: they see only what their
    run's `[compile] cache_dir` says (no cache when it is unset: `pdctl_env`).
    PDCTL_TEST_COMPILE_CACHE=0 turns it off."""
    # The compile cache's signing key (pdctl.engine.compile_cache) lives under XDG_STATE_HOME:
    # the session's own, inherited by the child processes, never the user's.
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.getbasetemp() / "xdg-state")
    if os.environ.get("PDCTL_TEST_COMPILE_CACHE", "1") == "0":
        os.environ["PDCTL_COMPILE_CACHE"] = ""  # no run's default cache either
        yield
        return
    import jax
    from helpers import session_compile_cache_dir
    from jax.experimental.compilation_cache import compilation_cache as cc

    from pdctl.engine import compile_cache

    keys = (
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    )
    old = {k: getattr(jax.config, k) for k in keys}
    # as pdctl's `[compile] cache_dir` does: entries signed with the (session's) user key
    compile_cache.install(session_compile_cache_dir(tmp_path_factory))
    # A run without `[compile] cache_dir` uses this one too, not one in its run directory
    # (pdctl's default): the tests' runs share their compiles. Children: `pdctl_env`.
    os.environ["PDCTL_COMPILE_CACHE"] = str(session_compile_cache_dir(tmp_path_factory))
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    cc.reset_cache()
