"""What every stage shares: prerequisites, the mesh, the target, checkpoints, trackers, state."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pdctl import __version__
from pdctl.config import AUTO_SCAN_LAYERS, Config, fingerprint, match_sites
from pdctl.engine import peers, runtime, sharding
from pdctl.engine.checkpoint import (
    Checkpointer,
    CheckpointUnreadable,
    complete_steps,
    drop_unfinished,
    read_meta,
    rematerialize,
)
from pdctl.engine.loop import Interrupted, describe_exception
from pdctl.engine.tracking import JsonlTracker, Tracker, make_tracker
from pdctl.errors import PdctlError, StageFailed
from pdctl.project import WRITE_LOCK, Project, RunDirMoved, now
from pdctl.science.targets import Target, build_target
from pdctl.stages import registry
from pdctl.stages.registry import command

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}

# Independent random streams of a run, all derived from [run] seed.
STREAM_TARGET, STREAM_DECOMP, STREAM_PRETRAIN, STREAM_WARMUP, STREAM_TRAIN = range(5)


def stream_key(cfg: Config, stream: int) -> jax.Array:
    return jax.random.fold_in(jax.random.PRNGKey(cfg.run.seed), stream)


def target_from_config(cfg: Config, root: Path | None = None, need_weights: bool = True) -> Target:
    """The target of `[target]`: its own keys, plus what it reads from other tables. An
    imported model's relative `path` is relative to the run directory `root`; without
    `need_weights` its config.json alone is enough (shapes only)."""
    t = cfg.target
    fields = t.model_dump(exclude={"kind"})
    fields["param_dtype"] = DTYPES[cfg.precision.param_dtype]
    if t.kind in ("tms", "resid_mlp"):
        fields["feature_probability"] = cfg.data.feature_probability
    else:
        fields["seq_len"] = cfg.data.seq_len
    if t.kind == "hf":
        fields["path"] = str(resolve(root, t.path))
        fields["need_weights"] = need_weights
    return build_target(t.kind, **fields)


def decomp_layout(cfg: Config, mesh: Mesh, target: Target) -> sharding.Decomp:
    """The mesh axes this run's components shard over (`[mesh] decomposition`)."""
    return sharding.decomp_axes(mesh, cfg.mesh.decomposition, target.output_kind == "logits")


def check_tensor_parallel(target: Target, mesh: Mesh, key: str = "mesh.tp") -> None:
    """A tp axis > 1 needs a target with a tensor-parallel layout whose heads and widths it
    divides, and (on several hosts) the tp devices of a group on one host."""
    tp = sharding.axis_size(mesh, "tp")
    if tp == 1:
        return
    sizes = target.tp_divisors()
    if sizes is None:
        raise PdctlError(
            f"{key}: the {target.kind} target has no tensor-parallel layout (its projections "
            "are not split over devices); set mesh.tp = 1 and use mesh.data / mesh.fsdp"
        )
    where = getattr(getattr(target, "spec", None), "config_path", None)
    for name, n in sizes.items():
        if n % tp:
            of = f" in {where}" if where else ""
            raise PdctlError(f"{key}: {tp} does not divide {name} = {n}{of}")
    local = len(mesh.local_devices)
    if jax.process_count() > 1 and local % tp:
        raise PdctlError(
            f"{key}: {tp} does not divide the {local} devices of each process (a tensor-"
            "parallel group must sit on one host)"
        )


