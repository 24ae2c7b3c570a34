"""The evaluation in micro-batches (`[train] eval_accum_steps`, issue 42): the masked-forwards
program takes the evaluation batch in equal parts, one after another, and gives the whole
batch's figures to float32 reassociation (the same mask draws, the fresh-PGD ascent on the
whole batch's gradient); the default (1) is the program as it was. Also what the fit check
adds for an evaluation (the train state it runs beside) and the step's matmul FLOPs with scans
counted per iteration (`measure.matmul_flops`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_spd_eval import make_cfg, random_ci_fn

from pdctl.config import fingerprint, parse_config
from pdctl.engine import measure
from pdctl.errors import PdctlError
from pdctl.inspect import fit
from pdctl.science.spd import evaluate as E
from pdctl.science.spd.masks import stochastic_masks, window_draw
from pdctl.science.targets import LlamaMLP


def test_a_window_draws_its_rows_of_the_whole_batchs_draw() -> None:
    """`window_draw` gives rows start .. start + n of the draw of the whole batch, bit for bit,
    with a traced start too; so do stochastic masks (and their delta masks)."""
    key = jax.random.key(3)
    ci = {"a": jnp.full((8, 3, 5), 0.25), "b": jnp.full((8, 3, 4), 0.5)}

    @jax.jit
    def draws(start):
        out = {"whole": jax.random.uniform(key, (8, 3, 5))}
        out["none"] = window_draw(jax.random.uniform, key, (8, 3, 5))
        out["part"] = window_draw(jax.random.uniform, key, (2, 3, 5), (start, 8))
        for sampling in ("continuous", "binomial"):
            half = {p: c[4:] for p, c in ci.items()}
            out[sampling] = stochastic_masks(key, ci, sampling, delta=True)
            out[f"{sampling} 4:"] = stochastic_masks(key, half, sampling, True, window=(4, 8))
        return out

    for start in (0, 2, 6):
        got = draws(start)
        assert np.array_equal(got["part"], got["whole"][start : start + 2])
    assert np.array_equal(got["none"], got["whole"])  # no window: the plain draw
    for sampling in ("continuous", "binomial"):
        (masks, dmasks), (m2, d2) = got[sampling], got[f"{sampling} 4:"]
        for p in ci:
            assert np.array_equal(m2[p], masks[p][4:]) and np.array_equal(d2[p], dmasks[p][4:])


def test_eval_accum_steps_defaults_to_one_must_divide_and_is_not_in_the_fingerprint() -> None:
    base = {"schema": 1, "target": {"kind": "llama_mlp"},
            "decomp": {"sites": [{"pattern": "layers.*.mlp.up", "C": 4}]}}  # fmt: skip
    cfg = parse_config(base)
    assert cfg.train.eval_accum_steps == 1
    parts = parse_config({**base, "train": {"eval_batch_size": 16, "eval_accum_steps": 4}})
    # how the evaluation runs, not what it computes: a run is not stale across it
    assert fingerprint(parts, "train") == fingerprint(
        parse_config({**base, "train": {"eval_batch_size": 16}}), "train"
    )
    with pytest.raises(PdctlError) as e:
        parse_config({**base, "train": {"eval_batch_size": 16, "eval_accum_steps": 3}})
    assert str(e.value) == ("train.eval_accum_steps: 3 does not divide train.eval_batch_size 16")


@pytest.mark.slow  # five compiles of the evaluation program: ~125 s on the loaded 2 cores
def test_the_evaluation_in_micro_batches_gives_the_whole_batchs_figures() -> None:
    """2 and 4 micro-batches against the whole batch: CE and KL of every masking (stochastic,
    random and fresh-PGD included) agree to float32 reassociation; binomial sampling's CI
    noise and per-example PGD sources too."""
    target = LlamaMLP(vocab_size=16, d_model=8, n_layers=2, n_heads=2, d_mlp=16, seq_len=6)
    params = jax.jit(target.init)(jax.random.PRNGKey(0))
    w = target.site_weights(params)
    sites = ("layers.0.mlp.up", "layers.1.mlp.down")
    rng = np.random.default_rng(1)
    comps = {
        p: {"V": jnp.asarray(rng.normal(size=(w[p].shape[0], 8)) / 3, jnp.float32),
            "U": jnp.asarray(rng.normal(size=(8, w[p].shape[1])) / 3, jnp.float32)}
        for p in sites
    }  # fmt: skip
    ci_fns = {sites[0]: random_ci_fn(1, 8, 8, (4,)), sites[1]: random_ci_fn(2, 16, 8, (4,))}
    tokens = jnp.asarray(rng.integers(0, 16, size=(8, 7)), jnp.int32)
    cases = (("continuous", "shared", (2, 4)), ("binomial", "per_example", (4,)))
    for sampling, scope, parts in cases:
        outs = {}
        for k in (1, *parts):
            cfg = make_cfg("llama_mlp", [{"pattern": "layers.*.mlp.*", "C": 8}], sampling=sampling)
            pgd = cfg.train.eval_pgd.model_copy(update={"scope": scope, "n_steps": 3})
            tc = cfg.train.model_copy(update={"eval_accum_steps": k, "eval_pgd": pgd})
            cfg = cfg.model_copy(update={"train": tc})
            outs[k] = E.lm_eval(target, params, comps, ci_fns, cfg, {"tokens": tokens},
                                jax.random.PRNGKey(3))  # fmt: skip
        whole = outs[1]
        assert set(whole) >= {"kl/pgd", "kl/stoch_masked", "kl/random_masked", "ce/target"}
        for k in parts:
            assert set(outs[k]) == set(whole)
            for name, v in whole.items():
                if name.startswith(("ce/", "kl/")):
                    assert outs[k][name] == pytest.approx(v, rel=2e-6, abs=1e-9), (k, name)


def test_an_evaluation_runs_beside_the_train_state_it_does_not_take() -> None:
    rows = [
        {"kind": "target", "bytes_per_device": 1},
        {"kind": "components", "bytes_per_device": 10},
        {"kind": "ci_fns", "bytes_per_device": 100},
        {"kind": "optimizer", "bytes_per_device": 1000},
        {"kind": "sources", "bytes_per_device": 10000},
        {"kind": "loop", "bytes_per_device": 100000},
        {"kind": "batch", "bytes_per_device": 1000000},
    ]
    assert fit.held_during_eval(rows) == 1111000


def test_matmul_flops_count_a_scans_body_once_per_iteration() -> None:
    def f(x, w):
        y, _ = jax.lax.scan(lambda c, wi: (jnp.tanh(c @ wi), None), x, w)
        return y.sum()

    x, w = jnp.ones((64, 32)), jnp.ones((10, 32, 32))
    one = 2 * 64 * 32 * 32
    assert measure.matmul_flops(jax.make_jaxpr(f)(x, w)) == 10 * one
    # the backward: dx and dw of each of the 10 products
    assert measure.matmul_flops(jax.make_jaxpr(jax.grad(f, argnums=1))(x, w)) == 30 * one
    # rematerialised: the forward again in the backward
    remat = jax.grad(lambda x, w: jax.checkpoint(f)(x, w), argnums=1)
    assert measure.matmul_flops(jax.make_jaxpr(remat)(x, w)) == 40 * one
    a, b = jnp.ones((3, 5, 7)), jnp.ones((3, 7, 2))
    batched = jax.make_jaxpr(lambda a, b: jnp.einsum("bij,bjk->bik", a, b))(a, b)
    assert measure.matmul_flops(batched) == 2 * 3 * 5 * 7 * 2
