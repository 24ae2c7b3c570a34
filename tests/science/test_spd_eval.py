"""SPD evaluation: CI error matching, MMCS / ML2R, L0 / alive, toy and LM evals."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdctl.config import parse_config
from pdctl.science.spd import components as comp_mod
from pdctl.science.spd import evaluate as E
from pdctl.science.targets import TMS, LlamaMLP


def make_cfg(target: str, sites: list[dict], **decomp):
    return parse_config(
        {"schema": 1, "target": {"kind": target}, "decomp": {"sites": sites, **decomp}}
    )


def random_ci_fn(seed: int, d_in: int, C: int, hidden: tuple[int, ...]):
    """CI-function weights in the init's layout, drawn with NumPy (no compile per shape)."""
    shapes = jax.eval_shape(lambda k: comp_mod.init_ci_fn(k, "mlp", d_in, C, hidden), KEY)
    rng = np.random.default_rng(seed)
    return jax.tree.map(
        lambda a: jnp.asarray(
            rng.normal(size=a.shape) / np.sqrt(a.shape[-2] if a.ndim > 2 else 1), jnp.float32
        ),
        shapes,
    )


KEY = jax.random.PRNGKey(0)

# ---------------------------------------------------------------------------------------------
# CI error


def test_ci_errors_identity_and_permutations():
    assert E.ci_errors(np.eye(5)) == 0
    padded = np.zeros((5, 20))
    padded[np.arange(5), [7, 3, 19, 0, 11]] = 1.0  # a permuted identity inside C = 20
    assert E.ci_errors(padded) == 0
    near = padded * 0.95
    near[near == 0] = 0.05  # within tolerance everywhere
    assert E.ci_errors(near) == 0


def test_ci_errors_count_extra_and_missing_entries():
    m = np.eye(5, 8)
    m[2, 6] = 0.5  # an extra active entry
    assert E.ci_errors(m) == 1
    m[0, 0] = 0.6  # a matched entry below 1 - tol
    assert E.ci_errors(m) == 2
    # one component for two features: one of them is matched elsewhere (to a 0), so it counts
    # once as an unmatched active entry and once as a matched entry below 0.9
    shared = np.zeros((2, 3))
    shared[:, 0] = 1.0
    assert E.ci_errors(shared) == 2
    assert E.ci_errors(np.eye(3) * 0.85, tol=0.2) == 0
    assert E.ci_errors(np.eye(3) * 0.85, tol=0.1) == 3


def test_dense_ci_errors():
    dense = np.zeros((6, 10))
    dense[:, [1, 4, 7]] = 1.0
    assert E.dense_ci_errors(dense, k=3) == 0
    assert E.dense_ci_errors(dense, k=4) == 1  # a 4th column has no strong entry
    dense[2, 9] = 0.5
    assert E.dense_ci_errors(dense, k=3) == 1


# ---------------------------------------------------------------------------------------------
# MMCS / ML2R


def test_mmcs_and_ml2r_exact_components():
    rng = np.random.default_rng(0)
    W = rng.normal(size=(5, 3))
    # per row: component i = e_i (x) W[i, :], plus unused random components
    V = np.concatenate([np.eye(5), rng.normal(size=(5, 4))], axis=1)
    U = np.concatenate([W, rng.normal(size=(4, 3)) * 0.01], axis=0)
    mmcs, ml2r = E.mmcs_and_ml2r(W, V, U, per="in")
    assert mmcs == pytest.approx(1.0, abs=1e-9) and ml2r == pytest.approx(1.0, abs=1e-9)
    # per column: component j = W[:, j] (x) e_j
    mmcs, ml2r = E.mmcs_and_ml2r(W, W, np.eye(3), per="out")
    assert mmcs == pytest.approx(1.0, abs=1e-9) and ml2r == pytest.approx(1.0, abs=1e-9)
    # half-size components keep the direction and halve the ratio
    mmcs, ml2r = E.mmcs_and_ml2r(W, np.eye(5), W / 2, per="in")
    assert mmcs == pytest.approx(1.0) and ml2r == pytest.approx(0.5)
    # the cosine is signed: sign-flipped components (-1) lose to the other, empty rows (0)
    mmcs, _ = E.mmcs_and_ml2r(W, -np.eye(5), W, per="in")
    assert mmcs == pytest.approx(0.0)
    with pytest.raises(ValueError):
        E.mmcs_and_ml2r(W, W, np.eye(3), per="diag")


