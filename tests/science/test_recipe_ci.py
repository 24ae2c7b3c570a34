"""The CI-function / init half of the LM recipe: the lower-leaky clamp for both
squashings, the transformer CI function, the nonlinearity-aligned init, and the CI functions'
own gradient clip. Closed forms first; then numbers from goodfire-ai/spd's torch code, produced
by `tests/science/reference_numbers.py` (which runs that code on the cases built here)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pdctl.science.spd import ci as ci_mod
from pdctl.science.spd import components as comp_mod

# ---------------------------------------------------------------------------------------------
# lower_leaky_hard: the forward clamp for both squashings

Z = [-2.0, -0.5, 0.0, 0.25, 1.0, 1.5, 3.0]
G = [0.7, -0.7, -1.3, 0.4, -0.9, 2.0, -2.0]


def _squash_vjp(sigmoid: str, which: int, g: list[float]) -> tuple[np.ndarray, np.ndarray]:
    out, vjp = jax.vjp(lambda z: ci_mod.squash(z, sigmoid)[which], jnp.asarray(Z, jnp.float32))
    return np.asarray(out), np.asarray(vjp(jnp.asarray(g, jnp.float32))[0])


@pytest.mark.parametrize("which", [0, 1])
def test_lower_leaky_hard_is_the_clamp_with_the_sign_gated_leak_for_both(which):
    # SPEC §4.2 / S6: forward clamp(z, 0, 1); backward g on 0 < z <= 1, 0.01 g on z <= 0 only
    # where g < 0, 0 on z > 1. Both squashings (ci_lower: masks, ci_upper: importance
    # minimality) are that function under `lower_leaky_hard`.
    out, grad = _squash_vjp("lower_leaky_hard", which, G)
    np.testing.assert_array_equal(out, np.clip(Z, 0, 1).astype(np.float32))
    z, g = np.asarray(Z, np.float32), np.asarray(G, np.float32)
    want = np.where(z <= 0, np.where(g < 0, np.float32(0.01) * g, 0), np.where(z <= 1, g, 0))
    np.testing.assert_array_equal(grad, want.astype(np.float32))


def test_leaky_hard_keeps_its_upper_leaky_importance_squashing():
    # the default pair is unchanged: ci_upper = z > 1 ? 1 + 0.01 (z - 1) : clip(z, 0, 1)
    out, _ = _squash_vjp("leaky_hard", 1, G)
    np.testing.assert_allclose(out, [0, 0, 0, 0.25, 1, 1.005, 1.02], rtol=1e-6)
    lo, _ = _squash_vjp("leaky_hard", 0, G)
    np.testing.assert_array_equal(lo, np.clip(Z, 0, 1).astype(np.float32))


# goodfire-ai/spd `spd/models/sigmoids.py` (`SIGMOID_TYPES["lower_leaky_hard"]`) on Z, its
# gradient for the cotangents G and -G (tests/science/reference_numbers.py, spd commit 3f0bb61e).
SPD_LOWER_LEAKY = {
    "out": [0.0, 0.0, 0.0, 0.25, 1.0, 1.0, 1.0],
    1.0: [0.0, -0.007, -0.013, 0.4, -0.9, 0.0, 0.0],
    -1.0: [-0.007, 0.0, 0.0, -0.4, 0.9, 0.0, 0.0],
}


@pytest.mark.parametrize("sign", [1.0, -1.0])
@pytest.mark.parametrize("which", [0, 1])
def test_lower_leaky_hard_matches_the_torch_reference(sign, which):
    out, grad = _squash_vjp("lower_leaky_hard", which, [sign * g for g in G])
    np.testing.assert_array_equal(out, np.float32(SPD_LOWER_LEAKY["out"]))
    # float32 0.01 * g against the reference printed to 6 decimals
    np.testing.assert_allclose(grad, SPD_LOWER_LEAKY[sign], rtol=0, atol=1e-7)


# ---------------------------------------------------------------------------------------------
# the transformer CI function


def transformer_case(n_blocks: int = 1) -> tuple[dict, np.ndarray]:
    """Fixed weights (pdctl's layout) and inputs: d_in 6, d_model 8, 2 heads, ffn 12, C 3,
    batch 2 x 5 positions. Biases non-zero so that every parameter matters."""
    rng = np.random.default_rng(0)
    d_in, d, H, ffn, C = 6, 8, 2, 12, 3

    def w(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    params = {
        "in": {"W": w(d_in, d), "b": w(d, scale=0.1)},
        "blocks": {
            "wq": w(n_blocks, d, H, d // H),
            "wk": w(n_blocks, d, H, d // H),
            "wv": w(n_blocks, d, H, d // H),
            "wo": w(n_blocks, H, d // H, d),
            "w1": w(n_blocks, d, ffn),
            "b1": w(n_blocks, ffn, scale=0.1),
            "w2": w(n_blocks, ffn, d),
            "b2": w(n_blocks, d, scale=0.1),
        },
        "out": {"W": w(d, C), "b": w(C, scale=0.1)},
    }
    x = w(2, 5, d_in, scale=2.0)
    return params, x


def _rms(a):
    return a / np.sqrt(np.mean(a * a, -1, keepdims=True) + np.finfo(np.float32).eps)


def test_transformer_without_blocks_is_an_affine_map_of_the_normalised_input():
    # n_blocks = 0: z = rms(x) W_in + b_in, then W_out + b_out (SPEC §4.6 steps 1, 2, 4)
    params, x = transformer_case(n_blocks=0)
    z = np.asarray(ci_mod.ci_fn_apply("transformer", params, jnp.asarray(x), None))
    x64 = x.astype(np.float64)
    p = jax.tree.map(lambda a: np.asarray(a, np.float64), params)
    want = (_rms(x64) @ p["in"]["W"] + p["in"]["b"]) @ p["out"]["W"] + p["out"]["b"]
    # float32 against float64
    np.testing.assert_allclose(z, want, rtol=1e-5, atol=1e-5)
    # the weightless norm: scaling a position's input changes nothing
    z3 = np.asarray(ci_mod.ci_fn_apply("transformer", params, jnp.asarray(3 * x), None))
    np.testing.assert_allclose(z3, z, rtol=1e-5, atol=1e-5)


def test_transformer_attends_both_ways_and_per_sequence():
    params, x = transformer_case()
    z = np.asarray(ci_mod.ci_fn_apply("transformer", params, jnp.asarray(x), None))
    assert z.shape == (2, 5, 3)
    x2 = x.copy()
    x2[0, -1] += 1.0  # the LAST position of sequence 0
    z2 = np.asarray(ci_mod.ci_fn_apply("transformer", params, jnp.asarray(x2), None))
    assert np.abs(z2[0, 0] - z[0, 0]).max() > 1e-4  # reaches the first position: bidirectional
    np.testing.assert_array_equal(z2[1], z[1])  # never another sequence


# goodfire-ai/spd (branch dev, 2ab728c0) `GlobalSharedTransformerCiFn` with one site, n_layers
# 1, n_heads 2, mlp_hidden_dims [12], loaded with `transformer_case()`'s weights, on its x
# (tests/science/reference_numbers.py). One site makes the reference's "global" CI function the
# per-site one pdctl builds; positions (0, 0), (0, 4), (1, 2).
SPD_TRANSFORMER = [
    [-5.827786, -2.152784, 2.301609],
    [0.162548, -0.90892, 5.08486],
    [-8.36966, -0.909028, -6.202990],
]


def test_transformer_matches_the_torch_reference():
    params, x = transformer_case()
    z = np.asarray(ci_mod.ci_fn_apply("transformer", params, jnp.asarray(x), None))
    got = [z[0, 0], z[0, 4], z[1, 2]]
    # float32 on both sides, different summation orders (sdpa, einsum)
    np.testing.assert_allclose(got, SPD_TRANSFORMER, rtol=1e-4, atol=1e-5)


def test_transformer_init_shapes_statistics_and_bits_under_vmap():
    arch = (32, 4, 2, 64)

    def init(k):
        return comp_mod.init_ci_fn(k, "transformer", 48, 7, arch)

    keys = jax.random.split(jax.random.PRNGKey(3), 2)
    stacked = jax.jit(jax.vmap(init))(keys)
    # the same bits under vmap (what init-weights' grouped init relies on)
    one = jax.jit(init)(keys[1])
    jax.tree.map(lambda s, o: np.testing.assert_array_equal(s[1], o), stacked, one)
    p = one
    b = jax.tree.map(lambda a: a[1], p["blocks"])  # the second block
    assert p["in"]["W"].shape == (48, 32) and p["out"]["W"].shape == (32, 7)
    assert p["blocks"]["wq"].shape == (2, 32, 4, 8) and b["wo"].shape == (4, 8, 32)
    assert b["w1"].shape == (32, 64) and b["w2"].shape == (64, 32)
    # SPEC §4.6 init: N(0, 2/fan_in) in-proj and FFN-in, N(0, 1/fan_in) FFN-out and head,
    # U(+-1/sqrt(d)) attention (variance 1/(3d)), biases zero. Loose: few samples.
    for a, var in [
        (p["in"]["W"], 2 / 48), (b["w1"], 2 / 32), (b["w2"], 1 / 64), (p["out"]["W"], 1 / 32),
        (b["wq"], 1 / 96),
    ]:  # fmt: skip
        assert abs(float(jnp.var(a)) / var - 1) < 0.25
    assert float(jnp.abs(b["wk"]).max()) <= 32**-0.5
    assert all(float(jnp.abs(v).max()) == 0 for v in (p["in"]["b"], b["b1"], b["b2"]))


# ---------------------------------------------------------------------------------------------
# nonlinearity_aligned init


def _w(d_in: int, d_out: int, seed: int = 0) -> jax.Array:
    return jnp.asarray(np.random.default_rng(seed).standard_normal((d_in, d_out)), jnp.float32)


@pytest.mark.parametrize("side", ["in", "out"])
def test_aligned_init_with_C_equal_to_the_neurons_is_exactly_W(side):
    W = _w(6, 10)  # side "out": 10 neurons (up: columns); side "in": 6 (down: rows)
    n = 10 if side == "out" else 6
    c = comp_mod.aligned_site_components(jax.random.PRNGKey(0), W, n, side)
    V, U = np.asarray(c["V"]), np.asarray(c["U"])
    # exact, not within a tolerance: every entry of V U is one product w * 1 plus exact zeros
    np.testing.assert_array_equal(V @ U, np.asarray(W))
    one_neuron = U if side == "out" else V.T  # (C, neurons): component c is neuron c
    np.testing.assert_array_equal(one_neuron, np.eye(n, dtype=np.float32))


@pytest.mark.parametrize("side", ["in", "out"])
def test_aligned_init_above_the_neurons_splits_them_exactly(side):
    W = _w(4, 5)
    n, resid = (5, 4) if side == "out" else (4, 5)
    C = 2 * n + 1  # every neuron twice, one of them three times
    c = comp_mod.aligned_site_components(jax.random.PRNGKey(1), W, C, side)
    V, U = np.asarray(c["V"]), np.asarray(c["U"])
    np.testing.assert_array_equal(V @ U, np.asarray(W))  # the parts sum to W exactly
    unit = U if side == "out" else V.T  # (C, neurons) one-hot: each component's neuron
    assert set(unit.sum(1)) == {1.0}
    per_neuron = unit.sum(0)
    assert sorted(per_neuron) == [2.0] * (n - 1) + [3.0]
    part = V.T if side == "out" else U  # (C, resid): each component's slice of its neuron
    assert ((part != 0).sum(1) >= 1).all()  # none empty
    # a neuron's parts are disjoint: its coordinates are owned once each
    for j in range(n):
        owned = (part[unit[:, j] == 1] != 0).sum(0)
        np.testing.assert_array_equal(owned, np.ones(resid))


@pytest.mark.parametrize("side", ["in", "out"])
def test_aligned_init_below_the_neurons_samples_distinct_ones(side):
    W = _w(6, 9)
    c = comp_mod.aligned_site_components(jax.random.PRNGKey(2), W, 4, side)
    V, U = np.asarray(c["V"]), np.asarray(c["U"])
    unit = U if side == "out" else V.T
    chosen = np.flatnonzero(unit.sum(0))
    assert len(chosen) == 4  # distinct
    W_np = np.asarray(W)
    want = np.zeros_like(W_np)
    if side == "out":
        want[:, chosen] = W_np[:, chosen]
    else:
        want[chosen] = W_np[chosen]
    np.testing.assert_array_equal(V @ U, want)


def test_aligned_grouped_init_is_bit_identical_to_the_per_site_one():
    # engine.init.grouped_init with per-item arrays (the target weights): a real group of 3 up
    # sites and 3 down sites, at 4 simulated devices with fsdp = 4 (V/U sharded), against
    # calling aligned_site_components site by site with the same keys.
    from pdctl.engine import init as engine_init
    from pdctl.engine import sharding

    mesh = sharding.make_mesh(1, 4, jax.devices()[:4])
    spec = lambda path, shape: sharding.spec_for(path, shape, fsdp=4, min_size=16)  # noqa: E731
    names = [f"layers.{i}.mlp.{s}" for i in range(3) for s in ("up", "down")]
    Ws = [_w(8, 16, i) if n.endswith("up") else _w(16, 8, i) for i, n in enumerate(names)]
    Cs = [20 if n.endswith("up") else 12 for n in names]  # up: split, down: sampled
    sides = ["out" if n.endswith("up") else "in" for n in names]
    keys = jax.random.split(jax.random.PRNGKey(5), len(names))

    def one(key, W, C, side, shape):
        return comp_mod.aligned_site_components(key, W, C, side)

    sigs = [(C, s, tuple(W.shape)) for C, s, W in zip(Cs, sides, Ws, strict=True)]
    out, _ = engine_init.grouped_init(one, names, sigs, keys, mesh, spec, arrays=Ws)
    for i, n in enumerate(names):
        ref = jax.jit(one, static_argnums=(2, 3, 4))(keys[i], Ws[i], *sigs[i])
        for k in ("V", "U"):
            np.testing.assert_array_equal(np.asarray(out[n][k]), np.asarray(ref[k]), err_msg=n)
        assert out[n]["V"].sharding.spec == P(None, "fsdp")


# ---------------------------------------------------------------------------------------------
# end to end: a tiny LM with every new option on


@pytest.mark.slow  # the whole pipeline on a tiny LM (compiles): ~30-60 s on 2 cores
def test_pdctl_run_with_aligned_init_no_warmup_transformer_ci_and_clamp(tmp_path, monkeypatch):
    """`pdctl run` on a tiny llama-mlp (GLU) with init = nonlinearity_aligned at C = d_mlp on
    gate/up/down, [warmup] steps = 0, the transformer CI function, sigmoid lower_leaky_hard and
    separate clips (components 0.01, CI functions 1.0): every stage finishes, train's losses
    are finite, and the components train starts from are exactly the target's weights."""
    import json

    from helpers import cli, make_run

    from pdctl.project import Project
    from pdctl.stages.env import StageEnv

    d_mlp = 64
    run = make_run(
        tmp_path,
        "llama-mlp",
        target={"glu": True},
        decomp={
            "init": "nonlinearity_aligned",
            "sigmoid": "lower_leaky_hard",
            "sites": [{"pattern": "layers.*.mlp.*", "C": d_mlp}],
            "ci_fn": {
                "type": "transformer",
                "d_model": 16,
                "n_heads": 2,
                "n_blocks": 1,
                "ffn_hidden": 32,
            },
        },
        warmup={"steps": 0},
        train={
            "steps": 4,
            "batch_size": 8,
            "log_every": 2,
            "eval_every": 4,
            "eval_batch_size": 8,
            "optim": {"grad_clip": 0.01},
            "ci_optim": {"lr": 1e-3, "grad_clip": 1.0},
        },
    )
    monkeypatch.chdir(run)
    result = cli("run")
    assert result.exit_code == 0, (result.output, result.exception)
    assert "nonlinearity-aligned (3 with C = their neurons" in result.output
    for stage in ("init_weights", "pretrain", "warmup", "train"):
        assert Project.load(run / "pdctl.toml").stage(stage)["status"] == "done", stage
    lines = [json.loads(x) for x in (run / "metrics" / "train.jsonl").read_text().splitlines()]
    assert any("total" in m for m in lines)
    assert all(np.isfinite(m["total"]) for m in lines if "total" in m)
    # warmup (0 steps, nothing saved) stands for the aligned components train started from:
    # V U = W bit for bit, from the TRAINED target (pretrain ran after init-weights)
    from pdctl.stages.decomposition import load_decomposition
    from pdctl.stages.env import pretrained_target

    project = Project.load(run / "pdctl.toml")
    assert project.stage("warmup").get("components_from") == "init_weights"
    components = load_decomposition(project, "warmup").components
    with StageEnv.open(project, "report") as env:
        weights = env.target.site_weights(pretrained_target(env))
    for p, c in components.items():
        np.testing.assert_array_equal(
            np.asarray(c["V"]) @ np.asarray(c["U"]), np.asarray(weights[p]), err_msg=p
        )


# ---------------------------------------------------------------------------------------------
# the CI functions' own gradient clip


def test_ci_optim_clips_the_ci_functions_apart_from_the_components():
    """With [train.ci_optim], `train.optimizer` is two AdamW chains, each with its own global-
    norm clip over its own subtree: components at train.optim.grad_clip (0.01, SPEC S19's
    value), CI functions at train.ci_optim.grad_clip (1.0). Two steps of it equal those two
    chains run separately, and differ from one clip over everything (so the test can fail)."""
    import optax

    from pdctl.config import parse_config
    from pdctl.stages import train

    over = {"lr": 1e-2, "schedule": "constant"}
    cfg = parse_config({
        "schema": 1,
        "decomp": {"sites": [{"pattern": "linear1", "C": 2}]},
        "train": {"optim": {**over, "grad_clip": 0.01}, "ci_optim": {**over, "grad_clip": 1.0}},
    })  # fmt: skip
    params = {"components": {"s": {"V": jnp.ones((3, 2))}}, "ci_fns": {"s": {"W": jnp.ones(4)}}}
    rng = np.random.default_rng(0)
    # gradient norms: components 1 then 10 (both clipped), CI 0.3 then 0.6 (neither)
    grads = [
        {
            "components": {"s": {"V": jnp.asarray(rng.standard_normal((3, 2)), jnp.float32)}},
            "ci_fns": {"s": {"W": jnp.asarray(rng.standard_normal(4), jnp.float32)}},
        }
        for _ in range(2)
    ]
    for g, (nc, nf) in zip(grads, [(1.0, 0.3), (10.0, 0.6)], strict=True):
        g["components"] = jax.tree.map(
            lambda a, n=nc: a * n / optax.global_norm(a), g["components"]
        )
        g["ci_fns"] = jax.tree.map(lambda a, n=nf: a * n / optax.global_norm(a), g["ci_fns"])

    def run(tx, part=None):
        p = params if part is None else params[part]
        state = tx.init(p)
        out = []
        for g in grads:
            u, state = tx.update(g if part is None else g[part], state, p)
            out.append(u)
        return out

    got = run(train.optimizer(cfg, 10))

    def chain(clip):
        return optax.chain(optax.clip_by_global_norm(clip), optax.adamw(1e-2, weight_decay=0.0))

    comps, ci = run(chain(0.01), "components"), run(chain(1.0), "ci_fns")
    for step in range(2):
        jax.tree.map(np.testing.assert_array_equal, got[step]["components"], comps[step])
        jax.tree.map(np.testing.assert_array_equal, got[step]["ci_fns"], ci[step])
    joint = run(chain(0.01))  # one clip over both: the CI functions' step changes
    assert not np.allclose(joint[1]["ci_fns"]["s"]["W"], got[1]["ci_fns"]["s"]["W"])


def test_transformer_ci_runs_on_stacked_units_and_sharded_parameters():
    """compute_ci with the transformer: a stacked unit (`scan_layers`' layout: two layers'
    parameters and inputs along a leading axis, vmapped by map_sites) gives each member's
    per-site values, and parameters laid out by the sharding RULES over 4 devices (fsdp = 4)
    give the same again."""
    from pdctl.engine import sharding

    unit = "model.layers.0-1.mlp.down_proj"
    sites = ["model.layers.0.mlp.down_proj", "model.layers.1.mlp.down_proj"]
    params, _ = transformer_case()  # fixed weights (an init would cost its RNG compiles)
    two = jax.tree.map(lambda a: np.stack([a, -0.5 * a]), params)  # layer 1: other weights
    stacked = {
        "ci": {unit: two},
        "comps": {unit: {"V": jnp.zeros((2, 6, 3)), "U": jnp.zeros((2, 3, 5))}},
        "x": {unit: jnp.asarray(np.random.default_rng(0).standard_normal((2, 3, 4, 6)))},
    }
    per_site = {  # the same arrays, one entry per layer
        k: {p: jax.tree.map(lambda a, j=j: a[j], v[unit]) for j, p in enumerate(sites)}
        for k, v in stacked.items()
    }

    def lower(t):
        return ci_mod.compute_ci(t["comps"], t["ci"], t["x"], "transformer", "leaky_hard")[0]

    lo = jax.jit(lower)(per_site)
    lo_s = jax.jit(lower)(stacked)
    for j, p in enumerate(sites):  # the same function vmapped: float reassociation at most
        np.testing.assert_allclose(lo_s[unit][j], lo[p], rtol=1e-5, atol=1e-6)
    mesh = sharding.make_mesh(1, 4, jax.devices()[:4])
    sh = sharding.tree_shardings(per_site["ci"], mesh, min_size=16)
    assert any(s.spec != P() for s in jax.tree.leaves(sh))  # something really is sharded
    lo_sh = jax.jit(lower)({**per_site, "ci": jax.device_put(per_site["ci"], sh)})
    for p in sites:  # sharded contractions sum in another order
        np.testing.assert_allclose(lo_sh[p], lo[p], rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------
# config errors name their key


@pytest.mark.parametrize(
    ("over", "key"),
    [
        ({"decomp": {"ci_fn": {"type": "transformer"}}}, "decomp.ci_fn.type:"),
        (
            {
                "target": {"kind": "llama_mlp"},
                "decomp": {"ci_fn": {"type": "transformer", "d_model": 12, "n_heads": 4}},
            },
            "decomp.ci_fn.n_heads:",
        ),
        ({"decomp": {"init": "aligned"}}, "decomp.init:"),
        ({"decomp": {"sigmoid": "lower_leaky"}}, "decomp.sigmoid:"),
    ],
)
def test_bad_recipe_keys_are_one_line_errors_naming_the_key(over, key):
    from helpers import merge

    from pdctl.config import parse_config
    from pdctl.errors import PdctlError

    raw = merge({"schema": 1, "decomp": {"sites": [{"pattern": "linear1", "C": 4}]}}, over)
    with pytest.raises(PdctlError) as e:
        parse_config(raw)
    assert str(e.value).startswith(key) and "\n" not in str(e.value)


def test_aligned_init_without_mlp_sites_is_refused_before_anything_is_written():
    from pdctl.config import parse_config
    from pdctl.errors import PdctlError
    from pdctl.stages.decomposition import decomposed_sites
    from pdctl.stages.inputs import target_from_config

    cfg = parse_config({
        "schema": 1, "decomp": {"init": "nonlinearity_aligned",
                                "sites": [{"pattern": "linear1", "C": 4}]},
    })  # fmt: skip
    with pytest.raises(PdctlError, match=r"^decomp.init: 'nonlinearity_aligned'.*MLP"):
        decomposed_sites(cfg, target_from_config(cfg))
    llama = parse_config({
        "schema": 1, "target": {"kind": "llama_mlp", "d_model": 8, "d_mlp": 16, "n_layers": 1,
                                "n_heads": 2},
        "decomp": {"init": "nonlinearity_aligned",
                   "sites": [{"pattern": "layers.*.attn.q", "C": 4},
                             {"pattern": "layers.*.mlp.down", "C": 16}]},
    })  # fmt: skip
    assert decomposed_sites(llama, target_from_config(llama))  # one MLP site is enough
