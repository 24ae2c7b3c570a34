"""pdctl.toml's tables into a `Config`: `parse_config` validates (a mistake is one `PdctlError`
line naming the key path, `train.optim.lr: must be > 0, got -1`) and checks what no single
table can (`_check_cross_fields`); `fingerprint` and `config_snapshot` say what of a config a
stage's result depends on. Validation lives in the schema (`pdctl.config.schema`) and here, and
only there."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import ValidationError

from pdctl import registry
from pdctl.config.schema import (
    SCHEMA_VERSION,
    Config,
    TrainConfig,
    assigned_per_micro_batch,
    is_sequence_model,
    ppgd_source_layout,
)
from pdctl.errors import PdctlError


def _keep_tags(full: Any, lean: Any) -> Any:
    """`lean` (a dump without defaults) with every union tag (`kind`) of `full` put back, so
    two table variants left at their defaults still differ."""
    if isinstance(lean, dict):
        out = {k: _keep_tags(full[k], v) for k, v in lean.items()}
        if "kind" in full:
            out["kind"] = full["kind"]
        return out
    if isinstance(lean, list):
        return [_keep_tags(f, v) for f, v in zip(full, lean, strict=True)]
    return lean


def fingerprint(cfg: Config, stage: str) -> str:
    """A stable hash of the config tables `stage` depends on: of the values that differ from
    the schema's defaults (key order free). An explicit default is the same as leaving the key
    out, and a later pdctl that adds a key with a default leaves existing fingerprints, hence
    existing runs, as they were. (Within one schema this sees exactly the changes a hash of
    every value would: the non-default values determine all the others.)"""
    full = cfg.model_dump(mode="json", by_alias=True)
    dumped = _keep_tags(full, cfg.model_dump(mode="json", by_alias=True, exclude_defaults=True))
    dumped["target"] = _keep_tags(full["target"], dumped.get("target", {}))
    # How the train step runs, not what it computes (train resumes across it, `stages.train.
    # restore`): not part of any fingerprint.
    dumped.get("train", {}).pop("scan_layers", None)
    dumped.get("train", {}).pop("eval_accum_steps", None)  # the same figures, in parts
    deps = registry.dependencies(stage)
    if cfg.target.kind == "hf":  # an imported target is not trained: [pretrain] changes nothing
        deps = tuple(d for d in deps if d != "pretrain")
    tables: dict[str, Any] = {k: dumped.get(k, {}) for k in deps}
    # init-weights also creates the PPGD sources, whose shape comes from [train] keys.
    tables["ppgd_sources"] = ppgd_source_layout(cfg)
    blob = json.dumps(tables, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def config_snapshot(cfg: Config, stage: str) -> dict[str, Any]:
    """{dotted key: value} of every config key `stage`'s result depends on: what its checkpoints
    record, so that a refusal can name the keys that changed (`changed_keys`)."""
    dumped = cfg.model_dump(mode="json", by_alias=True)
    out: dict[str, Any] = {}

    def walk(prefix: str, v: Any) -> None:
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}.{k}", x)
        else:
            out[prefix] = v

    for table in registry.dependencies(stage):
        walk(table, dumped[table])
    return out


def _format_error(err: ValidationError) -> str:
    errors = err.errors()
    first = errors[0]
    loc = ".".join(str(p) for p in first["loc"] if not _is_union_tag(p))
    msg = first["msg"]
    if msg.startswith("Value error, "):
        msg = msg[len("Value error, ") :]
    if first["type"] == "extra_forbidden":
        msg = "unknown key"
    elif first["type"] == "missing":
        msg = "missing (required)"
    elif first["type"] in ("greater_than", "greater_than_equal", "less_than_equal", "less_than"):
        msg = msg.replace("Input should be", "must be")
    elif first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        # A discriminated union ([target]): name the tag key, not just the table.
        ctx = first.get("ctx", {})
        tag = ctx.get("discriminator", "'kind'").strip("'")
        loc = f"{loc}.{tag}"
        tags = ", ".join(t.strip(" '") for t in ctx.get("expected_tags", "").split(","))
        if first["type"] == "union_tag_not_found":
            msg = f"missing; choose one of {tags or 'tms, resid_mlp, llama_mlp, hf'}"
        else:
            msg = f"must be one of {tags}, got {first['input'].get(tag)!r}"
    if (
        first["type"] != "extra_forbidden"
        and "input" in first
        and not isinstance(first["input"], dict)
    ):
        msg += f", got {first['input']!r}"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{loc or '<top level>'}: {msg}{more}"


def _is_union_tag(part: Any) -> bool:
    # pydantic puts the discriminator value into the location ("target.tms.n_hidden").
    return part in ("tms", "resid_mlp", "llama_mlp", "hf")


def parse_config(raw: dict[str, Any]) -> Config:
    """Validate the user's tables (everything but `state`) into a Config."""
    raw = {k: v for k, v in raw.items() if k != "state"}
    schema = raw.get("schema")
    if schema is None:
        raise PdctlError(
            f"schema: missing; add `schema = {SCHEMA_VERSION}` at the top of pdctl.toml"
        )
    if type(schema) is not int:
        raise PdctlError(f"schema: must be an integer (schema = {SCHEMA_VERSION}), got {schema!r}")
    if schema != SCHEMA_VERSION:
        raise PdctlError(
            f"schema: unsupported version {schema!r}; this pdctl reads schema {SCHEMA_VERSION}"
        )
    try:
        cfg = Config.model_validate(raw)
    except ValidationError as e:
        raise PdctlError(_format_error(e)) from None
    _check_cross_fields(cfg)
    return cfg


