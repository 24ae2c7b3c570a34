"""`pdctl sweep`: members as ordinary run directories, the stacked step against each member's
own, a sweep end to end (status, report, a member on its own), a diverging member."""

from __future__ import annotations

import dataclasses
import functools
import json
import tomllib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cli, cli_fails, cli_ok, state

from pdctl.project import Project
from pdctl.stages import pretrain, train
from pdctl.stages.init_weights import init_decomposition
from pdctl.stages.inputs import STREAM_DECOMP, STREAM_TARGET, stream_key, target_from_config
from pdctl.sweep import hyper, spec
from pdctl.sweep import stacked as st
from pdctl.sweep.spec import Sweep

TINY = [
    "pretrain.steps=20", "pretrain.batch_size=64", "pretrain.log_every=5", "checkpoint.every=10",
    'decomp.sites=[{pattern="linear1", C=4}, {pattern="linear2", C=4}]', "warmup.steps=10",
    "train.steps=20", "train.batch_size=64", "train.eval_every=10", "train.eval_batch_size=64",
    "train.log_every=5",
]  # fmt: skip


def _sets(extra: list[str] = ()) -> list[str]:
    return [x for s in [*TINY, *extra] for x in ("--set", s)]


def test_new_writes_one_ordinary_run_per_member(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cli_ok("sweep", "new", "sw", "--seeds", "3", "--grid", "train.loss.p=1.0,2.0", *_sets())
    sweep = Sweep.load(tmp_path / "sw")
    assert [m.name for m in sweep.members] == [
        f"p-{p}_seed{s}" for p in ("1.0", "2.0") for s in range(3)
    ]
    for m in sweep.members:
        cfg = sweep.project(m).config  # a complete, valid config on its own
        assert cfg.run.seed == m.seed and cfg.train.loss.p == m.point["train.loss.p"]
        assert cfg.train.steps == 20 and cfg.decomp.sites[0].C == 4
        assert cli_ok("-p", str(sweep.run_dir(m)), "status").exit_code == 0
    raw = tomllib.loads((tmp_path / "sw" / "sweep.toml").read_text())
    assert raw["grid"] == {"train.loss.p": [1.0, 2.0]} and raw["seeds"] == [0, 1, 2]


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--set", "train.stepz=3"], "train.stepz"),
        (["--set", "train.steps"], "--set"),
        (["--grid", "run.seed=1,2"], "--seeds"),
        (["--grid", "train.loss.p=1.0,1.0"], "twice"),
        (["--seeds", "0"], "--seeds"),
        (["--template", "hf-lm"], "toy targets"),
        (["--template", "nope"], "--template"),
    ],
)
def test_new_bad_input_is_one_line_and_writes_nothing(tmp_path: Path, monkeypatch, args, says):
    monkeypatch.chdir(tmp_path)
    line = cli_fails(2, "sweep", "new", "sw", *args)
    assert says in line
    assert not (tmp_path / "sw").exists()