# ---------------------------------------------------------------------------------------------
# L0 and alive


def test_l0_and_alive():
    ci = {
        "a": jnp.array([[0.0, 0.5, 0.2], [0.05, 0.95, 0.0]]),
        "b": jnp.array([[[0.2, 0.0], [0.0, 0.0]]]),
    }
    from pdctl.science.spd.losses import l0_per_site

    l0 = l0_per_site(ci, 0.1)
    assert float(l0["a"]) == pytest.approx(1.5)
    assert float(l0["b"]) == pytest.approx(0.5)
    alive = E.alive(ci, 0.1)
    np.testing.assert_array_equal(np.asarray(alive["a"]), [False, True, True])
    np.testing.assert_array_equal(np.asarray(alive["b"]), [True, False])


# ---------------------------------------------------------------------------------------------
# toy evals on TMS 5-2


@functools.cache
def _tms_exact():
    """TMS 5-2 with C = 5 components that reproduce each site exactly, one per feature."""
    target = TMS(n_features=5, n_hidden=2)
    params = jax.jit(target.init)(jax.random.PRNGKey(0))
    w = target.site_weights(params)
    comps = {
        "linear1": {"V": jnp.eye(5), "U": w["linear1"]},
        "linear2": {"V": w["linear2"], "U": jnp.eye(5)},
    }
    ci_fns = {
        "linear1": random_ci_fn(1, 5, 5, (16,)),
        "linear2": random_ci_fn(2, 2, 5, (16,)),
    }
    cfg = make_cfg("tms", [{"pattern": "linear*", "C": 5}])
    return target, params, comps, ci_fns, cfg


def test_toy_ci_matrix_and_toy_eval_on_tms():
    target, params, comps, ci_fns, cfg = _tms_exact()
    m = E.toy_ci_matrix(target, params, comps, ci_fns, cfg, "linear1")
    assert m.shape == (5, 5) and m.min() >= 0 and m.max() <= 1
    mats = E.toy_ci_matrices(target, params, comps, ci_fns, cfg)
    np.testing.assert_allclose(mats["linear1"], m, rtol=1e-6)
    # the matrix is the CI of one-hot inputs of magnitude 0.75 through the target
    x = 0.75 * jnp.eye(5)
    h = x @ comps["linear1"]["V"]
    from pdctl.science.spd.ci import ci_fn_apply

    z = ci_fn_apply("mlp", ci_fns["linear1"], x, h)
    np.testing.assert_allclose(m, np.clip(np.asarray(z), 0, 1), rtol=1e-5, atol=1e-6)
    out = E.toy_eval(target, params, comps, ci_fns, cfg)
    assert set(out) == {
        "recovered",
        "ci_error/linear1",
        "ci_error/linear2",
        "ci_error/total",
        "mmcs/linear1",
        "mmcs/linear2",
        "ml2r/linear1",
        "ml2r/linear2",
    }
    assert out["ci_error/total"] == out["ci_error/linear1"] + out["ci_error/linear2"]
    for site in ("linear1", "linear2"):
        assert out[f"mmcs/{site}"] == pytest.approx(1.0, abs=1e-6)
        assert out[f"ml2r/{site}"] == pytest.approx(1.0, abs=1e-6)


