"""`pdctl pretrain`: train the target model. The step donates the whole state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from pdctl.config import Config
from pdctl.engine import sharding
from pdctl.engine.accumulate import accumulate, split_micro
from pdctl.engine.loop import LoopResult, all_finite, guard_update, loop_counters
from pdctl.engine.optim import adamw, schedule
from pdctl.engine.precision import Policy
from pdctl.engine.program import StepProgram
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.science.targets import Target
from pdctl.stages.env import StageEnv
from pdctl.stages.inputs import (
    STREAM_PRETRAIN,
    abstract_target,
    stream_key,
    text_batch_spec,
    with_remat,
)
from pdctl.stages.runner import StageSpec, run_stage


def make_step(
    target, tx, batch_size: int, batch_sharding, policy: Policy | None = None, accum: int = 1
):
    """The pure pretrain step: (state, batch) -> (state, metrics)."""
    policy = policy or Policy(jnp.float32, jnp.float32)

    def loss_fn(params, batch):
        return target.loss(policy.to_compute(params), policy.to_compute(batch))

    def step(state: dict[str, Any], batch: Any):
        loop = state["loop"]
        if batch is None:  # toy data: a pure function of the step, generated on device
            key = jax.random.fold_in(loop["rng"], loop["step"])
            batch = jax.lax.with_sharding_constraint(
                target.make_batch(key, batch_size), batch_sharding
            )
        grad_fn = jax.value_and_grad(loss_fn, has_aux=True)
        if accum == 1:
            (loss, aux), grads = grad_fn(state["params"], batch)
        else:
            micro = split_micro(batch, accum, batch_sharding.mesh)
            (loss, aux), grads = accumulate(
                lambda mb, i: grad_fn(state["params"], mb), micro, accum
            )

        def update():
            updates, opt_state = tx.update(grads, state["opt_state"], state["params"])
            params = optax.apply_updates(state["params"], updates)
            return {"params": params, "opt_state": opt_state}

        metrics = {"loss": loss, **aux, "grad_norm": optax.global_norm(grads)}
        return guard_update(state, update, all_finite(loss, grads), metrics)

    return step


def program(cfg: Config, mesh: Mesh, target: Target, *, steps: int | None = None) -> StepProgram:
    """The pretrain step as a program (`steps` overrides `[pretrain] steps`, as `--steps`)."""
    pc = cfg.pretrain
    total = pc.steps if steps is None else steps
    sharding.check_batch_divides(pc.batch_size, mesh, "pretrain.batch_size", pc.grad_accum_steps)
    target = with_remat(target, pc.remat)
    abstract_params = abstract_target(cfg, target)
    tx = adamw(pc.optim, total, trainable=target.trainable_mask(abstract_params))
    rng = stream_key(cfg, STREAM_PRETRAIN)

    def make_state(params):
        return {"params": params, "opt_state": tx.init(params), "loop": loop_counters(rng)}

    abstract = jax.eval_shape(make_state, abstract_params)
    batch_sh = sharding.batch_sharding(mesh, 2)
    policy = Policy.from_config(cfg.precision)
    batch_abstract, batch_shardings = text_batch_spec(cfg, target, pc.batch_size, mesh)
    lr = schedule(pc.optim, total)
    return StepProgram(
        stage="pretrain",
        step=make_step(target, tx, pc.batch_size, batch_sh, policy, pc.grad_accum_steps),
        make_state=make_state,
        abstract_state=abstract,
        state_shardings=sharding.tree_shardings(abstract, mesh, cfg.mesh.fsdp_min_param_size),
        mesh=mesh,
        policy=policy,
        total_steps=total,
        batch_abstract=batch_abstract,
        batch_shardings=batch_shardings,
        examples_per_step=pc.batch_size,
        lr_fn=lambda s: {"lr": float(lr(s))},
    )


def fresh_inputs(env: StageEnv, prog: StepProgram) -> tuple[Any, ...]:
    """What a fresh pretrain starts from: init-weights' target parameters."""
    abstract_params = prog.abstract_state["params"]
    items, _ = env.restore_items("init_weights", {"target": abstract_params})
    return (items["target"],)


SPEC = StageSpec(name="pretrain", program=program, fresh_inputs=fresh_inputs)


def run(
    project: Project,
    *,
    steps: int | None = None,
    until: int | None = None,
    resume: bool = False,
    fresh: bool = False,
    profile: tuple[int, int] | None = None,
) -> LoopResult:
    if project.config.target.kind == "hf":
        raise PdctlError(
            "pretrain: target.kind = hf is an imported model, not trained here (its state says "
            "imported); continue with `pdctl warmup`"
        )
    # `--steps` is part of what this run ran with (its fingerprint, its checkpoints' config)
    overrides = {} if steps is None else {"pretrain.steps": steps}
    return run_stage(
        project, SPEC, until=until, resume=resume, fresh=fresh, profile=profile,
        overrides=overrides, program_options={"steps": steps},
    )  # fmt: skip
