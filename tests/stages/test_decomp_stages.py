"""The decomposition stages (warmup, train): donation, 1-vs-4-device parity, the CLI end to end,
and the TMS 5-2 ground truth.

The steps are built as `warmup.run` / `train.run` build them (`make_step`, `build`, the same
`jax.jit` in/out shardings and `donate_argnums=(1,)`), on hand-made meshes.
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from helpers import cli, edit_config, error_lines, make_run, pdctl_process, state

from pdctl.engine import donation, sharding
from pdctl.project import Project
from pdctl.stages import train, warmup
from pdctl.stages.env import StageEnv
from pdctl.stages.init_weights import init_decomposition
from pdctl.stages.inputs import STREAM_DECOMP, STREAM_TARGET, stream_key, target_from_config

# TMS 5-2 with C=8 (divides 4, so V/U shard at fsdp=4), every array above 16 elements sharded,
# and PPGD on, so sources and their Adam state are part of the donated train state.
TMS_TINY: dict[str, Any] = {
    "mesh": {"fsdp_min_param_size": 16},
    "decomp": {"sites": [{"pattern": "linear1", "C": 8}, {"pattern": "linear2", "C": 8}]},
    "warmup": {"steps": 4},
    "train": {"steps": 6, "batch_size": 32, "loss": {"ppgd_recon": 0.5}},
}


def _mesh(data: int, fsdp: int):
    return sharding.make_mesh(data, fsdp, jax.devices()[: data * fsdp])


class Steps:
    """The warmup and train programs of one config on one mesh (`warmup.program`,
    `train.program`: what the stages compile), and fresh sharded states for them (from host
    values shared by every mesh)."""

    def __init__(self, proj: Project, mesh, host_params: Any, host_dec: Any) -> None:
        self.env = env = StageEnv(proj, "train", mesh, target_from_config(proj.config))
        cfg, target = env.cfg, env.target
        w_prog = warmup.program(cfg, mesh, target)
        t_prog = train.program(cfg, mesh, target)
        self.params = jax.device_put(host_params, w_prog.frozen_shardings[0])
        self.dec = host_dec
        self.warmup_state = w_prog.jit_make_state()
        self.warmup_step = w_prog.jit()
        self.train_state = t_prog.jit_make_state()
        self.train_step = t_prog.jit()

    def fresh_warmup(self):
        return self.warmup_state(self.dec["components"])

    def fresh_train(self):
        d = self.dec
        return self.train_state(d["components"], d["ci_fns"], d["sources"])


@pytest.fixture(scope="module")
def tms_steps(tmp_path_factory: pytest.TempPathFactory):
    """`steps(data, fsdp)`: the cached `Steps` of TMS_TINY on that mesh (each step function is
    compiled once per mesh and shared by the donation and parity tests)."""
    run = make_run(tmp_path_factory.mktemp("steps"), "tms", **TMS_TINY)
    proj = Project.load(run / "pdctl.toml")
    cfg = proj.config
    target = target_from_config(cfg)
    host_params = jax.device_get(jax.jit(target.init)(stream_key(cfg, STREAM_TARGET)))
    mesh1 = _mesh(1, 1)
    dec, _ = init_decomposition(cfg, target, mesh1, stream_key(cfg, STREAM_DECOMP))
    host_dec = jax.device_get(dec)
    cache: dict[tuple[int, int], Steps] = {}

    def steps(data: int, fsdp: int) -> Steps:
        if (data, fsdp) not in cache:
            cache[(data, fsdp)] = Steps(proj, _mesh(data, fsdp), host_params, host_dec)
        return cache[(data, fsdp)]

    return steps


def _host(tree: Any) -> Any:
    return jax.tree.map(lambda x: np.array(x, copy=True), jax.device_get(tree))


def _check_donating_calls(step, params, st, n_calls: int = 2) -> None:
    """Call `step(params, st, None)` n times, as the loop does; for every call: >= 95% of the
    state's bytes reused, and the target parameters (not donated) alive and unchanged."""
    params_before = _host(params)
    for _ in range(n_calls):
        before = donation.buffer_bytes_by_ptr(st)
        assert sum(before.values()) > 0
        st_in = st
        st, metrics = step(params, st, None)
        jax.block_until_ready((st, metrics))
        fraction, missed = donation.reused_fraction(before, st)
        assert fraction >= donation.THRESHOLD, (fraction, missed)
        assert all(x.is_deleted() for x in jax.tree.leaves(st_in))  # really donated
        for leaf, want in zip(jax.tree.leaves(params), jax.tree.leaves(params_before), strict=True):
            assert not leaf.is_deleted()
            np.testing.assert_array_equal(np.asarray(leaf), want)
        assert np.isfinite(float(metrics["loss"]))


