"""Capacity features: gradient accumulation, rematerialisation, the precision policy.

All at the step-function level on one simulated CPU device, tiny shapes.
"""

from __future__ import annotations

import tomllib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdctl.config import parse_config
from pdctl.engine import sharding
from pdctl.engine.precision import Policy
from pdctl.science.spd import components as C
from pdctl.stages import pretrain as PT
from pdctl.stages import train as TR
from pdctl.stages.decomposition import decomposed_sites, source_shape
from pdctl.stages.inputs import target_from_config, with_remat
from pdctl.templates import templates_root

MESH1 = None


def mesh1():
    global MESH1
    if MESH1 is None:
        MESH1 = sharding.make_mesh(1, 1, jax.devices()[:1])
    return MESH1


def template(name: str, **tables) -> dict:
    raw = tomllib.loads((templates_root() / name / "pdctl.toml").read_text())
    for key, upd in tables.items():
        table = raw
        *parents, last = key.split(".")
        for p in parents:
            table = table.setdefault(p, {})
        table.setdefault(last, {}).update(upd)
    return raw


TINY_LM = {
    "target": {"d_model": 32, "d_mlp": 64, "n_layers": 2, "n_heads": 2},
    "data": {"seq_len": 16},
}


def spd_setup(cfg):
    """Target params, SPD fns and the train stage's program with a fresh state, without a run
    directory."""
    t = target_from_config(cfg)
    fns = TR.spd_fns(cfg, t)
    comps, ci, src = C.init_decomposition_reference(
        jax.random.PRNGKey(0),
        decomposed_sites(cfg, t),
        cfg.decomp.ci_fn.type,
        tuple(cfg.decomp.ci_fn.hidden),
        lambda c: source_shape(cfg, c),
    )
    free = {p: v for p, v in comps.items() if p not in fns.ties}
    tp = t.init(jax.random.PRNGKey(1))
    prog = TR.program(cfg, mesh1(), t)
    return t, fns, prog, tp, prog.jit_make_state()(free, ci, src)


def spd_step(cfg):
    t, _, prog, tp, state = spd_setup(cfg)
    batch = None
    if t.output_kind == "logits":
        shape = (cfg.train.batch_size, cfg.data.seq_len + 1)
        batch = {"tokens": jax.random.randint(jax.random.PRNGKey(3), shape, 0, 256)}
    return prog.jit(donate=False)(tp, state, batch)


@pytest.mark.slow  # ~8-14 s; the pretrain accumulation test and the next one stay fast
def test_train_grad_accumulation_equals_big_batch():
    # Deterministic terms only (no mask sampling), so k micro-batches and one batch see the same
    # computation; beta > 0 makes importance minimality non-linear in the batch sums, which is
    # exactly where per-micro-batch sums would differ from the whole batch's.
    losses = {
        "stochastic_recon": 0.0,
        "stochastic_recon_layerwise": 0.0,
        "ci_masked_recon": 1.0,
        "beta": 0.5,
    }
    out = {}
    for k in (1, 4):
        cfg = parse_config(
            template(
                "tms", **{"train": {"batch_size": 64, "grad_accum_steps": k}, "train.loss": losses}
            )
        )
        out[k] = spd_step(cfg)
    (s1, m1), (s4, m4) = out[1], out[4]
    # Tolerance: the same sums in another order (4 partial sums of 16 instead of one of 64).
    for key in ("loss", "importance_minimality", "ci_masked_recon", "grad_norm"):
        np.testing.assert_allclose(m4[key], m1[key], rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(s1["trainable"]), jax.tree.leaves(s4["trainable"]), strict=True
    ):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)
    # One optimizer update per step whatever k is: the Adam count moved by exactly one.
    counts = [x for x in jax.tree.leaves(s4["opt_state"]) if x.dtype == jnp.int32]
    assert counts and all(int(c) == 1 for c in counts)


