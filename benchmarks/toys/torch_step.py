"""The torch reference (goodfire-ai/spd) SPD train step on TMS 5-2 and ResidMLP-1, on CPU.

What it runs: goodfire-ai/spd's training loop `spd.run_spd.optimize`, unmodified, at the commit
of `--spd` (printed with the results; written against 3f0bb61ebb56c493f8de5c21618d866bbed60298).
One of its iterations: `ComponentModel.calc_weight_deltas`, a fresh batch from spd's own data
generator (`SparseFeatureDataset` for TMS, `ResidMLPDataset` for ResidMLP, each behind
`DatasetGeneratedDataLoader`, as its `tms_decomposition.py` / `resid_mlp_decomposition.py` set
them up), the target forward with input caching, `calc_causal_importances`,
`spd.losses.compute_total_loss`, `backward`, the per-site L0 bookkeeping and `AdamW.step`. As in
`benchmarks/lm/torch_step.py`, two names in `spd.run_spd` are replaced for the run and nothing else:
`optim` (its `AdamW` stamps the end of every step of the main optimizer and stops the loop by
raising once enough steps are timed; the faithfulness warm-up's AdamW, built later, is left
untouched) and `save_file` (no checkpoint).

Config: spd's own experiment file (`spd/experiments/tms/tms_5-2_config.yaml`,
`spd/experiments/resid_mlp/resid_mlp1_config.yaml`), loaded with `yaml` and built into
`spd.configs.Config`. Every setting that the matching pdctl template
(`templates/tms/pdctl.toml`, `templates/resid-mlp/pdctl.toml`; pdctl's defaults for keys they
leave out) also fixes is then set to the template's value: batch size, sites and C, CI function
type and hidden widths, sigmoid, sampling, mask samples, delta component, the loss terms with
their coefficients, importance-minimality p / anneal / beta / eps, output loss, lr schedule,
gradient clipping, faithfulness warm-up, feature probability, CI threshold. Each value that
differs from spd's file is printed ("spd -> pdctl"); at 3f0bb61 none of these differ for either
toy. Then the benchmark's own settings, also printed: `autocast_bf16` off (spd defaults it to on
and neither toy file sets it, so spd would run these toys under bf16 autocast on CPU; pdctl is
float32), train logging / eval / slow eval only at step 0 (frequencies past the run, no slow
eval, no eval metrics beyond the loss terms, 1 eval batch), no wandb, `steps` = the timed
iterations + 1 (so the cosine lr schedule of TMS spans only this short run; step time does not
depend on the lr). The whole config used is printed as JSON.

Target: spd loads a pretrained target from a wandb run, which cannot be reached here. The
benchmark instead builds spd's own model class (`TMSModel`, `ResidMLP`) with randomly
initialised weights (seed 0) and the template's shapes: TMS 5 features, 2 hidden, no hidden
layers, linear1/linear2 tied (and their components tied, as `tms_decomposition.py` does), output
bias; ResidMLP 100 features, d_embed 1000, d_mlp 50, one layer, ReLU, no MLP biases. The work of
a step is dense matmuls and elementwise ops of fixed shapes, so its time does not depend on the
target's weight values. spd's ResidMLP has an unembedding `W_U` of its own where pdctl reads out
through `W_E^T`: same shape, same cost. The inputs follow the same law on both sides (each
feature on with the template's probability, values U[0, 1] for TMS, U[-1, 1] for ResidMLP).

Timing: each toy runs in a fresh child process with `torch.set_num_threads(2)`. Iteration i's
time is the gap between the ends of optimizer steps i-1 and i; step 0 (logging, eval) is never
timed. After `--warmup` iterations, `--windows` windows of `--window` iterations each; a
window's mean is its ms per step. Reported: the best window and the median iteration.

Setup (as in `lm/torch_step.py`; spd needs Python >= 3.12; on Python 3.13 PyPI's torch 2.13.0
is the CUDA build, which runs on the CPU here):

    git clone <goodfire-ai/spd> /work/spd-bench/spd
    ~/.pyenv/versions/3.13.0/bin/python -m venv /work/spd-bench/venv
    /work/spd-bench/venv/bin/pip install torch==2.13.0 transformers==5.24.0 \
        tokenizers==0.23.3 numpy "pydantic<2.12" wandb==0.23.1 wandb-workspaces==0.1.12 \
        fire tqdm jaxtyping einops matplotlib python-dotenv datasets scipy pillow pyyaml
    /work/spd-bench/venv/bin/pip install --no-deps -e /work/spd-bench/spd

Run (from the repository root):

    /work/spd-bench/venv/bin/python -m benchmarks.toys.torch_step --toys tms resid_mlp \
        --spd /work/spd-bench/spd
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import tomllib
import types
from pathlib import Path
from typing import Any

from benchmarks._harness import child_env, machine_line, module_argv

ROOT = Path(__file__).resolve().parents[2]
TOYS = {
    # toy: (spd config file under spd/experiments, pdctl template, label)
    "tms": ("tms/tms_5-2_config.yaml", "tms", "TMS 5-2"),
    "resid_mlp": ("resid_mlp/resid_mlp1_config.yaml", "resid-mlp", "ResidMLP-1"),
}
# pdctl's defaults (pdctl/config/schema.py) for [train.loss] / [train.optim] keys a template
# leaves out
PDCTL_LOSS_DEFAULTS: dict[str, Any] = {
    "faithfulness": 0.0,
    "importance_minimality": 3e-3,
    "p": 1.0,
    "p_final": None,
    "p_anneal_start": 0.0,
    "p_anneal_end": 1.0,
    "beta": 0.0,
    "eps": 1e-12,
    "stochastic_recon": 1.0,
    "stochastic_recon_layerwise": 1.0,
    "stochastic_recon_subset": 0.0,
    "subset_routing": "uniform_k",
    "subset_p": 0.5,
    "ppgd_recon": 0.0,
    "pgd_recon": 0.0,
    "ci_masked_recon": 0.0,
    "unmasked_recon": 0.0,
    "output": "mse",
}
PDCTL_OPTIM_DEFAULTS: dict[str, Any] = {
    "lr": 1e-3,
    "weight_decay": 0.0,
    "b1": 0.9,
    "b2": 0.999,
    "schedule": "cosine",
    "warmup_frac": 0.0,
    "final_lr_frac": 0.0,
    "grad_clip": 0.0,
}


class _Enough(Exception):
    """Raised from the optimizer once every timed step has run."""


def spd_losses_from_pdctl(loss: dict[str, Any]) -> list[dict[str, Any]]:
    """pdctl's [train.loss] as spd `loss_metric_configs` (terms with coefficient 0 left out)."""
    lo = PDCTL_LOSS_DEFAULTS | loss
    for key in ("ppgd_recon", "pgd_recon"):
        if lo[key]:
            sys.exit(f"pdctl train.loss.{key} != 0 has no one-to-one spd loss here")
    out: list[dict[str, Any]] = []
    if lo["faithfulness"]:
        out.append({"classname": "FaithfulnessLoss", "coeff": lo["faithfulness"]})
    if lo["importance_minimality"]:
        imp = {
            "classname": "ImportanceMinimalityLoss",
            "coeff": lo["importance_minimality"],
            "pnorm": lo["p"],
            "beta": lo["beta"],
            "eps": lo["eps"],
        }
        if lo["p_final"] is not None:
            imp |= {
                "p_anneal_start_frac": lo["p_anneal_start"],
                "p_anneal_final_p": lo["p_final"],
                "p_anneal_end_frac": lo["p_anneal_end"],
            }
        out.append(imp)
    if lo["stochastic_recon"]:
        out.append({"classname": "StochasticReconLoss", "coeff": lo["stochastic_recon"]})
    if lo["stochastic_recon_layerwise"]:
        out.append(
            {"classname": "StochasticReconLayerwiseLoss", "coeff": lo["stochastic_recon_layerwise"]}
        )
    if lo["stochastic_recon_subset"]:
        routing = (
            {"type": "uniform_k_subset"}
            if lo["subset_routing"] == "uniform_k"
            else {"type": "static_probability", "p": lo["subset_p"]}
        )
        out.append(
            {
                "classname": "StochasticReconSubsetLoss",
                "coeff": lo["stochastic_recon_subset"],
                "routing": routing,
            }
        )
    if lo["ci_masked_recon"]:
        out.append({"classname": "CIMaskedReconLoss", "coeff": lo["ci_masked_recon"]})
    if lo["unmasked_recon"]:
        out.append({"classname": "UnmaskedReconLoss", "coeff": lo["unmasked_recon"]})
    return out