def test_ci_stats_on_tms_batch():
    """L0 and alive counts on a batch whose CI is known by hand.

    linear1: V = I, so component c sees h_c = x_c, and the CI function 4 gelu(h) - 0.5 gives
    ci 1 at h = 0.75 and 0 at h = 0 (see `_tms_id_perfect`): the CI is the batch's feature
    mask. linear2: CI functions with zero weights and output biases (2, -1, 2, -1, -1): ci
    (1, 0, 1, 0, 0) on every row, whatever the input."""
    target, params, comps, _, _ = _tms_exact()
    mask = np.array(
        [[1, 0, 1, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 0, 0], [1, 0, 0, 1, 0]], np.float32
    )  # features 0, 2, 3 active somewhere (1 and 4 never); 2, 1, 0, 2 active per row
    linear2 = _ci_mlp(0.0, 0.0, 0.0, 0.0, 5)
    linear2["1"]["b"] = jnp.array([[2.0], [-1.0], [2.0], [-1.0], [-1.0]])
    ci_fns = {"linear1": _ci_mlp(1.0, 0.0, 4.0, -0.5, 5), "linear2": linear2}
    cfg = make_cfg("tms", [{"pattern": "linear*", "C": 5}], ci_fn={"type": "mlp", "hidden": [1]})
    stats = E.ci_stats(target, params, comps, ci_fns, cfg, jnp.asarray(0.75 * mask))
    assert stats == {
        "l0/linear1": pytest.approx(5 / 4),  # mean active components per row
        "alive/linear1": 3.0,  # components active on at least one row
        "alive_mean/linear1": 3.0,  # mean CI over the rows 1/2, 0, 1/2, 1/4, 0: three > 1e-6
        "l0/linear2": pytest.approx(2.0),
        "alive/linear2": 2.0,
        "alive_mean/linear2": 2.0,
    }
    # mean CI, not any CI above decomp.ci_threshold: a component at CI 0.05 on one row of
    # four is alive by its mean (0.0125 > 1e-6) though never above the threshold 0.1
    ci = {"s": jnp.asarray([[0.05, 0.0], [0.0, 0.0], [0.0, 0.0], [0.0, 1e-6]], jnp.float32)}
    assert np.asarray(E.alive_by_mean(ci, E.ALIVE_MEAN_THRESHOLD)["s"]).tolist() == [True, False]
    assert np.asarray(E.alive(ci, 0.1)["s"]).tolist() == [False, False]


# ---------------------------------------------------------------------------------------------
# ground truth: a hand-built perfect decomposition of TMS 5-2 with one identity hidden layer


def _gelu(a: float) -> float:
    from scipy.special import erf

    return 0.5 * a * (1 + erf(a / np.sqrt(2)))


def _ci_mlp(w0: float, b0: float, w1: float, b1: float, C: int):
    """C identical `mlp` CI functions 1 -> 1 -> 1: z(h) = w1 * gelu(w0 * h + b0) + b1."""
    return {
        "0": {"W": jnp.full((C, 1, 1), w0), "b": jnp.full((C, 1), b0)},
        "1": {"W": jnp.full((C, 1, 1), w1), "b": jnp.full((C, 1), b1)},
    }