def test_accumulation_forms_the_faithfulness_term_once_a_step():
    """W - V U has no batch in it: with accumulation it is formed once per step, not once per
    micro-batch (on a TPU at six bf16 passes per product, it was most of an accumulated
    step's matmul time). The step's matmul FLOPs (scans per iteration) at 4 micro-batches are
    those at 2; 2 against 1 adds the importance sums' forward-only pass."""
    from pdctl.engine.measure import matmul_flops

    flops = {}
    for k in (1, 2, 4):
        cfg = parse_config(template("tms", **{"train": {"batch_size": 64, "grad_accum_steps": k}}))
        prog = spd_setup(cfg)[2]
        step = jax.make_jaxpr(prog.policy.scoped(prog.step))(*prog.abstract_args())
        flops[k] = matmul_flops(step)
    assert flops[4] == flops[2] > flops[1], flops


def test_train_grad_accumulation_without_batch_sums_differs():
    """The gate can fail: summing importance minimality per micro-batch (beta > 0) is wrong."""
    from pdctl.science.spd.losses import importance_minimality_loss

    ci = {"s": jax.random.uniform(jax.random.PRNGKey(0), (64, 5))}
    whole = importance_minimality_loss(ci, 1.0, 1e-12, 0.5)
    parts = [importance_minimality_loss({"s": ci["s"][i::4]}, 1.0, 1e-12, 0.5) for i in range(4)]
    assert abs(float(np.mean(parts)) - float(whole)) > 1e-3


def test_pretrain_grad_accumulation_equals_big_batch():
    raw = template(
        "resid-mlp",
        target={"n_features": 16, "d_embed": 32, "d_mlp": 8},
        pretrain={"batch_size": 64},
    )
    out = {}
    for k in (1, 4):
        raw["pretrain"]["grad_accum_steps"] = k
        cfg = parse_config(raw)
        t = target_from_config(cfg)
        prog = PT.program(cfg, mesh1(), t, steps=10)
        state = prog.jit_make_state()(t.init(jax.random.PRNGKey(0)))
        out[k] = prog.jit(donate=False)(state, None)
    (s1, m1), (s4, m4) = out[1], out[4]
    np.testing.assert_allclose(m4["loss"], m1["loss"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1["params"]), jax.tree.leaves(s4["params"]), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("policy", [pytest.param("dots_saveable", marks=pytest.mark.slow), "full"])
def test_remat_gives_equal_gradients(policy):
    cfg = parse_config(template("llama-mlp", **TINY_LM))
    t = target_from_config(cfg)
    params = t.init(jax.random.PRNGKey(0))
    batch = {"tokens": jax.random.randint(jax.random.PRNGKey(1), (4, 17), 0, 256)}

    def grads(target):
        return jax.jit(jax.grad(lambda p: target.loss(p, batch)[0]))(params)

    g0, g1 = grads(t), grads(with_remat(t, policy))
    # Recomputation may fuse differently: equal within float32 rounding, not bit for bit.
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7)


@pytest.mark.slow  # ~30 s; test_remat_gives_equal_gradients keeps remat in the fast tier
def test_remat_in_spd_train_step_equal_losses():
    base = template("llama-mlp", **TINY_LM, train={"batch_size": 4})
    base["train"]["loss"]["ppgd_recon"] = 0.0
    (s0, m0) = spd_step(parse_config(base))
    base["train"]["remat"] = "full"
    (s1, m1) = spd_step(parse_config(base))
    np.testing.assert_allclose(m1["loss"], m0["loss"], rtol=1e-5)
    for a, b in zip(
        jax.tree.leaves(s0["trainable"]), jax.tree.leaves(s1["trainable"]), strict=True
    ):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)


# bfloat16 has 8 mantissa bits (relative rounding 2^-8 ≈ 0.4%); after a few layers of matmuls
# a relative loss change of a few percent is expected. Stated tolerance: 5%.
BF16_RTOL = 0.05


