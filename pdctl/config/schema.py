"""The typed schema of pdctl.toml: every table as a pydantic model, every key with its default,
its range and its description (a table's model with its docstring where there is more to say),
and what the schema alone implies (`match_sites`, the PPGD sources' layout, ...). Loading a TOML
dict into it is `pdctl.config.load`; `pdctl.toml.example` is rendered from it by
`pdctl.config.example`."""

from __future__ import annotations

import fnmatch
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pdctl.errors import PdctlError

SCHEMA_VERSION = 1

Pos = Annotated[int, Field(gt=0)]
NonNeg = Annotated[int, Field(ge=0)]
# Floats are finite: `lr = inf` or `nan` is a mistake, never a setting.
PosF = Annotated[float, Field(gt=0, allow_inf_nan=False)]
NonNegF = Annotated[float, Field(ge=0, allow_inf_nan=False)]
Frac = Annotated[float, Field(ge=0, le=1, allow_inf_nan=False)]
Prob = Annotated[float, Field(gt=0, le=1, allow_inf_nan=False)]
DType = Literal["float32", "bfloat16", "float16"]
MatmulPrecision = Literal["default", "high", "highest"]


class Section(BaseModel):
    # strict: TOML already has types, so "5" for an int is a mistake, not something to coerce.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


# The `kind` of every [target] variant: the tag that picks the variant.
_KIND = "tms | resid_mlp | llama_mlp | hf"


class RunConfig(Section):
    seed: NonNeg = Field(
        0, description="one seed for every random stream of the run (init, data, masks)"
    )
    description: str = Field("", description="free text, shown by tooling and sent to the tracker")


class TmsTarget(Section):
    """Toy model of superposition, h = x @ W (site linear1), y = relu(h @ W^T + b)."""

    kind: Literal["tms"] = Field("tms", description=_KIND)
    n_features: Pos = Field(5, description="input/output features")
    n_hidden: Pos = Field(2, description="bottleneck width")
    n_hidden_layers: NonNeg = Field(
        0, description="identity-initialised hidden layers between the two sites"
    )
    tied_weights: bool = Field(True, description="linear2 uses linear1's transpose")
    bias: bool = Field(True, description="output bias b")


class ResidMlpTarget(Section):
    """Fixed unit-norm embedding, residual MLP layers (sites layers.N.mlp_in, layers.N.mlp_out)."""

    kind: Literal["resid_mlp"] = Field("resid_mlp", description=_KIND)
    n_features: Pos = Field(100, description="input/output features")
    d_embed: Pos = Field(1000, description="residual stream width")
    d_mlp: Pos = Field(50, description="MLP hidden width")
    n_layers: Pos = Field(1, description="residual MLP layers")
    embed_seed: NonNeg = Field(0, description="seed of the fixed random embedding W_E")
    bias: bool = Field(False, description="MLP biases (the canonical ResidMLP-1 has none)")


class LlamaTarget(Section):
    """Llama-style LM (RMSNorm, RoPE causal attention, MLP), sites layers.N.mlp.*."""

    kind: Literal["llama_mlp"] = Field("llama_mlp", description=_KIND)
    vocab_size: Pos = Field(256, description="tokens (256: bytes)")
    d_model: Pos = Field(
        64, description="residual width (divisible by n_heads, d_model / n_heads even)"
    )
    n_layers: Pos = Field(2, description="transformer blocks")
    n_heads: Pos = Field(4, description="attention heads")
    d_mlp: Pos = Field(256, description="MLP hidden width")
    glu: bool = Field(False, description="true: gate/up/down GLU MLP; false: up -> GELU -> down")
    tied_embeddings: bool = Field(True, description="logits through the embedding's transpose")
    rope_theta: PosF = Field(10000.0, description="RoPE base frequency")

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
    """A pretrained Hugging Face causal LM (LlamaForCausalLM, Qwen2ForCausalLM,
    Qwen3ForCausalLM, GPT2LMHeadModel) read from a local directory; sites are its module paths
    (model.layers.N.mlp.down_proj, transformer.h.N.attn.c_attn, ...); no pretrain stage."""

    kind: Literal["hf"] = Field("hf", description=_KIND)
    path: Annotated[str, Field(min_length=1)] = Field(
        description="the directory with config.json, *.safetensors and tokenizer.json "
        "(relative paths are relative to the run directory)",
        examples=["model"],
    )


Target = Annotated[TmsTarget | ResidMlpTarget | LlamaTarget | HfTarget, Field(discriminator="kind")]


