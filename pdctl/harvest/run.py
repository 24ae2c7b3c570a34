"""`pdctl harvest`: one pass over a corpus through the target and the trained CI functions,
every batch's CI counted by `accumulate.Harvest`, the result written to
`<run>/harvest/harvest.db` (`db`).

What it reads: the decomposition of the stage's latest checkpoint (`stages.decomposition`:
V / U and the CI functions, never the optimizer state) and the target's weights. LMs:
`--tokens` tokens of the eval split (default: all of it) in corpus order, as consecutive windows of
`data.seq_len`; toys: `--tokens` inputs drawn as the train stage draws them, and the CI of each
one-hot feature. The CI program is the evaluation's (`evaluate.compute_ci_jit`) over this
process's devices, the batch split across them; each batch's CI goes straight into the
accumulator's jitted reduction (`accumulate.Harvest`) on the device, and nothing waits for a
batch before the next is dispatched. Every `SAVE_EVERY` batches the accumulator is saved
(`harvest/partial.npz`, atomically): an interrupted harvest (SIGTERM, SIGKILL, a crash) run
again with the same options goes on from there and ends with the same database.

Co-occurrence: a dense C_total x C_total count matrix while C_total <= `--cooc-max` (8192:
512 MiB of int64 on the accumulator's device); beyond that a second pass over the same batches
counts it among the `--cooc-max` most often firing components (`accumulate.CoocCounter`), so
the cost is one more forward + CI pass, not C_total^2 memory.

Nothing done is lost to a stop: the state is saved as soon as the pass over the corpus ends
(`partial.npz` with every batch done), the second pass's counts every `SAVE_EVERY` batches and
when it ends (`cooc-<p>of<n>.npz`), and the output effects measured so far every
`EFFECTS_SAVE_EVERY` components and when they end (`effects-<p>of<n>.json`); a rerun with the
same options goes on with what is left (a kill while the database is written: just the write).
These files go once harvest.db is written. A harvest.db already complete for the same
checkpoint of the same run, the same config (`config.fingerprint` of the stage), the same
options (its `meta.options`) and batch, on as many devices and processes, is left as it is:
one line says so, nothing is read or written (`--fresh` harvests again from the start).

Several processes (jax.distributed, `--coordinator`): the pass needs no collective, so each
process harvests its own consecutive batches on its own devices and saves its part
(`partial-<p>of<n>.npz`, resumable as above); at a barrier every process reads every part and
merges them (`accumulate.merge_states`: the state one process would have, bit for bit), the
output effects are shared out (every n-th component) and gathered through small JSON files, and
process 0 writes the database. The run directory must be shared, as for checkpoints.

Otherwise a harvest.db already there is replaced whole; what later commands had added to it
(labels, clusters, attributions) is kept or saved, and said, as `keep` describes.

SIGTERM / SIGINT (`runtime.stop_signals`, as the stages use it) stop the harvest after the
batch in flight: the state is saved and `Interrupted` (exit 3) says how to go on. Restoring,
tokenizing and the first (compiling) batch of each pass run `runtime.interruptible`, so a stop
is acted on within seconds there too; a stop during the co-occurrence pass or the output
effects saves what they had done, and the rerun goes on from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdctl.errors import PdctlError
from pdctl.harvest import db, keep
from pdctl.harvest.accumulate import CoocCounter, Harvest, merge_states
from pdctl.harvest.reference import offsets
from pdctl.project import Project, now

SAVE_EVERY = 8  # batches between saves of the partial state
EFFECTS_SAVE_EVERY = 16  # output effects measured between saves of those done
SLOW_PART_S = 10.0  # a part of the harvest that takes this long says so (`_slow`)
# the layout of partial.npz (1: the host accumulator's; 2: without a checksum; neither read now)
PARTIAL_FORMAT = 3
TOY_INPUTS = 8192  # toys: inputs harvested by default
TOY_BATCH = 1024
SKIP_FIRST = 1  # LMs: each sequence's first positions left out (no context: `--skip-first`)
EFFECTS = 256  # LMs: components (the most often firing) whose output effect is measured
COOC_MAX = 8192  # components in the dense co-occurrence matrix (C_total^2 int64: 512 MiB)
# Top and sampled examples kept per component: each is a token window and its CI for every
# component, on the accumulator's device; more than a component's page can show is refused.
MAX_TOP_K = 1000
PEER_TIMEOUT_S = 6 * 3600  # several processes: how long one waits for the others' parts

log = logging.getLogger("pdctl")


@dataclass
class Result:
    path: Path
    n_positions: int
    resumed_from: int  # batches already done by an earlier, interrupted harvest
    batches: int
    processes: int = 1
    # what it kept of the database it replaced, and what not (`keep`): one line each
    kept: list[str] = field(default_factory=list)
    # harvest.db was already complete for these options: the line saying so (nothing written)
    already: str | None = None


def harvest_dir(project: Project) -> Path:
    return project.root / "harvest"


def partial_name(pid: int = 0, nproc: int = 1) -> str:
    """The file holding process `pid`'s saved state (its whole part once its pass is done)."""
    return "partial.npz" if nproc == 1 else f"partial-{pid}of{nproc}.npz"


