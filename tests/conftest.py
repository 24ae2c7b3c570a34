"""Test setup: 4 simulated CPU devices, set before JAX initialises, and one persistent
compilation cache for the session.

Tests that need one device build their mesh over ``jax.devices()[:1]``; tests that need a
fresh JAX with another device count run a subprocess.

Tiers: `python -m pytest -q` runs the fast tier (pyproject's `addopts` deselects tests marked
`slow`); `-m slow` runs the rest and `-m ""` everything.
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


@pytest.fixture(scope="session", autouse=True)
def _session_compile_cache(tmp_path_factory: pytest.TempPathFactory):
    """In this process, compiled programs go through a persistent cache under the session's
    temporary directory: many tests run the same tiny stage again (a copied run resumed,
    retrained or failed on purpose), and each run builds new jit objects, so without it every
    one of them recompiles the same step. A cache hit loads the executable XLA compiled for
    the identical program, so numerics are unchanged (test_resume's bit-exact resumes already
    run through such a cache). Child processes are not affected: they see only what their
    run's `[compile] cache_dir` says. PDCTL_TEST_COMPILE_CACHE=0 turns it off."""
    # The compile cache's signing key (pdctl.engine.compile_cache) lives under XDG_STATE_HOME:
    # the session's own, inherited by the child processes, never the user's.
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.getbasetemp() / "xdg-state")
    if os.environ.get("PDCTL_TEST_COMPILE_CACHE", "1") == "0":
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
    yield
    for k, v in old.items():
        jax.config.update(k, v)
    cc.reset_cache()


# The fast tier (`python -m pytest -q`) must finish within ~4 minutes on the 2-core CI-like
# machine. These tests took 2.5-17 s each there (`pytest --durations`, 2026-12-03: 593 tests in
# 7:07 before, ~250 s of it these), so they run in the slow tier (`-m slow`, which CI runs
# too) rather than in every quick check. A node id without brackets covers all its params.
SLOW_IN_FAST_TIER = (
    "tests/test_resume.py::test_train_until_then_resume_is_bit_exact",
    "tests/test_faults.py::test_2_resuming_a_stale_stage_is_refused",
    "tests/test_faults.py::test_1_edits_made_while_a_stage_runs_are_kept",
    "tests/test_faults.py::test_3_a_non_finite_train_fails_cleanly_keeping_the_checkpoints",
    "tests/test_faults.py::test_6_kill_9_before_the_first_checkpoint_then_resume",
    "tests/test_faults.py::test_8_sigterm_while_restoring_a_fresh_start",
    "tests/test_faults.py::test_8_sigterm_while_restoring_a_resume",
    "tests/test_faults.py::test_13_read_only_run_directory",
    "tests/test_decomp_stages.py::test_warmup_and_train_steps_donate_the_state_but_not_the_target",
    "tests/test_decomp_stages.py::test_train_losses_match_on_1_and_4_devices",
    "tests/test_init.py::test_stacked_init_is_bit_identical_to_the_per_site_reference[llama-mlp-4]",
    "tests/test_init_from.py::test_fresh_inputs_are_the_parents_final_decomposition",
    "tests/test_init_from.py::test_init_from_errors_are_one_line",
    "tests/test_init_from.py::test_train_from_a_parent_end_to_end",
    "tests/test_pretrain.py::test_new_init_weights_pretrain[llama-mlp]",
    "tests/test_pretrain.py::test_a_locked_run_directory_is_refused",
    "tests/test_pretrain.py::test_tms_5_2_pretrain_reaches_the_pentagon",
    "tests/test_harvest.py::test_harvest_of_a_toy_run_and_an_interrupted_one_resumes",
    "tests/test_harvest.py::test_browse_in_headless_chromium",
    "tests/test_harvest.py::test_the_device_accumulator_equals_the_numpy_reference_bit_for_bit",
    "tests/test_inspect.py::test_compile_aliases_the_donated_state",
    "tests/test_inspect.py::test_preview_8_devices_bytes_match_shapes",
    "tests/test_inspect.py::test_fit_check_cli",
    "tests/test_engine.py::test_parity_1_vs_4_devices[llama-mlp-data2_fsdp2]",
    "tests/test_engine.py::test_parity_1_vs_4_devices[resid-mlp-data2_fsdp2]",
    "tests/test_gguf.py::test_tiny_gguf_logits_equal_transformers[llama-8-False]",
    "tests/test_spd_reference.py::test_ppgd_loss_uses_the_previous_sources_then_one_ascent_step_from_it[sign]",
    "tests/test_spd_reference.py::test_tied_warmup_equals_two_torch_parameters_sharing_storage",
    "tests/test_spd_reference.py::test_tied_train_state_holds_one_parameter_set",
    "tests/test_spd_math.py::test_jitted_loss_and_grads_are_finite",
    "tests/test_spd_math.py::test_pgd_sign_steps_raise_the_recon_loss_and_sources_are_held_constant",
    "tests/test_signals.py::test_7_sigterm_to_pdctl_reaches_the_stage_process",
    "tests/test_signals.py::test_5_a_huge_train_step_count_stops_cleanly_at_until",
    "tests/test_scan.py::test_grouped_site_work_draws_the_same_bits",
    "tests/test_scan.py::test_scanned_forward_equals_unrolled",
    "tests/test_scan.py::test_scanned_forward_takes_stacked_units",
    "tests/test_spd_eval.py::test_lm_eval_with_exact_components",
    "tests/test_report.py::test_figures_leave_matplotlib_global_state_alone",
    "tests/test_measure.py::test_mfu_of_the_same_global_batch_matches_on_1_and_4_devices[resid-mlp]",
    "tests/test_scale.py::test_remat_gives_equal_gradients[dots_saveable]",
    # 2.5-3 s each: a margin under the 4 minutes (the machine's speed drifts by ~15%)
    "tests/test_platforms.py::test_inspect_sharding_on_a_missing_platform_is_one_line",
    "tests/test_harvest.py::test_the_fixed_point_sum_is_exact_in_any_order",
    "tests/test_faults.py::test_13_a_command_named_for_an_unfinished_stage_works",
    "tests/test_faults.py::test_13_jax_platforms_without_that_device",
    "tests/test_spd_math.py::test_reference_init_deterministic_distinct_and_vmappable",
    "tests/test_inspect.py::test_child_error_is_relayed",
)


@pytest.hookimpl(tryfirst=True)  # before `-m 'not slow'` deselects
def pytest_collection_modifyitems(config, items):
    found = set()
    for item in items:
        for nodeid in SLOW_IN_FAST_TIER:
            if item.nodeid == nodeid or item.nodeid.startswith(nodeid + "["):
                item.add_marker(pytest.mark.slow)
                found.add(nodeid)
    # a renamed test must not silently come back into the fast tier: on a whole-suite
    # collection every name here must still exist
    missing = set(SLOW_IN_FAST_TIER) - found
    if missing and len(items) > 500:
        raise pytest.UsageError(f"tests/conftest.py SLOW_IN_FAST_TIER: no test {sorted(missing)}")