class DataConfig(Section):
    feature_probability: Frac = Field(
        0.05, description="toys: each feature active with this probability, value U[0,1]"
    )
    path: str = Field(
        "",
        description='llama_mlp: local text file (read as bytes); "" = synthetic corpus\n'
        "hf: .txt / .jsonl / .parquet file or a directory (required)",
    )
    text_field: Annotated[str, Field(min_length=1)] = Field(
        "text", description="hf: the .jsonl field / .parquet column with each document"
    )
    eos_id: NonNeg | None = Field(
        None,
        description="hf: the id between documents (default: the tokenizer's EOS)",
        examples=[0],
    )
    seq_len: Pos = Field(64, description="llama_mlp, hf: tokens per sequence")
    separator: str = Field(
        "",
        description='hf: "" = a .txt file is one document; else every line holding only this '
        'string ends a document, and suffix-less files are text too (fortune files: "%")',
    )
    eval_fraction: Annotated[float, Field(ge=0.0, lt=1.0)] = Field(
        0.0,
        description="hf: fraction of the documents held out for evaluation and the report, "
        "split by document (a fixed draw per document index), never by token; 0 = evaluate "
        "on the training stream",
    )
    eval_path: str = Field(
        "",
        description="hf: a separate corpus to evaluate on (as path); excludes eval_fraction",
    )
    synthetic_bytes: Pos = Field(
        2_000_000, description="llama_mlp: size of the seeded synthetic corpus in bytes"
    )

    @model_validator(mode="after")
    def _one_eval_source(self) -> DataConfig:
        if self.eval_path and self.eval_fraction > 0:
            raise ValueError("set one of data.eval_path and data.eval_fraction, not both")
        return self


class MeshConfig(Section):
    data: int = Field(
        -1, ge=-1, description="data-parallel mesh axis size (-1 = all devices left after fsdp)"
    )
    fsdp: int = Field(
        1, ge=-1, description="parameter-sharding mesh axis size (-1 = all devices left after data)"
    )
    tp: int = Field(
        1,
        ge=1,
        description=(
            "tensor-parallel mesh axis size: each LM block's attention and MLP projections "
            "(and their components) split over tp devices, column-parallel q/k/v/gate/up, "
            "row-parallel o/down; must divide the heads, kv heads and MLP width"
        ),
    )
    fsdp_min_param_size: NonNeg = Field(
        1024, description="arrays with fewer elements than this stay replicated"
    )
    decomposition: Literal["auto", "fsdp", "all"] = Field(
        "auto",
        description=(
            "mesh axes the components (V, U and their optimizer moments) shard over by their "
            "component axis: fsdp, or all (every device holds and updates 1/N of each site, "
            "no device repeats another's weight-space work); auto = all for LM targets, fsdp "
            "for the toys"
        ),
    )

    @model_validator(mode="after")
    def _one_wildcard(self) -> MeshConfig:
        if self.data == 0 or self.fsdp == 0:
            raise ValueError("mesh sizes must be positive or -1 (all remaining devices)")
        if self.data == -1 and self.fsdp == -1:
            raise ValueError("only one of mesh.data and mesh.fsdp may be -1")
        return self


class DistributedConfig(Section):
    """Left at the defaults, pdctl detects SLURM / TPU pods or runs one process."""

    coordinator: str = Field(
        "", description='"host:port" of process 0 ("" = from the environment, or a single host)'
    )
    num_processes: NonNeg = Field(0, description="processes in the job (0 = from the environment)")
    process_id: int = Field(
        -1, ge=-1, description="this process's index (-1 = from the environment)"
    )
    local_device_ids: list[NonNeg] = Field(
        [], description="devices this process uses ([] = all local devices)"
    )
    init_timeout_s: Pos = Field(300, description="seconds to wait for every process to join")
    heartbeat_timeout_s: Pos = Field(
        100,
        description=(
            "seconds of silence after which JAX gives a process up (a host or network gone "
            "quiet); a process that dies is noticed within a second without it"
        ),
    )


class PrecisionConfig(Section):
    """Each dtype is one of float32 | bfloat16 | float16."""

    param_dtype: DType = Field("float32", description="dtype parameters are stored and updated in")
    compute_dtype: DType = Field(
        "float32",
        description="dtype of matmuls and activations (the faithfulness term is float32 always)",
    )
    target_dtype: DType | None = Field(
        None,
        examples=["bfloat16"],
        description=(
            "dtype an imported target's frozen weights are stored in (unset: param_dtype); "
            "bfloat16 halves their memory and reads: every stage then decomposes the model with "
            "its weights rounded to bfloat16 (faithfulness compares V U with those, exactly)"
        ),
    )
    matmul: MatmulPrecision = Field(
        "default",
        description=(
            "precision of a step's matmuls other than faithfulness (always full float32): "
            "default (a TPU's one bf16 pass: fastest) | high (three bf16 passes, ~1.8x the "
            "step on a v5e) | highest (float32, ~3.2x); a CPU computes float32 under each"
        ),
    )
    eval_matmul: MatmulPrecision = Field(
        "highest",
        description=(
            "precision of the evaluations' matmuls (CE / KL of the masked models): at a TPU's "
            "default the unmasked model alone is off by a KL of ~1e-4"
        ),
    )

    @model_validator(mode="before")
    @classmethod
    def _output_dtype_removed(cls, data: Any) -> Any:
        # `output_dtype` was never applied (losses and metrics are float32): an old config
        # that sets it to float32 still loads; any other value would not do what it says.
        if isinstance(data, dict) and "output_dtype" in data:
            if data["output_dtype"] != "float32":
                raise ValueError(
                    "`output_dtype` is gone: losses and metrics are always float32; delete the key"
                )
            data = {k: v for k, v in data.items() if k != "output_dtype"}
        return data


