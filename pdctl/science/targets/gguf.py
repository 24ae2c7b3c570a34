"""GGUF files (llama.cpp, ollama, LM Studio) as Hugging Face targets.

`gguf_spec` turns a GGUF file's metadata into the same `HfSpec` a `config.json` gives (through
`hf.spec`'s own validation, from a config dict with transformers' names), so the forward, the
site names (`model.layers.15.mlp.down_proj`) and everything downstream are the Hugging Face
target's.
`load_gguf_params` reads the tensors with the `gguf` package (`GGUFReader`, a memory map) and
dequantises them with `gguf.quants.dequantize` straight into sharded `jax.Array`s, one tensor at
a time, into `param_dtype`.

Layout. GGUF keeps every 2-D weight as torch's `nn.Linear` does, (d_out, d_in) in numpy order,
quantised in blocks along d_in: each row is whole blocks. pdctl's site weights are (d_in, d_out),
so a device's shard [in_slice, out_slice] is read as the rows `out_slice` (only those rows are
dequantised), then columns `in_slice`, transposed. Embeddings are (vocab, d) in both. llama.cpp's
converter interleaves the two rotary halves of every Llama Q and K head (its `permute`); reading
them undoes that with a row index, as transformers' GGUF loader does (Qwen2 and Qwen3 heads are
stored unpermuted). GPT-2's fused QKV and MLP weights were transposed by the converter into the
same (d_out, d_in) rows as everything else. Qwen3's per-head q/k RMSNorm weights are
`blk.N.attn_q_norm` / `blk.N.attn_k_norm`.
"""

from __future__ import annotations

import dataclasses
import functools
import mmap
import struct
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np

from pdctl.errors import PdctlError
from pdctl.science.targets.base import flatten, unflatten
from pdctl.science.targets.hf import (
    GPT2,
    LLAMA,
    QWEN2,
    QWEN3,
    HFCausalLM,
    HfSpec,
    config_value,
    gpt2_spec,
    llama_spec,
)

SUFFIX = ".gguf"
ARCHITECTURES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "gpt2": GPT2}
# Known GGUF architectures refused by name, with what they need that pdctl lacks.
UNSUPPORTED = {
    "qwen3moe": "Qwen3 mixture-of-experts (sparse MoE MLP blocks)",
    "qwen2moe": "Qwen2 mixture-of-experts (sparse MoE MLP blocks)",
}


def _err(msg: str) -> PdctlError:
    return PdctlError(f"target.path: {msg}")


def find_gguf(path: str | Path) -> Path | None:
    """The GGUF file `path` names: the file itself, or the one `.gguf` in a directory that holds
    no Hugging Face checkpoint (config.json + safetensors win); None when it is neither."""
    p = Path(path).expanduser()
    if p.is_file() and p.suffix.lower() == SUFFIX:
        return p.resolve()
    if not p.is_dir() or (p / "config.json").is_file():
        return None
    found = sorted(q for q in p.iterdir() if q.suffix.lower() == SUFFIX and q.is_file())
    if len(found) > 1:
        names = ", ".join(q.name for q in found[:4])
        raise _err(f"{p} holds {len(found)} .gguf files ({names}); name one of them in path")
    return found[0].resolve() if found else None


def _spec_key(key: str) -> bool:
    """The metadata `gguf_spec` reads (every `<arch>.*` key: any prefix but the big ones)."""
    return not key.startswith("tokenizer.ggml.") or key == "tokenizer.ggml.eos_token_id"


@dataclasses.dataclass(frozen=True)
class IndexedTensor:
    """One tensor of a GGUF file as `GGUFIndex` reads it: what `gguf.ReaderTensor` gives (name,
    type, shape in GGUF order, bytes) with `data` mapped on first use, as the reader maps it."""

    name: str
    tensor_type: Any  # gguf.GGMLQuantizationType
    shape: tuple[int, ...]
    n_elements: int
    n_bytes: int
    data_offset: int
    blob: Any = dataclasses.field(repr=False, compare=False)

    @property
    def data(self) -> np.ndarray:
        from gguf import GGMLQuantizationType as Q
        from gguf.quants import quant_shape_to_byte_shape

        typed = {Q.F16: np.float16, Q.F32: np.float32, Q.F64: np.float64, Q.I8: np.int8,
                 Q.I16: np.int16, Q.I32: np.int32, Q.I64: np.int64}  # fmt: skip
        dims = tuple(reversed(self.shape))
        raw = self.blob[self.data_offset : self.data_offset + self.n_bytes]
        if self.tensor_type in typed:
            return raw.view(typed[self.tensor_type]).reshape(dims)
        return raw.reshape(quant_shape_to_byte_shape(dims, self.tensor_type))