@pytest.mark.slow  # 12-35 s per target (two SPD train steps each, per-site reference init)
@pytest.mark.parametrize("name", ["tms", "resid-mlp", "llama-mlp"])
def test_bfloat16_compute_changes_loss_little(name):
    extra = (
        TINY_LM
        if name == "llama-mlp"
        else (
            {"target": {"n_features": 16, "d_embed": 32, "d_mlp": 8}} if name == "resid-mlp" else {}
        )
    )
    losses = {}
    for compute in ("float32", "bfloat16"):
        raw = template(name, **extra, precision={"compute_dtype": compute})
        raw["train"]["batch_size"] = 64 if name != "llama-mlp" else 4
        raw["train"]["loss"]["ppgd_recon"] = 0.0
        cfg = parse_config(raw)
        _, m = spd_step(cfg)
        t = target_from_config(cfg)
        params = t.init(jax.random.PRNGKey(0))
        if name == "llama-mlp":
            batch = {"tokens": jax.random.randint(jax.random.PRNGKey(1), (4, 17), 0, 256)}
        else:
            batch = t.make_batch(jax.random.PRNGKey(1), 256)
        policy = Policy.from_config(cfg.precision)
        pre = jax.jit(lambda p, b, t=t, pol=policy: t.loss(pol.to_compute(p), pol.to_compute(b))[0])
        losses[compute] = (float(pre(params, batch)), float(m["loss"]))
    for f32, bf16 in zip(losses["float32"], losses["bfloat16"], strict=True):
        assert np.isfinite(bf16)
        assert abs(bf16 - f32) <= BF16_RTOL * abs(f32) + 1e-6, losses
    assert losses["float32"] != losses["bfloat16"]  # the policy really changed the compute


@pytest.mark.slow  # ~20-35 s: two tiny-LM train steps with two ascent steps each
def test_ppgd_warmup_ascent_accumulates_per_batch_sources():
    # Per-batch PPGD sources are sized by the micro-batch; the warm-up ascent must run on the
    # micro-batches as the loss does (it used to take the whole batch and fail at trace time).
    # Two identical halves accumulated over k = 2 must give what one half gives at k = 1.
    # Deterministic terms only, and no importance minimality (its log term sees the batch sums).
    losses = {
        "ppgd_recon": 1.0,
        "stochastic_recon": 0.0,
        "stochastic_recon_layerwise": 0.0,
        "importance_minimality": 0.0,
    }
    half = jax.random.randint(jax.random.PRNGKey(3), (4, TINY_LM["data"]["seq_len"] + 1), 0, 256)
    out = {}
    for k, tokens in ((1, half), (2, jnp.concatenate([half, half]))):
        raw = template(
            "llama-mlp",
            **TINY_LM,
            train={"batch_size": 4 * k, "grad_accum_steps": k},
            **{"train.loss": losses, "train.ppgd": {"scope": "per_batch_per_position",
                                                   "n_warmup_steps": 2}},
        )  # fmt: skip
        _, _, prog, tp, state = spd_setup(parse_config(raw))
        out[k] = prog.jit(donate=False)(tp, state, {"tokens": tokens})
    (s1, m1), (s2, m2) = out[1], out[2]
    assert float(s2["src_opt"]["count"]) == float(s1["src_opt"]["count"]) == 3
    # Tolerance: the micro-batch program computes the same rows in a batch of another size
    # (XLA may tile the dots differently); the mean of two equal gradients is exact. Sources:
    # three Adam ascent steps (lr 0.01) divide by sqrt(v), so where a gradient element is tiny
    # a last-bit difference in it moves a source by more (seen: up to 2.2e-5 on one of 8256);
    # a gradient routed to the wrong source would move it by ~lr.
    np.testing.assert_allclose(m2["ppgd_recon"], m1["ppgd_recon"], rtol=1e-5)
    for a, b in zip(jax.tree.leaves(s1["sources"]), jax.tree.leaves(s2["sources"]), strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-4)
    for a, b in zip(
        jax.tree.leaves(s1["trainable"]), jax.tree.leaves(s2["trainable"]), strict=True
    ):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6)