def resolve(root: Path | None, path: str) -> Path:
    """A path from pdctl.toml: `~` expanded, relative to the run directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or root is None else root / p


def with_remat(target: Target, remat: str) -> Target:
    """The target with its blocks rematerialised by `remat` (only models with blocks have it)."""
    if remat == "none" or not hasattr(target, "remat"):
        return target
    return dataclasses.replace(target, remat=remat)


def scan_layers(cfg: Config, target: Target) -> bool:
    """`[train] scan_layers` for this target: true / false as set; "auto": on when the target
    can scan (an imported model) and the decomposed sites sit in `AUTO_SCAN_LAYERS` layers or
    more (where the scanned step compiled faster than the unrolled one, docs/performance.md)."""
    setting = cfg.train.scan_layers
    if setting != "auto":
        return bool(setting)
    if not hasattr(target, "scan_layers"):
        return False
    layers = {target.layer_of(p) for p in match_sites(cfg, target.site_paths())}
    return len(layers - {None}) >= AUTO_SCAN_LAYERS


def with_scan(target: Target, scan: bool) -> Target:
    """The target with its blocks scanned over layers in `apply_sites` (`[train] scan_layers`;
    only models with blocks have it)."""
    if not hasattr(target, "scan_layers") or target.scan_layers == scan:
        return target
    return dataclasses.replace(target, scan_layers=scan)


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
                f"{stage}'s checkpoint {step} does not restore ({_one_line(e)}); rerun "
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


def config_snapshot(cfg: Config, stage: str) -> dict[str, Any]:
    dumped = cfg.model_dump(mode="json", by_alias=True)
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        else:
            out[prefix] = v

    for table in registry.dependencies(stage):
        walk(table, dumped[table])
    return out


def notify(message: str) -> None:
    """A line on stderr for the user (what pdctl decided on their behalf)."""
    print(f"pdctl: {message}", file=sys.stderr, flush=True)


def _one_line(e: BaseException, limit: int = 160) -> str:
    text = " ".join(str(e).split())
    text = f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text if len(text) <= limit else text[: limit - 3] + "..."


def how_to_finish(project: Project, stage: str) -> str:
    """What to run so that `stage` ends `done`, as its status stands."""
    cli = command(stage)
    status = project.stage(stage).get("status", "pending")
    if status == "pending":
        return f"run `pdctl {cli}`"
    if status == "interrupted":
        if project.is_stale(stage):
            return f"its config changed since it stopped, so start it over: `pdctl {cli} --fresh`"
        return f"continue it with `pdctl {cli} --resume` (or `pdctl resume`)"
    if status == "running":
        if project.lock_is_free():
            return f"it crashed; continue it with `pdctl {cli} --resume` (or `pdctl resume`)"
        return "it is running in another pdctl process; wait for it to finish"
    if status == "failed" and project.stage(stage).get("lost_process") is not None:
        how = f"`pdctl {cli} --resume` (or `pdctl resume`)"
        return f"a process of its run was lost; continue it with {how}"
    if status == "failed":
        return (
            f"it failed; fix the cause and start it over with `pdctl {cli} --fresh`, or "
            f"continue from its last good checkpoint with `pdctl {cli} --resume`"
        )
    return f"run `pdctl {cli}`"


def stale_reason(project: Project, stage: str, changed: list[str] | None = None) -> str:
    """Why `stage` is stale, in words: the upstream stages rerun, or the keys that changed."""
    rerun = project.rerun_upstream(stage)
    if rerun:
        return f"{', '.join(rerun)} ran again since {stage} started"
    if changed:
        more = f" and {len(changed) - 3} more" if len(changed) > 3 else ""
        return "its config changed: " + ", ".join(changed[:3]) + more
    return "pdctl.toml differs from the config it ran with"


def checkpoint_changes(project: Project, stage: str, step: int) -> list[str]:
    """The config keys that differ between checkpoint `step` of `stage` and pdctl.toml now."""
    meta = read_meta(project.checkpoint_dir(stage), step) or {}
    return changed_keys(meta.get("config"), config_snapshot(project.config, stage))


def changed_keys(before: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """`key (old → new)` for every key whose value differs (added or removed ones included)."""
    if not before:
        return []
    out = []
    for k in sorted(set(before) | set(now), key=lambda k: (k not in now, k)):
        a, b = before.get(k, "<unset>"), now.get(k, "<unset>")
        if a != b:
            out.append(f"{k} ({a!r} → {b!r})")
    return out


def own_steps(env: StageEnv) -> list[int]:
    """The complete checkpoints that belong to the stage's current run (its run id), oldest
    first. Checkpoints a fresh run has not yet replaced, and those of older runs, are not the
    current run's progress and are never resumed from."""
    run_id = env.project.stage(env.stage).get("run_id")
    directory = env.project.checkpoint_dir(env.stage)
    steps = complete_steps(directory)
    if not run_id:
        return steps
    out = []
    for s in steps:
        meta = read_meta(directory, s)
        # Unreadable meta: keep it, the restore decides (and falls back if it must).
        if meta is None or meta.get("run_id") in (None, run_id):
            out.append(s)
    return out


