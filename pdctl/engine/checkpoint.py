"""Checkpoints: one orbax CheckpointManager per stage, async saves, sharded restore.

A checkpoint holds the state pytree (`StandardSave`) and a small JSON record (`meta`: data
iterator state, the run id and config it was written with, ...). Each top-level key of a state
is its own item, except in a train state (one with a `trainable` key), which is split in two:
`decomposition` (V / U and the CI functions: all that `report`, `export`, `harvest` and
`init_from` read) and `training` (optimizer states, PPGD sources and theirs, counters), so that
analysis never restores what only training needs. Checkpoints written before the split (one
item per key) restore and read as before (`_items_of`). Restores go straight into
abstract arrays that carry the target shardings (never a concrete host copy first), so a
checkpoint written on one mesh restores onto another; `rematerialize` then makes the restored
tree donatable (jax-ml/jax#18617).

A fresh start never deletes the previous run's checkpoints before it has one of its own: with
`fresh=True` the old directory is moved aside to `<stage>.previous` at the new run's first save
and deleted once a checkpoint of the new run is complete. Until then the old checkpoints stay
where they were, so a fresh run that fails or is killed early loses nothing.
"""

from __future__ import annotations

import errno
import json
import logging
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from pdctl.errors import one_line
from pdctl.files import refuse_links

log = logging.getLogger(__name__)

DECOMPOSITION = "decomposition"  # a train checkpoint's item of the state's `trainable`
TRAINING = "training"  # ... and of every other key of the state, together
_SPLIT_KEY = "trainable"


def split_items(state: dict[str, Any]) -> dict[str, Any]:
    """The items a state is saved as: a train state's `trainable` as `decomposition` and the
    rest as one `training` item; any other state one item per key."""
    if _SPLIT_KEY not in state:
        return dict(state)
    rest = {k: v for k, v in state.items() if k != _SPLIT_KEY}
    return {DECOMPOSITION: state[_SPLIT_KEY], **({TRAINING: rest} if rest else {})}


def join_items(items: dict[str, Any]) -> dict[str, Any]:
    """The inverse of `split_items`."""
    if DECOMPOSITION not in items:
        return dict(items)
    return {_SPLIT_KEY: items[DECOMPOSITION], **items.get(TRAINING, {})}


def _items_of(directory: Path, step: int, name: str) -> tuple[str, str | None]:
    """Where state key `name` of checkpoint `step` lives: (item, key within it or None). A
    split train checkpoint holds `trainable` as `decomposition` and the other keys inside
    `training`; an older one (or another stage's) each key as its own item."""
    base = Path(directory) / str(step)
    if (base / name).exists() or not (base / DECOMPOSITION).exists():
        return name, None
    if name == _SPLIT_KEY:
        return DECOMPOSITION, None
    return TRAINING, name


PREVIOUS_SUFFIX = ".previous"  # a fresh run's predecessor, until the fresh run has a checkpoint
CORRUPT_SUFFIX = ".corrupt"  # checkpoints that failed to restore, kept for inspection
TMP_SUFFIX = ocp.path.atomicity.TMP_DIR_SUFFIX  # ".orbax-checkpoint-tmp": a save in progress


def complete_steps(directory: Path) -> list[int]:
    """The complete checkpoints in `directory`, oldest first (orbax ignores unfinished ones)."""
    if not directory.exists():
        return []
    return sorted(m.step for m in ocp.step.standard_name_format().find_all(directory))


def has_key(directory: Path, step: int, name: str) -> bool:
    """Whether checkpoint `step` holds state key `name` (a split checkpoint whose `training`
    item was not copied along still has its decomposition)."""
    item, _ = _items_of(directory, step, name)
    return (Path(directory) / str(step) / item).is_dir()


def read_meta(directory: Path, step: int) -> dict[str, Any] | None:
    """The JSON `meta` item of checkpoint `step` (orbax's JsonSave writes `<item>/metadata`),
    without opening a manager or touching the arrays; None when it cannot be read."""
    path = Path(directory) / str(step) / "meta" / "metadata"
    try:
        return dict(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError):
        return None