def _atomic(path: Path, write: Callable[[Any], None]) -> None:
    """Write `path` whole through `write(file)`: a temporary file pdctl creates (never through
    a link planted at its name), renamed over `path`; a failed write (a full disk) leaves the
    old file and no temporary one, and is one line."""
    from pdctl.files import atomic_output, open_nofollow, refuse_links

    refuse_links(path)
    try:
        with (
            atomic_output(path) as tmp,
            os.fdopen(open_nofollow(tmp, os.O_WRONLY | os.O_TRUNC), "wb") as f,
        ):
            write(f)
    except OSError as e:
        raise PdctlError(
            f"harvest: cannot write {path} ({e.strerror or e}); the work saved before is kept: "
            "make room and run `pdctl harvest` again with the same options"
        ) from None


def _checksum(arrays: dict[str, np.ndarray]) -> str:
    """sha256 over every array's name, dtype, shape and bytes (the `_key` of the options
    among them), in name order."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name}\0{a.dtype.str}\0{a.shape}\0".encode())
        h.update(a.tobytes())
    return h.hexdigest()


def _save_keyed(path: Path, key: str, arrays: dict[str, Any]) -> None:
    """An .npz of `arrays`, this harvest's `key` and a checksum over both."""
    out = {k: np.asarray(v) for k, v in arrays.items()}
    out["_key"] = np.asarray(key)
    out["_sum"] = np.asarray(_checksum(out))
    # numpy's stub types savez's **kwds as if they could fill its `allow_pickle: bool`
    _atomic(path, lambda f: np.savez(f, **out))  # type: ignore[arg-type]


def _save_partial(path: Path, h: Harvest, key: str, next_batch: int) -> None:
    _save_keyed(path, key, {**h.state(), "_next": np.asarray(next_batch, np.int64)})


def _read_keyed(path: Path, key: str) -> dict[str, np.ndarray] | None:
    """The arrays of an .npz this harvest (`key`) saved, or None (missing, torn, foreign, or
    its checksum does not match its content: edited)."""
    try:
        with np.load(path, allow_pickle=False) as z:
            got = {k: z[k] for k in z.files}
        if str(got.get("_key")) != key:
            return None
        if str(got.pop("_sum")) != _checksum(got):
            log.warning("harvest: %s does not match its checksum (edited or torn): not used", path)
            return None
        return got
    except Exception:  # a torn or foreign file: start over (it is only a cache of work done)
        return None


def _read_partial(
    path: Path, key: str, first: int, last: int, positions: Callable[[int], int]
) -> tuple[dict[str, np.ndarray], int] | None:
    """(state, next batch) of a saved harvest with the same `key` over batches [first, last),
    or None. Values no harvest can reach are not used: a next batch outside [first, last], a
    position count other than the batches done cover (`positions(next)`), a count below 0 or
    above the positions."""
    got = _read_keyed(path, key)
    if got is None:
        return None
    state = {k: v for k, v in got.items() if not k.startswith("_")}
    try:
        nxt = int(got["_next"])
        n = int(state["n_positions"])
        count = np.asarray(state["count"])
        ok = first <= nxt <= last and n == positions(nxt) and count.size > 0
        ok = ok and int(count.min()) >= 0 and int(count.max()) <= n
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        log.warning("harvest: %s holds values no harvest reaches: not used", path)
        return None
    return state, nxt


def _load_partial(
    path: Path, h: Harvest, key: str, first: int, last: int, positions: Callable[[int], int]
) -> int | None:
    """The next batch of an interrupted harvest with the same `key` (None: start afresh)."""
    got = _read_partial(path, key, first, last, positions)
    if got is None:
        return None
    try:
        h.load_state(got[0])
    except (ValueError, KeyError):
        return None
    return got[1]


def _batches_of(pid: int, nproc: int, n_batches: int) -> tuple[int, int]:
    """Process `pid`'s part: consecutive batches [lo, hi), the parts as even as they go."""
    return pid * n_batches // nproc, (pid + 1) * n_batches // nproc


