"""GGUF targets: the spec from the metadata, tensors dequantised into sharded arrays, llama.cpp's
Q/K permutation undone, and logits equal to transformers' GGUF loader on the same file.

Fast tier: tiny random Llama / Qwen2 / GPT-2 models from transformers, converted here the way
llama.cpp's converter writes them (Q/K rows permuted for Llama, GPT-2's Conv1D weights as
(d_out, d_in), every 2-D weight quantised), read back by pdctl and by transformers.
Slow tier: the real SmolLM2-135M-Instruct GGUF (tests/real_model.py) against transformers in
float32 on 4 x 128 tokens of real text, and the Hugging Face directory saved from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pdctl.errors import PdctlError
from pdctl.science.targets import build_target
from pdctl.science.targets.gguf import (
    GGUFIndex,
    _spec_key,
    find_gguf,
    gguf_spec,
    load_gguf_params,
    reader,
)
from pdctl.science.targets.gguf import _reader as gguf_reader
from pdctl.science.targets.hf import HFCausalLM

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")
pytest.importorskip("accelerate")

Q = gguf.GGMLQuantizationType
VOCAB = 320


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter: each head's rows from (2, dim) rotary halves to (dim, 2) pairs."""
    rows = w.shape[0] // heads // 2
    return w.reshape(heads, 2, rows, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _tokenizer_fields(writer: gguf.GGUFWriter) -> None:
    """A byte-level vocabulary of VOCAB tokens (transformers' loader wants one)."""
    from tokenizers import pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = ["<|endoftext|>", *alphabet]
    tokens += [f"{a}{b}" for a in alphabet[:8] for b in alphabet[:8]][: VOCAB - len(tokens)]
    merges = [f"{t[0]} {t[1]}" for t in tokens[1 + len(alphabet) :]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([3] + [1] * (len(tokens) - 1))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(0)


def write_gguf(model, arch: str, path: Path, qtype=Q.Q8_0, vector_type=Q.F32) -> Path:
    """`model` (a transformers model) as llama.cpp writes it: every 2-D weight in `qtype`
    (embeddings and the LM head included), vectors in `vector_type`."""
    cfg = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    if arch == "gpt2":
        w.add_block_count(cfg.n_layer)
        w.add_context_length(cfg.n_positions)
        w.add_embedding_length(cfg.n_embd)
        w.add_feed_forward_length(cfg.n_inner or 4 * cfg.n_embd)
        w.add_head_count(cfg.n_head)
        w.add_layer_norm_eps(cfg.layer_norm_epsilon)
    else:
        w.add_block_count(cfg.num_hidden_layers)
        w.add_context_length(cfg.max_position_embeddings)
        w.add_embedding_length(cfg.hidden_size)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_head_count(cfg.num_attention_heads)
        w.add_head_count_kv(cfg.num_key_value_heads)
        w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
        rope = getattr(cfg, "rope_parameters", None) or {}  # transformers 5 keeps theta there
        w.add_rope_freq_base(rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        w.add_rope_dimension_count(head_dim)
        if arch == "qwen3":  # llama.cpp writes Qwen3's head_dim (it need not be d / heads)
            w.add_key_length(head_dim)
            w.add_value_length(head_dim)
        w.add_vocab_size(cfg.vocab_size)
    _tokenizer_fields(w)
    names = _names(arch)
    for hf_name, array in sd.items():
        name = _rename(hf_name, names)
        if name is None or (name == "output.weight" and cfg.tie_word_embeddings):
            continue  # a tied head is the embedding: llama.cpp writes no output.weight
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            heads = cfg.num_attention_heads if ".attn_q." in name else cfg.num_key_value_heads
            array = _permute(array, heads)
        if arch == "gpt2" and array.ndim == 2 and "blk." in name:
            array = array.T.copy()  # Conv1D (d_in, d_out) -> (d_out, d_in), as llama.cpp
        kind = qtype if array.ndim == 2 else vector_type
        if kind in K_SCALES:  # gguf.quants cannot quantise K-quants: random valid blocks
            data = _random_k_blocks(array.shape, kind, seed=len(name))
        else:
            data = gguf.quants.quantize(np.ascontiguousarray(array, np.float32), kind)
        w.add_tensor(name, data, raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# Byte offsets of each K-quant block's float16 scales (d, dmin for Q4_K / Q5_K, d for Q6_K),
# set to small values so random quant bits make weights of a usable size.
K_SCALES = {Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _random_k_blocks(shape: tuple[int, int], kind, seed: int) -> np.ndarray:
    block, nbytes = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = shape
    raw = np.random.default_rng(seed).integers(0, 256, (rows, cols // block, nbytes), np.uint8)
    scale = np.frombuffer(np.float16(2e-5 if kind == Q.Q6_K else 1e-4).tobytes(), np.uint8)
    for off in K_SCALES[kind]:
        raw[..., off : off + 2] = scale
    return raw.reshape(rows, -1)


def _names(arch: str) -> dict[str, str]:
    if arch == "gpt2":
        return {
            "ln_1": "attn_norm", "ln_2": "ffn_norm", "attn.c_attn": "attn_qkv",
            "attn.c_proj": "attn_output", "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down",
        }  # fmt: skip
    return {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
    }  # fmt: skip


def _rename(hf: str, names: dict[str, str]) -> str | None:
    top = {
        "model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight", "transformer.wte.weight": "token_embd.weight",
        "transformer.wpe.weight": "position_embd.weight",
        "transformer.ln_f.weight": "output_norm.weight",
        "transformer.ln_f.bias": "output_norm.bias",
    }  # fmt: skip
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    if tuple(parts[:2]) not in (("model", "layers"), ("transformer", "h")):
        return None
    i, module, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
    if module not in names:  # attn.bias / masked_bias buffers of old GPT-2 checkpoints
        return None
    return f"blk.{i}.{names[module]}.{leaf}"


def tiny_model(arch: str, d: int = 64, tied: bool = False):
    torch.manual_seed(0)
    if arch == "gpt2":
        # transformers' GGUF loader maps neither feed_forward_length nor context_length to
        # GPT-2's n_inner / n_positions: keep its defaults (4 d, 1024) so it can read the file.
        cfg = transformers.GPT2Config(vocab_size=VOCAB, n_embd=d, n_layer=2, n_head=4)
        return transformers.GPT2LMHeadModel(cfg).eval()
    common = dict(
        vocab_size=VOCAB, hidden_size=d, intermediate_size=2 * d, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied,
        max_position_embeddings=128, rope_theta=10000.0,
    )  # fmt: skip
    if arch == "qwen2":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common)).eval()
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common)).eval()
    with torch.no_grad():  # norms away from 1, so a swapped norm would show
        for p in model.parameters():
            if p.ndim == 1:
                p.uniform_(0.5, 1.5)
    return model


def pdctl_logits(path: Path, tokens: np.ndarray, mesh_devices: int = 1) -> np.ndarray:
    target = HFCausalLM(spec=gguf_spec(path), seq_len=tokens.shape[1])
    abstract = jax.eval_shape(target.init, jax.random.PRNGKey(0))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params, _ = load_gguf_params(path, target, jax.tree.map(lambda _: one, abstract))
    return np.asarray(jax.jit(target.apply)(params, jnp.asarray(tokens)))


def transformers_logits(path: Path, tokens: np.ndarray) -> np.ndarray:
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    with torch.no_grad():
        return model(torch.tensor(tokens)).logits.numpy()


def _tokens(n: int = 2, t: int = 24) -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, size=(n, t))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arch", "qtype", "tied"),
    [("llama", Q.Q8_0, False), ("llama", Q.F16, True), ("qwen2", Q.Q4_1, False)],
)
def test_tiny_gguf_logits_equal_transformers(tmp_path, arch, qtype, tied):
    """pdctl reads the file as transformers does: same dequantised weights, same Q/K rows,
    same tying; logits equal to float32 reordering (1e-4 on O(1) logits)."""
    path = write_gguf(tiny_model(arch, tied=tied), arch, tmp_path / f"{arch}.gguf", qtype)
    spec = gguf_spec(path)
    assert spec.tie_word_embeddings is tied and spec.n_kv_heads == 2 and spec.n_layers == 2
    tokens = _tokens()
    ours, ref = pdctl_logits(path, tokens), transformers_logits(path, tokens)
    np.testing.assert_allclose(ours, ref, atol=1e-4, rtol=0)


def test_gguf_weights_are_the_dequantised_tensors_unpermuted(tmp_path):
    """Leaf by leaf: each site weight is the dequantised GGUF tensor transposed, Q and K rows
    back in transformers' order (exact: the same float32 dequantisation)."""
    model = tiny_model("llama")
    path = write_gguf(model, "llama", tmp_path / "m.gguf", Q.Q8_0)
    target = HFCausalLM(spec=gguf_spec(path))
    abstract = jax.eval_shape(target.init, jax.random.PRNGKey(0))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params, info = load_gguf_params(path, target, jax.tree.map(lambda _: one, abstract))
    assert info["tensors"] == len(target.param_shapes())
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    deq = {n: gguf.quants.dequantize(np.asarray(t.data), t.tensor_type) for n, t in tensors.items()}
    q = params["model"]["layers"]["0"]["self_attn"]["q_proj"]["weight"]
    np.testing.assert_array_equal(np.asarray(q), _permute_back(deq["blk.0.attn_q.weight"], 4).T)
    k = params["model"]["layers"]["1"]["self_attn"]["k_proj"]["weight"]
    np.testing.assert_array_equal(np.asarray(k), _permute_back(deq["blk.1.attn_k.weight"], 2).T)
    down = params["model"]["layers"]["1"]["mlp"]["down_proj"]["weight"]
    np.testing.assert_array_equal(np.asarray(down), deq["blk.1.ffn_down.weight"].T)
    emb = params["model"]["embed_tokens"]["weight"]
    np.testing.assert_array_equal(np.asarray(emb), deq["token_embd.weight"])


def _permute_back(w: np.ndarray, heads: int) -> np.ndarray:
    rows = w.shape[0] // heads // 2
    return w.reshape(heads, rows, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


SHARDED = r"""
import sys, jax, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from pdctl.science.targets.gguf import gguf_spec, load_gguf_params
from pdctl.science.targets.hf import HFCausalLM
path = sys.argv[1]
target = HFCausalLM(spec=gguf_spec(path))
abstract = jax.eval_shape(target.init, jax.random.PRNGKey(0))
mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("data", "fsdp"))
def spec(x):
    if x.ndim == 2:
        return NamedSharding(mesh, P("data", "fsdp"))
    return NamedSharding(mesh, P("fsdp") if x.shape[0] % 2 == 0 else P())
sharded, _ = load_gguf_params(path, target, jax.tree.map(spec, abstract))
one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
whole, _ = load_gguf_params(path, target, jax.tree.map(lambda _: one, abstract))
for a, b in zip(jax.tree.leaves(sharded), jax.tree.leaves(whole)):
    assert len(a.sharding.device_set) == 4
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
print("ok")
"""


def test_gguf_reads_into_a_4_device_layout_equal_to_one_device(tmp_path):
    """Every leaf split over rows and columns of a 2 x 2 mesh reads the same values as on one
    device (each shard dequantises only its own rows)."""
    path = write_gguf(tiny_model("llama"), "llama", tmp_path / "m.gguf", Q.Q4_0)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4"}
    out = subprocess.run(
        [sys.executable, "-c", SHARDED, str(path)], env=env, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "ok"


def test_find_gguf_file_or_single_in_directory(tmp_path):
    path = write_gguf(tiny_model("llama"), "llama", tmp_path / "a.gguf")
    assert find_gguf(path) == path.resolve()
    assert find_gguf(tmp_path) == path.resolve()
    target = build_target("hf", path=str(tmp_path))
    assert target.spec.config_path == str(path.resolve())
    (tmp_path / "b.gguf").write_bytes(path.read_bytes())
    with pytest.raises(PdctlError, match=r"holds 2 \.gguf files"):
        find_gguf(tmp_path)


def test_unsupported_architecture_and_type_are_one_line(tmp_path):
    path = tmp_path / "falcon.gguf"
    w = gguf.GGUFWriter(str(path), "falcon")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(PdctlError) as e:
        gguf_spec(path)
    msg = str(e.value)
    assert "\n" not in msg and "'falcon'" in msg and "llama, qwen2, qwen3, gpt2" in msg

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 20)
    with pytest.raises(PdctlError, match="not a readable GGUF file"):
        gguf_spec(bad)


def _same_as_the_reader(path: Path) -> None:
    """`GGUFIndex` reads what `gguf.GGUFReader` reads: the metadata `gguf_spec` uses and every
    tensor's name, type, shape, offset, bytes and data (the same arrays, bit for bit)."""
    ix, r = GGUFIndex(str(path)), gguf.GGUFReader(str(path), "r")
    want = {
        k: f.contents() for k, f in r.fields.items() if _spec_key(k) and not k.startswith("GGUF.")
    }
    assert ix.fields.keys() == want.keys()
    for k, v in want.items():
        assert np.array_equal(np.asarray(ix.fields[k]), np.asarray(v)), k
    assert [t.name for t in ix.tensors] == [t.name for t in r.tensors]
    for a, b in zip(ix.tensors, r.tensors, strict=True):
        assert (a.tensor_type, a.shape, a.n_bytes, a.data_offset) == (
            b.tensor_type, tuple(int(n) for n in b.shape), int(b.n_bytes), int(b.data_offset),
        ), a.name  # fmt: skip
        assert a.data.dtype == b.data.dtype and a.data.shape == b.data.shape, a.name
        assert np.array_equal(a.data, b.data), a.name


@pytest.mark.parametrize("qtype", [Q.Q8_0, Q.F16, Q.Q4_K])
def test_the_gguf_index_reads_what_the_gguf_reader_reads(tmp_path, qtype):
    path = write_gguf(tiny_model("llama"), "llama", tmp_path / "m.gguf", qtype, Q.F32)
    _same_as_the_reader(path)
    gguf_reader.cache_clear()
    assert isinstance(reader(path), GGUFIndex)  # what every target load now reads


def test_a_gguf_the_index_cannot_read_falls_back_to_the_reader(tmp_path, monkeypatch):
    """Anything unusual (here: an index that fails) goes to `gguf.GGUFReader`, whose tensors
    and fields then serve, and whose parse errors stay the one-line ones."""
    path = write_gguf(tiny_model("llama"), "llama", tmp_path / "m.gguf")
    want = gguf_spec(path)

    def broken(self, p):
        raise ValueError("unusual")

    monkeypatch.setattr(GGUFIndex, "__init__", broken)
    gguf_reader.cache_clear()
    assert isinstance(reader(path), gguf.GGUFReader)
    assert gguf_spec(path) == want
    gguf_reader.cache_clear()


# ---- the real model (slow tier) ---------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2():
    from real_model import fortunes, smollm2_gguf

    path = smollm2_gguf()
    tok = transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids: list[int] = []
    for doc in fortunes()[:300]:
        ids += [*tok(doc)["input_ids"], tok.eos_token_id]
    tokens = np.array(ids[: 4 * 128]).reshape(4, 128)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    ).eval()
    with torch.no_grad():
        ref = model(torch.tensor(tokens)).logits.numpy()
    return {"path": path, "tokens": tokens, "ref": ref, "model": model}


@pytest.mark.slow
def test_the_gguf_index_reads_smollm2_as_the_reader() -> None:
    """The real file (Q4_1, 272 tensors, ~100k tokenizer strings the index steps over)."""
    from real_model import smollm2_gguf

    _same_as_the_reader(smollm2_gguf())


def _ce(logits: np.ndarray, tokens: np.ndarray) -> float:
    labels = tokens[:, 1:]
    return float(np.mean(optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], labels)))