@pytest.mark.slow
@pytest.mark.parametrize("n_devices", [1, 4])
def test_warmup_and_train_steps_donate_the_state_but_not_the_target(
    tms_steps, n_devices: int
) -> None:
    steps = tms_steps(1, n_devices)
    st = steps.fresh_train()
    if n_devices == 4:  # the state really is sharded, so donation is per shard
        V = st["trainable"]["components"]["linear1"]["V"]
        assert V.sharding.spec == jax.sharding.PartitionSpec(None, "fsdp")
    _check_donating_calls(steps.warmup_step, steps.params, steps.fresh_warmup())
    _check_donating_calls(steps.train_step, steps.params, st)


# ---------------------------------------------------------------------------------------------
# parity


@pytest.mark.slow
def test_train_losses_match_on_1_and_4_devices(tms_steps) -> None:
    """The same SPD train steps (toy batches generated on device from the step key, PPGD on) on
    1 device, on fsdp=4 and on data=4 give the same losses.

    Tolerance: the values may differ only by float32 reduction order (GSPMD sums each shard
    and then all-reduces; the batch means of MSE and importance minimality, and the fsdp
    all-gathers of V/U feed matmuls whose partial sums are ordered differently). That is a few
    ulps per reduction (float32 eps 1.2e-7) and Adam's normalised updates keep the drift small:
    measured at most 2.6e-7 relative over 20 steps (fsdp=4, data=4 and 2x2), so rtol 1e-5 is a
    40x margin, while a real sharding bug (a wrong spec, a per-shard mean, a missing
    all-reduce) moves the loss by orders of magnitude more."""
    losses = {}
    terms = {}
    for name, (data, fsdp) in {"1": (1, 1), "fsdp4": (1, 4), "data4": (4, 1)}.items():
        steps = tms_steps(data, fsdp)
        st = steps.fresh_train()
        out = []
        for _ in range(steps.env.cfg.train.steps):
            st, metrics = steps.train_step(steps.params, st, None)
            out.append(metrics)
        host = jax.device_get(out)
        losses[name] = np.array([m["loss"] for m in host], dtype=np.float64)
        terms[name] = {
            k: np.array([m[k] for m in host]) for k in ("stochastic_recon", "importance_minimality")
        }
    assert np.all(np.isfinite(losses["1"]))
    assert len(set(np.round(losses["1"], 6))) > 1, "the loss should move over the steps"
    for name in ("fsdp4", "data4"):
        np.testing.assert_allclose(losses[name], losses["1"], rtol=1e-5, atol=1e-7, err_msg=name)
        for k, v in terms[name].items():
            np.testing.assert_allclose(
                v, terms["1"][k], rtol=1e-5, atol=1e-7, err_msg=f"{name} {k}"
            )


def _lm_train_losses(run: Path, data: int, fsdp: int, n_steps: int = 6):
    """n SPD train steps of an LM run on a (data, fsdp) mesh from host values shared by every
    mesh; the losses and the state's V of the first site."""
    proj = Project.load(run / "pdctl.toml")
    cfg = proj.config
    target = target_from_config(cfg)
    mesh = _mesh(data, fsdp)
    prog = train.program(cfg, mesh, target)
    params = jax.jit(target.init, out_shardings=prog.frozen_shardings[0])(
        stream_key(cfg, STREAM_TARGET)
    )
    dec, _ = init_decomposition(cfg, target, _mesh(1, 1), stream_key(cfg, STREAM_DECOMP))
    dec = jax.device_get(dec)
    st = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
    V0 = st["trainable"]["components"]["layers.0.mlp.up"]["V"]
    spec = V0.sharding.spec
    step = prog.jit()
    rng = np.random.default_rng(0)
    losses = []
    for _ in range(n_steps):
        tokens = rng.integers(0, target.vocab_size, (cfg.train.batch_size, cfg.data.seq_len + 1))
        batch = jax.device_put({"tokens": tokens.astype(np.int32)}, prog.batch_shardings)
        st, metrics = step(params, st, batch)
        losses.append(metrics["loss"])
    return np.array(jax.device_get(losses), dtype=np.float64), spec


