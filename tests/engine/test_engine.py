"""The engine at 1 and 4 simulated CPU devices: FSDP sharding of parameters and Adam moments,
mesh errors, 1-vs-4-device parity gates (and proof that they can fail), donation, the
no-host-sync dispatch guard and on-device bad-step handling.

Everything runs the real pretrain pieces (`pdctl.stages.pretrain.build` / `make_step`) on
hand-made meshes; compiled steps are shared through module fixtures.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import Pretrain, make_loop, make_run, pretrain_on, run_steps
from jax.sharding import PartitionSpec as P

from pdctl.engine import donation, sharding
from pdctl.engine.loop import guard_update, loop_counters
from pdctl.engine.optim import adamw
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.stages.decomposition import abstract_decomposition as init_decomposition_abstract
from pdctl.stages.inputs import target_from_config

MESHES = {  # name: (data, fsdp); "1" is one device, the others use all 4
    "1": (1, 1),
    "data4": (4, 1),
    "fsdp4": (1, 4),
    "data2_fsdp2": (2, 2),
}
PARITY_STEPS = 8

# Parity tolerance, max over the trajectory of |loss_4dev - loss_1dev| / |loss_1dev|, float32.
# On 4 devices the batch mean, the gradient all-reduce and the FSDP matmuls sum in a different
# order than on 1; every reordered float32 sum moves by a few ulps (eps = 1.2e-7), and 8 Adam
# steps carry those differences along. Worst cases measured over the 3 meshes and 8 steps:
#   llama-mlp 2.6e-7  (cross-entropy ~5.5: the relative error of the loss is the ulp level)
#   resid-mlp 1e-6 .. 4.5e-6 (depending on the batches drawn; the loss is the MSE of a small
#                     residual y - y_hat of O(1) outputs, so a rounding error of the outputs
#                     is magnified by |y| / |y - y_hat| ~ 30)
# Each bound is 4-8x the worst seen. The gates below pin that the same comparison catches a 1%
# learning-rate change (resid-mlp: ~2e-4, 10x its bound) and one dropped example per batch
# (llama-mlp).
PARITY_RTOL = {"llama-mlp": 2e-6, "resid-mlp": 2e-5}


def _mesh(name: str) -> jax.sharding.Mesh:
    data, fsdp = MESHES[name]
    return sharding.make_mesh(data, fsdp, jax.devices()[:1] if name == "1" else None)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Tiny runs: llama-mlp with the default fsdp_min_param_size (1024: the 32-wide norms stay
    replicated, every matrix shards), resid-mlp with 64 so that its small matrices shard too."""
    d = tmp_path_factory.mktemp("engine")
    return {
        "llama-mlp": make_run(d, "llama-mlp"),
        "resid-mlp": make_run(d, "resid-mlp", mesh={"fsdp_min_param_size": 64}),
        "tms": make_run(d, "tms", tiny=False),  # the real TMS 5-2 config
    }


@pytest.fixture(scope="module")
def pieces(runs: dict[str, Path]):
    """pieces(template, mesh name) -> Pretrain, built once per module (compiles are shared)."""
    cache: dict[tuple[str, str, int], Pretrain] = {}

    def get(template: str, mesh: str, total: int = PARITY_STEPS) -> Pretrain:
        key = (template, mesh, total)
        if key not in cache:
            cache[key] = pretrain_on(runs[template], _mesh(mesh), total=total)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def reference(pieces):
    """The 1-device loss trajectory of each target (computed once)."""
    cache: dict[str, np.ndarray] = {}

    def get(template: str) -> np.ndarray:
        if template not in cache:
            pt = pieces(template, "1")
            cache[template] = run_steps(pt, pt.init_state(), PARITY_STEPS)[1]
        return cache[template]

    return get


def _leaves(tree: Any) -> dict[str, jax.Array]:
    return {sharding.path_str(p): x for p, x in jax.tree_util.tree_leaves_with_path(tree)}


def _shard_elems(x: jax.Array) -> int:
    return int(np.prod(x.addressable_shards[0].data.shape))


# ---- sharding ------------------------------------------------------------------------------


