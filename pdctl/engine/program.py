"""A stage's step as a program: the one description every caller compiles.

Each stage module builds its `StepProgram` from (config, mesh, target) alone, no files and no
devices touched: the pure step, the function that makes a fresh state, the abstract state and
its shardings, the frozen (non-donated) leading arguments, the batch, the precision policy. The
stage run (`stages.runner.run_stage`), `inspect-sharding --compile`, the benchmarks and the tests
then all jit it here, in one place, so they compile exactly the same program: the same
in/out shardings, the same donation, the same remat, precision and accumulation settings.

Step contract: `step(*frozen, state, batch) -> (state, metrics)`; the state (the argument right
after the frozen ones) is donated; `batch` is None when the step makes its own data.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh

from pdctl.engine import sharding
from pdctl.engine.precision import Policy


@dataclass(frozen=True)
class StepProgram:
    stage: str
    step: Callable[..., tuple[Any, dict[str, jax.Array]]]
    make_state: Callable[..., Any]  # the fresh state from the stage's upstream arrays
    abstract_state: Any
    state_shardings: Any
    mesh: Mesh
    policy: Policy
    total_steps: int
    frozen_abstract: tuple[Any, ...] = ()  # the target parameters of warmup/train
    frozen_shardings: tuple[Any, ...] = ()
    batch_abstract: Any = None  # None: the step generates its own batch on the device
    batch_shardings: Any = None
    examples_per_step: int = 0
    lr_fn: Callable[[int], dict[str, float]] | None = None
    notes: tuple[str, ...] = field(default=())

    @property
    def donate_argnums(self) -> tuple[int, ...]:
        return (len(self.frozen_abstract),)

    @property
    def makes_own_batch(self) -> bool:
        return self.batch_abstract is None

    def jit(self, donate: bool = True) -> Any:
        """The step under `jax.jit` with its shardings and donation (the one jit of it): the
        same object on every call, so that a compile of it on another thread (`engine.ahead`)
        is found in process by the stage's own."""
        key = f"_jit_{donate}"
        if key not in self.__dict__:  # a frozen dataclass: cached beside its fields
            object.__setattr__(self, key, self._make_jit(donate))
        return self.__dict__[key]

    def _make_jit(self, donate: bool) -> Any:
        return jax.jit(
            self.policy.scoped(self.step),
            in_shardings=(*self.frozen_shardings, self.state_shardings, self.batch_shardings),
            out_shardings=(self.state_shardings, sharding.replicated(self.mesh)),
            donate_argnums=self.donate_argnums if donate else (),
        )

    def jit_make_state(self) -> Any:
        """`make_state` under jit, its output born with the state's shardings."""
        return jax.jit(self.make_state, out_shardings=self.state_shardings)

    def abstract_args(self) -> tuple[Any, ...]:
        """(*frozen, state, batch) as ShapeDtypeStructs carrying their shardings."""
        frozen = tuple(
            sharding.abstract_with_shardings(a, s)
            for a, s in zip(self.frozen_abstract, self.frozen_shardings, strict=True)
        )
        state = sharding.abstract_with_shardings(self.abstract_state, self.state_shardings)
        batch = None
        if self.batch_abstract is not None:
            batch = sharding.abstract_with_shardings(self.batch_abstract, self.batch_shardings)
        return (*frozen, state, batch)

    def lower(self, donate: bool = True, cached: bool = True) -> Any:
        """The lowered step from abstract arguments: nothing is allocated. `cached = False`:
        through a jit of its own, not `jit`'s, so that its compile is not kept with this program
        (`pdctl run`'s compiles ahead of a later stage: into the compile cache only)."""
        fn = self.jit(donate) if cached else self._make_jit(donate)
        return fn.lower(*self.abstract_args())
