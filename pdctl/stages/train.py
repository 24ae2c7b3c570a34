"""`pdctl train`: Stochastic Parameter Decomposition training as a stage: the step
(`train_step.make_step`, its order there) made a program over the mesh with its state's
layout and shardings, restored from either layout of a checkpoint, and evaluated
(`train_eval`). The step donates everything but the frozen target parameters."""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pdctl.config import Config, match_sites
from pdctl.engine import sharding
from pdctl.engine.loop import loop_counters
from pdctl.engine.optim import schedule
from pdctl.engine.precision import Policy
from pdctl.engine.program import StepProgram
from pdctl.errors import notify
from pdctl.science.spd.components import component_ties
from pdctl.science.spd.losses import (
    init_freq_state,
    make_spd_fns,
)
from pdctl.science.spd.stacked import Stacking, is_stacked, members, per_site
from pdctl.science.targets import Target
from pdctl.stages.decomposition import abstract_decomposition, warmup_kept_init
from pdctl.stages.env import StageEnv, frozen_target
from pdctl.stages.inputs import (
    STREAM_TRAIN,
    abstract_target,
    as_trained,
    decomp_layout,
    stream_key,
    text_batch_spec,
    with_scan,
)
from pdctl.stages.runner import StageSpec, run_stage
from pdctl.stages.train_eval import make_eval
from pdctl.stages.train_step import make_step, optimizer


def program(cfg: Config, mesh: Mesh, target: Target) -> StepProgram:
    """The SPD train step as a program: the frozen target, the donated state, the batch."""
    tc = cfg.train
    total = tc.steps
    sharding.check_batch_divides(tc.batch_size, mesh, "train.batch_size", tc.grad_accum_steps)
    target = as_trained(cfg, target, mesh)
    tx = optimizer(cfg, total)
    dec = abstract_decomposition(cfg, target)
    stacking = stacking_for(cfg, target, dec)
    fns = spd_fns(cfg, target, mesh, stacking)

    make_state, abstract, state_sh = _state_spec(cfg, mesh, target, fns, tx, stacking, dec)
    abstract_params = abstract_target(cfg, target)
    batch_abstract, batch_shardings = text_batch_spec(cfg, target, tc.batch_size, mesh)
    lr = schedule(tc.optim, total)
    return StepProgram(
        stage="train",
        step=make_step(target, fns, tx, cfg, total, sharding.batch_sharding(mesh, 2)),
        make_state=make_state,
        abstract_state=abstract,
        state_shardings=state_sh,
        mesh=mesh,
        policy=Policy.from_config(cfg.precision),
        total_steps=total,
        frozen_abstract=(abstract_params,),
        frozen_shardings=(
            sharding.tree_shardings(
                abstract_params,
                mesh,
                cfg.mesh.fsdp_min_param_size,
                decomp_layout(cfg, mesh, target),
            ),
        ),
        batch_abstract=batch_abstract,
        batch_shardings=batch_shardings,
        examples_per_step=tc.batch_size,
        lr_fn=lambda s: {"lr": float(lr(s))},
    )


