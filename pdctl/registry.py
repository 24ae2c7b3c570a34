"""The stages of a run, in one table: everything that needs to know which stages there are, in
what order, what each needs first and which config tables it depends on reads it from here.

Plain data: this module imports no JAX and nothing of pdctl, so the config schema and `pdctl new`
can read it. `Stage.load()` imports the module that runs a stage, when it is to run.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from types import ModuleType


@dataclass(frozen=True)
class Stage:
    name: str  # as in [state.<name>], checkpoints/<name>/, metrics/<name>.jsonl
    command: str  # `pdctl <command>`
    requires: tuple[str, ...]  # stages that must be done before this one runs
    # Config tables this stage's result depends on, beyond those of the stages before it (a stage
    # is stale when anything upstream of it changed). Mesh, tracking, checkpoint cadence and the
    # compile cache do not change results.
    tables: tuple[str, ...]
    exports: tuple[str, ...]  # the checkpoint items `pdctl export` writes
    module: str  # the module whose `run(project, ...)` runs it

    def load(self) -> ModuleType:
        return importlib.import_module(self.module)


_TABLE = (
    Stage(
        name="init_weights",
        command="init-weights",
        requires=(),
        tables=("run", "target", "data", "decomp", "precision"),
        exports=("target", "components", "ci_fns", "sources"),
        module="pdctl.stages.init_weights",
    ),
    Stage(
        name="pretrain",
        command="pretrain",
        requires=("init_weights",),
        tables=("pretrain",),
        exports=("params",),
        module="pdctl.stages.pretrain",
    ),
    Stage(
        name="warmup",
        command="warmup",
        requires=("init_weights", "pretrain"),
        tables=("warmup",),
        exports=("components",),
        module="pdctl.stages.warmup",
    ),
    Stage(
        name="train",
        command="train",
        requires=("init_weights", "pretrain", "warmup"),
        tables=("train",),
        exports=("trainable", "sources"),
        module="pdctl.stages.train",
    ),
)

STAGES: tuple[str, ...] = tuple(s.name for s in _TABLE)  # in the order they run
_BY_NAME = {s.name: s for s in _TABLE}
_BY_COMMAND = {s.command: s for s in _TABLE}


def stage(name: str) -> Stage:
    """The stage called `name` (KeyError for any other)."""
    return _BY_NAME[name]


def by_command(command: str) -> Stage:
    """The stage that `pdctl <command>` runs (KeyError for any other)."""
    return _BY_COMMAND[command]


def command(name: str) -> str:
    """`pdctl <this>` runs stage `name`."""
    return _BY_NAME[name].command


def dependencies(name: str) -> tuple[str, ...]:
    """Every config table stage `name`'s result depends on: its own and its predecessors'."""
    deps: list[str] = []
    for s in _TABLE:
        deps.extend(s.tables)
        if s.name == name:
            return tuple(deps)
    raise KeyError(name)
