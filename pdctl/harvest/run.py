"""`pdctl harvest`: one pass over a corpus through the target and the trained CI functions,
every batch's CI counted by `accumulate.Harvest`, the result written to
`<run>/harvest/harvest.db` (`db`).

What it reads: the decomposition of the stage's latest checkpoint (`report.load`: V / U and
the CI functions, never the optimizer state) and the target's weights. LMs: `--tokens` tokens
of the eval split (default: all of it) in corpus order, as consecutive windows of
`data.seq_len`; toys: `--tokens` inputs drawn as the train stage draws them, and the CI of each
one-hot feature. The CI program is the evaluation's (`evaluate.compute_ci_jit`) over this
machine's devices, the batch split across them; each batch's CI goes straight into the
accumulator's jitted reduction (`accumulate.Harvest`) on the device, and nothing waits for a
batch before the next is dispatched. Every `SAVE_EVERY` batches the accumulator is saved
(`harvest/partial.npz`, atomically): an interrupted harvest (SIGTERM, SIGKILL, a crash) run
again with the same options goes on from there and ends with the same database.

SIGTERM / SIGINT (`runtime.stop_signals`, as the stages use it) stop the harvest after the
batch in flight: the state is saved and `Interrupted` (exit 3) says how to go on. Restoring,
tokenizing and the first (compiling) batch run `runtime.interruptible`, so a stop is acted on
within seconds there too; a stop during the output effects saves the finished pass over the
corpus, and the rerun goes straight to the effects.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import jax
import numpy as np

from pdctl.errors import PdctlError
from pdctl.harvest import db
from pdctl.harvest.accumulate import Harvest
from pdctl.project import Project, now

SAVE_EVERY = 8  # batches between saves of the partial state
PARTIAL_FORMAT = 2  # the layout of partial.npz (1: the host accumulator's, not read any more)
TOY_INPUTS = 8192  # toys: inputs harvested by default
TOY_BATCH = 1024
EFFECTS = 256  # LMs: components (the most often firing) whose output effect is measured


@dataclass
class Result:
    path: Path
    n_positions: int
    resumed_from: int  # batches already done by an earlier, interrupted harvest
    batches: int


def harvest_dir(project: Project) -> Path:
    return project.root / "harvest"


def _save_partial(d: Path, h: Harvest, key: str, next_batch: int) -> None:
    tmp = d / "partial.tmp.npz"
    with open(tmp, "wb") as f:
        np.savez(f, **h.state(), _key=np.asarray(key), _next=np.asarray(next_batch))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, d / "partial.npz")


def _load_partial(d: Path, h: Harvest, key: str) -> int:
    """The next batch of an interrupted harvest with the same `key` (0: start afresh)."""
    path = d / "partial.npz"
    if not path.is_file():
        return 0
    try:
        with np.load(path) as z:
            if str(z["_key"]) != key:
                return 0
            state = {k: z[k] for k in z.files}
        h.load_state(state)
        return int(state["_next"])
    except Exception:  # a torn or foreign file: start over (it is only a cache of work done)
        return 0


def _stopped(signum: int, done: str) -> PdctlError:
    import signal

    from pdctl.engine.loop import Interrupted

    name = signal.Signals(signum).name
    return Interrupted(
        f"harvest: stopped by {name} {done}; the work so far is saved: run `pdctl harvest` "
        "again with the same options to go on"
    )


def harvest(
    project: Project,
    **kwargs,
) -> Result:
    """`_harvest` with SIGTERM / SIGINT turned into a clean stop (exit 3, see the module)."""
    from pdctl.engine import runtime

    with runtime.stop_signals():
        try:
            return _harvest(project, **kwargs)
        except runtime.StopNow as e:  # a restore, tokenization or compile left running
            from pdctl.engine.loop import Interrupted

            raise Interrupted(
                f"harvest: stopped by {e.name} while {e.what} (left unfinished); what was "
                "saved before is kept: run `pdctl harvest` again with the same options to go on"
            ) from None


def _harvest(
    project: Project,
    *,
    stage: str = "train",
    n_tokens: int | None = None,
    batch_size: int | None = None,
    split: str = "eval",
    top_k: int = 20,
    effects: int = EFFECTS,
    on_batch: Callable[[int, int], None] | None = None,
) -> Result:
    from pdctl.engine import runtime, sharding
    from pdctl.report import load
    from pdctl.science.spd import evaluate
    from pdctl.stages.common import STREAM_TRAIN, StageEnv, corpus_tokens, stream_key

    if n_tokens is not None and n_tokens < 1:
        raise PdctlError(f"--tokens: must be >= 1, got {n_tokens}")
    if batch_size is not None and batch_size < 1:
        raise PdctlError(f"--batch-size: must be >= 1, got {batch_size}")
    if split not in ("eval", "train"):
        raise PdctlError(f"--split: must be eval or train, got {split!r}")
    if top_k < 1:
        raise PdctlError(f"--top-k: must be >= 1, got {top_k}")
    if effects < 0:
        raise PdctlError(f"--effects: must be >= 0, got {effects}")
    if stage not in ("train", "warmup"):
        raise PdctlError(f"--stage: {stage!r} has no decomposition (choose from train, warmup)")
    try:
        dec = runtime.interruptible(
            load.load_decomposition, project, stage, what="restoring the decomposition"
        )
    except LookupError as e:
        raise PdctlError(f"harvest: {e}") from None
    cfg = project.config
    target = dec.target
    lm = target.output_kind == "logits"
    devices = jax.devices()
    mesh = sharding.make_mesh(-1, 1, devices)
    n_dev = len(devices)
    B = batch_size or (cfg.train.eval_batch_size if lm else TOY_BATCH)
    if B % n_dev:
        raise PdctlError(
            f"--batch-size: {B} is not divisible by the {n_dev} devices (pick a multiple)"
        )
    sites = {s: int(c["V"].shape[1]) for s, c in dec.components.items()}

    if lm:
        T = cfg.data.seq_len
        env = StageEnv(project, "train", mesh, target)  # a view only: no lock, nothing written
        stream = runtime.interruptible(
            lambda: np.asarray(corpus_tokens(env, split)), what="reading and tokenizing the corpus"
        )
        if n_tokens is not None and n_tokens < T:
            raise PdctlError(f"--tokens: {n_tokens} is fewer than one sequence (data.seq_len {T})")
        n_windows = stream.size // T
        if n_tokens is not None:
            n_windows = min(n_windows, n_tokens // T)
        if n_windows < 1:
            raise PdctlError(
                f"harvest: the {split} split holds {stream.size} tokens, fewer than one "
                f"sequence of {T} (data.seq_len)"
            )
        windows = stream[: n_windows * T].reshape(n_windows, T).astype(np.int32)
        n_items = n_windows
        vocab = int(target.spec.vocab_size) if target.kind == "hf" else int(target.vocab_size)
    else:
        T, windows, vocab = 1, None, None
        n_items = n_tokens or TOY_INPUTS
    n_batches = math.ceil(n_items / B)

    rep = sharding.replicated(mesh)
    h = Harvest(sites, cfg.decomp.ci_threshold, top_k=top_k, n_samples=top_k, vocab=vocab,
                seed=cfg.run.seed, device=devices[0])  # fmt: skip
    st = project.stage(stage)
    ident = {"stage": stage, "step": dec.step, "run_id": st.get("run_id"), "split": split,
             "items": n_items, "batch": B, "top_k": top_k, "lm": lm,
             "format": PARTIAL_FORMAT}  # fmt: skip
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    out_dir = harvest_dir(project)
    out_dir.mkdir(exist_ok=True)
    start_batch = _load_partial(out_dir, h, key)

    params = jax.device_put(dec.params, rep)
    comps = jax.device_put(dec.components, rep)
    ci_fns = jax.device_put(dec.ci_fns, rep)
    in_sh = sharding.batch_sharding(mesh, 2)
    toy_key = jax.random.fold_in(stream_key(cfg, STREAM_TRAIN), 2**20)
    make = None if lm else jax.jit(lambda k: target.inputs(target.make_batch(k, B)))

    def one_batch(i: int) -> None:
        lo, hi = i * B, min(n_items, (i + 1) * B)
        if lm:
            x = windows[lo:hi]
            if x.shape[0] < B:  # one shape for every batch: one compile; the padding is dropped
                x = np.concatenate([x, np.zeros((B - x.shape[0], T), x.dtype)])
            x_dev = jax.device_put(x, in_sh)
        else:
            x_dev = jax.device_put(make(jax.random.fold_in(toy_key, i)), in_sh)
            x = None
        ci_lower, _ = evaluate.compute_ci_jit(target, params, comps, ci_fns, cfg, x_dev)
        h.add(ci_lower, x, start=lo * T, valid=hi - lo)  # dispatched, not waited for

    for i in range(start_batch, n_batches):
        if i == start_batch:  # the first batch compiles: a stop must not wait for it
            runtime.interruptible(one_batch, i, what="compiling the harvest")
        else:
            one_batch(i)
        signum = runtime.stop_requested()
        if signum is not None and i + 1 < n_batches:
            _save_partial(out_dir, h, key, i + 1)
            raise _stopped(signum, f"after batch {i + 1} of {n_batches}")
        if (i + 1) % SAVE_EVERY == 0 and i + 1 < n_batches:
            _save_partial(out_dir, h, key, i + 1)
        if on_batch is not None:
            on_batch(i + 1, n_batches)
    h.sync()

    changes = None
    if lm and effects:
        from pdctl.harvest import effect

        stats = h.stats
        ranked = sorted(
            (
                (int(stats[s].count[c]), s, c)
                for s in sites
                for c in range(sites[s])
                if stats[s].count[c] > 0
            ),
            key=lambda r: (-r[0], r[1], r[2]),
        )
        chosen = []
        for _, s, c in ranked[:effects]:
            pos = stats[s].sample.pos[:, c]
            chosen.append((s, c, np.sort(pos[pos >= 0])))

        def stop() -> None:
            signum = runtime.stop_requested()
            if signum is not None:
                _save_partial(out_dir, h, key, n_batches)
                raise _stopped(
                    signum, "during the output effects (the pass over the corpus is done)"
                )

        got = effect.output_effects(target, params, comps, ci_fns, cfg, windows, chosen, top_k,
                                    check=stop)  # fmt: skip
        changes = {sc: effect.top_changes(v) for sc, v in got.items()}  # fmt: skip
    toy = None
    if not lm and hasattr(target, "n_features"):
        toy = evaluate.toy_ci_matrices(target, params, comps, ci_fns, cfg)
    meta = {"run_id": st.get("run_id"), "stage": stage, "step": dec.step, "split": split,
            "seq_len": T if lm else None, "kind": target.kind, "lm": lm, "vocab": vocab,
            "batch_size": B, "devices": n_dev, "created": now(), "top_k": top_k}  # fmt: skip
    path = out_dir / "harvest.db"
    norms = {
        s: (np.linalg.norm(np.asarray(c["V"], np.float32), axis=0),
            np.linalg.norm(np.asarray(c["U"], np.float32), axis=1))
        for s, c in dec.components.items()
    }  # fmt: skip
    db.write(path, h, meta, toy_features=toy, norms=norms, effects=changes)
    (out_dir / "partial.npz").unlink(missing_ok=True)
    return Result(path, h.n_positions, start_batch, n_batches)


def harvest_line(project: Project) -> str | None:
    """`harvest: <path> (train checkpoint 20, 10848 positions, ...)` when one exists; says when
    the stage has moved on since (its checkpoint or run is another) or a harvest was cut off."""
    d = harvest_dir(project)
    path = d / "harvest.db"
    partial = " (an interrupted harvest can go on: `pdctl harvest` again)"
    partial = partial if (d / "partial.npz").is_file() else ""
    if not path.is_file():
        return f"harvest: none yet{partial}" if partial else None
    try:
        con = db.open_readonly(path)
        try:
            meta = {k: json.loads(v) for k, v in con.execute("SELECT key, value FROM meta")}
        finally:
            con.close()
    except (PdctlError, ValueError, OSError) as e:
        return f"harvest: {path} is unreadable ({e})"
    stage = meta.get("stage", "train")
    st = project.stage(stage)
    moved = ""
    if st.get("run_id") != meta.get("run_id") or st.get("checkpoint") != meta.get("step"):
        moved = f"; {stage} has moved on since: run `pdctl harvest` again"
    return (
        f"harvest: {path} ({stage} checkpoint {meta.get('step')}, {meta.get('n_positions')} "
        f"positions, {meta.get('created')}{moved}){partial}"
    )