def _state_spec(cfg, mesh, target, fns, tx, stacking: Stacking, dec):
    """(make_state, its abstract output, its shardings) for the given stacking."""
    rng = stream_key(cfg, STREAM_TRAIN)
    src_dtype = jnp.dtype(cfg.train.ppgd.dtype)
    lcfg = cfg.train.loss

    def make_state(components, ci_fns, sources):
        # the upstream arrays come per site; the state holds repeated sites stacked
        components, ci_fns, sources = (stacking.stack(t) for t in (components, ci_fns, sources))
        # init-weights makes float32 sources; the state keeps them as [train.ppgd] dtype says
        sources = jax.tree.map(lambda s: s.astype(src_dtype), sources)
        trainable = {"components": components, "ci_fns": ci_fns}
        expanded = fns.expand(components)
        state = {
            "trainable": trainable,
            # one moment set per site, tied sites included (see make_step)
            "opt_state": tx.init({"components": expanded, "ci_fns": ci_fns}),
            "sources": sources,
            "src_opt": fns.init_source_opt(sources),
            "loop": loop_counters(rng),
        }
        if lcfg.frequency > 0 and lcfg.frequency_ema_halflife is not None:
            # the frequency term's EMA of f_c: one (C,) per site (a stacked unit: (L, C))
            shapes = {u: (*c["V"].shape[:-2], c["V"].shape[-1]) for u, c in expanded.items()}
            state["freq"] = init_freq_state(shapes)
        return state

    abstract = jax.eval_shape(make_state, dec["components"], dec["ci_fns"], dec["sources"])
    layout = decomp_layout(cfg, mesh, target)
    state_sh = sharding.tree_shardings(abstract, mesh, cfg.mesh.fsdp_min_param_size, layout)
    if cfg.train.ppgd.scope in ("per_batch_per_position", "pooled"):
        # one source per example (and position): shard them like the batch they mask (behind
        # the layer axis of stacked sites)
        def by_batch(tree):
            return {
                k: sharding.leading_batch_shardings(v, mesh, lead=int(members(k) is not None))
                for k, v in tree.items()
            }

        state_sh["sources"] = by_batch(abstract["sources"])
        for k in ("m", "v"):
            if k in abstract["src_opt"]:
                state_sh["src_opt"][k] = by_batch(abstract["src_opt"][k])
    return make_state, abstract, state_sh


def restore(env: StageEnv, step: int, prog: StepProgram) -> tuple[Any, dict[str, Any]]:
    """Checkpoint `step` as this program's state, whichever layout wrote it: a checkpoint with
    one array per site (a pdctl before stacked sites, or `scan_layers = false`) restores into
    a stacked state and the other way round, bit for bit (`scan_layers` is not part of the
    fingerprint: it changes how the step runs, not what it computes)."""
    cfg = env.cfg
    target = as_trained(cfg, env.target, env.mesh)
    dec = abstract_decomposition(cfg, target)
    stacking = stacking_for(cfg, target, dec)
    other = stacking_for(cfg, with_scan(target, not getattr(target, "scan_layers", False)), dec)
    stacked = _checkpoint_is_stacked(env, step)
    if stacked is None or stacked == (not stacking.trivial) or other.trivial == stacking.trivial:
        return env.restore_state(step, prog.abstract_state, prog.state_shardings)
    fns = spd_fns(cfg, target, env.mesh)
    tx = optimizer(cfg, cfg.train.steps)
    _, abstract, shardings = _state_spec(cfg, env.mesh, target, fns, tx, other, dec)
    state, meta = env.restore_state(step, abstract, shardings)
    if stacking.trivial:
        convert, how = unstack_state, "one array per site"
    else:
        convert, how = functools.partial(stack_state, stacking), "repeated sites stacked"
    # (not donated: the layouts differ in shape, so no buffer could be reused)
    state = jax.jit(convert, out_shardings=prog.state_shardings)(state)
    notify(f"train: checkpoint {meta['step']} was written in the other layout; restored it "
           f"with {how}")  # fmt: skip
    return state, meta


def _checkpoint_is_stacked(env: StageEnv, step: int) -> bool | None:
    from pdctl.engine.checkpoint import item_tree

    try:
        tree = item_tree(env.project.checkpoint_dir("train"), step, "trainable")
    except Exception:  # unreadable: let restore_state name it (and fall back to an older one)
        return None
    return is_stacked(tree.get("components", {}))


def stack_state(stacking: Stacking, state: Any) -> Any:
    """A per-site train state (every dict keyed by sites: components, CI functions, sources,
    their optimizer moments) in `stacking`'s layout."""
    firsts = {ms[0] for _, ms in stacking.groups}

    def by_site(x: Any) -> bool:
        return isinstance(x, dict) and any(k in firsts for k in x)

    return jax.tree.map(lambda x: stacking.stack(x) if by_site(x) else x, state, is_leaf=by_site)