def read_host(directory: Path, step: int, name: str) -> Any:
    """Item `name` of checkpoint `step` as host numpy arrays, whatever mesh and device count
    wrote it (restoring "as saved" would need the writer's devices). Opens no manager, so it
    never touches an in-flight save of a stage that is running (opening a CheckpointManager
    cleans up temporary directories). For export and the report."""
    item, key = _items_of(directory, step, name)
    handler = ocp.PyTreeCheckpointHandler()
    path = Path(directory) / str(step) / item
    try:
        tree = handler.metadata(path).tree
        if key is not None:  # only that key's arrays of the `training` item
            tree = {key: tree[key]}
        args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
        restore = ocp.args.PyTreeRestore(
            item=tree, restore_args=args, partial_restore=key is not None
        )
        out = handler.restore(path, args=restore)
        return out if key is None else out[key]
    finally:
        handler.close()


def item_tree(directory: Path, step: int, name: str) -> Any:
    """The tree structure of item `name` of checkpoint `step` (its metadata: nothing read)."""
    item, key = _items_of(directory, step, name)
    handler = ocp.PyTreeCheckpointHandler()
    try:
        tree = handler.metadata(Path(directory) / str(step) / item).tree
        return tree if key is None else tree[key]
    finally:
        handler.close()


def remove_unfinished(directory: Path) -> None:
    """Delete the temporary directories (`<step>.orbax-checkpoint-tmp*`) of saves that never
    finished, before a manager is opened on `directory`; process 0 deletes, all wait."""
    if jax.process_index() == 0:
        drop_unfinished(directory)
    _barrier(f"pdctl-cleanup-{directory.name}")


def drop_unfinished(directory: Path) -> None:
    """Delete the temporary directories of saves in progress or that never finished."""
    if not directory.is_dir():
        return
    for p in directory.iterdir():
        if TMP_SUFFIX in p.name and p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)


def drop_checkpoints(directory: Path) -> None:
    """Delete a stage's checkpoints and its `.previous` (those of a run that a fresh run which
    saves none, `stages.runner._run_idle`, has replaced); process 0 deletes, all wait. A
    symlink among them is refused, as `Checkpointer` refuses it."""
    directory = Path(directory)
    previous = directory.with_name(directory.name + PREVIOUS_SUFFIX)
    for d in (directory, previous):
        refuse_links(d, 1)
    if jax.process_index() == 0:
        for d in (directory, previous):
            shutil.rmtree(d, ignore_errors=True)
    _barrier(f"pdctl-drop-{directory.name}")


def _barrier(name: str) -> None:
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


