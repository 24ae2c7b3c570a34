"""SPD against the reference's behaviour (goodfire-ai/spd), not against pdctl's own formulas.

Each value below is worked out by hand in the comments, from the reference's definitions: the
mask formulas, importance minimality, the KL and faithfulness terms, the CI-error counts, the
schedule, the routing probabilities, the source optimizer. Then the two places where pdctl's
step must do what the reference's loop does: the PPGD order (loss with the previous step's
sources, then ONE ascent step from that same term's gradient) and the tied TMS components (one
parameter set; each tied site keeps its own Adam moments and both updates land on it, as two
torch Parameters sharing storage do).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdctl.config import parse_config
from pdctl.engine import sharding
from pdctl.engine.optim import schedule
from pdctl.science.spd import components as comp_mod
from pdctl.science.spd import evaluate as E
from pdctl.science.spd import losses as L
from pdctl.science.spd import masks as M
from pdctl.science.spd import sources as S
from pdctl.science.spd.ci import compute_ci
from pdctl.stages import train, warmup
from pdctl.stages.decomposition import site_layout
from pdctl.stages.env import StageEnv
from pdctl.stages.inputs import target_from_config


def f32(a) -> jax.Array:
    return jnp.asarray(np.asarray(a, np.float32))


# ---------------------------------------------------------------------------------------------
# values by hand


def test_mask_values_by_hand():
    # stochastic: m = ci + (1 - ci) r. ci = 0.25, r = 0.5 -> 0.25 + 0.75 * 0.5 = 0.625; ci = 1
    # -> 1 whatever r; ci = 0 -> r.
    ci = f32([[0.25, 1.0, 0.0]])
    r = f32([[0.5, 0.3, 0.7]])
    np.testing.assert_allclose(np.asarray(ci + (1 - ci) * r), [[0.625, 1.0, 0.7]], rtol=1e-7)
    # adversarial: the reference's own example (`_interpolate_component_mask`): ci 0.2, source
    # 0.8 -> 0.2 + 0.8 * 0.8 = 0.84. The source's last entry (0.3) is the delta mask, as is.
    masks, delta = M.source_masks({"a": f32([[0.2, 0.5]])}, {"a": f32([0.8, 0.0, 0.3])}, True)
    np.testing.assert_allclose(np.asarray(masks["a"]), [[0.84, 0.5]], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(delta["a"]), [0.3])
    # per-example sources (B, C+1) line up with ci's batch axis
    per_ex = {"a": f32([[1.0, 0.0, 0.5], [0.0, 1.0, 0.25]])}
    masks, delta = M.source_masks({"a": f32([[0.5, 0.5], [0.5, 0.5]])}, per_ex, True)
    np.testing.assert_allclose(np.asarray(masks["a"]), [[1.0, 0.5], [0.5, 1.0]])
    np.testing.assert_allclose(np.asarray(delta["a"]), [0.5, 0.25])


def test_importance_minimality_by_hand():
    # ci_upper over a batch of 2 examples, 2 components; eps = 0.
    # p = 1: S = (0.5 + 1, 0 + 0.25) = (1.5, 0.25); m = S / 2 = (0.75, 0.125); loss 0.875.
    # beta = 1 adds sum m log2(1 + S) = 0.75 log2 2.5 + 0.125 log2 1.25
    #   = 0.75 * 1.3219281 + 0.125 * 0.3219281 = 0.9914461 + 0.0402410 = 1.0316871 -> 1.9066871.
    # p = 2: S = (0.25 + 1, 0.0625) = (1.25, 0.0625); m = (0.625, 0.03125); loss 0.65625.
    ci = {"s": f32([[0.5, 0.0], [1.0, 0.25]])}
    assert float(L.importance_minimality_loss(ci, 1.0, 0.0, 0.0)) == pytest.approx(0.875)
    assert float(L.importance_minimality_loss(ci, 1.0, 0.0, 1.0)) == pytest.approx(1.9066871)
    assert float(L.importance_minimality_loss(ci, 2.0, 0.0, 0.0)) == pytest.approx(0.65625)


def test_faithfulness_and_kl_by_hand():
    # W = I (2x2), V U = [[1], [0]] [[1, 1]] = [[1, 1], [0, 0]]; W - V U = [[0, -1], [0, 1]]:
    # squared norm 2 over 4 entries = 0.5.
    got = L.faithfulness_loss({"s": jnp.eye(2)}, {"s": {"V": f32([[1], [0]]), "U": f32([[1, 1]])}})
    assert float(got) == pytest.approx(0.5)
    # KL(target || masked): target logits (0, ln 3) -> p = (1/4, 3/4); masked (0, 0) -> q = (1/2,
    # 1/2). KL = 1/4 ln(1/2) + 3/4 ln(3/2) = -0.1732868 + 0.3040988 = 0.1308120.
    kl = L.kl_distance(f32([[0.0, 0.0]]), f32([[0.0, math.log(3.0)]]))
    assert float(kl) == pytest.approx(0.1308120, rel=1e-6)


def test_ci_errors_by_hand():
    # Identity: features match the diagonal (0.95, 0.85, 0.91). 0.85 < 1 - 0.1 is one error;
    # the unmatched 0.2 > 0.1 is another; 0.05 is within tolerance. Total 2.
    m = np.array([[0.95, 0.05, 0.0, 0.0], [0.2, 0.85, 0.0, 0.0], [0.0, 0.0, 0.91, 0.0]])
    assert E.ci_errors(m) == 2
    # The same with the columns permuted: the Hungarian match finds the same diagonal.
    assert E.ci_errors(m[:, [2, 0, 3, 1]]) == 2
    # Dense, k = 2: columns sorted by mass -> (col 1: 1 + 1 + 0.95, col 0: 0.92 + 0.5 + 0,
    # col 2: 0.3). Col 1 has a strong entry; col 0 has 0.92 >= 0.9: fine; the third column
    # holds 0.3 > 0.1: one error. Total 1.
    d = np.array([[0.92, 1.0, 0.0], [0.5, 1.0, 0.3], [0.0, 0.95, 0.0]])
    assert E.dense_ci_errors(d, k=2) == 1
    assert E.pattern_errors(d, ("dense", 2)) == 1


def test_schedule_by_hand():
    # The reference's get_scheduled_value, cosine over 5 steps from 1e-3 to 0: progress =
    # step / (5 - 1); step 2 -> 1e-3 * 0.5 * (1 + cos(pi / 2)) = 5e-4; step 4 -> 0.
    cos = schedule(
        SimpleNamespace(lr=1e-3, schedule="cosine", warmup_frac=0.0, final_lr_frac=0.0), 5
    )
    np.testing.assert_allclose(
        [float(cos(s)) for s in range(5)],
        [1e-3, 8.535534e-4, 5e-4, 1.464466e-4, 0.0],
        rtol=1e-5,
        atol=1e-9,
    )
    # warmup_frac 0.4 of 5 steps: int(2.0) = 2 warmup steps, lr = 1e-3 * step / 2 (0, 5e-4);
    # then linear decay over 3 steps to 0.1 * 1e-3: progress (step - 2) / 2 -> 1e-3, 5.5e-4,
    # 1e-4.
    lin = schedule(
        SimpleNamespace(lr=1e-3, schedule="linear", warmup_frac=0.4, final_lr_frac=0.1), 5
    )
    np.testing.assert_allclose(
        [float(lin(s)) for s in range(5)], [0.0, 5e-4, 1e-3, 5.5e-4, 1e-4], rtol=1e-6, atol=1e-10
    )


def test_source_adam_first_step_by_hand():
    # First Adam step: m_hat = g, v_hat = g^2, so the step is lr * g / (|g| + eps): +0.01 for
    # g = 2 (0.3 -> 0.31), -0.01 for g = -0.5 (0.5 -> 0.49); 1.0 + 0.01 is clipped to 1.
    src = {"a": f32([0.3, 0.5, 1.0])}
    new, opt = S.ascent_step(
        src, {"a": f32([2.0, -0.5, 1.0])}, S.init_opt(src, "adam"), optimizer="adam", lr=0.01
    )
    np.testing.assert_allclose(np.asarray(new["a"]), [0.31, 0.49, 1.0], rtol=1e-6)
    assert float(opt["count"]) == 1


def test_binomial_sampling_moves_the_lower_leaky_input():
    # The reference's binomial sampling feeds 1.05 z - 0.05 u (u ~ U[0,1)) to the lower-leaky
    # squashing: z = 0.5 -> [0.475, 0.525]; z = 1 -> [1.0, 1.05] -> clipped to 1; z = 0.02 ->
    # [-0.029, 0.021] -> [0, 0.021]. The upper-leaky one still sees z.
    z = f32([[0.5, 1.0, 0.02]] * 4000)
    kind_params = {"0": {"W": jnp.ones((3, 1, 1)), "b": jnp.zeros((3, 1))}}
    comps = {"s": {"V": jnp.eye(3), "U": jnp.eye(3)}}
    lo, up = compute_ci(
        comps,
        {"s": kind_params},
        {"s": z},
        "mlp",
        "leaky_hard",
        "none",
        "binomial",
        jax.random.PRNGKey(0),
    )
    lo, up = np.asarray(lo["s"]), np.asarray(up["s"])
    assert lo[:, 0].min() >= 0.475 and lo[:, 0].max() <= 0.525 and lo[:, 0].std() > 0.01
    np.testing.assert_array_equal(lo[:, 1], 1.0)
    assert lo[:, 2].min() == 0.0 and lo[:, 2].max() <= 0.021
    np.testing.assert_allclose(up, np.asarray(z), rtol=1e-7)
    lo_c, _ = compute_ci(comps, {"s": kind_params}, {"s": z}, "mlp", "leaky_hard")
    np.testing.assert_array_equal(np.asarray(lo_c["s"]), np.asarray(z))


def test_routing_probabilities_by_hand():
    # uniform_k over n = 3 sites: k ~ U{1, 2, 3}, then k random sites, so each count of routed
    # sites has probability 1/3 and each site is routed with probability E[k] / n = 2/3.
    # static_p: each site independently with probability p.
    key = jax.random.PRNGKey(0)
    paths = ("a", "b", "c")
    routes = M.routing_masks(key, paths, (30000,), "uniform_k")
    stack = np.stack([np.asarray(routes[p]) for p in paths])
    counts = np.bincount(stack.sum(0), minlength=4) / stack.shape[1]
    np.testing.assert_allclose(counts, [0, 1 / 3, 1 / 3, 1 / 3], atol=0.015)
    np.testing.assert_allclose(stack.mean(1), [2 / 3] * 3, atol=0.015)
    static = M.routing_masks(key, paths, (30000,), "static_p", 0.25)
    np.testing.assert_allclose(
        [np.asarray(static[p]).mean() for p in paths], [0.25] * 3, atol=0.015
    )
    assert M.routing_masks(key, paths, (4,), "all") is None


def test_a_routed_out_site_keeps_the_target_weight():
    # y = x @ W at routed-out positions, the masked components elsewhere: with V = 0 (so the
    # components give 0 and no delta) the output is 0 where routed, x @ W where not.
    W = f32([[1.0, 2.0], [3.0, 4.0]])
    fn = comp_mod.masked_site_fn(
        W, jnp.zeros((2, 3)), jnp.zeros((3, 2)), jnp.ones((2, 3)), None, jnp.array([True, False])
    )
    out = fn(f32([[1.0, 1.0], [1.0, 0.0]]))
    np.testing.assert_allclose(np.asarray(out), [[0.0, 0.0], [1.0, 2.0]])


# ---------------------------------------------------------------------------------------------
# tied components


def test_fold_is_the_transpose_of_expand():
    # <expand(a), b> = <a, fold(b)> for every a, b: fold is expand's adjoint, so folding
    # per-site gradients gives the gradient of the one parameter set.
    rng = np.random.default_rng(0)
    ties, paths = {"t": "s"}, ("s", "t")
    a = {"s": {"V": f32(rng.normal(size=(5, 3))), "U": f32(rng.normal(size=(3, 2)))}}
    b = {
        p: {"V": f32(rng.normal(size=s[0])), "U": f32(rng.normal(size=s[1]))}
        for p, s in {"s": ((5, 3), (3, 2)), "t": ((2, 3), (3, 5))}.items()
    }
    ea = comp_mod.expand_tied(a, ties, paths)
    np.testing.assert_array_equal(np.asarray(ea["t"]["V"]), np.asarray(a["s"]["U"]).T)
    np.testing.assert_array_equal(np.asarray(ea["t"]["U"]), np.asarray(a["s"]["V"]).T)

    def dot(x, y):
        return sum(
            float(jnp.vdot(u, v))
            for u, v in zip(jax.tree.leaves(x), jax.tree.leaves(y), strict=True)
        )

    assert dot(ea, b) == pytest.approx(dot(a, comp_mod.fold_tied(b, ties)), rel=1e-6)


def _cfg(**train):
    return parse_config(
        {
            "schema": 1,
            "target": {"kind": "tms"},
            "decomp": {"sites": [{"pattern": "linear*", "C": 4}], "ci_fn": {"hidden": [4]}},
            "warmup": {"steps": 3, "lr": 0.01, "weight_decay": 0.1},
            "train": {"steps": 10, "batch_size": 64, **train},
        }
    )


def _env(cfg):
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    return StageEnv(SimpleNamespace(config=cfg), "train", mesh, target_from_config(cfg))


def _decomposition(cfg, target):
    sites = {p: (*target.site_shapes()[p], 4) for p in target.site_paths()}
    return comp_mod.init_decomposition_reference(
        jax.random.PRNGKey(1), sites, "mlp", [4], lambda c: (c + 1,)
    )


@pytest.mark.slow
def test_tied_warmup_equals_two_torch_parameters_sharing_storage():
    """The reference ties linear2's components by making them views of linear1's storage
    (`tgt.U.data = src.V.data.T`), so AdamW holds two moment sets and both steps land on the
    shared storage. Simulated here in NumPy for 3 faithfulness-warmup steps (torch's AdamW:
    decay p by lr * wd, then the bias-corrected Adam step), against pdctl's warmup step."""
    cfg = _cfg()
    env = _env(cfg)
    target = env.target
    params = jax.jit(target.init)(jax.random.PRNGKey(0))
    comps, _, _ = _decomposition(cfg, target)
    free = {"linear1": comps["linear1"]}
    paths, ties = site_layout(cfg, target)
    assert ties == {"linear2": "linear1"} and paths == ("linear1", "linear2")
    prog = warmup.program(cfg, env.mesh, target)
    state = prog.make_state(free)
    # one parameter set, two moment sets
    assert set(state["components"]) == {"linear1"}
    moments = [x for x in jax.tree.leaves(state["opt_state"]) if x.ndim == 2]
    assert len(moments) == 2 * 4  # mu and nu for V and U of both sites
    step = prog.jit(donate=False)
    for _ in range(3):
        state, _ = step(params, state, None)

    W = np.asarray(params["linear1"]["W"], np.float64)
    V, U = (np.asarray(free["linear1"][k], np.float64) for k in ("V", "U"))
    n = 2 * W.size  # faithfulness: both sites' squared errors over both sites' entries
    adam: dict[str, list[np.ndarray]] = {}
    lr, wd, b1, b2, eps = 0.01, 0.1, 0.9, 0.999, 1e-8
    for t in range(1, 4):
        R = W - V @ U  # linear2's residual is R.T (W2 = W.T, V2 U2 = U.T V.T)
        g = {"1V": -2 * R @ U.T / n, "1U": -2 * V.T @ R / n}
        g["2V"], g["2U"] = g["1U"].T, g["1V"].T  # the same numbers, seen through the views
        steps = {}
        for k, gk in g.items():
            m, v = adam.get(k, [np.zeros_like(gk), np.zeros_like(gk)])
            m, v = b1 * m + (1 - b1) * gk, b2 * v + (1 - b2) * gk * gk
            adam[k] = [m, v]
            steps[k] = lr * (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps)
        # both Parameters decay and step the shared storage
        V = V - lr * wd * V - steps["1V"] - lr * wd * V - steps["2U"].T
        U = U - lr * wd * U - steps["1U"] - lr * wd * U - steps["2V"].T
    # Tolerance: float32 vs float64, and torch decays the second view after the first step
    # (an O(lr^2 wd) difference); both far below one Adam step (1e-2).
    np.testing.assert_allclose(np.asarray(state["components"]["linear1"]["V"]), V, atol=2e-6)
    np.testing.assert_allclose(np.asarray(state["components"]["linear1"]["U"]), U, atol=2e-6)


