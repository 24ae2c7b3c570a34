"""The one training loop every stage runs.

It compiles the stage's donating step ahead of time (recording compile seconds), checks donation
on the first step, dispatches steps with no host sync between logging points (enforced with a
device-to-host transfer guard), reads metrics only at the logging cadence, checkpoints with
orbax, keeps `[state.<stage>]` current, and stops cleanly on SIGTERM/SIGINT, `--until` or too
many consecutive bad steps.

Every step's consecutive-bad-step count (computed on the device) is read once that step has
completed, MAX_AHEAD steps behind the dispatch: the run fails at exactly `max_bad_steps`, not at
the next logging point, without stalling the queue. Nothing non-finite is kept: before every
evaluation and checkpoint the state is checked finite on the device, and an evaluation that
raises or returns a non-finite number fails the stage. A failure of any kind (those, an XLA
error, out of memory) ends as status `failed` with the last good checkpoint and one line
(`StageFailed`, exit 1).

A stop request (SIGTERM/SIGINT) is acted on between steps with a stop checkpoint, and during
the long calls into C++ as well: the step's compile and every evaluation run `interruptible`
(engine.runtime), so a stop that comes while one of them runs ends the stage within seconds,
`interrupted` at its last checkpoint, leaving that call behind. Under jax.distributed every
process stops at the same step (JAX's preemption sync point). A signal that comes after the
last step changes nothing: the stage is done.

Step contract: `step(*frozen, state, batch) -> (state, metrics)` where `state` is a dict holding
at least `step`, `bad_steps` and `max_bad_run` (int32 scalars, see `guard_update`) and is
donated; `frozen` (the target parameters of warmup/train) is not.
"""

from __future__ import annotations

import collections
import contextlib
import json
import os
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, NoReturn

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from pdctl.engine import donation, measure, peers, runtime
from pdctl.engine.checkpoint import Checkpointer
from pdctl.engine.tracking import Tracker
from pdctl.errors import EXIT_INTERRUPTED, PdctlError, StageFailed, one_line


class Interrupted(PdctlError):
    """SIGTERM/SIGINT: the stage saved a checkpoint and stopped; `pdctl resume` continues."""

    exit_code = EXIT_INTERRUPTED


MAX_AHEAD = 8  # steps the host may dispatch ahead of the devices
# the loss terms a text log line shows, where the step has them
LINE_TERMS = ("faithfulness", "stochastic_recon", "stochastic_recon_layerwise", "merged_recon",
              "chunkwise_recon", "ppgd_recon", "importance_minimality", "frequency")  # fmt: skip


def loop_counters(rng: jax.Array) -> dict[str, jax.Array]:
    """`state["loop"]`: the step counter, bad-step counters and the run's base RNG key.

    Every random draw of a step derives from `fold_in(rng, step)`, so a step is a pure function
    of the state and resuming from a checkpoint continues exactly."""
    z = jnp.zeros((), jnp.int32)
    return {"step": z, "bad_steps": z, "max_bad_run": z, "rng": rng}


def all_finite(*trees: Any) -> jax.Array:
    leaves = [x for t in trees for x in jax.tree.leaves(t)]
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in leaves]))


def guard_update(
    state: dict[str, Any],
    new: dict[str, Any] | Callable[[], dict[str, Any]],
    finite: jax.Array,
    metrics: dict[str, jax.Array],
) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """Keep `state` unchanged (but advance the step) when the step was not finite.

    `new` holds the new values of the keys the step updates, or is a function that computes
    them (the optimizer update): that function runs inside `lax.cond(finite, ...)`, so a bad
    step computes nothing and a good one writes the donated buffers in place. (A select,
    `where(finite, new, old)`, needs old and new alive together: XLA then keeps copies of the
    donated state, measured in benchmarks/memory/donation.py.)

    Runs on the device: no host sync. `bad_steps` counts consecutive bad steps and
    `max_bad_run` remembers the longest run, so the host can check it every step."""
    if callable(new):
        keys = tuple(jax.eval_shape(new))
        old = {k: state[k] for k in keys}
        out = jax.lax.cond(finite, lambda o: new(), lambda o: o, old)
    else:
        out = {
            k: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new[k], state[k])
            for k in new
            if k != "loop"
        }
    out = dict(out)
    for k in state:
        out.setdefault(k, state[k])
    loop = state["loop"]
    bad = jnp.where(finite, 0, loop["bad_steps"] + 1).astype(jnp.int32)
    max_bad = jnp.maximum(loop["max_bad_run"], bad)
    out["loop"] = {**loop, "step": loop["step"] + 1, "bad_steps": bad, "max_bad_run": max_bad}
    metrics = {**metrics, "finite": finite.astype(jnp.float32), "max_bad_run": max_bad}
    return out, metrics