def pdctl_settings(tpl: dict[str, Any]) -> dict[str, Any]:
    """The spd Config fields that a pdctl template fixes, in spd's terms."""
    dec, train, warm = tpl["decomp"], tpl["train"], tpl.get("warmup", {})
    opt = PDCTL_OPTIM_DEFAULTS | train.get("optim", {})
    if opt["weight_decay"] or (opt["b1"], opt["b2"]) != (0.9, 0.999):
        sys.exit("spd's main AdamW is fixed at weight_decay 0, betas (0.9, 0.999)")
    if "ci_optim" in train:
        sys.exit("pdctl [train.ci_optim] (a second optimizer) has no spd counterpart")
    constant = opt["schedule"] == "constant"
    return {
        "batch_size": train["batch_size"],
        "module_info": [{"module_pattern": s["pattern"], "C": s["C"]} for s in dec["sites"]],
        "ci_fn_type": dec.get("ci_fn", {}).get("type", "mlp"),
        "ci_fn_hidden_dims": dec.get("ci_fn", {}).get("hidden", [16]),
        "sigmoid_type": dec.get("sigmoid", "leaky_hard"),
        "sampling": dec.get("sampling", "continuous"),
        "n_mask_samples": dec.get("n_mask_samples", 1),
        "use_delta_component": dec.get("delta_component", True),
        "ci_alive_threshold": dec.get("ci_threshold", 0.1),
        "loss_metric_configs": spd_losses_from_pdctl(train.get("loss", {})),
        "output_loss_type": (PDCTL_LOSS_DEFAULTS | train.get("loss", {}))["output"],
        "lr_schedule": {
            "start_val": opt["lr"],
            "fn_type": opt["schedule"],
            "warmup_pct": opt["warmup_frac"],
            "final_val_frac": 1.0 if constant else opt["final_lr_frac"],
        },
        "grad_clip_norm_components": opt["grad_clip"] or None,
        "grad_clip_norm_ci_fns": opt["grad_clip"] or None,
        "faithfulness_warmup_steps": warm.get("steps", 400),
        "faithfulness_warmup_lr": warm.get("lr", 0.01),
        "faithfulness_warmup_weight_decay": warm.get("weight_decay", 0.1),
        "task_config.feature_probability": tpl["data"]["feature_probability"],
    }