class GGUFIndex:
    """A GGUF file's model metadata and tensor table, read without decoding the tokenizer's
    vocabulary and merges (~100k strings in SmolLM2's file), which `gguf.GGUFReader` turns into
    Python objects: 2.3-5 s a process, against ~0.1 s here. `fields` {key: value} holds every
    key but `tokenizer.ggml.*` (the EOS id excepted); `tensors` as `GGUFReader.tensors`."""

    def __init__(self, path: str):
        from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

        from pdctl.science.gguf_tokenizer import _GGUFScan

        with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as head:
            scan = _GGUFScan(head, Path(path), wanted=_spec_key)
            raw = scan.fields()
            if scan.order != "<":
                raise ValueError("a big-endian GGUF file")  # rare: the reader handles it
            self.fields = {k: v for k, (_, v) in raw.items()}
            align = int(self.fields.get("general.alignment", 32))
            if align <= 0 or align & (align - 1):
                raise ValueError(f"general.alignment {align} is not a power of two")
            pos, infos = scan.end, []
            for _ in range(scan.n_tensors):
                name, pos = scan._string(pos)
                (n_dims,) = scan._u32(pos)
                scan._need(pos + 4, 8 * n_dims + 12)
                dims = tuple(struct.unpack_from(f"<{n_dims}Q", head, pos + 4))
                pos += 4 + 8 * n_dims
                kind, offset = struct.unpack_from("<IQ", head, pos)
                pos += 12
                infos.append((name, dims, kind, offset))
        blob = np.memmap(path, mode="r")
        start = -(-pos // align) * align
        tensors, seen = [], set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"tensor {name!r} appears twice")
            seen.add(name)
            qtype = GGMLQuantizationType(kind)
            block, size = GGML_QUANT_SIZES[qtype]
            n = int(np.prod(dims))
            n_bytes, at = n * size // block, start + offset
            if at + n_bytes > len(blob):
                raise ValueError(f"tensor {name!r} runs past the end of the file")
            tensors.append(IndexedTensor(name, qtype, dims, n, n_bytes, at, blob))
        self.tensors = tensors


@functools.lru_cache(maxsize=4)
def _reader(path: str, mtime_ns: int, size: int) -> Any:
    try:
        return GGUFIndex(path)
    except Exception:  # anything unusual: the gguf package's reader, and its errors
        pass
    import gguf

    try:
        r = gguf.GGUFReader(path, "r")
    except (ValueError, OSError, IndexError, KeyError) as e:  # the reader's own parse errors
        line = str(e).strip().splitlines()[0][:160] if str(e).strip() else type(e).__name__
        raise _err(f"{path} is not a readable GGUF file ({line})") from None
    # `fields` as {key: value}, as `GGUFIndex` has them (the stubs type it {key: ReaderField})
    r.fields = {k: f.contents() for k, f in r.fields.items() if _spec_key(k)}  # type: ignore[assignment]
    return r


def reader(path: str | Path) -> Any:
    """A (cached) index of `path` (`GGUFIndex`, or a `gguf.GGUFReader` where the index does
    not read the file), `fields` as {key: value}; parse errors are one line."""
    p = Path(path)
    st = p.stat()
    return _reader(str(p), st.st_mtime_ns, st.st_size)


def _field(r: Any, key: str, default: Any = ..., path: Path | None = None) -> Any:
    if key not in r.fields:
        if default is ...:
            raise _err(f"{path or 'the GGUF file'}: no {key!r} in its metadata")
        return default
    v = r.fields[key]
    return v.item() if isinstance(v, np.generic) else v