def _latest_step(project: Project, stage: str) -> int | None:
    """The step of `stage`'s latest checkpoint, found as `decomposition.load_decomposition`
    finds it, without reading it (None: there is none; 0 for a warmup of `steps = 0`, whose
    components are init-weights')."""
    import orbax.checkpoint as ocp

    from pdctl.stages.decomposition import warmup_kept_init

    if stage == "warmup" and warmup_kept_init(project):
        return 0

    directory = project.checkpoint_dir(stage)
    found = ocp.step.standard_name_format().find_all(directory) if directory.is_dir() else []
    return max((int(m.step) for m in found), default=None)


def select_sites(sites: dict[str, int], patterns: list[str]) -> dict[str, int]:
    """The decomposition's sites (in its order) that match any of `patterns` (`--sites`, glob
    patterns as `[[decomp.sites]] pattern` takes them); all of them when none is given."""
    import fnmatch

    if not patterns:
        return sites
    hits = {p: {s for s in sites if fnmatch.fnmatchcase(s, p)} for p in patterns}
    for p, matched in hits.items():
        if not matched:
            names = list(sites)
            shown = ", ".join(names[:3]) + (f", ... ({len(names)} sites)" if len(names) > 3 else "")
            raise PdctlError(f"--sites: no site matches {p!r} (the sites: {shown})")
    return {s: C for s, C in sites.items() if any(s in m for m in hits.values())}


def harvest_options(project: Project, stage: str, step: int | None, **options: Any) -> dict:
    """What makes two harvests the same, beside the batch and the devices and processes it ran
    on (meta's `batch_size`, `devices`, `processes`: an LM's mean CI can move by an ulp with
    another batch per device): `meta.options` in harvest.db, the checkpoint (stage, step, run
    id), the config it is read with (`config.fingerprint` of the stage) and the command's
    options as given."""
    from pdctl.config import fingerprint

    out = {"stage": stage, "step": step, "run_id": project.stage(stage).get("run_id"),
           "config": fingerprint(project.config, stage), **options}  # fmt: skip
    return json.loads(json.dumps(out, sort_keys=True))  # as read back from the database


def _batch_and_devices(cfg: Any, lm: bool, batch_size: int | None) -> tuple[int, list]:
    """(the batch, this process's devices it is split over): the default batch (the eval
    batch for an LM) on as many devices as divide it."""
    devices = jax.local_devices()
    B = batch_size or (cfg.train.eval_batch_size if lm else TOY_BATCH)
    if batch_size is None:
        devices = devices[: max(d for d in range(1, len(devices) + 1) if B % d == 0)]
    return B, devices


def _complete(path: Path, options: dict, layout: dict) -> dict | None:
    """The meta of harvest.db at `path` when it is a harvest (this schema) with `options`
    (`harvest_options`) and `layout` (meta's batch_size, devices, processes), else None.
    harvest.db is written whole (`db.write`), so one that is there is complete."""
    import sqlite3

    try:
        meta = db.read_meta(path)
    except (PdctlError, ValueError, OSError, sqlite3.Error):
        return None
    same = meta.get("options") == options and all(meta.get(k) == v for k, v in layout.items())
    return meta if same else None


def _read_effects(path: Path, key: str) -> dict[tuple[str, int], Any]:
    """{(site, component): top changes} of the output effects a harvest with `key` measured
    and saved (`effects-<p>of<n>.json`); empty when none (missing, torn, another harvest)."""
    try:
        got = json.loads(path.read_text())
        if got.get("key") != key:
            return {}
        out = {}
        for s, c, ch in got["rows"]:
            rows = {k: [(int(t), float(v)) for t, v in ch[k]] for k in ("raised", "lowered")}
            out[(str(s), int(c))] = rows
        return out
    except (OSError, ValueError, TypeError, KeyError, AttributeError):
        return {}


def _save_effects(path: Path, key: str, changes: dict[tuple[str, int], Any]) -> None:
    rows = [[s, c, ch] for (s, c), ch in changes.items()]
    text = json.dumps({"key": key, "rows": rows}).encode()
    _atomic(path, lambda f: f.write(text))


