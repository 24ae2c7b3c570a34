"""`pdctl warmup`: faithfulness warmup of V/U toward the pretrained target weights.

Its own AdamW (discarded afterwards). The step donates everything but the frozen target
parameters, its first argument, which must survive the call."""

from __future__ import annotations

from typing import Any

import jax
import optax

from pdctl.config import OptimConfig
from pdctl.engine import sharding
from pdctl.engine.loop import LoopResult, all_finite, guard_update, loop_counters
from pdctl.engine.optim import adamw
from pdctl.project import Project
from pdctl.science.spd.components import component_ties, expand_tied, fold_tied
from pdctl.science.spd.losses import faithfulness_loss
from pdctl.stages.common import (
    STREAM_WARMUP,
    StageEnv,
    pretrained_target,
    resume_point,
    run_loop,
    stream_key,
)


def optimizer(env: StageEnv, steps: int) -> optax.GradientTransformation:
    w = env.cfg.warmup
    return adamw(
        OptimConfig(lr=w.lr, weight_decay=w.weight_decay, schedule="constant"), max(steps, 1)
    )


def make_step(target, paths: tuple[str, ...], tx, ties: dict[str, str] | None = None):
    """The warmup step over the component parameters (tied sites folded away, see
    `components.expand_tied`). The loss and the optimizer see every site: faithfulness sums
    over all of them, and AdamW keeps one moment set per site (a tied site's update is folded
    back onto its source's parameters), as the reference's two tied Parameters sharing storage.
    """
    ties = ties or {}

    def loss_fn(components, target_params):
        w = target.site_weights(target_params)
        return faithfulness_loss({p: jax.lax.stop_gradient(w[p]) for p in paths}, components)

    def step(target_params: Any, state: dict[str, Any], batch: None):
        per_site = expand_tied(state["components"], ties, paths)
        loss, grads = jax.value_and_grad(loss_fn)(per_site, target_params)

        def update():
            updates, opt_state = tx.update(grads, state["opt_state"], per_site)
            comps = optax.apply_updates(state["components"], fold_tied(updates, ties))
            return {"components": comps, "opt_state": opt_state}

        metrics = {"loss": loss, "faithfulness": loss, "grad_norm": optax.global_norm(grads)}
        return guard_update(state, update, all_finite(loss, grads), metrics)

    return step


def build(env: StageEnv, abstract_components: Any, steps: int):
    tx = optimizer(env, steps)
    rng = stream_key(env.cfg, STREAM_WARMUP)
    paths, ties = site_layout(env)

    def make_state(components):
        return {
            "components": components,
            "opt_state": tx.init(expand_tied(components, ties, paths)),
            "loop": loop_counters(rng),
        }

    abstract = jax.eval_shape(make_state, abstract_components)
    return tx, make_state, abstract, env.shardings(abstract)


def site_layout(env: StageEnv) -> tuple[tuple[str, ...], dict[str, str]]:
    """(decomposed site paths in forward order, {tied site: source site})."""
    from pdctl.stages.init_weights import decomposed_sites

    sites = decomposed_sites(env.cfg, env.target)
    paths = tuple(p for p in env.target.site_paths() if p in sites)
    return paths, component_ties(env.target.tied_sites(), sites)


def abstract_decomposition(env: StageEnv) -> dict[str, Any]:
    """Abstract {"components", "ci_fns", "sources"} as init-weights creates them."""
    from pdctl.stages.init_weights import init_decomposition_abstract

    return init_decomposition_abstract(env.cfg, env.target)


def run(
    project: Project,
    *,
    until: int | None = None,
    resume: bool = False,
    fresh: bool = False,
    profile: tuple[int, int] | None = None,
) -> LoopResult:
    env = StageEnv.open(project, "warmup", requires=("init_weights", "pretrain"))
    cfg = env.cfg
    steps = cfg.warmup.steps
    ckpt_step = resume_point(env, resume=resume, fresh=fresh)
    abstract_dec = abstract_decomposition(env)
    tx, make_state, abstract, state_sh = build(env, abstract_dec["components"], steps)
    target_params = pretrained_target(env)
    paths, ties = site_layout(env)
    if ckpt_step is None:
        env.begin(fresh=True, steps=steps)
        items, _ = env.restore_items("init_weights", {"components": abstract_dec["components"]})
        state = jax.jit(make_state, out_shardings=state_sh)(items["components"])
        start = 0
    else:
        env.begin(fresh=False, steps=steps)
        state, meta = env.restore_state(ckpt_step, abstract, state_sh)
        start = int(meta["step"])
    target_sh = jax.tree.map(lambda x: x.sharding, target_params)
    step_fn = jax.jit(
        make_step(env.target, paths, tx, ties),
        in_shardings=(target_sh, state_sh, None),
        out_shardings=(state_sh, sharding.replicated(env.mesh)),
        donate_argnums=(1,),
    )
    return run_loop(
        env,
        step_fn=step_fn,
        state=state,
        frozen=(target_params,),
        total=steps,
        start=start,
        until=until,
        log_every=cfg.warmup.log_every,
        max_bad_steps=cfg.warmup.max_bad_steps,
        lr_fn=lambda s: {"lr": cfg.warmup.lr},
        profile=profile,
    )