class Checkpointer:
    """One stage's checkpoints. `max_step` (the stage's `steps`) and `run_id` (its current run),
    when given, are what a restored checkpoint's meta is checked against besides its own
    directory name and step counter (`check_meta`)."""

    def __init__(
        self,
        directory: Path,
        keep: int,
        *,
        async_save: bool = True,
        fresh: bool = False,
        max_step: int | None = None,
        run_id: str | None = None,
    ):
        # A run directory may come from someone else: none of the directories this writes,
        # moves or deletes (nor a step in them) may be a symlink that leads elsewhere.
        directory = Path(directory)
        refuse_links(directory, 1)
        self.directory = directory.resolve()
        for suffix in (PREVIOUS_SUFFIX, CORRUPT_SUFFIX):
            refuse_links(self.directory.with_name(self.directory.name + suffix), 1)
        self.keep = keep
        self.max_step = max_step
        self.run_id = run_id
        self._async = async_save
        # fresh: the checkpoints already in `directory` belong to an earlier run; this one
        # sees none of them and moves them aside at its first save.
        self._fresh_pending = fresh
        self._mgr = self._open()

    def _open(self) -> ocp.CheckpointManager:
        # Unfinished saves of a killed run are removed here, synchronously. orbax's own
        # `cleanup_tmp_directories` does it in a background thread that `close()` does not wait
        # for: after a close and reopen (a fresh run's first save, a quarantine) the first
        # manager's cleanup could still be listing the directory when the second one's save
        # had created `<step>.orbax-checkpoint-tmp`, and delete it mid-write (seen in CI as a
        # failed rename of `0.orbax-checkpoint-tmp/meta.orbax-checkpoint-tmp`).
        remove_unfinished(self.directory)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=self.keep,
            create=True,
            enable_async_checkpointing=self._async,
            cleanup_tmp_directories=False,
        )
        return ocp.CheckpointManager(self.directory, options=options)

    @property
    def previous_dir(self) -> Path:
        return self.directory.with_name(self.directory.name + PREVIOUS_SUFFIX)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Each top-level key of `state` is its own item, so a later stage can restore just one
        (warmup reads pretrain's `params` without its optimizer state); a train state is split
        in `decomposition` and `training` (`split_items`)."""
        if not self.directory.is_dir():  # the run directory moved: orbax would make it anew
            raise FileNotFoundError(errno.ENOENT, "checkpoint directory gone", str(self.directory))
        if self._fresh_pending:
            self._move_previous_aside()
        else:
            self._drop_previous()
        items = {k: ocp.args.StandardSave(v) for k, v in split_items(state).items()}
        args = ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta or {}))
        self._mgr.save(step, args=args, force=True)

    def _move_previous_aside(self) -> None:
        """First save of a fresh run: the earlier run's checkpoints go to `<dir>.previous`
        (replacing an older `.previous` only when there is something newer to keep)."""
        self._mgr.wait_until_finished()
        self._mgr.close()
        # Nothing complete here (a fresh run killed before its first checkpoint): keep the
        # `.previous` there may be; `_open` removes unfinished saves.
        if jax.process_index() == 0 and complete_steps(self.directory):
            prev = self.previous_dir
            shutil.rmtree(prev, ignore_errors=True)
            self.directory.rename(prev)
            self.directory.mkdir(parents=True)
        _barrier(f"pdctl-fresh-{self.directory.name}")
        self._fresh_pending = False
        self._mgr = self._open()

    def _drop_previous(self) -> None:
        """Delete `<dir>.previous` once this directory holds a complete checkpoint."""
        prev = self.previous_dir
        if (
            not self._fresh_pending
            and jax.process_index() == 0
            and prev.exists()
            and complete_steps(self.directory)
        ):
            shutil.rmtree(prev, ignore_errors=True)

    def wait(self) -> None:
        self._mgr.wait_until_finished()
        self._drop_previous()

    def latest_step(self) -> int | None:
        """The newest *complete* checkpoint of this run (orbax ignores unfinished ones)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The complete checkpoints of this run on disk, oldest first (none, for a fresh run
        before its first save: what is there belongs to the previous run).

        Read from the directory, not with `CheckpointManager.reload()`: reloading while an
        async save is in flight drops that save from the manager's bookkeeping, and its
        garbage collection then keeps `keep + 1` checkpoints."""
        if self._fresh_pending:
            return []
        return complete_steps(self.directory)

    def previous_steps(self) -> list[int]:
        """A fresh run's predecessor's complete checkpoints, still in place or moved aside."""
        if self._fresh_pending:
            return complete_steps(self.directory)
        return complete_steps(self.previous_dir)

    def restore(self, step: int, abstract: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore the state keys named in `abstract` (ShapeDtypeStructs with shardings), from
        a split train checkpoint or one item per key, whichever `step` holds."""
        # (from the directory: the manager's item_metadata warns about every item it has no
        # handler for)
        split = (self.directory / str(step) / DECOMPOSITION).is_dir()
        wanted = split_items(abstract) if split else dict(abstract)
        items = {k: ocp.args.StandardRestore(v) for k, v in wanted.items()}
        out = self._mgr.restore(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonRestore()))
        restored = join_items({k: out[k] for k in wanted})
        meta = out["meta"] or {}
        if not isinstance(meta, dict):
            raise CheckpointMismatch(f"its meta is a {type(meta).__name__}, not an object")
        meta = dict(meta)
        self.check_meta(step, meta, restored)
        if not tree_is_finite(restored):  # pdctl saves only finite states: forged, or bit rot
            raise CheckpointMismatch("its arrays are not finite (NaN or inf)")
        return restored, meta

    def check_meta(self, step: int, meta: dict[str, Any], restored: dict[str, Any]) -> None:
        """Trust nothing in checkpoint `step`'s meta that can be checked: its `step` must be
        the checkpoint's directory name and the step counter of the restored arrays
        (`loop.step`), at most the stage's `steps` (`max_step`), and its `run_id` the stage's
        current run. Raises `CheckpointMismatch`, which restoring treats like an unreadable
        checkpoint (fall back to an older one, quarantined as `.corrupt`)."""
        claimed = meta.get("step", step)
        if not isinstance(claimed, int) or isinstance(claimed, bool) or claimed != step:
            raise CheckpointMismatch(f"its meta says step {claimed!r} but it is checkpoint {step}")
        loop = restored.get("loop")
        counter = loop.get("step") if isinstance(loop, dict) else None
        if counter is not None:
            value = int(np.asarray(counter.addressable_shards[0].data))
            if value != step:
                raise CheckpointMismatch(f"its arrays are at step {value}, not {step}")
        if self.max_step is not None and step > self.max_step:
            raise CheckpointMismatch(f"step {step} is past the stage's {self.max_step} steps")
        rid = meta.get("run_id")
        if self.run_id is not None and rid is not None and rid != self.run_id:
            raise CheckpointMismatch(
                f"its meta names run {rid!r}, not the stage's current run {self.run_id!r}"
            )

    def restore_newest(
        self,
        steps: list[int],
        restore: Callable[[int], Any],
        *,
        quarantine: bool = False,
        warn: Callable[[str], None] | None = None,
    ) -> tuple[int, Any]:
        """`restore(step)` for the newest of `steps` that restores: (step, its result).

        A checkpoint that fails (truncated files, a half-copied directory) is reported through
        `warn` and, with `quarantine`, moved to `<dir>.corrupt/<step>` so that a resumed run
        can write that step again. Raises `CheckpointUnreadable` when none restores."""
        errors: list[str] = []
        for step in sorted(steps, reverse=True):
            try:
                return step, restore(step)
            except Exception as e:  # orbax/tensorstore raise many kinds; all mean "unreadable"
                reason = one_line(e)
                errors.append(f"step {step}: {reason}")
                older = [s for s in steps if s < step]
                if warn is not None:
                    nxt = f"trying step {max(older)}" if older else "no older checkpoint"
                    name = f"{self.directory.name}/{step}"
                    warn(f"checkpoint {name} does not restore ({reason}); {nxt}")
                if quarantine:
                    self.quarantine(step)
        raise CheckpointUnreadable(self.directory, errors)

    def quarantine(self, step: int) -> Path | None:
        """Move checkpoint `step` out of the manager's sight, to `<dir>.corrupt/<step>`."""
        src = self.directory / str(step)
        dst = self.directory.with_name(self.directory.name + CORRUPT_SUFFIX) / str(step)
        if jax.process_index() == 0 and src.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(dst, ignore_errors=True)
            src.rename(dst)
        _barrier(f"pdctl-quarantine-{self.directory.name}-{step}")
        self._mgr.close()
        self._mgr = self._open()
        return dst

    def read_meta(self, step: int) -> dict[str, Any] | None:
        return read_meta(self.directory, step)

    def item_names(self, step: int) -> list[str]:
        """The items on disk (a split train checkpoint: `decomposition`, `training`)."""
        meta = self._mgr.item_metadata(step)
        return [k for k in meta if k != "meta"]

    def restore_host(self, step: int, names: list[str]) -> dict[str, Any]:
        """State keys of checkpoint `step` as host numpy arrays (`meta` as its dict), whatever
        devices wrote them (`read_host`)."""
        return {
            n: read_meta(self.directory, step)
            if n == "meta"
            else read_host(self.directory, step, n)
            for n in names
        }

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._drop_previous()
        self._mgr.close()


