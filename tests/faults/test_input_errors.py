"""Mistakes in the input (items 14, 17 and 19 of a review's list, as the section comments
number them): each is one line naming the key or the
file, exit 2, nothing written, no traceback, found before anything runs; and `pdctl export`
of warmup, which used to crash.

Hugging Face models here are hand-made (a config.json, random safetensors tensors that fit it,
a BPE tokenizer.json trained on a few words): no transformers, no network.
"""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import jax
import numpy as np
import pytest
from helpers import cli_fails, cli_ok, edit_config
from safetensors.numpy import save_file

from pdctl.engine.checkpoint import Checkpointer
from pdctl.engine.sharding import path_str
from pdctl.errors import PdctlError
from pdctl.project import Project
from pdctl.science.targets.hf import HFCausalLM, read_hf_config
from pdctl.templates import create_run
from pdctl.testing.models import bpe_tokenizer, write_corpus

# ---- helpers ---------------------------------------------------------------------------------


def _fails(*args: Any, code: int = 2) -> str:
    return cli_fails(code, *args)


_ok = cli_ok


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under `root` and its bytes (the lock file aside: its content is a pid)."""
    return {
        str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None)
        for p in sorted(root.rglob("*"))
        if p.name != ".pdctl.lock"
    }


def _copy(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "r"
    shutil.copytree(src, dst)
    return dst


def _set_state(run: Path, stage: str, **fields: Any) -> None:
    proj = Project.load(run / "pdctl.toml")
    proj.update_stage(stage, **fields)


def _checkpoint_arrays(run: Path, stage: str, names: tuple[str, ...]) -> dict[str, np.ndarray]:
    """The latest checkpoint's items as flat `item.path` arrays, read with orbax directly."""
    ckpt = Checkpointer(run / "checkpoints" / stage, keep=100)
    try:
        items = ckpt.restore_host(ckpt.latest_step(), names)
    finally:
        ckpt.close()
    return {
        f"{name}.{path_str(p)}": np.asarray(x)
        for name, tree in items.items()
        for p, x in jax.tree_util.tree_leaves_with_path(tree)
    }


# ---- a TMS run through warmup ----------------------------------------------------------------

SMALL = {
    "checkpoint": {"every": 5},
    "pretrain": {"steps": 5, "batch_size": 64, "log_every": 5},
    "warmup": {"steps": 5, "log_every": 5},
    "train": {"steps": 10, "batch_size": 64, "log_every": 5, "eval_every": 5},
}


@pytest.fixture(scope="module")
def warmed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """TMS 5-2: init-weights, pretrain and warmup done, train pending."""
    root = tmp_path_factory.mktemp("warmed")
    run = create_run("r", "tms", root)
    edit_config(run, SMALL)
    for cmd in ("init-weights", "pretrain", "warmup"):
        _ok("--project", run, cmd)
    return run


# ---- item 17: export of warmup ---------------------------------------------------------------


def test_export_of_warmup_is_its_components_with_inits_ci_fns_and_sources(warmed, tmp_path):
    run = _copy(warmed, tmp_path)
    out = tmp_path / "w.npz"
    _ok("--project", run, "export", "--stage", "warmup", "--out", out)
    got = dict(np.load(out))
    want = {
        **{
            k.replace("params.", "target.", 1): v
            for k, v in _checkpoint_arrays(run, "pretrain", ("params",)).items()
        },
        **_checkpoint_arrays(run, "warmup", ("components",)),
        **_checkpoint_arrays(run, "init_weights", ("ci_fns", "sources")),
    }
    # TMS ties linear2 to linear1's transpose: the export shows both sites
    for mine, theirs in (("V", "U"), ("U", "V")):
        want[f"components.linear2.{mine}"] = want[f"components.linear1.{theirs}"].T
    assert set(got) == set(want)
    for k, v in want.items():
        np.testing.assert_array_equal(got[k], v, err_msg=k)
    # warmup trained V/U away from init-weights' (so these are warmup's, not init's)
    init = _checkpoint_arrays(run, "init_weights", ("components",))
    assert not np.array_equal(init["components.linear1.V"], got["components.linear1.V"])
    # a plain export, warmup being the last stage done, is the same arrays
    _ok("--project", run, "export", "--out", tmp_path / "plain.npz")
    plain = dict(np.load(tmp_path / "plain.npz"))
    assert set(plain) == set(got)
    for k in got:
        np.testing.assert_array_equal(plain[k], got[k], err_msg=k)
    # and as safetensors, V/U under the site names
    _ok("--project", run, "export", "--stage", "warmup", "--out", tmp_path / "w.safetensors")
    from safetensors.numpy import load_file

    named = load_file(str(tmp_path / "w.safetensors"))
    np.testing.assert_array_equal(named["linear1.V"], got["components.linear1.V"])


