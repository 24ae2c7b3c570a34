"""`[train.ppgd] ascent_examples = "assigned"`: the PPGD warm-up ascents run on the examples
the step's merged term masks by the sources (exactly round(adv_fraction x micro-batch) of
them), instead of on every example of the micro-batch.

What must hold: the default ("all") is untouched (the merged term keeps its Bernoulli draw,
the ascents their objective); with "assigned" the ascent's gradient for the assigned
examples' sources is the all-examples ascent's gradient for them, and 0 for the others; the
merged term of the loss masks by the sources exactly the examples the ascent worked on; a tiny
LM trains with it under accumulation. Bad combinations are one-line config errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_recipe_loss import RECIPE
from test_scale import TINY_LM, spd_setup, template

from pdctl.config import parse_config
from pdctl.errors import PdctlError
from pdctl.science.spd import losses as L
from pdctl.science.spd import masks as M
from pdctl.stages import train as TR


def _cfg(ascent: str, batch: int = 4, accum: int = 1, **ppgd):
    raw = template(
        "llama-mlp",
        **{
            "target": TINY_LM["target"],
            "data": TINY_LM["data"],
            "train": {"batch_size": batch, "steps": 10, "grad_accum_steps": accum},
            "train.loss": RECIPE,
            "train.ppgd": {
                "scope": "per_batch_per_position",
                "n_warmup_steps": 1,
                "ascent_examples": ascent,
                **ppgd,
            },
        },
    )
    raw["train"]["loss"].pop("p_final")  # smooth_l0 anneals gamma instead
    return parse_config(raw)


def test_fixed_assignment_draws_exactly_n():
    for seed in range(5):
        assign, idx = M.fixed_assignment(jax.random.PRNGKey(seed), 8, 3)
        assert int(assign.sum()) == 3 and idx.shape == (3,)
        assert np.array_equal(np.flatnonzero(np.asarray(assign)), np.asarray(idx))


def test_config_errors_name_the_key():
    def err(loss=None, ppgd=None, train=None):
        with pytest.raises(PdctlError) as e:
            parse_config(
                {
                    "schema": 1,
                    "decomp": {"sites": [{"pattern": "linear*", "C": 4}]},
                    "train": {"loss": loss or {}, "ppgd": ppgd or {}, **(train or {})},
                }
            )
        return str(e.value)

    assigned = {"ascent_examples": "assigned"}
    assert err(ppgd=assigned).startswith("train.ppgd.ascent_examples: 'assigned' picks")
    merged = {"merged_recon": 1.0, "stochastic_recon": 0.0, "adv_fraction": 0.5}
    assert "pooled" in err(merged, {**assigned, "scope": "pooled"})
    tiny = {**merged, "adv_fraction": 0.1}
    msg = err(tiny, {**assigned, "scope": "per_batch_per_position"}, {"batch_size": 4})
    assert msg.startswith("train.ppgd.ascent_examples: adv_fraction 0.1 of a micro-batch of 4")


@pytest.mark.slow  # ~10 s: the tiny LM's clean forward, CI and two ascent gradients
def test_the_assigned_ascent_is_the_full_ascent_on_those_examples():
    cfg_all, cfg_asg = _cfg("all"), _cfg("assigned")
    t, fns_all, _, tp, state = spd_setup(cfg_all)
    fns_asg = TR.spd_fns(cfg_asg, t)
    tokens = jax.random.randint(jax.random.PRNGKey(3), (4, cfg_all.data.seq_len + 1), 0, 256)
    x = t.inputs({"tokens": tokens})
    free = state["trainable"]
    comps = fns_all.expand(free["components"])
    sources = state["sources"]
    clean = jax.jit(fns_all.clean)(tp, x)
    k_loss, k_asc = jax.random.PRNGKey(11), jax.random.PRNGKey(12)
    ci_lower, _ = jax.jit(fns_all.ci)(comps, free["ci_fns"], clean.site_inputs, None)

    def grad_of(fns):
        return jax.jit(
            jax.grad(lambda s: fns.ppgd_loss(comps, ci_lower, tp, s, clean, x, k_asc, k_loss))
        )(sources)

    g_all, g_asg = grad_of(fns_all), grad_of(fns_asg)
    idx = np.asarray(L.merged_assignment(k_loss, 4, 2))
    rest = np.setdiff1d(np.arange(4), idx)
    assert idx.shape == (2,)
    for p in sources:  # per-example sources: (examples, positions, C + 1)
        a, b = np.asarray(g_all[p]), np.asarray(g_asg[p])
        assert np.abs(a[idx]).max() > 0
        # Tolerance: the forward over 2 examples and over 4 may sum in another order.
        np.testing.assert_allclose(b[idx], a[idx], rtol=1e-5, atol=1e-9)
        assert not np.any(b[rest])

    # the merged term of the loss drawn from the same key masks exactly those examples by the
    # sources: its gradient reaches their sources and no other's
    def merged(s):
        out = fns_asg.loss(free, tp, s, clean, x, k_loss, 0.1, freq_state=state["freq"])
        return out[1]["merged_recon"]

    g_merged = jax.jit(jax.grad(merged))(sources)
    for p in sources:
        g = np.asarray(g_merged[p])
        assert np.abs(g[idx]).max() > 0 and not np.any(g[rest])


@pytest.mark.slow  # ~15 s: the tiny LM step compiled twice
def test_a_tiny_lm_trains_with_assigned_ascents_under_accumulation():
    batch = {"tokens": jax.random.randint(jax.random.PRNGKey(3), (8, 17), 0, 256)}
    runs = {}
    for ascent in ("all", "assigned"):
        cfg = _cfg(ascent, batch=8, accum=2)
        _t, _fns, prog, tp, state = spd_setup(cfg)
        src0 = jax.tree.map(np.asarray, state["sources"])
        step = prog.jit(donate=False)
        for _ in range(3):
            state, m = step(tp, state, batch)
        assert all(np.isfinite(float(v)) for v in m.values())
        moved = jax.tree.map(lambda a, b: bool(np.any(np.asarray(a) != b)), state["sources"], src0)
        assert all(jax.tree.leaves(moved))
        runs[ascent] = float(m["loss"])
    assert runs["all"] != runs["assigned"]


@pytest.mark.slow  # ~5 s under load: two mask draws over 64 examples
def test_the_default_keeps_the_bernoulli_draw():
    """ascent_examples = "all": the merged term's assignment is the Bernoulli draw it always
    was (here, a draw whose count is not the fixed one)."""
    ci = {"s": jnp.full((64, 3), 0.5)}
    src = {"s": jnp.ones((64, 4))}
    key = jax.random.PRNGKey(0)
    _, _, bern = M.mixed_masks(key, ci, src, 0.5, True)
    k_assign, _ = jax.random.split(key)
    assert np.array_equal(np.asarray(bern), np.asarray(jax.random.bernoulli(k_assign, 0.5, (64,))))
    _, _, fixed = M.mixed_masks(key, ci, src, 0.5, True, n_assigned=32)
    assert int(fixed.sum()) == 32