class CompileConfig(Section):
    cache_dir: str | None = Field(
        None,
        examples=["cache/compile"],
        description="persistent JAX compilation cache directory (unset: $PDCTL_COMPILE_CACHE "
        'if set, else cache/compile in the run directory; "" = none), so that a rerun or '
        "resume skips most of the compile; a relative path is "
        "relative to the run directory. It holds compiled code that pdctl loads and executes: "
        "use a directory only you can write (pdctl refuses one writable by others or owned by "
        "another user, and creates a missing one 0700); pdctl marks the directories it creates "
        "and signs every entry with your key, refuses a directory holding files without its "
        "mark (one that came with someone else's run directory) and never loads an entry it "
        "did not write",
    )
    ahead: bool | Literal["auto"] = Field(
        "auto",
        description="compile on a host thread, into the compile cache, what runs later: "
        "`pdctl run` compiles the later stages' steps while the earlier stages run, and train "
        "its evaluation's programs while its steps run, so that each starts from the cache "
        "(auto: on for one process on a GPU or TPU, whose host cores are free meanwhile; off "
        "on CPU, where the compiles would take the cores the stages run on, and under "
        "jax.distributed). Needs the compile cache",
    )


class CheckpointConfig(Section):
    every: Pos = Field(
        1000, description="steps between checkpoints (also saved at the end and on SIGTERM)"
    )
    keep: Pos = Field(3, description="newest checkpoints kept per stage")


class TrackingConfig(Section):
    wandb: Literal["disabled", "offline", "online"] = Field(
        "disabled",
        description="disabled | offline | online (metrics always go to metrics/<stage>.jsonl)",
    )
    project: str = Field("pdctl", description="wandb project")
    entity: str = Field("", description='wandb entity (team or user; "" = your default)')


class MeasureConfig(Section):
    peak_tflops: NonNegF = Field(
        0.0, description="device peak TFLOP/s for the MFU estimate (0 = look up by device kind)"
    )


_REMAT = "rematerialisation policy: none | dots_saveable | full"
_BATCH = "examples (sequences for LMs) per step, global across devices"


class OptimConfig(Section):
    """AdamW with a learning-rate schedule. The same keys make up [train.optim] and
    [train.ci_optim]."""

    lr: PosF = Field(1e-3, description="peak learning rate (> 0)")
    weight_decay: NonNegF = Field(0.0, description="AdamW weight decay")
    b1: Frac = Field(0.9, description="Adam beta1")
    b2: Frac = Field(0.999, description="Adam beta2")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "cosine",
        description="constant | linear | cosine (decay from the peak to final_lr_frac * lr)",
    )
    warmup_frac: Frac = Field(
        0.0, description="fraction of steps with a linear warmup from 0 to the peak"
    )
    final_lr_frac: Frac = Field(0.0, description="lr at the last step, as a fraction of the peak")
    grad_clip: NonNegF = Field(0.0, description="global-norm gradient clipping (0 = off)")
    moments_dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="storage of Adam's first moment: float32 | bfloat16 (half its bytes; the "
        "second moment stays float32: at b2 = 0.999 a bfloat16 average cannot move)",
    )


class PretrainConfig(Section):
    """Skipped when you bring your own weights (target.kind = "hf")."""

    steps: Pos = Field(1000, description="optimizer steps")
    batch_size: Pos = Field(1024, description=_BATCH)
    log_every: Pos = Field(100, description="steps between logged metrics")
    max_bad_steps: Pos = Field(
        10, description="consecutive non-finite steps (update skipped) before failing"
    )
    grad_accum_steps: Pos = Field(1, description="micro-batches accumulated per optimizer step")
    remat: Literal["none", "dots_saveable", "full"] = Field("none", description=_REMAT)
    optim: OptimConfig = Field(OptimConfig(), description="optimizer of the target model")


class SiteConfig(Section):
    """One entry of decomp.sites."""

    pattern: Annotated[str, Field(min_length=1)] = Field(
        description='glob over the target\'s site paths, such as "layers.*.mlp.up"'
    )
    C: Pos = Field(description="components of every site the pattern matches")