def gguf_spec(path: Path) -> HfSpec:
    """The HfSpec of the GGUF at `path`, from `general.architecture` and its `<arch>.*` keys;
    an architecture or feature pdctl lacks is a one-line error naming what is supported."""
    r = reader(path)
    arch = _field(r, "general.architecture", None)
    if isinstance(arch, str) and arch in UNSUPPORTED:
        raise _err(f"{path}: GGUF architecture {arch!r} is not supported: {UNSUPPORTED[arch]} "
                   f"(supported: {', '.join(ARCHITECTURES)})")  # fmt: skip
    if not isinstance(arch, str) or arch not in ARCHITECTURES:
        raise _err(
            f"{path}: GGUF architecture {arch!r} is not supported "
            f"(supported: {', '.join(ARCHITECTURES)})"
        )
    names = {t.name: t for t in r.tensors}
    if "token_embd.weight" not in names:
        raise _err(f"{path}: no token_embd.weight tensor (is it a {arch} model?)")

    def get(key: str, typ: type, default: Any = ...) -> Any:
        """`<arch>.key` of type `typ` (a file's metadata may hold any type under any key: a
        string for a number, an array for a size); one line naming it otherwise."""
        name = f"{arch}.{key}"
        v = _field(r, name, default, path)
        return v if v is None or v is default else config_value({name: v}, path, name, typ)

    vocab = get("vocab_size", int, None)
    if vocab is None:  # older converters leave it out: the embedding's rows say it
        vocab = int(names["token_embd.weight"].shape[-1])
    eos = _field(r, "tokenizer.ggml.eos_token_id", None)
    cfg: dict[str, Any] = {"vocab_size": vocab, "eos_token_id": eos, "dtype": "gguf"}
    if arch == "gpt2":
        cfg.update(
            n_embd=get("embedding_length", int),
            n_layer=get("block_count", int),
            n_head=get("attention.head_count", int),
            n_inner=get("feed_forward_length", int),
            layer_norm_epsilon=get("attention.layer_norm_epsilon", float, 1e-5),
            n_positions=get("context_length", int),
            tie_word_embeddings="output.weight" not in names,
        )
        return gpt2_spec(cfg, path)
    d, n_heads = get("embedding_length", int), get("attention.head_count", int)
    cfg.update(
        hidden_size=d,
        num_hidden_layers=get("block_count", int),
        intermediate_size=get("feed_forward_length", int),
        num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", int, n_heads),
        rms_norm_eps=get("attention.layer_norm_rms_epsilon", float, 1e-6),
        rope_theta=get("rope.freq_base", float, 10000.0),
        max_position_embeddings=get("context_length", int, 2048),
        tie_word_embeddings="output.weight" not in names,
        hidden_act="silu",
    )
    key_length = get("attention.key_length", int, None)
    if key_length is not None:
        cfg["head_dim"] = key_length
    elif arch == "qwen3" and isinstance(n_heads, int) and n_heads > 0:
        # llama.cpp's default, embedding_length / head_count (Qwen3Config's would be 128)
        cfg["head_dim"] = d // n_heads
    head_dim = cfg.get("head_dim") or (d // n_heads if isinstance(n_heads, int) and n_heads else 0)
    value_length = get("attention.value_length", int, head_dim)
    if value_length != head_dim:
        raise _err(f"{path}: attention.value_length {value_length} != head_dim {head_dim} "
                   "(value heads of another size than key heads are not supported)")  # fmt: skip
    rot = get("rope.dimension_count", int, head_dim)
    if rot != head_dim:
        raise _err(f"{path}: rope.dimension_count {rot} != head_dim {head_dim} (partial "
                   "rotary embeddings are not supported)")  # fmt: skip
    if "rope_freqs.weight" in names:
        raise _err(f"{path}: per-frequency RoPE factors (rope_freqs.weight, Llama 3.1 style) "
                   "are not supported; use the Hugging Face directory of this model")  # fmt: skip
    scaling = get("rope.scaling.type", str, None)
    if scaling not in (None, "none", "linear"):
        raise _err(f"{path}: rope scaling {scaling!r} is not supported (supported: linear)")
    if scaling == "linear":
        cfg["rope_scaling"] = {"rope_type": "linear", "factor": get("rope.scaling.factor", float)}
    if arch in ("llama", "qwen3"):
        cfg["attention_bias"] = "blk.0.attn_q.bias" in names
    if arch == "llama":
        cfg["mlp_bias"] = "blk.0.ffn_up.bias" in names
    return llama_spec(cfg, path, ARCHITECTURES[arch])


# ---- tensors ------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Planned:
    """One params leaf's source: GGUF tensor `name` of numpy shape `stored` (rows, cols), read
    transposed into the leaf when `transposed`, its rows reordered by `rope_heads` heads when set
    (llama.cpp's Q/K permutation)."""

    name: str
    stored: tuple[int, ...]
    transposed: bool
    rope_heads: int = 0


def _gguf_name(spec: HfSpec, path: str) -> str:
    parts = path.split(".")
    if spec.is_gpt2:
        top = {
            "transformer.wte.weight": "token_embd.weight",
            "transformer.wpe.weight": "position_embd.weight",
            "transformer.ln_f.weight": "output_norm.weight",
            "transformer.ln_f.bias": "output_norm.bias",
            "lm_head.weight": "output.weight",
        }
        if path in top:
            return top[path]
        i, module, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
        local = {
            "ln_1": "attn_norm",
            "ln_2": "ffn_norm",
            "attn.c_attn": "attn_qkv",
            "attn.c_proj": "attn_output",
            "mlp.c_fc": "ffn_up",
            "mlp.c_proj": "ffn_down",
        }[module]
        return f"blk.{i}.{local}.{leaf}"
    top = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
        "lm_head.weight": "output.weight",
    }
    if path in top:
        return top[path]
    i, module, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
    local = {
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }[module]
    return f"blk.{i}.{local}.{leaf}"


def supported_types() -> set[Any]:
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    return {Q.F32, Q.F16, *quants._type_traits}