def test_fsdp4_shards_large_params_and_their_adam_moments(pieces) -> None:
    pt = pieces("llama-mlp", "fsdp4")
    state = pt.init_state()  # jit(make_state, out_shardings=...) over jit(init, out_shardings)
    min_size = pt.cfg.mesh.fsdp_min_param_size
    params = _leaves(state["params"])
    big = {k for k, x in params.items() if x.size >= min_size}
    assert big and big != set(params), "the tiny llama must have both large and small params"
    for path, x in params.items():
        spec = x.sharding.spec
        if path in big:
            assert list(spec).count("fsdp") == 1, (path, x.shape, spec)
            assert _shard_elems(x) * 4 == x.size, (path, "each device holds a quarter")
        else:
            assert x.sharding.is_fully_replicated, (path, x.shape, spec)
            assert _shard_elems(x) == x.size

    # Adam's mu and nu mirror the parameter tree and inherit each parameter's spec.
    moments = {k: x for k, x in _leaves(state["opt_state"]).items() if ".mu." in k or ".nu." in k}
    assert len(moments) == 2 * len(params)
    for path, m in moments.items():
        param_path = path.split(".mu.", 1)[-1].split(".nu.", 1)[-1]
        p = params[param_path]
        assert m.shape == p.shape
        assert m.sharding.spec == p.sharding.spec, (path, m.sharding.spec, p.sharding.spec)
        assert _shard_elems(m) == _shard_elems(p), path
    # Scalars (Adam count, loop counters, rng) stay replicated.
    others = {k: x for k, x in _leaves(state["opt_state"]).items() if k not in moments}
    others.update(_leaves(state["loop"]))
    assert others
    for path, x in others.items():
        assert x.sharding.is_fully_replicated, path

    # The stage's state shardings are exactly the rule applied to `tx.init`'s abstract output.
    abstract_opt = pt.abstract["opt_state"]
    want = sharding.tree_specs(abstract_opt, pt.env.mesh, min_size)
    got = jax.tree.map(lambda x: x.sharding.spec, state["opt_state"])
    assert jax.tree.leaves(got, is_leaf=lambda s: isinstance(s, P)) == jax.tree.leaves(
        want, is_leaf=lambda s: isinstance(s, P)
    )


def test_fsdp1_replicates_everything(pieces) -> None:
    pt = pieces("llama-mlp", "data4")
    state = pt.init_state()
    for path, x in _leaves(state).items():
        assert x.sharding.is_fully_replicated, (path, x.sharding.spec)
        assert _shard_elems(x) == x.size


def test_decomposition_V_U_shard_over_the_component_axis(runs: dict[str, Path]) -> None:
    """V (d_in, C) as P(None, 'fsdp') and U (C, d_out) as P('fsdp', None), for the arrays and
    their Adam moments, through the same rule the warmup/train stages apply (`env.shardings`)."""
    cfg = Project.load(runs["llama-mlp"] / "pdctl.toml").config
    target = target_from_config(cfg)
    mesh = _mesh("fsdp4")
    abstract = init_decomposition_abstract(cfg, target)["components"]
    assert set(abstract) == {"layers.0.mlp.up", "layers.0.mlp.down"}
    tx = adamw(cfg.train.optim, 10)
    specs = sharding.tree_specs(
        {"c": abstract, "opt": jax.eval_shape(tx.init, abstract)},
        mesh,
        cfg.mesh.fsdp_min_param_size,
    )
    flat = {
        sharding.path_str(p): s
        for p, s in jax.tree_util.tree_leaves_with_path(specs, is_leaf=lambda x: isinstance(x, P))
    }
    n_v = n_u = 0
    for path, spec in flat.items():
        if path.endswith(".V"):
            assert spec == P(None, "fsdp"), path
            n_v += 1
        elif path.endswith(".U"):
            assert spec == P("fsdp", None), path
            n_u += 1
    assert n_v == n_u == 2 * 3  # 2 sites x (array, mu, nu)
    # Below fsdp_min_param_size (32 x 8 = 256 < 1024) and still split: V/U always shard their
    # component axis. The real arrays, made under jit with these shardings, hold C / 4 each.
    V = abstract["layers.0.mlp.up"]["V"]
    assert V.shape == (32, 8) and V.size < cfg.mesh.fsdp_min_param_size
    made = jax.jit(
        lambda: jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), abstract),
        out_shardings=jax.tree.map(
            lambda s: jax.sharding.NamedSharding(mesh, s),
            specs["c"],
            is_leaf=lambda x: isinstance(x, P),
        ),
    )()
    for site, vu in made.items():
        assert vu["V"].addressable_shards[0].data.shape == (vu["V"].shape[0], 2), site
        assert vu["U"].addressable_shards[0].data.shape == (2, vu["U"].shape[1]), site
    # A component count the axis does not divide stays replicated; fsdp=1 replicates.
    assert sharding.spec_for("a.V", (32, 6), 4, 1024) == P()
    assert sharding.spec_for("a.U", (6, 32), 4, 1024) == P()
    assert sharding.spec_for("a.V", (32, 8), 1, 1024) == P()