class CiFnConfig(Section):
    """mlp: one MLP per component on (x @ V)_c; vector_mlp: one MLP per component on x;
    shared_mlp: one MLP from x to all C logits; transformer (language models): a small
    bidirectional transformer over each site's RMS-normalised inputs along the sequence;
    global_shared_transformer (language models): ONE such transformer for all sites, over all
    their inputs (each projected to d_model and summed), with one CI head per site."""

    type: Literal["mlp", "vector_mlp", "shared_mlp", "transformer", "global_shared_transformer"] = (
        Field(
            "mlp",
            description="mlp | vector_mlp | shared_mlp | transformer | global_shared_transformer",
        )
    )
    hidden: list[Pos] = Field([16], description="hidden layer widths (the MLP types)")
    d_model: Pos = Field(64, description="transformer: width of its residual stream")
    n_heads: Pos = Field(
        4, description="transformer: attention heads (d_model / n_heads must be even: RoPE)"
    )
    n_blocks: NonNeg = Field(2, description="transformer: attention + MLP blocks")
    ffn_hidden: Pos = Field(256, description="transformer: hidden width of each block's MLP")

    def arch(self) -> tuple[int, ...]:
        """The static shape argument of `components.init_ci_fn` for this type: the MLP types'
        hidden widths, or the transformer's (d_model, n_heads, n_blocks, ffn_hidden)."""
        if self.type in ("transformer", "global_shared_transformer"):
            return (self.d_model, self.n_heads, self.n_blocks, self.ffn_hidden)
        return tuple(self.hidden)


class DecompConfig(Section):
    sites: list[SiteConfig] = Field(
        [],
        description='which weight matrices ("sites") to decompose: glob patterns over the '
        "target's site paths, each with its component count C. Default: [] (no sites; list at "
        "least one). A pattern that matches nothing, or a site matched by two patterns, is an "
        "error",
        examples=[[{"pattern": "linear1", "C": 20}, {"pattern": "linear2", "C": 20}]],
    )
    delta_component: bool = Field(
        True, description="add W - V U as one more maskable component per site"
    )
    init: Literal["random", "nonlinearity_aligned"] = Field(
        "random",
        description="components' init: random (V ~ N(0, 1/d_in), U ~ N(0, 1/C)) | "
        "nonlinearity_aligned (MLP sites: each component one MLP neuron's slice of W, so with "
        "C = neurons V U = W exactly and no warmup is needed; C above: neurons split, below: "
        "neurons sampled; other sites stay random). Applied when warmup starts, from the "
        "trained target",
    )
    sigmoid: Literal["leaky_hard", "lower_leaky_hard", "hard"] = Field(
        "leaky_hard",
        description="CI squashing: leaky_hard (masks: clamp with a sign-gated leak in the "
        "backward; importance minimality: upper-leaky) | lower_leaky_hard (that clamp for "
        "both) | hard (plain clip for both)",
    )
    sampling: Literal["continuous", "binomial"] = Field(
        "continuous",
        description="masks ci + (1 - ci) r: r ~ U[0,1] (continuous) | r in {0,1} (binomial)",
    )
    n_mask_samples: Pos = Field(1, description="stochastic masks drawn per example")
    ci_threshold: Frac = Field(
        0.1, description="a component counts as active (L0, evals) when its CI exceeds this"
    )
    ci_fn: CiFnConfig = Field(
        CiFnConfig(), description="the causal-importance (CI) function of each site"
    )


class WarmupConfig(Section):
    """AdamW on V, U only (loss = faithfulness); its optimizer is discarded."""

    steps: NonNeg = Field(400, description="optimizer steps (0 = skip)")
    lr: PosF = Field(0.01, description="constant learning rate (> 0)")
    weight_decay: NonNegF = Field(0.1, description="AdamW weight decay")
    log_every: Pos = Field(100, description="steps between logged metrics")
    max_bad_steps: Pos = Field(
        10, description="consecutive non-finite steps before the stage fails"
    )


Routing = Literal["uniform_k", "static_p"]


