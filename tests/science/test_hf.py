"""Hugging Face targets: config reading, the sharded safetensors loader, and logit parity with
transformers (float32, CPU) on tiny random models saved locally (no network).

Parity cases need the `parity` extra (transformers + torch); the loader and error tests build
their checkpoints with safetensors alone.
"""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from safetensors.numpy import save_file

from pdctl.engine.sharding import tree_shardings
from pdctl.errors import PdctlError
from pdctl.science.targets.hf import HFCausalLM, read_hf_config
from pdctl.science.targets.hf import load as hf_load
from pdctl.science.targets.hf.load import load_hf_params, read_index

SEQ = 12
MIN_SIZE = 64  # fsdp_min_param_size for these tiny models: most leaves shard on 4 devices
PARITY_ATOL = 1e-4

# Tiny configs that cover each feature: GQA (kv heads < heads, down to 1), attention and MLP
# biases, llama3 RoPE scaling with tied embeddings, Qwen2's q/k/v biases, GPT-2 with a vocab
# that 4 does not divide (its embedding shards along d instead). Sharded saves for two of them.
CASES: dict[str, dict] = {
    "llama_gqa_bias": {
        "arch": "LlamaForCausalLM",
        "config": dict(vocab_size=160, hidden_size=48, intermediate_size=96, num_hidden_layers=2,
                       num_attention_heads=6, num_key_value_heads=2, attention_bias=True,
                       mlp_bias=True, tie_word_embeddings=False),
        "max_shard_size": "20KB",
    },
    "llama3_rope_tied": {
        "arch": "LlamaForCausalLM",
        "config": dict(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True,
                       rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0,
                                        "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0,
                                        "original_max_position_embeddings": 32}),
    },
    "qwen2": {
        "arch": "Qwen2ForCausalLM",
        "config": dict(vocab_size=200, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True),
        "max_shard_size": "30KB",
    },
    "gpt2": {
        "arch": "GPT2LMHeadModel",
        "config": dict(vocab_size=101, n_embd=32, n_layer=2, n_head=4, n_positions=32),
    },
}  # fmt: skip


def _mesh(n: int) -> Mesh:
    return Mesh(np.array(jax.devices()[:n]).reshape(1, n), ("data", "fsdp"))


def _shardings(target: HFCausalLM, n: int, min_size: int = MIN_SIZE):
    abstract = jax.eval_shape(target.init, jax.random.key(0))
    return tree_shardings(abstract, _mesh(n), min_size)


def _dotted(path) -> str:
    return ".".join(k.key for k in path)


def _tokens(vocab: int, batch: int = 2, seq: int = SEQ, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, seq), dtype=np.int64)


# ---------------------------------------------------------------------------------------------
# Parity with transformers


def _build_hf(name: str, root: Path) -> SimpleNamespace:
    transformers = pytest.importorskip(
        "transformers", reason="logit parity needs the `parity` extra (transformers, torch)"
    )
    torch = pytest.importorskip("torch", reason="logit parity needs the `parity` extra")
    case = CASES[name]
    cfg_cls = {
        "LlamaForCausalLM": transformers.LlamaConfig,
        "Qwen2ForCausalLM": transformers.Qwen2Config,
        "GPT2LMHeadModel": transformers.GPT2Config,
    }[case["arch"]]
    torch.manual_seed(0)
    model = getattr(transformers, case["arch"])(cfg_cls(**case["config"])).eval()
    with torch.no_grad():
        # transformers' init leaves biases at 0 and norm scales at 1; random values make every
        # parameter show in the logits.
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    path = root / name
    kwargs = {"max_shard_size": case["max_shard_size"]} if "max_shard_size" in case else {}
    model.save_pretrained(path, safe_serialization=True, **kwargs)
    assert (path / "model.safetensors.index.json").is_file() == bool(kwargs)
    tokens = _tokens(model.config.vocab_size)
    with torch.no_grad():
        out = model(torch.tensor(tokens), labels=torch.tensor(tokens))
    return SimpleNamespace(
        name=name,
        path=path,
        model=model,
        tokens=tokens,
        logits=out.logits.float().numpy(),
        loss=float(out.loss),
        target=HFCausalLM.from_dir(path, seq_len=SEQ),
        torch=torch,
    )


