"""`pdctl pretrain`: train the target model. The step donates the whole state."""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

from pdctl.engine import sharding
from pdctl.engine.accumulate import accumulate, split_micro
from pdctl.engine.loop import LoopResult, all_finite, guard_update, loop_counters
from pdctl.engine.optim import adamw, schedule
from pdctl.engine.precision import Policy
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.stages.common import (
    STREAM_PRETRAIN,
    STREAM_TARGET,
    StageEnv,
    resume_point,
    run_loop,
    stream_key,
    text_batches,
    with_remat,
)


def make_step(
    target, tx, batch_size: int, batch_sharding, policy: Policy | None = None, accum: int = 1
):
    """The pure pretrain step: (state, batch) -> (state, metrics)."""
    policy = policy or Policy(jnp.float32, jnp.float32, jnp.float32)

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


def build(env: StageEnv, total: int):
    """(tx, abstract state, state shardings, make_state) of the pretrain stage."""
    cfg, target = env.cfg, env.target
    abstract_params = jax.eval_shape(target.init, stream_key(cfg, STREAM_TARGET))
    tx = adamw(cfg.pretrain.optim, total, trainable=target.trainable_mask(abstract_params))
    rng = stream_key(cfg, STREAM_PRETRAIN)

    def make_state(params):
        return {"params": params, "opt_state": tx.init(params), "loop": loop_counters(rng)}

    abstract = jax.eval_shape(make_state, abstract_params)
    return tx, abstract, env.shardings(abstract), make_state, abstract_params


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
    env = StageEnv.open(project, "pretrain", requires=("init_weights",))
    cfg = env.cfg
    pc = cfg.pretrain
    target = with_remat(env.target, pc.remat)
    total = pc.steps if steps is None else steps
    if steps is not None:
        env.overrides["pretrain.steps"] = steps  # `--steps` is part of what this run ran with
    sharding.check_batch_divides(
        pc.batch_size, env.mesh, "pretrain.batch_size", pc.grad_accum_steps
    )
    ckpt_step = resume_point(env, resume=resume, fresh=fresh)
    tx, abstract, state_sh, make_state, abstract_params = build(env, total)
    is_text = target.output_kind == "logits"
    batch_sh = sharding.batch_sharding(env.mesh, 2)

    if ckpt_step is None:
        env.begin(fresh=True, steps=total)
        items, _ = env.restore_items("init_weights", {"target": abstract_params})
        state = jax.jit(make_state, out_shardings=state_sh)(items["target"])
        start, data_state = 0, None
    else:
        env.begin(fresh=False, steps=total)
        state, meta = env.restore_state(ckpt_step, abstract, state_sh)
        start, data_state = int(meta["step"]), meta.get("data")

    batches = None
    if is_text:
        batches = text_batches(
            env, pc.batch_size, seed=cfg.run.seed, state=data_state, sharding=batch_sh
        )
    step_fn = jax.jit(
        make_step(
            target,
            tx,
            pc.batch_size,
            batch_sh,
            Policy.from_config(cfg.precision),
            pc.grad_accum_steps,
        ),
        in_shardings=(state_sh, batch_sh if is_text else None),
        out_shardings=(state_sh, sharding.replicated(env.mesh)),
        donate_argnums=(0,),
    )
    lr = schedule(pc.optim, total)
    return run_loop(
        env,
        step_fn=step_fn,
        state=state,
        total=total,
        start=start,
        until=until,
        log_every=pc.log_every,
        max_bad_steps=pc.max_bad_steps,
        batches=batches,
        examples_per_step=pc.batch_size,
        lr_fn=lambda s: {"lr": float(lr(s))},
        profile=profile,
    )