class LossConfig(Section):
    """total = sum of coefficient * term; every coefficient is explicit (0 = the term is not
    computed)."""

    faithfulness: NonNegF = Field(
        0.0, description="coefficient: ||W - V U||^2 / numel(W), over every site"
    )
    importance_minimality: NonNegF = Field(
        3e-3,
        description="coefficient: mean over examples of the per-CI penalty (`sparsity`), summed "
        "over components",
    )
    p: PosF = Field(1.0, description="importance minimality exponent (at the start of the anneal)")
    p_final: PosF | None = Field(
        None,
        description="exponent at the end of the anneal (default unset: p constant)",
        examples=[1.0],
    )
    p_anneal_start: Frac = Field(
        0.0, description="fraction of training where p starts moving towards p_final"
    )
    p_anneal_end: Frac = Field(
        1.0, description="fraction of training where it reaches p_final (>= start)"
    )
    beta: NonNegF = Field(
        0.0, description="weight of the m_c * log2(1 + S_c) term of importance minimality"
    )
    eps: NonNegF = Field(1e-12, description="added to ci before the power")
    stochastic_recon: NonNegF = Field(
        1.0, description="coefficient: reconstruction, all sites stochastically masked"
    )
    stochastic_recon_layerwise: NonNegF = Field(
        1.0, description="coefficient: one site masked at a time"
    )
    stochastic_recon_subset: NonNegF = Field(
        0.0, description="coefficient: a routed random subset of sites masked"
    )
    subset_routing: Routing = Field(
        "uniform_k",
        description="subset: uniform_k (k ~ U{1..n_sites} per example, then k random sites) | "
        "static_p (each site with probability p)",
    )
    subset_p: Prob = Field(0.5, description="static_p routing: probability that a site is masked")
    ppgd_recon: NonNegF = Field(
        0.0,
        description="coefficient: reconstruction with persistent adversarial sources "
        "([train.ppgd])",
    )
    pgd_recon: NonNegF = Field(
        0.0, description="coefficient: reconstruction with per-step PGD sources ([train.pgd])"
    )
    ci_masked_recon: NonNegF = Field(
        0.0,
        description="coefficient: reconstruction with mask = ci (a monitor: a model trained on "
        "it can drive it to 0 without a useful decomposition)",
    )
    unmasked_recon: NonNegF = Field(0.0, description="coefficient: reconstruction with mask = 1")
    output: Literal["mse", "kl"] = Field(
        "mse", description="reconstruction distance: mse | kl (KL(target || masked), LMs)"
    )
    # The LM recipe of goodfire-ai/param-decomp (core/SPEC.md S8-S9, S8'', S34).
    sparsity: Literal["lp", "smooth_l0"] = Field(
        "lp",
        description="per-CI penalty of importance minimality (and of the frequency term): lp = "
        "(ci_upper + eps)^p | smooth_l0 = ci^2 / (ci^2 + gamma^2), bounded gradient, -> L0 as "
        "gamma -> 0",
    )
    gamma: PosF = Field(1.0, description="smooth_l0: width gamma (at the start of its anneal)")
    gamma_final: PosF | None = Field(
        None,
        description="smooth_l0: gamma at the end of the anneal (default unset: constant; the LM "
        "recipe anneals 1 -> 0.01 over 90% of the run)",
        examples=[0.01],
    )
    gamma_anneal_start: Frac = Field(
        0.0, description="fraction of training where gamma starts moving towards gamma_final"
    )
    gamma_anneal_end: Frac = Field(
        1.0, description="fraction of training where it reaches gamma_final (>= start)"
    )
    normalize_at_one: bool = Field(
        False,
        description="smooth_l0: multiply the penalty by (1 + gamma^2), so ci = 1 costs exactly 1",
    )
    frequency: NonNegF = Field(
        0.0,
        description="coefficient: frequency term sum_s sum_c f_c log2(1 + frequency_a f_c), f_c = "
        "the mean penalty of component c over the batch's examples (and positions)",
    )
    frequency_a: PosF | None = Field(
        None,
        description="a' of the frequency term (the reference datapoint count; default unset: the "
        "examples (x positions) of one train batch, where frequency = importance_minimality * "
        "beta reproduces beta's term)",
        examples=[32768.0],
    )
    frequency_ema_halflife: PosF | None = Field(
        None,
        description="frequency term at a debiased EMA of f_c with this half-life in steps, the "
        "gradient through the batch's f_c (default unset: the batch's f_c; the EMA is train "
        "state, checkpointed)",
        le=1e6,
        examples=[200.0],
    )
    merged_recon: NonNegF = Field(
        0.0,
        description="coefficient: stochastic and PPGD reconstruction in ONE masked forward: each "
        "example takes the persistent sources ([train.ppgd]) at every site with probability "
        "adv_fraction, else fresh uniform masks routed by subset_routing (1.0 with adv_fraction "
        "0.5 replaces 0.5 stochastic_recon_subset + 0.5 ppgd_recon in expectation)",
    )
    adv_fraction: Frac = Field(
        0.5, description="merged_recon: probability that an example is masked adversarially"
    )
    # goodfire-ai/param-decomp's ChunkwiseSubsetReconLoss
    chunkwise_recon: NonNegF = Field(
        0.0,
        description="coefficient: the sites cut into chunks of sites_per_chunk; per chunk one "
        "masked forward (per decomp.n_mask_samples) with only that chunk's sites masked, "
        "routed among them by subset_routing, from the clean stream at the chunk's first "
        "block; the mean over chunks (param-decomp scales it 0.5 x the number of chunks)",
    )
    sites_per_chunk: Pos | None = Field(
        None,
        description="chunkwise_recon: consecutive sites (in the target's site order) per chunk, "
        "the last chunk shorter if they do not divide (default unset: one chunk of every site, "
        "the stochastic_recon_subset term)",
        examples=[56],
    )

    @model_validator(mode="after")
    def _anneal_order(self) -> LossConfig:
        if self.p_anneal_end < self.p_anneal_start:
            raise ValueError("p_anneal_end must be >= p_anneal_start")
        if self.gamma_anneal_end < self.gamma_anneal_start:
            raise ValueError("gamma_anneal_end must be >= gamma_anneal_start")
        if self.sparsity == "lp" and (self.gamma_final is not None or self.normalize_at_one):
            key = "gamma_final" if self.gamma_final is not None else "normalize_at_one"
            raise ValueError(f"{key} is a smooth_l0 setting; set sparsity = 'smooth_l0'")
        if self.sparsity == "smooth_l0" and self.p_final is not None:
            raise ValueError("p_final anneals the lp penalty; smooth_l0 anneals gamma_final")
        if self.ppgd_recon > 0 and self.merged_recon > 0:
            raise ValueError(
                "ppgd_recon and merged_recon both use the persistent sources; set one of them "
                "to 0 (a source set feeds one term)"
            )
        return self