def _check_assigned_ascent(tc: TrainConfig) -> None:
    key = "train.ppgd.ascent_examples"
    if not tc.loss.merged_recon:
        raise PdctlError(
            f"{key}: 'assigned' picks the examples of the merged term (train.loss.merged_recon), "
            "which is 0; set it or use 'all'"
        )
    if tc.ppgd.scope == "pooled":
        raise PdctlError(f"{key}: 'assigned' does not work with scope 'pooled'; use 'all'")
    micro = tc.batch_size // tc.grad_accum_steps
    k = assigned_per_micro_batch(tc)
    if not 1 <= k <= micro:
        raise PdctlError(
            f"{key}: adv_fraction {tc.loss.adv_fraction:g} of a micro-batch of {micro} is "
            f"{k} examples; 'assigned' needs 1 to {micro} (raise adv_fraction or the batch)"
        )


def _check_cross_fields(cfg: Config) -> None:
    seen: set[str] = set()
    for i, site in enumerate(cfg.decomp.sites):
        if site.pattern in seen:
            raise PdctlError(f"decomp.sites.{i}.pattern: {site.pattern!r} is listed twice")
        seen.add(site.pattern)
    if not is_sequence_model(cfg) and cfg.train.ppgd.scope == "per_position":
        raise PdctlError(
            "train.ppgd.scope: 'per_position' needs a sequence model (a language-model target); "
            "use 'shared' or 'per_batch_per_position'"
        )
    if not is_sequence_model(cfg) and cfg.train.loss.output == "kl":
        raise PdctlError(
            "train.loss.output: 'kl' needs logits (a language-model target); use 'mse'"
        )
    if cfg.target.kind == "hf" and not cfg.data.path:
        raise PdctlError(
            "data.path: an imported model (target.kind = hf) is decomposed on your text; set "
            "data.path to a .txt, .jsonl or .parquet file or a directory of them"
        )
    if cfg.precision.target_dtype is not None and cfg.target.kind != "hf":
        # a self-trained target (pretrain) is trained and stored in param_dtype
        raise PdctlError(
            "precision.target_dtype: only an imported target (target.kind = hf) is stored "
            f"apart from the decomposition, not {cfg.target.kind}; delete the key"
        )
    tc = cfg.train
    if tc.init_from_step is not None and not tc.init_from:
        raise PdctlError("train.init_from_step: names a step of the init_from run; set init_from")
    if tc.eval_batch_size % tc.eval_accum_steps:
        raise PdctlError(
            f"train.eval_accum_steps: {tc.eval_accum_steps} does not divide train.eval_batch_size "
            f"{tc.eval_batch_size}"
        )
    per_batch = ("per_batch_per_position", "pooled")
    if tc.ppgd.scope in per_batch and tc.batch_size % tc.grad_accum_steps:
        raise PdctlError(
            f"train.grad_accum_steps: {tc.grad_accum_steps} does not divide train.batch_size "
            f"{tc.batch_size} (per-batch PPGD sources are sized by the micro-batch)"
        )
    if tc.ppgd.ascent_examples == "assigned":
        _check_assigned_ascent(tc)
    ci = cfg.decomp.ci_fn
    if ci.type in ("transformer", "global_shared_transformer"):
        if not is_sequence_model(cfg):
            raise PdctlError(
                f"decomp.ci_fn.type: {ci.type!r} attends over a sequence and needs a "
                "language-model target; use mlp, vector_mlp or shared_mlp"
            )
        if ci.d_model % ci.n_heads or (ci.d_model // ci.n_heads) % 2:
            raise PdctlError(
                f"decomp.ci_fn.n_heads: d_model {ci.d_model} must split into {ci.n_heads} heads "
                "of even size (RoPE rotates pairs of dimensions)"
            )
    if not cfg.decomp.sites:
        raise PdctlError(
            "decomp.sites: empty; list the weight matrices to decompose, e.g. "
            'sites = [{ pattern = "linear1", C = 20 }]'
        )