def resume_point(env: StageEnv, *, resume: bool, fresh: bool) -> int | None:
    """The checkpoint step to continue from, or None to start fresh; refuses to drop progress
    and to continue a run under a config other than the one it started with."""
    stage, cli = env.stage, command(env.stage)
    if resume and fresh:
        raise PdctlError("--resume and --fresh: choose one (continue the stage, or start it over)")
    if fresh:
        return None
    st = env.project.stage(stage)
    status = st.get("status", "pending")
    latest = None
    if status != "pending":
        steps = own_steps(env)
        latest = steps[-1] if steps else None
    if resume:
        if status == "done":
            raise PdctlError(
                f"{stage} is done; nothing to resume (`pdctl {cli} --fresh` reruns it)"
            )
        if status == "pending":
            raise PdctlError(f"{stage} has not started; nothing to resume: run `pdctl {cli}`")
        if latest is None:
            how = {"running": "crashed", "failed": "failed"}.get(status, "stopped")
            notify(f"{stage}: its last run {how} before its first checkpoint; starting it over")
            return None
        refuse_if_stale(env, latest)
        return latest
    if status in ("interrupted", "running", "failed") and latest is not None:
        refuse_if_stale(env, latest)
        raise PdctlError(
            f"{stage} stopped at step {latest} ({status}); continue it with "
            f"`pdctl {cli} --resume` or start over with `pdctl {cli} --fresh`"
        )
    return None


def is_stale_run(env: StageEnv) -> bool:
    """The stage's current run began under another config (`--steps` included) or read from
    a run of an earlier stage that has since been replaced."""
    st = env.project.stage(env.stage)
    return bool(env.project.rerun_upstream(env.stage)) or st.get("fingerprint") != env.fingerprint()


def refuse_if_stale(env: StageEnv, latest: int) -> None:
    """Continuing `env.stage` from checkpoint `latest` would mix two configs (or two upstream
    results): refuse, naming what changed and the two ways on."""
    if not is_stale_run(env):
        return
    stage, cli = env.stage, command(env.stage)
    meta = read_meta(env.project.checkpoint_dir(stage), latest) or {}
    changed = changed_keys(meta.get("config"), env.config_snapshot())
    reason = stale_reason(env.project, stage, changed)
    undo = "" if env.project.rerun_upstream(stage) else ", or restore the config to continue it"
    raise PdctlError(
        f"{stage} is stale, so it cannot continue from step {latest} ({reason}); start over "
        f"with `pdctl {cli} --fresh`{undo}"
    )


@contextlib.contextmanager
def guarded(project: Project, stage: str) -> Iterator[None]:
    """Run one stage so that every way it can end keeps the README's promises.

    SIGTERM/SIGINT are turned into a clean stop from the start (imports, restore, compile
    included). A user mistake found after the stage began (exit 2) puts its state back as it
    was; any other failure leaves status `failed` and one line (exit 1), never `running`."""
    from pdctl import supervisor

    with runtime.stop_signals(), peers.watch(lambda lost: _peer_lost(project, stage, lost)):
        supervisor.tell(
            stage=stage, cli=command(stage), toml=str(project.path), writer=runtime.is_writer(),
            processes=jax.process_count(),
        )  # fmt: skip
        try:
            try:
                yield
            except Exception as e:
                if not isinstance(e, PdctlError):  # a collective failed: did a process die?
                    peers.settle()
                moved = project.moved()
                if moved:  # whatever failed first (a checkpoint, a state write) failed for that
                    raise RunDirMoved(f"{stage}: {moved}") from None
                raise
        except runtime.StopNow as e:  # a long call before the step loop was left running
            raise Interrupted(_left_running(project, stage, e)) from None
        except RunDirMoved:
            raise  # nothing can be written where the run directory was
        except (Interrupted, StageFailed):
            _mark_failed(project, stage, None)
            raise
        except PdctlError:
            _roll_back(project, stage)
            raise
        except Exception as e:
            line = describe_exception(stage, e)
            _mark_failed(project, stage, line)
            raise StageFailed(f"{stage}: {line}") from e
        finally:
            project.attempts.pop(stage, None)
        signum = runtime.stop_requested()
        if signum is not None:
            import signal

            name = signal.Signals(signum).name
            status = project.stage(stage).get("status", "pending")
            if project.is_done(stage):  # it had finished: nothing is left to stop or resume
                notify(f"{stage}: {name} came after it finished; it is {status}")
                return
            raise Interrupted(
                f"{stage}: stopped by {name} after it ended ({status} at step "
                f"{project.stage(stage).get('step')}); continue with `pdctl resume`"
            )


