"""Tensor parallelism (`[mesh] tp`): the sharding rules of the tp axis, the checks of a mesh
against the target, and the parity gate: the train step on tp = 2 and tp = 4 (and data x tp)
gives the one-device trajectory.

Tolerance of the parity gate: splitting a projection over tp devices turns one matmul into
partial products summed by an all-reduce (row-parallel o / down, the faithfulness term's
sums), a float32 reassociation; benchmarks/tp_parity.py (docs/performance.md) measured the
metrics of 5 steps to differ by at most 5.7e-6 relative (tests use 3e-5), the L0 counts not at
all.
"""

from __future__ import annotations

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from pdctl.engine import sharding
from pdctl.engine.sharding import P
from pdctl.errors import PdctlError

LLAMA = dict(architectures=["LlamaForCausalLM"], vocab_size=64, hidden_size=32,
             intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
# One GPT-2 block: it holds every GPT-2 projection tp splits (the fused c_attn and mlp.c_fc
# column-parallel, both c_proj row-parallel), and a second block only repeats them (the
# stacked, scanned layout is the llama case's). Measured on a loaded 2-core machine, the
# gpt2 case's setup + step compile on its two meshes: 175 s with one block, 268 s with two.
GPT2 = dict(architectures=["GPT2LMHeadModel"], vocab_size=64, n_embd=32, n_layer=1, n_head=4,
            n_positions=32)  # fmt: skip
RTOL = 3e-5  # float32 reassociation of the tp all-reduces (module docstring)


def _spec(path: str, shape: tuple[int, ...], tp: int = 2, fsdp: int = 1, decomp=None) -> P:
    return sharding.spec_for(path, shape, fsdp, 1024, decomp, tp)


def test_projections_split_column_and_row_and_their_components_follow():
    q, o = "model.layers.3.self_attn.q_proj", "model.layers.3.self_attn.o_proj"
    assert _spec(f"{q}.weight", (64, 64)) == P(None, "tp")  # column: over d_out
    assert _spec(f"{q}.bias", (64,)) == P("tp")
    assert _spec(f"{o}.weight", (64, 64)) == P("tp", None)  # row: over d_in
    assert _spec(f"{o}.bias", (64,)) == P()
    dec = sharding.Decomp(("data",), 2)
    # U (C, d_out) of a column site and V (d_in, C) of a row site split like their matrix,
    # their component axis over the decomposition's axes; the other factor is whole over tp
    assert _spec(f"trainable.components.{q}.U", (8, 64), decomp=dec) == P("data", "tp")
    assert _spec(f"trainable.components.{q}.V", (64, 8), decomp=dec) == P(None, "data")
    assert _spec(f"trainable.components.{o}.V", (64, 8), decomp=dec) == P("tp", "data")
    assert _spec(f"trainable.components.{o}.U", (8, 64), decomp=dec) == P("data", None)
    # a stacked group (leading layer axis) and an Adam moment of it
    grp = "model.layers.0-29.mlp.down_proj"
    assert _spec(f"opt_state.0.mu.components.{grp}.V", (30, 128, 8), decomp=dec) == P(
        None, "tp", "data"
    )
    # and only over tp, whatever fsdp is (docs/performance.md, "Tensor parallelism")
    assert _spec(f"{q}.weight", (64, 64), fsdp=2) == P(None, "tp")
    # GPT-2 and llama-mlp names; a toy's or a norm's arrays are not tp's
    assert _spec("transformer.h.0.attn.c_attn.weight", (32, 96)) == P(None, "tp")
    assert _spec("transformer.h.0.mlp.c_proj.weight", (128, 32)) == P("tp", None)
    assert _spec("layers.0.mlp.down", (128, 32)) == P("tp", None)
    assert _spec("layers.0.attn.q", (32, 32)) == P(None, "tp")
    assert _spec("model.layers.0.input_layernorm.weight", (64,)) == P()
    assert _spec("linear1.weight", (64, 64)) == P()
    # tp = 1: nothing changes
    assert _spec(f"{q}.weight", (64, 64), tp=1) == P()
    rule, _ = sharding.rule_for(f"{o}.weight", (64, 64), 1, 1024, None, 2)
    assert rule.name.startswith("tensor parallel")


def test_mesh_shape_with_tp():
    assert sharding.resolve_mesh_shape(-1, 1, 8, tp=2) == (4, 1)
    assert sharding.resolve_mesh_shape(2, -1, 8, tp=2) == (2, 2)
    mesh = sharding.make_mesh(-1, 1, tp=2)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 1, "tp": 2}
    # a tp group is consecutive devices (one host's, on a cluster)
    assert [d.id for d in mesh.devices[0, 0]] == [0, 1]
    assert sharding.batch_shards(mesh) == 2
    with pytest.raises(PdctlError, match=r"mesh\.tp: 3 does not divide the 4 available devices"):
        sharding.make_mesh(-1, 1, tp=3)
    with pytest.raises(PdctlError, match=r"mesh.data: 3 does not divide the 2 of the 4 devices"):
        sharding.make_mesh(3, -1, tp=2)
    with pytest.raises(PdctlError, match="the 2 batch shards"):
        sharding.check_batch_divides(3, mesh, "train.batch_size")


