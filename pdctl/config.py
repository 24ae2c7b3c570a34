"""The typed schema of pdctl.toml: every key, its default, its range.

Validation lives here and only here. `parse_config` turns a TOML dict into a `Config` or raises a
`PdctlError` whose one line names the key path (`train.optim.lr: must be > 0, got -1`).
`pdctl.toml.example` documents every field below; a test keeps the two in step.
"""

from __future__ import annotations

import fnmatch
import hashlib
import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pdctl.errors import PdctlError

SCHEMA_VERSION = 1
STAGES = ("init_weights", "pretrain", "warmup", "train")

Pos = Annotated[int, Field(gt=0)]
NonNeg = Annotated[int, Field(ge=0)]
# Floats are finite: `lr = inf` or `nan` is a mistake, never a setting.
PosF = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegF = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Frac = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Prob = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
DType = Literal["float32", "bfloat16", "float16"]


class Section(BaseModel):
    # strict: TOML already has types, so "5" for an int is a mistake, not something to coerce.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class RunConfig(Section):
    seed: NonNeg = 0
    description: str = ""


class TmsTarget(Section):
    kind: Literal["tms"] = "tms"
    n_features: Pos = 5
    n_hidden: Pos = 2
    n_hidden_layers: NonNeg = 0
    tied_weights: bool = True
    bias: bool = True


class ResidMlpTarget(Section):
    kind: Literal["resid_mlp"] = "resid_mlp"
    n_features: Pos = 100
    d_embed: Pos = 1000
    d_mlp: Pos = 50
    n_layers: Pos = 1
    embed_seed: NonNeg = 0
    bias: bool = False  # MLP biases; the canonical ResidMLP-1 has none