# Keys and values of [train.ppgd] that earlier pdctl versions read with another meaning.
_PPGD_REMOVED = {
    "n_steps": "removed: PPGD now takes ONE source step per train step, from the gradient of "
    "that step's PPGD loss; use `n_warmup_steps` for extra ascent steps on each batch",
    "warmup_steps": "removed: use `n_warmup_steps` (extra ascent steps on EVERY train step)",
}
_PPGD_RENAMED_SCOPES = {"batch": "shared", "position": "per_position"}
_ROUTING = "all | uniform_k | static_p: which sites the adversary masks"
# [train.ppgd] pool_size: the sources are (micro-batch, pool_size, C) per site, so a pool far
# past any use (1e15) would be refused only by XLA, deep inside init-weights
MAX_POOL_SIZE = 4096


class PpgdConfig(Section):
    """Persistent adversarial sources (persistent PGD; PersistentPGDReconLoss in the SPD
    reference code). Each train step: n_warmup_steps extra ascent steps on the batch, the PPGD
    loss with the sources as they then are, and after the main update ONE ascent step from that
    loss's gradient. The sources persist across steps and are checkpointed; masks are
    ci + (1 - ci) * source."""

    scope: Literal["shared", "per_position", "per_batch_per_position", "pooled"] = Field(
        "shared",
        description="shared: one source per component | per_position: one per position (LMs) | "
        "per_batch_per_position: one per example (and position) | pooled: pool_size per example",
    )
    optimizer: Literal["adam", "sign"] = Field("adam", description="source ascent: adam | sign")
    lr: PosF = Field(0.01, description="source learning rate (peak of its schedule)")
    schedule: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="constant | linear | cosine, like the optimizers' schedules"
    )
    warmup_frac: Frac = Field(
        0.0, description="fraction of train steps with a linear warmup of the source lr"
    )
    final_lr_frac: Frac = Field(
        0.0, description="linear/cosine: source lr at the last step, as a fraction of lr"
    )
    b1: Frac = Field(0.9, description="Adam beta1 of the sources")
    b2: Frac = Field(0.999, description="Adam beta2 of the sources")
    eps: NonNegF = Field(1e-8, description="Adam epsilon of the sources")
    n_warmup_steps: NonNeg = Field(
        0, description="extra ascent steps on each batch, before the loss, on EVERY step"
    )
    sigmoid: bool = Field(
        False, description="unconstrained sources seen through a sigmoid (no clipping)"
    )
    routing: Literal["all", "uniform_k", "static_p"] = Field(
        "all", description=_ROUTING + " (merged_recon's ascent steps: every site)"
    )
    routing_p: Prob = Field(0.5, description="static_p routing: probability per site")
    pool_size: Annotated[int, Field(gt=0, le=MAX_POOL_SIZE)] = Field(
        4,
        description="scope pooled: persistent particles per example; each step every example "
        f"draws one, shared by its positions and every site (at most {MAX_POOL_SIZE})",
    )
    unroll: bool = Field(
        False,
        description="the n_warmup_steps ascents as straight-line code, not a loop (no loop "
        "boundary for XLA to schedule around; a longer compile)",
    )
    dtype: Literal["float32", "bfloat16"] = Field(
        "float32",
        description="storage of the sources and of their Adam first moment: float32 | bfloat16 "
        "(each ascent step computes in float32; the second moment stays float32)",
    )
    ascent_examples: Literal["all", "assigned"] = Field(
        "all",
        description="the n_warmup_steps ascents' examples: all | assigned (with merged_recon: "
        "only the examples the step's merged term masks by the sources, exactly "
        "round(adv_fraction x micro-batch) of them instead of a Bernoulli draw each; the "
        "ascents then cost that fraction of their forwards)",
    )

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
    """Non-persistent PGD sources (PGDReconLoss in the SPD reference code): re-initialised on
    every step, n_steps sign-ascent steps of size step_size, then the loss with the final
    sources."""

    init: Literal["random", "ones", "zeroes"] = Field(
        "random", description="random (U[0,1)) | ones | zeroes"
    )
    step_size: PosF = Field(0.1, description="size of each sign step")
    n_steps: NonNeg = Field(1, description="ascent steps per train step")
    scope: Literal["per_example", "shared"] = Field(
        "per_example",
        description="per_example: one source per example (and position) | shared",
    )
    routing: Literal["all", "uniform_k", "static_p"] = Field("all", description=_ROUTING)
    routing_p: Prob = Field(0.5, description="static_p routing: probability per site")


