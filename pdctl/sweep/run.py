"""`pdctl sweep run`: the members of a sweep through init-weights → pretrain → warmup → train,
each training stage as ONE program for all the members that can share it.

Members whose configs differ only in their seed and in the numbers `sweep.hyper.TRACED` lists
(loss coefficients, learning rates, p, beta, the feature probability) share every program: the
seed only changes array values, and a varied number becomes a traced value per member
(`hyper`). Members that differ in anything else (a shape, a term switched between "on" for all
and "off" for all, a schedule kind) form separate groups. For each group and
stage, the members that would run the stage (fresh, or resuming from the same step) run it
together (`stacked.Stacked`); a group of one runs the ordinary stage, so a one-member sweep is
`pdctl run`, bit for bit.

Each member keeps its own run directory exactly as if it had run alone: its lock while its
stage runs, `[state.<stage>]`, metrics history and checkpoints (the stacked state is split and
saved per member at every checkpoint), so `pdctl resume`, `report`, `export` and `harvest`
work on a member by itself. A member that diverges (max_bad_steps, a non-finite state or
evaluation) ends `failed`; the others carry on.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import jax
import numpy as np

from pdctl import registry
from pdctl.engine import runtime
from pdctl.engine.checkpoint import Checkpointer, complete_steps
from pdctl.engine.loop import Loop, LoopResult, flatten_metrics, non_finite_keys, to_float
from pdctl.engine.tracking import NoopTracker, Tracker
from pdctl.errors import PdctlError, StageFailed, notify, one_line
from pdctl.project import Project
from pdctl.registry import STAGES
from pdctl.stages import pipeline
from pdctl.stages.env import StageEnv
from pdctl.stages.inputs import peak_flops, target_from_config
from pdctl.stages.policy import guarded, resume_point
from pdctl.sweep import hyper
from pdctl.sweep import stacked as st
from pdctl.sweep.spec import Member, Sweep


def groups(sweep: Sweep) -> list[list[tuple[Member, Project]]]:
    """The members, grouped by what they must share to run as one program (their config but
    the seed and the traced numbers: `hyper.signature`), in sweep order."""
    out: dict[str, list[tuple[Member, Project]]] = {}
    for m in sweep.members:
        p = sweep.project(m)
        sig = hyper.signature(p.config.model_dump(mode="json", by_alias=True))
        out.setdefault(sig, []).append((m, p))
    return list(out.values())


def run_sweep(
    sweep: Sweep, strategy: str | None = None, echo: Callable[[str], None] = print
) -> None:
    strategy = strategy or st.default_strategy()
    grouped = groups(sweep)
    for members in grouped:  # every member's config is checked before anything runs
        for m, p in members:
            try:
                pipeline.check_configs(p)
            except PdctlError as e:
                raise PdctlError(f"sweep member {m.name}: {e}") from None
    for gi, members in enumerate(grouped):
        names = ", ".join(m.name for m, _ in members)
        echo(f"group {gi + 1}/{len(grouped)}: {len(members)} members ({names})")
        for stage in STAGES:
            _run_group_stage(sweep, members, stage, strategy, echo)


def _actions(members: list[tuple[Member, Project]], stage: str) -> dict[str, list]:
    by: dict[str, list] = {}
    for m, p in members:
        p = Project.load(p.path)  # the state as the previous stage left it
        if _failed_before(p, stage):
            continue
        try:
            action = dict(pipeline.plan(p))[stage]
        except PdctlError as e:
            raise PdctlError(f"sweep member {m.name}: {e}") from None
        by.setdefault(action, []).append((m, p))
    return by


def _failed_before(p: Project, stage: str) -> bool:
    """A stage before `stage` failed in this member: it does not go on (its directory says why;
    `pdctl run` there retries it)."""
    return any(p.stage(s).get("status") == "failed" for s in STAGES[: STAGES.index(stage)])


def _run_group_stage(sweep, members, stage: str, strategy: str, echo) -> None:
    for action, ms in _actions(members, stage).items():
        if action == "skip":
            continue
        if stage == "init_weights" or len(ms) == 1 or _idle(stage, ms):
            for m, p in ms:
                try:
                    pipeline.run_stage(p, stage, **pipeline.ACTION_KWARGS.get(action, {}))
                except StageFailed as e:
                    echo(f"{m.name}: {e}")
                    continue
                _say_done(echo, [(m, p)], stage)
            continue
        if action == "resume":
            resume_steps(ms, stage)
        t0 = time.perf_counter()
        run_members(ms, stage, strategy, resume=action == "resume")
        echo(f"{stage}: {len(ms)} members as one program in {time.perf_counter() - t0:.1f} s")
        _say_done(echo, ms, stage)


def _idle(stage: str, ms) -> bool:
    """Every member's `stage` has nothing to do (warmup at `steps = 0`): each is done at once on
    its own (`runner._run_idle`), with no program to share."""
    spec = registry.stage(stage).load().SPEC
    return spec.idle is not None and all(spec.idle(p.config) is not None for _, p in ms)


def _say_done(echo, ms, stage: str) -> None:
    for m, p in ms:
        s = Project.load(p.path).stage(stage)
        echo(f"  {m.name}: {stage} {s.get('status')} at step {s.get('step')}")


def resume_steps(ms, stage: str) -> None:
    """Members resumed together must stand at the same checkpoint."""
    steps = {}
    for m, p in ms:
        ckpts = complete_steps(p.checkpoint_dir(stage))
        steps[m.name] = ckpts[-1] if ckpts else None
    if len(set(steps.values())) > 1:
        where = ", ".join(f"{k} at {v}" for k, v in steps.items())
        raise PdctlError(
            f"sweep: the members to resume in {stage} stopped at different steps ({where}); "
            "finish the ones behind with `pdctl resume` in their directories, then rerun "
            "`pdctl sweep run`"
        )


# ---- one stage of several members, as one program ---------------------------------------------


def _member_step(spec, env0: StageEnv, mesh) -> Callable[[dict[str, Any]], Callable[..., Any]]:
    """values -> that member's step: the group's program built from the config with the
    member's values (tracers inside the stacked step) of the varied keys in place, and its
    target from that config as a stage builds it (the toy target draws its own data)."""

    def build(values: dict[str, Any]) -> Callable[..., Any]:
        cfg = hyper.substitute(env0.cfg, values)
        return spec.program(cfg, mesh, target_from_config(cfg, env0.project.root)).step

    return build


@dataclass
class MemberRun:
    name: str
    env: StageEnv
    checkpointer: Checkpointer
    tracker: Tracker = field(default_factory=NoopTracker)
    eval_fn: Callable[[Any], dict[str, Any]] | None = None
    lr_fn: Callable[[int], dict[str, float]] | None = None  # its own, where lrs differ
    alive: bool = True
    metrics: dict[str, float] = field(default_factory=dict)
    eval: dict[str, Any] = field(default_factory=dict)


def run_members(ms, stage: str, strategy: str, *, resume: bool) -> list[LoopResult]:
    spec = registry.stage(stage).load().SPEC
    with contextlib.ExitStack() as stack:
        for _, p in ms:
            stack.enter_context(guarded(p, stage))
        envs = [stack.enter_context(StageEnv.open(p, stage)) for _, p in ms]
        return _run_members(spec, [m.name for m, _ in ms], envs, strategy, resume)


def _run_members(spec, names, envs: list[StageEnv], strategy: str, resume: bool):
    later = runtime.interruptible
    n = len(envs)
    cfg0 = envs[0].cfg
    mesh = st.member_mesh(n)
    slots = st.member_slots(n, mesh)  # n, or more: padding so that every device has as many
    member_prog = spec.program(cfg0, mesh, envs[0].target)
    varied = hyper.varied(env.cfg.model_dump(mode="json", by_alias=True) for env in envs)
    build = _member_step(spec, envs[0], mesh) if varied else None
    prog = st.stacked_program(member_prog, slots, strategy, tuple(varied), build)
    starts = [resume_point(env, resume=resume, fresh=not resume) for env in envs]
    # each member's own program: its fresh state's random stream is its seed's, its logged
    # learning rate its own
    owns = [spec.program(env.cfg, mesh, env.target) for env in envs]
    frozen_m, states_m = [], []
    for env, start, own in zip(envs, starts, owns, strict=True):
        if spec.frozen:
            fr = later(spec.frozen, env, member_prog, what="restoring the target")
            frozen_m.append(jax.device_get(fr))
        env.begin(
            fresh=start is None,
            steps=member_prog.total_steps,
            sweep={"members": n, "devices": mesh.size, "slots": slots, "strategy": strategy},
        )
        if start is None:
            inputs = later(
                lambda env=env: jax.device_get(spec.fresh_inputs(env, member_prog)),
                what="restoring the stage's inputs",
            )
            state = own.jit_make_state()(*inputs)
        else:
            restore = spec.restore or (
                lambda e, s, pr: e.restore_state(s, pr.abstract_state, pr.state_shardings)
            )
            state, _ = later(restore, env, start, member_prog, what=f"restoring step {start}")
        states_m.append(jax.device_get(state))
    start = 0 if starts[0] is None else int(starts[0])
    state = prog.put(st.pad_members(states_m, slots), prog.state_shardings)
    frozen = tuple(
        prog.put(st.pad_members([f[i] for f in frozen_m], slots), sh)
        for i, sh in enumerate(prog.frozen_shardings[: len(member_prog.frozen_shardings)])
    )
    if varied:  # the members' own values of the varied keys, one more frozen argument
        values = {k: np.asarray(st.pad_members(list(v), slots)) for k, v in varied.items()}
        frozen = (*frozen, jax.device_put(values, prog.frozen_shardings[-1]))
    runs = []
    for i, (name, env) in enumerate(zip(names, envs, strict=True)):
        run = MemberRun(name, env, env.checkpointer(), env.tracker(start))
        if varied:  # what its log reports as its learning rate is its own
            run.lr_fn = owns[i].lr_fn
        if spec.evaluation:
            fr = frozen_m[i] if frozen_m else ()
            run.eval_fn = later(spec.evaluation, env, fr, member_prog, what="preparing the eval")
        runs.append(run)
    table = getattr(cfg0, spec.name)
    try:
        loop = SweepLoop(
            stage=spec.name,
            step_fn=prog.jit(),
            state=state,
            frozen=frozen,
            total_steps=member_prog.total_steps,
            start_step=start,
            # FanOut has the Checkpointer methods the loop calls (save, wait, latest_step,
            # previous_steps); Loop annotates the concrete class
            checkpointer=cast(Checkpointer, FanOut(runs)),
            on_state=lambda **f: None,
            tracker=NoopTracker(),
            log_every=table.log_every,
            checkpoint_every=cfg0.checkpoint.every,
            max_bad_steps=table.max_bad_steps,
            eval_fn=(lambda s: {}) if spec.evaluation else None,
            eval_every=getattr(table, "eval_every", 0),
            examples_per_step=member_prog.examples_per_step,
            lr_fn=member_prog.lr_fn,
            peak_flops=peak_flops(cfg0),
            members=runs,
            finite_fn=prog.finite_fn(),
        )
        loop.on_state = loop.write_all
        return loop.run()
    finally:
        for r in runs:
            r.tracker.finish()
            if r.checkpointer is not None:
                with contextlib.suppress(Exception):
                    r.checkpointer.close()


class FanOut:
    """The members' checkpointers as one: a save splits the stacked state and saves each
    living member's part with its own meta; the steps are the first living member's."""

    def __init__(self, runs: list[MemberRun]):
        self.runs = runs

    def _alive(self) -> list[MemberRun]:
        return [r for r in self.runs if r.alive]

    def save(self, step: int, state: Any, meta: dict[str, Any] | None = None) -> None:
        host = jax.device_get(state)
        for i, r in enumerate(self.runs):
            if r.alive:
                own = {**r.env.run_meta(), **(meta or {}), "step": step}
                r.checkpointer.save(step, st.member_slice(host, i), own)

    def wait(self) -> None:
        for r in self._alive():
            r.checkpointer.wait()

    def latest_step(self) -> int | None:
        alive = self._alive() or self.runs
        return alive[0].checkpointer.latest_step()

    def previous_steps(self) -> list[int]:
        alive = self._alive() or self.runs
        return alive[0].checkpointer.previous_steps()


@dataclass
class SweepLoop(Loop):
    """The engine loop over a stacked state: what it reads per step is per member (metrics,
    bad-step counts, finiteness, evaluations), and what it writes goes to each member's own
    state, tracker and checkpoints."""

    members: list[MemberRun] = field(default_factory=list)
    finite_fn: Any = None

    def write_all(self, **fields: Any) -> None:
        for r in self.members:
            if r.alive:
                r.env.on_state(**fields)

    def _alive(self) -> list[int]:
        return [i for i, r in enumerate(self.members) if r.alive]

    def _fail_member(self, i: int, step: int, reason: str, hint: str = "") -> None:
        r = self.members[i]
        with contextlib.suppress(Exception):
            r.checkpointer.wait()
        latest = r.checkpointer.latest_step()
        r.alive = False
        fields = self._state_fields(
            step, r.metrics, self._t_start, "failed", latest, error=reason[:300]
        )
        r.env.on_state(**fields)
        kept = (
            f"its last good checkpoint is step {latest}"
            if latest is not None
            else "no checkpoint of it was saved"
        )
        notify(f"{self.stage}: member {r.name} failed: {reason}; {kept}. {hint}".rstrip())
        if not self._alive():
            raise StageFailed(f"{self.stage}: every member failed (the last: {r.name}: {reason})")

    # ---- what the loop reads -------------------------------------------------------------
    def _log(self, step: int, metrics: Any, t_log: float, n: int) -> dict[str, float]:
        # the members' rows only (padding slots, if any, come after them)
        host = jax.tree.map(lambda a: np.asarray(a)[: len(self.members)], jax.device_get(metrics))
        dt = (time.perf_counter() - t_log) / max(n, 1)
        extra = {"step_ms": dt * 1e3}
        if self.examples_per_step:
            extra["samples_per_s"] = self.examples_per_step / dt
        own_lr = any(r.lr_fn for r in self.members)  # members with other lrs: no group lr
        if self.lr_fn and not own_lr:
            extra.update(self.lr_fn(step))
        for i in self._alive():
            rec = {k: float(np.asarray(v)[i]) for k, v in host.items()}
            rec.update(extra)
            member_lr = self.members[i].lr_fn
            if member_lr:
                rec.update(member_lr(step))
            self.members[i].metrics = rec
            self.members[i].tracker.log(rec, step=step)
        mean = {k: to_float(v) for k, v in host.items()}
        return {**mean, **extra}

    def _check_bad_steps(self, steps: list[tuple[int, Any]], metrics: dict[str, float]) -> None:
        if not steps:
            return
        last = np.asarray(jax.device_get(steps[-1][1]))
        for i in self._alive():
            if last[i] < self.max_bad_steps:
                continue
            for step, x in steps:
                count = int(np.asarray(jax.device_get(x))[i])
                if count >= self.max_bad_steps:
                    self._fail_member(
                        i,
                        step,
                        f"{count} consecutive non-finite steps (max_bad_steps = "
                        f"{self.max_bad_steps}) by step {step}",
                        "Lower the learning rate or check the data.",
                    )
                    break
        steps.clear()

    def _check_state_finite(self, step: int, state: Any, metrics: dict[str, float]) -> None:
        finite = np.asarray(jax.device_get(self.finite_fn(state)))
        for i in self._alive():
            if not finite[i]:
                self._fail_member(
                    i,
                    step,
                    f"the state is not finite at step {step} (an update overflowed); "
                    "no checkpoint of it was saved",
                    "Lower the learning rate.",
                )

    def _evaluate(self, step: int, state: Any, metrics: dict[str, float]) -> dict[str, Any]:
        host = jax.device_get(state)
        for i in self._alive():
            r = self.members[i]
            try:
                ev = runtime.interruptible(
                    r.eval_fn, st.member_slice(host, i), what=f"evaluating step {step}"
                )
            except runtime.StopNow:
                raise
            except Exception as e:
                self._fail_member(i, step, f"evaluation at step {step} failed ({one_line(e, 200)})")
                continue
            r.tracker.log(flatten_metrics(ev, "eval"), step=step)
            bad = non_finite_keys(ev)
            if bad:
                self._fail_member(
                    i,
                    step,
                    f"evaluation at step {step} is not finite ({', '.join(bad[:3])})",
                    "Lower the learning rate.",
                )
                continue
            r.eval = ev
        return {"members": float(len(self._alive()))}

    # ---- what the loop writes ------------------------------------------------------------
    def _write_state(
        self, step: int, metrics: dict[str, float], t_start: float, status: str, **extra: Any
    ) -> None:
        for i in self._alive():
            r = self.members[i]
            own = dict(extra)
            if "eval" in own:
                own["eval"] = r.eval
            latest = r.checkpointer.latest_step()
            r.env.on_state(
                **self._state_fields(step, r.metrics or metrics, t_start, status, latest, **own)
            )