@dataclass
class LoopResult:
    state: Any
    step: int
    status: str
    metrics: dict[str, float] = field(default_factory=dict)
    eval: dict[str, Any] = field(default_factory=dict)
    donation_fraction: float | None = None


@dataclass
class Loop:
    stage: str
    step_fn: Any  # jax.jit(...) with in/out shardings and donation
    state: Any
    total_steps: int
    checkpointer: Checkpointer
    on_state: Callable[..., None]  # writes [state.<stage>] (no-op off process 0)
    tracker: Tracker  # jsonl + wandb (process 0), or a no-op
    frozen: tuple[Any, ...] = ()
    start_step: int = 0
    until: int | None = None
    log_every: int = 100
    checkpoint_every: int = 1000
    batches: Iterator[Any] | None = None  # device batches; None = generated inside the step
    batches_state: Callable[[], Any] | None = None  # JSON state of `batches` after the last get
    max_bad_steps: int = 10
    eval_fn: Callable[[Any], dict[str, Any]] | None = None
    eval_every: int = 0
    examples_per_step: int = 0
    tokens_per_step: int = 0
    lr_fn: Callable[[int], dict[str, float]] | None = None
    peak_flops: float | None = None  # one device's peak FLOP/s
    profile: tuple[int, int] | None = None
    profile_dir: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    # the checkpoint resumed from was saved by a stop during its step's evaluation: that
    # evaluation is done first (`_stopped_evaluating`)
    eval_owed: bool = False
    # set when the step's compile ahead on a host thread (`engine.ahead`) has ended: the loop
    # waits for it before its own compile, which then finds the executable in process; the wait
    # counts as the step's compile time. None: the step is not compiled ahead
    compiled_ahead: Any = None
    # "auto" (a progress bar on a terminal, else `text`), "text" (a line when the step compiles
    # and each logging step and evaluation) or "json" (the same records as JSON lines): `pdctl
    # --log-format`, through $PDCTL_LOG_FORMAT so that a supervised stage process sees it
    log_format: str = field(
        default_factory=lambda: os.environ.get(runtime.LOG_FORMAT_ENV) or "auto"
    )
    console: Console = field(default_factory=lambda: Console(stderr=True))
    echo: Callable[[str], None] = print
    compile_s: float = 0.0
    cache_hit: bool = False  # the step was read from the persistent compile cache
    flops_per_step: float | None = None
    _signal: int | None = None
    _step: int = 0  # the last step dispatched (for the state written when a step fails)
    _t_start: float = field(default_factory=time.perf_counter)
    _finite_fn: Any = None

    # ---- compile -------------------------------------------------------------------------
    def compile(self, state: Any = None) -> Any:
        t0 = time.perf_counter()
        ready = self.compiled_ahead
        if ready is not None and not ready.is_set():
            self._say("compile_wait", "waiting for the step compiling ahead")
            runtime.interruptible(ready.wait, what="compiling the step")
        batch = self._peek_batch()
        state = self.state if state is None else state
        args = (*self.frozen, state, batch)
        if hasattr(self.step_fn, "trace"):  # a jax.jit: its jaxpr gives the matmul FLOPs
            traced = self.step_fn.trace(*args)
            lowered, jaxpr = traced.lower(), traced.jaxpr
        else:  # anything else with .lower (a wrapper): XLA's count
            lowered, jaxpr = self.step_fn.lower(*args), None
        # XLA's compile is one long C++ call: a stop request is still acted on during it
        with cache_events() as counts:
            compiled = runtime.interruptible(lowered.compile, what="compiling the step")
        self.cache_hit = counts.get("hits", 0) > 0
        self.compile_s = time.perf_counter() - t0
        self.flops_per_step = measure.flops_per_device(jaxpr, compiled, jax.device_count())
        return compiled

    _peeked: Any = None

    def _peek_batch(self) -> Any:
        if self.batches is None:
            return None
        if self._peeked is None:
            self._peeked = next(self.batches)
        return self._peeked

    def _next_batch(self) -> Any:
        if self.batches is None:
            return None
        if self._peeked is not None:
            b, self._peeked = self._peeked, None
            return b
        return next(self.batches)

    # ---- signals -------------------------------------------------------------------------
    def _signals(self):
        # Process-wide and re-entrant: `pdctl <stage>` installs them before it restores or
        # compiles anything; a Loop run on its own installs them for its run.
        return runtime.stop_signals()

    def _stopping(self) -> bool:
        """Stop now? Asked before the first step and once per step, identically on every
        process: under jax.distributed all processes answer yes at the same step."""
        if self._signal is None:
            self._signal = runtime.agreed_stop(self._step)
        return self._signal is not None

    # ---- run -----------------------------------------------------------------------------
    def run(self) -> LoopResult:
        # The handlers stay installed until the stop checkpoint and the final state are
        # written: a second SIGTERM/SIGINT must not cut that save short.
        with self._signals():
            try:
                return self._run()
            except runtime.StopNow as e:  # a compile or evaluation was left running
                self._left_running(e)
            except PdctlError:
                raise  # Interrupted, StageFailed, and user errors: already said and written
            except Exception as e:  # an XLA error, out of memory, a failing data source, ...
                self._fail(self._step, describe_exception(self.stage, e), cause=e)

    def _run(self) -> LoopResult:
        end = self._end
        step = self._step = self.start_step
        self._t_start = t_start = time.perf_counter()
        state = self.state
        self.state = None  # the loop owns the (donated) state from here on
        if self._stopping():  # stopped while restoring: save where it stands, compile nothing
            return self._finish(step, state, {}, {}, None)
        owed: dict[str, Any] = {}
        if self.eval_owed and self.eval_fn:
            self._check_state_finite(step, state, {})
            owed = self._evaluate(step, state, {})
        if step >= end:
            # Nothing to step (warmup at `steps = 0`, a schedule already complete, `--until`
            # reached): no program is compiled; the stage saves and ends as it stands.
            return self._finish(step, state, {}, owed, None)
        self._say("compile", "compiling the step")
        compiled = self.compile(state)
        how = "read from the compile cache" if self.cache_hit else "compiled"
        line = f"step {how} in {self.compile_s:.1f} s"
        if self.compiled_ahead is not None:  # its own compile found it in process
            line = f"step compiled ahead; {self.compile_s:.1f} s spent waiting for it"
        self._say("compiled", line, seconds=self.compile_s, cache_hit=self.cache_hit)
        self.on_state(
            status="running",
            compile_s={"step": round(self.compile_s, 3)},
            flops_per_step=self.flops_per_step,
        )
        last_metrics: dict[str, float] = {}
        last_eval: dict[str, Any] = owed
        donation_fraction = None
        t_start = self._t_start = time.perf_counter()
        t_log, steps_since_log = time.perf_counter(), 0
        # Seconds of the current logging window spent evaluating and checkpointing: not step
        # time, so the logged ms a step, tokens/s and MFU leave them out (an evaluation at the
        # step before the run's last line made that one step read "13462.6 ms/step").
        paused = 0.0
        progress = Progress(
            TextColumn(f"[bold]{self.stage}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=self.console,
            disable=self._lines() is not None,
        )
        tracing = False
        # (step, its max_bad_run) of the steps dispatched but not yet waited on, and of the
        # steps waited on but not yet read.
        inflight: collections.deque = collections.deque()
        unread: list[tuple[int, Any]] = []
        with progress:
            task = progress.add_task(self.stage, total=end, completed=step, info="")
            while step < end and not self._stopping():
                if self.profile and step == self.profile[0] and self.profile_dir:
                    jax.profiler.start_trace(str(self.profile_dir))
                    tracing = True
                batch = self._next_batch()
                check = donation_fraction is None
                if check:
                    before = donation.buffer_bytes_by_ptr(state)
                with jax.transfer_guard_device_to_host("disallow"):
                    state, metrics = compiled(*self.frozen, state, batch)
                step += 1
                self._step = step
                inflight.append((step, metrics["max_bad_run"]))
                # Run at most MAX_AHEAD steps ahead of the devices: waiting on a step that is
                # MAX_AHEAD behind costs nothing while the device is the bottleneck and keeps
                # the queue bounded (XLA's CPU runtime needs that with several simulated
                # devices: unbounded queues of collective programs can deadlock its
                # rendezvous). Every MAX_AHEAD steps, the bad-step counts of the steps waited on
                # are checked (one read; on a failure each is read to find the step where the
                # run reached max_bad_steps, exactly), not only at the next logging point.
                if len(inflight) > MAX_AHEAD:
                    done = inflight.popleft()
                    done[1].block_until_ready()
                    unread.append(done)
                    if len(unread) >= MAX_AHEAD:
                        self._check_bad_steps(unread, last_metrics)
                if check:
                    donation_fraction, missed = donation.reused_fraction(before, state)
                    donation.report(self.stage, donation_fraction, missed, echo=self.echo)
                    self._first_step(step, state)
                steps_since_log += 1
                if check and step % self.log_every and step != end:
                    # The first step of a process (waited on above) is not a step's time: the
                    # executable's load and first-run work (after a resume on a v5e: 608 ms
                    # for a 264 ms step). The first window starts after it, unless it is the
                    # only step the window has.
                    t_log, steps_since_log, paused = time.perf_counter(), 0, 0.0
                if tracing and self.profile is not None and step >= self.profile[1]:
                    jax.block_until_ready(state)
                    jax.profiler.stop_trace()
                    tracing = False
                log_due = step % self.log_every == 0 or step == end
                eval_due = bool(
                    self.eval_fn
                    and self.eval_every
                    and (step % self.eval_every == 0 or step == self.total_steps)
                )
                ckpt_due = step % self.checkpoint_every == 0 or step == end
                if log_due:
                    last_metrics = self._log(step, metrics, t_log + paused, steps_since_log)
                    t_log, steps_since_log, paused = time.perf_counter(), 0, 0.0
                    progress.update(task, completed=step, info=self._info(last_metrics))
                if log_due or eval_due or ckpt_due:
                    # every step up to here, before anything is evaluated or saved
                    unread.extend(inflight)
                    inflight.clear()
                    self._check_bad_steps(unread, last_metrics)
                if eval_due or ckpt_due:
                    self._check_state_finite(step, state, last_metrics)
                    t_pause = time.perf_counter()  # the steps before are done (waited on above)
                    if eval_due:
                        last_eval = self._evaluate(step, state, last_metrics)
                    if ckpt_due:
                        self._checkpoint(step, state, last_metrics, t_start, status="running")
                    paused += time.perf_counter() - t_pause
            if tracing:
                jax.profiler.stop_trace()
            unread.extend(inflight)
            self._check_bad_steps(unread, last_metrics)
        return self._finish(step, state, last_metrics, last_eval, donation_fraction)

    def _finish(
        self,
        step: int,
        state: Any,
        last_metrics: dict[str, float],
        last_eval: dict[str, Any],
        donation_fraction: float | None,
    ) -> LoopResult:
        """The end of a run: the evaluation still owed, the stop checkpoint, the final state."""
        if self.eval_fn and self.eval_every and step >= self.total_steps and not last_eval:
            # A resume that found the schedule already complete (a crash after the last
            # checkpoint) still owes the final evaluation.
            self._check_state_finite(step, state, last_metrics)
            last_eval = self._evaluate(step, state, last_metrics)
        # A stop seen by the loop (not one that came after its last step: a finished stage
        # is done, whatever arrives while it writes its end).
        interrupted = self._signal is not None
        self.checkpointer.wait()
        if self.checkpointer.latest_step() != step:  # a signal, or a zero-step stage
            self._check_state_finite(step, state, last_metrics)
            self._checkpoint(step, state, last_metrics, self._t_start, status="running")
            self.checkpointer.wait()
        done = step >= self.total_steps
        status = "done" if done else "interrupted"
        self._write_state(
            step,
            last_metrics,
            self._t_start,
            status=status,
            eval=last_eval,
            donation_fraction=donation_fraction,
        )
        if interrupted and not done:
            assert self._signal is not None  # what `interrupted` says
            name = signal.Signals(self._signal).name
            raise Interrupted(
                f"{self.stage}: stopped by {name} at step {step}; checkpoint saved, "
                "continue with `pdctl resume`"
            )
        return LoopResult(state, step, status, last_metrics, last_eval, donation_fraction)

    # ---- health: nothing non-finite is saved, evaluated or carried on with ----------------
    def _check_bad_steps(self, steps: list[tuple[int, Any]], metrics: dict[str, float]) -> None:
        """Fail at the first of `steps` (step, its max_bad_run; in order) whose longest run of
        non-finite steps reached max_bad_steps, then forget them. max_bad_run never decreases,
        so the last one answers for all: the others are read only when it says a run did."""
        if not steps:
            return

        def value(x: Any) -> int:
            return int(np.asarray(jax.device_get(x)))

        if value(steps[-1][1]) >= self.max_bad_steps:
            for step, x in steps:
                n = value(x)
                if n >= self.max_bad_steps:
                    self._fail(
                        step,
                        f"{n} consecutive non-finite steps (max_bad_steps = "
                        f"{self.max_bad_steps}) by step {step}",
                        metrics=metrics,
                        hint="Lower the learning rate or check the data.",
                    )
        steps.clear()

    def _check_state_finite(self, step: int, state: Any, metrics: dict[str, float]) -> None:
        if self._finite_fn is None:
            # Replicated out: every process of a multi-host run can read the answer.
            mesh = next(
                (
                    x.sharding.mesh
                    for x in jax.tree.leaves(state)
                    if isinstance(getattr(x, "sharding", None), NamedSharding)
                ),
                None,
            )
            out = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None
            self._finite_fn = jax.jit(state_is_finite, out_shardings=out)
        if not bool(jax.device_get(self._finite_fn(state))):
            self._fail(
                step,
                f"the state is not finite at step {step} (an update overflowed); "
                "no checkpoint of it was saved",
                metrics=metrics,
                hint="Lower the learning rate.",
            )

    def _evaluate(self, step: int, state: Any, metrics: dict[str, float]) -> dict[str, Any]:
        try:
            # compiles its programs on the first call, and can run long: stays interruptible
            ev = runtime.interruptible(self.eval_fn, state, what=f"evaluating step {step}")
        except runtime.StopNow as e:
            self._stopped_evaluating(step, state, metrics, e)
        except Exception as e:
            self._fail(
                step, f"evaluation at step {step} failed ({one_line(e, 200)})", metrics, cause=e
            )
        bad = non_finite_keys(ev)
        if bad:
            self._log_eval(step, ev)
            self._fail(
                step,
                f"evaluation at step {step} is not finite ({', '.join(bad[:3])})",
                metrics=metrics,
                hint="Lower the learning rate.",
            )
        flat = {k: v for k, v in self._log_eval(step, ev).items() if _is_number(v)}
        keys = ("ce", "kl", "l0", "recovered", "mmcs", "ci_errors")
        shown = [f"{k[5:]} {v:.4g}" for k, v in flat.items() if k[5:].startswith(keys)]
        text = f"evaluation at step {step}: " + ", ".join(shown[:12])
        self._say("eval", text, **{**flat, "step": step})
        return ev

    def _first_step(self, step: int, state: Any) -> None:
        """The first step of this run has finished: how long after the `pdctl` command started
        (restores, compiles and earlier stages of `pdctl run` included), in `[state.<stage>]
        first_step_s` and one line. The one wait on a step outside the logging cadence."""
        jax.block_until_ready(state)
        first = round(time.time() - runtime.started(), 3)
        self.on_state(first_step_s=first)
        text = (
            f"step {step} done {first:.1f} s after pdctl started "
            f"(the step compiled in {self.compile_s:.1f} s)"
        )
        if self._lines() == "json":
            self._say("first_step", text, step=step, first_step_s=first)
        else:  # on a terminal too: the one line that says how long the wait was
            self.echo(f"{self.stage}: {text}")

    def _stopped_evaluating(
        self, step: int, state: Any, metrics: dict[str, float], e: runtime.StopNow
    ) -> NoReturn:
        """A stop came while step `step` was evaluated and the evaluation did not end within
        the grace. An evaluation donates nothing, so the state in hand is whole (and was checked
        finite before it): it is saved as checkpoint `step`, marked with the evaluation it owes,
        and the stage ends `interrupted` (exit 3). `pdctl resume` continues from that step and
        evaluates it first: no step since the last checkpoint is lost. The evaluation is left
        running on its thread (the process then ends with os._exit)."""
        self._signal = e.signum
        self.checkpointer.wait()
        if self.checkpointer.latest_step() != step:  # else: resumed from it, still owed
            self._checkpoint(step, state, metrics, self._t_start, status="running", owed=True)
            self.checkpointer.wait()
        self._write_state(step, metrics, self._t_start, status="interrupted")
        raise Interrupted(
            f"{self.stage}: stopped by {e.name} while evaluating step {step}; checkpoint of "
            f"step {step} saved, continue with `pdctl resume` (it evaluates step {step} first)"
        )

    def _left_running(self, e: runtime.StopNow) -> NoReturn:
        """A stop came while a compile or an evaluation ran, and it did not end within the
        grace: status `interrupted` at the last complete checkpoint (nothing new is saved: the
        state in hand may be mid-way between checkpoints, and a save takes time), exit 3."""
        latest = self.checkpointer.latest_step()
        step = latest if latest is not None else self.start_step
        with contextlib.suppress(Exception):
            self.on_state(
                status="interrupted",
                step=step,
                checkpoint=latest,
                wall_s=round(time.perf_counter() - self._t_start + self.compile_s, 3),
            )
        where = f"{self.stage}: stopped by {e.name} while {e.what} (left unfinished)"
        if latest is not None:
            kept = f"the last checkpoint, step {latest}, is kept; continue with `pdctl resume`"
        else:
            kept = "no checkpoint of this run was saved; `pdctl resume` starts it over"
            kept += self._previous_kept()
        raise Interrupted(f"{where}; {kept}") from None

    def _fail(
        self,
        step: int,
        reason: str,
        metrics: dict[str, float] | None = None,
        hint: str = "",
        cause: BaseException | None = None,
    ) -> NoReturn:
        """Status `failed`, the last good checkpoint kept (every save is checked finite), and
        one line saying so (exit 1)."""
        if cause is not None:  # a collective whose peer died: the lost process is the news
            peers.settle()
        with contextlib.suppress(Exception):  # a save in flight finishes, or is abandoned
            self.checkpointer.wait()
        latest = self.checkpointer.latest_step()
        with contextlib.suppress(Exception):
            self._write_state(
                step, metrics or {}, self._t_start, status="failed", error=reason[:300]
            )
        if latest is not None:
            kept = f"the last good checkpoint is step {latest}"
        else:
            kept = "no checkpoint of this run was saved" + self._previous_kept()
        raise StageFailed(f"{self.stage}: {reason}; {kept}." + (f" {hint}" if hint else "")) from (
            cause
        )

    # ---- helpers -------------------------------------------------------------------------
    def _previous_kept(self) -> str:
        """' (the previous run's, up to step N, are kept)' when a fresh run that saved nothing
        yet still has the previous run's checkpoints aside; '' otherwise."""
        with contextlib.suppress(Exception):
            prev = self.checkpointer.previous_steps()
            if prev:
                return f" (the previous run's, up to step {prev[-1]}, are kept)"
        return ""

    def _log(self, step: int, metrics: Any, t_log: float, n: int) -> dict[str, float]:
        host = jax.device_get(metrics)  # the only device->host sync, at the logging cadence
        dt = (time.perf_counter() - t_log) / max(n, 1)
        rec: dict[str, float] = {k: to_float(v) for k, v in host.items()}
        rec["step_ms"] = dt * 1e3
        if self.examples_per_step:
            rec["samples_per_s"] = self.examples_per_step / dt
        if self.tokens_per_step:
            rec["tokens_per_s"] = self.tokens_per_step / dt
        if self.flops_per_step:
            # flops_per_step is one device's share of the step's matmul FLOPs (a scan's body
            # counted per iteration); peak_flops is one device's peak.
            rec["tflops_per_s"] = self.flops_per_step * jax.device_count() / dt / 1e12
            if self.peak_flops:
                rec["mfu"] = measure.mfu(self.flops_per_step, dt, self.peak_flops)
        if self.lr_fn:
            rec.update(self.lr_fn(step))
        self.tracker.log(rec, step=step)
        self._say_step(step, rec, dt)
        return rec

    # ---- log lines off a terminal --------------------------------------------------------
    @property
    def _end(self) -> int:
        """The step this run stops at: the schedule's end, or `--until` before it."""
        return self.total_steps if self.until is None else min(self.until, self.total_steps)

    def _lines(self) -> str | None:
        """ "text" or "json" when the loop prints log lines, None for the progress bar."""
        fmt = self.log_format if self.log_format in runtime.LOG_FORMATS else "auto"
        if fmt == "auto":
            return None if self.console.is_terminal else "text"
        return fmt

    def _say(self, event: str, text: str, **fields: Any) -> None:
        fmt = self._lines()
        if fmt == "json":
            self.echo(json.dumps({"stage": self.stage, "event": event, **fields}))
        elif fmt == "text":
            self.echo(f"{self.stage}: {text}")

    def _say_step(self, step: int, rec: dict[str, float], dt: float) -> None:
        """One line a logging step: step / total, loss, the loss terms, L0 (mean over the
        sites), ms a step, tokens/s, MFU, and the time left at this pace."""
        if self._lines() is None:
            return
        end = self._end
        eta = max(end - step, 0) * dt
        l0 = [v for k, v in rec.items() if k.startswith("l0/")]
        fields = {"step": step, "steps": end, **rec, "eta_s": round(eta, 1)}  # rec has no step
        if l0:
            fields["l0_mean"] = float(np.mean(l0))
        parts = [f"step {step}/{end}", f"loss {rec.get('loss', float('nan')):.4g}"]
        parts += [f"{k} {rec[k]:.4g}" for k in LINE_TERMS if k in rec]
        if l0:
            parts.append(f"L0 {fields['l0_mean']:.4g}")
        parts.append(f"{rec['step_ms']:.1f} ms/step")
        if "tokens_per_s" in rec:
            parts.append(f"{rec['tokens_per_s']:,.0f} tokens/s")
        if "mfu" in rec:
            parts.append(f"MFU {rec['mfu']:.2f}")
        h, rest = divmod(round(eta), 3600)
        parts.append(f"ETA {h}:{rest // 60:02d}:{rest % 60:02d}")
        self._say("step", "  ".join(parts), **fields)

    def _log_eval(self, step: int, ev: dict[str, Any]) -> dict[str, Any]:
        flat = flatten_metrics(ev, "eval")
        self.tracker.log(flat, step=step)
        return flat

    def _info(self, m: dict[str, float]) -> str:
        loss = m.get("loss", float("nan"))
        return f"loss {loss:.4g}  {m.get('step_ms', 0):.2f} ms/step"

    def _checkpoint(
        self,
        step: int,
        state: Any,
        metrics: dict[str, float],
        t_start: float,
        status: str,
        owed: bool = False,
    ) -> None:
        meta = dict(self.meta)
        meta["step"] = step
        if owed:  # its evaluation was cut short by a stop: a resume does it first
            meta["eval_owed"] = True
        if self.batches_state is not None:
            meta["data"] = self.batches_state()
        self.checkpointer.save(step, state, meta)
        self._write_state(step, metrics, t_start, status=status)

    def _write_state(
        self, step: int, metrics: dict[str, float], t_start: float, status: str, **extra: Any
    ) -> None:
        latest = self.checkpointer.latest_step()
        self.on_state(**self._state_fields(step, metrics, t_start, status, latest, **extra))

    def _state_fields(
        self,
        step: int,
        metrics: dict[str, float],
        t_start: float,
        status: str,
        latest: int | None,
        **extra: Any,
    ) -> dict[str, Any]:
        """The `[state.<stage>]` fields of a write at `step`."""
        fields: dict[str, Any] = {
            "status": status,
            "step": step,
            "steps": self.total_steps,
            "checkpoint": latest,
            "metrics": {k: v for k, v in metrics.items() if np.isfinite(v)},
            "wall_s": round(time.perf_counter() - t_start + self.compile_s, 3),
        }
        if "step_ms" in metrics:
            fields["step_ms"] = round(metrics["step_ms"], 4)
        if "mfu" in metrics:
            fields["mfu"] = metrics["mfu"]
        peak = measure.device_peak_bytes(jax.local_devices())
        if peak is not None:  # an accelerator's; XLA:CPU keeps no statistics
            fields["device_peak_gib"] = round(peak / 2**30, 3)
        for k, v in extra.items():
            if v is not None and v != {}:
                fields[k] = v
        return fields


@contextlib.contextmanager
def cache_events() -> Iterator[dict[str, int]]:
    """{"hits": n, "misses": n}: JAX's persistent compile cache lookups while the block runs
    (from `jax.monitoring`'s events, counted on any thread)."""
    counts: dict[str, int] = {}
    names = {"/jax/compilation_cache/cache_hits": "hits",
             "/jax/compilation_cache/cache_misses": "misses"}  # fmt: skip

    def listen(event: str, **_: Any) -> None:
        if event in names:
            counts[names[event]] = counts.get(names[event], 0) + 1

    jax.monitoring.register_event_listener(listen)
    try:
        yield counts
    finally:
        jax.monitoring.unregister_event_listener(listen)


def state_is_finite(state: Any) -> jax.Array:
    """True when every floating-point leaf of `state` is finite (on the device)."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for x in jax.tree.leaves(state)
        if jnp.issubdtype(jnp.asarray(x).dtype, jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def non_finite_keys(d: Any, prefix: str = "") -> list[str]:
    """The keys of an evaluation whose numbers are not finite."""
    out: list[str] = []
    if isinstance(d, dict):
        for k, v in d.items():
            out += non_finite_keys(v, f"{prefix}{k}" if not prefix else f"{prefix}.{k}")
        return out
    try:
        arr = np.asarray(d, dtype=np.float64)
    except (TypeError, ValueError):
        return out
    if not np.all(np.isfinite(arr)):
        out.append(prefix or "value")
    return out


def describe_exception(stage: str, e: BaseException) -> str:
    """One line for an unexpected exception in a stage; out of memory says what to change."""
    text = str(e)
    if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower():
        first = " ".join(text.split())[:160]
        return (
            f"out of memory ({first}); lower {stage}.batch_size, raise "
            f"{stage}.grad_accum_steps, or shard over more devices ([mesh])"
        )
    return f"{one_line(e, 200)} (PDCTL_TRACEBACK=1 shows where)"


def _is_number(v: Any) -> bool:
    return isinstance(v, int | float | np.number) and not isinstance(v, bool)


def to_float(v: Any) -> float:
    arr = np.asarray(v)
    return float(arr) if arr.size == 1 else float(arr.mean())


def flatten_metrics(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}/{k}"
        if isinstance(v, dict):
            out.update(flatten_metrics(v, key))
        else:
            out[key] = v
    return out