# ---------------------------------------------------------------------------------------------
# the PPGD order inside one train step


def _train_setup(ppgd: dict, loss: dict):
    cfg = _cfg(ppgd=ppgd, loss=loss)
    env = _env(cfg)
    target = env.target
    fns = train.spd_fns(cfg, target)
    comps, ci_fns, sources = _decomposition(cfg, target)
    free = {p: v for p, v in comps.items() if p not in fns.ties}
    prog = train.program(cfg, env.mesh, target)
    state = prog.jit_make_state()(free, ci_fns, sources)
    params = jax.jit(target.init)(jax.random.PRNGKey(0))
    return cfg, target, fns, params, state, prog.jit(donate=False)


@pytest.mark.slow  # each case compiles a whole train step (~10 s)
@pytest.mark.parametrize("optimizer", ["adam", "sign"])
def test_ppgd_loss_uses_the_previous_sources_then_one_ascent_step_from_it(optimizer):
    # ppgd_recon = 0.5 (a power of two: the step's d total / d s / coeff is exact)
    loss = {"ppgd_recon": 0.5, "stochastic_recon": 1.0, "stochastic_recon_layerwise": 0.0}
    cfg, target, fns, params, state, step = _train_setup({"optimizer": optimizer, "lr": 0.05}, loss)
    before = jax.tree.map(np.asarray, jax.device_get(state))
    new, metrics = step(params, state, None)
    # the step's keys and batch, as make_step derives them
    key = jax.random.fold_in(before["loop"]["rng"], 0)
    k_data, k_loss, _ = jax.random.split(key, 3)
    x = target.inputs(target.make_batch(k_data, cfg.train.batch_size))
    clean = fns.clean(params, x)
    comps = fns.expand(before["trainable"]["components"])
    ci_lower, _ = fns.ci(
        comps, before["trainable"]["ci_fns"], clean.site_inputs, fns.ci_key(k_loss)
    )
    term_key = jax.random.fold_in(k_loss, L.TERMS.index("ppgd_recon"))

    def term(s):
        return fns.ppgd_loss(comps, ci_lower, params, s, clean, x, term_key)

    value, g = jax.jit(jax.value_and_grad(term))(before["sources"])
    # the loss of this step used the sources as they were BEFORE it
    assert float(metrics["ppgd_recon"]) == pytest.approx(float(value), rel=1e-6)
    assert float(term(new["sources"])) != pytest.approx(float(value), rel=1e-6)
    # and the new sources are ONE ascent step from the gradient of that same term
    want, want_opt = S.ascent_step(
        before["sources"], g, before["src_opt"], optimizer=optimizer, lr=0.05
    )
    for p in want:
        # Tolerance: the step's gradient comes from the full backward (another XLA program
        # than this test's jax.grad of the term alone): ulp-level differences in g, which Adam
        # normalises away and sign ignores.
        np.testing.assert_allclose(np.asarray(new["sources"][p]), np.asarray(want[p]), atol=1e-6)
    assert float(new["src_opt"]["count"]) == float(want_opt["count"]) == 1