@pytest.fixture(scope="module")
def hf_root(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("hf")


@pytest.fixture(scope="module", params=list(CASES))
def hf_case(request, hf_root) -> SimpleNamespace:
    return _build_hf(request.param, hf_root)


@pytest.mark.parametrize("n_devices", [1, 4])
def test_logits_match_transformers(hf_case, n_devices: int):
    target = hf_case.target
    shardings = _shardings(target, n_devices)
    params, info = load_hf_params(hf_case.path, target, shardings)
    assert info["source"] == str(hf_case.path.resolve())
    assert len(info["checksum"]) == 64
    flat_params = jax.tree_util.tree_leaves_with_path(params)
    flat_sh = jax.tree.leaves(shardings)
    assert len(flat_params) == len(flat_sh)
    n_sharded = 0
    for (path, x), s in zip(flat_params, flat_sh, strict=True):
        assert x.sharding == s, path
        assert x.dtype == jnp.float32
        n_sharded += not s.is_fully_replicated
    if n_devices == 4:
        assert n_sharded >= 10  # the fsdp axis is really used, not everything replicated
    # Strict numerics as the equinox tests: no silent rank or dtype promotion in the forward.
    with jax.numpy_rank_promotion("raise"), jax.numpy_dtype_promotion("strict"):
        logits = jax.jit(target.apply)(params, jnp.asarray(hf_case.tokens, jnp.int32))
    assert logits.dtype == jnp.float32
    np.testing.assert_allclose(np.asarray(logits), hf_case.logits, rtol=0, atol=PARITY_ATOL)
    if n_devices == 1:
        # Next-token CE as transformers' own loss with labels = inputs (the batch carries one
        # extra token; apply sees tokens[:, :-1]).
        ce, _ = jax.jit(target.loss)(params, {"tokens": jnp.asarray(hf_case.tokens, jnp.int32)})
        np.testing.assert_allclose(float(ce), hf_case.loss, rtol=1e-5)


def test_site_paths_are_the_hf_modules(hf_case):
    """Sites are exactly the attention and MLP Linear/Conv1D modules, named and ordered as
    transformers names them, with pdctl's (d_in, d_out) shapes."""
    from transformers.pytorch_utils import Conv1D

    torch = hf_case.torch
    modules = [
        (n, m)
        for n, m in hf_case.model.named_modules()
        if isinstance(m, torch.nn.Linear | Conv1D) and n != "lm_head"
    ]
    shapes = hf_case.target.site_shapes()
    assert list(shapes) == [n for n, _ in modules]
    for n, m in modules:
        w = m.weight
        expected = tuple(w.shape) if isinstance(m, Conv1D) else (w.shape[1], w.shape[0])
        assert shapes[n] == expected, n


def test_identity_override_is_bit_identical(hf_case):
    target = hf_case.target
    params, _ = load_hf_params(hf_case.path, target, _shardings(target, 1))
    weights = target.site_weights(params)
    tokens = jnp.asarray(hf_case.tokens, jnp.int32)

    @jax.jit
    def both(params, tokens):
        same = {p: (lambda x, w=w: x @ w) for p, w in weights.items()}
        first = target.site_paths()[0]
        zeroed = {first: lambda x: jnp.zeros((*x.shape[:-1], weights[first].shape[1]), x.dtype)}
        return (
            target.apply(params, tokens),
            target.apply(params, tokens, same),
            target.apply(params, tokens, zeroed),
        )

    plain, same, zeroed = both(params, tokens)
    np.testing.assert_array_equal(np.asarray(same), np.asarray(plain))
    assert not np.allclose(np.asarray(zeroed), np.asarray(plain))  # overrides are really used


def test_stored_bf16_and_fp16_convert_on_the_fly(hf_root):
    """A bf16 / fp16 checkpoint loads into float32 with exactly the stored values, and a
    float32 checkpoint into bfloat16 params when asked."""
    case = _build_hf("llama_gqa_bias", hf_root / "half")
    torch = case.torch
    for torch_dtype in (torch.bfloat16, torch.float16):
        path = hf_root / f"half_{str(torch_dtype).split('.')[-1]}"
        case.model.to(torch_dtype).save_pretrained(path, safe_serialization=True)
        target = HFCausalLM.from_dir(path, seq_len=SEQ)
        params, _ = load_hf_params(path, target, _shardings(target, 4))
        ref = case.model.model.layers[1].self_attn.q_proj.weight.detach().float().numpy().T
        got = params["model"]["layers"]["1"]["self_attn"]["q_proj"]["weight"]
        assert got.dtype == jnp.float32
        np.testing.assert_array_equal(np.asarray(got), ref)
    target = HFCausalLM.from_dir(case.path, seq_len=SEQ, param_dtype="bfloat16")
    params, _ = load_hf_params(case.path, target, _shardings(target, 4))
    assert {x.dtype for x in jax.tree.leaves(params)} == {jnp.dtype(jnp.bfloat16)}
    logits = jax.jit(target.apply)(params, jnp.asarray(case.tokens, jnp.int32))
    assert logits.dtype == jnp.float32 and bool(jnp.all(jnp.isfinite(logits)))


# ---------------------------------------------------------------------------------------------
# Loader behaviour on hand-made checkpoints (safetensors only)

LLAMA_CFG = {
    "architectures": ["LlamaForCausalLM"],
    "vocab_size": 4096,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": False,
}


def _write_model(path: Path, config: dict, *, shards: int = 1, drop: str | None = None) -> Path:
    """A random checkpoint that fits `config`, as one file or `shards` files plus an index."""
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    (path / "model.safetensors").touch()  # read_hf_config wants weights to be present
    target = HFCausalLM(spec=read_hf_config(path), seq_len=SEQ)
    (path / "model.safetensors").unlink()
    rng = np.random.default_rng(1)
    tensors = {
        t.name: rng.standard_normal(t.stored_shape).astype(np.float32)
        for t in target.checkpoint_layout().values()
        if t.name != drop
    }
    if shards == 1:
        save_file(tensors, str(path / "model.safetensors"))
        return path
    names = sorted(tensors)
    weight_map = {}
    for j in range(shards):
        fname = f"model-{j + 1:05d}-of-{shards:05d}.safetensors"
        part = names[j::shards]
        save_file({n: tensors[n] for n in part}, str(path / fname))
        weight_map.update(dict.fromkeys(part, fname))
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return path


def test_each_process_reads_only_its_shards(tmp_path, monkeypatch):
    """make_array_from_callback asks for the 4 addressable shards of a sharded leaf and once for
    a replicated one; every read is exactly that slice, so the elements read sum to the model's."""
    path = _write_model(tmp_path / "m", LLAMA_CFG, shards=3)
    target = HFCausalLM.from_dir(path, seq_len=SEQ)
    shardings = _shardings(target, 4, min_size=1024)
    reads: dict[str, list[tuple[int, ...]]] = {}
    real_read = hf_load._read

    def spy(sl, t, index, dtype):
        out = real_read(sl, t, index, dtype)
        reads.setdefault(t.name, []).append(out.shape)
        return out

    monkeypatch.setattr(hf_load, "_read", spy)
    params, info = load_hf_params(path, target, shardings)
    planned = {_dotted(p): s for p, s in jax.tree_util.tree_leaves_with_path(shardings)}
    n_sharded = 0
    for p, x in jax.tree_util.tree_leaves_with_path(params):
        s = planned[_dotted(p)]
        n_sharded += not s.is_fully_replicated
        expected = [s.shard_shape(x.shape)] * (1 if s.is_fully_replicated else 4)
        assert reads[_dotted(p)] == expected, _dotted(p)
    assert n_sharded >= 10
    # Nothing is read twice: the elements read add up to the model's, once.
    n_read = sum(int(np.prod(shape)) for shapes in reads.values() for shape in shapes)
    assert 4 * n_read == info["bytes"] == sum(x.nbytes for x in jax.tree.leaves(params))


def test_sharded_load_host_memory_bound(tmp_path):
    """Peak host allocation during a 4-device fsdp load stays under what the devices hold plus
    1.5 copies of the largest tensor (the issue: never a full copy of the largest tensor twice).

    Derivation. On CPU the devices' buffers are host memory; XLA may alias the numpy shards it
    is given, so tracemalloc may count them: at most `model` bytes. On top of that, for the leaf
    being loaded: make_array_from_callback gathers the host copies of all 4 addressable shards
    before transferring them (1.0 x the tensor), and while one shard is being transposed /
    converted its raw slice exists too (0.25 x). Hence peak <= model + 1.25 x largest; the bound
    adds 0.25 x largest + 256 KiB of slack for JAX's own Python objects. Loading each tensor
    whole and slicing it would need 2 x largest on top of the model, and fails this bound.
    The embedding and lm_head (4096 x 64 float32, 1 MiB each) dominate this model (2.3 MiB).
    """
    path = _write_model(tmp_path / "m", LLAMA_CFG, shards=2)
    target = HFCausalLM.from_dir(path, seq_len=SEQ)
    shardings = _shardings(target, 4, min_size=1024)
    load_hf_params(path, target, shardings)  # warm JAX's caches outside the measurement
    largest = 4096 * 64 * 4
    tracemalloc.start()
    try:
        params, info = load_hf_params(path, target, shardings)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    model = info["bytes"]
    assert model == sum(x.nbytes for x in jax.tree.leaves(params))
    assert peak < model + 1.5 * largest + 256 * 1024, (peak, model, largest)


def test_base_model_names_without_prefix_load(tmp_path):
    """Checkpoints saved from the base model (the Hub's gpt2: `h.0.attn...`, no `transformer.`)
    load too; the checksum follows the single file's header."""
    cfg = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_embd": 16, "n_layer": 1,
           "n_head": 2, "n_positions": 16}  # fmt: skip
    full = _write_model(tmp_path / "full", cfg)
    from safetensors.numpy import load_file

    tensors = load_file(str(full / "model.safetensors"))
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "config.json").write_text(json.dumps(cfg))
    save_file({k.removeprefix("transformer."): v for k, v in tensors.items()},
              str(bare / "model.safetensors"))  # fmt: skip
    target = HFCausalLM.from_dir(bare, seq_len=SEQ)
    a, _ = load_hf_params(full, target, _shardings(target, 1))
    b, info = load_hf_params(bare, target, _shardings(target, 1))
    jax.tree.map(np.testing.assert_array_equal, a, b)
    assert info["checksum_of"] == "model.safetensors header"
    assert read_index(bare).checksum != read_index(full).checksum