class LlamaTarget(Section):
    kind: Literal["llama_mlp"] = "llama_mlp"
    vocab_size: Pos = 256
    d_model: Pos = 64
    n_layers: Pos = 2
    n_heads: Pos = 4
    d_mlp: Pos = 256
    glu: bool = False
    tied_embeddings: bool = True
    rope_theta: PosF = 10000.0

    @model_validator(mode="after")
    def _heads_divide(self) -> LlamaTarget:
        if self.d_model % self.n_heads:
            raise ValueError(
                f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})"
            )
        if (self.d_model // self.n_heads) % 2:
            raise ValueError("d_model / n_heads must be even for RoPE")
        return self


class HfTarget(Section):
    """A pretrained Hugging Face causal LM from a local directory (config.json, safetensors,
    tokenizer.json): LlamaForCausalLM, Qwen2ForCausalLM or GPT2LMHeadModel."""

    kind: Literal["hf"] = "hf"
    path: Annotated[str, Field(min_length=1)]


Target = Annotated[TmsTarget | ResidMlpTarget | LlamaTarget | HfTarget, Field(discriminator="kind")]


class DataConfig(Section):
    feature_probability: Frac = 0.05
    path: str = ""
    text_field: Annotated[str, Field(min_length=1)] = "text"
    eos_id: NonNeg | None = None
    seq_len: Pos = 64
    synthetic_bytes: Pos = 2_000_000


class MeshConfig(Section):
    data: int = Field(-1, ge=-1)
    fsdp: int = Field(1, ge=-1)
    fsdp_min_param_size: NonNeg = 1024

    @model_validator(mode="after")
    def _one_wildcard(self) -> MeshConfig:
        if self.data == 0 or self.fsdp == 0:
            raise ValueError("mesh sizes must be positive or -1 (all remaining devices)")
        if self.data == -1 and self.fsdp == -1:
            raise ValueError("only one of mesh.data and mesh.fsdp may be -1")
        return self


class DistributedConfig(Section):
    coordinator: str = ""
    num_processes: NonNeg = 0
    process_id: int = Field(-1, ge=-1)
    local_device_ids: list[NonNeg] = []
    init_timeout_s: Pos = 300
    heartbeat_timeout_s: Pos = 100


class PrecisionConfig(Section):
    param_dtype: DType = "float32"
    compute_dtype: DType = "float32"
    output_dtype: DType = "float32"


class CompileConfig(Section):
    cache_dir: str = ""


class CheckpointConfig(Section):
    every: Pos = 1000
    keep: Pos = 3


class TrackingConfig(Section):
    wandb: Literal["disabled", "offline", "online"] = "disabled"
    project: str = "pdctl"
    entity: str = ""


class MeasureConfig(Section):
    peak_tflops: NonNegF = 0.0


class OptimConfig(Section):
    lr: PosF = 1e-3
    weight_decay: NonNegF = 0.0
    b1: Frac = 0.9
    b2: Frac = 0.999
    schedule: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_frac: Frac = 0.0
    final_lr_frac: Frac = 0.0
    grad_clip: NonNegF = 0.0


class PretrainConfig(Section):
    steps: Pos = 1000
    batch_size: Pos = 1024
    log_every: Pos = 100
    max_bad_steps: Pos = 10
    grad_accum_steps: Pos = 1
    remat: Literal["none", "dots_saveable", "full"] = "none"
    optim: OptimConfig = OptimConfig()


class SiteConfig(Section):
    pattern: Annotated[str, Field(min_length=1)]
    C: Pos


class CiFnConfig(Section):
    type: Literal["mlp", "vector_mlp", "shared_mlp"] = "mlp"
    hidden: list[Pos] = [16]


class DecompConfig(Section):
    sites: list[SiteConfig] = []
    delta_component: bool = True
    sigmoid: Literal["leaky_hard", "hard"] = "leaky_hard"
    sampling: Literal["continuous", "binomial"] = "continuous"
    n_mask_samples: Pos = 1
    ci_threshold: Frac = 0.1
    ci_fn: CiFnConfig = CiFnConfig()


class WarmupConfig(Section):
    steps: NonNeg = 400
    lr: PosF = 0.01
    weight_decay: NonNegF = 0.1
    log_every: Pos = 100
    max_bad_steps: Pos = 10


Routing = Literal["uniform_k", "static_p"]


class LossConfig(Section):
    faithfulness: NonNegF = 0.0
    importance_minimality: NonNegF = 3e-3
    p: PosF = 1.0
    p_final: PosF | None = None
    p_anneal_start: Frac = 0.0
    p_anneal_end: Frac = 1.0
    beta: NonNegF = 0.0
    eps: NonNegF = 1e-12
    stochastic_recon: NonNegF = 1.0
    stochastic_recon_layerwise: NonNegF = 1.0
    stochastic_recon_subset: NonNegF = 0.0
    subset_routing: Routing = "uniform_k"
    subset_p: Prob = 0.5
    ppgd_recon: NonNegF = 0.0
    pgd_recon: NonNegF = 0.0
    ci_masked_recon: NonNegF = 0.0
    unmasked_recon: NonNegF = 0.0
    output: Literal["mse", "kl"] = "mse"

    @model_validator(mode="after")
    def _anneal_order(self) -> LossConfig:
        if self.p_anneal_end < self.p_anneal_start:
            raise ValueError("p_anneal_end must be >= p_anneal_start")
        return self


# Keys and values of [train.ppgd] that earlier pdctl versions read with another meaning.
_PPGD_REMOVED = {
    "n_steps": "removed: PPGD now takes ONE source step per train step, from the gradient of "
    "that step's PPGD loss; use `n_warmup_steps` for extra ascent steps on each batch",
    "warmup_steps": "removed: use `n_warmup_steps` (extra ascent steps on EVERY train step)",
}
_PPGD_RENAMED_SCOPES = {"batch": "shared", "position": "per_position"}


class PpgdConfig(Section):
    """Persistent adversarial sources (the reference's PersistentPGDReconLoss)."""

    scope: Literal["shared", "per_position", "per_batch_per_position"] = "shared"
    optimizer: Literal["adam", "sign"] = "adam"
    lr: PosF = 0.01
    schedule: Literal["constant", "linear", "cosine"] = "constant"
    warmup_frac: Frac = 0.0
    final_lr_frac: Frac = 0.0
    b1: Frac = 0.9
    b2: Frac = 0.999
    eps: NonNegF = 1e-8
    n_warmup_steps: NonNeg = 0
    sigmoid: bool = False
    routing: Literal["all", "uniform_k", "static_p"] = "all"
    routing_p: Prob = 0.5

    @model_validator(mode="before")
    @classmethod
    def _removed_keys(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, why in _PPGD_REMOVED.items():
                if key in data:
                    raise ValueError(f"`{key}` {why}")
            new = _PPGD_RENAMED_SCOPES.get(data.get("scope"))  # type: ignore[arg-type]
            if new:
                raise ValueError(f"scope {data['scope']!r} is now called {new!r}")
        return data


class PgdConfig(Section):
    """Non-persistent PGD sources (the reference's PGDReconLoss): re-initialised on every step,
    `n_steps` sign-ascent steps of size `step_size`, then the loss with the final sources."""

    init: Literal["random", "ones", "zeroes"] = "random"
    step_size: PosF = 0.1
    n_steps: NonNeg = 1
    scope: Literal["per_example", "shared"] = "per_example"
    routing: Literal["all", "uniform_k", "static_p"] = "all"
    routing_p: Prob = 0.5


class TrainConfig(Section):
    steps: Pos = 10000
    batch_size: Pos = 4096
    log_every: Pos = 100
    eval_every: Pos = 1000
    eval_batch_size: Pos = 1024
    eval_rounding_threshold: Frac = 0.0
    max_bad_steps: Pos = 10
    grad_accum_steps: Pos = 1
    remat: Literal["none", "dots_saveable", "full"] = "none"
    optim: OptimConfig = OptimConfig()
    ci_optim: OptimConfig | None = None
    loss: LossConfig = LossConfig()
    ppgd: PpgdConfig = PpgdConfig()
    pgd: PgdConfig = PgdConfig()


class Config(Section):
    schema_: int = Field(SCHEMA_VERSION, alias="schema")
    run: RunConfig = RunConfig()
    target: Target = TmsTarget()
    data: DataConfig = DataConfig()
    mesh: MeshConfig = MeshConfig()
    distributed: DistributedConfig = DistributedConfig()
    precision: PrecisionConfig = PrecisionConfig()
    compile: CompileConfig = CompileConfig()
    checkpoint: CheckpointConfig = CheckpointConfig()
    tracking: TrackingConfig = TrackingConfig()
    measure: MeasureConfig = MeasureConfig()
    pretrain: PretrainConfig = PretrainConfig()
    decomp: DecompConfig = DecompConfig()
    warmup: WarmupConfig = WarmupConfig()
    train: TrainConfig = TrainConfig()

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


# Which config tables each stage's result depends on (cumulative: a stage is stale when anything
# upstream of it changed). Mesh, tracking, checkpoint cadence and compile cache do not change
# results.
_STAGE_DEPS = {
    "init_weights": ("run", "target", "data", "decomp", "precision"),
    "pretrain": ("pretrain",),
    "warmup": ("warmup",),
    "train": ("train",),
}


def stage_dependencies(stage: str) -> tuple[str, ...]:
    deps: list[str] = []
    for s in STAGES:
        deps.extend(_STAGE_DEPS[s])
        if s == stage:
            return tuple(deps)
    raise KeyError(stage)


def fingerprint(cfg: Config, stage: str) -> str:
    """A stable hash of the config tables `stage` depends on (defaults included, key order free)."""
    dumped = cfg.model_dump(mode="json", by_alias=True)
    deps = stage_dependencies(stage)
    if cfg.target.kind == "hf":  # an imported target is not trained: [pretrain] changes nothing
        deps = tuple(d for d in deps if d != "pretrain")
    tables: dict[str, Any] = {k: dumped[k] for k in deps}
    # init-weights also creates the PPGD sources, whose shape comes from [train] keys.
    tables["ppgd_sources"] = ppgd_source_layout(cfg)
    blob = json.dumps(tables, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


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
    tc = cfg.train
    if tc.ppgd.scope == "per_batch_per_position" and tc.batch_size % tc.grad_accum_steps:
        raise PdctlError(
            f"train.grad_accum_steps: {tc.grad_accum_steps} does not divide train.batch_size "
            f"{tc.batch_size} (per-batch PPGD sources are sized by the micro-batch)"
        )
    if not cfg.decomp.sites:
        raise PdctlError(
            "decomp.sites: empty; list the weight matrices to decompose, e.g. "
            'sites = [{ pattern = "linear1", C = 20 }]'
        )


SEQUENCE_TARGETS = ("llama_mlp", "hf")


def is_sequence_model(cfg: Config) -> bool:
    """Targets whose inputs are token sequences (batch, positions) and whose output is logits."""
    return cfg.target.kind in SEQUENCE_TARGETS


def ppgd_source_layout(cfg: Config) -> dict[str, Any]:
    """What the shape of the persistent PPGD sources depends on (init-weights creates them).

    Leading axes by scope: shared () ; per_position (seq_len,); per_batch_per_position
    (micro-batch,) for toys or (micro-batch, seq_len) for LMs. Trailing axis: C (+1 with the delta
    component)."""
    tc = cfg.train
    seq = is_sequence_model(cfg)
    if tc.ppgd.scope == "shared":
        lead: tuple[int, ...] = ()
    elif tc.ppgd.scope == "per_position":
        lead = (cfg.data.seq_len,)
    else:
        micro = tc.batch_size // tc.grad_accum_steps
        lead = (micro, cfg.data.seq_len) if seq else (micro,)
    return {"leading": list(lead), "sigmoid": tc.ppgd.sigmoid}


def match_sites(cfg: Config, site_paths: list[str]) -> dict[str, int]:
    """Resolve `decomp.sites` globs to {site path: C} in the target's order.

    A pattern that matches nothing, or a path matched by two patterns, is a config error."""
    owner: dict[str, int] = {}
    for i, site in enumerate(cfg.decomp.sites):
        hits = [p for p in site_paths if fnmatch.fnmatchcase(p, site.pattern)]
        if not hits:
            raise PdctlError(
                f"decomp.sites.{i}.pattern: {site.pattern!r} matches no site of this "
                f"{cfg.target.kind} target (sites: {', '.join(site_paths)})"
            )
        for p in hits:
            if p in owner:
                j = owner[p]
                raise PdctlError(
                    f"decomp.sites.{i}.pattern: {site.pattern!r} matches {p!r}, which "
                    f"decomp.sites.{j}.pattern already matched"
                )
            owner[p] = i
    return {p: cfg.decomp.sites[owner[p]].C for p in site_paths if p in owner}