def _peer_lost(project: Project, stage: str, lost: int) -> None:
    """Another process of the run is gone (`engine.peers`), so this stage cannot go on.
    Process 0 records it `failed` at its last complete checkpoint with `lost_process`, which
    `pdctl resume` continues (with any number of processes); nothing partial is kept (a save
    in progress is dropped, no stop checkpoint is taken). Every process says one line and
    ends at once with os._exit(1): it may be waiting in a barrier or a collective that ends
    only with JAX's heartbeat timeout, and so would JAX's shutdown at exit. A stage that had
    already ended here is left as it is (the process then ends at exit: `cli.main`).

    Runs on pdctl's watchdog thread (or on the main thread, from a failure path): it takes
    the state's write lock and keeps it, so no write of the main thread follows its own."""
    from pdctl import supervisor

    supervisor.tell(lost=lost)
    WRITE_LOCK.acquire()
    st = project.stage(stage)
    began = stage in project.attempts
    if began and st.get("status") != "running":  # it ended here: nothing left to stop
        WRITE_LOCK.release()
        return
    who = (
        f"{stage}: process {lost} of {jax.process_count()} is gone (killed, or crashed: see "
        "its output), so the run cannot go on"
    )
    if not began:
        line = f"{who}; it had not begun the stage here: nothing was written"
    elif project.writer:
        latest = supervisor.latest_checkpoint(project, stage, st)
        with contextlib.suppress(Exception):
            drop_unfinished(project.checkpoint_dir(stage))
        kept = (
            f"the last checkpoint is step {latest}; continue with `pdctl resume`"
            if latest is not None
            else "no checkpoint of this run was saved; `pdctl resume` starts it over"
        )
        line = f"{who}; nothing partial was saved, {kept} (with any number of processes)"
        try:
            project.update_stage(
                stage, status="failed", error=line[:300], checkpoint=latest, lost_process=lost
            )
        except Exception as e:
            line += f" (its state could not be written: {e})"
    elif lost == 0:
        line = (
            f"{who}; only process 0 writes the stage's state, so this one writes nothing: "
            "`pdctl status` shows what process 0 last recorded"
        )
    else:
        line = f"{who}; process 0 records the stage's state (see its output, or `pdctl status`)"
    sys.stdout.flush()
    sys.stderr.flush()
    # The last line: what JAX's agent may log while the process ends (process 0's service
    # gone) would only repeat it. Its threads write to fd 2 at any moment, so fd 2 goes to
    # /dev/null first and the line is written whole, in one write, to a copy of the old one.
    out = 2
    with contextlib.suppress(OSError):
        out = os.dup(2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 2)
    with contextlib.suppress(OSError):
        os.write(out, f"error: {line}\n".encode())
    supervisor.tell_said(1)
    os._exit(1)


def _left_running(project: Project, stage: str, e: runtime.StopNow) -> str:
    """A stop while the stage restored, tokenized or compiled before its step loop, in a call
    that did not end: the stage is `interrupted` where its last checkpoint is (nothing new is
    saved), and the line says so."""
    began = stage in project.attempts
    st = project.stage(stage)
    if began and project.writer and st.get("status") == "running":
        with contextlib.suppress(Exception):
            project.update_stage(stage, status="interrupted")
    where = f"{stage}: stopped by {e.name} while {e.what} (left unfinished)"
    if not began:
        return f"{where}, before the stage began; nothing was written"
    latest = st.get("checkpoint")
    if latest is not None:
        return f"{where}; the last checkpoint, step {latest}, is kept; continue with `pdctl resume`"
    return f"{where}; no checkpoint of this run was saved; `pdctl resume` starts it over"


