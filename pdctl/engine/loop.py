"""The one training loop every stage runs.

It compiles the stage's donating step ahead of time (recording compile seconds), checks donation
on the first step, dispatches steps with no host sync between logging points (enforced with a
device-to-host transfer guard), reads metrics only at the logging cadence, checkpoints with
orbax, keeps `[state.<stage>]` current, and stops cleanly on SIGTERM/SIGINT, `--until` or too
many consecutive bad steps.

Step contract: `step(*frozen, state, batch) -> (state, metrics)` where `state` is a dict holding
at least `step`, `bad_steps` and `max_bad_run` (int32 scalars, see `guard_update`) and is
donated; `frozen` (the target parameters of warmup/train) is not.
"""

from __future__ import annotations

import collections
import contextlib
import signal
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeRemainingColumn,
)

from pdctl.engine import donation
from pdctl.engine.checkpoint import Checkpointer
from pdctl.engine.tracking import JsonlWriter, Tracker
from pdctl.errors import EXIT_INTERRUPTED, PdctlError, StageFailed


class Interrupted(PdctlError):
    """SIGTERM/SIGINT: the stage saved a checkpoint and stopped; `pdctl resume` continues."""

    exit_code = EXIT_INTERRUPTED


MAX_AHEAD = 8  # steps the host may dispatch ahead of the devices


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
    state: dict[str, Any], new: dict[str, Any], finite: jax.Array, metrics: dict[str, jax.Array]
) -> tuple[dict[str, Any], dict[str, jax.Array]]:
    """Keep `state` unchanged (but advance the step) when the step was not finite.

    Runs on the device: no host sync. `bad_steps` counts consecutive bad steps and
    `max_bad_run` remembers the longest run, so the host can check it at the logging cadence."""
    out = {
        k: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new[k], state[k])
        for k in new
        if k != "loop"
    }
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
    jsonl: JsonlWriter
    tracker: Tracker
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
    peak_flops: float | None = None
    profile: tuple[int, int] | None = None
    profile_dir: Any = None
    meta: dict[str, Any] = field(default_factory=dict)
    console: Console = field(default_factory=lambda: Console(stderr=True))
    echo: Callable[[str], None] = print
    compile_s: float = 0.0
    flops_per_step: float | None = None
    _signal: int | None = None

    # ---- compile -------------------------------------------------------------------------
    def compile(self) -> Any:
        t0 = time.perf_counter()
        batch = self._peek_batch()
        compiled = self.step_fn.lower(*self.frozen, self.state, batch).compile()
        self.compile_s = time.perf_counter() - t0
        try:
            cost = compiled.cost_analysis()
            cost = cost[0] if isinstance(cost, list | tuple) else cost
            flops = float(cost.get("flops", 0.0)) if cost else 0.0
            self.flops_per_step = flops if flops > 0 else None
        except Exception:  # cost analysis is best effort on some backends
            self.flops_per_step = None
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
    @contextlib.contextmanager
    def _signals(self):
        def handler(signum, frame):
            # The first signal asks for a clean stop after this step; later ones are ignored
            # so that a second Ctrl-C cannot cut the checkpoint save short.
            if self._signal is None:
                self._signal = signum

        old = {}
        try:
            for s in (signal.SIGTERM, signal.SIGINT):
                old[s] = signal.signal(s, handler)
        except ValueError:  # not the main thread: no signal handling
            pass
        try:
            yield
        finally:
            for s, h in old.items():
                signal.signal(s, h)

    # ---- run -----------------------------------------------------------------------------
    def run(self) -> LoopResult:
        # The handlers stay installed until the stop checkpoint and the final state are
        # written: a second SIGTERM/SIGINT must not cut that save short.
        with self._signals():
            return self._run()

    def _run(self) -> LoopResult:
        end = self.total_steps if self.until is None else min(self.until, self.total_steps)
        compiled = self.compile()
        self.on_state(
            status="running",
            compile_s={"step": round(self.compile_s, 3)},
            flops_per_step=self.flops_per_step,
        )
        step = self.start_step
        last_metrics: dict[str, float] = {}
        last_eval: dict[str, Any] = {}
        donation_fraction = None
        t_start = time.perf_counter()
        t_log, steps_since_log = time.perf_counter(), 0
        state = self.state
        self.state = None  # the loop owns the (donated) state from here on
        progress = Progress(
            TextColumn(f"[bold]{self.stage}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[info]}"),
            TimeRemainingColumn(),
            console=self.console,
            disable=not self.console.is_terminal,
        )
        tracing = False
        inflight: collections.deque = collections.deque()
        with progress:
            task = progress.add_task(self.stage, total=end, completed=step, info="")
            while step < end and self._signal is None:
                if self.profile and step == self.profile[0] and self.profile_dir:
                    jax.profiler.start_trace(str(self.profile_dir))
                    tracing = True
                batch = self._next_batch()
                check = donation_fraction is None
                if check:
                    before = donation.buffer_bytes_by_ptr(state)
                with jax.transfer_guard_device_to_host("disallow"):
                    state, metrics = compiled(*self.frozen, state, batch)
                    # Run at most MAX_AHEAD steps ahead of the devices: waiting (not copying)
                    # on an older step's scalar keeps the queue bounded, which XLA's CPU
                    # runtime needs with several simulated devices (unbounded queues of
                    # collective programs can deadlock its rendezvous) and costs nothing
                    # while the device is the bottleneck.
                    inflight.append(metrics["max_bad_run"])
                    if len(inflight) > MAX_AHEAD:
                        inflight.popleft().block_until_ready()
                if check:
                    donation_fraction, missed = donation.reused_fraction(before, state)
                    donation.report(self.stage, donation_fraction, missed, echo=self.echo)
                step += 1
                steps_since_log += 1
                if tracing and step >= self.profile[1]:
                    jax.block_until_ready(state)
                    jax.profiler.stop_trace()
                    tracing = False
                if step % self.log_every == 0 or step == end:
                    last_metrics = self._log(step, metrics, t_log, steps_since_log)
                    t_log, steps_since_log = time.perf_counter(), 0
                    progress.update(task, completed=step, info=self._info(last_metrics))
                    if last_metrics.get("max_bad_run", 0) >= self.max_bad_steps:
                        self._fail_bad_steps(step, last_metrics, t_start)
                if (
                    self.eval_fn
                    and self.eval_every
                    and (step % self.eval_every == 0 or step == self.total_steps)
                ):
                    last_eval = self.eval_fn(state)
                    self._log_eval(step, last_eval)
                if step % self.checkpoint_every == 0 or step == end:
                    self._checkpoint(step, state, last_metrics, t_start, status="running")
            if tracing:
                jax.profiler.stop_trace()
        if self.eval_fn and self.eval_every and step >= self.total_steps and not last_eval:
            # A resume that found the schedule already complete (a crash after the last
            # checkpoint) still owes the final evaluation.
            last_eval = self.eval_fn(state)
            self._log_eval(step, last_eval)
        interrupted = self._signal is not None
        self.checkpointer.wait()
        if self.checkpointer.latest_step() != step:  # a signal, or a zero-step stage
            self._checkpoint(step, state, last_metrics, t_start, status="running")
            self.checkpointer.wait()
        done = step >= self.total_steps
        status = "done" if done else "interrupted"
        self._write_state(
            step,
            last_metrics,
            t_start,
            status=status,
            eval_=last_eval,
            donation_fraction=donation_fraction,
        )
        if interrupted:
            name = signal.Signals(self._signal).name
            raise Interrupted(
                f"{self.stage}: stopped by {name} at step {step}; checkpoint saved, "
                "continue with `pdctl resume`"
            )
        return LoopResult(state, step, status, last_metrics, last_eval, donation_fraction)

    # ---- helpers -------------------------------------------------------------------------
    def _log(self, step: int, metrics: Any, t_log: float, n: int) -> dict[str, float]:
        host = jax.device_get(metrics)  # the only device->host sync, at the logging cadence
        dt = (time.perf_counter() - t_log) / max(n, 1)
        rec: dict[str, float] = {k: _to_float(v) for k, v in host.items()}
        rec["step_ms"] = dt * 1e3
        if self.examples_per_step:
            rec["samples_per_s"] = self.examples_per_step / dt
        if self.tokens_per_step:
            rec["tokens_per_s"] = self.tokens_per_step / dt
        if self.flops_per_step:
            achieved = self.flops_per_step / dt
            rec["tflops_per_s"] = achieved / 1e12
            if self.peak_flops:
                rec["mfu"] = achieved / self.peak_flops
        if self.lr_fn:
            rec.update(self.lr_fn(step))
        self.jsonl.write({"step": step, **rec})
        self.tracker.log({f"{self.stage}/{k}": v for k, v in rec.items()}, step=step)
        return rec

    def _log_eval(self, step: int, ev: dict[str, Any]) -> None:
        flat = _flatten(ev, "eval")
        self.jsonl.write({"step": step, **flat})
        self.tracker.log({f"{self.stage}/{k}": v for k, v in flat.items()}, step=step)

    def _info(self, m: dict[str, float]) -> str:
        loss = m.get("loss", float("nan"))
        return f"loss {loss:.4g}  {m.get('step_ms', 0):.2f} ms/step"

    def _checkpoint(
        self, step: int, state: Any, metrics: dict[str, float], t_start: float, status: str
    ) -> None:
        meta = dict(self.meta)
        meta["step"] = step
        if self.batches_state is not None:
            meta["data"] = self.batches_state()
        self.checkpointer.save(step, state, meta)
        self._write_state(step, metrics, t_start, status=status)

    def _write_state(
        self, step: int, metrics: dict[str, float], t_start: float, status: str, **extra: Any
    ) -> None:
        latest = self.checkpointer.latest_step()
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
        for k, v in extra.items():
            if v is not None and v != {}:
                fields[k] = v
        self.on_state(**fields)

    def _fail_bad_steps(self, step: int, metrics: dict[str, float], t_start: float) -> None:
        self.checkpointer.wait()
        self._write_state(step, metrics, t_start, status="failed")
        raise StageFailed(
            f"{self.stage}: {int(metrics['max_bad_run'])} consecutive non-finite steps "
            f"(max_bad_steps = {self.max_bad_steps}) by step {step}; the last good checkpoint "
            f"is step {self.checkpointer.latest_step()}. Lower the learning rate or check the data."
        )


def _to_float(v: Any) -> float:
    arr = np.asarray(v)
    return float(arr) if arr.size == 1 else float(arr.mean())


def _flatten(d: dict[str, Any], prefix: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}/{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out
