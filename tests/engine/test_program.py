"""`inspect-sharding --compile` compiles the stage's own program: its memory is the memory of
the step the stage runs, for every setting that changes the program (remat, the precision
policy, gradient accumulation)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from helpers import TINY, merge

from pdctl import inspect as insp
from pdctl.config import parse_config
from pdctl.engine import sharding
from pdctl.stages import pretrain, train
from pdctl.stages.init_weights import init_decomposition
from pdctl.stages.inputs import STREAM_DECOMP, STREAM_TARGET, stream_key, target_from_config
from pdctl.templates import templates_root

SETTINGS = {
    "train": {"remat": "full", "grad_accum_steps": 2, "batch_size": 8},
    "pretrain": {"remat": "dots_saveable", "grad_accum_steps": 2, "batch_size": 8},
}
BF16 = {"compute_dtype": "bfloat16"}


def _cfg(stage: str, tuned: bool):
    import tomllib

    raw = tomllib.loads((templates_root() / "llama-mlp" / "pdctl.toml").read_text())
    raw = merge(raw, TINY["llama-mlp"])
    raw["mesh"] = {"data": 1, "fsdp": 1}
    if tuned:
        raw = merge(raw, {stage: SETTINGS[stage], "precision": BF16})
    else:
        raw = merge(raw, {stage: {"batch_size": 8}})
    return parse_config(raw)


def _stage_memory(stage: str, cfg) -> dict[str, int]:
    """The memory of the step as the stage compiles it: real arrays in, `program.jit()`."""
    mesh = sharding.make_mesh(1, 1, jax.devices()[:1])
    target = target_from_config(cfg)
    module = {"train": train, "pretrain": pretrain}[stage]
    prog = module.program(cfg, mesh, target)
    key = stream_key(cfg, STREAM_TARGET)
    params_sh = prog.state_shardings["params"] if stage == "pretrain" else prog.frozen_shardings[0]
    params = jax.jit(target.init, out_shardings=params_sh)(key)
    if stage == "pretrain":
        state = prog.jit_make_state()(params)
        frozen = ()
    else:
        dec, _ = init_decomposition(cfg, target, mesh, stream_key(cfg, STREAM_DECOMP))
        state = prog.jit_make_state()(dec["components"], dec["ci_fns"], dec["sources"])
        frozen = (params,)
    tokens = np.zeros((SETTINGS[stage]["batch_size"], cfg.data.seq_len + 1), np.int32)
    batch = {"tokens": jax.device_put(tokens, prog.batch_shardings["tokens"])}
    m = prog.jit().lower(*frozen, state, batch).compile().memory_analysis()
    return {
        "argument_bytes": int(m.argument_size_in_bytes),
        "output_bytes": int(m.output_size_in_bytes),
        "alias_bytes": int(m.alias_size_in_bytes),
        "temp_bytes": int(m.temp_size_in_bytes),
    }


@pytest.mark.slow  # four llama compiles: ~75 s here
@pytest.mark.parametrize("stage", ["train", "pretrain"])
def test_inspect_compile_reports_the_stages_own_step(stage: str):
    cfg = _cfg(stage, tuned=True)
    report = insp.inspect(cfg, stage, compile=True, devices=jax.devices()[:1])
    keys = ("argument_bytes", "output_bytes", "alias_bytes", "temp_bytes")
    got = {k: report["memory"][k] for k in keys}
    assert got == _stage_memory(stage, cfg)
    # and the settings really changed the program inspect compiled: the default config's step
    # needs other memory (so an inspect that ignored remat/bf16/accumulation would fail above)
    plain = insp.inspect(_cfg(stage, tuned=False), stage, compile=True, devices=jax.devices()[:1])
    assert plain["memory"]["temp_bytes"] != got["temp_bytes"]


def test_inspect_names_the_sharding_rule_of_every_array():
    """Every row says which line of engine.sharding.RULES gave its spec (fsdp = 4, C = 8)."""
    from pdctl.engine.sharding import RULES

    rule = {r.pattern: r.name for r in RULES if r.pattern in ("*.V", "*.U")}
    raw = merge(_raw_tms(), {"mesh": {"data": 1, "fsdp": 4, "fsdp_min_param_size": 16}})
    report = insp.inspect(parse_config(raw), "train", expand=True, devices=jax.devices()[:4])
    names = {r["path"]: r["rule"] for r in report["rows"]}
    assert names["trainable.components.linear1.V"] == rule["*.V"]
    assert names["trainable.components.linear1.U"] == rule["*.U"]
    assert names["loop.step"] == "scalar"
    # the optimizer's moments of V inherit V's rule through their path
    mu_v = [p for p in names if p.endswith("mu.components.linear1.V")]
    assert mu_v and all(names[p] == rule["*.V"] for p in mu_v)
    assert {r["rule"] for r in report["rows"]} <= {rule.name for rule in RULES}


def _raw_tms():
    import tomllib

    raw = tomllib.loads((templates_root() / "tms" / "pdctl.toml").read_text())
    return merge(raw, {"decomp": {"sites": [{"pattern": "linear*", "C": 8}]}})
