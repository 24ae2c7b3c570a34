"""Shared test utilities: tiny run directories, the CLI in-process, and the pretrain step built
the way `pdctl.stages.pretrain.run` builds it, on any hand-made mesh.

Import with `from helpers import ...` (pyproject's `pythonpath` puts `tests/` on sys.path).
"""

from __future__ import annotations

import copy
import os
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tomli_w
from typer.testing import CliRunner

from pdctl.engine import sharding
from pdctl.engine.checkpoint import Checkpointer
from pdctl.engine.loop import Loop
from pdctl.engine.program import StepProgram
from pdctl.engine.tracking import JsonlTracker
from pdctl.project import Project, split_state
from pdctl.stages import pretrain
from pdctl.stages.env import StageEnv
from pdctl.stages.inputs import STREAM_TARGET, stream_key, target_from_config
from pdctl.templates import create_run

TEMPLATES = ("llama-mlp", "resid-mlp", "tms")

# Tiny but structurally complete versions of each template: every site, every kind of leaf.
TINY: dict[str, dict[str, Any]] = {
    "tms": {
        "pretrain": {"steps": 20, "batch_size": 64, "log_every": 5},
        "checkpoint": {"every": 10},
        "decomp": {"sites": [{"pattern": "linear1", "C": 4}, {"pattern": "linear2", "C": 4}]},
    },
    "resid-mlp": {
        "target": {"n_features": 16, "d_embed": 32, "d_mlp": 8},
        "pretrain": {"steps": 20, "batch_size": 64, "log_every": 5},
        "checkpoint": {"every": 10},
        "decomp": {
            "sites": [
                {"pattern": "layers.*.mlp_in", "C": 8},
                {"pattern": "layers.*.mlp_out", "C": 8},
            ]
        },
    },
    "llama-mlp": {
        "target": {"d_model": 32, "d_mlp": 64, "n_layers": 1, "n_heads": 4},
        "data": {"seq_len": 16, "synthetic_bytes": 20000},
        "pretrain": {"steps": 20, "batch_size": 8, "log_every": 5},
        "checkpoint": {"every": 10},
        "decomp": {
            "sites": [
                {"pattern": "layers.*.mlp.up", "C": 8},
                {"pattern": "layers.*.mlp.down", "C": 8},
            ]
        },
    },
}


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of `base` with `over` merged in (tables merge, everything else replaces)."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def edit_config(run: Path, overrides: dict[str, Any]) -> None:
    """Merge `overrides` into the user tables of run/pdctl.toml, keeping any `[state.*]` part."""
    path = run / "pdctl.toml"
    user, state = split_state(path.read_text(encoding="utf-8"))
    raw = merge(tomllib.loads(user), overrides)
    path.write_text(tomli_w.dumps(raw) + ("\n" + state if state else ""), encoding="utf-8")


def make_run(
    parent: Path, template: str, name: str | None = None, *, tiny: bool = True, **overrides: Any
) -> Path:
    """parent/name from `template`, shrunk with TINY[template] (if `tiny`) and `overrides`
    (keyword per table: `pretrain={"steps": 8}`, `mesh={"data": 3}`)."""
    run = create_run(name or template, template, parent)
    over = merge(TINY[template], overrides) if tiny else overrides
    if over:
        edit_config(run, over)
    Project.load(run / "pdctl.toml")  # still a valid config
    return run


# ---- the CLI, in-process ---------------------------------------------------------------------


def cli(*args: str) -> Any:
    """Invoke the real Typer app in-process; the result has exit_code, stdout and stderr."""
    from pdctl.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def error_lines(result: Any) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def cli_fails(code: int, *args: Any) -> str:
    """Run the CLI: exit `code`, exactly one line on stderr (`error: ...`), no traceback; that
    line."""
    result = cli(*args)
    assert result.exit_code == code, (args, result.stdout, result.stderr, result.exception)
    assert isinstance(result.exception, SystemExit), result.exception
    lines = error_lines(result)
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert "Traceback" not in result.output
    return lines[0]


def cli_ok(*args: Any) -> Any:
    result = cli(*args)
    assert result.exit_code == 0, (args, result.stdout, result.stderr, result.exception)
    return result


def state(run: Path, stage: str) -> dict[str, Any]:
    return Project.load(run / "pdctl.toml").stage(stage)


