"""What every stage shares: prerequisites, the mesh, the target, checkpoints, trackers, state."""

from __future__ import annotations

import dataclasses
import datetime as dt
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pdctl import __version__
from pdctl.config import Config
from pdctl.engine import runtime, sharding
from pdctl.engine.checkpoint import Checkpointer, rematerialize
from pdctl.engine.tracking import JsonlWriter, Tracker, make_tracker
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.science.targets import Target, build_target

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}
CLI_NAME = {
    "init_weights": "init-weights",
    "pretrain": "pretrain",
    "warmup": "warmup",
    "train": "train",
}

# Independent random streams of a run, all derived from [run] seed.
STREAM_TARGET, STREAM_DECOMP, STREAM_PRETRAIN, STREAM_WARMUP, STREAM_TRAIN = range(5)


def stream_key(cfg: Config, stream: int) -> jax.Array:
    return jax.random.fold_in(jax.random.PRNGKey(cfg.run.seed), stream)


def target_from_config(cfg: Config) -> Target:
    """The target of `[target]`: its own keys, plus what it reads from other tables."""
    t = cfg.target
    fields = t.model_dump(exclude={"kind"})
    fields["param_dtype"] = DTYPES[cfg.precision.param_dtype]
    if t.kind in ("tms", "resid_mlp"):
        fields["feature_probability"] = cfg.data.feature_probability
    else:
        fields["seq_len"] = cfg.data.seq_len
    return build_target(t.kind, **fields)


def with_remat(target: Target, remat: str) -> Target:
    """The target with its blocks rematerialised by `remat` (only models with blocks have it)."""
    if remat == "none" or not hasattr(target, "remat"):
        return target
    return dataclasses.replace(target, remat=remat)


def _now() -> str:
    return dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()


