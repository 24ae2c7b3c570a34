"""`pdctl warmup`: faithfulness warmup of V/U toward the pretrained target weights.

Its own AdamW (discarded afterwards). The step donates everything but the frozen target
parameters, its first argument, which must survive the call.

At `steps = 0` its result is the components it starts from (`start_components`): it is done at
once and saves nothing (`[state.warmup] components_from = "init_weights"`); train, and what
reads warmup's decomposition (`stages.decomposition.warmup_kept_init`), build them from
init-weights' checkpoint as warmup would have, bit for bit."""

from __future__ import annotations

import functools
from typing import Any

import jax
import optax
from jax.sharding import Mesh

from pdctl.config import Config, OptimConfig
from pdctl.engine import sharding
from pdctl.engine.loop import all_finite, guard_update, loop_counters
from pdctl.engine.optim import adamw
from pdctl.engine.precision import Policy
from pdctl.engine.program import StepProgram
from pdctl.science.spd.components import expand_tied, fold_tied
from pdctl.science.spd.losses import faithfulness_loss
from pdctl.science.targets import Target
from pdctl.stages.decomposition import KEPT_INIT, abstract_decomposition, site_layout
from pdctl.stages.env import StageEnv, frozen_target
from pdctl.stages.inputs import STREAM_WARMUP, abstract_target, decomp_layout, stream_key
from pdctl.stages.runner import StageSpec, run_stage


def optimizer(cfg: Config, steps: int) -> optax.GradientTransformation:
    w = cfg.warmup
    # not validated: a sweep may vary lr / weight_decay as tracers (pdctl.sweep.hyper)
    opt = OptimConfig.model_construct(lr=w.lr, weight_decay=w.weight_decay, schedule="constant")
    return adamw(opt, max(steps, 1))


def make_step(
    target, paths: tuple[str, ...], tx, ties: dict[str, str] | None = None, weight_space=None
):
    """The warmup step over the component parameters (tied sites folded away, see
    `components.expand_tied`). The loss and the optimizer see every site: faithfulness sums
    over all of them, and AdamW keeps one moment set per site (a tied site's update is folded
    back onto its source's parameters), as the reference's two tied Parameters sharing storage.
    """
    ties = ties or {}

    def loss_fn(components, target_params):
        w = target.site_weights(target_params)
        weights = {p: jax.lax.stop_gradient(w[p]) for p in paths}
        return faithfulness_loss(weights, components, weight_space)

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


def program(cfg: Config, mesh: Mesh, target: Target) -> StepProgram:
    """The faithfulness-warmup step as a program: the frozen target, then the donated state."""
    steps = cfg.warmup.steps
    tx = optimizer(cfg, steps)
    rng = stream_key(cfg, STREAM_WARMUP)
    paths, ties = site_layout(cfg, target)

    def make_state(components):
        return {
            "components": components,
            "opt_state": tx.init(expand_tied(components, ties, paths)),
            "loop": loop_counters(rng),
        }

    def shardings(abstract: Any) -> Any:
        return sharding.tree_shardings(
            abstract, mesh, cfg.mesh.fsdp_min_param_size, decomp_layout(cfg, mesh, target)
        )

    dec = abstract_decomposition(cfg, target)
    abstract = jax.eval_shape(make_state, dec["components"])
    abstract_params = abstract_target(cfg, target)
    return StepProgram(
        stage="warmup",
        step=make_step(
            target, paths, tx, ties, sharding.weight_space(mesh, decomp_layout(cfg, mesh, target))
        ),
        make_state=make_state,
        abstract_state=abstract,
        state_shardings=shardings(abstract),
        mesh=mesh,
        policy=Policy.from_config(cfg.precision),
        total_steps=steps,
        frozen_abstract=(abstract_params,),
        frozen_shardings=(shardings(abstract_params),),
        lr_fn=lambda s: {"lr": cfg.warmup.lr},
    )


def start_components(env: StageEnv, abstract: Any) -> Any:
    """The components warmup starts from, sharded as `env` shards `abstract` (per site, tied
    sites folded): init-weights', nonlinearity-aligned to the trained target where `[decomp]
    init` says so. At `steps = 0` also its result, which train then builds with this."""
    items, _ = env.restore_items("init_weights", {"components": abstract})
    if env.cfg.decomp.init == "nonlinearity_aligned":  # from the trained target's weights
        from pdctl.stages.init_weights import nonlinearity_aligned

        return nonlinearity_aligned(env, items["components"])
    return items["components"]


def fresh_inputs(env: StageEnv, prog: StepProgram) -> tuple[Any, ...]:
    """What a fresh warmup starts from: init-weights' components (`start_components`)."""
    return (start_components(env, prog.abstract_state["components"]),)


def idle(cfg: Config) -> dict[str, Any] | None:
    """At `steps = 0` warmup changes nothing: what its state records instead of a checkpoint
    (`runner._run_idle`)."""
    return {"components_from": KEPT_INIT} if cfg.warmup.steps == 0 else None


SPEC = StageSpec(
    name="warmup",
    program=program,
    fresh_inputs=fresh_inputs,
    frozen=frozen_target,
    idle=idle,
)


# `warmup.run(project, until=..., resume=..., fresh=..., profile=...)`: the generic stage run.
run = functools.partial(run_stage, spec=SPEC)