def session_compile_cache_dir(tmp_path_factory: Any) -> Path:
    """The test session's persistent compile cache (conftest points JAX at it); also usable as
    a run's `[compile] cache_dir`, so a test's child processes share it."""
    return tmp_path_factory.getbasetemp() / "jax-session-cache"


# ---- the CLI in a fresh process --------------------------------------------------------------


def pdctl_env(devices: int = 1, **extra: str) -> dict[str, str]:
    """This environment for a child process: JAX on `devices` simulated CPU devices (the flag
    replaced, other XLA flags kept), wandb off, unbuffered output, then `extra`."""
    env = dict(os.environ)
    flags = [
        f
        for f in env.get("XLA_FLAGS", "").split()
        if "xla_force_host_platform_device_count" not in f
    ]
    flags.append(f"--xla_force_host_platform_device_count={devices}")
    env.update(
        XLA_FLAGS=" ".join(flags),
        JAX_PLATFORMS="cpu",
        WANDB_MODE="disabled",
        PYTHONUNBUFFERED="1",
        # no compile cache unless the run's `[compile] cache_dir` asks for one (pdctl's
        # default puts one in the run directory; the tests' children ran without one)
        PDCTL_COMPILE_CACHE="",
    )
    env.update(extra)
    return env


def pdctl_argv(*args: Any, project: Path | None = None) -> list[str]:
    """`python -m pdctl [--project PROJECT] ARGS` for this interpreter."""
    head = ["--project", str(project)] if project is not None else []
    return [sys.executable, "-m", "pdctl", *head, *(str(a) for a in args)]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pdctl_processes(
    n: int, *args: Any, project: Path, devices: int = 1, timeout: float = 600
) -> list[tuple[int, str]]:
    """`pdctl ARGS` as `n` processes of one jax.distributed job on localhost (each on `devices`
    CPU devices), run to completion: [(returncode, stdout + stderr)] by process id."""
    port = free_port()
    head = ("--coordinator", f"127.0.0.1:{port}", "--num-processes", n)
    procs = [
        subprocess.Popen(
            pdctl_argv(*head, "--process-id", pid, *args, project=project),
            env=pdctl_env(devices),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for pid in range(n)
    ]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    return [(p.returncode, out) for p, out in zip(procs, outs, strict=True)]


def pdctl_process(
    *args: Any,
    project: Path | None = None,
    cwd: Path | None = None,
    devices: int = 1,
    env: dict[str, str] | None = None,
    timeout: float = 600,
) -> subprocess.CompletedProcess[str]:
    """`python -m pdctl [--project PROJECT] ARGS` run to completion in a fresh process on
    `devices` CPU devices (`env` added to `pdctl_env`), with stdout/stderr captured as text.
    For a process to signal or kill, `subprocess.Popen(pdctl_argv(...), env=pdctl_env(n))`."""
    return subprocess.run(
        pdctl_argv(*args, project=project),
        cwd=cwd,
        env=pdctl_env(devices, **(env or {})),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


# ---- the pretrain step on a hand-made mesh ---------------------------------------------------


@dataclass
class Pretrain:
    """The pretrain stage's program (`pretrain.program`, what `pdctl pretrain` compiles) on
    `mesh`, with fresh sharded states and batches for it."""

    env: StageEnv
    prog: StepProgram

    @property
    def target(self) -> Any:
        return self.env.target

    @property
    def cfg(self) -> Any:
        return self.env.cfg

    @property
    def abstract(self) -> Any:
        return self.prog.abstract_state

    @property
    def state_sh(self) -> Any:
        return self.prog.state_shardings

    @property
    def abstract_params(self) -> Any:
        return self.prog.abstract_state["params"]

    @property
    def batch_sh(self) -> Any:
        return sharding.batch_sharding(self.env.mesh, 2)

    @property
    def total(self) -> int:
        return self.prog.total_steps

    @property
    def is_text(self) -> bool:
        return not self.prog.makes_own_batch

    _jits: dict[str, Any] = field(default_factory=dict)

    def _jit(self, name: str, make: Any) -> Any:
        if name not in self._jits:  # one jit object per function: repeated calls reuse its cache
            self._jits[name] = make()
        return self._jits[name]

    def init_params(self) -> Any:
        """Target params born sharded (`jit(init, out_shardings=...)`), as init-weights does."""
        sh = self.env.shardings(self.abstract_params)
        init = self._jit("init", lambda: jax.jit(self.target.init, out_shardings=sh))
        return init(stream_key(self.cfg, STREAM_TARGET))

    def init_state(self, params: Any | None = None) -> Any:
        """The whole pretrain state born sharded, as `pretrain.run` makes it."""
        params = self.init_params() if params is None else params
        make = self._jit("state", self.prog.jit_make_state)
        return make(params)

    def step_fn(self, *, donate: bool = True, target: Any = None) -> Any:
        """The jitted step exactly as `pretrain.run` compiles it. `donate=False`: the same
        step without donation; `target`: the same program around another target (not
        cached)."""
        if target is not None:
            return pretrain.program(self.cfg, self.env.mesh, target, steps=self.total).jit(donate)
        return self._jit(f"step-{donate}", lambda: self.prog.jit(donate))

    def batch(self, i: int) -> Any:
        """Batch `i`: None for the toys (generated on device from the step), else random tokens
        (a pure function of `i`) placed on the mesh."""
        if not self.is_text:
            return None
        rng = np.random.default_rng(1000 + i)
        tokens = rng.integers(
            0, self.target.vocab_size, (self.cfg.pretrain.batch_size, self.cfg.data.seq_len + 1)
        )
        return {"tokens": jax.device_put(tokens.astype(np.int32), self.batch_sh)}


def pretrain_on(run: Path, mesh: jax.sharding.Mesh, total: int | None = None) -> Pretrain:
    """The pretrain program of run/pdctl.toml on `mesh` (no lock, no checkpoints)."""
    proj = Project.load(run / "pdctl.toml")
    env = StageEnv(proj, "pretrain", mesh, target_from_config(proj.config))
    return Pretrain(env, pretrain.program(proj.config, mesh, env.target, steps=total))


def run_steps(pt: Pretrain, state: Any, n: int, step_fn: Any = None) -> tuple[Any, np.ndarray]:
    """n steps with no host sync in between; (final state, the n losses)."""
    step_fn = step_fn or pt.step_fn()
    losses = []
    for i in range(n):
        state, metrics = step_fn(state, pt.batch(i))
        losses.append(metrics["loss"])
    return state, np.asarray(jax.device_get(losses), dtype=np.float64)


def make_loop(
    step_fn: Any,
    state: Any,
    directory: Path,
    *,
    total: int,
    log_every: int,
    batches: Iterator[Any] | None = None,
    **kw: Any,
) -> tuple[Loop, list[str], list]:
    """A `Loop` writing into `directory`; returns it with its echo lines and on_state calls."""
    echoed: list[str] = []
    states: list[dict[str, Any]] = []
    loop = Loop(
        stage="pretrain",
        step_fn=step_fn,
        state=state,
        total_steps=total,
        checkpointer=Checkpointer(directory / "ckpt", keep=2),
        on_state=lambda **f: states.append(f),
        tracker=JsonlTracker(directory / "metrics.jsonl"),
        log_every=log_every,
        checkpoint_every=kw.pop("checkpoint_every", total),
        batches=batches,
        echo=echoed.append,
        **kw,
    )
    return loop, echoed, states


# ---- a fresh train step ----------------------------------------------------------------------


def fresh_train_state(cfg: Any, mesh: Any, tokens: np.ndarray) -> tuple[Any, ...]:
    """(target, train program, random target params, fresh train state, the batch of `tokens`
    (B, T + 1), number of sites) for `cfg` on `mesh`: a train step ready to run, no run
    directory (an imported target needs only its config.json)."""
    from pdctl.stages import train
    from pdctl.stages.init_weights import init_decomposition
    from pdctl.stages.inputs import STREAM_DECOMP

    target = target_from_config(cfg, need_weights=False)
    prog = train.program(cfg, mesh, target)
    params = jax.jit(target.init, out_shardings=prog.frozen_shardings[0])(jax.random.key(0))
    dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
    state = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
    batch = jax.device_put({"tokens": tokens}, prog.batch_shardings)
    return target, prog, params, state, batch, len(dec["components"])


def harvest_rows(path: Path) -> list[str]:
    """Every row of a harvest.db as SQL, but the time it was written: two harvests that did
    the same work compare equal."""
    from pdctl.harvest import db

    con = db.open_readonly(path)
    try:
        return [r for r in con.iterdump() if "INSERT" in r and "'created'" not in r]
    finally:
        con.close()


def harvest_labels(run: Path) -> dict:
    """The labels in the run's harvest.db (`db.read_labels`' form)."""
    from pdctl.harvest import db

    con = db.open_readonly(run / "harvest" / "harvest.db")
    try:
        return db.read_labels(con)
    finally:
        con.close()