@pytest.mark.slow  # a subprocess run of several seconds: the slow tier
def test_lm_train_parity_with_the_components_sharded_over_every_device(tmp_path: Path) -> None:
    """An LM's components shard their component axis over data x fsdp by default ([mesh]
    decomposition = auto -> all): no data-parallel device repeats another's faithfulness
    matmuls, their gradients or the optimizer update. The losses equal one device's within
    float32 reduction order (the V U partial sums over component
    shards are all-reduced, the batch means too): the same 1e-5 relative bound and reasoning
    as the TMS parity gate above."""
    run = make_run(tmp_path, "llama-mlp", train={"batch_size": 8})
    ref, spec1 = _lm_train_losses(run, 1, 1)
    assert spec1 == jax.sharding.PartitionSpec()
    assert np.all(np.isfinite(ref)) and len(set(ref.tolist())) > 1
    for (data, fsdp), want in (
        ((4, 1), jax.sharding.PartitionSpec(None, "data")),
        ((2, 2), jax.sharding.PartitionSpec(None, ("data", "fsdp"))),
    ):
        losses, spec = _lm_train_losses(run, data, fsdp)
        assert spec == want, (data, fsdp, spec)
        np.testing.assert_allclose(losses, ref, rtol=1e-5, err_msg=f"{data}x{fsdp}")


@pytest.mark.slow  # ~10-18 s: compiles the faithfulness term on several meshes
def test_faithfulness_on_sharded_components_moves_no_weight_sized_collective(tmp_path) -> None:
    """With the components sharded over data (an LM's default), the compiled train and warmup
    steps have no all-reduce / reduce-scatter of a site's d_in x d_out shape: each device forms
    its rows of W - V U from gathered V / U (`sharding.WeightSpace`), instead of all-reducing
    every site's whole partial product. The faithfulness value is the unconstrained one's
    (same sums, float32 reassociation only: rtol 1e-6)."""
    import re

    from pdctl.science.spd.losses import faithfulness_loss

    run = make_run(tmp_path, "llama-mlp", train={"batch_size": 8})
    cfg = Project.load(run / "pdctl.toml").config
    target = target_from_config(cfg)
    mesh = _mesh(4, 1)
    shapes = {f"f32[{a},{b}]" for a, b in target.site_shapes().values()}
    weight_sized = re.compile(r"= \(?([^=]*?)\)? (all-reduce|reduce-scatter)\(")
    for module in (train, warmup):
        prog = module.program(cfg, mesh, target)
        hlo = prog.jit().lower(*prog.abstract_args()).compile().as_text()
        collectives = [m.group(1) for m in weight_sized.finditer(hlo)]
        assert collectives, f"{module.__name__}: expected the gradient collectives"
        for operands in collectives:
            for shape in shapes:
                assert shape + "{" not in operands, (module.__name__, shape, operands[:300])

    comps = init_decomposition(cfg, target, _mesh(1, 1), stream_key(cfg, STREAM_DECOMP))[0]
    comps = comps["components"]
    params = jax.jit(target.init)(stream_key(cfg, STREAM_TARGET))
    weights = {p: target.site_weights(params)[p] for p in comps}
    plain = float(faithfulness_loss(weights, comps))
    decomp = sharding.decomp_axes(mesh, "all", lm=True)
    spec = sharding.tree_shardings(comps, mesh, 1024, decomp)
    laid = jax.jit(lambda w, c: faithfulness_loss(w, c, sharding.weight_space(mesh, decomp)))(
        weights, jax.device_put(comps, spec)
    )
    np.testing.assert_allclose(float(laid), plain, rtol=1e-6)


# ---------------------------------------------------------------------------------------------
# the CLI end to end

EVAL_KEYS = {"ci_errors", "mmcs", "ml2r", "l0", "alive"}


def _ok(*args: str):
    result = cli(*args)
    assert result.exit_code == 0, (args, result.output, result.exception)
    return result


def _jsonl(run: Path, stage: str) -> list[dict[str, Any]]:
    path = run / "metrics" / f"{stage}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.mark.slow  # ~20-30 s; test_faults' `done` run and test_resume's run every stage fast
