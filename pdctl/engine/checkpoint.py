"""Checkpoints: one orbax CheckpointManager per stage, async saves, sharded restore.

A checkpoint holds the state pytree (`StandardSave`) and a small JSON record (`meta`: data
iterator state, wandb id, ...). Restores go straight into abstract arrays that carry the target
shardings (never a concrete host copy first), so a checkpoint written on one mesh restores onto
another; `rematerialize` then makes the restored tree donatable (jax issue 18617).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

log = logging.getLogger(__name__)


class Checkpointer:
    def __init__(self, directory: Path, keep: int, *, async_save: bool = True):
        self.directory = Path(directory).resolve()
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            create=True,
            enable_async_checkpointing=async_save,
            cleanup_tmp_directories=True,
        )
        self._mgr = ocp.CheckpointManager(self.directory, options=options)

    def save(self, step: int, state: dict[str, Any], meta: dict[str, Any] | None = None) -> None:
        """Each top-level key of `state` is its own item, so a later stage can restore just one
        (warmup reads pretrain's `params` without its optimizer state)."""
        items = {k: ocp.args.StandardSave(v) for k, v in state.items()}
        args = ocp.args.Composite(**items, meta=ocp.args.JsonSave(meta or {}))
        self._mgr.save(step, args=args, force=True)

    def wait(self) -> None:
        self._mgr.wait_until_finished()

    def latest_step(self) -> int | None:
        """The newest *complete* checkpoint (orbax ignores unfinished ones)."""
        steps = self.all_steps()
        return steps[-1] if steps else None

    def all_steps(self) -> list[int]:
        """The complete checkpoints on disk, oldest first.

        Read from the directory, not with `CheckpointManager.reload()`: reloading while an
        async save is in flight drops that save from the manager's bookkeeping, and its
        garbage collection then keeps `keep + 1` checkpoints."""
        if not self.directory.exists():
            return []
        return sorted(m.step for m in ocp.step.standard_name_format().find_all(self.directory))

    def restore(self, step: int, abstract: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore the items named in `abstract` (ShapeDtypeStructs with shardings)."""
        items = {k: ocp.args.StandardRestore(v) for k, v in abstract.items()}
        out = self._mgr.restore(step, args=ocp.args.Composite(**items, meta=ocp.args.JsonRestore()))
        return {k: out[k] for k in abstract}, dict(out["meta"] or {})

    def item_names(self, step: int) -> list[str]:
        meta = self._mgr.item_metadata(step)
        return [k for k in meta if k != "meta"]

    def restore_host(self, step: int, names: list[str]) -> dict[str, Any]:
        """Restore items as they were saved, with no target shardings (for export)."""
        items = {k: ocp.args.StandardRestore() for k in names}
        out = self._mgr.restore(step, args=ocp.args.Composite(**items))
        return {k: out[k] for k in names}

    def close(self) -> None:
        self._mgr.wait_until_finished()
        self._mgr.close()


def rematerialize(tree: Any, shardings: Any) -> Any:
    """Re-create `tree` as outputs of an identity jit pinned to `shardings`.

    Arrays restored by orbax are not reliably donatable; fresh jit outputs are."""
    return jax.jit(lambda t: t, out_shardings=shardings)(tree)