def test_commands_on_a_missing_sweep_are_one_line(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for cmd in ("run", "status", "report"):
        assert "sweep new" in cli_fails(2, "sweep", cmd, "nowhere")
    assert "--strategy" in cli_fails(2, "sweep", "run", "nowhere", "--strategy", "fast")


def _member_cfgs(tmp_path: Path, n: int):
    cli_ok("sweep", "new", "sw", "--seeds", str(n), *_sets())
    sweep = Sweep.load(tmp_path / "sw")
    return [sweep.project(m).config for m in sweep.members]


def _alone(prog, frozen, state, n):
    step = prog.jit()
    for _ in range(n):
        state, _ = step(*frozen, state, None)
    return jax.device_get(state)


def _together(progs, frozens, states, n, strategy):
    sp = st.stacked_program(progs[0], len(progs), strategy)
    s = sp.put(states, sp.state_shardings)
    f = tuple(sp.put([fr[i] for fr in frozens], sh) for i, sh in enumerate(sp.frozen_shardings))
    step = sp.jit()
    for _ in range(n):
        s, m = step(*f, s, None)
    assert np.asarray(m["loss"]).shape == (len(progs),)
    return jax.device_get(s)


@pytest.mark.parametrize("strategy", st.STRATEGIES)
def test_stacked_pretrain_is_each_members_own_step(tmp_path, monkeypatch, strategy):
    """`map` runs each member's own step: bit for bit. `vmap` batches the members' matmuls,
    which XLA may sum in another order: equal within float32 rounding."""
    monkeypatch.chdir(tmp_path)
    cfgs = _member_cfgs(tmp_path, 2)
    target = target_from_config(cfgs[0])
    alone = st.member_mesh(1)
    progs = [pretrain.program(c, st.member_mesh(2), target) for c in cfgs]
    states = [
        jax.device_get(p.jit_make_state()(target.init(stream_key(c, STREAM_TARGET))))
        for p, c in zip(progs, cfgs, strict=True)
    ]
    got = _together(progs, [()] * 2, states, 4, strategy)
    for i, c in enumerate(cfgs):
        own = pretrain.program(c, alone, target)
        want = _alone(own, (), st.member_slice(jax.tree.map(lambda *x: np.stack(x), *states), i), 4)
        same = np.testing.assert_array_equal
        if strategy == "vmap":
            same = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)  # noqa: E731
        jax.tree.map(same, st.member_slice(got, i), want)
    # the seeds' streams differ: the members did not train on the same data
    assert not np.array_equal(got["params"]["linear1"]["W"][0], got["params"]["linear1"]["W"][1])


@pytest.mark.parametrize(
    ("n", "devices", "used", "slots"),
    [(1, 4, 1, 1), (2, 4, 2, 2), (3, 4, 3, 3), (4, 4, 4, 4), (5, 4, 3, 6), (6, 4, 3, 6),
     (7, 4, 4, 8), (9, 4, 3, 9), (3, 2, 2, 4), (4, 2, 2, 4), (5, 1, 1, 5)],
)  # fmt: skip
def test_padded_member_mesh_gives_the_fewest_members_per_device(n, devices, used, slots):
    # (GPU/TPU) ceil(n / devices) members per device on as few devices as that needs; a count
    # that does not fill them evenly is padded (3 on 2 devices: 2 + 2, not 3 on one)
    mesh = st.member_mesh(n, jax.devices()[:devices], pad=True)
    assert (mesh.shape[st.MEMBERS], st.member_slots(n, mesh)) == (used, slots)
    assert st.pad_members(list(range(n)), slots) == [*range(n), *[0] * (slots - n)]


@pytest.mark.parametrize(
    ("n", "devices", "used"), [(1, 4, 1), (3, 4, 3), (4, 4, 4), (5, 4, 1), (6, 4, 3), (3, 2, 1)]
)
def test_cpu_member_mesh_is_the_most_devices_that_divide_the_count(n, devices, used):
    # (CPU: the default here) host devices share one thread pool, so no padding
    mesh = st.member_mesh(n, jax.devices()[:devices])
    assert (mesh.shape[st.MEMBERS], st.member_slots(n, mesh)) == (used, n)


def test_padded_members_each_run_their_own_step(tmp_path, monkeypatch):
    """3 members on 2 devices run as 4 slots (the 4th a copy of the first, its result unread):
    each member's state is its own step's, bit for bit."""
    monkeypatch.chdir(tmp_path)
    cfgs = _member_cfgs(tmp_path, 3)
    target = target_from_config(cfgs[0])
    mesh = st.member_mesh(3, jax.devices()[:2], pad=True)
    slots = st.member_slots(3, mesh)
    assert (mesh.size, slots) == (2, 4)
    progs = [pretrain.program(c, mesh, target) for c in cfgs]
    states = [
        jax.device_get(p.jit_make_state()(target.init(stream_key(c, STREAM_TARGET))))
        for p, c in zip(progs, cfgs, strict=True)
    ]
    got = _together(st.pad_members(progs, slots), [()] * slots, st.pad_members(states, slots), 3,
                    "map")  # fmt: skip
    for i, c in enumerate(cfgs):
        own = pretrain.program(c, st.member_mesh(1), target)
        want = _alone(own, (), states[i], 3)
        jax.tree.map(np.testing.assert_array_equal, st.member_slice(got, i), want)
    jax.tree.map(np.testing.assert_array_equal, st.member_slice(got, 3), st.member_slice(got, 0))