def _mark_failed(project: Project, stage: str, error: str | None) -> None:
    """A stage this process began and left `running` ends `failed`."""
    if stage not in project.attempts or not project.writer:
        return
    if project.stage(stage).get("status") == "running":
        with contextlib.suppress(Exception):
            project.update_stage(stage, status="failed", error=(error or "")[:300] or None)


def _roll_back(project: Project, stage: str) -> None:
    """Undo this process's writes to `stage`'s state after a user mistake: nothing written."""
    attempt = project.attempts.get(stage)
    if attempt is None or not project.writer:
        return
    if attempt["ckpt"]:  # it got as far as a checkpoint: keep that, say it failed
        _mark_failed(project, stage, "stopped by an input error")
        return
    before = attempt["before"]
    with contextlib.suppress(Exception):
        if before:
            project.state[stage] = before
        else:
            project.state.pop(stage, None)
        project.save_state()


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

        path, key, cut = cfg.data.path, "data.path", split
        if split == "eval" and cfg.data.eval_path:
            path, key, cut = cfg.data.eval_path, "data.eval_path", None
        elif split == "train" and cfg.data.eval_path:
            cut = None
        try:
            tokens = data.load_corpus(
                resolve(env.project.root, path),
                tokenizer_path=imported.tokenizer_path(env.target),
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
        vocab = env.target.spec.vocab_size
        if tokens.size and int(tokens.max()) >= vocab:
            raise PdctlError(
                f"{key}: token id {int(tokens.max())} is outside the model's vocabulary "
                f"({vocab}); is the tokenizer the model's own?"
            )
        return tokens
    if cfg.data.path:
        path = resolve(env.project.root, cfg.data.path)
        if not path.is_file():
            raise PdctlError(f"data.path: no file at {path}")
        try:
            return data.load_text(path)
        except ValueError as e:
            raise PdctlError(f"data.path: {e}") from None
    return data.synthetic_corpus(cfg.run.seed, cfg.data.synthetic_bytes)


def peak_flops(cfg: Config) -> float | None:
    """One device's peak FLOP/s (the table by device kind, or `[measure] peak_tflops`)."""
    from pdctl.engine.measure import peak_flops_per_device

    return peak_flops_per_device(jax.devices()[0], cfg.measure.peak_tflops)


def abstract_target(cfg: Config, target: Target) -> Any:
    """The target's parameters as ShapeDtypeStructs: what init-weights creates (and pretrain
    trains, and warmup/train take frozen)."""
    return jax.eval_shape(target.init, stream_key(cfg, STREAM_TARGET))


def pretrained_target(env: StageEnv) -> Any:
    """The trained target parameters: the `params` item of pretrain's latest checkpoint, or an
    imported model read from its directory straight into the mesh's shardings (each process
    reads only the slices its devices hold)."""
    abstract = abstract_target(env.cfg, env.target)
    st = env.project.stage("pretrain")
    if st.get("status") == "imported":
        from pdctl.science.targets import imported

        imported.verify(env.target, st)
        return imported.load(env.target, env.shardings(abstract), dtype=env.target.param_dtype)
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

    tracker = env.tracker(start)
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
            tracker=tracker,
            log_every=log_every,
            checkpoint_every=env.cfg.checkpoint.every,
            batches=batches,
            batches_state=batches_state(batches) if batches is not None else None,
            max_bad_steps=max_bad_steps,
            eval_fn=eval_fn,
            eval_every=eval_every,
            examples_per_step=examples_per_step,
            tokens_per_step=examples_per_step * target.n_tokens_per_example() if is_text else 0,
            lr_fn=lr_fn,
            peak_flops=peak_flops(env.cfg),
            profile=profile,
            profile_dir=env.project.profiles_dir / env.stage,
            meta=env.run_meta() if isinstance(env.project, Project) else {},
        ).run()
    finally:
        tracker.finish()
        if batches is not None:
            batches.close()


# ---- the one way a training stage runs --------------------------------------------------------


def text_batch_spec(cfg: Config, target: Target, batch_size: int, mesh: Mesh) -> tuple[Any, Any]:
    """(abstract batch, its shardings) of a text target's step: `{"tokens": (batch, seq_len +
    1) int32}` split over the batch axes; (None, None) for the toys, whose step makes its own."""
    if target.output_kind != "logits":
        return None, None
    tokens = jax.ShapeDtypeStruct((batch_size, cfg.data.seq_len + 1), jnp.int32)
    return {"tokens": tokens}, {"tokens": sharding.batch_sharding(mesh, 2)}