@functools.cache
def _tms_id_perfect():
    """TMS 5-2-id whose W1 is an exact unit pentagon (row i = (cos 2 pi i/5, sin 2 pi i/5)).

    - linear1: C = 5, V = I, U = W1 (so V U = W1); h_c = (x V)_c = x_c, i.e. 0.75 on the active
      feature's component and 0 elsewhere. CI z = 4 gelu(h) - 0.5: z(0.75) = 4 * 0.5798 - 0.5
      = 1.82 -> ci 1; z(0) = -0.5 -> ci 0. The identity pattern exactly.
    - hidden_layers.0 (the fixed 2 x 2 identity): C = 2, V = U = I; a constant CI (output bias
      2, weights 0) -> ci 1 for every feature on both components: the dense pattern with k = 2
      (scored as an identity it would count 8 errors: the old scoring's mistake).
    - linear2 = W1.T, tied: V = U1.T = W1.T, U = V1.T = I; h_c = 0.75 W1[i] . W1[c] =
      0.75 cos(2 pi (i - c) / 5) in {0.75, 0.232, -0.607}. CI z = gelu(10 h - 5) - 0.2:
      z(0.75) = gelu(2.5) - 0.2 = 2.284 -> 1; z(0.232) = gelu(-2.68) - 0.2 = -0.210 -> 0;
      z(-0.607) -> gelu(-11.1) - 0.2 = -0.2 -> 0. The identity pattern exactly.
    """
    target = TMS(n_features=5, n_hidden=2, n_hidden_layers=1)
    angles = 2 * np.pi * np.arange(5) / 5
    W1 = np.stack([np.cos(angles), np.sin(angles)], axis=1).astype(np.float32)
    params = {
        "linear1": {"W": jnp.asarray(W1)},
        "hidden_layers": {"0": {"W": jnp.eye(2)}},
        "linear2": {"b": jnp.zeros(5)},
    }
    comps = {
        "linear1": {"V": jnp.eye(5), "U": jnp.asarray(W1)},
        "hidden_layers.0": {"V": jnp.eye(2), "U": jnp.eye(2)},
        "linear2": {"V": jnp.asarray(W1.T), "U": jnp.eye(5)},
    }
    ci_fns = {
        "linear1": _ci_mlp(1.0, 0.0, 4.0, -0.5, 5),
        "hidden_layers.0": _ci_mlp(0.0, 0.0, 0.0, 2.0, 2),
        "linear2": _ci_mlp(10.0, -5.0, 1.0, -0.2, 5),
    }
    sites = [{"pattern": "linear*", "C": 5}, {"pattern": "hidden_layers.0", "C": 2}]
    cfg = parse_config(
        {
            "schema": 1,
            "target": {"kind": "tms", "n_hidden_layers": 1},
            "decomp": {"sites": sites, "ci_fn": {"type": "mlp", "hidden": [1]}},
        }
    )
    return target, params, comps, ci_fns, cfg


def test_hand_built_perfect_tms_id_decomposition_scores_zero_ci_errors():
    assert _gelu(2.5) - 0.2 > 1 and _gelu(10 * 0.75 * np.cos(0.4 * np.pi) - 5) - 0.2 < 0
    target, params, comps, ci_fns, cfg = _tms_id_perfect()
    assert E.toy_patterns(target, list(comps)) == {
        "linear1": ("identity", 5),
        "hidden_layers.0": ("dense", 2),
        "linear2": ("identity", 5),
    }
    mats = E.toy_ci_matrices(target, params, comps, ci_fns, cfg)
    np.testing.assert_array_equal(mats["linear1"], np.eye(5))
    np.testing.assert_array_equal(mats["hidden_layers.0"], np.ones((5, 2)))
    np.testing.assert_array_equal(mats["linear2"], np.eye(5))
    out = E.toy_eval(target, params, comps, ci_fns, cfg)
    assert out["ci_error/total"] == 0 and out["recovered"] == 5
    for site in ("linear1", "linear2"):
        assert out[f"mmcs/{site}"] == pytest.approx(1.0, abs=1e-6)
    # scored as an identity, the dense hidden block is 5 rows x 2 columns of ones: the
    # Hungarian match uses 2 entries (both 1, fine) and the other 8 ones are off the match
    assert E.ci_errors(mats["hidden_layers.0"]) == 8


def test_recovered_counts_only_identity_sites_and_a_broken_feature_is_not_recovered():
    patterns = {"a": ("identity", 3), "d": ("dense", 2)}
    good = np.eye(3)
    broken = np.eye(3)
    broken[1, 2] = 0.5  # feature 1 also lights component 2
    dense = np.ones((3, 2))
    assert E.recovered_features({"a": good, "d": dense}, patterns) == 3
    assert E.recovered_features({"a": broken, "d": dense}, patterns) == 2