def _load_cooc(
    path: Path, key: str, counter: CoocCounter, first: int, last: int, positions: Callable
) -> int | None:
    """The next batch of the co-occurrence pass a harvest with `key` saved (its counts loaded
    into `counter`), or None (start it afresh): its components must be `counter`'s, its next
    batch in [first, last], its counts within the positions the batches done cover."""
    got = _read_keyed(path, key)
    if got is None:
        return None
    try:
        nxt, counts = int(got["_next"]), np.asarray(got["counts"])
        k = counter.index.size
        ok = np.array_equal(np.asarray(got["index"]), counter.index) and first <= nxt <= last
        ok = ok and counts.shape == (k, k) and counts.dtype.kind in "iu"
        ok = ok and (k == 0 or 0 <= int(counts.min()) <= int(counts.max()) <= positions(nxt))
    except (KeyError, TypeError, ValueError):
        ok = False
    if not ok:
        log.warning("harvest: %s holds values no harvest reaches: not used", path)
        return None
    counter.load(counts)
    return nxt


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
    """`_harvest` with SIGTERM / SIGINT turned into a clean stop (exit 3, see the module),
    holding the run directory's lock: a stage that would replace the checkpoint being read
    (`train --fresh`), or another harvest, is refused while it runs, and it is refused while
    one of them runs. Process 0 holds it for every process (as for a stage); taking it checks
    that nothing under harvest/ is a symlink (`Project.check_run_dir`), and the others check
    that too."""
    import contextlib

    from pdctl.engine import runtime

    held: contextlib.AbstractContextManager[None]
    if runtime.is_writer():
        held = project.locked()
    else:
        project.check_run_dir()
        held = contextlib.nullcontext()
    with runtime.stop_signals(), held:
        try:
            return _harvest(project, **kwargs)
        except runtime.StopNow as e:  # a restore, tokenization or compile left running
            from pdctl.engine.loop import Interrupted

            raise Interrupted(
                f"harvest: stopped by {e.name} while {e.what} (left unfinished); what was "
                "saved before is kept: run `pdctl harvest` again with the same options to go on"
            ) from None


def stage_line(st: dict, stage: str, step: int) -> str | None:
    """The line that says which checkpoint is harvested when the stage did not finish
    (interrupted, failed, or still running): its latest checkpoint, not its last step."""
    status = st.get("status")
    if status in ("done", "imported", None):
        return None
    of = f" of {st['steps']}" if isinstance(st.get("steps"), int) else ""
    return (
        f"harvest: {stage} did not finish ({status} at step {st.get('step')}{of}): harvesting "
        f"its latest checkpoint, step {step}"
    )


def check_options(
    *,
    stage: str = "train",
    n_tokens: int | None = None,
    batch_size: int | None = None,
    split: str = "eval",
    top_k: int = 20,
    effects: int = EFFECTS,
    cooc_max: int = COOC_MAX,
    sites: tuple[str, ...] = (),
    skip_first: int | None = None,
) -> None:
    """One line naming the flag for a value no harvest takes."""
    if n_tokens is not None and n_tokens < 1:
        raise PdctlError(f"--tokens: must be >= 1, got {n_tokens}")
    if batch_size is not None and batch_size < 1:
        raise PdctlError(f"--batch-size: must be >= 1, got {batch_size}")
    if split not in ("eval", "train"):
        raise PdctlError(f"--split: must be eval or train, got {split!r}")
    if not 1 <= top_k <= MAX_TOP_K:
        raise PdctlError(f"--top-k: must be in [1, {MAX_TOP_K}], got {top_k}")
    if effects < 0:
        raise PdctlError(f"--effects: must be >= 0, got {effects}")
    if cooc_max < 1:
        raise PdctlError(f"--cooc-max: must be >= 1, got {cooc_max}")
    if stage not in ("train", "warmup"):
        raise PdctlError(f"--stage: {stage!r} has no decomposition (choose from train, warmup)")
    if any(not p.strip() for p in sites):
        raise PdctlError("--sites: an empty pattern (give glob patterns separated by commas)")
    if skip_first is not None and skip_first < 0:
        raise PdctlError(f"--skip-first: must be >= 0, got {skip_first}")