def check_gguf(path: Path, target: HFCausalLM) -> dict[str, Planned]:
    """Per params leaf, the tensor it is read from, after checking that every tensor is there
    with the shape the metadata implies and a type that `gguf.quants` dequantises."""
    r = reader(path)
    tensors = {t.name: t for t in r.tensors}
    spec, sites = target.spec, set(target.site_shapes())
    ok_types = supported_types()
    plan = {}
    for leaf, shape in target.param_shapes().items():
        name = _gguf_name(spec, leaf)
        t = tensors.get(name)
        if t is None:
            raise _err(f"{path}: tensor {name!r} (for {leaf}, shape {shape}) is not in the file")
        module = leaf.rsplit(".", 1)[0]
        transposed = module in sites and leaf.endswith(".weight")
        want = tuple(shape[::-1]) if transposed else tuple(shape)
        stored = tuple(int(n) for n in t.shape[::-1])
        if stored != want:
            raise _err(f"{path}: tensor {name!r} has shape {stored}, but the metadata implies "
                       f"{want} (for {leaf})")  # fmt: skip
        if t.tensor_type not in ok_types:
            names = ", ".join(sorted(q.name for q in ok_types))
            raise _err(f"{path}: tensor {name!r} has type {t.tensor_type.name}, which "
                       f"gguf.quants cannot dequantise (supported: {names})")  # fmt: skip
        heads = 0
        if spec.architecture == LLAMA and module.endswith(("q_proj", "k_proj")):
            heads = spec.n_heads if module.endswith("q_proj") else spec.n_kv_heads
        plan[leaf] = Planned(name, stored, transposed, heads)
    return plan


def _hf_rows(n: int, heads: int) -> np.ndarray:
    """For each row of the Hugging Face Q/K weight, the GGUF row it is: llama.cpp stored each
    head's rows as (dim, 2) interleaved pairs, transformers keeps the (2, dim) rotary halves."""
    return np.arange(n).reshape(heads, n // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _rows(t: Any, rows: np.ndarray) -> np.ndarray:
    """Rows `rows` of tensor `t` as float32 (rows, cols), dequantising only those rows."""
    from gguf import GGMLQuantizationType as Q
    from gguf import quants

    data = np.asarray(t.data)
    if data.ndim == 1 or len(t.shape) == 1:  # a vector: norms and biases, small
        full = quants.dequantize(data, t.tensor_type) if t.tensor_type != Q.F32 else data
        return np.asarray(full, dtype=np.float32).reshape(-1)[rows]
    picked = data[rows]
    if t.tensor_type in (Q.F32, Q.F16):
        return picked.astype(np.float32)
    return quants.dequantize(picked, t.tensor_type).astype(np.float32, copy=False)


def load_gguf_params(
    path: Path, target: HFCausalLM, shardings: Any, dtype: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The target's params read and dequantised from the GGUF at `path`, each leaf placed with
    its sharding (`shardings` has the params' structure). Only the rows a process's devices
    hold are dequantised, once per tensor and row range. Returns (params, info)."""
    t0 = time.perf_counter()
    dtype = np.dtype(target.param_dtype if dtype is None else dtype)
    plan = check_gguf(path, target)
    tensors = {t.name: t for t in reader(path).tensors}
    flat_sh = flatten(shardings)
    leaves, nbytes = {}, 0
    for leaf, p in plan.items():
        t = tensors[p.name]
        nbytes += int(t.n_bytes)
        n_rows = p.stored[0]
        order = _hf_rows(n_rows, p.rope_heads) if p.rope_heads else np.arange(n_rows)

        @functools.lru_cache(maxsize=8)
        def rows_of(start: int, stop: int, t=t, order=order) -> np.ndarray:
            return _rows(t, order[start:stop])

        def read(index: tuple[slice, ...], p=p, rows_of=rows_of, n_rows=n_rows) -> np.ndarray:
            if len(p.stored) == 1:
                return rows_of(*index[0].indices(n_rows)[:2]).astype(dtype)
            if p.transposed:  # leaf (d_in, d_out)[a, b] = stored (d_out, d_in)[b, a]
                row_sl, col_sl = index[1], index[0]
            else:
                row_sl, col_sl = index[0], index[1]
            block = rows_of(*row_sl.indices(n_rows)[:2])[:, col_sl]
            return (block.T if p.transposed else block).astype(dtype, order="C")

        shape = p.stored[::-1] if p.transposed else p.stored
        # jax types the callback's index `Index | None`, but asserts it is not None before calling
        leaves[leaf] = jax.make_array_from_callback(shape, flat_sh[leaf], read, dtype)  # type: ignore[arg-type]
    info = {
        "source": str(path),
        "tensors": len(plan),
        "bytes": nbytes,
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    return unflatten({p: leaves[p] for p in target.param_shapes()}), info