def test_a_non_finite_ci_matrix_scores_nan_not_a_crash():
    m = np.eye(4)
    m[1, 1] = np.nan
    assert np.isnan(E.pattern_errors(m, ("identity", 4)))
    assert np.isnan(E.pattern_errors(m, ("dense", 2)))
    assert E.pattern_errors(np.eye(4), ("identity", 4)) == 0


# ---------------------------------------------------------------------------------------------
# LM eval


@pytest.mark.slow
def test_lm_eval_with_exact_components():
    target = LlamaMLP(vocab_size=16, d_model=8, n_layers=1, n_heads=2, d_mlp=16, seq_len=6)
    params = jax.jit(target.init)(jax.random.PRNGKey(0))
    w = target.site_weights(params)
    sites = ("layers.0.mlp.up", "layers.0.mlp.down")
    # V = I, U = W: V @ U == W exactly, so the unmasked model (no delta) is the target
    comps = {p: {"V": jnp.eye(w[p].shape[0]), "U": w[p]} for p in sites}
    ci_fns = {
        "layers.0.mlp.up": random_ci_fn(1, 8, 8, (4,)),
        "layers.0.mlp.down": random_ci_fn(2, 16, 16, (4,)),
    }
    cfg = make_cfg("llama_mlp", [{"pattern": "layers.*.mlp.*", "C": 8}])
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 16, size=(4, 7)), jnp.int32)
    out = E.lm_eval(target, params, comps, ci_fns, cfg, {"tokens": tokens}, jax.random.PRNGKey(3))
    kinds = (*E.LM_MASKINGS, "zero_masked")
    assert kinds == (
        "ci_masked",
        "stoch_masked",
        "random_masked",
        "rounded_masked",
        "unmasked",
        "zero_masked",
    )  # the reference's CEandKLLosses variants
    expected = {"ce/target"} | {f"{m}/{k}" for m in ("ce", "kl") for k in kinds}
    expected |= {f"{m}/{k}" for m in ("ce_difference", "ce_unrecovered") for k in kinds[:-1]}
    # + the fresh-PGD masking ([train.eval_pgd], on by default)
    expected |= {f"{m}/pgd" for m in ("ce", "kl", "ce_difference", "ce_unrecovered")}
    assert set(out) == expected
    assert all(np.isfinite(v) for v in out.values())
    assert out["kl/unmasked"] == pytest.approx(0.0, abs=1e-6)
    assert out["ce/unmasked"] == pytest.approx(out["ce/target"], abs=1e-5)
    assert out["ce_difference/unmasked"] == pytest.approx(0.0, abs=1e-5)
    assert out["kl/zero_masked"] > 0
    for k in kinds:
        assert out[f"kl/{k}"] >= -1e-6
    ref_ce = float(jax.jit(target.loss)(params, {"tokens": tokens})[0])
    assert out["ce/target"] == pytest.approx(ref_ce, rel=1e-5)
    # 20 sign-ascent steps from the sources that 0 steps scores: the KL went up; the other
    # maskings' draws do not depend on the PGD (its own fold of the key)
    cfg0 = cfg.model_copy(update={"train": cfg.train.model_copy(
        update={"eval_pgd": cfg.train.eval_pgd.model_copy(update={"n_steps": 0})})})  # fmt: skip
    out0 = E.lm_eval(target, params, comps, ci_fns, cfg0, {"tokens": tokens}, jax.random.PRNGKey(3))
    assert out["kl/pgd"] > out0["kl/pgd"] > 0
    assert all(out0[k] == out[k] for k in out if not k.endswith("/pgd"))


# ---------------------------------------------------------------------------------------------
# fresh-PGD evaluation


class _Logits:
    """logits = x @ W at one site "w": a stand-in target for `losses.Recon`."""

    def site_paths(self):
        return ["w"]

    def site_weights(self, params):
        return {"w": params["w"]}

    def apply(self, params, x, overrides=None):
        return overrides["w"](x) if overrides else x @ params["w"]