def _harvest(
    project: Project,
    *,
    stage: str = "train",
    n_tokens: int | None = None,
    batch_size: int | None = None,
    split: str = "eval",
    top_k: int = 20,
    effects: int = EFFECTS,
    cooc_max: int = COOC_MAX,
    sites: tuple[str, ...] = (),
    skip_first: int | None = None,
    on_batch: Callable[[int, int], None] | None = None,
    fresh: bool = False,
) -> Result:
    from pdctl.engine import runtime, sharding
    from pdctl.science.spd import evaluate
    from pdctl.science.spd.components import GLOBAL_CI
    from pdctl.stages import decomposition
    from pdctl.stages.env import StageEnv, corpus_tokens
    from pdctl.stages.inputs import STREAM_TRAIN, stream_key, target_from_config

    check_options(stage=stage, n_tokens=n_tokens, batch_size=batch_size, split=split,
                  top_k=top_k, effects=effects, cooc_max=cooc_max, sites=sites,
                  skip_first=skip_first)  # fmt: skip
    nproc, pid = jax.process_count(), jax.process_index()
    path = harvest_dir(project) / "harvest.db"
    patterns = [p.strip() for p in sites]
    given: dict[str, Any] = {"split": split, "tokens": n_tokens, "top_k": top_k,
                             "effects": effects, "cooc_max": cooc_max}  # fmt: skip
    if patterns:  # only when given: a harvest of every site keeps the options it always had
        given["sites"] = patterns

    def first_left_out(lm: bool) -> int:
        """Each sequence's first positions not harvested (an LM's; `given` records them)."""
        if not lm:
            if skip_first:
                raise PdctlError("--skip-first: a toy's inputs are not sequences (LMs only)")
            return 0
        skip = SKIP_FIRST if skip_first is None else skip_first
        if skip >= project.config.data.seq_len:
            raise PdctlError(f"--skip-first: {skip} leaves nothing of a sequence of "
                             f"{project.config.data.seq_len} tokens (data.seq_len)")  # fmt: skip
        given["skip_first"] = skip
        return skip

    try:
        built = target_from_config(project.config, project.root, need_weights=False)
    except Exception:  # a target it cannot build: the restore below says why
        built = None
    if built is not None:
        first_left_out(built.output_kind == "logits")
    db.check_side_files(path)  # another program's -wal beside harvest.db: before any work
    step = _latest_step(project, stage)
    done_before = None
    if not fresh and step is not None and path.is_file() and built is not None:  # done?
        try:
            B_, devices_ = _batch_and_devices(project.config, built.output_kind == "logits",
                                              batch_size)  # fmt: skip
        except Exception:  # a target it cannot build: the harvest below says why
            B_ = None
        if B_ is not None:
            layout = {"batch_size": B_, "devices": len(devices_) * nproc, "processes": nproc}
            options = harvest_options(project, stage, step, **given)
            done_before = _complete(path, options, layout)
    if done_before is not None:  # nothing to do: nothing read, nothing written
        return Result(path, int(done_before.get("n_positions") or 0), 0, 0, nproc, already=(
            f"harvest: already complete for {stage} checkpoint {step} with the same options: "
            f"{path}; nothing to do (`pdctl harvest --fresh` harvests again)"))  # fmt: skip
    t0 = time.monotonic()
    try:
        dec = runtime.interruptible(
            decomposition.load_decomposition, project, stage, what="restoring the decomposition"
        )
    except LookupError as e:
        raise PdctlError(f"harvest: {e}") from None
    _slow(f"{stage} checkpoint {dec.step} restored", t0)
    line = stage_line(project.stage(stage), stage, dec.step)
    if line:
        log.warning(line)
    cfg = project.config
    target = dec.target
    lm = target.output_kind == "logits"
    skip = first_left_out(lm)
    # Several processes (jax.distributed): each harvests its own consecutive batches on its
    # own devices (the pass needs no collective), saves its part, and every process merges
    # the parts (`merge_states`); the output effects are shared out; process 0 writes.
    B, devices = _batch_and_devices(cfg, lm, batch_size)
    mesh = sharding.make_mesh(-1, 1, devices)
    n_dev = len(devices)
    if B % n_dev:
        raise PdctlError(
            f"--batch-size: {B} is not divisible by the {n_dev} devices of this process "
            "(pick a multiple)"
        )
    every = {s: int(c["V"].shape[1]) for s, c in dec.components.items()}
    site_sizes = select_sites(every, patterns)

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
    # components numbered among all the decomposition's sites, whichever `--sites` keeps
    h = Harvest(site_sizes, cfg.decomp.ci_threshold, top_k=top_k, n_samples=top_k, vocab=vocab,
                cooc_max=cooc_max, seed=cfg.run.seed, device=devices[0],
                numbered_from=offsets(every), skip_first=skip)  # fmt: skip
    st = project.stage(stage)
    options = harvest_options(project, stage, dec.step, **given)
    ident = {"stage": stage, "step": dec.step, "run_id": st.get("run_id"), "split": split,
             "items": n_items, "batch": B, "top_k": top_k, "lm": lm,
             "format": PARTIAL_FORMAT, "processes": nproc, "cooc_max": cooc_max,
             "config": options["config"], **({"sites": patterns} if patterns else {}),
             **({"skip_first": skip} if skip else {})}  # fmt: skip
    key = hashlib.sha256(json.dumps(ident, sort_keys=True).encode()).hexdigest()[:16]
    out_dir = harvest_dir(project)
    out_dir.mkdir(exist_ok=True)
    first, last = _batches_of(pid, nproc, n_batches)
    mine = out_dir / partial_name(pid, nproc)

    def positions(lo: int, hi: int) -> int:
        """Positions batches [lo, hi) cover (those each sequence's `skip` first leave)."""
        return (min(n_items, hi * B) - min(n_items, lo * B)) * (T - skip)

    got = None if fresh else _load_partial(mine, h, key, first, last,
                                           lambda nxt: positions(first, nxt))  # fmt: skip
    start_batch = first if got is None else got

    params = jax.device_put(dec.params, rep)
    comps = jax.device_put(dec.components, rep)
    ci_fns = jax.device_put(dec.ci_fns, rep)
    # The passes need the CI of the harvested sites alone. With a CI function per site, those
    # sites' functions on their inputs give it (`--sites` of 3 layers of 30: a tenth of the
    # captured inputs and CI); a global CI function reads every site's inputs.
    pass_comps, pass_fns = comps, ci_fns
    if cfg.decomp.ci_fn.type != GLOBAL_CI and len(site_sizes) < len(every):
        pass_comps = {s: comps[s] for s in site_sizes}
        pass_fns = {s: ci_fns[s] for s in site_sizes}
    in_sh = sharding.batch_sharding(mesh, 2)
    toy_key = jax.random.fold_in(stream_key(cfg, STREAM_TRAIN), 2**20)
    make = None if lm else jax.jit(lambda k: target.inputs(target.make_batch(k, B)))

    def ci_batch(i: int) -> tuple[Any, np.ndarray | None, int, int]:
        """Batch i's CI (dispatched, not waited for), its tokens and its rows [lo, hi)."""
        lo, hi = i * B, min(n_items, (i + 1) * B)
        if lm:
            x = windows[lo:hi]
            if x.shape[0] < B:  # one shape for every batch: one compile; the padding is dropped
                x = np.concatenate([x, np.zeros((B - x.shape[0], T), x.dtype)])
            x_dev = jax.device_put(x, in_sh)
        else:
            assert make is not None  # built whenever not lm
            x_dev = jax.device_put(make(jax.random.fold_in(toy_key, i)), in_sh)
            x = None
        ci_lower, _ = evaluate.compute_ci_jit(target, params, pass_comps, pass_fns, cfg, x_dev)
        return ci_lower, x, lo, hi

    def one_batch(i: int) -> None:
        ci_lower, x, lo, hi = ci_batch(i)
        h.add(ci_lower, x, start=lo * T, valid=hi - lo)  # dispatched, not waited for

    of = f" of {n_batches}" if nproc == 1 else f" (batches {first}..{last - 1} of {n_batches})"
    phase = _Phase(f"{sum(site_sizes.values())} components of {len(site_sizes)} sites")
    for i in range(start_batch, last):
        if i == start_batch:  # the first batch compiles: a stop must not wait for it
            runtime.interruptible(one_batch, i, what="compiling the harvest")
            phase.first()
        else:
            one_batch(i)
        signum = runtime.stop_requested()
        if signum is not None and i + 1 < last:
            _save_partial(mine, h, key, i + 1)
            raise _stopped(signum, f"after batch {i + 1}{of}")
        if (i + 1) % SAVE_EVERY == 0 and i + 1 < last:
            _save_partial(mine, h, key, i + 1)
        if on_batch is not None:
            on_batch(i + 1 - first, last - first)
    h.sync()
    phase.end("the pass", last - start_batch)
    if start_batch < last or got is None:  # the pass is done: a stop from here on keeps it
        _save_partial(mine, h, key, last)
    if nproc > 1:  # hand the part over; take everyone's
        runtime.barrier("pdctl-harvest-parts", PEER_TIMEOUT_S)
        parts: list[Mapping[str, np.ndarray]] = [
            _part(out_dir, key, p, nproc, n_batches, positions) for p in range(nproc)
        ]
        h.load_state(merge_states(parts))

    if not h.cooc_kept:  # too many components for the dense matrix: a second, narrower pass
        count = np.concatenate([h.stats[s].count for s in site_sizes])
        alive = np.nonzero(count > 0)[0]
        index = np.sort(alive[np.lexsort((alive, -count[alive]))[:cooc_max]])
        if index.size:
            counter = CoocCounter(site_sizes, index, cfg.decomp.ci_threshold, device=devices[0],
                                  skip_first=skip)  # fmt: skip
            mine_c = out_dir / f"cooc-{pid}of{nproc}.npz"

            def save_cooc(nxt: int) -> None:
                _save_keyed(mine_c, key, {"counts": counter.counts, "index": index,
                                          "_next": np.asarray(nxt, np.int64)})  # fmt: skip

            def one_cooc(i: int) -> None:
                ci_lower, _, lo, hi = ci_batch(i)
                counter.add(ci_lower, hi - lo)

            got_c = None if fresh else _load_cooc(mine_c, key, counter, first, last,
                                                  lambda nxt: positions(first, nxt))  # fmt: skip
            start_c = first if got_c is None else got_c
            phase = _Phase(f"the {index.size} most often firing components")
            for i in range(start_c, last):
                if i == start_c:  # its first batch compiles the counter's step
                    runtime.interruptible(one_cooc, i, what="compiling the co-occurrence pass")
                    phase.first()
                else:
                    one_cooc(i)
                signum = runtime.stop_requested()
                if signum is not None and i + 1 < last:
                    save_cooc(i + 1)
                    raise _stopped(signum, f"after batch {i + 1}{of} of the co-occurrence pass "
                                           "(the first pass is done)")  # fmt: skip
                if (i + 1) % SAVE_EVERY == 0 and i + 1 < last:
                    save_cooc(i + 1)
                if on_batch is not None:
                    on_batch(i + 1 - first, last - first)
            if start_c < last or got_c is None:  # done: a stop from here on keeps it
                save_cooc(last)
            counts = counter.counts
            phase.end("the co-occurrence pass", last - start_c)
            if nproc > 1:
                runtime.barrier("pdctl-harvest-cooc", PEER_TIMEOUT_S)
                parts_c = [_cooc_part(out_dir, key, p, nproc, n_batches) for p in range(nproc)]
                counts = sum(parts_c[1:], parts_c[0])
            h.set_cooc(index, counts)

    changes = None
    if lm and effects:
        from pdctl.harvest import effect

        stats = h.stats
        ranked = sorted(
            (
                (int(stats[s].count[c]), s, c)
                for s in site_sizes
                for c in range(site_sizes[s])
                if stats[s].count[c] > 0
            ),
            key=lambda r: (-r[0], r[1], r[2]),
        )
        chosen = []
        for _, s, c in ranked[:effects]:
            pos = stats[s].sample.pos[:, c]
            chosen.append((s, c, np.sort(pos[pos >= 0])))

        # those measured before a stop are kept (`effects-<p>of<n>.json`): measured once
        mine_e = out_dir / f"effects-{pid}of{nproc}.json"
        ours = chosen[pid::nproc]
        before = {} if fresh else _read_effects(mine_e, key)
        measured: dict[tuple[str, int], np.ndarray] = {}
        saved = [0]

        def so_far() -> dict[tuple[str, int], Any]:
            """The effects measured, in the order of `ours` (that of the database's rows)."""
            out = {}
            for s, c, _ in ours:
                if (s, c) in before:
                    out[(s, c)] = before[(s, c)]
                elif (s, c) in measured:
                    out[(s, c)] = effect.top_changes(measured[(s, c)])
            return out

        def stop() -> None:
            signum = runtime.stop_requested()
            if signum is not None:
                if measured:
                    _save_effects(mine_e, key, so_far())
                raise _stopped(signum, f"during the output effects ({len(before) + len(measured)}"
                                       f" of {len(ours)} measured; the pass over the corpus is "
                                       "done)")  # fmt: skip
            if len(measured) - saved[0] >= EFFECTS_SAVE_EVERY:
                _save_effects(mine_e, key, so_far())
                saved[0] = len(measured)

        todo = [(s, c, pos) for s, c, pos in ours if (s, c) not in before]
        t_e = time.monotonic()
        effect.output_effects(target, params, comps, ci_fns, cfg, windows, todo, top_k,
                              check=stop, out=measured)  # fmt: skip
        _slow(f"output effects of {len(todo)} components", t_e)
        changes = so_far()
        if todo or nproc > 1:  # all measured: a stop from here on keeps them
            _save_effects(mine_e, key, changes)
        if nproc > 1:  # each process measured every nproc-th component: gather them
            runtime.barrier("pdctl-harvest-effects", PEER_TIMEOUT_S)
            changes = {}
            for p in range(nproc):
                got_p = json.loads((out_dir / f"effects-{p}of{nproc}.json").read_text())
                if got_p.get("key") != key:
                    raise PdctlError(f"harvest: {out_dir}/effects-{p}of{nproc}.json is from "
                                     "another harvest (run `pdctl harvest` again)")  # fmt: skip
                changes.update({(s, c): ch for s, c, ch in got_p["rows"]})
    meta = {"run_id": st.get("run_id"), "stage": stage, "step": dec.step, "split": split,
            "seq_len": T if lm else None, "kind": target.kind, "lm": lm, "vocab": vocab,
            "batch_size": B, "devices": n_dev * nproc, "processes": nproc, "created": now(),
            "top_k": top_k, "options": options}  # fmt: skip
    if pid != 0:  # process 0 writes; the others wait until it has
        runtime.barrier("pdctl-harvest-written", PEER_TIMEOUT_S)
        return Result(path, h.n_positions, start_batch - first, n_batches, nproc)
    toy = None
    if not lm and hasattr(target, "n_features"):
        toy = evaluate.toy_ci_matrices(target, params, comps, ci_fns, cfg)
    norms = {
        s: (np.linalg.norm(np.asarray(c["V"], np.float32), axis=0),
            np.linalg.norm(np.asarray(c["U"], np.float32), axis=1))
        for s, c in dec.components.items()
        if s in site_sizes
    }  # fmt: skip
    kept = keep.keep(path, meta, site_sizes)  # labels to carry; those it does not are saved now
    t_w = time.monotonic()
    db.write(path, h, meta, toy_features=toy, norms=norms, effects=changes, labels=kept.labels)
    _slow(f"{path.name} written", t_w)
    for p in range(nproc):
        (out_dir / partial_name(p, nproc)).unlink(missing_ok=True)
        (out_dir / f"effects-{p}of{nproc}.json").unlink(missing_ok=True)
        (out_dir / f"cooc-{p}of{nproc}.npz").unlink(missing_ok=True)
    if nproc > 1:
        runtime.barrier("pdctl-harvest-written", PEER_TIMEOUT_S)
    return Result(path, h.n_positions, start_batch - first, n_batches, nproc, kept.lines)