def _norm(v: Any) -> Any:
    """Comparable form of a config value (loss lists compared as sets of dicts)."""
    if isinstance(v, list) and v and isinstance(v[0], dict) and "classname" in v[0]:
        return sorted(json.dumps(d, sort_keys=True) for d in v)
    return json.dumps(v, sort_keys=True)


def make_config(spd_dir: Path, toy: str, steps: int) -> tuple[Any, list[str], dict[str, Any]]:
    """spd's experiment config, set to the pdctl template where they differ, plus bench settings.

    Returns the Config, the differences (spd -> pdctl) and the pdctl template.
    """
    import yaml
    from spd.configs import Config

    spd_file, tpl_dir, _ = TOYS[toy]
    data = yaml.safe_load((spd_dir / "spd" / "experiments" / spd_file).read_text())
    tpl = tomllib.loads((ROOT / "templates" / tpl_dir / "pdctl.toml").read_text())
    spd_cfg = Config(**data).model_dump(mode="json")  # spd's file with spd's defaults filled in

    def canon(key: str, value: Any) -> Any:
        """`value` as spd's Config stores it for `key` (spd's defaults filled in)."""
        return Config(**{**data, key: value}).model_dump(mode="json")[key]

    diffs = []
    for key, want in pdctl_settings(tpl).items():
        if key.startswith("task_config."):
            sub = key.split(".", 1)[1]
            have = data["task_config"][sub]
            data["task_config"][sub] = want
        else:
            have, want = spd_cfg[key], canon(key, want)
            if _norm(have) != _norm(want):
                data[key] = want
        if _norm(have) != _norm(want):
            diffs.append(f"{key}: spd {json.dumps(have)} -> pdctl {json.dumps(want)}")

    big = 10**9  # past the run: train logging and eval at step 0 only
    data |= {
        "autocast_bf16": False,
        "steps": steps,
        "train_log_freq": big,
        "eval_freq": big,
        "slow_eval_freq": big,
        "slow_eval_on_first_step": False,
        "n_eval_steps": 1,
        "eval_metric_configs": [],
        "save_freq": None,
        "wandb_project": None,
    }
    return Config(**data), diffs, tpl


