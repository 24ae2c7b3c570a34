"""Tiny run directories and the train steps inside them, for pdctl's tests and benchmarks:
`make_run` (a template shrunk to seconds a stage, `TINY`), `edit_config`, the pretrain program
on any hand-made mesh (`pretrain_on`, `Pretrain`), a `Loop` writing into a directory
(`make_loop`) and a fresh train step with no run directory (`fresh_train_state`).
"""

from __future__ import annotations

import copy
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np
import tomli_w

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