@pytest.mark.slow  # ~10-14 s: a train step with three source steps inside
def test_n_warmup_steps_ascend_every_step_before_the_loss():
    # n_warmup_steps = 2: three source steps per train step (2 before the loss, 1 after), on
    # every step, not only the first.
    loss = {"ppgd_recon": 1.0, "stochastic_recon": 0.0, "stochastic_recon_layerwise": 0.0}
    _, _, _, params, state, step = _train_setup({"n_warmup_steps": 2}, loss)
    state, m1 = step(params, state, None)
    assert float(state["src_opt"]["count"]) == 3
    state, m2 = step(params, state, None)
    assert float(state["src_opt"]["count"]) == 6
    assert np.isfinite(float(m1["ppgd_recon"])) and np.isfinite(float(m2["ppgd_recon"]))


@pytest.mark.slow
def test_tied_train_state_holds_one_parameter_set():
    _, _, fns, params, state, step = _train_setup({}, {})
    assert set(state["trainable"]["components"]) == {"linear1"}
    assert set(state["trainable"]["ci_fns"]) == {"linear1", "linear2"}
    assert set(state["sources"]) == {"linear1", "linear2"}
    new, _ = step(params, state, None)
    # both sites' gradients moved the one parameter set
    assert not np.array_equal(
        np.asarray(new["trainable"]["components"]["linear1"]["V"]),
        np.asarray(state["trainable"]["components"]["linear1"]["V"]),
    )
    per_site = fns.expand(new["trainable"]["components"])
    np.testing.assert_array_equal(
        np.asarray(per_site["linear2"]["U"]), np.asarray(per_site["linear1"]["V"]).T
    )