def test_traced_values_share_a_program_and_structure_does_not(tmp_path, monkeypatch):
    """Members that differ only in numbers `hyper.TRACED` lists have one signature; a value
    that changes the program's structure (p_final None vs a number, a schedule kind) does not.
    `varied` lists only the keys whose values differ, `substitute` puts values in place."""
    monkeypatch.chdir(tmp_path)
    grid = ["train.optim.lr=0.001,0.002", "data.feature_probability=0.05,0.1"]
    cli_ok("sweep", "new", "sw", "--seeds", "2", *[x for g in grid for x in ("--grid", g)],
           *_sets(["warmup.lr=0.02"]))  # fmt: skip
    sweep = Sweep.load(tmp_path / "sw")
    raws = [sweep.project(m).config.model_dump(mode="json", by_alias=True) for m in sweep.members]
    assert len({hyper.signature(r) for r in raws}) == 1
    got = hyper.varied(raws)
    assert sorted(got) == ["data.feature_probability", "train.optim.lr"]  # not warmup.lr
    np.testing.assert_array_equal(got["train.optim.lr"], np.float32([0.001] * 4 + [0.002] * 4))
    other = json.loads(json.dumps(raws[0]))
    other["train"]["loss"]["p_final"] = 0.5
    assert hyper.signature(other) != hyper.signature(raws[0])
    other = json.loads(json.dumps(raws[0]))
    other["train"]["optim"]["schedule"] = "linear"
    assert hyper.signature(other) != hyper.signature(raws[0])
    cfg = sweep.project(sweep.members[0]).config
    new = hyper.substitute(cfg, {"train.optim.lr": 0.5, "train.loss.stochastic_recon": 2.0})
    assert (new.train.optim.lr, new.train.loss.stochastic_recon) == (0.5, 2.0)
    assert cfg.train.optim.lr == 0.001 and new.train.steps == cfg.train.steps
    # names stay readable when two keys end alike
    assert spec.short_keys(["train.optim.lr", "warmup.lr", "train.loss.p"]) == {
        "train.optim.lr": "optim.lr", "warmup.lr": "warmup.lr", "train.loss.p": "p"
    }  # fmt: skip


def test_a_traced_coefficient_of_0_gives_neither_value_nor_gradient():
    """A member without a term (traced coefficient 0) gets exactly 0 and a zero gradient from
    it, even where the term's gradient is not finite (sqrt at 0), one by one and vmapped."""
    from pdctl.science.spd.losses import term_if_on

    x = jnp.array([0.0, 1.0])

    def part(c, x):
        return term_if_on(c, lambda k: jnp.sum(jnp.sqrt(x)), jax.random.key(0))[1]

    np.testing.assert_array_equal(jax.grad(part, argnums=1)(jnp.float32(0.0), x), [0.0, 0.0])
    assert part(jnp.float32(0.0), x) == 0.0 and part(jnp.float32(2.0), x) == 2.0
    g = jax.vmap(jax.grad(part, argnums=1), in_axes=(0, None))(jnp.float32([0.0, 2.0]), x)
    np.testing.assert_array_equal(g[0], [0.0, 0.0])
    assert g[1][1] == 1.0