@pytest.mark.slow
def test_smollm2_gguf_logits_equal_transformers(smollm2):
    """SmolLM2-135M from its Q4_1 GGUF: pdctl's float32 logits equal transformers' on 4 x 128
    tokens of fortunes (max |dlogit| <= 1e-3, CE to 1e-4; the gap is float32 summation order
    over 30 layers)."""
    ours = pdctl_logits(smollm2["path"], smollm2["tokens"])
    assert np.max(np.abs(ours - smollm2["ref"])) <= 1e-3
    assert abs(_ce(ours, smollm2["tokens"]) - _ce(smollm2["ref"], smollm2["tokens"])) <= 1e-4
    spec = gguf_spec(smollm2["path"])
    assert (spec.n_layers, spec.d_model, spec.d_mlp, spec.n_heads, spec.n_kv_heads) == (
        30, 576, 1536, 9, 3,
    )  # fmt: skip
    assert spec.tie_word_embeddings and spec.rope_theta == 1e5 and spec.vocab_size == 49152


@pytest.mark.slow
def test_smollm2_hf_directory_saved_from_the_gguf_equals_transformers(smollm2, tmp_path):
    """The Hugging Face directory transformers saves from the GGUF (weights copied into a
    fresh LlamaForCausalLM: save_pretrained refuses a GGUF-quantised model) reads into the
    same logits through pdctl's safetensors path."""
    from pdctl.science.targets.hf.load import load_hf_params

    model = smollm2["model"]
    config = transformers.LlamaConfig.from_dict(
        {k: v for k, v in model.config.to_dict().items() if k != "quantization_config"}
    )
    fresh = transformers.LlamaForCausalLM(config)
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text())["num_hidden_layers"] == 30
    target = build_target("hf", path=str(tmp_path), seq_len=128)
    abstract = jax.eval_shape(target.init, jax.random.PRNGKey(0))
    one = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params, _ = load_hf_params(tmp_path, target, jax.tree.map(lambda _: one, abstract))
    ours = np.asarray(jax.jit(target.apply)(params, jnp.asarray(smollm2["tokens"])))
    assert np.max(np.abs(ours - smollm2["ref"])) <= 1e-3
    assert abs(_ce(ours, smollm2["tokens"]) - _ce(smollm2["ref"], smollm2["tokens"])) <= 1e-4


@pytest.mark.slow
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.BF16, Q.Q4_0])
def test_k_quants_and_bf16_equal_transformers(tmp_path, qtype):
    """The K-quant block layouts (256-wide super-blocks) and BF16, on a d_model 256 Llama."""
    path = write_gguf(tiny_model("llama", d=256), "llama", tmp_path / "m.gguf", qtype)
    tokens = _tokens()
    np.testing.assert_allclose(
        pdctl_logits(path, tokens), transformers_logits(path, tokens), atol=1e-4, rtol=1e-4
    )


@pytest.mark.slow
def test_gpt2_gguf_equals_transformers(tmp_path):
    path = write_gguf(tiny_model("gpt2"), "gpt2", tmp_path / "g.gguf", Q.Q8_0, Q.F32)
    tokens = _tokens()
    np.testing.assert_allclose(
        pdctl_logits(path, tokens), transformers_logits(path, tokens), atol=1e-4, rtol=0
    )