def test_decomposition_axes_by_mode_and_target() -> None:
    """[mesh] decomposition: fsdp keeps the component axis on fsdp; all (auto for an LM) puts
    it over every mesh axis larger than 1; a C the whole mesh does not divide falls back to
    fsdp alone, then to replicated."""
    m22, m41 = sharding.make_mesh(2, 2), sharding.make_mesh(4, 1)
    Decomp = sharding.Decomp
    assert sharding.decomp_axes(m22, "auto", lm=True) == Decomp(("data", "fsdp"), 4)
    assert sharding.decomp_axes(m22, "auto", lm=False) == Decomp(("fsdp",), 2)
    assert sharding.decomp_axes(m22, "fsdp", lm=True) == Decomp(("fsdp",), 2)
    assert sharding.decomp_axes(m41, "all", lm=False) == Decomp(("data",), 4)
    assert sharding.decomp_axes(m41, "fsdp", lm=True) == Decomp(("fsdp",), 1)
    one = sharding.make_mesh(1, 1, jax.devices()[:1])
    assert sharding.decomp_axes(one, "all", lm=True) == Decomp(("fsdp",), 1)
    every = sharding.decomp_axes(m22, "all", lm=True)
    assert sharding.spec_for("a.V", (32, 8), 2, 1024, every) == P(None, ("data", "fsdp"))
    assert sharding.spec_for("mu.a.U", (8, 32), 2, 1024, every) == P(("data", "fsdp"), None)
    assert sharding.spec_for("a.V", (32, 6), 2, 1024, every) == P(None, "fsdp")  # 6 % 4
    assert sharding.spec_for("a.V", (32, 5), 2, 1024, every) == P()
    data_only = sharding.decomp_axes(m41, "all", lm=True)
    assert sharding.spec_for("a.V", (32, 8), 1, 1024, data_only) == P(None, "data")
    assert sharding.spec_for("a.V", (32, 6), 1, 1024, data_only) == P()
    # other arrays are not affected by the mode
    assert sharding.spec_for("a.W", (64, 64), 1, 1024, data_only) == P()
    with pytest.raises(ValueError, match="decomposition mode"):
        sharding.decomp_axes(m22, "every", lm=True)


# ---- mesh errors ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "fsdp", "numbers"),
    [
        (3, 1, ("data=3", "fsdp=1", "= 3 devices", "4 are available")),
        (2, 4, ("data=2", "fsdp=4", "= 8 devices", "4 are available")),
        (1, 2, ("data=1", "fsdp=2", "= 2 devices", "4 are available")),
        (3, -1, ("mesh.data: 3", "4 available devices")),
        (-1, 3, ("mesh.fsdp: 3", "4 available devices")),
    ],
)
def test_make_mesh_that_does_not_fit_names_the_numbers(data, fsdp, numbers) -> None:
    assert len(jax.devices()) == 4
    with pytest.raises(PdctlError) as e:
        sharding.make_mesh(data, fsdp)
    msg = str(e.value)
    assert "\n" not in msg
    for part in numbers:
        assert part in msg, (part, msg)


