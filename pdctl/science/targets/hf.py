"""Hugging Face causal LMs (Llama, Qwen2, GPT-2) as pdctl targets, read from a local directory.

`read_hf_config` turns a model directory's `config.json` into an `HfSpec` (everything the forward
needs, hashable); `HFCausalLM` is the forward pass over a params pytree whose nested dict keys are
the Hugging Face module names, so a leaf's dotted path is the name of its tensor in the
checkpoint (`model.layers.3.mlp.down_proj.weight`). Site paths are the module paths of every
attention and MLP projection. Site weights are stored as (d_in, d_out) for `y = x @ W (+ b)`:
torch `nn.Linear` weights are transposed on load, GPT-2's `Conv1D` weights already are (d_in,
d_out). Everything else keeps its checkpoint layout (embeddings and `lm_head` are (vocab, d)).
The weights themselves are read by `pdctl.science.targets.hf_load`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from pdctl.errors import PdctlError
from pdctl.science.arrays import expand_left
from pdctl.science.spd.grouped import members, per_site_views, sites_of
from pdctl.science.targets.base import (
    Overrides,
    Params,
    Residual,
    SiteDataFn,
    SiteFn,
    Target,
    add_bias,
    normal_init,
)
from pdctl.science.targets.llama_mlp import REMAT_POLICIES

LLAMA, QWEN2, GPT2 = "LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"
SUPPORTED = (LLAMA, QWEN2, GPT2)
_BY_MODEL_TYPE = {"llama": LLAMA, "qwen2": QWEN2, "gpt2": GPT2}
# Activation names as transformers' ACT2FN spells them.
ACTIVATIONS = ("silu", "swish", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")
ROPE_TYPES = ("default", "linear", "llama3")
WEIGHTS_HELP = "model.safetensors, or *.safetensors with model.safetensors.index.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class HfSpec:
    """What the forward pass needs from `config.json`; tuples only, so a target stays hashable."""

    architecture: str  # one of SUPPORTED
    config_path: str  # the config.json it was read from (for messages)
    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int  # < n_heads: grouped-query attention
    head_dim: int
    d_mlp: int
    act: str  # one of ACTIVATIONS
    norm_eps: float
    tie_word_embeddings: bool
    # GPT-2: size of the learned position table; Llama / Qwen2: max_position_embeddings, the
    # context it was trained for. data.seq_len may not exceed it.
    max_positions: int
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    rope_theta: float = 10000.0
    # (rope_type, factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_scaling: tuple[str, float, float, float, int] = ("default", 1.0, 1.0, 1.0, 0)
    attn_scale_weights: bool = True  # GPT-2 scale_attn_weights
    attn_scale_by_layer: bool = False  # GPT-2 scale_attn_by_inverse_layer_idx
    checkpoint_dtype: str | None = None  # config's torch_dtype / dtype, informational
    eos_token_ids: tuple[int, ...] = ()

    @property
    def is_gpt2(self) -> bool:
        return self.architecture == GPT2


def _err(msg: str) -> PdctlError:
    return PdctlError(f"target.path: {msg}")


def has_weights(model_dir: Path) -> bool:
    return (model_dir / "model.safetensors").is_file() or any(model_dir.glob("*.safetensors"))


def read_hf_config(model_dir: str | Path, need_weights: bool = True) -> HfSpec:
    """The spec of the model in `model_dir`; a missing file or an unsupported model or feature
    is a one-line PdctlError naming what was found and what is supported. Without
    `need_weights` a directory holding only config.json is enough."""
    d = Path(model_dir).expanduser()
    if not d.is_dir():
        raise _err(f"{d} is not a directory (expected a Hugging Face model directory)")
    path = d / "config.json"
    if not path.is_file():
        raise _err(f"no config.json in {d} (expected config.json and {WEIGHTS_HELP})")
    if need_weights and not has_weights(d):
        raise _err(f"no weights in {d} (expected {WEIGHTS_HELP})")
    try:
        cfg = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise _err(f"{path} is not valid JSON: {str(e).splitlines()[0]}") from None
    if not isinstance(cfg, dict):
        raise _err(f"{path} is not a JSON object")
    archs = cfg.get("architectures") or []
    model_type = cfg.get("model_type")
    if not archs and isinstance(model_type, str) and model_type in _BY_MODEL_TYPE:
        archs = [_BY_MODEL_TYPE[model_type]]
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    if not isinstance(arch, str) or arch not in SUPPORTED:
        found = f"architecture {arch!r}" if arch else "no 'architectures'"
        raise _err(f"{found} in {path} is not supported (supported: {', '.join(SUPPORTED)})")
    return _gpt2_spec(cfg, path) if arch == GPT2 else _llama_spec(cfg, path, arch)


# The largest size a config may give (a JAX dimension is an int32 on some backends): a value
# above it is a corrupt or mistyped config, not a model.
MAX_SIZE = 2**31 - 1


def _get(cfg: Mapping[str, Any], path: Path | str, key: str, typ: type, default: Any = ...) -> Any:
    """`cfg[key]` of type `typ` (an int is a float too; numpy scalars, as GGUF metadata gives
    them, count as Python ones); missing or null is `default`, or an error without one."""
    if key not in cfg or cfg[key] is None:
        if default is ...:
            raise _err(f"{path} has no {key!r}")
        return default
    v = cfg[key]
    if isinstance(v, bool | np.bool_):
        ok = typ is bool
        v = bool(v)
    elif isinstance(v, numbers.Integral) and typ in (int, float):
        v, ok = int(v), True
        if typ is float:
            try:
                v = float(v)
            except OverflowError:
                ok = False
    elif isinstance(v, numbers.Real) and typ is float:
        v, ok = float(v), True
    else:
        ok = isinstance(v, typ)
    if not ok:
        what = _TYPE_NAMES.get(typ, typ.__name__)
        raise _err(f"{path}: {key!r} must be {what}, got {_shown(cfg[key])}")
    return v


_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string"}


def _shown(v: Any) -> str:
    """A value for a one-line message: its repr, cut short."""
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _size(
    cfg: Mapping[str, Any], path: Path | str, key: str, default: Any = ..., least: int = 1
) -> int:
    """An integer size in [least, MAX_SIZE] (a count of heads, layers, a width, ...)."""
    v = _get(cfg, path, key, int, default)
    if not least <= v <= MAX_SIZE:
        raise _err(f"{path}: {key!r} must be an integer in [{least}, {MAX_SIZE}], got {_shown(v)}")
    return v


def _number(
    cfg: Mapping[str, Any], path: Path | str, key: str, default: Any = ..., *, zero: bool = False
) -> float:
    """A finite number > 0 (>= 0 with `zero`)."""
    v = _get(cfg, path, key, float, default)
    if not math.isfinite(v) or v < 0 or (v == 0 and not zero):
        raise _err(f"{path}: {key!r} must be a finite number {'>=' if zero else '>'} 0, got {v!r}")
    return v


def _common(cfg: Mapping[str, Any], path: Path) -> dict[str, Any]:
    dtype = cfg.get("torch_dtype") or cfg.get("dtype")
    eos = cfg.get("eos_token_id")
    eos_ids = [] if eos is None else list(eos) if isinstance(eos, list | tuple) else [eos]
    # Types only: transformers keeps ids beyond vocab_size too (GPT2Config's default 50256 in a
    # smaller vocabulary), and data.eos_id is what pdctl puts between documents.
    if any(isinstance(i, bool | np.bool_) or not isinstance(i, numbers.Integral) for i in eos_ids):
        raise _err(
            f"{path}: 'eos_token_id' must be an integer or a list of them, got {_shown(eos)}"
        )
    return {
        "config_path": str(path),
        "checkpoint_dtype": dtype if isinstance(dtype, str) else None,
        "eos_token_ids": tuple(int(i) for i in eos_ids),
    }


def _activation(cfg: Mapping[str, Any], path: Path, key: str, default: str) -> str:
    act = _get(cfg, path, key, str, default)
    if act not in ACTIVATIONS:
        raise _err(
            f"{key} {act!r} in {path} is not supported (supported: {', '.join(ACTIVATIONS)})"
        )
    return act


def _rope(cfg: Mapping[str, Any], path: Path) -> tuple[float, tuple[str, float, float, float, int]]:
    """rope_theta and scaling from either layout: transformers 5 (`rope_parameters`) or 4
    (top-level `rope_theta` plus `rope_scaling`)."""
    params = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    if not isinstance(params, Mapping):
        raise _err(f"{path}: rope_parameters must be an object, got {params!r}")
    # A key in rope_parameters wins over the top-level one (transformers 5 moved them there).
    merged = {**cfg, **params}
    theta = _number(merged, path, "rope_theta", 10000.0)
    kind = params.get("rope_type", params.get("type", "default"))
    if not isinstance(kind, str) or kind not in ROPE_TYPES:
        raise _err(
            f"rope scaling {kind!r} in {path} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    if _get(merged, path, "partial_rotary_factor", float, 1.0) != 1.0:
        raise _err(f"partial_rotary_factor in {path} is not supported (supported: 1.0)")
    if kind == "default":
        return theta, ("default", 1.0, 1.0, 1.0, 0)
    where = f"{path} (rope scaling {kind!r})"
    factor = _number(params, where, "factor")
    if kind == "linear":
        return theta, ("linear", factor, 1.0, 1.0, 0)
    low = _number(params, where, "low_freq_factor")
    high = _number(params, where, "high_freq_factor")
    if high <= low:
        raise _err(
            f"{where}: 'high_freq_factor' {high} must be greater than 'low_freq_factor' {low}"
        )
    orig = _size(params, where, "original_max_position_embeddings")
    return theta, ("llama3", factor, low, high, orig)


def _llama_spec(cfg: Mapping[str, Any], path: Path, arch: str) -> HfSpec:
    """The spec of a Llama or Qwen2 config (transformers' key names; `cfg` may be any mapping,
    such as one built from a GGUF file's metadata). Every size is checked for type and range,
    and the head layout as transformers builds it: Llama needs hidden_size to be a multiple of
    num_attention_heads (LlamaConfig refuses it otherwise), both need num_attention_heads to be
    a multiple of num_key_value_heads, and head_dim (default hidden_size // num_attention_heads)
    even for RoPE."""
    d = _size(cfg, path, "hidden_size")
    n_heads = _size(cfg, path, "num_attention_heads")
    n_kv = _size(cfg, path, "num_key_value_heads", n_heads)
    if arch == LLAMA and d % n_heads:
        raise _err(f"{path}: hidden_size {d} is not a multiple of num_attention_heads {n_heads}")
    if d // n_heads < 1 and cfg.get("head_dim") is None:
        raise _err(f"{path}: hidden_size {d} is smaller than num_attention_heads {n_heads}")
    head_dim = _size(cfg, path, "head_dim", d // n_heads)
    n_layers = _size(cfg, path, "num_hidden_layers")
    vocab = _size(cfg, path, "vocab_size")
    if n_heads % n_kv:
        raise _err(f"{path}: num_attention_heads {n_heads} is not a multiple of "
                   f"num_key_value_heads {n_kv}")  # fmt: skip
    if head_dim % 2:
        raise _err(f"{path}: head_dim {head_dim} is odd (RoPE rotates pairs of dimensions)")
    if arch == QWEN2:
        # absent is Qwen2Config's default; null is refused, as Qwen2Config refuses it
        for key, what in (("use_sliding_window", bool), ("max_window_layers", int)):
            if key in cfg and cfg[key] is None:
                raise _err(f"{path}: {key!r} must be {_TYPE_NAMES[what]}, got null")
        types = cfg.get("layer_types")
        if types is not None:
            if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
                raise _err(f"{path}: 'layer_types' must be a list of strings, got {types!r}")
            sliding = "sliding_attention" in types
        else:
            # as Qwen2Config: layer i slides when use_sliding_window, a sliding_window is set
            # and i >= max_window_layers (default 28)
            use = _get(cfg, path, "use_sliding_window", bool, False)
            window = _get(cfg, path, "sliding_window", int, None)
            first = _size(cfg, path, "max_window_layers", 28, least=0)
            sliding = use and window is not None and first < n_layers
        if sliding:
            raise _err(
                f"sliding-window attention in {path} is not supported (supported: full "
                "attention in every layer, use_sliding_window = false)"
            )
        biases = {"qkv_bias": True, "o_bias": False, "mlp_bias": False}
    else:
        attn_bias = _get(cfg, path, "attention_bias", bool, False)
        biases = {
            "qkv_bias": attn_bias,
            "o_bias": attn_bias,
            "mlp_bias": _get(cfg, path, "mlp_bias", bool, False),
        }
    theta, scaling = _rope(cfg, path)
    return HfSpec(
        architecture=arch,
        vocab_size=vocab,
        d_model=d,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=n_kv,
        head_dim=head_dim,
        d_mlp=_size(cfg, path, "intermediate_size"),
        act=_activation(cfg, path, "hidden_act", "silu"),
        norm_eps=_number(cfg, path, "rms_norm_eps", 1e-6, zero=True),
        tie_word_embeddings=_get(cfg, path, "tie_word_embeddings", bool, False),
        # transformers' defaults: LlamaConfig 2048, Qwen2Config 32768
        max_positions=_size(cfg, path, "max_position_embeddings", 32768 if arch == QWEN2 else 2048),
        rope_theta=theta,
        rope_scaling=scaling,
        **biases,
        **_common(cfg, path),
    )


def _gpt2_spec(cfg: Mapping[str, Any], path: Path) -> HfSpec:
    """The spec of a GPT-2 config (transformers' key names, or any mapping with them); n_embd
    must be a multiple of n_head, as GPT2Attention requires."""
    d = _size(cfg, path, "n_embd")
    n_heads = _size(cfg, path, "n_head")
    if d % n_heads:
        raise _err(f"{path}: n_embd {d} is not a multiple of n_head {n_heads}")
    if _get(cfg, path, "add_cross_attention", bool, False):
        raise _err(f"add_cross_attention in {path} is not supported (supported: false)")
    vocab = _size(cfg, path, "vocab_size")
    return HfSpec(
        architecture=GPT2,
        vocab_size=vocab,
        d_model=d,
        n_layers=_size(cfg, path, "n_layer"),
        n_heads=n_heads,
        n_kv_heads=n_heads,
        head_dim=d // n_heads,
        d_mlp=_size(cfg, path, "n_inner", 4 * d),
        act=_activation(cfg, path, "activation_function", "gelu_new"),
        norm_eps=_number(cfg, path, "layer_norm_epsilon", 1e-5, zero=True),
        tie_word_embeddings=_get(cfg, path, "tie_word_embeddings", bool, True),
        max_positions=_size(cfg, path, "n_positions", 1024),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        attn_scale_weights=_get(cfg, path, "scale_attn_weights", bool, True),
        attn_scale_by_layer=_get(cfg, path, "scale_attn_by_inverse_layer_idx", bool, False),
        **_common(cfg, path),
    )


def _act(name: str, x: jax.Array) -> jax.Array:
    if name in ("silu", "swish"):
        return jax.nn.silu(x)
    if name == "gelu":
        return jax.nn.gelu(x, approximate=False)
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return jax.nn.gelu(x, approximate=True)
    return jax.nn.relu(x)


@dataclasses.dataclass(frozen=True)
class Tensor:
    """Where one params leaf comes from: the checkpoint tensor `name` of `stored_shape`, which
    is the leaf transposed when `transposed` (torch nn.Linear keeps weights as (d_out, d_in))."""

    name: str
    stored_shape: tuple[int, ...]
    transposed: bool


@dataclasses.dataclass(frozen=True, kw_only=True)
class HFCausalLM(Target):
    """A Hugging Face causal LM. Sites, per layer in forward order:
    Llama / Qwen2: `model.layers.{i}.self_attn.{q,k,v,o}_proj`, `model.layers.{i}.mlp.{gate,up,
    down}_proj`; GPT-2: `transformer.h.{i}.attn.c_attn` (fused q|k|v), `transformer.h.{i}.attn.
    c_proj`, `transformer.h.{i}.mlp.c_fc`, `transformer.h.{i}.mlp.c_proj`. The site's matrix is
    the leaf `<site>.weight`, its bias (if any) `<site>.bias`, added after the site output.
    """

    kind = "hf"
    output_kind = "logits"

    spec: HfSpec
    seq_len: int = 128
    param_dtype: Any = jnp.float32
    remat: str = "none"  # none | dots_saveable | full: rematerialise each block in the backward
    # `apply_sites` runs the blocks as a scan over layers (`[train] scan_layers`)
    scan_layers: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "param_dtype", jnp.dtype(self.param_dtype))
        if self.remat not in ("none", *REMAT_POLICIES):
            raise ValueError(f"remat must be one of none, {', '.join(REMAT_POLICIES)}")
        s = self.spec
        if self.seq_len > s.max_positions:
            if s.is_gpt2:
                what = f"{s.max_positions} learned positions (n_positions) of the GPT-2 model"
            else:
                what = (
                    f"{s.max_positions} positions (max_position_embeddings) that the "
                    f"{s.architecture} model was trained for"
                )
            raise PdctlError(f"data.seq_len: {self.seq_len} exceeds the {what} in {s.config_path}")

    @classmethod
    def from_dir(cls, model_dir: str | Path, **kwargs: Any) -> HFCausalLM:
        return cls(spec=read_hf_config(model_dir), **kwargs)

    # Layout.

    def _prefix(self) -> str:
        return "transformer.h" if self.spec.is_gpt2 else "model.layers"

    def _layer_sites(self) -> list[tuple[str, tuple[int, int], bool]]:
        """(name within the layer, (d_in, d_out), has bias) in forward order."""
        s = self.spec
        d, m = s.d_model, s.d_mlp
        if s.is_gpt2:
            return [
                ("attn.c_attn", (d, 3 * d), True),
                ("attn.c_proj", (d, d), True),
                ("mlp.c_fc", (d, m), True),
                ("mlp.c_proj", (m, d), True),
            ]
        q, kv = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        return [
            ("self_attn.q_proj", (d, q), s.qkv_bias),
            ("self_attn.k_proj", (d, kv), s.qkv_bias),
            ("self_attn.v_proj", (d, kv), s.qkv_bias),
            ("self_attn.o_proj", (q, d), s.o_bias),
            ("mlp.gate_proj", (d, m), s.mlp_bias),
            ("mlp.up_proj", (d, m), s.mlp_bias),
            ("mlp.down_proj", (m, d), s.mlp_bias),
        ]

    def site_shapes(self) -> dict[str, tuple[int, int]]:
        return {
            f"{self._prefix()}.{i}.{name}": shape
            for i in range(self.spec.n_layers)
            for name, shape, _ in self._layer_sites()
        }

    def site_weights(self, params: Params) -> dict[str, jax.Array]:
        return {path: _node(params, path)["weight"] for path in self.site_shapes()}

    def mlp_neuron_sides(self) -> dict[str, str]:
        side = {"mlp.gate_proj": "out", "mlp.up_proj": "out", "mlp.down_proj": "in",
                "mlp.c_fc": "out", "mlp.c_proj": "in"}  # fmt: skip
        return {
            f"{self._prefix()}.{i}.{name}": side[name]
            for i in range(self.spec.n_layers)
            for name, _, _ in self._layer_sites()
            if name in side
        }

    def tp_divisors(self) -> dict[str, int]:
        """Column-parallel q/k/v (or c_attn) split heads, gate/up (c_fc) the MLP width, over
        tp devices (`engine.sharding.COLUMN_SITES`)."""
        s = self.spec
        if s.is_gpt2:
            return {"n_head": s.n_heads, "n_inner": s.d_mlp}
        return {
            "num_attention_heads": s.n_heads,
            "num_key_value_heads": s.n_kv_heads,
            "intermediate_size": s.d_mlp,
        }

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Dotted leaf path (= checkpoint tensor name) -> shape as pdctl stores it."""
        s = self.spec
        d, V = s.d_model, s.vocab_size
        shapes: dict[str, tuple[int, ...]] = {}
        if s.is_gpt2:
            shapes["transformer.wte.weight"] = (V, d)
            shapes["transformer.wpe.weight"] = (s.max_positions, d)
            norms, final = ("ln_1", "ln_2"), "transformer.ln_f"
        else:
            shapes["model.embed_tokens.weight"] = (V, d)
            norms, final = ("input_layernorm", "post_attention_layernorm"), "model.norm"
        for i in range(s.n_layers):
            layer = f"{self._prefix()}.{i}"
            for norm in norms:
                shapes[f"{layer}.{norm}.weight"] = (d,)
                if s.is_gpt2:
                    shapes[f"{layer}.{norm}.bias"] = (d,)
            for name, (a, b), bias in self._layer_sites():
                shapes[f"{layer}.{name}.weight"] = (a, b)
                if bias:
                    shapes[f"{layer}.{name}.bias"] = (b,)
        shapes[f"{final}.weight"] = (d,)
        if s.is_gpt2:
            shapes[f"{final}.bias"] = (d,)
        if not s.tie_word_embeddings:
            shapes["lm_head.weight"] = (V, d)
        return shapes

    def checkpoint_layout(self) -> dict[str, Tensor]:
        """Dotted leaf path -> the checkpoint tensor it is read from."""
        sites = set(self.site_shapes())
        out = {}
        for path, shape in self.param_shapes().items():
            # nn.Linear stores (d_out, d_in); GPT-2's Conv1D already stores (d_in, d_out).
            transposed = not self.spec.is_gpt2 and path.endswith(".weight") and path[:-7] in sites
            out[path] = Tensor(path, shape[::-1] if transposed else shape, transposed)
        return out

    # Init.

    def init(self, key: jax.Array) -> Params:
        """N(0, 0.02) matrices, zero biases, unit norm scales (for shapes, tests and toy runs;
        real weights come from `hf_load`). Same-shaped matrices are drawn as one stacked array
        and sliced: one RNG body per distinct shape keeps the jitted init's compile small."""
        dt = self.param_dtype
        flat: dict[str, jax.Array] = {}
        by_shape: dict[tuple[int, ...], list[str]] = {}
        for path, shape in self.param_shapes().items():
            if len(shape) == 2:
                by_shape.setdefault(shape, []).append(path)
            elif path.endswith(".bias"):
                flat[path] = jnp.zeros(shape, dt)
            else:
                flat[path] = jnp.ones(shape, dt)
        keys = jax.random.split(key, len(by_shape))
        for (shape, group), k in zip(by_shape.items(), keys, strict=True):
            stacked = normal_init(k, (len(group), *shape), 0.02, dt)
            flat.update({path: stacked[j] for j, path in enumerate(group)})
        return unflatten({p: flat[p] for p in self.param_shapes()})

    # Forward.

    def _norm(self, x: jax.Array, p: Params) -> jax.Array:
        """RMSNorm (Llama, Qwen2) or LayerNorm (GPT-2), statistics in float32 as transformers."""
        x32 = x.astype(jnp.float32)
        eps = self.spec.norm_eps
        if self.spec.is_gpt2:
            mean = jnp.mean(x32, axis=-1, keepdims=True)
            var = jnp.mean(jnp.square(x32 - mean), axis=-1, keepdims=True)
            y = (x32 - mean) * jax.lax.rsqrt(var + eps)
            y = y * expand_left(p["weight"].astype(jnp.float32), y.ndim)
            y = y + expand_left(p["bias"].astype(jnp.float32), y.ndim)
            return y.astype(x.dtype)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
        return expand_left(p["weight"], x.ndim) * y.astype(x.dtype)

    def _inv_freq(self) -> np.ndarray:
        """RoPE inverse frequencies, float32 as transformers computes them (with llama3 or
        linear scaling applied)."""
        H, theta = self.spec.head_dim, self.spec.rope_theta
        exps = np.arange(0, H, 2, dtype=np.int64).astype(np.float32) / np.float32(H)
        inv = (1.0 / (np.float32(theta) ** exps)).astype(np.float32)
        kind, factor, low, high, orig = self.spec.rope_scaling
        if kind == "linear":
            return (inv / np.float32(factor)).astype(np.float32)
        if kind == "llama3":
            wavelen = 2 * math.pi / inv
            low_wl, high_wl = orig / low, orig / high
            scaled = np.where(wavelen > low_wl, inv / factor, inv)
            smooth = (orig / wavelen - low) / (high - low)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = (wavelen >= high_wl) & (wavelen <= low_wl)
            return np.where(medium, smoothed, scaled).astype(np.float32)
        return inv

    def _rope(self, x_BxTxNxH: jax.Array) -> jax.Array:
        T, H = x_BxTxNxH.shape[1], x_BxTxNxH.shape[3]
        angle_TxH2 = jnp.arange(T, dtype=jnp.float32)[:, None] * jnp.asarray(self._inv_freq())[None]
        cos = jnp.cos(angle_TxH2)[None, :, None, :]
        sin = jnp.sin(angle_TxH2)[None, :, None, :]
        x32 = x_BxTxNxH.astype(jnp.float32)
        x1, x2 = x32[..., : H // 2], x32[..., H // 2 :]
        rotated = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
        return rotated.astype(x_BxTxNxH.dtype)

    def _proj(self, path: str, x: jax.Array, p: Params, overrides: Overrides | None) -> jax.Array:
        h = self._site(path, x, p["weight"], overrides)
        return add_bias(h, p["bias"]) if "bias" in p else h

    def _attend(self, q_BxTxNxH, k_BxTxKxH, v_BxTxKxH, scale: float) -> jax.Array:
        """Causal softmax attention; each of the K kv heads serves N/K query heads (query head
        n uses kv head n // (N/K), as transformers' repeat_kv). Scores in float32."""
        B, T, N, H = q_BxTxNxH.shape
        K = k_BxTxKxH.shape[2]
        q_BxTxKxGxH = q_BxTxNxH.reshape(B, T, K, N // K, H)
        scores = jnp.einsum(
            "btkgh,bskh->bkgts", q_BxTxKxGxH, k_BxTxKxH, preferred_element_type=jnp.float32
        )
        scores = scores * jnp.float32(scale)
        causal_TxT = jnp.tril(jnp.ones((T, T), dtype=bool))
        scores = jnp.where(causal_TxT[None, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(v_BxTxKxH.dtype)
        out = jnp.einsum("bkgts,bskh->btkgh", probs, v_BxTxKxH)
        return out.reshape(B, T, N * H)

    def _llama_block(self, x, layer: Params, i: Any, site: SiteFn) -> jax.Array:
        """One Llama / Qwen2 block; `site(name, x_in, p)` computes the projection `name`
        (e.g. "self_attn.q_proj") of this layer from its params `p` (weight, bias)."""
        s = self.spec
        B, T, _ = x.shape
        attn, mlp = layer["self_attn"], layer["mlp"]
        h = self._norm(x, layer["input_layernorm"])

        def heads(name: str, n: int) -> jax.Array:
            out = site(f"self_attn.{name}", h, attn[name])
            return out.reshape(B, T, n, s.head_dim)

        q = self._rope(heads("q_proj", s.n_heads))
        k = self._rope(heads("k_proj", s.n_kv_heads))
        v = heads("v_proj", s.n_kv_heads)
        o = self._attend(q, k, v, s.head_dim**-0.5)
        x = x + site("self_attn.o_proj", o, attn["o_proj"])
        h = self._norm(x, layer["post_attention_layernorm"])
        gate = site("mlp.gate_proj", h, mlp["gate_proj"])
        up = site("mlp.up_proj", h, mlp["up_proj"])
        hidden = _act(s.act, gate) * up
        return x + site("mlp.down_proj", hidden, mlp["down_proj"])

    def _gpt2_block(self, x, layer: Params, i: Any, site: SiteFn) -> jax.Array:
        s = self.spec
        B, T, d = x.shape
        attn, mlp = layer["attn"], layer["mlp"]
        h = self._norm(x, layer["ln_1"])
        qkv = site("attn.c_attn", h, attn["c_attn"])
        q, k, v = (
            qkv[..., j * d : (j + 1) * d].reshape(B, T, s.n_heads, s.head_dim) for j in range(3)
        )
        scale = s.head_dim**-0.5 if s.attn_scale_weights else 1.0
        if s.attn_scale_by_layer:  # i is a Python int unrolled, a traced index under scan
            scale = scale / (float(i + 1) if isinstance(i, int) else (i + 1).astype(jnp.float32))
        o = self._attend(q, k, v, scale)
        x = x + site("attn.c_proj", o, attn["c_proj"])
        h = self._norm(x, layer["ln_2"])
        hidden = _act(s.act, site("mlp.c_fc", h, mlp["c_fc"]))
        return x + site("mlp.c_proj", hidden, mlp["c_proj"])

    def _embed(self, params: Params, tokens: jax.Array) -> tuple[jax.Array, Params, Params]:
        """(the embedded tokens, the params of the root module, its layers)."""
        s = self.spec
        n_tok = tokens.shape[1]
        if s.is_gpt2:
            if n_tok > s.max_positions:
                raise ValueError(f"{n_tok} tokens exceed GPT-2's {s.max_positions} positions")
            root = params["transformer"]
            x_BxTxD = jnp.take(root["wte"]["weight"], tokens, axis=0)
            x_BxTxD = x_BxTxD + expand_left(root["wpe"]["weight"][:n_tok], x_BxTxD.ndim)
            return x_BxTxD, root, root["h"]
        root = params["model"]
        return jnp.take(root["embed_tokens"]["weight"], tokens, axis=0), root, root["layers"]

    def _start(
        self, params: Params, tokens: jax.Array, start: Residual | None
    ) -> tuple[jax.Array, Params, Params, int]:
        """(the stream the blocks start from, the root module's params, its layers, the first
        layer to run): the embedded tokens and 0, or `start`'s stream and layer (the embedding
        is then unused, and XLA drops it)."""
        x_BxTxD, root, layers = self._embed(params, tokens)
        if start is None:
            return x_BxTxD, root, layers, 0
        return start.x, root, layers, start.layer

    def _unembed(self, params: Params, root: Params, x_BxTxD: jax.Array) -> jax.Array:
        s = self.spec
        h = self._norm(x_BxTxD, root["ln_f" if s.is_gpt2 else "norm"])
        if s.tie_word_embeddings:
            unembed_VxD = root["wte" if s.is_gpt2 else "embed_tokens"]["weight"]
        else:
            unembed_VxD = params["lm_head"]["weight"]
        return jnp.einsum("btd,vd->btv", h, unembed_VxD, preferred_element_type=jnp.float32)

    def _block_fn(self):
        return self._gpt2_block if self.spec.is_gpt2 else self._llama_block

    def _remat(self, fn):
        if self.remat == "none":
            return fn
        return jax.checkpoint(fn, policy=REMAT_POLICIES[self.remat])

    def apply(
        self,
        params: Params,
        tokens: jax.Array,
        overrides: Overrides | None = None,
        residual: Residual | None = None,
        start: Residual | None = None,
    ) -> jax.Array:
        """tokens (B, T) int -> logits (B, T, vocab) float32, the blocks unrolled (one copy of
        the block per layer in the program; `apply_sites` scans them). `residual` / `start`:
        the stream entering a layer, filled in / started from (`base.Residual`)."""
        x_BxTxD, root, layers, first = self._start(params, tokens, start)
        block_fn = self._block_fn()
        for i in range(first, self.spec.n_layers):
            if residual is not None and i == residual.layer:
                residual.x = x_BxTxD
            pre = f"{self._prefix()}.{i}"

            def block(x, layer, i=i, pre=pre):
                def site(name, x_in, p):
                    return self._proj(f"{pre}.{name}", x_in, p, overrides)

                return block_fn(x, layer, i, site)

            x_BxTxD = self._remat(block)(x_BxTxD, layers[str(i)])
        return self._unembed(params, root, x_BxTxD)

    # The scanned forward.

    def layer_of(self, path: str) -> int | None:
        where = self.layer_site(path)
        return None if where is None else where[0]

    def layer_site(self, path: str) -> tuple[int, str] | None:
        """(layer, name within the layer) of a site path, None for a path outside the blocks."""
        prefix = self._prefix() + "."
        if not path.startswith(prefix):
            return None
        layer, _, name = path[len(prefix) :].partition(".")
        return (int(layer), name) if layer.isdigit() else None

    def apply_sites(
        self,
        params: Params,
        tokens: jax.Array,
        site_fn: SiteDataFn | None = None,
        site_data: Mapping[str, Any] | None = None,
        capture: Sequence[str] = (),
        residual: Residual | None = None,
        start: Residual | None = None,
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """The forward with the sites in `site_data` computed by `site_fn(x_in, W, data)` and
        the inputs of the sites in `capture` returned: (logits, {key: x_in}). `residual` /
        `start`: the stream entering a layer, filled in / started from (`base.Residual`; no
        site below `start`'s layer may be in `site_data` or `capture`).

        Keys are site paths or stacked units (`science.spd.grouped`: a group of one site name
        over consecutive layers, `model.layers.0-29.mlp.down_proj`, whose data carry a leading
        layer axis; its captured inputs come back stacked the same way).

        With `scan_layers` the blocks run as `jax.lax.scan` over each run of two or more
        consecutive layers whose sites are treated alike (the same units, or per-site data of
        the same shapes): the layer params are stacked along a leading layer axis and each
        unit's data are scanned over as they are (sliced when a run covers part of a unit), so
        the program holds one block per run instead of one per layer and nothing per site,
        whatever the depth. Other layers (alone, or without sites) stay unrolled. The values
        are those of the unrolled forward up to float reassociation inside the loop body
        (tests/test_scan.py)."""
        site_data = dict(site_data or {})
        capture = tuple(capture)
        if not self.scan_layers:
            if not any(members(k) for k in (*site_data, *capture)):
                return super().apply_sites(
                    params, tokens, site_fn, site_data, capture, residual, start
                )
            # stacked units without a scan: site by site, the captures stacked back
            out, got = super().apply_sites(
                params, tokens, site_fn, per_site_views(site_data), sites_of(capture), residual,
                start,
            )  # fmt: skip
            return out, {
                c: got[c] if members(c) is None else jnp.stack([got[m] for m in members(c)])
                for c in capture
            }
        data_at, cap_at = self._where(site_data), self._where(capture)
        x, root, layers, first = self._start(params, tokens, start)
        block_fn = self._block_fn()
        single: dict[str, jax.Array] = {}  # captured inputs of per-site keys
        pieces: dict[str, list[jax.Array]] = {}  # captured inputs of units, run by run

        def one_layer(unit_j: tuple[str, int | None]) -> Any:
            unit, j = unit_j
            return site_data[unit] if j is None else jax.tree.map(lambda a: a[j], site_data[unit])

        cuts = [i for i in (first, None if residual is None else residual.layer) if i]
        for lo, stop in self._runs(site_data, capture, cuts):
            if stop <= first:
                continue
            if residual is not None and lo == residual.layer:
                residual.x = x
            ids = range(lo, stop)
            names = [n for n, _, _ in self._layer_sites()]
            fed = [n for n in names if (lo, n) in data_at]
            caught = tuple(n for n in names if (lo, n) in cap_at)
            if stop - lo < 2 or not (caught or fed):
                # Nothing repeats here (one layer, or layers without sites): unrolled. On
                # XLA:CPU a scan slices (copies) each layer's weights out of the stack on every
                # iteration of every forward and backward, which cost a 30-layer SmolLM2 step
                # with 3 sites 1.45x its unrolled time; layers without sites compile cheaply.
                for i in ids:

                    def site(name, x_in, proj, i=i):
                        where = cap_at.get((i, name))
                        if where is not None:
                            unit, j = where
                            if j is None:
                                single[unit] = x_in
                            else:
                                pieces.setdefault(unit, []).append(x_in[None])
                        if (i, name) not in data_at:
                            return _project(x_in, proj, None, None)
                        return _project(x_in, proj, site_fn, one_layer(data_at[(i, name)]))

                    def block(x, layer, i=i, site=site):
                        return block_fn(x, layer, i, site)

                    x = (block if capture else self._remat(block))(x, layers[str(i)])
                continue
            stacked = _stack([layers[str(i)] for i in ids])
            data = {}
            for n in fed:
                unit, j = data_at[(lo, n)]
                if j is None:  # per-site keys of equal shapes: stacked here
                    data[n] = _stack([site_data[data_at[(i, n)][0]] for i in ids])
                else:
                    data[n] = _take(site_data[unit], j, stop - lo)

            def body(x, xs, data_names=tuple(data), caught=caught):
                layer, d, i = xs
                got: dict[str, jax.Array] = {}

                def site(site_name, x_in, proj):
                    if site_name in caught:
                        got[site_name] = x_in
                    fn = site_fn if site_name in data_names else None
                    return _project(x_in, proj, fn, d.get(site_name))

                return block_fn(x, layer, i, site), got

            body_fn = body if caught else self._remat(body)
            x, got = jax.lax.scan(body_fn, x, (stacked, data, jnp.arange(lo, stop)))
            for n in caught:
                unit, j = cap_at[(lo, n)]
                if j is not None:
                    pieces.setdefault(unit, []).append(got[n])
                    continue
                parts = jax.lax.split(got[n], [1] * len(ids), axis=0)
                single.update({cap_at[(i, n)][0]: a[0] for i, a in zip(ids, parts, strict=True)})
        captured = {c: single[c] if members(c) is None else _concat(pieces[c]) for c in capture}
        return self._unembed(params, root, x), captured

    def _where(self, keys: Any) -> dict[tuple[int, str], tuple[str, int | None]]:
        """(layer, site name) -> (the key of `keys` that holds it, its index in a unit or None
        for a site path)."""
        out: dict[tuple[int, str], tuple[str, int | None]] = {}
        for k in keys:
            ms = members(k)
            for j, m in enumerate(ms or [k]):
                where = self.layer_site(m)
                if where is None:
                    raise ValueError(f"{m} is not a site inside the layers of this model")
                out[where] = (k, None if ms is None else j)
        return out

    def _runs(
        self, site_data: Mapping[str, Any], capture: Sequence[str], cuts: Sequence[int] = ()
    ) -> list[tuple[int, int]]:
        """[start, stop) runs of consecutive layers whose sites are treated alike: per site
        name, the same unit (data or capture), or per-site data of the same shapes; a run
        also starts at each layer of `cuts`."""
        names = [n for n, _, _ in self._layer_sites()]
        data_at, cap_at = self._where(site_data), self._where(capture)

        def key(i: int) -> tuple:
            out = []
            for n in names:
                d = data_at.get((i, n))
                if d is not None and d[1] is None:
                    leaves, tree = jax.tree.flatten(site_data[d[0]])
                    d = (tree, tuple((a.shape, str(a.dtype)) for a in leaves))
                elif d is not None:
                    d = d[0]
                c = cap_at.get((i, n))
                out.append((d, None if c is None else (c[0] if c[1] is not None else True)))
            return tuple(out)

        runs: list[tuple[int, int]] = []
        prev = None
        for i in range(self.spec.n_layers):
            k = key(i)
            if runs and k == prev and i not in cuts:
                runs[-1] = (runs[-1][0], i + 1)
            else:
                runs.append((i, i + 1))
            prev = k
        return runs

    # Training interface (as LlamaMLP: next-token cross-entropy on packed text).

    def make_batch(self, key: jax.Array, batch_size: int) -> dict[str, jax.Array]:
        raise TypeError("hf reads text batches from pdctl.science.data, not make_batch")

    def inputs(self, batch: Mapping[str, jax.Array]) -> jax.Array:
        return batch["tokens"][:, :-1]

    def loss(
        self, params: Params, batch: Mapping[str, jax.Array]
    ) -> tuple[jax.Array, dict[str, jax.Array]]:
        tokens = batch["tokens"]
        logits_BxTxV = self.apply(params, tokens[:, :-1])
        labels_BxT = tokens[:, 1:]
        ce = jnp.mean(optax.softmax_cross_entropy_with_integer_labels(logits_BxTxV, labels_BxT))
        accuracy = jnp.mean((jnp.argmax(logits_BxTxV, axis=-1) == labels_BxT).astype(jnp.float32))
        return ce, {"ce": ce, "accuracy": accuracy}

    def trainable_mask(self, params: Params) -> Any:
        # Every leaf: an imported model is not pretrained by pdctl, and if it were, all of it
        # (positions and norms included) would be trainable as in transformers.
        return jax.tree.map(lambda _: True, params)

    def n_tokens_per_example(self) -> int:
        return self.seq_len


def _project(x_in: jax.Array, proj: Params, site_fn: SiteDataFn | None, data: Any) -> jax.Array:
    """One projection of `apply_sites`: `site_fn(x_in, W, data)` (cast back to the compute
    dtype) or, without a site_fn, `x_in @ W`; then the bias, if the projection has one."""
    W = proj["weight"]
    h = x_in @ W if site_fn is None else site_fn(x_in, W, data).astype(x_in.dtype)
    return add_bias(h, proj["bias"]) if "bias" in proj else h


def _stack(trees: Sequence[Any]) -> Any:
    """Same-structured pytrees stacked leaf by leaf along a new leading axis."""
    return jax.tree.map(lambda *leaves: jnp.stack(leaves), *trees)


def _take(tree: Any, start: int, n: int) -> Any:
    """Members [start, start + n) of a unit's stacked data (itself when that is all of it)."""

    def take(a: jax.Array) -> jax.Array:
        if start == 0 and a.shape[0] == n:
            return a
        return jax.lax.slice_in_dim(a, start, start + n, axis=0)

    return jax.tree.map(take, tree)


def _concat(parts: Sequence[jax.Array]) -> jax.Array:
    return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=0)


def _node(params: Params, path: str) -> Any:
    node: Any = params
    for part in path.split("."):
        node = node[part]
    return node


def unflatten(flat: Mapping[str, Any]) -> Params:
    """{'a.b.c': x} -> {'a': {'b': {'c': x}}}, keeping insertion order."""
    out: Params = {}
    for path, value in flat.items():
        *parents, leaf = path.split(".")
        node = out
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out
