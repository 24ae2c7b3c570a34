"""benchmarks/tpu/step.py's arms: what each name means as configuration and patches (no model,
no compile: the benchmark itself is smoke-run by hand, see its docstring)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tpu_step():
    from benchmarks.tpu import step

    return step


def _args(**kw):
    base = dict(gguf=None, text="/usr/share/games/fortunes", batch=32, seq=256, layer=15,
                eval_batch=16)  # fmt: skip
    return argparse.Namespace(**{**base, **kw})


def test_aliases_and_modifiers(tpu_step):
    A = tpu_step.Arm.parse
    assert A("before").spec == "edbbc41+fdefault+noskip"
    # the 5% pair differs only by the faithfulness precision
    assert A("before").mods - A("policy-old").mods == {"fdefault"}
    assert A("policy").spec == "template" and A("default").mods == {"fdefault"}
    assert A("after").mods == {"tbf16", "unroll", "cbf16"}
    assert A("template+unroll+tbf16").spec == "template+tbf16+unroll"
    for bad in ("nope", "template+fast", "edbbc41+"):
        with pytest.raises(SystemExit, match="--arms"):
            A(bad)


def test_configs(tpu_step):
    old = tpu_step.config(_args(), tpu_step.Arm.parse("before"))
    assert old.decomp.sites[0].C == 1024 and old.decomp.init == "random"
    assert old.train.loss.stochastic_recon_subset == 1.0 and old.train.loss.merged_recon == 0
    assert old.train.ppgd.n_warmup_steps == 0 and old.warmup.steps == 1000
    new = tpu_step.config(_args(batch=4, seq=64, layer=3), tpu_step.Arm.parse("after"))
    assert new.decomp.sites[0].C == 1536 and new.decomp.sites[0].pattern == "model.layers.3.mlp.*"
    assert new.train.ppgd.n_warmup_steps == 2 and new.train.ppgd.unroll
    assert new.precision.target_dtype == "bfloat16" and new.precision.compute_dtype == "bfloat16"
    assert (new.train.batch_size, new.data.seq_len) == (4, 64)
    assert not new.train.eval_pgd.enabled
    plain = tpu_step.config(_args(), tpu_step.Arm.parse("policy"))
    assert plain.precision.target_dtype is None and not plain.train.ppgd.unroll


def test_tracing_patches_only_while_tracing(tpu_step):
    from pdctl.science.arrays import exact_matmul
    from pdctl.science.spd import losses

    with tpu_step.Arm.parse("before").tracing():
        assert losses.exact_matmul is not exact_matmul
        assert losses.prefix_layer(None, ["model.layers.15.mlp.up_proj"]) is None
    assert losses.exact_matmul is exact_matmul
    with tpu_step.Arm.parse("policy").tracing():
        assert losses.exact_matmul is exact_matmul
