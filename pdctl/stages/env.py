"""`StageEnv`, a stage's view of its run (config, mesh, target, lock, state, checkpoints,
trackers), and what a stage reads through it: the trained target and the text corpus."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jax
from jax.sharding import Mesh

from pdctl import __version__, registry
from pdctl.config import Config, config_snapshot, fingerprint
from pdctl.engine import runtime, sharding
from pdctl.engine.checkpoint import (
    Checkpointer,
    CheckpointUnreadable,
    complete_steps,
    rematerialize,
)
from pdctl.engine.tracking import JsonlTracker, Tracker, make_tracker
from pdctl.errors import PdctlError, notify, one_line
from pdctl.project import Project, now
from pdctl.registry import command
from pdctl.science.targets import Target
from pdctl.stages.inputs import (
    abstract_target,
    check_tensor_parallel,
    decomp_layout,
    resolve,
    target_from_config,
)
from pdctl.stages.policy import how_to_finish, own_steps, stale_reason


@dataclass
class StageEnv:
    """A stage's view of the run: config, mesh, target, its checkpoint directory and state."""

    project: Project
    stage: str
    mesh: Mesh
    target: Target
    requires: tuple[str, ...] = ()
    # Command-line overrides of config keys ({"pretrain.steps": 3} from `--steps 3`): they enter
    # the stage's fingerprint and its checkpoints' config, so a run is never taken for another.
    overrides: dict[str, Any] = field(default_factory=dict)
    fresh_run: bool = False  # begun with begin(fresh=True): its checkpoints start from none
    # the trained target as `frozen_target` restored it for this stage (never donated): what
    # the nonlinearity-aligned init reads too, so it is not restored twice
    frozen_params: Any = None
    _fresh_ckpt_given: bool = False
    _closed: bool = False

    @property
    def cfg(self) -> Config:
        return self.project.config

    @classmethod
    def open(
        cls,
        project: Project,
        stage: str,
        requires: tuple[str, ...] | None = None,
        devices: list[Any] | None = None,
    ) -> StageEnv:
        """`requires`: the stages that must be done first; by default the registry's."""
        if requires is None:
            requires = registry.stage(stage).requires if stage in registry.STAGES else ()
        for req in requires:
            st = project.stage(req)
            if not project.is_done(req):
                raise PdctlError(
                    f"{command(stage)} needs {command(req)} first "
                    f"({req} is {st.get('status', 'pending')}): {how_to_finish(project, req)}"
                )
            if project.is_stale(req):
                raise PdctlError(
                    f"{req} is stale ({stale_reason(project, req)}): rerun "
                    f"`pdctl {command(req)}` before `pdctl {command(stage)}`"
                )
        project.writer = runtime.is_writer()
        if project.writer:  # one writer per run directory, until the stage closes
            project.acquire_lock()
        try:
            mesh = sharding.mesh_from_config(project.config.mesh, devices)
            target = target_from_config(project.config, project.root)
            check_tensor_parallel(target, mesh)
        except BaseException:
            if project.writer:
                project.release_lock()
            raise
        return cls(project, stage, mesh, target, requires=requires)

    # `with StageEnv.open(...) as env:` holds the run directory's lock for the stage and
    # releases it when the stage is over, however it ends.
    def __enter__(self) -> StageEnv:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Release the run directory's lock that `open` took (idempotent)."""
        if self.project.writer and not self._closed:
            self._closed = True
            self.project.release_lock()

    # ---- the config this stage runs with -------------------------------------------------
    def effective_config(self) -> Config:
        cfg = self.cfg
        for key, value in self.overrides.items():
            cfg = _override(cfg, key.split("."), value)
        return cfg

    def fingerprint(self) -> str:
        return fingerprint(self.effective_config(), self.stage)

    def config_snapshot(self) -> dict[str, Any]:
        """{dotted key: value} of every config key this stage's result depends on."""
        return config_snapshot(self.effective_config(), self.stage)

    # ---- state ---------------------------------------------------------------------------
    def begin(self, *, fresh: bool, **fields: Any) -> None:
        """Mark the stage running. A fresh start gets a new run id; the previous run's
        checkpoints stay until the new run has saved one of its own (`Checkpointer(fresh=...)`)
        and its metrics history is restarted by the loop."""
        proj = self.project
        proj.begin_attempt(self.stage)
        base: dict[str, Any] = {
            "status": "running",
            "fingerprint": self.fingerprint(),
            "started_at": now(),
            "devices": jax.device_count(),
            "processes": jax.process_count(),
            "device_kind": jax.devices()[0].device_kind,
            "mesh": sharding.describe_mesh(self.mesh),
            "pdctl_version": __version__,
            "jax_version": jax.__version__,
            "error": None,
            "lost_process": None,
        }
        if fresh or not proj.stage(self.stage).get("run_id"):
            base["run_id"] = uuid.uuid4().hex[:12]
        if fresh:
            self.fresh_run = True
            # Which run of each stage this one reads: rerunning one of them makes it stale.
            upstream = {
                r: proj.stage(r)["run_id"] for r in self.requires if proj.stage(r).get("run_id")
            }
            if upstream:
                base["upstream"] = upstream
            proj.reset_stage(self.stage, **base, **fields)
        else:
            proj.update_stage(self.stage, **base, **fields)

    def run_meta(self) -> dict[str, Any]:
        """What every checkpoint of this run records besides the arrays."""
        return {
            "run_id": self.project.stage(self.stage).get("run_id"),
            "config": self.config_snapshot(),
        }

    def on_state(self, **fields: Any) -> None:
        compile_s = fields.pop("compile_s", None)
        if compile_s:
            merged = dict(self.project.stage(self.stage).get("compile_s", {}))
            merged.update(compile_s)
            fields["compile_s"] = merged
        if fields.get("checkpoint") is not None:
            self.project.attempt_committed(self.stage)
        self.project.update_stage(self.stage, **fields)

    # ---- engine pieces -------------------------------------------------------------------
    def checkpointer(self, stage: str | None = None) -> Checkpointer:
        # The first checkpointer of a fresh run's own directory moves the old checkpoints aside
        # at its first save; any later one sees the new run's.
        fresh = stage in (None, self.stage) and self.fresh_run and not self._fresh_ckpt_given
        if fresh:
            self._fresh_ckpt_given = True
        # What a checkpoint's meta is checked against on restore (a forged step or run id
        # makes it unreadable, so resume falls back to an older one).
        st = self.project.stage(stage or self.stage)
        return Checkpointer(
            self.project.checkpoint_dir(stage or self.stage),
            keep=self.cfg.checkpoint.keep,
            fresh=fresh,
            max_step=st.get("steps"),
            run_id=st.get("run_id"),
        )

    def shardings(self, abstract: Any) -> Any:
        return sharding.tree_shardings(
            abstract,
            self.mesh,
            self.cfg.mesh.fsdp_min_param_size,
            decomp_layout(self.cfg, self.mesh, self.target),
        )

    def tracker(self, start: int) -> Tracker:
        """The stage's metrics tracker (jsonl, and wandb when enabled). Its jsonl history keeps
        what was logged up to `start` (a resumed run re-logs what follows; a fresh one starts
        it over)."""
        path = self.project.metrics_path(self.stage)
        if self.project.writer:
            JsonlTracker(path).truncate_after(-1 if self.fresh_run else start)
        t = self.cfg.tracking
        tr = make_tracker(
            jsonl=path,
            prefix=self.stage,
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
        """Restore items of `stage`'s latest checkpoint into the given abstract trees (sharded).

        That checkpoint is `stage`'s result: when it does not restore, an older one would be
        another result, so this refuses (naming the fix) rather than fall back."""
        directory = self.project.checkpoint_dir(stage)
        steps = complete_steps(directory)  # no manager yet: it would create the directory
        if not steps:
            raise PdctlError(
                f"{stage} has no checkpoint in {directory}; rerun `pdctl {command(stage)}`"
            )
        step = steps[-1]
        ckpt = self.checkpointer(stage)
        abstract = {
            k: sharding.abstract_with_shardings(v, self.shardings(v)) for k, v in names.items()
        }
        try:
            items, _ = ckpt.restore(step, abstract)
        except Exception as e:
            raise PdctlError(
                f"{stage}'s checkpoint {step} does not restore ({one_line(e)}); rerun "
                f"`pdctl {command(stage)} --fresh`"
            ) from None
        finally:
            ckpt.close()
        return items, step

    def restore_state(
        self, step: int, abstract: dict[str, Any], shardings: dict[str, Any]
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore this stage's checkpoint `step` onto the current mesh and make it donatable.

        When it does not restore (truncated files, a half-copied directory), the newest older
        checkpoint of the same run that does is used instead, and stderr says which; the
        unreadable ones move to `checkpoints/<stage>.corrupt/`. `meta["step"]` is where the
        run continues."""
        ckpt = self.checkpointer()
        target = {k: sharding.abstract_with_shardings(abstract[k], shardings[k]) for k in abstract}
        steps = [s for s in own_steps(self) if s <= step] or [step]
        try:
            got, (items, meta) = ckpt.restore_newest(
                steps,
                lambda s: ckpt.restore(s, target),
                quarantine=self.project.writer,
                warn=notify,
            )
        except CheckpointUnreadable as e:
            raise PdctlError(
                f"{self.stage}: no checkpoint restores ({'; '.join(e.errors)[:300]}); start over "
                f"with `pdctl {command(self.stage)} --fresh`"
            ) from None
        finally:
            ckpt.close()
        if got != step:
            notify(f"{self.stage}: resuming from checkpoint {got}, the newest that restores")
        meta.setdefault("step", got)
        # Restored arrays are not reliably donatable (jax#18617): re-create them as jit outputs.
        return rematerialize(items, shardings), meta


def _override(model: Any, parts: list[str], value: Any) -> Any:
    if len(parts) == 1:
        return model.model_copy(update={parts[0]: value})
    return model.model_copy(
        update={parts[0]: _override(getattr(model, parts[0]), parts[1:], value)}
    )


def pretrained_target(env: StageEnv) -> Any:
    """The trained target parameters: the `params` item of pretrain's latest checkpoint, or an
    imported model read from its directory straight into the mesh's shardings (each process
    reads only the slices its devices hold)."""
    abstract = abstract_target(env.cfg, env.target)
    st = env.project.stage("pretrain")
    if st.get("status") == "imported":
        from pdctl.science.targets import imported
        from pdctl.science.targets.hf import HFCausalLM

        target = env.target
        assert isinstance(target, HFCausalLM)  # only an imported model is "imported"
        imported.verify(target, st)
        return imported.load(target, env.shardings(abstract), dtype=target.param_dtype)
    items, _ = env.restore_items("pretrain", {"params": abstract})
    # Fresh jit outputs: the frozen first argument of warmup/train is never donated, but a
    # consistent layout avoids a relayout copy at the first call.
    return rematerialize(items["params"], env.shardings(abstract))


def frozen_target(env: StageEnv, prog: Any) -> tuple[Any, ...]:
    """The frozen first argument of warmup and train: the trained (or imported) target (kept
    as `env.frozen_params`)."""
    env.frozen_params = pretrained_target(env)
    return (env.frozen_params,)


def text_batches(
    env: StageEnv, batch_size: int, *, seed: int, state: Any, sharding, split: str = "train"
):
    """The LM's token batches as a grain iterator: a local corpus (bytes for llama_mlp, the
    model's tokenizer for an imported model) or the synthetic corpus, each process reading its
    own slice of the global batch, made into global arrays on the mesh and prefetched on a
    background thread (grain's ThreadPrefetchIterDataset), so host batching and transfers
    overlap the steps. Its `get_state()` counts the batches handed out (not the prefetched
    ones), which is what a checkpoint records; `state` (that, as JSON) resumes it exactly.
    `split` "eval" reads the held-out documents (`corpus_tokens`)."""
    import grain

    from pdctl.science import data

    cfg = env.cfg
    ds = data.make_text_iter_dataset(
        corpus_tokens(env, split),
        cfg.data.seq_len,
        batch_size,
        seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    ds = ds.map(
        lambda b: jax.tree.map(lambda x: jax.make_array_from_process_local_data(sharding, x), b)
    )
    it = iter(grain.experimental.ThreadPrefetchIterDataset(ds, prefetch_buffer_size=2))
    if state is not None:
        it.set_state(data.state_from_json(state))
    return it


def batches_state(batches: Any) -> Callable[[], str]:
    """The JSON state of a grain iterator, as a checkpoint's meta records it."""
    from pdctl.science import data

    return lambda: data.state_to_json(batches.get_state())


def corpus_tokens(env: StageEnv, split: str = "train") -> Any:
    """The whole token stream of `[data]`: the file's bytes (llama_mlp), the corpus tokenized
    with the imported model's tokenizer (tokenizer.json or the GGUF's; cached under
    <run>/cache/tokens), or the seeded synthetic corpus. For an imported model, `split` "eval"
    is the held-out documents (`data.eval_fraction`) or `data.eval_path`, and "train" the rest;
    with neither set both are the whole corpus."""
    from pdctl.science import data

    cfg = env.cfg
    if env.target.kind == "hf":
        from pdctl.science.targets import imported
        from pdctl.science.targets.hf import HFCausalLM

        target = env.target
        assert isinstance(target, HFCausalLM)  # kind "hf"
        cut: str | None
        path, key, cut = cfg.data.path, "data.path", split
        if split == "eval" and cfg.data.eval_path:
            path, key, cut = cfg.data.eval_path, "data.eval_path", None
        elif split == "train" and cfg.data.eval_path:
            cut = None
        try:
            tokens = data.load_corpus(
                resolve(env.project.root, path),
                tokenizer_path=imported.tokenizer_path(target),
                text_field=cfg.data.text_field,
                eos_id=cfg.data.eos_id,
                cache_dir=env.project.root / "cache" / "tokens",
                seq_len=cfg.data.seq_len,
                split=cut,
                eval_fraction=cfg.data.eval_fraction,
                separator=cfg.data.separator,
            )
        except ValueError as e:
            raise PdctlError(f"{key}: {e}") from None
        vocab = target.spec.vocab_size
        if tokens.size and int(tokens.max()) >= vocab:
            raise PdctlError(
                f"{key}: token id {int(tokens.max())} is outside the model's vocabulary "
                f"({vocab}); is the tokenizer the model's own?"
            )
        return tokens
    if cfg.data.path:
        file = resolve(env.project.root, cfg.data.path)
        if not file.is_file():
            raise PdctlError(f"data.path: no file at {file}")
        try:
            return data.load_text(file)
        except ValueError as e:
            raise PdctlError(f"data.path: {e}") from None
    return data.synthetic_corpus(cfg.run.seed, cfg.data.synthetic_bytes)