# ---- item 14: export mistakes ----------------------------------------------------------------


@pytest.mark.parametrize("status", ["failed", "interrupted"])
def test_plain_export_after_a_train_that_did_not_finish_is_refused(warmed, tmp_path, status):
    """Not warmup's arrays passed off as the result: the line says what to do instead."""
    run = _copy(warmed, tmp_path)
    _set_state(run, "train", status=status, step=5, error="x")
    before = _snapshot(tmp_path)
    line = _fails("--project", run, "export", "--out", tmp_path / "x.npz")
    assert f"train, the last stage run, is {status}" in line, line
    assert "--stage warmup" in line, line
    assert _snapshot(tmp_path) == before
    # asked for by name, it is refused the same way, and warmup still exports
    line = _fails("--project", run, "export", "--stage", "train", "--out", tmp_path / "x.npz")
    assert f"--stage: train is {status}, not done" in line, line
    _ok("--project", run, "export", "--stage", "warmup", "--out", tmp_path / "x.npz")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc")
@pytest.mark.parametrize("name", ["x.safetensors", "x.npz"])
def test_export_to_an_unwritable_directory(warmed, tmp_path, name):
    """/proc takes no new files, even from root: safetensors' own error is one line too."""
    run = _copy(warmed, tmp_path)
    before = _snapshot(tmp_path)
    line = _fails("--project", run, "export", "--stage", "warmup", "--out", f"/proc/{name}")
    assert line.startswith(f"error: --out: cannot write /proc/{name} ("), line
    assert _snapshot(tmp_path) == before


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_failed_export_leaves_no_directories_behind(warmed, tmp_path, suffix):
    run = _copy(warmed, tmp_path)
    before = _snapshot(tmp_path)
    out = tmp_path / "new" / "sub" / ("x" * 250 + suffix)  # its temporary name is too long
    line = _fails("--project", run, "export", "--stage", "warmup", "--out", out)
    assert "--out: cannot write" in line, line
    assert _snapshot(tmp_path) == before


def test_export_with_garbage_sites_in_state(warmed, tmp_path):
    run = _copy(warmed, tmp_path)
    _set_state(run, "init_weights", sites=3)
    before = _snapshot(tmp_path)
    line = _fails("--project", run, "export", "--stage", "warmup", "--out", tmp_path / "x.npz")
    assert "state.init_weights.sites: must be a table" in line, line
    assert _snapshot(tmp_path) == before


# ---- item 14: status with garbage in [state.*] -----------------------------------------------


@pytest.mark.parametrize(
    ("key", "value"),
    [("ci_errors", "x"), ("ci_errors", [1]), ("mmcs", 3), ("l0", "all")],
)
def test_status_with_garbage_eval_in_state(tmp_path, key, value):
    run = create_run("r", "tms", tmp_path)
    ev = {"ci_errors": {"total": 0}, key: value}
    _set_state(run, "train", status="done", step=10, eval=ev)
    before = _snapshot(tmp_path)
    line = _fails("--project", run, "status")
    assert f"state.train.eval.{key}: must be a table" in line, line
    assert "delete [state.train]" in line, line
    assert _snapshot(tmp_path) == before
    # --json shows the state as it is
    report = json.loads(_ok("--project", run, "status", "--json").stdout)
    assert report["train"]["eval"][key] == value


def test_status_shows_a_non_number_inside_eval_as_a_question_mark():
    from pdctl.report import eval_summary

    assert eval_summary({"eval": {"ci_errors": {"total": "x"}, "mmcs": {}}}) == "CI errors ?"
    assert eval_summary({"eval": {"ci_errors": {"a": 1, "b": True}}}) == "CI errors 1"


# ---- item 14: pdctl new ----------------------------------------------------------------------


@pytest.mark.parametrize("length", [256, 300])
def test_new_with_a_name_too_long_for_a_directory(tmp_path, monkeypatch, length):
    monkeypatch.chdir(tmp_path)
    line = _fails("new", "n" * length)
    assert line.startswith(f"error: NAME: {length} characters is too long"), line
    assert "(at most 255)" in line and "n" * 20 not in line, line
    assert list(tmp_path.iterdir()) == []