def make_target(toy: str, tpl: dict[str, Any]) -> tuple[Any, list[tuple[str, str]] | None]:
    """spd's model class for the toy, randomly initialised, with the template's shapes."""
    t = tpl["target"]
    if toy == "tms":
        from spd.experiments.tms.configs import TMSModelConfig
        from spd.experiments.tms.models import TMSModel

        assert t["kind"] == "tms" and t.get("bias", True), "spd's TMSModel always has the bias"
        model = TMSModel(
            TMSModelConfig(
                n_features=t["n_features"],
                n_hidden=t["n_hidden"],
                n_hidden_layers=t["n_hidden_layers"],
                tied_weights=t["tied_weights"],
                init_bias_to_zero=False,
                device="cpu",
            )
        )
        tied = [("linear1", "linear2")] if t["tied_weights"] else None
        return model, tied
    from spd.experiments.resid_mlp.configs import ResidMLPModelConfig
    from spd.experiments.resid_mlp.models import ResidMLP

    assert t["kind"] == "resid_mlp"
    model = ResidMLP(
        ResidMLPModelConfig(
            n_features=t["n_features"],
            d_embed=t["d_embed"],
            d_mlp=t["d_mlp"],
            n_layers=t["n_layers"],
            act_fn_name="relu",
            in_bias=t.get("bias", False),
            out_bias=t.get("bias", False),
        )
    )
    return model, None


def make_loader(toy: str, config: Any, model: Any, batch_size: int) -> Any:
    """spd's data generator for the toy, as its decomposition script builds it."""
    from spd.utils.data_utils import DatasetGeneratedDataLoader

    tc = config.task_config
    if toy == "tms":
        from spd.utils.data_utils import SparseFeatureDataset

        dataset = SparseFeatureDataset(
            n_features=model.config.n_features,
            feature_probability=tc.feature_probability,
            device="cpu",
            data_generation_type=tc.data_generation_type,
            value_range=(0.0, 1.0),
            synced_inputs=None,
        )
    else:
        from spd.experiments.resid_mlp.resid_mlp_dataset import ResidMLPDataset

        dataset = ResidMLPDataset(
            n_features=model.config.n_features,
            feature_probability=tc.feature_probability,
            device="cpu",
            calc_labels=False,
            label_type=None,
            act_fn_name=None,
            label_fn_seed=None,
            label_coeffs=None,
            data_generation_type=tc.data_generation_type,
            synced_inputs=None,
        )
    return DatasetGeneratedDataLoader(dataset, batch_size=batch_size, shuffle=False)