def test_make_mesh_fills_the_wildcard() -> None:
    assert dict(sharding.make_mesh(-1, 2).shape) == {"data": 2, "fsdp": 2, "tp": 1}
    assert dict(sharding.make_mesh(1, -1).shape) == {"data": 1, "fsdp": 4, "tp": 1}
    assert dict(sharding.make_mesh(1, 1, jax.devices()[:1]).shape) == {
        "data": 1,
        "fsdp": 1,
        "tp": 1,
    }


# ---- parity gates --------------------------------------------------------------------------


def _max_rel_dev(traj: np.ndarray, ref: np.ndarray) -> float:
    assert traj.shape == ref.shape == (PARITY_STEPS,)
    assert np.all(np.isfinite(traj)) and np.all(np.isfinite(ref))
    return float(np.max(np.abs(traj - ref) / np.abs(ref)))


# llama-mlp on every 4-device mesh; resid-mlp (batches generated on the device under a sharding
# constraint) on the mesh that uses both axes.
PARITY_CASES = [
    ("llama-mlp", "data4"),
    ("llama-mlp", "fsdp4"),
    ("llama-mlp", "data2_fsdp2"),
    ("resid-mlp", "data2_fsdp2"),
]


@pytest.mark.slow  # ~8-14 s each
@pytest.mark.parametrize(("template", "mesh"), PARITY_CASES)
def test_parity_1_vs_4_devices(pieces, reference, template: str, mesh: str) -> None:
    ref = reference(template)
    assert len(set(ref.tolist())) == PARITY_STEPS, "a trajectory with something to compare"
    if template == "llama-mlp":
        assert ref[-1] < ref[0], "the reference run is learning"
    pt = pieces(template, mesh)
    if mesh != "data4":  # the run really is sharded: some parameter is split over devices
        params = pt.init_params()
        assert any(_shard_elems(x) < x.size for x in jax.tree.leaves(params))
    traj = run_steps(pt, pt.init_state(), PARITY_STEPS)[1]
    dev = _max_rel_dev(traj, ref)
    assert dev <= PARITY_RTOL[template], (template, mesh, dev, traj, ref)


def test_parity_gate_catches_a_1pct_learning_rate_change(runs, reference, tmp_path: Path) -> None:
    """The same comparison must fail for a step that is only slightly wrong."""
    ref = reference("resid-mlp")
    lr = Project.load(runs["resid-mlp"] / "pdctl.toml").config.pretrain.optim.lr
    run = make_run(tmp_path, "resid-mlp", pretrain={"optim": {"lr": lr * 1.01}})
    pt = pretrain_on(run, _mesh("1"), total=PARITY_STEPS)
    traj = run_steps(pt, pt.init_state(), PARITY_STEPS)[1]
    assert traj[0] == ref[0]  # same init, same first batch: only the update differs
    dev = _max_rel_dev(traj, ref)
    assert dev > 3 * PARITY_RTOL["resid-mlp"], dev


def test_parity_gate_catches_a_dropped_example(pieces, reference) -> None:
    """One sequence of every batch replaced by a copy of another (an example dropped by a
    sharding bug) breaks the gate from the first step.

    The corrupted batches go through the reference's own 1-device step (compiled once, for
    the reference): the gate compares two loss trajectories, and on one device the whole
    deviation is the dropped example's (a 4-device run would only add the few ulps of its
    reordered sums), so it still shows that this comparison catches the bug. The fast tier
    thereby skips a second (4-device) compile of the step (~10 s on 2 cores)."""
    ref = reference("llama-mlp")
    pt = pieces("llama-mlp", "1")
    step = pt.step_fn()
    state, losses = pt.init_state(), []
    for i in range(PARITY_STEPS):
        tokens = np.array(jax.device_get(pt.batch(i)["tokens"]))
        tokens[-1] = tokens[0]
        state, m = step(state, {"tokens": jax.device_put(tokens, pt.batch_sh)})
        losses.append(m["loss"])
    traj = np.asarray(jax.device_get(losses), dtype=np.float64)
    assert _max_rel_dev(traj, ref) > 3 * PARITY_RTOL["llama-mlp"]