def _slow(what: str, t0: float) -> None:
    """One INFO line (pdctl's log, stderr) for a part of the harvest that took `SLOW_PART_S`
    or more: where a long harvest's time goes, also in a log file or a piped output, where the
    progress bar draws nothing (a whole-model harvest on a v5e once ran 250 s without a
    line). Quick parts say nothing."""
    dt = time.monotonic() - t0
    if dt >= SLOW_PART_S:
        log.info("harvest: %s in %.1f s", what, dt)


class _Phase:
    """`_slow` lines for a pass: its first batch (which compiles the pass's program) and the
    whole pass."""

    def __init__(self, what: str):
        self.what, self.t0 = what, time.monotonic()

    def first(self) -> None:
        _slow(f"first batch over {self.what} (compiling)", self.t0)

    def end(self, name: str, batches: int) -> None:
        if batches > 0:
            _slow(f"{name}, {batches} batches,", self.t0)


def _cooc_part(d: Path, key: str, p: int, nproc: int, n_batches: int) -> np.ndarray:
    """Process p's co-occurrence counts (its pass over its batches finished)."""
    path = d / f"cooc-{p}of{nproc}.npz"
    got = _read_keyed(path, key)
    if got is not None and int(got.get("_next", -1)) == _batches_of(p, nproc, n_batches)[1]:
        return got["counts"]
    raise PdctlError(f"harvest: {path} is missing or from another harvest (run `pdctl harvest` "
                     "again; is the run directory shared by every process?)")  # fmt: skip


def _part(
    d: Path, key: str, p: int, nproc: int, n_batches: int, positions: Callable[[int, int], int]
) -> dict[str, np.ndarray]:
    """Process p's finished part (its state after its last batch)."""
    lo, hi = _batches_of(p, nproc, n_batches)
    got = _read_partial(d / partial_name(p, nproc), key, lo, hi, lambda nxt: positions(lo, nxt))
    if got is None or got[1] != hi:
        raise PdctlError(
            f"harvest: the part of process {p} ({d / partial_name(p, nproc)}) is missing or "
            "unfinished: is the run directory shared by every process? (then run `pdctl "
            "harvest` again)"
        )
    return got[0]


def harvest_line(project: Project) -> str | None:
    """`harvest: <path> (train checkpoint 20, 10848 positions, ...)` when one exists; says when
    the stage has moved on since (its checkpoint or run is another) or a harvest was cut off."""
    d = harvest_dir(project)
    path = d / "harvest.db"
    partial = " (an interrupted harvest can go on: `pdctl harvest` again)"
    partial = partial if any(d.glob("partial*.npz")) else ""
    if not path.is_file():
        return f"harvest: none yet{partial}" if partial else None
    try:
        meta = db.read_meta(path)
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
