"""Qwen3 (`Qwen3ForCausalLM`, GGUF `general.architecture = qwen3`): logits equal transformers'
on tiny random models (per-head q/k RMSNorm before RoPE, head_dim other than d / heads,
attention biases on and off, tied and untied heads), read from a safetensors directory and from
a GGUF of the same weights; the GGUF's Qwen2-style byte-level tokenizer; and the one-line
refusals of what is still unsupported (Qwen3 mixture-of-experts).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cli, edit_config, error_lines

from pdctl.errors import PdctlError
from pdctl.science.targets.gguf import gguf_spec
from pdctl.science.targets.hf import QWEN3, HFCausalLM, read_hf_config
from pdctl.science.targets.hf.load import load_hf_params, read_index

transformers = pytest.importorskip("transformers", reason="parity needs the `parity` extra")
torch = pytest.importorskip("torch", reason="parity needs the `parity` extra")

SEQ = 12
# float32 on both sides; the difference is reassociation (einsum vs. torch matmul orders) on
# logits of size O(1)
ATOL = 1e-4
MIN_SIZE = 64

CASES = {
    # head_dim 16 != hidden 32 / 4 heads, as real Qwen3 (0.6B: 1024 / 16 heads, head_dim 128)
    "tied_head_dim_16": dict(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
    ),
    "bias_untied_one_kv_head": dict(
        vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, head_dim=8, attention_bias=True,
        tie_word_embeddings=False,
    ),
}  # fmt: skip


def _model(config: dict):
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**config)).eval()
    with torch.no_grad():
        # transformers leaves norms at 1 and biases at 0: random values make each one (q_norm
        # and k_norm included) show in the logits
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    return model


def _tokens(vocab: int) -> np.ndarray:
    return np.random.default_rng(0).integers(0, vocab, (2, SEQ), dtype=np.int64)


def _reference(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.float().numpy()


def _shardings(target: HFCausalLM, n: int):
    from jax.sharding import Mesh

    from pdctl.engine.sharding import tree_shardings

    mesh = Mesh(np.array(jax.devices()[:n]).reshape(1, n), ("data", "fsdp"))
    return tree_shardings(jax.eval_shape(target.init, jax.random.key(0)), mesh, MIN_SIZE)


@pytest.fixture(scope="module", params=list(CASES))
def saved(request, tmp_path_factory):
    model = _model(CASES[request.param])
    path = tmp_path_factory.mktemp("qwen3") / request.param
    model.save_pretrained(path, safe_serialization=True)
    tokens = _tokens(model.config.vocab_size)
    return {"name": request.param, "model": model, "path": path, "tokens": tokens,
            "ref": _reference(model, tokens)}  # fmt: skip


@pytest.mark.parametrize("n_devices", [1, 4])
def test_hf_logits_match_transformers(saved, n_devices):
    target = HFCausalLM.from_dir(saved["path"], seq_len=SEQ)
    spec, cfg = target.spec, saved["model"].config
    assert spec.architecture == QWEN3 and spec.qk_norm and not spec.mlp_bias
    assert spec.head_dim == cfg.head_dim and spec.qkv_bias is spec.o_bias is cfg.attention_bias
    # every tensor of the checkpoint is read (q_norm / k_norm included), nothing else is wanted
    assert set(target.checkpoint_layout()) == set(read_index(saved["path"]).tensors)
    params, _ = load_hf_params(saved["path"], target, _shardings(target, n_devices))
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        logits = jax.jit(target.apply)(params, jnp.asarray(saved["tokens"], jnp.int32))
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), saved["ref"], rtol=0, atol=ATOL)


def test_sites_are_the_linear_modules(saved):
    """Sites are transformers' nn.Linear modules in order; the q/k norms are not sites."""
    target = HFCausalLM.from_dir(saved["path"], seq_len=SEQ)
    linear = [
        (n, m)
        for n, m in saved["model"].named_modules()
        if isinstance(m, torch.nn.Linear) and n != "lm_head"
    ]
    shapes = target.site_shapes()
    assert list(shapes) == [n for n, _ in linear]
    assert all(shapes[n] == (m.in_features, m.out_features) for n, m in linear)


def test_gguf_logits_match_transformers(tmp_path):
    """A Qwen3 GGUF (F32 tensors, as llama.cpp's converter names them: attn_q_norm /
    attn_k_norm, Q and K rows unpermuted, key_length = head_dim) read by pdctl gives the logits
    of the transformers model it was written from."""
    from test_gguf import pdctl_logits, write_gguf

    model = _model(CASES["tied_head_dim_16"])
    path = write_gguf(model, "qwen3", tmp_path / "qwen3.gguf", gguf.GGMLQuantizationType.F32)
    names = {t.name for t in gguf.GGUFReader(str(path)).tensors}
    assert {"blk.1.attn_q_norm.weight", "blk.1.attn_k_norm.weight"} <= names
    spec = gguf_spec(path)
    assert spec.architecture == QWEN3 and spec.qk_norm and spec.head_dim == 16
    assert spec.tie_word_embeddings and spec.rope_theta == 1e6
    tokens = _tokens(model.config.vocab_size)
    np.testing.assert_allclose(pdctl_logits(path, tokens), _reference(model, tokens), atol=ATOL)