def unstack_state(state: Any) -> Any:
    """A stacked train state with one array per site again (the inverse of `stack_state`)."""

    def grouped(x: Any) -> bool:
        return isinstance(x, dict) and is_stacked(x)

    return jax.tree.map(lambda x: per_site(x) if grouped(x) else x, state, is_leaf=grouped)


def stacking_for(cfg: Config, target: Target, dec: Any | None = None) -> Stacking:
    """Which sites this run's train state stacks: those repeated over consecutive layers of a
    target whose layers run as a scan, with equal shapes (`science.spd.stacked`); none when
    components are tied (the toys)."""
    dec = dec if dec is not None else abstract_decomposition(cfg, target)
    paths = [p for p in target.site_paths() if p in dec["components"]]
    if component_ties(target.tied_sites(), dict.fromkeys(paths, 0)):
        return Stacking()

    def signature(p: str) -> Any:
        trees = (dec["components"][p], dec["ci_fns"][p], dec["sources"][p])
        return tuple((tuple(a.shape), str(a.dtype)) for a in jax.tree.leaves(trees))

    return Stacking.plan(target, paths, signature)


def spd_fns(
    cfg: Config, target: Target, mesh: Mesh | None = None, stacking: Stacking | None = None
):
    """The SPD functions of this config's sites on `target`; with the step's `mesh`, laid out
    for the components' sharding on it (`sharding.weight_space`); with a `stacking`, on the
    train state's stacked groups (`make_spd_fns`)."""
    ws = None if mesh is None else sharding.weight_space(mesh, decomp_layout(cfg, mesh, target))
    site_C = match_sites(cfg, target.site_paths())
    return make_spd_fns(target, site_C, cfg, ws, stacking)


def fresh_inputs(env: StageEnv, prog: StepProgram) -> tuple[Any, ...]:
    """What a fresh train starts from: warmup's components (when warmup ran with `steps = 0`,
    the ones it started from, built here as it would have: `warmup.start_components`),
    init-weights' CI functions and PPGD sources; with `[train] init_from`, the parent run's
    final components and CI functions instead (`stages.init_from`), and this run's fresh
    sources."""
    dec = abstract_decomposition(env.cfg, env.target)  # per site, as upstream stages save it
    trainable = {"components": dec["components"], "ci_fns": dec["ci_fns"]}
    if env.cfg.train.init_from:
        from pdctl.stages.init_from import UPSTREAM_KEY, parent_decomposition

        arrays, parent = parent_decomposition(
            env.project.root, env.cfg, trainable, env.shardings(trainable)
        )
        init, _ = env.restore_items("init_weights", {"sources": dec["sources"]})
        # the parent's train is read as an upstream stage is: its rerun makes this one stale
        upstream = dict(env.project.stage("train").get("upstream") or {})
        if parent.run_id:
            upstream[UPSTREAM_KEY] = parent.run_id
        env.on_state(init_from=parent.origin(), upstream=upstream)
        notify(f"train: starting from the decomposition of {parent.run} at step "
               f"{parent.step} (fresh optimizer, sources and step)")  # fmt: skip
        return arrays["components"], arrays["ci_fns"], init["sources"]
    init, _ = env.restore_items(
        "init_weights", {"ci_fns": trainable["ci_fns"], "sources": dec["sources"]}
    )
    if warmup_kept_init(env.project):  # warmup ran with steps = 0: it saved nothing
        from pdctl.stages.warmup import start_components

        return start_components(env, trainable["components"]), init["ci_fns"], init["sources"]
    warm, _ = env.restore_items("warmup", {"components": trainable["components"]})
    return warm["components"], init["ci_fns"], init["sources"]


