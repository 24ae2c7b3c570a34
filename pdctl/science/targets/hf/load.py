"""Read a Hugging Face safetensors checkpoint straight into sharded `jax.Array`s.

Every leaf is built with `jax.make_array_from_callback`: JAX asks for the index of each shard
that this process's devices hold, and the callback reads only that slice of the stored tensor
(`safe_open(...).get_slice(name)[index]`, a memory map of one file), transposing nn.Linear weights
into pdctl's (d_in, d_out) and converting dtype on the way. So a process never reads what its
devices do not hold, and its host memory stays near its own shard plus one tensor: the file of one
tensor is open (mapped) at a time, and the host copies of a tensor's shards are dropped once they
are on the devices.

Names, shapes and dtypes are all checked against `config.json` from the files' headers before
any data is read, so a bad checkpoint fails before anything is loaded or written.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
import time
from pathlib import Path
from typing import Any

import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so safetensors can return it)
import numpy as np
from safetensors import safe_open

from pdctl.errors import PdctlError
from pdctl.science.targets.base import flatten, unflatten
from pdctl.science.targets.hf.model import HFCausalLM, Tensor
from pdctl.science.targets.hf.spec import WEIGHTS_HELP

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# Stored dtypes we convert from; the names are safetensors' own.
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")
_MAX_HEADER = 100 * 2**20  # safetensors' own limit on a header


@dataclasses.dataclass(frozen=True)
class Stored:
    file: Path
    shape: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclasses.dataclass(frozen=True)
class CheckpointIndex:
    """Every tensor of a checkpoint (name -> where and what), from the files' headers only."""

    source: Path  # the resolved model directory
    tensors: dict[str, Stored]
    checksum: str  # sha256 of the index json, or of the single file's header
    checksum_of: str  # which file the checksum covers

    def lookup(self, name: str) -> tuple[str, Stored] | None:
        """The stored tensor for `name`, also in a checkpoint saved from the base model, whose
        names lack the `model.` / `transformer.` prefix (the Hub's original gpt2 is one)."""
        if name in self.tensors:
            return name, self.tensors[name]
        head, _, rest = name.partition(".")
        if head in ("model", "transformer") and rest in self.tensors:
            return rest, self.tensors[rest]
        return None


def _err(msg: str) -> PdctlError:
    return PdctlError(f"target.path: {msg}")


def _header(path: Path) -> tuple[bytes, dict[str, Any]]:
    """The raw JSON header of a .safetensors file and its parsed form (no tensor data read)."""
    try:
        with path.open("rb") as f:
            raw_len = f.read(8)
            (n,) = struct.unpack("<Q", raw_len) if len(raw_len) == 8 else (-1,)
            if not 0 < n <= _MAX_HEADER:
                raise _err(f"{path} is not a safetensors file (bad header length)")
            raw = f.read(n)
            size = path.stat().st_size
    except OSError as e:
        raise _err(f"cannot read {path}: {e.strerror or e}") from None
    try:
        header = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise _err(f"{path} is not a safetensors file (bad header)") from None
    data_len = size - 8 - n
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry.get("data_offsets", (0, -1))
        if not 0 <= start <= end <= data_len:
            raise _err(f"{path} is truncated or corrupt (tensor {name!r} lies past its end)")
    return raw, header


def _tensors(path: Path, header: dict[str, Any]) -> dict[str, Stored]:
    out = {}
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        start, end = entry["data_offsets"]
        out[name] = Stored(path, tuple(int(s) for s in entry["shape"]), entry["dtype"], end - start)
    return out


def read_index(model_dir: str | Path) -> CheckpointIndex:
    """Where every tensor of the checkpoint in `model_dir` lives: a single `model.safetensors`,
    or `*.safetensors` shards listed by `model.safetensors.index.json` (shards without an index
    are read from their headers)."""
    d = Path(model_dir).expanduser()
    if not d.is_dir():
        raise _err(f"{d} is not a directory (expected a Hugging Face model directory)")
    d = d.resolve()
    index = d / INDEX
    if index.is_file():
        raw = index.read_bytes()
        try:
            weight_map = json.loads(raw)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError):
            raise _err(f"{index} is not a safetensors index (no 'weight_map')") from None
        tensors: dict[str, Stored] = {}
        for name in files:
            path = d / name
            if not path.is_file():
                raise _err(f"{index} lists {name}, which is not in {d}")
            found = _tensors(path, _header(path)[1])
            tensors.update({k: v for k, v in found.items() if weight_map.get(k) == name})
        missing = sorted(set(weight_map) - set(tensors))
        if missing:
            raise _err(f"{index} maps {missing[0]!r} to {weight_map[missing[0]]}, whose header "
                       "does not have it")  # fmt: skip
        return CheckpointIndex(d, tensors, hashlib.sha256(raw).hexdigest(), INDEX)
    single = d / SINGLE
    files = [single] if single.is_file() else sorted(d.glob("*.safetensors"))
    if not files:
        raise _err(f"no weights in {d} (expected {WEIGHTS_HELP})")
    digest, tensors = hashlib.sha256(), {}
    for path in files:
        raw, header = _header(path)
        digest.update(raw)
        tensors.update(_tensors(path, header))
    of = f"{SINGLE} header" if files == [single] else f"headers of {len(files)} files"
    return CheckpointIndex(d, tensors, digest.hexdigest(), of)