def test_cli_new_to_train_on_tiny_tms(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    _ok("new", "tiny", "--template", "tms")
    run = tmp_path / "tiny"
    edit_config(
        run,
        {
            "pretrain": {"steps": 40, "batch_size": 64, "log_every": 20},
            "checkpoint": {"every": 10},
            "decomp": {"sites": [{"pattern": "linear1", "C": 8}, {"pattern": "linear2", "C": 8}]},
            "warmup": {"steps": 10, "log_every": 5},
            "train": {
                "steps": 20,
                "batch_size": 64,
                "log_every": 5,
                "eval_every": 10,
                "eval_batch_size": 64,
            },
        },
    )
    p = ("--project", "tiny")
    _ok(*p, "init-weights")
    assert state(run, "init_weights")["status"] == "done"

    # Out of order: one line on stderr, exit 2, nothing written for warmup.
    bad = cli(*p, "warmup")
    assert bad.exit_code == 2, bad.output
    lines = error_lines(bad)
    assert len(lines) == 1 and lines[0].startswith("error: ") and "pretrain" in lines[0], lines
    assert state(run, "warmup") == {}

    _ok(*p, "pretrain")
    _ok(*p, "warmup")
    out = _ok(*p, "train", "--until", "10").stdout
    assert "interrupted at step 10" in out
    st = state(run, "train")
    assert st["status"] == "interrupted" and st["step"] == 10
    out = _ok(*p, "train", "--resume").stdout
    assert "done at step 20" in out and "CI errors" in out

    for stage in ("init_weights", "pretrain", "warmup", "train"):
        st = state(run, stage)
        assert st["status"] == "done", (stage, st)
        if stage != "init_weights":
            assert st["step"] == st["steps"]
            assert st["donation_fraction"] >= donation.THRESHOLD, stage
    ev = state(run, "train")["eval"]
    assert set(ev) >= EVAL_KEYS, ev
    for k in EVAL_KEYS - {"ci_errors"}:
        assert set(ev[k]) == {"linear1", "linear2"}, (k, ev[k])
    assert set(ev["ci_errors"]) == {"linear1", "linear2", "total"}

    rows = _jsonl(run, "train")
    evals = [r for r in rows if "eval/ci_errors/total" in r]
    assert [r["step"] for r in evals] == [10, 20]
    assert {"eval/mmcs/linear1", "eval/l0/linear2", "eval/alive/linear1"} <= set(evals[-1])
    train_steps = [r["step"] for r in rows if "loss" in r]
    assert train_steps == [5, 10, 15, 20]  # resumed without repeating or skipping a log line
    assert all(np.isfinite(r["loss"]) for r in rows if "loss" in r)


# ---------------------------------------------------------------------------------------------
# ground truth


def _pdctl(cwd: Path, *args: str, devices: int = 2) -> subprocess.CompletedProcess:
    """The installed CLI in a fresh process on `devices` simulated CPU devices (mesh data = all:
    the configuration benchmarks/toys/recovery.py measured, see docs/results.md)."""
    return pdctl_process(*args, cwd=cwd, devices=devices, timeout=2400)


@pytest.mark.slow
def test_tms_5_2_recovers_every_feature(tmp_path: Path) -> None:
    """Ground truth through the CLI on the UNMODIFIED tms template (seed 0, 10,000 SPD steps at
    batch 4096, tied components): one component per feature at both sites (0 CI errors on the
    one-hot inputs of magnitude 0.75), and the components point along the target's feature
    directions (MMCS >= 0.99)."""
    t0 = time.perf_counter()
    assert _pdctl(tmp_path, "new", "gt", "--template", "tms").returncode == 0
    run = tmp_path / "gt"
    r = _pdctl(run, "run")
    assert r.returncode == 0, (r.stdout, r.stderr[-3000:])
    st = state(run, "train")
    assert st["status"] == "done" and st["devices"] == 2 and st["step"] == 10000
    ev = st["eval"]
    assert ev["ci_errors"] == {"linear1": 0.0, "linear2": 0.0, "total": 0.0}, ev
    assert min(ev["mmcs"].values()) >= 0.99, ev
    assert ev["alive"] == {"linear1": 5.0, "linear2": 5.0}, ev
    assert ev["recovered"] == 5.0, ev
    print(f"TMS 5-2 ground truth through the CLI: {time.perf_counter() - t0:.1f} s, eval {ev}")