@dataclass(frozen=True)
class StageSpec:
    """What a training stage is, besides its program: what a fresh run
    starts from (the upstream arrays `make_state` takes), its frozen arguments (the trained
    target, for warmup and train) and, optionally, how it evaluates."""

    name: str  # in the registry, which says what it requires
    program: Callable[..., Any]  # (cfg, mesh, target, **options) -> StepProgram
    fresh_inputs: Callable[[StageEnv, Any], tuple[Any, ...]]
    frozen: Callable[[StageEnv, Any], tuple[Any, ...]] | None = None
    evaluation: Callable[[StageEnv, tuple[Any, ...], Any], Callable[[Any], dict]] | None = None
    # (env, step, program) -> (state, meta); default `env.restore_state` into the program's
    # abstract state (train converts an older checkpoint layout)
    restore: Callable[[StageEnv, int, Any], tuple[Any, dict[str, Any]]] | None = None


def run_stage(
    project: Project,
    spec: StageSpec,
    *,
    until: int | None = None,
    resume: bool = False,
    fresh: bool = False,
    profile: tuple[int, int] | None = None,
    overrides: dict[str, Any] | None = None,
    program_options: dict[str, Any] | None = None,
):
    """Run any training stage: open the run, find where to start (fresh or a checkpoint), build
    the stage's program, make or restore its state, feed it batches and hand it to the loop."""
    with StageEnv.open(project, spec.name) as env:
        return _run_stage(env, spec, until, resume, fresh, profile, overrides, program_options)


def _run_stage(env, spec, until, resume, fresh, profile, overrides, program_options):
    env.overrides.update(overrides or {})
    cfg = env.cfg
    prog = spec.program(cfg, env.mesh, env.target, **(program_options or {}))
    ckpt_step = resume_point(env, resume=resume, fresh=fresh)
    # Restores, tokenization and the compiles inside them are long calls into C++: each runs
    # `interruptible`, so a stop request is acted on within seconds (runtime.StopNow).
    later = runtime.interruptible
    frozen = later(spec.frozen, env, prog, what="restoring the target") if spec.frozen else ()
    data_state = None
    if ckpt_step is None:
        env.begin(fresh=True, steps=prog.total_steps)
        state = later(
            lambda: prog.jit_make_state()(*spec.fresh_inputs(env, prog)),
            what="restoring the stage's inputs",
        )
        start = 0
    else:
        env.begin(fresh=False, steps=prog.total_steps)
        if spec.restore is not None:
            state, meta = later(
                spec.restore, env, ckpt_step, prog, what=f"restoring checkpoint {ckpt_step}"
            )
        else:
            state, meta = later(
                env.restore_state,
                ckpt_step,
                prog.abstract_state,
                prog.state_shardings,
                what=f"restoring checkpoint {ckpt_step}",
            )
        start, data_state = int(meta["step"]), meta.get("data")
    batches = None
    if not prog.makes_own_batch:
        batches = later(
            text_batches,
            env,
            prog.examples_per_step,
            seed=cfg.run.seed,
            state=data_state,
            sharding=prog.batch_shardings["tokens"],
            what="reading and tokenizing the corpus",
        )
    eval_fn = None
    if spec.evaluation:
        eval_fn = later(spec.evaluation, env, frozen, prog, what="preparing the evaluation")
    table = getattr(cfg, spec.name)
    result = run_loop(
        env,
        step_fn=prog.jit(),
        state=state,
        frozen=frozen,
        total=prog.total_steps,
        start=start,
        until=until,
        log_every=table.log_every,
        max_bad_steps=table.max_bad_steps,
        batches=batches,
        eval_fn=eval_fn,
        eval_every=getattr(table, "eval_every", 0),
        examples_per_step=prog.examples_per_step,
        lr_fn=prog.lr_fn,
        profile=profile,
    )
    if result.status == "done" and result.eval:
        env.on_state(eval=result.eval)
    return result


def frozen_target(env: StageEnv, prog: Any) -> tuple[Any, ...]:
    """The frozen first argument of warmup and train: the trained (or imported) target."""
    return (pretrained_target(env),)