def test_the_target_must_have_a_layout_the_tp_axis_divides(tmp_path: Path):
    from pdctl.science.targets import TMS
    from pdctl.science.targets.hf import HFCausalLM, read_hf_config
    from pdctl.stages.inputs import check_tensor_parallel

    (tmp_path / "config.json").write_text(json.dumps({**LLAMA, "num_key_value_heads": 2}))
    llama = HFCausalLM(spec=read_hf_config(tmp_path, need_weights=False), seq_len=8)
    check_tensor_parallel(llama, sharding.make_mesh(-1, 1, tp=2))
    with pytest.raises(PdctlError, match=r"mesh\.tp: 4 does not divide num_key_value_heads = 2 in"):
        check_tensor_parallel(llama, sharding.make_mesh(-1, 1, tp=4))
    with pytest.raises(PdctlError, match="the tms target has no tensor-parallel layout"):
        check_tensor_parallel(TMS(), sharding.make_mesh(-1, 1, tp=2))


def _raw(model_dir: Path, scan: bool) -> dict:
    import tomllib

    from pdctl.templates import templates_root

    raw = tomllib.loads((templates_root() / "hf-lm" / "pdctl.toml").read_text())
    raw["target"]["path"] = str(model_dir)
    raw["data"]["seq_len"] = 8
    raw["decomp"]["sites"] = [{"pattern": "*.mlp.*", "C": 8}, {"pattern": "*attn.*", "C": 4}]
    raw["decomp"]["ci_fn"]["hidden"] = [8]
    raw["train"]["batch_size"] = 4
    raw["train"]["scan_layers"] = scan
    return raw


def _trajectory(raw: dict, data: int, fsdp: int, tp: int, steps: int = 5):
    """Every scalar metric of `steps` train steps from the same start, on data x fsdp x tp
    devices (random target weights, a fixed batch)."""
    from helpers import fresh_train_state

    from pdctl.config import parse_config
    from pdctl.stages.inputs import check_tensor_parallel, target_from_config

    cfg = parse_config(raw)
    mesh = sharding.make_mesh(data, fsdp, jax.devices()[: data * fsdp * tp], tp=tp)
    check_tensor_parallel(target_from_config(cfg, need_weights=False), mesh)
    tokens = np.random.default_rng(0).integers(0, 64, size=(4, 9), dtype=np.int32)
    _, prog, params, state, batch, _ = fresh_train_state(cfg, mesh, tokens)
    step = prog.jit()
    rows = []
    for _ in range(steps):
        state, m = step(params, state, batch)
        m = jax.device_get(m)
        rows.append({k: float(v) for k, v in m.items() if np.ndim(v) == 0})
    return rows, prog


@pytest.mark.slow  # five train-step compiles, ~100 s
@pytest.mark.parametrize(
    ("name", "scan", "meshes"),
    [("llama", True, [(1, 1, 4), (2, 1, 2)]), ("gpt2", False, [(1, 2, 2)])],
)
def test_tp_gives_the_one_device_trajectory(tmp_path: Path, name, scan, meshes):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA if name == "llama" else GPT2))
    raw = _raw(tmp_path, scan)
    ref, _ = _trajectory(raw, 1, 1, 1)
    for data, fsdp, tp in meshes:
        got, prog = _trajectory(raw, data, fsdp, tp)
        # the layout is the tp one, not a replicated fallback
        specs = [s.spec for s in jax.tree.leaves(prog.frozen_shardings[0])]
        assert sum("tp" in jax.tree.leaves(tuple(s)) for s in specs) >= 4, specs
        for step, (a, b) in enumerate(zip(got, ref, strict=True)):
            assert set(a) == set(b)
            for k in b:
                if k.startswith("l0/"):
                    assert a[k] == b[k], (data, fsdp, tp, step, k)
                else:
                    np.testing.assert_allclose(
                        a[k], b[k], rtol=RTOL, atol=1e-6, err_msg=f"{(data, fsdp, tp)} {k}"
                    )