def test_gguf_tokenizer_is_qwen2_style_bpe(tmp_path):
    """A Qwen3 GGUF's tokenizer (byte-level BPE, `tokenizer.ggml.pre = qwen2`, as llama.cpp
    writes Qwen3's): Qwen2's split (digits one by one) and round trips."""
    from test_gguf_tokenizer import _write, byte_level_fields

    from pdctl.science.gguf_tokenizer import load_gguf_tokenizer

    path = _write(tmp_path / "t.gguf", arch="qwen3", **byte_level_fields(pre="qwen2"))
    tok = load_gguf_tokenizer(path)
    enc = tok.tokenizer.encode("the world 12345")
    assert [p for p in enc.tokens if p.isdigit()] == list("12345")
    for text in ("hello world", "naïve café 你好", " x = [1, 22]\n"):
        assert tok.tokenizer.decode(tok.tokenizer.encode(text).ids) == text


def test_gguf_tokenizer_equals_transformers(tmp_path):
    from test_gguf_tokenizer import _write, byte_level_fields

    from pdctl.science.gguf_tokenizer import load_gguf_tokenizer

    path = _write(tmp_path / "t.gguf", arch="qwen3", **byte_level_fields(pre="qwen2"))
    mine = load_gguf_tokenizer(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert json.loads(mine.tokenizer.to_str()) == json.loads(theirs.backend_tokenizer.to_str())


# ---- what is refused -------------------------------------------------------------------------


def _one_line(fn, *needles: str) -> str:
    with pytest.raises(PdctlError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("target.path: "), msg
    for n in needles:
        assert n in msg, msg
    return msg


def _config(path: Path, **cfg) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    base = dict(CASES["tied_head_dim_16"], architectures=["Qwen3ForCausalLM"], model_type="qwen3")
    (path / "config.json").write_text(json.dumps({**base, **cfg}))
    return path


def test_hf_config_defaults_and_refusals(tmp_path):
    # Qwen3Config's head_dim default is 128, not hidden_size / heads
    cfg = {k: v for k, v in CASES["tied_head_dim_16"].items() if k != "head_dim"}
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3"}))
    assert read_hf_config(tmp_path / "d", need_weights=False).head_dim == 128
    for where, cfg in [
        ("arch", {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe"}),
        ("type", {"architectures": None, "model_type": "qwen3_moe"}),
    ]:
        _one_line(
            lambda d=_config(tmp_path / where, **cfg): read_hf_config(d, need_weights=False),
            "'Qwen3MoeForCausalLM'", "mixture-of-experts", "Qwen3ForCausalLM",
        )  # fmt: skip
    sliding = _config(tmp_path / "sw", use_sliding_window=True, sliding_window=4,
                      max_window_layers=1)  # fmt: skip
    _one_line(lambda: read_hf_config(sliding, need_weights=False), "sliding-window attention")


def _gguf(path: Path, arch: str, **ints: int) -> Path:
    w = gguf.GGUFWriter(str(path), arch)
    for key, v in {"block_count": 1, "embedding_length": 32, "feed_forward_length": 64,
                   "attention.head_count": 4, **ints}.items():  # fmt: skip
        w.add_uint32(f"{arch}.{key}", v)
    w.add_tensor("token_embd.weight", np.zeros((8, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_gguf_refusals(tmp_path):
    moe = _gguf(tmp_path / "moe.gguf", "qwen3moe")
    _one_line(lambda: gguf_spec(moe), "'qwen3moe'", "mixture-of-experts", "qwen3")
    odd = _gguf(tmp_path / "v.gguf", "qwen3", **{"attention.key_length": 16,
                                                 "attention.value_length": 8})  # fmt: skip
    _one_line(lambda: gguf_spec(odd), "attention.value_length 8 != head_dim 16")
    # without key_length, llama.cpp's head_dim: embedding_length / head_count
    assert gguf_spec(_gguf(tmp_path / "plain.gguf", "qwen3")).head_dim == 8


def test_cli_refuses_a_qwen3_moe_gguf_in_one_line(tmp_path):
    moe = _gguf(tmp_path / "moe.gguf", "qwen3moe")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        assert cli("new", "x", "--template", "hf-lm").exit_code == 0
    finally:
        os.chdir(cwd)
    run = tmp_path / "x"
    edit_config(run, {"target": {"path": str(moe)}})
    r = cli("--project", run, "run")
    assert r.exit_code == 2, r.output
    lines = error_lines(r)
    assert len(lines) == 1 and "Traceback" not in r.output, r.output
    assert "target.path" in lines[0] and "'qwen3moe'" in lines[0], lines[0]
    assert "mixture-of-experts" in lines[0], lines[0]
    assert "[state." not in (run / "pdctl.toml").read_text()
    assert not (run / "checkpoints").exists()