def test_stacked_pretrain_with_traced_values_is_each_members_own_step(tmp_path, monkeypatch):
    """Two members with another learning rate and feature probability, stacked with their
    values traced: each member's result equals its own program's (the values are folded into
    the member's own program as constants, so XLA may round differently: float32 rounding)."""
    monkeypatch.chdir(tmp_path)
    grid = ["pretrain.optim.lr=0.005,0.02", "data.feature_probability=0.05,0.2"]
    cli_ok("sweep", "new", "sw", "--seeds", "1", *[x for g in grid for x in ("--grid", g)],
           *_sets())  # fmt: skip
    sweep = Sweep.load(tmp_path / "sw")
    cfgs = [sweep.project(m).config for m in sweep.members][::3]  # (0.005, 0.05), (0.02, 0.2)
    raws = [c.model_dump(mode="json", by_alias=True) for c in cfgs]
    varied = hyper.varied(raws)
    mesh = st.member_mesh(2)
    target0 = target_from_config(cfgs[0])

    def build(values):
        t = dataclasses.replace(target0, feature_probability=values["data.feature_probability"])
        return pretrain.program(hyper.substitute(cfgs[0], values), mesh, t).step

    member = pretrain.program(cfgs[0], mesh, target0)
    sp = st.stacked_program(member, 2, "map", tuple(varied), build)
    states = [
        jax.device_get(member.jit_make_state()(target0.init(stream_key(c, STREAM_TARGET))))
        for c in cfgs
    ]
    s = sp.put(states, sp.state_shardings)
    values = jax.device_put(varied, sp.frozen_shardings[-1])
    step = sp.jit()
    for _ in range(4):
        s, _ = step(values, s, None)
    got = jax.device_get(s)
    for i, c in enumerate(cfgs):
        own = pretrain.program(c, st.member_mesh(1), target_from_config(c))
        want = _alone(own, (), states[i], 4)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7),
            st.member_slice(got, i),
            want,
        )
    # the two members really trained differently (their lr and data differ)
    assert not np.allclose(got["params"]["linear1"]["W"][0], got["params"]["linear1"]["W"][1])


@pytest.mark.slow
def test_stacked_train_step_matches_each_members_own(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfgs = _member_cfgs(tmp_path, 2)
    target = target_from_config(cfgs[0])
    mesh = st.member_mesh(2)
    progs, frozens, states = [], [], []
    for c in cfgs:
        p = train.program(c, mesh, target)
        dec, _ = init_decomposition(c, target, mesh, stream_key(c, STREAM_DECOMP))
        progs.append(p)
        frozens.append((jax.device_get(target.init(stream_key(c, STREAM_TARGET))),))
        inputs = (dec["components"], dec["ci_fns"], dec["sources"])
        states.append(jax.device_get(p.jit_make_state()(*inputs)))
    got = _together(progs, frozens, states, 3, "map")
    for i, c in enumerate(cfgs):
        own = train.program(c, st.member_mesh(1), target)
        put = lambda t, s: jax.device_put(t, s)  # noqa: E731
        want = _alone(
            own,
            (put(frozens[i][0], own.frozen_shardings[0]),),
            put(states[i], own.state_shardings),
            3,
        )
        # The same computation; XLA fuses the step inside the member loop differently, so
        # float sums may be reordered (measured: 3e-7 relative after 200 steps).
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
            st.member_slice(got, i),
            want,
        )


def _run_tiny(tmp_path: Path, *args: str) -> Sweep:
    cli_ok("sweep", "new", "sw", *args, *_sets())
    cli_ok("sweep", "run", "sw")
    return Sweep.load(tmp_path / "sw")