@dataclass
class StageEnv:
    """A stage's view of the run: config, mesh, target, its checkpoint directory and state."""

    project: Project
    stage: str
    mesh: Mesh
    target: Target

    @property
    def cfg(self) -> Config:
        return self.project.config

    @classmethod
    def open(
        cls,
        project: Project,
        stage: str,
        requires: tuple[str, ...] = (),
        devices: list[Any] | None = None,
    ) -> StageEnv:
        for req in requires:
            st = project.stage(req)
            if st.get("status") != "done":
                raise PdctlError(
                    f"{CLI_NAME[stage]} needs {CLI_NAME[req]} first "
                    f"({req} is {st.get('status', 'pending')}): run `pdctl {CLI_NAME[req]}`"
                )
            if project.is_stale(req):
                raise PdctlError(
                    f"{req} is stale (pdctl.toml changed since it ran): rerun "
                    f"`pdctl {CLI_NAME[req]}` before `pdctl {CLI_NAME[stage]}`"
                )
        project.writer = runtime.is_writer()
        if project.writer:  # held until the process exits: one writer per run directory
            project.acquire_lock()
        mesh = sharding.make_mesh(project.config.mesh.data, project.config.mesh.fsdp, devices)
        env = cls(project, stage, mesh, target_from_config(project.config))
        return env

    # ---- state ---------------------------------------------------------------------------
    def begin(self, *, fresh: bool, **fields: Any) -> None:
        """Mark the stage running. A fresh start drops the stage's old checkpoints and metrics."""
        if fresh and self.project.writer:
            shutil.rmtree(self.project.checkpoint_dir(self.stage), ignore_errors=True)
            self.project.metrics_path(self.stage).unlink(missing_ok=True)
        base = {
            "status": "running",
            "fingerprint": self.project.fingerprint(self.stage),
            "started_at": _now(),
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "device_kind": jax.devices()[0].device_kind,
            "mesh": sharding.describe_mesh(self.mesh),
            "pdctl_version": __version__,
            "jax_version": jax.__version__,
        }
        if fresh:
            self.project.reset_stage(self.stage, **base, **fields)
        else:
            self.project.update_stage(self.stage, **base, **fields)

    def on_state(self, **fields: Any) -> None:
        compile_s = fields.pop("compile_s", None)
        if compile_s:
            merged = dict(self.project.stage(self.stage).get("compile_s", {}))
            merged.update(compile_s)
            fields["compile_s"] = merged
        self.project.update_stage(self.stage, **fields)

    def state_writer(self) -> Callable[..., None]:
        return self.on_state

    # ---- engine pieces -------------------------------------------------------------------
    def checkpointer(self, stage: str | None = None) -> Checkpointer:
        return Checkpointer(
            self.project.checkpoint_dir(stage or self.stage), keep=self.cfg.checkpoint.keep
        )

    def shardings(self, abstract: Any) -> Any:
        return sharding.tree_shardings(abstract, self.mesh, self.cfg.mesh.fsdp_min_param_size)

    def jsonl(self) -> JsonlWriter:
        return JsonlWriter(self.project.metrics_path(self.stage), enabled=self.project.writer)

    def tracker(self) -> Tracker:
        t = self.cfg.tracking
        tr = make_tracker(
            mode=t.wandb,
            project=t.project,
            entity=t.entity,
            name=f"{self.project.root.name}-{self.stage}",
            directory=self.project.wandb_dir,
            run_id=self.project.stage(self.stage).get("wandb_id"),
            config=self.cfg.model_dump(mode="json", by_alias=True),
            is_writer=self.project.writer,
        )
        if tr.run_id:
            self.project.update_stage(self.stage, wandb_id=tr.run_id)
        return tr

    def restore_items(self, stage: str, names: dict[str, Any]) -> tuple[dict[str, Any], int]:
        """Restore items of `stage`'s latest checkpoint into the given abstract trees (sharded)."""
        ckpt = self.checkpointer(stage)
        step = ckpt.latest_step()
        if step is None:
            raise PdctlError(
                f"{stage} has no checkpoint in {ckpt.directory}; rerun `pdctl {CLI_NAME[stage]}`"
            )
        abstract = {
            k: sharding.abstract_with_shardings(v, self.shardings(v)) for k, v in names.items()
        }
        items, _ = ckpt.restore(step, abstract)
        ckpt.close()
        return items, step

    def restore_state(
        self, step: int, abstract: dict[str, Any], shardings: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore this stage's checkpoint `step` onto the current mesh and make it donatable."""
        ckpt = self.checkpointer()
        target = {k: sharding.abstract_with_shardings(abstract[k], shardings[k]) for k in abstract}
        items, meta = ckpt.restore(step, target)
        ckpt.close()
        # Restored arrays are not reliably donatable (jax#18617): re-create them as jit outputs.
        return rematerialize(items, shardings), meta


def resume_point(env: StageEnv, *, resume: bool, fresh: bool) -> int | None:
    """The checkpoint step to continue from, or None to start fresh; refuses to drop progress."""
    stage, cli = env.stage, CLI_NAME[env.stage]
    st = env.project.stage(stage)
    status = st.get("status", "pending")
    latest = env.checkpointer().latest_step() if status != "pending" else None
    if resume:
        if status == "done":
            raise PdctlError(
                f"{stage} is done; nothing to resume (`pdctl {cli} --fresh` reruns it)"
            )
        if latest is None:
            raise PdctlError(f"{stage} has no checkpoint to resume from; run `pdctl {cli}`")
        return latest
    if status in ("interrupted", "running", "failed") and latest is not None and not fresh:
        raise PdctlError(
            f"{stage} stopped at step {latest} ({status}); continue it with "
            f"`pdctl {cli} --resume` or start over with `pdctl {cli} --fresh`"
        )
    return None


def text_batches(env: StageEnv, batch_size: int, *, seed: int, state: Any, sharding):
    """The LM's token batches: grain over a local file or the synthetic corpus, each process
    reading its own slice of the global batch, prefetched onto the mesh."""
    from pdctl.engine.prefetch import Prefetcher
    from pdctl.science import data

    cfg = env.cfg
    if cfg.data.path:
        path = (env.project.root / cfg.data.path).expanduser()
        if not path.is_file():
            raise PdctlError(f"data.path: no file at {path}")
        try:
            tokens = data.load_text(path)
        except ValueError as e:
            raise PdctlError(f"data.path: {e}") from None
    else:
        tokens = data.synthetic_corpus(cfg.run.seed, cfg.data.synthetic_bytes)
    it = data.make_text_iterator(
        tokens,
        cfg.data.seq_len,
        batch_size,
        seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    if state is not None:
        it.set_state(data.state_from_json(state))
    return Prefetcher(it, sharding, state_fn=lambda: data.state_to_json(it.get_state()))


def peak_flops(cfg: Config) -> float | None:
    from pdctl.engine.measure import peak_flops_per_device

    per_dev = peak_flops_per_device(jax.devices()[0], cfg.measure.peak_tflops)
    return per_dev * jax.device_count() if per_dev else None


def pretrained_target(env: StageEnv) -> Any:
    """The trained target parameters: the `params` item of pretrain's latest checkpoint."""
    abstract = jax.eval_shape(env.target.init, stream_key(env.cfg, STREAM_TARGET))
    items, _ = env.restore_items("pretrain", {"params": abstract})
    # Fresh jit outputs: the frozen first argument of warmup/train is never donated, but a
    # consistent layout avoids a relayout copy at the first call.
    return rematerialize(items["params"], env.shardings(abstract))


def run_loop(
    env: StageEnv,
    *,
    step_fn,
    state,
    frozen=(),
    total: int,
    start: int,
    until,
    log_every: int,
    max_bad_steps: int,
    batches=None,
    eval_fn=None,
    eval_every=0,
    examples_per_step=0,
    lr_fn=None,
    profile=None,
):
    """Run the engine loop with this stage's checkpointer, state writer and trackers."""
    from pdctl.engine.loop import Loop

    jsonl = env.jsonl()
    jsonl.truncate_after(start)
    tracker = env.tracker()
    target = env.target
    is_text = target.output_kind == "logits"
    try:
        return Loop(
            stage=env.stage,
            step_fn=step_fn,
            state=state,
            frozen=frozen,
            total_steps=total,
            start_step=start,
            until=until,
            checkpointer=env.checkpointer(),
            on_state=env.on_state,
            jsonl=jsonl,
            tracker=tracker,
            log_every=log_every,
            checkpoint_every=env.cfg.checkpoint.every,
            batches=batches,
            batches_state=batches.state if batches is not None else None,
            max_bad_steps=max_bad_steps,
            eval_fn=eval_fn,
            eval_every=eval_every,
            examples_per_step=examples_per_step,
            tokens_per_step=examples_per_step * target.n_tokens_per_example() if is_text else 0,
            lr_fn=lr_fn,
            peak_flops=peak_flops(env.cfg),
            profile=profile,
            profile_dir=env.project.profiles_dir / env.stage,
        ).run()
    finally:
        tracker.finish()
        if batches is not None:
            batches.close()
