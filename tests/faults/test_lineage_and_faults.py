"""Faults found in a review, numbered as they were listed (the section comments below keep
the numbers): `[train] init_from` lineage (items 7, 8, 9), Qwen2's `max_window_layers = null`
(12), a lost peer (14), a NaN checkpoint (15), a run directory renamed mid-stage (16),
`export` after a failed train (17), SIGTERM while pdctl starts (18), and `sweep new --seeds`
huge / a GGUF with mistyped metadata (11)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import cli_ok, make_run, pdctl_argv, pdctl_env, state

ROOT = Path(__file__).resolve().parents[2]
SMALL = {
    "checkpoint": {"every": 5},
    "pretrain": {"steps": 20, "batch_size": 64, "log_every": 5},
    "warmup": {"steps": 5, "log_every": 5},
    "train": {"steps": 10, "batch_size": 64, "log_every": 5, "eval_every": 5},
}


@pytest.fixture(scope="module")
def initialized_tms(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny TMS run with init-weights done."""
    run = make_run(tmp_path_factory.mktemp("faults37"), "tms", "r", **SMALL)
    cli_ok("--project", run, "init-weights")
    return run


# ---- item 18: SIGTERM while pdctl starts up ---------------------------------------------------

_SLOW_CHILD_START = """\
import os, time
if "PDCTL_SUPERVISED" in os.environ:  # the supervised child, before any pdctl code runs
    open({mark!r}, "w").close()
    time.sleep(1.5)
"""


