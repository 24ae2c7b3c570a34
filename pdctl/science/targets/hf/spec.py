"""`config.json` of a Hugging Face causal LM (Llama, Qwen2, Qwen3, GPT-2) read into an `HfSpec`.

`read_hf_config` checks a model directory and parses its `config.json`; `llama_spec` /
`gpt2_spec` build the spec from any mapping with transformers' key names (GGUF metadata goes
through them too, `targets.gguf`). Every size is checked for type and range, and a missing or
unsupported model or feature is a one-line `PdctlError` naming `target.path`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import numbers
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from pdctl.errors import PdctlError

LLAMA, QWEN2, GPT2 = "LlamaForCausalLM", "Qwen2ForCausalLM", "GPT2LMHeadModel"
QWEN3 = "Qwen3ForCausalLM"
SUPPORTED = (LLAMA, QWEN2, QWEN3, GPT2)
_BY_MODEL_TYPE = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "gpt2": GPT2}
# Known architectures pdctl refuses by name, with what they need that pdctl lacks
# (by `architectures` entry and by `model_type`).
UNSUPPORTED = {
    "Qwen3MoeForCausalLM": "Qwen3 mixture-of-experts (sparse MoE MLP blocks)",
    "Qwen2MoeForCausalLM": "Qwen2 mixture-of-experts (sparse MoE MLP blocks)",
}
_UNSUPPORTED_TYPES = {"qwen3_moe": "Qwen3MoeForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM"}
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
    # Qwen3: RMSNorm over each query / key head (`self_attn.q_norm`, `self_attn.k_norm`, weights
    # of head_dim), applied before RoPE
    qk_norm: bool = False
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
    if not archs and isinstance(model_type, str):
        archs = [_BY_MODEL_TYPE.get(model_type) or _UNSUPPORTED_TYPES.get(model_type)]
        archs = [a for a in archs if a]
    arch = archs[0] if isinstance(archs, list) and len(archs) == 1 else archs
    if isinstance(arch, str) and arch in UNSUPPORTED:
        raise _err(f"architecture {arch!r} in {path} is not supported: {UNSUPPORTED[arch]} "
                   f"(supported: {', '.join(SUPPORTED)})")  # fmt: skip
    if not isinstance(arch, str) or arch not in SUPPORTED:
        found = f"architecture {arch!r}" if arch else "no 'architectures'"
        raise _err(f"{found} in {path} is not supported (supported: {', '.join(SUPPORTED)})")
    return gpt2_spec(cfg, path) if arch == GPT2 else llama_spec(cfg, path, arch)


# The largest size a config may give (a JAX dimension is an int32 on some backends): a value
# above it is a corrupt or mistyped config, not a model.
MAX_SIZE = 2**31 - 1


def config_value(
    cfg: Mapping[str, Any], path: Path | str, key: str, typ: type, default: Any = ...
) -> Any:
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
    v = config_value(cfg, path, key, int, default)
    if not least <= v <= MAX_SIZE:
        raise _err(f"{path}: {key!r} must be an integer in [{least}, {MAX_SIZE}], got {_shown(v)}")
    return v


def _number(
    cfg: Mapping[str, Any], path: Path | str, key: str, default: Any = ..., *, zero: bool = False
) -> float:
    """A finite number > 0 (>= 0 with `zero`)."""
    v = config_value(cfg, path, key, float, default)
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
    act = config_value(cfg, path, key, str, default)
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
    if config_value(merged, path, "partial_rotary_factor", float, 1.0) != 1.0:
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


def llama_spec(cfg: Mapping[str, Any], path: Path, arch: str) -> HfSpec:
    """The spec of a Llama, Qwen2 or Qwen3 config (transformers' key names; `cfg` may be any
    mapping, such as one built from a GGUF file's metadata). Every size is checked for type and
    range, and the head layout as transformers builds it: Llama needs hidden_size to be a
    multiple of num_attention_heads (LlamaConfig refuses it otherwise), all need
    num_attention_heads to be a multiple of num_key_value_heads, and head_dim (default
    hidden_size // num_attention_heads; Qwen3Config's default is 128) even for RoPE."""
    d = _size(cfg, path, "hidden_size")
    n_heads = _size(cfg, path, "num_attention_heads")
    n_kv = _size(cfg, path, "num_key_value_heads", n_heads)
    if arch == LLAMA and d % n_heads:
        raise _err(f"{path}: hidden_size {d} is not a multiple of num_attention_heads {n_heads}")
    if arch == QWEN3:
        head_dim = _size(cfg, path, "head_dim", 128)  # Qwen3Config's default, not d // heads
    else:
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
    if arch in (QWEN2, QWEN3):
        # absent is Qwen2Config's / Qwen3Config's default; null is refused, as they refuse it
        for key, what in (("use_sliding_window", bool), ("max_window_layers", int)):
            if key in cfg and cfg[key] is None:
                raise _err(f"{path}: {key!r} must be {_TYPE_NAMES[what]}, got null")
        types = cfg.get("layer_types")
        if types is not None:
            if not isinstance(types, list) or not all(isinstance(t, str) for t in types):
                raise _err(f"{path}: 'layer_types' must be a list of strings, got {types!r}")
            sliding = "sliding_attention" in types
        else:
            # as Qwen2Config and Qwen3Config: layer i slides when use_sliding_window, a
            # sliding_window is set and i >= max_window_layers (default 28)
            use = config_value(cfg, path, "use_sliding_window", bool, False)
            window = config_value(cfg, path, "sliding_window", int, None)
            first = _size(cfg, path, "max_window_layers", 28, least=0)
            sliding = use and window is not None and first < n_layers
        if sliding:
            raise _err(
                f"sliding-window attention in {path} is not supported (supported: full "
                "attention in every layer, use_sliding_window = false)"
            )
    biases: dict[str, Any]  # HfSpec's bias flags, by keyword
    if arch == QWEN2:
        biases = {"qkv_bias": True, "o_bias": False, "mlp_bias": False}
    elif arch == QWEN3:
        # Qwen3Attention: attention_bias on q, k, v and o; Qwen3MLP has no biases
        attn_bias = config_value(cfg, path, "attention_bias", bool, False)
        biases = {"qkv_bias": attn_bias, "o_bias": attn_bias, "mlp_bias": False}
    else:
        attn_bias = config_value(cfg, path, "attention_bias", bool, False)
        biases = {
            "qkv_bias": attn_bias,
            "o_bias": attn_bias,
            "mlp_bias": config_value(cfg, path, "mlp_bias", bool, False),
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
        tie_word_embeddings=config_value(cfg, path, "tie_word_embeddings", bool, False),
        # transformers' defaults: LlamaConfig 2048, Qwen2Config and Qwen3Config 32768
        max_positions=_size(cfg, path, "max_position_embeddings", 2048 if arch == LLAMA else 32768),
        qk_norm=arch == QWEN3,
        rope_theta=theta,
        rope_scaling=scaling,
        **biases,
        **_common(cfg, path),
    )


def gpt2_spec(cfg: Mapping[str, Any], path: Path) -> HfSpec:
    """The spec of a GPT-2 config (transformers' key names, or any mapping with them); n_embd
    must be a multiple of n_head, as GPT2Attention requires."""
    d = _size(cfg, path, "n_embd")
    n_heads = _size(cfg, path, "n_head")
    if d % n_heads:
        raise _err(f"{path}: n_embd {d} is not a multiple of n_head {n_heads}")
    if config_value(cfg, path, "add_cross_attention", bool, False):
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
        tie_word_embeddings=config_value(cfg, path, "tie_word_embeddings", bool, True),
        max_positions=_size(cfg, path, "n_positions", 1024),
        qkv_bias=True,
        o_bias=True,
        mlp_bias=True,
        attn_scale_weights=config_value(cfg, path, "scale_attn_weights", bool, True),
        attn_scale_by_layer=config_value(cfg, path, "scale_attn_by_inverse_layer_idx", bool, False),
        **_common(cfg, path),
    )