# ---- donation ------------------------------------------------------------------------------


def test_pretrain_step_donates_its_whole_state(pieces) -> None:
    pt = pieces("resid-mlp", "data2_fsdp2")
    step = pt.step_fn()
    state = pt.init_state()
    inputs = jax.tree.leaves(state)
    before = donation.buffer_bytes_by_ptr(state)
    # Sharded leaves contribute one buffer per device: the check covers every shard.
    assert len(before) > len(inputs)
    new, _ = step(state, pt.batch(0))
    jax.block_until_ready(new)
    fraction, missed = donation.reused_fraction(before, new)
    assert fraction >= 0.95, (fraction, missed)
    assert all(x.is_deleted() for x in inputs), "every donated input is consumed"
    assert not any(x.is_deleted() for x in jax.tree.leaves(new))
    # The rebinding carries on: a second step donates the first one's outputs as well.
    before = donation.buffer_bytes_by_ptr(new)
    newer, _ = step(new, pt.batch(1))
    assert donation.reused_fraction(before, newer)[0] >= 0.95


def test_non_donating_step_is_reported(pieces, capsys: pytest.CaptureFixture[str]) -> None:
    pt = pieces("resid-mlp", "data2_fsdp2")
    step = pt.step_fn(donate=False)
    state = pt.init_state()
    before = donation.buffer_bytes_by_ptr(state)
    new, _ = step(state, pt.batch(0))
    fraction, missed = donation.reused_fraction(before, new)
    assert fraction < 0.95
    assert missed > 0
    assert not any(x.is_deleted() for x in jax.tree.leaves(state))
    assert donation.report("pretrain", fraction, missed) is False
    out = capsys.readouterr().out
    assert "DONATION FAILED in pretrain" in out
    assert "MiB not reused" in out
    # ... and a working step prints nothing.
    assert donation.report("pretrain", 0.99, 10) is True
    assert capsys.readouterr().out == ""


def test_loop_reports_a_non_donating_step_fn(pieces, tmp_path: Path) -> None:
    pt = pieces("tms", "1", total=12)
    loop, echoed, states = make_loop(
        pt.step_fn(donate=False), pt.init_state(), tmp_path, total=3, log_every=3
    )
    result = loop.run()
    assert result.donation_fraction is not None and result.donation_fraction < 0.95
    assert sum("DONATION FAILED in pretrain" in line for line in echoed) == 1, echoed
    assert states[-1]["donation_fraction"] < 0.95


# ---- no host sync per step -----------------------------------------------------------------


class SyncingStep:
    """A step function for `Loop` that wraps the compiled step in Python and, after every call,
    reads the loss on the host (`np.asarray`): a per-step host sync. It records the
    device-to-host transfer guard in force while the loop dispatches it."""

    def __init__(self, jitted: Any):
        self.jitted = jitted
        self.guards: list[str | None] = []

    def lower(self, *args: Any) -> Any:
        lowered = self.jitted.lower(*args)
        outer = self

        class Lowered:
            def compile(self) -> Any:
                compiled = lowered.compile()

                def call(*a: Any) -> Any:
                    outer.guards.append(jax.config.jax_transfer_guard_device_to_host)
                    state, metrics = compiled(*a)
                    np.asarray(metrics["loss"])  # the host sync the guard must refuse
                    return state, metrics

                return call

        return Lowered()


def test_loop_dispatches_under_a_device_to_host_guard(pieces, tmp_path: Path) -> None:
    pt = pieces("tms", "1", total=12)
    step = SyncingStep(pt.step_fn())
    loop, _, _ = make_loop(step, pt.init_state(), tmp_path, total=3, log_every=3)
    if jax.default_backend() == "cpu":
        # XLA:CPU arrays convert to numpy zero-copy and the guard does not see it (jax#16602),
        # so on CPU check that the guard is in force around every dispatch instead.
        loop.run()
        assert step.guards == ["disallow"] * 3
        assert jax.config.jax_transfer_guard_device_to_host in (None, "allow")  # restored
    else:
        with pytest.raises(Exception, match=r"(?i)disallowed device-to-host"):
            loop.run()
        assert step.guards == ["disallow"]