class EvalPgdConfig(Section):
    """The fresh-PGD evaluation of LM runs (goodfire-ai/param-decomp SPEC.md section 10, its
    fast-tier `PGDReconLoss` probe with `source_shape: c`): sources drawn fresh at each
    evaluation, n_steps sign-ascent steps of step_size on KL(target || masked) with the CI and
    components held fixed, then the CE and KL of the model masked by them (`kl_pgd`, `ce_pgd`
    in the evaluation): the robustness figure of a decomposition."""

    enabled: bool = Field(True, description="LMs: run the fresh-PGD evaluation at each eval")
    n_steps: NonNeg = Field(
        20, description="sign-ascent steps (0: the KL at the initial sources themselves)"
    )
    step_size: PosF = Field(0.1, description="size of each sign step (sources live in [0, 1])")
    init: Literal["random", "ones", "zeroes"] = Field(
        "random", description="initial sources: random (U[0,1)) | ones | zeroes"
    )
    scope: Literal["shared", "per_example"] = Field(
        "shared",
        description="shared: one source per component for the whole batch and every position | "
        "per_example: one per example and position",
    )


# `[train] scan_layers = "auto"` turns the scan on when the decomposed sites sit in at least this
# many layers: where the scanned step compiled faster than the unrolled one
# (benchmarks/startup/scan_compile.py, docs/performance.md "scan_layers = auto").
AUTO_SCAN_LAYERS = 4


class TrainConfig(Section):
    steps: Pos = Field(10000, description="optimizer steps")
    batch_size: Pos = Field(4096, description=_BATCH)
    log_every: Pos = Field(100, description="steps between logged metrics")
    eval_every: Pos = Field(
        1000, description="steps between evaluations (CI errors, L0, masked CE/KL for LMs)"
    )
    eval_batch_size: Pos = Field(1024, description="examples per evaluation")
    eval_accum_steps: Pos = Field(
        1,
        description=(
            "LMs: the evaluation's masked forwards in this many equal micro-batches of the "
            "evaluation batch, one after another (the same figures to float32 reassociation: "
            "each micro-batch draws its rows of the whole batch's masks, and the fresh-PGD "
            "ascent steps on the whole batch's gradient), so that a device holds one "
            "micro-batch's activations; must divide eval_batch_size. Not part of the fingerprint"
        ),
    )
    eval_rounding_threshold: Frac = Field(
        0.0, description='LMs: the "rounded" masking evaluates ci > this as 1, else 0'
    )
    max_bad_steps: Pos = Field(
        10, description="consecutive non-finite steps (update skipped) before failing"
    )
    grad_accum_steps: Pos = Field(1, description="micro-batches accumulated per optimizer step")
    remat: Literal["none", "dots_saveable", "full"] = Field("none", description=_REMAT)
    scan_layers: bool | Literal["auto", "all"] = Field(
        "auto",
        description=(
            "imported (hf) models: run the layers that have sites as a scan and hold each site "
            "that repeats over consecutive layers as one stacked array that the whole step "
            "works on, so that the train step's compile time does not grow with depth "
            "(measured on CPU: the step itself ran 0.75-0.8x as fast, see docs/performance.md). "
            f'"auto": on when the decomposed sites sit in {AUTO_SCAN_LAYERS} layers or more; '
            'below that "all" on a TPU and off elsewhere. '
            '"all": on, and the runs of layers without sites (those before and after a few '
            "decomposed layers) scanned as well: a much smaller program, so a shorter compile "
            "and trace (a one-layer decomposition of a deep model), for a step that slices "
            "each of those layers' weights out of a stack. "
            "Not part of the fingerprint: a run resumes across a change of it"
        ),
    )
    init_from: str = Field(
        "",
        description=(
            "another run's directory (relative to this one): start from its train stage's "
            "final decomposition (V, U, CI functions; structure checked) with a fresh "
            "optimizer, PPGD sources and step counter, instead of warmup's components. The "
            "parent's train must be done (unless init_from_step names a checkpoint); a rerun of "
            "it (a new run id) makes this train stale"
        ),
    )
    init_from_step: NonNeg | None = Field(
        None,
        examples=[5000],
        description=(
            "with init_from: start from the parent's train checkpoint at this step instead of "
            "its final one; the parent's train then need not be done (an interrupted or failed "
            "one), and the step is recorded in [state.train] init_from"
        ),
    )
    optim: OptimConfig = Field(
        OptimConfig(),
        description="optimizer of the components (and of the CI functions unless "
        "[train.ci_optim] is given)",
    )
    ci_optim: OptimConfig | None = Field(
        None,
        description="optional: a separate optimizer for the CI functions. When the table is "
        "absent they use train.optim; when present, a key left out takes the default below "
        "(not train.optim's value)",
    )
    loss: LossConfig = Field(LossConfig(), description="the SPD loss")
    ppgd: PpgdConfig = Field(
        PpgdConfig(),
        description="persistent PGD, used when train.loss.ppgd_recon or merged_recon > 0",
    )
    pgd: PgdConfig = Field(
        PgdConfig(), description="per-step PGD, used when train.loss.pgd_recon > 0"
    )
    eval_pgd: EvalPgdConfig = Field(
        EvalPgdConfig(), description="LMs: the fresh-PGD evaluation (the robustness figure)"
    )

    @field_validator("scan_layers", mode="before")
    @classmethod
    def _scan_layers_choice(cls, v: Any) -> Any:
        # one line naming the choices, not pydantic's one error per member of the union
        if not isinstance(v, bool) and v not in ("auto", "all"):
            raise ValueError('must be true, false, "auto" or "all"')
        return v