@pytest.mark.slow  # a stage in a subprocess: several seconds
def test_18_sigterm_to_the_group_while_the_child_starts_is_a_stop(
    tmp_path: Path, initialized_tms: Path
) -> None:
    """A SIGTERM to the whole process group (`timeout`, a terminal) while the supervised child
    is still starting Python used to kill the child (the default disposition) and the parent
    said `died by SIGTERM`, exit 1. The child now starts with the signal ignored and the parent
    forwards it once the child can stop cleanly: exit 3, `interrupted`."""
    import shutil

    run = tmp_path / "r"
    shutil.copytree(initialized_tms, run)
    hooks = tmp_path / "hooks"
    hooks.mkdir()
    mark = tmp_path / "child-starting"
    (hooks / "sitecustomize.py").write_text(_SLOW_CHILD_START.format(mark=str(mark)))
    env = pdctl_env(1, PYTHONPATH=os.pathsep.join([str(hooks), str(ROOT)]))
    proc = subprocess.Popen(
        pdctl_argv("pretrain", project=run),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    t0 = time.monotonic()
    while not mark.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() - t0 < 60, "the child never started"
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, (proc.returncode, err[-3000:])
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1 and "stopped by SIGTERM" in lines[0], err[-3000:]
    assert state(run, "pretrain")["status"] == "interrupted"


def test_18_a_signal_while_the_cli_loads_is_held_then_handed_on() -> None:
    """`hold_signals` (the first thing `python -m pdctl` does) keeps a SIGTERM from killing the
    process while it imports; a command that is not a stage gets it back as it was
    (`release_signals`), a stage takes it as a stop request (`take_held`)."""
    code = (
        "import os, signal, sys\n"
        f"sys.path.insert(0, {str(ROOT)!r})\n"
        "from pdctl import supervisor\n"
        "supervisor.hold_signals()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "print('alive', supervisor._held, flush=True)\n"
        "got = []\n"
        "signal.signal(signal.SIGTERM, lambda s, f: got.append(s))\n"
        "print('taken', supervisor.take_held(), flush=True)\n"
        "signal.signal(signal.SIGTERM, signal.SIG_DFL)\n"
        "supervisor.hold_signals()\n"
        "os.kill(os.getpid(), signal.SIGTERM)\n"
        "supervisor.release_signals()\n"
        "print('unreachable', flush=True)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.stdout.splitlines() == ["alive [15]", "taken [15]"], r
    assert r.returncode == -signal.SIGTERM, r  # released: the default handling, as before


# ---- item 17: `export` with no --stage after a failed train -----------------------------------


def _set_status(run: Path, **statuses: str) -> None:
    from pdctl.project import Project

    proj = Project.load(run / "pdctl.toml")
    for stage, status in statuses.items():
        proj.update_stage(stage, status=status, step=1)


@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_17_plain_export_after_a_failed_train_names_the_stage_to_pass(
    tmp_path: Path, status: str
) -> None:
    """The line leads with the flag and the stage that is done, then how to finish train."""
    from helpers import cli_fails

    run = make_run(tmp_path, "tms", "r")
    _set_status(run, init_weights="done", pretrain="done", warmup="done", train=status)
    line = cli_fails(2, "--project", run, "export", "--out", tmp_path / "x.npz")
    assert line.startswith(
        f"error: --stage: not given, and train, the last stage run, is {status}: pass "
        "`--stage warmup` to export the last stage that is done, or finish train first ("
    ), line
    assert not (tmp_path / "x.npz").exists()
    _set_status(run, init_weights="failed", pretrain="pending", warmup="pending", train="pending")
    line = cli_fails(2, "--project", run, "export", "--out", tmp_path / "x.npz")
    assert line.startswith("error: export: no stage is done yet (init_weights"), line


# ---- item 12: a Qwen2 config.json with max_window_layers = null -------------------------------

_QWEN2 = {
    "architectures": ["Qwen2ForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        ({"max_window_layers": None}, "'max_window_layers' must be an integer, got null"),
        ({"use_sliding_window": None}, "'use_sliding_window' must be true or false, got null"),
        # with layer_types given too: Qwen2Config checks the field's type all the same
        ({"max_window_layers": None, "layer_types": ["full_attention"] * 2},
         "'max_window_layers' must be an integer, got null"),
    ],
)  # fmt: skip
def test_12_qwen2_null_window_keys_are_refused_as_transformers_does(
    tmp_path: Path, change: dict, needle: str
) -> None:
    """transformers' Qwen2Config (a strict dataclass) refuses null for these two fields; pdctl
    read null as "absent" (the default, 28) and went on."""
    import json

    from pdctl.errors import PdctlError
    from pdctl.science.targets.hf import read_hf_config

    (tmp_path / "config.json").write_text(json.dumps({**_QWEN2, **change}))
    (tmp_path / "model.safetensors").touch()
    with pytest.raises(PdctlError) as err:
        read_hf_config(tmp_path)
    msg = str(err.value)
    assert msg.startswith("target.path: ") and "\n" not in msg and needle in msg, msg
    # absent is the default, as before
    (tmp_path / "config.json").write_text(json.dumps(_QWEN2))
    assert read_hf_config(tmp_path).n_layers == 2


# ---- item 11: a GGUF whose metadata has the wrong types ---------------------------------------


def _gguf(path: Path, **bad) -> Path:
    """A metadata-only Llama GGUF (and its embedding) with `bad` keys written as given."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    good = {"block_count": 1, "context_length": 64, "embedding_length": 32,
            "feed_forward_length": 64, "attention.head_count": 4,
            "attention.head_count_kv": 2, "vocab_size": 32}  # fmt: skip
    for key, value in {**good, **bad}.items():
        name = f"llama.{key}"
        if isinstance(value, str):
            w.add_string(name, value)
        elif isinstance(value, list):
            w.add_array(name, value)
        elif isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_uint32(name, value)
    w.add_tensor("token_embd.weight", np.zeros((32, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("bad", "needle"),
    [
        ({"rope.freq_base": "big"}, "'llama.rope.freq_base' must be a number, got 'big'"),
        ({"embedding_length": [32, 32]}, "'llama.embedding_length' must be an integer, got [32,"),
        ({"attention.head_count": "4"}, "'llama.attention.head_count' must be an integer, got '4'"),
        ({"rope.dimension_count": 2.5}, "'llama.rope.dimension_count' must be an integer, got 2.5"),
        ({"rope.scaling.type": [1]}, "'llama.rope.scaling.type' must be a string, got [1]"),
    ],
)  # fmt: skip
def test_11_gguf_metadata_of_the_wrong_type_is_one_line_naming_the_key(
    tmp_path: Path, bad: dict, needle: str
) -> None:
    from pdctl.errors import PdctlError
    from pdctl.science.targets.gguf import gguf_spec

    path = _gguf(tmp_path / "m.gguf", **bad)
    with pytest.raises(PdctlError) as err:
        gguf_spec(path)
    msg = str(err.value)
    assert msg.startswith(f"target.path: {path}: ") and needle in msg, msg


def test_11_init_weights_on_a_mistyped_gguf_writes_nothing(tmp_path: Path) -> None:
    """Exit 2 naming target.path, and the run directory exactly as it was: no `.pdctl.lock`
    left behind by the lock the stage took before it read the file."""
    from helpers import cli_fails, edit_config

    model = _gguf(tmp_path / "m.gguf", **{"rope.freq_base": "big"})
    run = make_run(tmp_path, "hf-lm", "r", tiny=False)
    edit_config(run, {"target": {"path": str(model)}})
    before = {p.name: p.read_bytes() for p in run.iterdir()}
    for cmd in ("init-weights", "run"):
        line = cli_fails(2, "--project", run, cmd)
        assert line.startswith("error: target.path: ") and "llama.rope.freq_base" in line, line
        assert {p.name: p.read_bytes() for p in run.iterdir()} == before


# ---- item 11: `sweep new --seeds` with a huge count -------------------------------------------


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--seeds", "100000000000"], "--seeds: 100000000000 seeds x 1 grid points is "),
        (["--seeds", "5000", "--grid", "train.optim.lr=1e-3,2e-3,3e-3"],
         "--seeds/--grid: 5000 seeds x 3 grid points is 15000 members; a sweep holds at most "
         "10000"),
    ],
)  # fmt: skip
def test_11_sweep_new_with_more_members_than_a_sweep_holds_is_refused_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, args: list[str], says: str
) -> None:
    """It used to expand (and validate) every member first: 1e11 seeds hung for minutes."""
    from helpers import cli_fails

    monkeypatch.chdir(tmp_path)
    t0 = time.monotonic()
    line = cli_fails(2, "sweep", "new", "sw", *args)
    assert time.monotonic() - t0 < 5
    assert line.startswith(f"error: {says}"), line
    assert not any(tmp_path.iterdir())


# ---- item 15: a checkpoint whose arrays hold NaN ----------------------------------------------


def _poison(run: Path, stage: str, step: int) -> None:
    """Rewrite checkpoint `step` of `stage` with one NaN in its first float array, its meta
    and everything else as they were: a well-formed checkpoint, crafted."""
    import shutil

    import jax
    import numpy as np

    from pdctl.engine.checkpoint import Checkpointer, read_host, read_meta

    directory = run / "checkpoints" / stage
    names = [p.name for p in (directory / str(step)).iterdir() if p.is_dir() and p.name != "meta"]
    items = {n: read_host(directory, step, n) for n in names}
    meta = read_meta(directory, step)
    leaves, tree = jax.tree.flatten(items)
    first = next(i for i, x in enumerate(leaves) if np.issubdtype(x.dtype, np.floating))
    leaves[first] = np.array(leaves[first], copy=True)
    leaves[first].flat[0] = np.nan
    shutil.rmtree(directory / str(step))
    ckpt = Checkpointer(directory, keep=100, async_save=False)
    ckpt.save(step, jax.tree.unflatten(tree, leaves), meta)
    ckpt.close()


def test_15_a_nan_checkpoint_is_not_resumed_from(initialized_tms: Path, tmp_path: Path) -> None:
    """docs/commands.md: every checkpoint is checked finite before it is saved. One crafted to hold
    NaN restored, and the stage went on from it to `done`; now it is treated as unreadable:
    the newest finite checkpoint is used and the NaN one goes to `.corrupt`."""
    import shutil

    from helpers import cli_ok

    run = tmp_path / "r"
    shutil.copytree(initialized_tms, run)
    cli_ok("--project", run, "pretrain", "--until", "10")
    _poison(run, "pretrain", 10)
    result = cli_ok("--project", run, "pretrain", "--resume")
    assert "checkpoint pretrain/10 does not restore" in result.stderr, result.stderr
    assert "not finite" in result.stderr and "resuming from checkpoint 5" in result.stderr
    st = state(run, "pretrain")
    assert st["status"] == "done" and st["step"] == 20, st
    assert (run / "checkpoints" / "pretrain.corrupt" / "10").is_dir()


# ---- item 16: the run directory renamed while a stage runs ------------------------------------


def test_16_a_run_directory_moved_mid_stage_ends_with_one_line_saying_so(
    initialized_tms: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Renamed just before the first periodic checkpoint: that save (or the next state write)
    fails for want of the directory. It used to end with `FileNotFoundError` text (or `cannot
    write pdctl.toml`, exit 2); now one line says the directory moved, exit 1, and in its new
    place the stage is `running` with no lock held: `pdctl resume` continues it."""
    import shutil

    from helpers import cli_fails

    from pdctl.engine import checkpoint

    run = tmp_path / "r"
    shutil.copytree(initialized_tms, run)
    moved = tmp_path / "elsewhere"
    save = checkpoint.Checkpointer.save

    def save_after_a_move(self, step, *args, **kwargs):
        if step > 0 and run.exists():
            run.rename(moved)
        return save(self, step, *args, **kwargs)

    monkeypatch.setattr(checkpoint.Checkpointer, "save", save_after_a_move)
    line = cli_fails(1, "--project", run, "pretrain")
    assert line.startswith(f"error: pretrain: the run directory {run} was moved or removed"), line
    assert "`pdctl resume` continues it" in line, line
    assert not run.exists()  # nothing was written where the directory had been
    monkeypatch.undo()
    from pdctl.project import Project

    proj = Project.load(moved / "pdctl.toml")
    assert proj.stage("pretrain")["status"] == "running" and proj.lock_is_free()