def test_loop_runs_with_sparse_logging_and_checks_donation(pieces, tmp_path: Path) -> None:
    pt = pieces("tms", "1", total=12)
    loop, echoed, states = make_loop(
        pt.step_fn(), pt.init_state(), tmp_path, total=12, log_every=4, checkpoint_every=6
    )
    result = loop.run()
    assert result.status == "done" and result.step == 12
    assert result.donation_fraction is not None and result.donation_fraction >= 0.95
    assert not any("DONATION FAILED" in line for line in echoed)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lines] == [4, 8, 12]  # metrics read only at the cadence
    assert all(np.isfinite(r["loss"]) and r["finite"] == 1.0 for r in lines)
    assert int(jax.device_get(result.state["loop"]["step"])) == 12
    assert loop.checkpointer.all_steps() == [6, 12]
    assert states[-1]["status"] == "done" and states[-1]["step"] == 12


# ---- bad steps -----------------------------------------------------------------------------


def test_guard_update_skips_non_finite_steps_and_counts_them() -> None:
    old = {
        "params": {"w": jnp.ones(3)},
        "opt_state": {"m": jnp.zeros(3)},
        "loop": loop_counters(jax.random.PRNGKey(0)),
    }
    new = {"params": {"w": jnp.full(3, 2.0)}, "opt_state": {"m": jnp.full(3, 0.5)}}
    upd = jax.jit(guard_update)
    metrics = {"loss": jnp.float32(1.0)}

    s, m = upd(old, new, jnp.bool_(False), metrics)
    np.testing.assert_array_equal(s["params"]["w"], old["params"]["w"])
    np.testing.assert_array_equal(s["opt_state"]["m"], old["opt_state"]["m"])
    assert (int(s["loop"]["step"]), int(s["loop"]["bad_steps"]), int(m["max_bad_run"])) == (1, 1, 1)
    assert float(m["finite"]) == 0.0
    s, m = upd(s, new, jnp.bool_(False), metrics)
    assert (int(s["loop"]["step"]), int(s["loop"]["bad_steps"]), int(m["max_bad_run"])) == (2, 2, 2)
    s, m = upd(s, new, jnp.bool_(True), metrics)
    np.testing.assert_array_equal(s["params"]["w"], new["params"]["w"])
    np.testing.assert_array_equal(s["opt_state"]["m"], new["opt_state"]["m"])
    # The consecutive count resets; the longest run so far is remembered.
    assert (int(s["loop"]["step"]), int(s["loop"]["bad_steps"]), int(m["max_bad_run"])) == (3, 0, 2)
    assert float(m["finite"]) == 1.0
    np.testing.assert_array_equal(s["loop"]["rng"], old["loop"]["rng"])


class NaNLoss:
    """A target whose loss is NaN: the pretrain step must skip the update on the device."""

    def __init__(self, target: Any):
        self._t = target

    def __getattr__(self, name: str) -> Any:
        return getattr(self._t, name)

    def loss(self, params, batch):
        loss, aux = self._t.loss(params, batch)
        return loss * jnp.nan, aux


def test_pretrain_step_with_a_nan_loss_leaves_the_state_unchanged(pieces) -> None:
    pt = pieces("resid-mlp", "data2_fsdp2")
    bad_step = pt.step_fn(target=NaNLoss(pt.target))
    state = pt.init_state()
    host0 = jax.device_get({"params": state["params"], "opt_state": state["opt_state"]})
    for k in (1, 2):
        state, m = bad_step(state, None)
        assert np.isnan(float(m["loss"])) and float(m["finite"]) == 0.0
        host = jax.device_get({"params": state["params"], "opt_state": state["opt_state"]})
        jax.tree.map(np.testing.assert_array_equal, host, host0)
        loop = jax.device_get(state["loop"])
        assert (int(loop["step"]), int(loop["bad_steps"]), int(m["max_bad_run"])) == (k, k, k)
    state, m = pt.step_fn()(state, None)  # a good step updates again and resets the run
    assert float(m["finite"]) == 1.0 and np.isfinite(float(m["loss"]))
    loop = jax.device_get(state["loop"])
    assert (int(loop["step"]), int(loop["bad_steps"]), int(m["max_bad_run"])) == (3, 0, 2)
    w = jax.device_get(state["params"]["layers"]["0"]["mlp_in"]["W"])
    assert not np.array_equal(w, host0["params"]["layers"]["0"]["mlp_in"]["W"])