class Config(Section):
    schema_: int = Field(
        SCHEMA_VERSION,
        alias="schema",
        description=f"pdctl.toml schema version (required; this pdctl reads {SCHEMA_VERSION})",
    )
    run: RunConfig = Field(RunConfig(), description="the run as a whole")
    target: Target = Field(
        TmsTarget(),
        description="the network to decompose; `kind` picks the variant, each with only its own "
        "keys",
    )
    data: DataConfig = Field(DataConfig(), description="what the stages train and evaluate on")
    mesh: MeshConfig = Field(
        MeshConfig(), description="the device mesh, axes ('data', 'fsdp', 'tp')"
    )
    distributed: DistributedConfig = Field(DistributedConfig(), description="multi-host runs")
    precision: PrecisionConfig = Field(
        PrecisionConfig(), description="one precision policy for every stage"
    )
    compile: CompileConfig = Field(CompileConfig(), description="JAX compilation")
    checkpoint: CheckpointConfig = Field(
        CheckpointConfig(), description="orbax checkpoints, one manager per stage"
    )
    tracking: TrackingConfig = Field(TrackingConfig(), description="experiment tracking")
    measure: MeasureConfig = Field(MeasureConfig(), description="performance figures")
    pretrain: PretrainConfig = Field(
        PretrainConfig(), description="stage pretrain: trains the target model"
    )
    decomp: DecompConfig = Field(
        DecompConfig(),
        description="the decomposition: which weights, how many components, how masks are drawn",
    )
    warmup: WarmupConfig = Field(
        WarmupConfig(), description="stage warmup: fits the components to the target's weights"
    )
    train: TrainConfig = Field(
        TrainConfig(), description="stage train: SPD training of the components and CI functions"
    )

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, populate_by_name=True)


def assigned_per_micro_batch(tc: TrainConfig) -> int:
    """`[train.ppgd] ascent_examples = "assigned"`: the examples of a micro-batch that the
    merged term masks by the sources, round(adv_fraction x micro-batch)."""
    return round(tc.loss.adv_fraction * (tc.batch_size // tc.grad_accum_steps))


SEQUENCE_TARGETS = ("llama_mlp", "hf")


def is_sequence_model(cfg: Config) -> bool:
    """Targets whose inputs are token sequences (batch, positions) and whose output is logits."""
    return cfg.target.kind in SEQUENCE_TARGETS


def ppgd_source_layout(cfg: Config) -> dict[str, Any]:
    """What the shape of the persistent PPGD sources depends on (init-weights creates them).

    Leading axes by scope: shared () ; per_position (seq_len,); per_batch_per_position
    (micro-batch,) for toys or (micro-batch, seq_len) for LMs; pooled (micro-batch, pool_size).
    Trailing axis: C (+1 with the delta component)."""
    tc = cfg.train
    seq = is_sequence_model(cfg)
    if tc.ppgd.scope == "shared":
        lead: tuple[int, ...] = ()
    elif tc.ppgd.scope == "per_position":
        lead = (cfg.data.seq_len,)
    elif tc.ppgd.scope == "pooled":
        lead = (tc.batch_size // tc.grad_accum_steps, tc.ppgd.pool_size)
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