def child(a: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("WANDB_MODE", "disabled")
    import torch

    torch.set_num_threads(2)
    import spd.run_spd as run_spd
    from spd.utils.general_utils import set_seed

    n_timed = a.warmup + a.windows * a.window
    config, diffs, tpl = make_config(a.spd, a.child, steps=n_timed + 1)
    set_seed(config.seed)
    target, tied = make_target(a.child, tpl)
    target.eval()
    train_loader = make_loader(a.child, config, target, config.batch_size)
    eval_loader = make_loader(a.child, config, target, config.eval_batch_size)

    ends: list[float] = []
    made: list[Any] = []

    class TimedAdamW(torch.optim.AdamW):
        """The first AdamW built (optimize's main optimizer) is timed; later ones are plain."""

        def __init__(self, *args: Any, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self._timed = not made
            made.append(self)

        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            out = super().step(closure)
            if self._timed:
                ends.append(time.perf_counter())
                if len(ends) == n_timed:
                    raise _Enough
            return out

    run_spd.optim = types.SimpleNamespace(AdamW=TimedAdamW)  # type: ignore[assignment]
    run_spd.save_file = lambda *_a, **_k: None  # type: ignore[assignment]
    with tempfile.TemporaryDirectory(prefix="spd-bench-") as out, contextlib.suppress(_Enough):
        run_spd.optimize(
            target_model=target,
            config=config,
            device="cpu",
            train_loader=train_loader,
            eval_loader=eval_loader,
            n_eval_steps=config.n_eval_steps,
            out_dir=Path(out),
            tied_weights=tied,
        )
    assert len(made) == 1 + (config.faithfulness_warmup_steps > 0), len(made)
    assert len(ends) == n_timed, f"optimize stopped after {len(ends)} steps"
    per_step = [(t1 - t0) * 1e3 for t0, t1 in itertools.pairwise(ends)][a.warmup - 1 :]
    windows = [
        statistics.fmean(per_step[i * a.window : (i + 1) * a.window]) for i in range(a.windows)
    ]
    return {
        "toy": a.child,
        "step_ms": min(windows),
        "step_median_ms": statistics.median(per_step),
        "windows_ms": windows,
        "steps_ms": per_step,
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
        "differences": diffs,
        "config": config.model_dump(mode="json"),
    }


def run_child(a: argparse.Namespace, toy: str) -> dict[str, Any]:
    cmd = [sys.executable, *module_argv(__spec__.name, "--child", toy, "--spd", a.spd)]
    cmd += ["--warmup", str(a.warmup), "--windows", str(a.windows), "--window", str(a.window)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(path=(a.spd,)))
    if r.returncode:
        sys.exit(f"child failed ({toy}):\n{r.stdout}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--toys", nargs="+", default=list(TOYS), choices=list(TOYS))
    ap.add_argument("--spd", type=Path, default=Path("/work/spd-bench/spd"))
    ap.add_argument("--warmup", type=int, default=20, help="untimed steps (>= 1)")
    ap.add_argument("--windows", type=int, default=5)
    ap.add_argument("--window", type=int, default=40, help="steps per timing window")
    ap.add_argument("--quiet", action="store_true", help="do not print the configs used")
    ap.add_argument("--json", type=Path, help="write all figures here")
    ap.add_argument("--child", choices=list(TOYS), help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.spd = a.spd.resolve()
    assert a.warmup >= 1, "step 0 (eval, logging) is never timed"
    if a.child:
        print(json.dumps(child(a)))
        return
    print(machine_line())
    commit = subprocess.run(
        ["git", "-C", str(a.spd), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"goodfire-ai/spd {commit or '?'}  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    print(
        f"timing: {a.warmup} warm-up iterations, then {a.windows} windows of {a.window}",
        flush=True,
    )
    rows = []
    for toy in a.toys:
        r = run_child(a, toy)
        r["spd_commit"] = commit
        rows.append(r)
        label = TOYS[toy][2]
        if not a.quiet:
            print(f"--- {label}: config used (spd.configs.Config) ---")
            print(json.dumps(r["config"], indent=1))
        print(f"--- {label}: spd config vs pdctl template ---")
        for d in r["differences"] or ["(no differences in the settings a template fixes)"]:
            print(f"  {d}")
        print(
            f"torch/spd {label:10s}  step {r['step_ms']:8.2f} ms (median "
            f"{r['step_median_ms']:8.2f})  windows "
            f"{' '.join(f'{w:.2f}' for w in r['windows_ms'])}  RSS {r['peak_rss_gib']:5.2f} GiB  "
            f"torch {r['torch']}, {r['threads']} threads",
            flush=True,
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