def test_one_tracker_interface_fans_out_to_jsonl_and_the_others(tmp_path):
    """The loop logs to one tracker; the composite sends every record to jsonl (step + raw
    names) and to the others (a stand-in with wandb's shape here), and a resumed stage's
    jsonl drops what it will log again."""
    from pdctl.engine.tracking import CompositeTracker, JsonlTracker

    seen = []

    class Other:
        run_id = "abc"

        def log(self, metrics, step):
            seen.append((step, dict(metrics)))

        def finish(self):
            seen.append("finish")

    path = tmp_path / "m.jsonl"
    tr = CompositeTracker([JsonlTracker(path), Other()])
    assert tr.run_id == "abc"
    for step in (5, 10, 15):
        tr.log({"loss": step / 10, "bad": float("nan")}, step)
    tr.finish()
    lines = [json.loads(x) for x in path.read_text().splitlines()]
    assert [x["step"] for x in lines] == [5, 10, 15] and lines[0]["loss"] == 0.5
    assert lines[0]["bad"] == "nan"  # JSON has no NaN: written as a string
    assert seen[0] == (5, {"loss": 0.5, "bad": seen[0][1]["bad"]}) and seen[-1] == "finish"
    JsonlTracker(path).truncate_after(10)
    assert [json.loads(x)["step"] for x in path.read_text().splitlines()] == [5, 10]


def test_logged_step_time_leaves_out_evaluations_and_checkpoints(pieces, tmp_path: Path) -> None:
    """An evaluation (here a 1.5 s one) between two log lines is not step time: before, the
    window after it read its seconds as ms a step (on a TPU "13462.6 ms/step, 304 tokens/s"
    for the step after an 11 s evaluation)."""
    import time

    pt = pieces("tms", "1", total=12)

    def slow_eval(state: Any) -> dict[str, Any]:
        time.sleep(1.5)
        return {"loss": 0.0}

    loop, _, _ = make_loop(
        pt.step_fn(), pt.init_state(), tmp_path, total=4, log_every=2,
        eval_fn=slow_eval, eval_every=2,
    )  # fmt: skip
    loop.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ms = {r["step"]: r["step_ms"] for r in lines if "step_ms" in r}
    assert set(ms) == {2, 4}
    # steps 3-4 ran after the evaluation of step 2: a toy step takes milliseconds (the 1.5 s
    # evaluation spread over 2 steps would read 750 ms)
    assert ms[4] < 300, ms


def test_the_first_log_window_starts_after_the_first_step(pieces, tmp_path: Path) -> None:
    """The first step of a process (here made 1.5 s slower, as a resumed executable's first
    run is on a TPU) does not count in the logged ms a step unless it is the window's only
    step."""
    import time

    pt = pieces("tms", "1", total=12)
    jitted = pt.step_fn()

    class SlowFirst:
        def lower(self, *args: Any) -> Any:
            lowered = jitted.lower(*args)

            class Lowered:
                def compile(self) -> Any:
                    compiled = lowered.compile()
                    calls = []

                    def call(*a: Any) -> Any:
                        calls.append(1)
                        if len(calls) == 1:
                            time.sleep(1.5)
                        return compiled(*a)

                    return call

            return Lowered()

    loop, _, _ = make_loop(SlowFirst(), pt.init_state(), tmp_path, total=4, log_every=2)
    loop.run()
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    ms = {r["step"]: r["step_ms"] for r in lines if "step_ms" in r}
    assert ms[2] < 300, ms  # step 2 alone (the 1.5 s first step over 2 steps read 750 ms)
