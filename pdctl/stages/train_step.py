"""The SPD train step (`make_step`: its order is in its docstring) and its optimizer: AdamW on
components and CI functions, separate optimizers when `[train.ci_optim]` is set. `pdctl.stages
.train` makes it a program (`train.program`) and runs it; this module holds only the step's
maths and order, as one pure function of (frozen target parameters, state, batch)."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax

from pdctl.engine.accumulate import accumulate, split_micro
from pdctl.engine.loop import all_finite, guard_update
from pdctl.engine.optim import adamw, schedule
from pdctl.engine.precision import Policy
from pdctl.science.arrays import is_traced
from pdctl.science.spd.losses import (
    FREQ_STATE,
    faithfulness_once,
    penalty_sums,
    sparsity_penalty,
    whole_batch_terms,
)
from pdctl.science.spd.stacked import members


def optimizer(cfg, steps: int) -> optax.GradientTransformation:
    tc = cfg.train
    if tc.ci_optim is None:
        return adamw(tc.optim, steps)
    return optax.multi_transform(
        {"components": adamw(tc.optim, steps), "ci_fns": adamw(tc.ci_optim, steps)},
        lambda t: {k: jax.tree.map(lambda _, k=k: k, v) for k, v in t.items()},
    )


def make_step(target, fns, tx, cfg, total: int, batch_sharding):
    """The SPD step, in the reference's order (goodfire-ai/spd `run_spd.py` with
    `persistent_pgd.py`):

    clean target forward (stop-gradient; shared by everything below) -> CI ->
    `n_warmup_steps` extra PPGD ascent steps on this batch (components and CI held constant) ->
    every loss term, the PPGD term with the sources as they now are -> one backward giving the
    parameters' gradients and the sources' (d total / d sources = coeff * dL_ppgd / d sources)
    -> AdamW update of the parameters (per site; tied sites folded back) -> ONE source ascent
    step with that step's source learning rate (the sources serve ppgd_recon or, the LM
    recipe, merged_recon). With a frequency EMA (`[train.loss] frequency_ema_halflife`), the
    state's `freq` advances by this batch's f_c. A non-finite step changes nothing but the
    counters (`guard_update`).

    With `fns` made for a stacking (`[train] scan_layers`: the state holds repeated sites
    stacked) everything runs on the groups as they are: the optimizer, clipping and guard, and
    the SPD functions, so no per-site copy of any of it is in the program."""
    tc, lcfg, pcfg = cfg.train, cfg.train.loss, cfg.train.ppgd
    policy = Policy.from_config(cfg.precision)
    k_accum = tc.grad_accum_steps
    mesh = batch_sharding.mesh
    use_ppgd = fns.source_coeff > 0
    source_lr = schedule(pcfg, total)
    imp_on = is_traced(lcfg.importance_minimality) or lcfg.importance_minimality > 0
    freq_on = lcfg.frequency > 0

    def loss_fn(
        trainable, sources, target_params, clean, x, key, step_frac, imp_totals=None, freq=None,
        skip=(),
    ):  # fmt: skip
        # `target_params` as stored: the terms see their compute-dtype cast, faithfulness the
        # stored values (`pdctl.engine.precision`)
        return fns.loss(
            policy.to_compute(trainable), policy.to_compute(target_params), sources, clean, x,
            key, step_frac, imp_totals, freq, exact=(trainable["components"], target_params),
            skip=skip,
        )  # fmt: skip

    grad_fn = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)
    # With accumulation the faithfulness term (W - V U of every site: no batch in it, at full
    # float32 precision, on a TPU six bf16 passes) is formed once per step, not once per
    # micro-batch; the micro-batches' mean would be the same value to float32 reassociation.
    faith_once = k_accum > 1 and not is_traced(lcfg.faithfulness) and lcfg.faithfulness > 0
    micro_grad_fn = (
        jax.value_and_grad(
            functools.partial(loss_fn, skip=("faithfulness",)), argnums=(0, 1), has_aux=True
        )
        if faith_once
        else grad_fn
    )

    def split_step(x, clean):
        # a stacked unit's captured inputs have its layers ahead of the batch: (L, B, ...)
        axes = {p: int(members(p) is not None) for p in clean.site_inputs}
        resid = None if clean.residual is None else 0  # (B, T, d): batch first
        starts = None if clean.starts is None else dict.fromkeys(clean.starts, 0)  # likewise
        batch_axes = {
            "x": 0,
            "clean": clean._replace(out=0, site_inputs=axes, residual=resid, starts=starts),
        }
        return split_micro({"x": x, "clean": clean}, k_accum, mesh, batch_axes)

    def value_and_grads(trainable, sources, target_params, clean, x, key, step_frac, freq):
        """((loss, metrics), grads), the frequency EMA's new state (None without one)."""
        if k_accum == 1:
            (loss, m), grads = grad_fn(
                trainable, sources, target_params, clean, x, key, step_frac, None, freq
            )
            return ((loss, m), grads), m.pop(FREQ_STATE, None)
        micro = split_step(x, clean)
        imp_totals, penalty = None, sparsity_penalty(lcfg, step_frac)
        if imp_on or freq_on:
            # Importance minimality and the frequency term take the whole accumulated batch's
            # sums before their logs: a forward-only first pass collects S_c over every
            # micro-batch.
            def sums(c):
                _, up = fns.ci(trainable["components"], trainable["ci_fns"], c.site_inputs, key)
                return penalty_sums(up, penalty)

            S = jax.tree.map(lambda a: a.sum(0), jax.lax.map(sums, micro["clean"]))
            positions = x.shape[1] if target.output_kind == "logits" else 1
            n_mb = x.shape[0] // k_accum * positions
            imp_totals = (S, n_mb, n_mb * k_accum)
        out = accumulate(
            lambda mb, i: micro_grad_fn(
                trainable,
                sources,
                target_params,
                mb["clean"],
                mb["x"],
                jax.random.fold_in(key, i),
                step_frac,
                imp_totals,
                freq,
            ),
            micro,
            k_accum,
        )
        (loss, m), grads = out
        if faith_once:
            value, g = jax.value_and_grad(fns.faithfulness_loss)(
                trainable["components"], target_params
            )
            g_tr, g_src = grads
            loss, m, comps = faithfulness_once(
                lcfg.faithfulness, value, g, loss, m, g_tr["components"]
            )
            grads = ({**g_tr, "components": comps}, g_src)
        m.pop(FREQ_STATE, None)  # the mean over micro-batches: recomputed below
        new_freq = None
        if imp_totals is not None:  # report the whole batch's values, not the surrogates'
            loss, m, new_freq = whole_batch_terms(
                lcfg, loss, m, imp_totals[0], n_mb * k_accum, freq
            )
        return ((loss, m), grads), new_freq

    def step(target_params: Any, state: dict[str, Any], batch: Any):
        loop = state["loop"]
        key = jax.random.fold_in(loop["rng"], loop["step"])
        k_data, k_loss, k_src = jax.random.split(key, 3)
        if batch is None:  # toy data, a pure function of the step
            batch = jax.lax.with_sharding_constraint(
                target.make_batch(k_data, tc.batch_size), batch_sharding
            )
        x = policy.to_compute(target.inputs(batch))
        params = policy.to_compute(target_params)
        clean = fns.clean(params, x)
        free = state["trainable"]
        trainable = {"components": fns.expand(free["components"]), "ci_fns": free["ci_fns"]}
        sources, src_opt = state["sources"], state["src_opt"]
        lr_src = source_lr(loop["step"])
        freq = state.get("freq")
        if use_ppgd and pcfg.n_warmup_steps:
            const = jax.lax.stop_gradient(policy.to_compute(trainable))
            comps = const["components"]
            if k_accum == 1:
                # the loss's CI, computed once for every ascent step
                ci_lower, _ = fns.ci(comps, const["ci_fns"], clean.site_inputs, fns.ci_key(k_loss))

                def source_grad(srcs, key):
                    return jax.grad(
                        lambda s: fns.ppgd_loss(comps, ci_lower, params, s, clean, x, key, k_loss)
                    )(srcs)

            else:
                # Accumulated like the loss below: micro-batch j sees the CI the loss computes
                # for it (key folded by j) and the sources' gradient is the mean over micro-
                # batches, so per-batch sources (sized by the micro-batch) fit and no more than
                # one micro-batch's activations are live. Split once, outside the ascent loop.
                micro = split_step(x, clean)

                def on_micro(srcs, key, mb, j):
                    k_loss_mb = jax.random.fold_in(k_loss, j)
                    k_ci = fns.ci_key(k_loss_mb)
                    ci_mb, _ = fns.ci(comps, const["ci_fns"], mb["clean"].site_inputs, k_ci)
                    k_mb = jax.random.fold_in(key, j)
                    g = jax.grad(
                        lambda s: fns.ppgd_loss(
                            comps, ci_mb, params, s, mb["clean"], mb["x"], k_mb, k_loss_mb
                        )
                    )(srcs)
                    return (jnp.zeros((), jnp.float32), {}), g

                def source_grad(srcs, key):
                    one = functools.partial(on_micro, srcs, key)
                    return accumulate(one, micro, k_accum)[1]

            def ascend(carry, i):
                srcs, opt = carry
                g = source_grad(srcs, jax.random.fold_in(k_src, i))
                return fns.source_step(srcs, g, opt, lr_src), None

            (sources, src_opt), _ = jax.lax.scan(
                ascend, (sources, src_opt), jnp.arange(pcfg.n_warmup_steps), unroll=pcfg.unroll
            )
        step_frac = loop["step"].astype(jnp.float32) / float(total)
        ((loss, m), (g_tr, g_src)), new_freq = value_and_grads(
            trainable, sources, target_params, clean, x, k_loss, step_frac, freq
        )
        metrics = {**m, "loss": loss, "grad_norm": optax.global_norm(g_tr)}
        if use_ppgd:
            metrics["ppgd_lr"] = jnp.asarray(lr_src, jnp.float32)

        def update():
            updates, opt_state = tx.update(g_tr, state["opt_state"], trainable)
            updates = {"components": fns.fold(updates["components"]), "ci_fns": updates["ci_fns"]}
            srcs, s_opt = sources, src_opt
            if use_ppgd:
                g_ppgd = jax.tree.map(lambda g: g / fns.source_coeff, g_src)
                srcs, s_opt = fns.source_step(srcs, g_ppgd, s_opt, lr_src)
            out = {
                "trainable": optax.apply_updates(free, updates),
                "opt_state": opt_state,
                "sources": srcs,
                "src_opt": s_opt,
            }
            if new_freq is not None:
                out["freq"] = new_freq
            return out

        return guard_update(state, update, all_finite(loss, g_tr, g_src), metrics)

    return step