def test_init_has_the_loaded_structure():
    target = HFCausalLM(spec=_spec_of(LLAMA_CFG), seq_len=SEQ)
    params = jax.jit(target.init)(jax.random.key(0))
    leaves = jax.tree_util.tree_leaves_with_path(params)
    assert {_dotted(p): x.shape for p, x in leaves} == target.param_shapes()
    logits = jax.jit(target.apply)(params, jnp.zeros((2, SEQ), jnp.int32))
    assert logits.shape == (2, SEQ, 4096)
    assert target.n_tokens_per_example() == SEQ


def _spec_of(cfg: dict, tmp: Path | None = None):
    import tempfile

    d = Path(tmp or tempfile.mkdtemp())
    (d / "config.json").write_text(json.dumps(cfg))
    (d / "model.safetensors").touch()
    return read_hf_config(d)


# ---------------------------------------------------------------------------------------------
# Bad inputs: one line each, naming what was found and what is supported


def _one_line_error(fn, *match: str) -> str:
    with pytest.raises(PdctlError) as e:
        fn()
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("target.path: "), msg
    for m in match:
        assert m in msg, msg
    return msg


def test_missing_dir_config_and_weights(tmp_path):
    _one_line_error(lambda: read_hf_config(tmp_path / "nope"), "nope", "not a directory")
    _one_line_error(lambda: read_hf_config(tmp_path), "no config.json", str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps(LLAMA_CFG))
    _one_line_error(lambda: read_hf_config(tmp_path), "no weights", "model.safetensors")
    (tmp_path / "model.safetensors").write_text("")
    (tmp_path / "config.json").write_text("{not json")
    _one_line_error(lambda: read_hf_config(tmp_path), "config.json is not valid JSON")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"architectures": ["MistralForCausalLM"]},
         ("architecture 'MistralForCausalLM'", "config.json is not supported",
          "(supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, GPT2LMHeadModel)")),
        ({"architectures": None}, ("no 'architectures'", "supported: LlamaForCausalLM")),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}},
         ("rope scaling 'yarn'", "supported: default, linear, llama3")),
        ({"hidden_act": "gelu_fast"}, ("hidden_act 'gelu_fast'", "supported: silu")),
        ({"architectures": ["Qwen2ForCausalLM"], "use_sliding_window": True,
          "sliding_window": 8, "max_window_layers": 1},
         ("sliding-window attention", "supported: full attention")),
        ({"num_attention_heads": None}, ("has no 'num_attention_heads'",)),
    ],
)  # fmt: skip
def test_unsupported_configs(tmp_path, change, match):
    cfg = {k: v for k, v in {**LLAMA_CFG, **change}.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    (tmp_path / "model.safetensors").touch()
    _one_line_error(lambda: read_hf_config(tmp_path), *match)


def test_wrong_shape_in_a_shard(tmp_path):
    path = _write_model(tmp_path / "m", LLAMA_CFG, shards=2)
    index = json.loads((path / "model.safetensors.index.json").read_text())["weight_map"]
    name = "model.layers.1.mlp.up_proj.weight"
    shard = path / index[name]
    from safetensors.numpy import load_file

    tensors = load_file(str(shard))
    tensors[name] = np.zeros((96, 64), np.float32)  # config.json: (intermediate 128, hidden 64)
    save_file(tensors, str(shard))
    target = HFCausalLM.from_dir(path, seq_len=SEQ)
    _one_line_error(
        lambda: load_hf_params(path, target, _shardings(target, 4)),
        f"tensor '{name}'",
        str(shard),
        "shape (96, 64)",
        "implies (128, 64)",
    )


def test_missing_tensor_and_missing_shard(tmp_path):
    path = _write_model(tmp_path / "a", LLAMA_CFG, drop="lm_head.weight")
    target = HFCausalLM.from_dir(path, seq_len=SEQ)
    _one_line_error(
        lambda: load_hf_params(path, target, _shardings(target, 1)),
        "tensor 'lm_head.weight'",
        "(4096, 64)",
        "is not in the checkpoint",
    )
    # Tied embeddings: lm_head absent is fine.
    tied = _write_model(tmp_path / "b", {**LLAMA_CFG, "tie_word_embeddings": True})
    target = HFCausalLM.from_dir(tied, seq_len=SEQ)
    params, _ = load_hf_params(tied, target, _shardings(target, 1))
    assert "lm_head" not in params
    sharded = _write_model(tmp_path / "c", LLAMA_CFG, shards=2)
    (sharded / "model-00002-of-00002.safetensors").unlink()
    _one_line_error(lambda: read_index(sharded), "lists model-00002-of-00002.safetensors")


def test_gpt2_seq_len_beyond_positions_is_a_config_error(tmp_path):
    cfg = {"architectures": ["GPT2LMHeadModel"], "vocab_size": 64, "n_embd": 16, "n_layer": 1,
           "n_head": 2, "n_positions": 16}  # fmt: skip
    spec = _spec_of(cfg, tmp_path)
    with pytest.raises(PdctlError, match=r"data\.seq_len: 32 exceeds the 16 learned positions"):
        HFCausalLM(spec=spec, seq_len=32)


@pytest.mark.slow  # ~8 s; test_scale.py keeps remat in the fast tier
def test_remat_keeps_loss_and_grads():
    cfg = {**LLAMA_CFG, "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
           "num_hidden_layers": 1}  # fmt: skip
    spec = _spec_of(cfg)
    tokens = jnp.asarray(_tokens(64, seq=SEQ + 1), jnp.int32)
    params = jax.jit(HFCausalLM(spec=spec, seq_len=SEQ).init)(jax.random.key(1))
    out = {}
    for remat in ("none", "full"):
        target = HFCausalLM(spec=spec, seq_len=SEQ, remat=remat)
        grad_fn = jax.jit(jax.value_and_grad(lambda p, t=target: t.loss(p, {"tokens": tokens})[0]))
        out[remat] = grad_fn(params)
    np.testing.assert_allclose(float(out["full"][0]), float(out["none"][0]), rtol=1e-6)
    jax.tree.map(
        lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6),
        out["full"][1],
        out["none"][1],
    )
