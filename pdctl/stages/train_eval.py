"""The train stage's evaluation (`make_eval`): on a fixed held-out batch (LMs: the eval split's
text; toys: a seeded batch), at the evaluations' matmul precision, the L0 and alive counts per
site and the LM's masked-model CE / KL or the toy's recovery figures, as plain floats."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from pdctl.engine import runtime, sharding
from pdctl.engine.precision import Policy
from pdctl.science.spd import evaluate
from pdctl.science.targets import Target
from pdctl.stages.env import StageEnv, text_batches
from pdctl.stages.inputs import STREAM_TRAIN, stream_key


def make_eval(env: StageEnv, target_params, fns, target: Target | None = None):
    cfg, target = env.cfg, target or env.target
    eval_key = jax.random.fold_in(stream_key(cfg, STREAM_TRAIN), 10**6)
    eval_batch = None
    # Several XLA:CPU devices: the batch and the decomposition come to the evaluation
    # replicated, so that none of its many small programs has a collective (they can deadlock
    # XLA:CPU; runtime.CPU_INFLIGHT_LIMIT). The decomposition, sharded over its component axis
    # (`[mesh] decomposition`), goes through the host: not even the gather is a collective.
    replicate = runtime.collective_free_eval(env.mesh)
    if target.output_kind == "logits":
        batch_sh = (
            sharding.replicated(env.mesh) if replicate else sharding.batch_sharding(env.mesh, 2)
        )
        it = text_batches(
            env,
            cfg.train.eval_batch_size,
            seed=cfg.run.seed + 1,
            state=None,
            sharding=batch_sh,
            split="eval",
        )
        eval_batch = next(it)
        it.close()
    # The key laid out as `train.eval_programs` lowers it (replicated, not one device's), so
    # that the program `pdctl run` compiled ahead is the one this evaluation looks up.
    lm_key = jax.device_put(eval_key, sharding.replicated(env.mesh))
    # A toy's batch is a pure function of its key: drawn at the first evaluation (the same
    # batch), so that its program is not compiled before the stage's first step.
    expand = jax.jit(fns.expand)

    policy = Policy.from_config(cfg.precision)

    def eval_fn(state) -> dict[str, Any]:
        nonlocal eval_batch
        if eval_batch is None:  # a toy's, outside the evaluations' matmul precision
            eval_batch = jax.jit(lambda k: target.make_batch(k, cfg.train.eval_batch_size))(
                eval_key
            )
        with policy.eval_scope():  # traced (and cached) at the evaluations' matmul precision
            return evaluations(state)

    def evaluations(state) -> dict[str, Any]:
        # (a stacked state is evaluated as it is: the evaluation's programs take its groups
        # and report per site)
        trainable = state["trainable"]
        if replicate:
            trainable = jax.device_put(jax.device_get(trainable), sharding.replicated(env.mesh))
        comps = expand(trainable["components"])
        ci_fns = trainable["ci_fns"]
        assert eval_batch is not None  # an LM's is read up front, a toy's drawn by eval_fn
        out: dict[str, Any] = {}
        stats = evaluate.ci_stats(
            target, target_params, comps, ci_fns, cfg, target.inputs(eval_batch)
        )
        out["l0"] = {k[3:]: v for k, v in stats.items() if k.startswith("l0/")}
        out["alive"] = {k[6:]: v for k, v in stats.items() if k.startswith("alive/")}
        if target.output_kind == "logits":
            # the reference's alive count (mean CI > 1e-6), beside fresh-PGD / stochastic KL
            out["alive_mean"] = {k[11:]: v for k, v in stats.items() if k.startswith("alive_mean/")}
            lm = evaluate.lm_eval(target, target_params, comps, ci_fns, cfg, eval_batch, lm_key)
            for k, v in lm.items():
                out[k.replace("/", "_")] = v
        else:
            toy = evaluate.toy_eval(target, target_params, comps, ci_fns, cfg)
            out["recovered"] = toy["recovered"]
            out["ci_errors"] = {k[9:]: v for k, v in toy.items() if k.startswith("ci_error/")}
            out["mmcs"] = {k[5:]: v for k, v in toy.items() if k.startswith("mmcs/")}
            out["ml2r"] = {k[5:]: v for k, v in toy.items() if k.startswith("ml2r/")}
        return _floats(out)

    return eval_fn


def _floats(d: dict[str, Any]) -> dict[str, Any]:
    """Plain floats, nested; non-finite values stay NaN/inf so that the loop sees a diverged
    evaluation (and fails the stage) instead of a silently shorter report."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out[k] = _floats(v)
        elif isinstance(v, float | int | np.floating | np.integer):
            out[k] = float(v)
    return out