def evaluation(env: StageEnv, frozen: tuple[Any, ...], prog: StepProgram):
    (target_params,) = frozen
    target = as_trained(env.cfg, env.target, env.mesh, step=False)
    return make_eval(env, target_params, spd_fns(env.cfg, target), target)


def eval_programs(cfg: Config, prog: StepProgram, target: Target, mesh: Mesh) -> dict[str, Any]:
    """{name: lowered} of the evaluation's own programs (`evaluation` runs them), lowered from
    abstract arguments with the train state's shardings as the stage traces them (at
    `[precision] eval_matmul`, in `[train] eval_accum_steps` micro-batches): the CI program and,
    for an LM, the masked-forwards program. Used by the fit check and by `pdctl run`'s compile
    ahead (`[compile] ahead`). Several CPU devices evaluate replicated instead
    (`runtime.collective_free_eval`), a CPU workaround these programs do not follow."""
    with prog.policy.eval_scope():
        return _eval_programs(cfg, prog, target, mesh)


def _eval_programs(cfg: Config, prog: StepProgram, target: Target, mesh: Mesh) -> dict[str, Any]:
    from pdctl.science.spd import evaluate

    target = as_trained(cfg, target, mesh, step=False)  # as train evaluates
    fns = spd_fns(cfg, target)
    params = sharding.abstract_with_shardings(prog.frozen_abstract[0], prog.frozen_shardings[0])
    # The evaluation takes the decomposition as the train state holds it (a scanned target's
    # sites stacked in groups), laid out as the state lays it out.
    trainable = sharding.abstract_with_shardings(
        prog.abstract_state["trainable"], prog.state_shardings["trainable"]
    )
    comps = jax.eval_shape(fns.expand, trainable["components"])
    comps = jax.tree.map(  # tied sites come out unsharded: shard them as their sources are
        lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding.replicated(mesh)),
        comps,
    ) if fns.ties else trainable["components"]  # fmt: skip
    ci_fns = trainable["ci_fns"]
    paths = evaluate.unit_order(target, comps)
    n = cfg.train.eval_batch_size
    d = cfg.decomp
    shape: tuple[int, ...]
    if target.output_kind == "logits":
        shape, dtype = (n, cfg.data.seq_len), jnp.int32
    else:
        batch = jax.eval_shape(lambda k: target.make_batch(k, n), jax.random.key(0))
        x_batch = target.inputs(batch)
        shape, dtype = tuple(x_batch.shape), x_batch.dtype
    # The evaluation batch splits over the devices like a train batch; one that does not
    # divide is laid out replicated (the fit check then states a larger peak, not a crash).
    split = n % sharding.batch_shards(mesh) == 0
    x_sh = sharding.batch_sharding(mesh, len(shape)) if split else sharding.replicated(mesh)
    x = jax.ShapeDtypeStruct(shape, dtype, sharding=x_sh)
    ci = evaluate.ci_program(target, paths, d.ci_fn.type, d.sigmoid, d.sampling)
    out: dict[str, Any] = {"eval: CI": ci.lower(params, comps, ci_fns, x)}
    if target.output_kind == "logits":
        key = jax.eval_shape(lambda: stream_key(cfg, STREAM_TRAIN))
        key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=sharding.replicated(mesh))
        fn = evaluate.lm_eval_program(
            target, paths, d.ci_fn.type, d.sigmoid, d.sampling, d.delta_component,
            cfg.train.eval_rounding_threshold, evaluate.fresh_pgd_config(cfg),
            cfg.train.eval_accum_steps,
        )  # fmt: skip
        out["eval: masked forwards"] = fn.lower(params, comps, ci_fns, x, x, key)
    return out


SPEC = StageSpec(
    name="train",
    program=program,
    fresh_inputs=fresh_inputs,
    frozen=frozen_target,
    evaluation=evaluation,
    restore=restore,
    eval_programs=eval_programs,
)


# `train.run(project, until=..., resume=..., fresh=..., profile=...)`: the generic stage run.
run = functools.partial(run_stage, spec=SPEC)
