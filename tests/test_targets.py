"""Targets: the site interface, overrides, data generators, init, and that the toys train."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdctl.science.targets import TMS, LlamaMLP, ResidMLP, Target, build_target

TARGETS = {
    "tms": lambda: TMS(),
    "tms_untied_hidden": lambda: TMS(n_features=6, n_hidden=3, n_hidden_layers=2, tied_weights=False),
    "resid_mlp": lambda: ResidMLP(n_features=12, d_embed=16, d_mlp=6, n_layers=2),
    "llama": lambda: LlamaMLP(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_mlp=24, seq_len=8),
    "llama_glu_untied": lambda: LlamaMLP(
        vocab_size=32, d_model=16, n_layers=1, n_heads=4, d_mlp=24, seq_len=8, glu=True,
        tied_embeddings=False,
    ),
}  # fmt: skip


def _dense_inputs(target: Target, key: jax.Array) -> jax.Array:
    """Inputs with every feature/token position populated, so any site change shows."""
    if isinstance(target, LlamaMLP):
        return jax.random.randint(key, (3, target.seq_len), 0, target.vocab_size)
    return jax.random.uniform(key, (7, target.n_features), minval=0.1, maxval=1.0)


def _batch(target: Target, key: jax.Array) -> dict[str, jax.Array]:
    if isinstance(target, LlamaMLP):
        return {"tokens": jax.random.randint(key, (3, target.seq_len + 1), 0, target.vocab_size)}
    return target.make_batch(key, 64)


@pytest.fixture(params=list(TARGETS))
def target(request) -> Target:
    return TARGETS[request.param]()


def test_site_interface(target: Target):
    params = target.init(jax.random.key(0))
    weights = target.site_weights(params)
    assert list(weights) == target.site_paths() == list(target.site_shapes())
    for path, w in weights.items():
        assert w.shape == target.site_shapes()[path], path
        assert w.dtype == jnp.float32
    x = _dense_inputs(target, jax.random.key(1))
    out = jax.jit(target.apply)(params, x)
    if target.output_kind == "logits":
        assert out.shape == (*x.shape, target.vocab_size)
    else:
        assert out.shape == x.shape
    assert out.dtype == jnp.float32
    mask = target.trainable_mask(params)
    assert jax.tree.structure(mask) == jax.tree.structure(params)
    assert target.flops_per_example() > 0
    assert target.kind in {"tms", "resid_mlp", "llama_mlp"}


def test_identity_override_is_exact_and_zero_override_changes_output(target: Target):
    params = target.init(jax.random.key(0))
    x = _dense_inputs(target, jax.random.key(1))
    weights = target.site_weights(params)
    same = {path: (lambda x_in, w=w: x_in @ w) for path, w in weights.items()}

    def run(overrides):
        return jax.jit(lambda p, x: target.apply(p, x, overrides))(params, x)

    ref = run(None)
    np.testing.assert_array_equal(run(same), ref)
    np.testing.assert_array_equal(target.apply(params, x, same), target.apply(params, x))
    for path, (_, d_out) in target.site_shapes().items():
        zero = {path: lambda x_in, d_out=d_out: jnp.zeros((*x_in.shape[:-1], d_out), x_in.dtype)}
        assert not np.allclose(run(zero), ref), f"zeroing {path} left the output unchanged"


def test_loss_is_finite_and_differentiable(target: Target):
    params = target.init(jax.random.key(0))
    batch = _batch(target, jax.random.key(1))
    (loss, aux), grads = jax.jit(jax.value_and_grad(target.loss, has_aux=True))(params, batch)
    assert loss.shape == () and loss.dtype == jnp.float32 and np.isfinite(loss)
    assert all(np.isfinite(v) and v.shape == () for v in aux.values())
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))
    assert target.inputs(batch).shape[0] == next(iter(batch.values())).shape[0]


def test_strict_promotion_and_bfloat16(target: Target):
    # Other modules may run under strict numerics; the targets must not rely on implicit
    # dtype or rank promotion, and a bf16 model must still give float32 outputs and losses.
    bf16 = type(target)(**{**_fields(target), "param_dtype": jnp.bfloat16})
    params = bf16.init(jax.random.key(0))
    assert all(leaf.dtype == jnp.bfloat16 for leaf in jax.tree.leaves(params))
    batch = _batch(bf16, jax.random.key(1))
    with jax.numpy_dtype_promotion("strict"), jax.numpy_rank_promotion("raise"):
        loss, _ = jax.jit(bf16.loss)(params, batch)
        f32 = target.init(jax.random.key(0))
        jax.jit(jax.grad(lambda p: target.loss(p, batch)[0]))(f32)
    assert loss.dtype == jnp.float32 and np.isfinite(loss)


def _fields(target: Target) -> dict:
    import dataclasses

    return {f.name: getattr(target, f.name) for f in dataclasses.fields(target)}


def test_build_target():
    t = build_target("tms", n_features=40, n_hidden=10)
    assert isinstance(t, TMS) and t.site_shapes()["linear1"] == (40, 10)
    assert isinstance(build_target("resid_mlp"), ResidMLP)
    assert isinstance(build_target("llama_mlp", glu=True), LlamaMLP)
    with pytest.raises(ValueError, match="unknown target kind"):
        build_target("mlp")
    with pytest.raises(TypeError):
        build_target("tms", n_feature=3)
    with pytest.raises(ValueError, match="heads"):
        LlamaMLP(d_model=30, n_heads=4)


# TMS


def test_tms_tied_and_untied():
    tied = TMS()
    p = tied.init(jax.random.key(0))
    assert set(p) == {"linear1", "linear2"} and set(p["linear2"]) == {"b"}
    w = tied.site_weights(p)
    np.testing.assert_array_equal(w["linear2"], p["linear1"]["W"].T)
    assert w["linear1"].shape == (5, 2) and w["linear2"].shape == (2, 5)

    untied = TMS(tied_weights=False)
    p = untied.init(jax.random.key(0))
    assert p["linear2"]["W"].shape == (2, 5)
    np.testing.assert_array_equal(untied.site_weights(p)["linear2"], p["linear2"]["W"])

    no_bias = TMS(bias=False)
    assert "linear2" not in no_bias.init(jax.random.key(0))


def test_tms_identity_hidden_layers_are_frozen_and_transparent():
    deep, flat = TMS(n_hidden_layers=2), TMS()
    p_deep = deep.init(jax.random.key(3))
    assert deep.site_paths() == ["linear1", "hidden_layers.0", "hidden_layers.1", "linear2"]
    for i in ("0", "1"):
        np.testing.assert_array_equal(p_deep["hidden_layers"][i]["W"], np.eye(2))
    mask = deep.trainable_mask(p_deep)
    assert mask["hidden_layers"] == {"0": {"W": False}, "1": {"W": False}}
    assert mask["linear1"]["W"] and mask["linear2"]["b"]
    p_flat = {k: v for k, v in p_deep.items() if k != "hidden_layers"}
    x = _dense_inputs(flat, jax.random.key(4))
    np.testing.assert_allclose(deep.apply(p_deep, x), flat.apply(p_flat, x), rtol=1e-6)


def test_tms_make_batch_deterministic_and_sparse():
    t = TMS(n_features=5, feature_probability=0.05)
    a, b = t.make_batch(jax.random.key(7), 20_000), t.make_batch(jax.random.key(7), 20_000)
    np.testing.assert_array_equal(a["x"], b["x"])
    assert not np.array_equal(a["x"], t.make_batch(jax.random.key(8), 20_000)["x"])
    x = np.asarray(a["x"])
    assert x.shape == (20_000, 5) and x.dtype == np.float32
    assert 0.0 <= x.min() and x.max() <= 1.0
    # 100k Bernoulli(0.05) draws: std of the active fraction is ~7e-4.
    assert abs(np.mean(x > 0) - 0.05) < 0.004
    np.testing.assert_array_equal(a["y"], a["x"])
    assert t.inputs(a) is a["x"]


def test_tms_5_2_pretrains_to_the_pentagon():
    """Adam on TMS 5-2 (p=0.05, batch 1024, lr 1e-2) reaches the pentagon within 600 steps.

    Threshold: the best symmetric pentagon (row norm 1.13, bias -0.25) has MSE 0.00180 on this
    data; each feature the model leaves unrepresented costs p * E[U^2] / n_features = 0.0033 on
    its own, so MSE < 0.0025 holds only when all five features are represented. With our
    zero-bias init 32/32 seeds got there in 500 steps (median eval MSE 0.00178); the zero model
    sits at p / 3 = 0.0167. Four seeds are trained at once with vmap.
    """
    t, steps, batch_size = TMS(), 600, 1024
    tx = optax.adam(1e-2)

    def train(seed):
        params = t.init(jax.random.key(seed))

        def step(carry, key):
            params, opt = carry
            (loss, _), grads = jax.value_and_grad(t.loss, has_aux=True)(
                params, t.make_batch(key, batch_size)
            )
            updates, opt = tx.update(grads, opt, params)
            return (optax.apply_updates(params, updates), opt), loss

        keys = jax.random.split(jax.random.key(seed + 100), steps)
        (params, _), losses = jax.lax.scan(step, (params, tx.init(params)), keys)
        eval_loss, _ = t.loss(params, t.make_batch(jax.random.key(10_000 + seed), 65_536))
        return params, losses, eval_loss

    params, losses, eval_loss = jax.jit(jax.vmap(train))(jnp.arange(4))
    losses, eval_loss = np.asarray(losses), np.asarray(eval_loss)
    assert np.all(losses[:, -50:].mean(1) < 0.3 * losses[:, :10].mean(1))
    assert np.all(eval_loss < 0.0025), eval_loss
    norms = np.linalg.norm(np.asarray(params["linear1"]["W"]), axis=-1)
    assert np.all(norms > 0.9), norms


# ResidMLP


def test_resid_mlp_embedding_fixed_unit_norm_and_frozen():
    t = ResidMLP(n_features=12, d_embed=16, d_mlp=6, n_layers=1, embed_seed=3)
    p0, p1 = t.init(jax.random.key(0)), t.init(jax.random.key(1))
    np.testing.assert_allclose(np.linalg.norm(p0["W_E"], axis=-1), 1.0, rtol=1e-6)
    np.testing.assert_array_equal(p0["W_E"], p1["W_E"])
    assert not np.array_equal(
        p0["layers"]["0"]["mlp_in"]["W"], p1["layers"]["0"]["mlp_in"]["W"]
    )
    other_seed = ResidMLP(n_features=12, d_embed=16, d_mlp=6, embed_seed=4)
    assert not np.array_equal(p0["W_E"], other_seed.init(jax.random.key(0))["W_E"])
    mask = t.trainable_mask(p0)
    assert mask["W_E"] is False
    assert all(jax.tree.leaves(mask["layers"]))
    assert "b" not in ResidMLP(n_features=4, d_embed=8, d_mlp=2, bias=False).init(
        jax.random.key(0)
    )["layers"]["0"]["mlp_in"]


def test_resid_mlp_make_batch():
    t = ResidMLP(n_features=50, d_embed=16, d_mlp=6, feature_probability=0.02)
    batch = t.make_batch(jax.random.key(0), 10_000)
    np.testing.assert_array_equal(batch["x"], t.make_batch(jax.random.key(0), 10_000)["x"])
    x, y = np.asarray(batch["x"]), np.asarray(batch["y"])
    assert -1.0 <= x.min() < 0 < x.max() <= 1.0
    assert abs(np.mean(x != 0) - 0.02) < 0.002
    np.testing.assert_array_equal(y, x + np.maximum(x, 0))


def test_resid_mlp_trains():
    t = ResidMLP(n_features=20, d_embed=40, d_mlp=10, feature_probability=0.05)
    params = t.init(jax.random.key(0))
    tx = optax.masked(optax.adam(3e-3), t.trainable_mask(params))

    @jax.jit
    def run(params):
        def step(carry, key):
            params, opt = carry
            (loss, _), g = jax.value_and_grad(t.loss, has_aux=True)(params, t.make_batch(key, 256))
            updates, opt = tx.update(g, opt, params)
            return (optax.apply_updates(params, updates), opt), loss

        return jax.lax.scan(step, (params, tx.init(params)), jax.random.split(jax.random.key(1), 300))

    (trained, _), losses = run(params)
    np.testing.assert_array_equal(trained["W_E"], params["W_E"])
    assert losses[-20:].mean() < 0.7 * losses[:20].mean()


# LlamaMLP


def test_llama_loss_at_init_is_log_vocab():
    t = LlamaMLP(d_model=32, n_layers=1, n_heads=2, d_mlp=64, seq_len=16)
    params = t.init(jax.random.key(0))
    tokens = jax.random.randint(jax.random.key(1), (4, 17), 0, t.vocab_size)
    loss, aux = jax.jit(t.loss)(params, {"tokens": tokens})
    assert abs(float(loss) - math.log(256)) < 0.1
    assert set(aux) == {"ce", "accuracy"} and 0 <= aux["accuracy"] <= 1
    np.testing.assert_array_equal(t.inputs({"tokens": tokens}), tokens[:, :-1])
    assert t.n_tokens_per_example() == 16
    with pytest.raises(TypeError):
        t.make_batch(jax.random.key(0), 4)


def test_llama_params_layout_and_causality():
    t = TARGETS["llama_glu_untied"]()
    params = t.init(jax.random.key(0))
    layer = params["layers"]["0"]
    assert layer["mlp"]["gate"].shape == layer["mlp"]["up"].shape == (16, 24)
    assert layer["mlp"]["down"].shape == (24, 16)
    assert params["unembed"].shape == (16, 32)
    np.testing.assert_array_equal(layer["attn_norm"], np.ones(16))
    assert t.site_paths()[4:] == ["layers.0.mlp.gate", "layers.0.mlp.up", "layers.0.mlp.down"]
    tokens = _dense_inputs(t, jax.random.key(1))
    changed = tokens.at[:, -1].set((tokens[:, -1] + 1) % t.vocab_size)
    apply = jax.jit(t.apply)
    np.testing.assert_allclose(apply(params, tokens)[:, :-1], apply(params, changed)[:, :-1])
    assert not np.allclose(apply(params, tokens)[:, -1], apply(params, changed)[:, -1])
