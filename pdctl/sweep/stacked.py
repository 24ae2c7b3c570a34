"""Several runs' step as one program: every state leaf (and frozen argument) stacked along a
leading member axis that is split over the devices, each device stepping its own members.

The member axis is a mesh axis of its own, `members`, ahead of the usual ('data', 'fsdp',
'tp'), which are 1 here: a member's step is the program `pdctl run` compiles for it, with its
batch whole on one device. Under `shard_map` (manual over `members` only) each device runs its
members either one after another (`lax.map`: the working set stays that of one run, which is
what XLA:CPU's caches want; benchmarks/toys/sweep.py measures it) or batched (`vmap`: one wide
program, what an accelerator wants). No collective crosses members: there is nothing to all-reduce.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from pdctl.engine.checkpoint import rematerialize
from pdctl.engine.loop import state_is_finite
from pdctl.engine.program import StepProgram

MEMBERS = "members"
STRATEGIES = ("map", "vmap")


def default_strategy() -> str:
    return "map" if jax.default_backend() == "cpu" else "vmap"


def member_mesh(n_members: int, devices: list[Any] | None = None, pad: bool | None = None) -> Mesh:
    """The mesh ('members', 'data', 'fsdp', 'tp') = (d, 1, 1, 1) that steps `n_members` in the
    least time. Every device holds as many members, so:

    - with `pad` (the default on GPU/TPU, whose devices compute independently): the fewest
      members per device, ceil(n / devices), on as few devices as that needs, the count padded
      up (`member_slots`): 3 members on 2 devices run as 2 + 2, 11 on 8 as 6 x 2;
    - without (the default on CPU): the most devices that divide the member count, no padding.
      XLA:CPU runs every host device on one thread pool over the same cores, so a padding slot
      costs a member's step while a second device adds little (benchmarks/toys/sweep_step.py
      --compare-padding measures it)."""
    devices = list(jax.devices() if devices is None else devices)
    if pad is None:
        pad = devices[0].platform != "cpu"
    if pad:
        per = -(-n_members // len(devices))
        d = -(-n_members // per)
    else:
        d = max(k for k in range(1, len(devices) + 1) if n_members % k == 0)
    return Mesh(np.array(devices[:d]).reshape(d, 1, 1, 1), (MEMBERS, "data", "fsdp", "tp"))


def member_slots(n_members: int, mesh: Mesh) -> int:
    """The stacked program's member count on `mesh`: `n_members` rounded up to a multiple of
    its devices (`n_members` itself on a mesh that divides it). The slots past the members are
    padding: they run a copy of the first member and nothing reads their results."""
    d = mesh.shape[MEMBERS]
    return -(-n_members // d) * d


def pad_members(items: list[Any], slots: int) -> list[Any]:
    """`items` (one per member) filled up to `slots` with copies of the first."""
    return [*items, *[items[0]] * (slots - len(items))]


def _lead(tree: Any, mesh: Mesh) -> Any:
    return jax.tree.map(lambda s: NamedSharding(mesh, P(MEMBERS, *s.spec)), tree)


def _stack_abstract(tree: Any, n: int) -> Any:
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct((n, *a.shape), a.dtype), tree)


@dataclasses.dataclass(frozen=True)
class Stacked:
    """A member program (built on `member_mesh`) run for `n` members at once.

    With `hyper` (the traced keys whose values differ among the members, `sweep.hyper`), the
    step takes one more frozen argument after the member program's: {key: (n,) float32}, and
    each member's step is `build({key: its value})`, the member program built with its own
    values (tracers) in the config."""

    member: StepProgram
    n: int
    strategy: str = "map"
    hyper: tuple[str, ...] = ()
    build: Callable[[dict[str, Any]], Callable[..., Any]] | None = None

    @property
    def mesh(self) -> Mesh:
        return self.member.mesh

    @property
    def state_shardings(self) -> Any:
        return _lead(self.member.state_shardings, self.mesh)

    @property
    def frozen_shardings(self) -> tuple[Any, ...]:
        own = tuple(_lead(s, self.mesh) for s in self.member.frozen_shardings)
        return (*own, dict.fromkeys(self.hyper, self.by_member)) if self.hyper else own

    @property
    def abstract_state(self) -> Any:
        return _stack_abstract(self.member.abstract_state, self.n)

    @property
    def by_member(self) -> NamedSharding:
        return NamedSharding(self.mesh, P(MEMBERS))

    def step(self, *args: Any) -> tuple[Any, Any]:
        *frozen, state, batch = args
        if batch is not None:
            raise ValueError("a stacked step makes its own batches (toy targets)")
        step, strategy, build = self.member.step, self.strategy, self.build
        traced = bool(self.hyper)

        def local(frozen, state):
            def one(fs):
                *fr, st = fs
                if not traced:
                    return step(*fr, st, None)
                *fr, values = fr  # this member's traced config values: its own step
                return build(values)(*fr, st, None)

            if strategy == "vmap":
                return jax.vmap(one)((*frozen, state))
            # One member after another, each written back into the carried (donated) stack in
            # place: `lax.map` would build its outputs in fresh buffers, leaving part of the
            # donated state unused (measured: 69% of its bytes reused).
            n = jax.tree.leaves(state)[0].shape[0]
            at = jax.lax.dynamic_index_in_dim
            put = jax.lax.dynamic_update_index_in_dim
            pick = lambda t, i: jax.tree.map(lambda a: at(a, i, keepdims=False), t)  # noqa: E731
            m_shape = jax.eval_shape(one, (*pick(frozen, 0), pick(state, 0)))[1]
            metrics = jax.tree.map(lambda a: jnp.zeros((n, *a.shape), a.dtype), m_shape)

            def body(i, carry):
                s, m = carry
                new, mi = one((*pick(frozen, i), pick(s, i)))
                s = jax.tree.map(lambda a, x: put(a, x, i, 0), s, new)
                m = jax.tree.map(lambda a, x: put(a, x, i, 0), m, mi)
                return s, m

            return jax.lax.fori_loop(0, n, body, (state, metrics))

        spec = P(MEMBERS)
        return jax.shard_map(
            local,
            mesh=self.mesh,
            in_specs=(tuple(spec for _ in frozen), spec),
            out_specs=(spec, spec),
            axis_names={MEMBERS},
            check_vma=False,
        )(tuple(frozen), state)

    def jit(self) -> Any:
        """The stacked step under jit, the state donated, the metrics left on their devices
        (a member's metrics are read with the others at the logging cadence; no collective)."""
        nf = len(self.frozen_shardings)  # the traced values too, when there are any
        return jax.jit(
            self.member.policy.scoped(self.step),
            in_shardings=(*self.frozen_shardings, self.state_shardings, None),
            out_shardings=(self.state_shardings, self.by_member),
            donate_argnums=(nf,),
        )

    def put(self, members: list[Any], shardings: Any) -> Any:
        """Host trees of the members, stacked and placed along the member axis."""
        stacked = jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *members)
        # as jit outputs: a buffer put from host memory is not reliably donatable (jax#18617)
        return rematerialize(jax.device_put(stacked, shardings), shardings)

    def finite_fn(self) -> Any:
        """(state) -> (n,) bool: each member's state finite, on its own devices."""
        return jax.jit(jax.vmap(state_is_finite), out_shardings=self.by_member)


def stacked_program(
    member: StepProgram,
    n: int,
    strategy: str,
    hyper: tuple[str, ...] = (),
    build: Callable[[dict[str, Any]], Callable[..., Any]] | None = None,
) -> Stacked:
    if strategy not in STRATEGIES:
        raise ValueError(strategy)
    if not member.makes_own_batch:
        raise ValueError("sweeps stack toy targets only (their step makes its own batch)")
    if bool(hyper) != (build is not None):
        raise ValueError("traced config values need the function that builds a member's step")
    return Stacked(member, n, strategy, tuple(hyper), build)


def member_slice(host_tree: Any, i: int) -> Any:
    return jax.tree.map(lambda a: np.asarray(a)[i], host_tree)
