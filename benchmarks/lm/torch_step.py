"""The torch reference (goodfire-ai/spd) LM decomposition train step on SmolLM2-135M, on CPU.

What it runs: goodfire-ai/spd's own training loop, `spd.run_spd.optimize` (measured at commit
3f0bb61ebb56c493f8de5c21618d866bbed60298; the commit of `--spd` is printed with the results),
unmodified. Each of its iterations is: `ComponentModel.calc_weight_deltas`, the target forward
with input caching (`ComponentModel(batch, cache_type="input")`),
`ComponentModel.calc_causal_importances`, `spd.losses.compute_total_loss`, `backward`, the
per-layer L0 logging and `AdamW.step`. The batches come from `spd.data.create_data_loader`, as
in `spd/experiments/lm/lm_decomposition.py`. Two names in `spd.run_spd` are swapped for the run:
`optim` (so that its `AdamW` records when each step ends, and stops the loop by raising once
enough steps are timed) and `save_file` (no checkpoint is written). Nothing else is touched.

The config (`spd.configs.Config`): target `transformers.LlamaForCausalLM` from `--model`, output
attr `logits`; sites `model.layers.15.mlp.{gate,up,down}_proj` (3 sites), layers 14-15 (6),
12-15 (12) or all 30 layers (90), C = 256 per site; batch 4 x 64 tokens of real text (Debian's
fortunes, all files, tokenized once by spd's `tokenize_and_concatenate` into `--data`, then
read on spd's pre-tokenized data path); losses FaithfulnessLoss (1e7),
ImportanceMinimalityLoss (5e-4, pnorm 2.0 annealed to 0.4 over the run, beta 0),
StochasticReconSubsetLoss (1.0, uniform-k subset routing), output loss KL; CI function
`shared_mlp` (spd's `VectorSharedMLPCiFn`: one MLP per site) with one hidden layer of 128,
sigmoid `leaky_hard`, delta component on, 1 mask sample, continuous sampling, AdamW (weight
decay 0, i.e. Adam) at a constant lr of 1e-3, no grad clipping, no faithfulness warm-up,
float32 (`autocast_bf16` off), `torch.set_num_threads(2)`. Train logging and evaluation happen
at step 0 only (their frequencies are set past the run); step 0 is not timed.

Timing: each site count runs in a fresh child process. Iteration i's time is the gap between
the ends of optimizer steps i-1 and i. After `--warmup` iterations, `--windows` windows of
`--window` iterations each; a window's mean is its ms per step. Reported: the best window and
the median iteration. The forward is `LlamaForCausalLM(input_ids)` under `torch.no_grad()` on
a batch from the same loader (best of 3 windows of 3 calls, after 2 warm-up calls). Peak RSS
is the child's `ru_maxrss` (model, SPD state and all).

Setup (spd needs Python >= 3.12, and wandb 0.23.1 for the `wandb_workspaces` it imports; on
Python 3.13 PyPI's torch 2.13.0 is the CUDA build, which runs on the CPU here):

    # the reference, as a work tree
    git clone <goodfire-ai/spd> /work/spd-bench/spd
    # a venv of its own
    ~/.pyenv/versions/3.13.0/bin/python -m venv /work/spd-bench/venv
    /work/spd-bench/venv/bin/pip install torch==2.13.0 transformers==5.24.0 \
        tokenizers==0.23.3 numpy "pydantic<2.12" wandb==0.23.1 wandb-workspaces==0.1.12 \
        fire tqdm jaxtyping einops matplotlib python-dotenv datasets scipy pillow pyyaml
    /work/spd-bench/venv/bin/pip install --no-deps -e /work/spd-bench/spd
    # SmolLM2 as a plain float32 HF directory: load the Q4_1 GGUF with transformers
    # (gguf_file=..., dtype float32), drop quantization_config from its config, copy the
    # state dict into a fresh LlamaForCausalLM(config), save_pretrained it and the tokenizer
    # to /work/spd-bench/smollm2-hf (with /work/venv: /work/spd-bench/tools/gguf_to_hf.py)

Run (from the repository root):

    /work/spd-bench/venv/bin/python -m benchmarks.lm.torch_step --sites 3 90 \
        --spd /work/spd-bench/spd --model /work/spd-bench/smollm2-hf
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
import types
from pathlib import Path
from typing import Any

from benchmarks._harness import child_env, machine_line, module_argv

LAYERS = {3: "15", 6: "1[45]", 12: "1[2-5]", 90: "*"}
FORTUNES = Path(os.environ.get("PDCTL_TEXT", "/usr/share/games/fortunes"))
SEQ_LEN = 64
BATCH = 4


class _Enough(Exception):
    """Raised from the optimizer once every timed step has run."""


def write_tokens(data_dir: Path, model: Path) -> Path:
    """Debian's fortunes, tokenized once into `train.jsonl` ({"input_ids": [SEQ_LEN ids]} a line).

    The tokens are spd's own: `spd.data.tokenize_and_concatenate` (fortunes joined by EOS, cut
    into SEQ_LEN-token rows), run in one process. The step then reads them through spd's
    `create_data_loader` on its pre-tokenized path (`is_tokenized=True`), as its GPT-2 config
    does; its text path re-tokenizes in 10 forked `datasets.map` workers each run.
    """
    path = data_dir / "train.jsonl"
    if path.exists():
        return path
    from datasets import Dataset
    from spd.data import tokenize_and_concatenate
    from transformers import AutoTokenizer

    texts = []
    for src in sorted(FORTUNES.iterdir()):
        if src.suffix in {".dat", ".u8"} or not src.is_file():
            continue
        texts += [t.strip() for t in src.read_text(errors="replace").split("\n%\n") if t.strip()]
    tokens = tokenize_and_concatenate(
        Dataset.from_dict({"text": texts}),
        AutoTokenizer.from_pretrained(model),
        column_name="text",
        max_length=SEQ_LEN,
        num_proc=1,
    )["input_ids"]
    data_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for row in tokens:
            f.write(json.dumps({"input_ids": row.tolist()}) + "\n")
    tmp.rename(path)
    return path


def make_config(model: Path, data_dir: Path, n_sites: int, C: int, steps: int) -> Any:
    from spd.configs import Config

    layers = LAYERS[n_sites]
    big = 10**9  # past the run: train logging and eval at step 0 only
    return Config(
        seed=0,
        autocast_bf16=False,
        n_mask_samples=1,
        ci_fn_type="shared_mlp",
        ci_fn_hidden_dims=[128],
        sampling="continuous",
        sigmoid_type="leaky_hard",
        module_info=[
            {"module_pattern": f"model.layers.{layers}.mlp.{proj}", "C": C}
            for proj in ("gate_proj", "up_proj", "down_proj")
        ],
        use_delta_component=True,
        loss_metric_configs=[
            {"classname": "FaithfulnessLoss", "coeff": 1e7},
            {
                "classname": "ImportanceMinimalityLoss",
                "coeff": 5e-4,
                "pnorm": 2.0,
                "beta": 0.0,
                "p_anneal_start_frac": 0.0,
                "p_anneal_final_p": 0.4,
                "p_anneal_end_frac": 1.0,
            },
            {
                "classname": "StochasticReconSubsetLoss",
                "coeff": 1.0,
                "routing": {"type": "uniform_k_subset"},
            },
        ],
        output_loss_type="kl",
        lr_schedule={"start_val": 1e-3, "fn_type": "constant"},
        steps=steps,
        batch_size=BATCH,
        faithfulness_warmup_steps=0,
        train_log_freq=big,
        eval_freq=big,
        slow_eval_freq=big,
        slow_eval_on_first_step=False,
        eval_batch_size=BATCH,
        n_eval_steps=1,
        eval_metric_configs=[],
        pretrained_model_class="transformers.LlamaForCausalLM",
        pretrained_model_name=str(model),
        pretrained_model_output_attr="logits",
        tokenizer_name=str(model),
        task_config={
            "task_name": "lm",
            "max_seq_len": SEQ_LEN,
            "dataset_name": str(data_dir),
            "column_name": "input_ids",
            "train_data_split": "train",
            "eval_data_split": "train",
            "is_tokenized": True,
            "streaming": False,
        },
    )


def child(a: argparse.Namespace) -> dict[str, Any]:
    os.environ.setdefault("HF_DATASETS_CACHE", str(a.data / "hf_cache"))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("WANDB_MODE", "disabled")
    import torch

    torch.set_num_threads(2)
    import spd.run_spd as run_spd
    from spd.data import DatasetConfig, create_data_loader
    from spd.utils.general_utils import extract_batch_data, set_seed
    from spd.utils.module_utils import expand_module_patterns
    from transformers import LlamaForCausalLM

    n_timed = a.warmup + a.windows * a.window
    config = make_config(a.model, a.data, a.child, a.C, steps=n_timed + 1)
    set_seed(config.seed)
    target = LlamaForCausalLM.from_pretrained(config.pretrained_model_name)
    target.eval()
    sites = expand_module_patterns(target, config.all_module_info)
    assert len(sites) == a.child, [s.module_path for s in sites]

    tc = config.task_config
    loaders = []
    for split, seed in ((tc.train_data_split, config.seed), (tc.eval_data_split, config.seed + 1)):
        data_config = DatasetConfig(
            name=tc.dataset_name,
            hf_tokenizer_path=config.tokenizer_name,
            split=split,
            n_ctx=tc.max_seq_len,
            is_tokenized=tc.is_tokenized,
            streaming=tc.streaming,
            column_name=tc.column_name,
            shuffle_each_epoch=tc.shuffle_each_epoch,
            seed=None,
        )
        loader, _ = create_data_loader(
            dataset_config=data_config,
            batch_size=config.batch_size,
            buffer_size=tc.buffer_size,
            global_seed=seed,
            dist_state=None,
        )
        loaders.append(loader)

    ends: list[float] = []

    class TimedAdamW(torch.optim.AdamW):
        def step(self, closure: Any = None) -> Any:  # type: ignore[override]
            out = super().step(closure)
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
            train_loader=loaders[0],
            eval_loader=loaders[1],
            n_eval_steps=config.n_eval_steps,
            out_dir=Path(out),
        )
    assert len(ends) == n_timed, f"optimize stopped after {len(ends)} steps"
    per_step = [(t1 - t0) * 1e3 for t0, t1 in itertools.pairwise(ends)][a.warmup - 1 :]
    windows = [
        statistics.fmean(per_step[i * a.window : (i + 1) * a.window]) for i in range(a.windows)
    ]

    batch = extract_batch_data(next(iter(loaders[0])))
    assert tuple(batch.shape) == (BATCH, SEQ_LEN), batch.shape
    fwd: list[float] = []
    with torch.no_grad():
        for _ in range(2):
            target(batch)
        for _ in range(3):
            t = time.perf_counter()
            for _ in range(3):
                target(batch)
            fwd.append((time.perf_counter() - t) / 3 * 1e3)

    return {
        "sites": a.child,
        "C": a.C,
        "step_ms": min(windows),
        "step_median_ms": statistics.median(per_step),
        "windows_ms": windows,
        "steps_ms": per_step,
        "forward_ms": min(fwd),
        "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "torch": torch.__version__,
        "threads": torch.get_num_threads(),
    }


def run_child(a: argparse.Namespace, n_sites: int) -> dict[str, Any]:
    cmd = [sys.executable, *module_argv(__spec__.name, "--child", n_sites, "--spd", a.spd)]
    cmd += ["--model", str(a.model), "--data", str(a.data), "--C", str(a.C)]
    cmd += ["--warmup", str(a.warmup), "--windows", str(a.windows), "--window", str(a.window)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=child_env(path=(a.spd,)))
    if r.returncode:
        sys.exit(f"child failed ({n_sites} sites):\n{r.stdout}\n{r.stderr[-4000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sites", type=int, nargs="+", default=[3, 90], choices=sorted(LAYERS))
    ap.add_argument("--spd", type=Path, default=Path("/work/spd-bench/spd"))
    ap.add_argument("--model", type=Path, default=Path("/work/spd-bench/smollm2-hf"))
    ap.add_argument("--data", type=Path, default=Path("/work/spd-bench/fortunes-tok64"))
    ap.add_argument("--C", type=int, default=256)
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps (>= 1)")
    ap.add_argument("--windows", type=int, default=3)
    ap.add_argument("--window", type=int, default=3, help="steps per timing window")
    ap.add_argument("--json", type=Path, help="write all figures here")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.spd, a.model, a.data = a.spd.resolve(), a.model.resolve(), a.data.resolve()
    assert a.warmup >= 1, "step 0 (eval, logging) is never timed"
    if a.child:
        print(json.dumps(child(a)))
        return
    print(machine_line())
    write_tokens(a.data, a.model)  # spd's tokenizer: run with the checkout of --spd on PYTHONPATH
    commit = subprocess.run(
        ["git", "-C", str(a.spd), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    print(f"goodfire-ai/spd {commit or '?'}  {time.strftime('%Y-%m-%d %H:%M:%S %Z')}", flush=True)
    rows = []
    for n in a.sites:
        r = run_child(a, n)
        r["spd_commit"] = commit
        rows.append(r)
        print(
            f"torch/spd {n:3d} sites C={r['C']}  step {r['step_ms']:8.1f} ms (median "
            f"{r['step_median_ms']:8.1f})  forward {r['forward_ms']:6.1f} ms  step/fwd "
            f"{r['step_ms'] / r['forward_ms']:6.2f}  RSS {r['peak_rss_gib']:5.2f} GiB  "
            f"torch {r['torch']}",
            flush=True,
        )
    if a.json:
        a.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
