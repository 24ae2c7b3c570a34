"""What a stage builds from the config alone: the target, its random streams, its layout on the
mesh (tensor parallelism, rematerialisation, scanned layers), the abstract target parameters and
a text batch's shape. Nothing here reads the run directory's state."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from pdctl.config import AUTO_SCAN_LAYERS, Config, match_sites
from pdctl.engine import sharding
from pdctl.errors import PdctlError
from pdctl.science.targets import Target, build_target

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


# Independent random streams of a run, all derived from [run] seed.
STREAM_TARGET, STREAM_DECOMP, STREAM_PRETRAIN, STREAM_WARMUP, STREAM_TRAIN = range(5)


def stream_key(cfg: Config, stream: int) -> jax.Array:
    return jax.random.fold_in(jax.random.PRNGKey(cfg.run.seed), stream)


def target_from_config(cfg: Config, root: Path | None = None, need_weights: bool = True) -> Target:
    """The target of `[target]`: its own keys, plus what it reads from other tables. An
    imported model's relative `path` is relative to the run directory `root`; without
    `need_weights` its config.json alone is enough (shapes only)."""
    t = cfg.target
    fields = t.model_dump(exclude={"kind"})
    # an imported target's frozen weights may be stored apart ([precision] target_dtype)
    fields["param_dtype"] = DTYPES[cfg.precision.target_dtype or cfg.precision.param_dtype]
    if t.kind in ("tms", "resid_mlp"):
        fields["feature_probability"] = cfg.data.feature_probability
    else:
        fields["seq_len"] = cfg.data.seq_len
    if t.kind == "hf":
        fields["path"] = str(resolve(root, t.path))
        fields["need_weights"] = need_weights
        if cfg.precision.target_dtype is not None:  # stored apart: computed in compute_dtype
            fields["compute_dtype"] = DTYPES[cfg.precision.compute_dtype]
    return build_target(t.kind, **fields)


def decomp_layout(cfg: Config, mesh: Mesh, target: Target) -> sharding.Decomp:
    """The mesh axes this run's components shard over (`[mesh] decomposition`)."""
    return sharding.decomp_axes(mesh, cfg.mesh.decomposition, target.output_kind == "logits")


def check_tensor_parallel(target: Target, mesh: Mesh, key: str = "mesh.tp") -> None:
    """A tp axis > 1 needs a target with a tensor-parallel layout whose heads and widths it
    divides, and (on several hosts) the tp devices of a group on one host."""
    tp = sharding.axis_size(mesh, "tp")
    if tp == 1:
        return
    sizes = target.tp_divisors()
    if sizes is None:
        raise PdctlError(
            f"{key}: the {target.kind} target has no tensor-parallel layout (its projections "
            "are not split over devices); set mesh.tp = 1 and use mesh.data / mesh.fsdp"
        )
    where = getattr(getattr(target, "spec", None), "config_path", None)
    for name, n in sizes.items():
        if n % tp:
            of = f" in {where}" if where else ""
            raise PdctlError(f"{key}: {tp} does not divide {name} = {n}{of}")
    local = len(mesh.local_devices)
    if jax.process_count() > 1 and local % tp:
        raise PdctlError(
            f"{key}: {tp} does not divide the {local} devices of each process (a tensor-"
            "parallel group must sit on one host)"
        )


def resolve(root: Path | None, path: str) -> Path:
    """A path from pdctl.toml: `~` expanded, relative to the run directory."""
    p = Path(path).expanduser()
    return p if p.is_absolute() or root is None else root / p


def with_remat(target: Target, remat: str) -> Target:
    """The target with its blocks rematerialised by `remat` (only models with blocks have it)."""
    if remat == "none" or not hasattr(target, "remat"):
        return target
    return dataclasses.replace(target, remat=remat)


def scan_layers(cfg: Config, target: Target, mesh: Any = None) -> bool | Literal["all"]:
    """`[train] scan_layers` for this target: true / false / "all" as set; "auto": on when the
    target can scan (an imported model) and the decomposed sites sit in `AUTO_SCAN_LAYERS`
    layers or more (where the scanned step compiled faster than the unrolled one); below
    that, "all" on a TPU (`mesh`'s devices, else JAX's default backend: the layers without
    sites scanned, which halved the smollm2 template's compile on a v5e), off elsewhere
    (XLA:CPU compiled and ran it slower scanned). docs/performance.md has the figures."""
    setting = cfg.train.scan_layers
    if setting == "all":
        return "all" if hasattr(target, "scan_layers") else False
    if setting != "auto":
        return bool(setting)
    if not hasattr(target, "scan_layers"):
        return False
    layers = {target.layer_of(p) for p in match_sites(cfg, target.site_paths())}
    if len(layers - {None}) >= AUTO_SCAN_LAYERS:
        return True
    platform = mesh.devices.flat[0].platform if mesh is not None else jax.default_backend()
    return "all" if platform == "tpu" else False


def with_scan(target: Target, scan: bool | Literal["all"]) -> Target:
    """The target with its blocks scanned over layers in `apply_sites` (`[train] scan_layers`;
    only models with blocks have it); "all": the runs of layers without sites too."""
    if not hasattr(target, "scan_layers"):
        return target
    on, siteless = bool(scan), scan == "all"
    if target.scan_layers == on and getattr(target, "scan_siteless", False) == siteless:
        return target
    extra = {"scan_siteless": siteless} if hasattr(target, "scan_siteless") else {}
    return dataclasses.replace(target, scan_layers=on, **extra)


def as_trained(cfg: Config, target: Target, mesh: Any = None, step: bool = True) -> Target:
    """The target as the train stage runs it, resolved here once for the step, its restore, its
    evaluation and the fit check: scanned over layers by `[train] scan_layers` ("auto" resolved
    for `mesh`) and, for the step, rematerialised by `[train] remat` (`step=False`: the
    evaluation takes no gradient, so nothing is recomputed)."""
    scan = scan_layers(cfg, target, mesh)
    return with_scan(with_remat(target, cfg.train.remat) if step else target, scan)


def abstract_target(cfg: Config, target: Target) -> Any:
    """The target's parameters as ShapeDtypeStructs: what init-weights creates (and pretrain
    trains, and warmup/train take frozen)."""
    return jax.eval_shape(target.init, stream_key(cfg, STREAM_TARGET))


def text_batch_spec(cfg: Config, target: Target, batch_size: int, mesh: Mesh) -> tuple[Any, Any]:
    """(abstract batch, its shardings) of a text target's step: `{"tokens": (batch, seq_len +
    1) int32}` split over the batch axes; (None, None) for the toys, whose step makes its own."""
    if target.output_kind != "logits":
        return None, None
    tokens = jax.ShapeDtypeStruct((batch_size, cfg.data.seq_len + 1), jnp.int32)
    return {"tokens": tokens}, {"tokens": sharding.batch_sharding(mesh, 2)}


def peak_flops(cfg: Config) -> float | None:
    """One device's peak FLOP/s (the table by device kind, or `[measure] peak_tflops`)."""
    from pdctl.engine.measure import peak_flops_per_device

    return peak_flops_per_device(jax.devices()[0], cfg.measure.peak_tflops)