class CheckpointMismatch(ValueError):
    """A checkpoint whose meta contradicts what can be checked (its directory name, its
    arrays, the stage's config): forged or mixed up, so not restored."""


class CheckpointUnreadable(Exception):
    """No checkpoint of a stage restores."""

    def __init__(self, directory: Path, errors: list[str]):
        self.directory = directory
        self.errors = errors
        super().__init__(f"{directory}: no checkpoint restores ({'; '.join(errors) or 'none'})")


def tree_is_finite(tree: Any) -> bool:
    """Every floating-point array of `tree` (sharded `jax.Array`s, as restored) is finite;
    computed on the devices, the answer replicated so that every process can read it."""
    leaves = [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.inexact)]
    if not leaves:
        return True
    mesh = next((x.sharding.mesh for x in leaves if isinstance(x.sharding, NamedSharding)), None)
    out = NamedSharding(mesh, PartitionSpec()) if mesh is not None else None

    def finite(xs: list[jax.Array]) -> jax.Array:
        return jnp.all(jnp.stack([jnp.all(jnp.isfinite(x)) for x in xs]))

    return bool(jax.device_get(jax.jit(finite, out_shardings=out)(leaves)))


def rematerialize(tree: Any, shardings: Any) -> Any:
    """Re-create `tree` as outputs of an identity jit pinned to `shardings`.

    Arrays restored by orbax are not reliably donatable; fresh jit outputs are."""
    return jax.jit(lambda t: t, out_shardings=shardings)(tree)