@pytest.mark.slow
def test_a_sweep_end_to_end(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    # a structural key: two groups of two members, run one after the other
    sweep = _run_tiny(tmp_path, "--seeds", "2", "--grid", "decomp.n_mask_samples=1,2")
    for m in sweep.members:
        run = sweep.run_dir(m)
        for stage in ("init_weights", "pretrain", "warmup", "train"):
            assert state(run, stage)["status"] == "done", (m.name, stage)
        tr = state(run, "train")
        assert tr["step"] == 20 and tr["sweep"]["members"] == 2
        assert "ci_errors" in tr["eval"] and tr["checkpoint"] == 20
        # the member on its own: its checkpoints and metrics are its own
        assert (run / "metrics" / "train.jsonl").is_file() or any(run.rglob("train.jsonl"))
        cli_ok("-p", str(run), "export", "--out", str(tmp_path / f"{m.name}.npz"))
    a, b = (np.load(tmp_path / f"{m.name}.npz") for m in sweep.members[:2])
    assert not np.array_equal(a["components.linear1.V"], b["components.linear1.V"])
    out = json.loads(cli_ok("sweep", "status", "sw", "--json").stdout)
    assert [r["member"] for r in out["members"]] == [m.name for m in sweep.members]
    assert all(r["status"] == "done" and r["success"] in (True, False) for r in out["members"])
    assert [g["members"] for g in out["points"]] == [2, 2]
    rep = cli_ok("sweep", "report", "sw")
    assert "decomp.n_mask_samples=1" in rep.stdout and (tmp_path / "sw" / "report.md").is_file()
    # a second run has nothing to do and changes nothing
    before = [(sweep.run_dir(m) / "pdctl.toml").read_text() for m in sweep.members]
    again = cli_ok("sweep", "run", "sw")
    assert "program" not in again.stdout
    assert before == [(sweep.run_dir(m) / "pdctl.toml").read_text() for m in sweep.members]


def _member_and_solo(member: Path, tmp_path: Path):
    """The member's exported arrays and those of `pdctl run` on a copy of its config alone
    (in `solo-<member>`, its [state.*] tables left out)."""
    solo = tmp_path / f"solo-{member.name}"
    solo.mkdir()
    text = (member / "pdctl.toml").read_text()
    (solo / "pdctl.toml").write_text(text[: text.index("\n[state.")] + "\n")
    cli_ok("-p", str(solo), "run")
    for run in (member, solo):
        cli_ok("-p", str(run), "export", "--out", str(tmp_path / f"{run.name}.npz"))
    got, want = np.load(tmp_path / f"{member.name}.npz"), np.load(tmp_path / f"{solo.name}.npz")
    assert got.files == want.files
    return got, want


@pytest.mark.slow
def test_a_one_member_sweep_is_pdctl_run_bit_for_bit(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    sweep = _run_tiny(tmp_path, "--seeds", "1")
    got, want = _member_and_solo(sweep.run_dir(sweep.members[0]), tmp_path)
    for k in want.files:
        np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.slow
def test_a_sweep_that_does_not_fill_the_devices_evenly_is_padded(tmp_path, monkeypatch):
    """With padding (GPU/TPU's layout, forced here) 5 members on the 4 test devices run as 3
    devices x 2 slots (one padding slot, a copy of the first member whose results nobody
    reads; its traced value too): every member ends as its own run, and the one beside the
    padding equals its own `pdctl run` (within float32 rounding, as for any stacked member with
    traced values)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(st, "member_mesh", functools.partial(st.member_mesh, pad=True))
    grid = "train.loss.importance_minimality=0.001,0.002,0.003,0.004,0.005"
    sweep = _run_tiny(tmp_path, "--seeds", "1", "--grid", grid)
    for m in sweep.members:
        tr = state(sweep.run_dir(m), "train")
        assert tr["status"] == "done" and tr["step"] == 20, m.name
        assert (tr["sweep"]["members"], tr["sweep"]["devices"], tr["sweep"]["slots"]) == (5, 3, 6)
    got, want = _member_and_solo(sweep.run_dir(sweep.members[4]), tmp_path)
    for k in want.files:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)


@pytest.mark.slow
def test_members_with_other_coefficients_run_as_one_program_like_alone(tmp_path, monkeypatch):
    """A grid over a loss coefficient (0 = the term off for that member) and the feature
    probability is ONE group: every stage runs its 4 members as one program. A member's
    result equals its own `pdctl run` within float32 rounding (its values are traced in the
    sweep, constants alone; measured max |diff| 1.2e-7 on the CI weights, the rest equal) and
    its evaluation is the same."""
    monkeypatch.chdir(tmp_path)
    grid = ["train.loss.importance_minimality=0.0,0.003", "data.feature_probability=0.05,0.1"]
    cli_ok("sweep", "new", "sw", "--seeds", "1", *[x for g in grid for x in ("--grid", g)],
           *_sets())  # fmt: skip
    out = cli_ok("sweep", "run", "sw").stdout
    assert "group 1/1: 4 members" in out and out.count("4 members as one program") == 3
    sweep = Sweep.load(tmp_path / "sw")
    for m in (sweep.members[0], sweep.members[3]):  # the term off / on, both probabilities
        member = sweep.run_dir(m)
        got, want = _member_and_solo(member, tmp_path)
        for k in want.files:
            np.testing.assert_allclose(got[k], want[k], rtol=1e-5, atol=1e-6, err_msg=k)
        ev = state(member, "train")["eval"]
        ev_solo = state(tmp_path / f"solo-{m.name}", "train")["eval"]
        assert ev["ci_errors"] == ev_solo["ci_errors"]
        assert ev["mmcs"] == pytest.approx(ev_solo["mmcs"], abs=1e-5)
    names = [m.name for m in sweep.members]
    assert names[0] == "importance_minimality-0.0_feature_probability-0.05_seed0"


@pytest.mark.slow
@pytest.mark.parametrize(
    "axes", [["--seeds", "2"], ["--seeds", "1", "--grid", "train.optim.lr=0.001,0.003"]]
)
def test_a_stopped_sweep_continues_bit_exact(tmp_path: Path, monkeypatch, axes):
    """SIGTERM in the middle of train: every member saves a checkpoint at the same step and is
    `interrupted` (exit 3); `pdctl sweep run` continues them together to the very arrays of a
    sweep that was never stopped. Members that differ in seed, and members that differ in a
    traced value (their learning rate: one more argument of the stacked step)."""
    import os
    import signal

    from pdctl.sweep.run import SweepLoop

    monkeypatch.chdir(tmp_path)
    for name in ("whole", "stopped"):
        cli_ok("sweep", "new", name, *axes, *_sets())
    cli_ok("sweep", "run", "whole")
    log = SweepLoop._log

    def stop_at_10(self, step, *a):
        if self.stage == "train" and step == 10:
            os.kill(os.getpid(), signal.SIGTERM)
        return log(self, step, *a)

    monkeypatch.setattr(SweepLoop, "_log", stop_at_10)
    line = cli_fails(3, "sweep", "run", "stopped")
    assert "sweep run stopped" in line
    sweep = Sweep.load(tmp_path / "stopped")
    for m in sweep.members:
        tr = state(sweep.run_dir(m), "train")
        assert (tr["status"], tr["checkpoint"]) == ("interrupted", 10)
    monkeypatch.setattr(SweepLoop, "_log", log)
    cli_ok("sweep", "run", "stopped")
    for m in sweep.members:
        got, want = (
            np.load(cli_ok("-p", str(tmp_path / s / "runs" / m.name), "export", "--out",
                           str(tmp_path / f"{s}-{m.name}.npz")) and tmp_path / f"{s}-{m.name}.npz")
            for s in ("stopped", "whole")
        )  # fmt: skip
        for k in want.files:
            np.testing.assert_array_equal(got[k], want[k], err_msg=k)


@pytest.mark.slow
def test_a_diverging_member_fails_alone(tmp_path: Path, monkeypatch):
    """seed1's target starts non-finite: its pretrain steps are all bad, so it ends `failed`
    at max_bad_steps while seed0 and seed2 train to the end and go on to the next stages."""
    spec = pretrain.SPEC

    def poisoned(env, prog):
        (params,) = spec.fresh_inputs(env, prog)
        if env.project.root.name == "seed1":
            params = jax.tree.map(lambda a: a * np.nan, params)
        return (params,)

    monkeypatch.setattr(pretrain, "SPEC", dataclasses.replace(spec, fresh_inputs=poisoned))
    monkeypatch.chdir(tmp_path)
    cli_ok("sweep", "new", "sw", "--seeds", "3", *_sets(["pretrain.max_bad_steps=3"]))
    result = cli("sweep", "run", "sw")
    assert result.exit_code == 0, result.stderr
    assert "member seed1 failed" in result.stderr
    sweep = Sweep.load(tmp_path / "sw")
    got = {m.name: Project.load(sweep.run_dir(m) / "pdctl.toml") for m in sweep.members}
    assert got["seed1"].stage("pretrain")["status"] == "failed"
    assert "non-finite" in got["seed1"].stage("pretrain")["error"]
    assert "train" not in got["seed1"].state
    for name in ("seed0", "seed2"):
        assert got[name].stage("train")["status"] == "done"