# ---- item 14: config.json mistakes -----------------------------------------------------------

LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 128,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": False,
}
QWEN2 = {**LLAMA, "architectures": ["Qwen2ForCausalLM"]}
GPT2 = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_embd": 16, "n_layer": 1,
        "n_head": 2, "n_positions": 16}  # fmt: skip
LLAMA3 = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip


def _config_dir(root: Path, cfg: dict) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(cfg))  # NaN / Infinity as Python writes them
    (root / "model.safetensors").touch()
    return root


BAD_CONFIGS = [
    # (base, change, the key the line must name)
    (LLAMA, {"num_attention_heads": 0}, "'num_attention_heads' must be an integer in [1, "),
    (LLAMA, {"num_attention_heads": -4}, "'num_attention_heads' must be an integer in [1, "),
    (LLAMA, {"num_key_value_heads": 0}, "'num_key_value_heads' must be an integer in [1, "),
    (LLAMA, {"num_attention_heads": 3}, "hidden_size 32 is not a multiple of num_attention_heads"),
    (LLAMA, {"num_attention_heads": 64, "num_key_value_heads": 64}, "not a multiple"),
    (QWEN2, {"num_attention_heads": 64, "num_key_value_heads": 64}, "smaller than"),
    (LLAMA, {"head_dim": 0}, "'head_dim' must be an integer in [1, "),
    (LLAMA, {"head_dim": 7}, "head_dim 7 is odd"),
    (LLAMA, {"hidden_size": "32"}, "'hidden_size' must be an integer, got '32'"),
    (LLAMA, {"hidden_size": 32.0}, "'hidden_size' must be an integer, got 32.0"),
    (LLAMA, {"hidden_size": True}, "'hidden_size' must be an integer, got True"),
    (LLAMA, {"vocab_size": 0}, "'vocab_size' must be an integer in [1, "),
    (LLAMA, {"vocab_size": 2**40}, "'vocab_size' must be an integer in [1, 2147483647]"),
    (LLAMA, {"num_hidden_layers": 0}, "'num_hidden_layers' must be an integer in [1, "),
    (LLAMA, {"intermediate_size": -1}, "'intermediate_size' must be an integer in [1, "),
    (LLAMA, {"max_position_embeddings": 0}, "'max_position_embeddings' must be an integer"),
    (LLAMA, {"rms_norm_eps": -1e-6}, "'rms_norm_eps' must be a finite number >= 0"),
    (LLAMA, {"rms_norm_eps": math.nan}, "'rms_norm_eps' must be a finite number >= 0"),
    (LLAMA, {"rms_norm_eps": 10**400}, "'rms_norm_eps' must be a number"),
    (LLAMA, {"rope_theta": 0}, "'rope_theta' must be a finite number > 0"),
    (LLAMA, {"rope_theta": "big"}, "'rope_theta' must be a number, got 'big'"),
    (LLAMA, {"partial_rotary_factor": "half"}, "'partial_rotary_factor' must be a number"),
    (LLAMA, {"partial_rotary_factor": 0.5}, "partial_rotary_factor in"),
    (LLAMA, {"rope_parameters": {"rope_type": "linear", "factor": "x"}}, "'factor' must be a num"),
    (LLAMA, {"rope_parameters": {"rope_type": "linear", "factor": 0}}, "'factor' must be a finite"),
    (LLAMA, {"rope_parameters": {**LLAMA3, "high_freq_factor": 1.0}},
     "'high_freq_factor' 1.0 must be greater than 'low_freq_factor' 1.0"),
    (LLAMA, {"rope_parameters": {**LLAMA3, "original_max_position_embeddings": 0}},
     "'original_max_position_embeddings' must be an integer in [1, "),
    (LLAMA, {"rope_parameters": {"rope_type": ["llama3"]}}, "rope scaling ['llama3']"),
    (LLAMA, {"tie_word_embeddings": "yes"}, "'tie_word_embeddings' must be true or false"),
    (LLAMA, {"attention_bias": 1}, "'attention_bias' must be true or false, got 1"),
    (LLAMA, {"eos_token_id": "</s>"}, "'eos_token_id' must be an integer or a list of them"),
    (LLAMA, {"eos_token_id": [2, None]}, "'eos_token_id' must be an integer or a list of them"),
    (LLAMA, {"architectures": None, "model_type": ["llama"]}, "no 'architectures'"),
    (QWEN2, {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": "all"},
     "'max_window_layers' must be an integer, got 'all'"),
    (QWEN2, {"use_sliding_window": "yes"}, "'use_sliding_window' must be true or false"),
    (QWEN2, {"layer_types": "full_attention"}, "'layer_types' must be a list of strings"),
    (GPT2, {"n_head": 0}, "'n_head' must be an integer in [1, "),
    (GPT2, {"n_embd": 0}, "'n_embd' must be an integer in [1, "),
    (GPT2, {"n_inner": 0}, "'n_inner' must be an integer in [1, "),
    (GPT2, {"n_positions": "1024"}, "'n_positions' must be an integer"),
    (GPT2, {"layer_norm_epsilon": math.inf}, "'layer_norm_epsilon' must be a finite number"),
    (GPT2, {"add_cross_attention": "no"}, "'add_cross_attention' must be true or false"),
]  # fmt: skip


@pytest.mark.parametrize(("base", "change", "needle"), BAD_CONFIGS, ids=range(len(BAD_CONFIGS)))
def test_config_json_mistakes_are_one_line_errors(tmp_path, base, change, needle):
    cfg = {k: v for k, v in {**base, **change}.items() if v is not None}
    d = _config_dir(tmp_path / "m", cfg)
    with pytest.raises(PdctlError) as err:
        read_hf_config(d)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("target.path: "), msg
    assert needle in msg, msg
    assert str(d) in msg, msg


@pytest.mark.parametrize(
    "change",
    [
        {},
        {"num_attention_heads": 4, "num_key_value_heads": 4, "head_dim": 16},  # 4 * 16 != 32
        {"rope_parameters": LLAMA3},
        {"rope_scaling": {"type": "linear", "factor": 2}, "rope_theta": 1e6},
        {"partial_rotary_factor": 1},
        {"eos_token_id": [1, 2, 1000]},  # ids beyond vocab_size are transformers' to keep
        {"rms_norm_eps": 0},
    ],
)
def test_config_json_that_transformers_takes_still_reads(tmp_path, change):
    spec = read_hf_config(_config_dir(tmp_path / "m", {**LLAMA, **change}))
    assert spec.head_dim == change.get("head_dim", 8)


def test_qwen2_sliding_window_as_transformers_places_it(tmp_path):
    """Layer i slides when i >= max_window_layers (default 28): 2 layers never do."""
    on = {"use_sliding_window": True, "sliding_window": 8}
    assert read_hf_config(_config_dir(tmp_path / "a", {**QWEN2, **on})).n_layers == 2
    with pytest.raises(PdctlError, match="sliding-window attention"):
        read_hf_config(_config_dir(tmp_path / "b", {**QWEN2, **on, "max_window_layers": 1}))


def test_read_with_a_plain_dict_and_numpy_scalars(tmp_path):
    """The spec functions take any mapping (GGUF metadata comes as numpy scalars)."""
    from pdctl.science.targets.hf import LLAMA as LLAMA_ARCH
    from pdctl.science.targets.hf import llama_spec as _llama_spec

    cfg = {k: (np.int32(v) if isinstance(v, int) and not isinstance(v, bool) else v)
           for k, v in LLAMA.items()}  # fmt: skip
    cfg["rms_norm_eps"] = np.float32(1e-5)
    spec = _llama_spec(cfg, tmp_path / "model.gguf", LLAMA_ARCH)
    assert (spec.d_model, spec.n_heads, spec.head_dim) == (32, 4, 8)
    assert type(spec.d_model) is int and type(spec.norm_eps) is float
    with pytest.raises(PdctlError, match=r"model\.gguf: 'num_attention_heads' must be"):
        _llama_spec({**cfg, "num_attention_heads": np.int64(0)}, tmp_path / "model.gguf", "x")


@pytest.mark.parametrize(("base", "key"), [(LLAMA, "LlamaForCausalLM"), (QWEN2, "Qwen2")])
def test_seq_len_beyond_max_position_embeddings(tmp_path, base, key):
    spec = read_hf_config(_config_dir(tmp_path / "m", base))
    assert HFCausalLM(spec=spec, seq_len=64).seq_len == 64
    with pytest.raises(PdctlError) as err:
        HFCausalLM(spec=spec, seq_len=65)
    msg = str(err.value)
    assert msg.startswith("data.seq_len: 65 exceeds the 64 positions (max_position_embeddings)")
    assert key in msg and str(tmp_path / "m" / "config.json") in msg, msg


def test_qwen2_default_max_position_embeddings_is_transformers(tmp_path):
    cfg = {k: v for k, v in QWEN2.items() if k != "max_position_embeddings"}
    assert read_hf_config(_config_dir(tmp_path / "m", cfg)).max_positions == 32768


# ---- item 14 and 19 through `pdctl run`: an imported model -----------------------------------

HF_VOCAB = 320


@pytest.fixture(scope="module")
def hf_assets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A tiny Llama (vocabulary 320; its byte-level tokenizer's 257 ids), random weights, a
    corpus."""
    pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("hf-model")
    model = root / "llama"
    model.mkdir()
    n_tok = bpe_tokenizer(model, vocab_size=300)
    assert n_tok < HF_VOCAB
    (model / "config.json").write_text(json.dumps({**LLAMA, "vocab_size": HF_VOCAB}))
    (model / "model.safetensors").touch()
    target = HFCausalLM(spec=read_hf_config(model), seq_len=16)
    rng = np.random.default_rng(0)
    tensors = {
        t.name: (0.02 * rng.standard_normal(t.stored_shape)).astype(np.float32)
        for t in target.checkpoint_layout().values()
    }
    save_file(tensors, str(model / "model.safetensors"))
    corpus = write_corpus(root / "corpus.jsonl", 100, rng)  # rng: after the weights' draws
    return {"model": model, "corpus": corpus, "tokenizer_ids": n_tok}


def _hf_run(tmp_path: Path, assets: dict[str, Any], model: Path | None = None, **over) -> Path:
    run = create_run("x", "hf-lm", tmp_path)
    small = {
        "target": {"path": str(model or assets["model"])},
        "data": {"path": str(assets["corpus"]), "seq_len": 16},
        "checkpoint": {"every": 5},
        "decomp": {"sites": [{"pattern": "*.mlp.down_proj", "C": 4}],
                   "ci_fn": {"type": "shared_mlp", "hidden": [8]}},
        "warmup": {"steps": 2, "log_every": 1},
        "train": {"steps": 2, "batch_size": 4, "log_every": 1, "eval_every": 2,
                  "eval_batch_size": 4},
    }  # fmt: skip
    for table, values in over.items():
        small[table] = {**small.get(table, {}), **values}
    edit_config(run, small)
    return run


def _run_refused(run: Path, *needles: str) -> str:
    before = _snapshot(run)
    line = _fails("--project", run, "run")
    for n in needles:
        assert n in line, line
    assert _snapshot(run) == before  # no state, no checkpoint, no token cache
    assert not (run / "checkpoints").exists()
    return line


def test_run_with_an_eos_id_beyond_the_models_vocabulary(tmp_path, hf_assets):
    run = _hf_run(tmp_path, hf_assets, data={"eos_id": 1_000_000})
    _run_refused(run, "data.eos_id: 1000000", f"vocab_size {HF_VOCAB}")


def test_run_with_an_eos_id_beyond_the_tokenizers_vocabulary(tmp_path, hf_assets):
    """Within the model's embeddings, not among its tokenizer's ids."""
    eos = hf_assets["tokenizer_ids"] + 1
    run = _hf_run(tmp_path, hf_assets, data={"eos_id": eos})
    _run_refused(run, f"data.eos_id: {eos}", "tokenizer", f"({hf_assets['tokenizer_ids']} ids)")


def test_run_with_seq_len_beyond_max_position_embeddings(tmp_path, hf_assets):
    run = _hf_run(tmp_path, hf_assets, data={"seq_len": 65})
    _run_refused(run, "data.seq_len: 65 exceeds the 64 positions (max_position_embeddings)")


BROKEN_CONFIG_JSON = [
    ({"num_attention_heads": 0}, "'num_attention_heads' must be an integer in [1, "),
    ({"partial_rotary_factor": "half"}, "'partial_rotary_factor' must be a number"),
    ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
      "sliding_window": 8, "max_window_layers": "all"}, "'max_window_layers' must be"),
]  # fmt: skip


@pytest.mark.parametrize(
    ("change", "needle"), BROKEN_CONFIG_JSON, ids=["zero-heads", "rotary-half", "window-all"]
)
def test_run_with_a_broken_config_json(tmp_path, hf_assets, change, needle):
    model = tmp_path / "model"
    shutil.copytree(hf_assets["model"], model)
    cfg = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**cfg, **change}))
    run = _hf_run(tmp_path, hf_assets, model=model)
    line = _run_refused(run, "target.path: ", needle)
    assert str(model / "config.json") in line, line