def _rank_one_recon(ci: float, delta: bool = False):
    """One site, one component that IS the weight (V U = W), CI `ci` everywhere, no delta
    component: the masked logits are m z, z = x W, m = ci + (1 - ci) s for the one shared
    source s."""
    from pdctl.science.spd.losses import Recon

    rng = np.random.default_rng(0)
    V = jnp.asarray(rng.normal(size=(6, 1)), jnp.float32)
    U = jnp.asarray(rng.normal(size=(1, 9)), jnp.float32)
    x = jnp.asarray(rng.normal(size=(4, 3, 6)), jnp.float32)  # (batch, positions, d_in)
    W = V @ U
    clean = x @ W
    recon = Recon(_Logits(), {"w": W}, {}, {"w": {"V": V, "U": U}}, x, clean, delta, "kl",
                  order=("w",))  # fmt: skip
    return recon, {"w": jnp.full((4, 3, 1), ci, jnp.float32)}, np.asarray(clean, np.float64)


def _kl(z: np.ndarray, m: float) -> float:
    def logsm(a):
        return (
            a
            - np.log(np.sum(np.exp(a - a.max(-1, keepdims=True)), -1, keepdims=True))
            - (a.max(-1, keepdims=True))
        )

    lp, lq = logsm(z), logsm(m * z)
    return float(np.mean(np.sum(np.exp(lp) * (lp - lq), -1)))


def test_fresh_pgd_ascends_the_kl_in_closed_form():
    """d KL(softmax(z) || softmax(s z)) / ds = E_{softmax(s z)}[z] - E_{softmax(z)}[z] < 0 for
    s < 1 (the mean of z under softmax(s z) grows with s): every sign step lowers the shared
    source by step_size until 0, and the evaluation's
    KL is the closed form at the final source. 0 steps: the KL at the random sources; more
    steps: never below it."""
    from pdctl.science.spd.losses import ppgd_recon_loss

    recon, ci, z = _rank_one_recon(0.0)
    key = jax.random.PRNGKey(5)
    with_delta, _, _ = _rank_one_recon(0.0, delta=True)
    shape = E.fresh_pgd_sources(with_delta, ci, key, E.FreshPgd(n_steps=0))["w"].shape
    assert shape == (2,)  # + the delta component's source
    init = np.asarray(E.fresh_pgd_sources(recon, ci, key, E.FreshPgd(n_steps=0))["w"])
    assert init.shape == (1,)  # one component, one source for all examples and positions
    s0 = np.float32(init[0])
    kls = []
    for n in (0, 1, 3, 20):
        pgd = E.FreshPgd(n_steps=n, step_size=0.1)
        srcs = jax.jit(lambda c, pgd=pgd: E.fresh_pgd_sources(recon, c, key, pgd))(ci)
        want = s0
        for _ in range(n):  # the ascent, as float32 arithmetic does it
            want = np.clip(want - np.float32(0.1), 0, 1)
        got = np.asarray(srcs["w"])
        assert got[0] == want, (n, got, want)
        kl = float(ppgd_recon_loss(recon, ci, srcs))
        assert kl == pytest.approx(_kl(z, float(want)), rel=1e-5)
        kls.append(kl)
    assert kls[0] == pytest.approx(_kl(z, float(s0)), rel=1e-5)
    assert kls == sorted(kls) and kls[-1] > kls[0]  # ascent: 0 <= 1 <= 3 <= 20 steps
    assert kls[-1] == pytest.approx(_kl(z, 0.0), rel=1e-5)  # at s = 0: the zero-masked KL
    # CI 1 pins the mask to 1 whatever the source: nothing to ascend, KL 0
    recon, ci1, _ = _rank_one_recon(1.0)
    srcs = E.fresh_pgd_sources(recon, ci1, key, E.FreshPgd(n_steps=3))
    assert float(ppgd_recon_loss(recon, ci1, srcs)) == pytest.approx(0.0, abs=1e-7)