def check_checkpoint(
    model_dir: str | Path, target: HFCausalLM
) -> tuple[CheckpointIndex, dict[str, tuple[str, Stored]]]:
    """The checkpoint's index and, per params leaf, the stored tensor it is read from. A tensor
    that is missing, or whose shape or dtype does not fit `config.json`, is a one-line error."""
    ckpt = read_index(model_dir)
    config = target.spec.config_path
    plan = {}
    for path, t in target.checkpoint_layout().items():
        found = ckpt.lookup(t.name)
        if found is None:
            raise _err(
                f"tensor {t.name!r} (shape {t.stored_shape} per {config}) is not in the "
                f"checkpoint in {ckpt.source}"
            )
        name, stored = found
        if stored.shape != t.stored_shape:
            raise _err(
                f"tensor {name!r} in {stored.file} has shape {stored.shape}, but {config} "
                f"implies {t.stored_shape}"
            )
        if stored.dtype not in FLOAT_DTYPES:
            raise _err(
                f"tensor {name!r} in {stored.file} has dtype {stored.dtype} (supported: "
                f"{', '.join(FLOAT_DTYPES)})"
            )
        plan[path] = (name, stored)
    return ckpt, plan


def _read(sl: Any, t: Tensor, index: tuple[slice, ...], dtype: np.dtype) -> np.ndarray:
    """One shard of a leaf: the matching slice of the stored tensor, in the leaf's layout."""
    if t.transposed:
        # Leaf (d_in, d_out)[a, b] is stored (d_out, d_in)[b, a].
        return np.asarray(sl[tuple(index[::-1])]).T.astype(dtype, order="C")
    return np.asarray(sl[tuple(index)]).astype(dtype, copy=False)


def load_hf_params(
    model_dir: str | Path, target: HFCausalLM, shardings: Any, dtype: Any = None
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The target's params read from `model_dir`, each leaf placed with its sharding.

    `shardings` has the params' structure (nested dicts of `jax.sharding.Sharding`, e.g. from
    `jax.eval_shape(target.init, key)` and the mesh rules). `dtype` (default: the target's
    param_dtype) is what every leaf is converted to. Returns (params, info) with info holding
    `source` (resolved directory), `checksum` (sha256, see `read_index`), `checksum_of`,
    `tensors`, `bytes` (stored bytes of the tensors read) and `wall_s`.
    """
    t0 = time.perf_counter()
    dtype = np.dtype(target.param_dtype if dtype is None else dtype)
    ckpt, plan = check_checkpoint(model_dir, target)
    layout = target.checkpoint_layout()
    flat_sh = flatten(shardings)
    if set(flat_sh) != set(layout):
        extra = sorted(set(flat_sh) ^ set(layout))
        raise ValueError(
            f"shardings do not have the target's params structure (differ at {extra[:3]})"
        )
    leaves = {}
    for path, t in layout.items():
        name, stored = plan[path]
        shape = t.stored_shape[::-1] if t.transposed else t.stored_shape
        # One file mapped at a time; closing it drops the mapping (and its resident pages).
        with safe_open(str(stored.file), framework="numpy") as f:
            sl = f.get_slice(name)
            # jax types the callback's index `Index | None` (this lambda's cannot be inferred),
            # but asserts it is not None before calling
            leaves[path] = jax.make_array_from_callback(
                shape,
                flat_sh[path],
                lambda index, sl=sl, t=t: _read(sl, t, index, dtype),  # type: ignore[misc]
                dtype,
            )
            del sl
    info = {
        "source": str(ckpt.source),
        "checksum": ckpt.checksum,
        "checksum_of": ckpt.checksum_of,
        "tensors": len(plan),
        "bytes": int(sum(s.nbytes for _, s in plan.values())),
        "wall_s": round(time.perf_counter() - t0, 3),
    }
    return unflatten({p: leaves[p] for p in layout}), info
