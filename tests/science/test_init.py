"""Stacked (vmap-grouped) decomposition init: bit-identical to the per-site reference, sharded.

`init_weights.init_decomposition` groups same-shaped sites, initialises each group with one
`vmap` over the per-site keys and fans the stacks out with a slicing jit. Its V/U, CI functions
and PPGD sources must equal, bit for bit, `components.init_decomposition_reference` (one site at
a time, same `site_keys`) at 1 and at 4 simulated devices (fsdp=4, so V/U really are sharded),
on configs with real multi-site shape groups and heterogeneous C.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from pdctl.config import Config, parse_config
from pdctl.engine import init as engine_init
from pdctl.engine import sharding
from pdctl.science.spd import components as comps
from pdctl.stages import init_weights
from pdctl.stages.decomposition import abstract_decomposition as init_decomposition_abstract
from pdctl.stages.decomposition import decomposed_sites, source_shape
from pdctl.stages.init_weights import init_decomposition
from pdctl.stages.inputs import target_from_config

MIN_SIZE = 16  # small enough that CI weights and sources shard too, not only V/U


def _llama(ci_type: str, sigmoid: bool = False) -> dict[str, Any]:
    """3 layers: `layers.*.mlp.up` (8 -> 16, C=8) and `layers.*.mlp.down` (16 -> 8, C=12):
    two shape groups of 3 sites each. Per-position sources, (seq_len, C + 1), N(0, 1) with the
    sigmoid parametrisation."""
    return {
        "schema": 1,
        "target": {
            "kind": "llama_mlp",
            "vocab_size": 16,
            "d_model": 8,
            "n_layers": 3,
            "n_heads": 2,
            "d_mlp": 16,
        },
        "data": {"seq_len": 4},
        "mesh": {"fsdp_min_param_size": MIN_SIZE},
        "decomp": {
            "sites": [
                {"pattern": "layers.*.mlp.up", "C": 8},
                {"pattern": "layers.*.mlp.down", "C": 12},
            ],
            "ci_fn": {"type": ci_type, "hidden": [4]},
        },
        "train": {
            "ppgd": {"scope": "per_position", "sigmoid": sigmoid},
            "loss": {"output": "kl", "ppgd_recon": 0.5},
        },
    }


def _tms_hidden(ci_type: str) -> dict[str, Any]:
    """TMS 8-4 with two identity hidden layers: `hidden_layers.{0,1}` (4 -> 4, C=4) form a
    group of 2; `linear1` (8 -> 4) and `linear2` (4 -> 8) have C=8, and linear2's components
    are tied to linear1's (tied weights), so only linear1's are created. Per-example sources,
    (batch, C + 1)."""
    return {
        "schema": 1,
        "target": {"kind": "tms", "n_features": 8, "n_hidden": 4, "n_hidden_layers": 2},
        "mesh": {"fsdp_min_param_size": MIN_SIZE},
        "decomp": {
            "sites": [{"pattern": "linear*", "C": 8}, {"pattern": "hidden_layers.*", "C": 4}],
            "ci_fn": {"type": ci_type, "hidden": [4, 3]},
        },
        "train": {"batch_size": 16, "ppgd": {"scope": "per_batch_per_position"}},
    }


CASES = {
    "llama-mlp": _llama("mlp"),
    "tms-hidden-vector_mlp": _tms_hidden("vector_mlp"),
    "llama-shared_mlp": _llama("shared_mlp", sigmoid=True),
    "llama-transformer": _llama("transformer"),
}
KEY = jax.random.PRNGKey(7)


def _mesh(n_devices: int):
    devices = jax.devices()[:n_devices]
    assert len(devices) == n_devices, "conftest should give 4 simulated CPU devices"
    return sharding.make_mesh(1, n_devices, devices)  # fsdp = n_devices


_REFS: dict[str, Any] = {}


def _reference(case: str, cfg: Config, target) -> tuple[Any, Any, Any]:
    """The per-site reference init (device independent, so computed once per case), without
    the components of tied sites (their source's transposes, never stored)."""
    if case not in _REFS:
        ties = comps.component_ties(target.tied_sites(), decomposed_sites(cfg, target))
        ref_comps, ref_ci, ref_src = jax.device_get(
            comps.init_decomposition_reference(
                KEY,
                decomposed_sites(cfg, target),
                cfg.decomp.ci_fn.type,
                cfg.decomp.ci_fn.arch(),
                lambda C: source_shape(cfg, C),
                jax.numpy.dtype(cfg.precision.param_dtype),
                cfg.train.ppgd.sigmoid,
            )
        )
        ref_comps = {p: v for p, v in ref_comps.items() if p not in ties}
        _REFS[case] = ref_comps, ref_ci, ref_src
    return _REFS[case]


def _assert_tree_equal(got: Any, want: Any, what: str) -> None:
    assert jax.tree.structure(got) == jax.tree.structure(want), what
    for (path, g), w in zip(
        jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want), strict=True
    ):
        g = np.asarray(g)
        assert g.dtype == w.dtype and g.shape == w.shape, (what, path)
        np.testing.assert_array_equal(g, w, err_msg=f"{what} {sharding.path_str(path)}")


def _check_groups(cfg: Config, target) -> None:
    """The config must exercise a real stack (a group of >= 2 sites) and heterogeneous C."""
    sites = decomposed_sites(cfg, target)
    assert max(Counter(sites.values()).values()) >= 2
    assert len({C for _, _, C in sites.values()}) >= 2


def _check_shardings(out: dict[str, Any], cfg: Config, target, mesh) -> None:
    """Every leaf carries the sharding the spec rule gives its path and shape."""
    abstract = init_decomposition_abstract(cfg, target)
    want = sharding.tree_shardings(abstract, mesh, cfg.mesh.fsdp_min_param_size)
    for (path, x), s in zip(
        jax.tree_util.tree_leaves_with_path(out), jax.tree.leaves(want), strict=True
    ):
        assert x.sharding.is_equivalent_to(s, x.ndim), (sharding.path_str(path), x.sharding, s)
        assert set(x.sharding.device_set) == set(mesh.devices.flat)
    n = mesh.shape["fsdp"]
    for p, c in out["components"].items():
        if n > 1:
            assert c["V"].sharding.spec == P(None, "fsdp"), p
            assert c["U"].sharding.spec == P("fsdp", None), p
            starts = {s.index[1].start for s in c["V"].addressable_shards}
            assert len(starts) == n  # really split over the component axis
        else:
            assert c["V"].sharding.is_fully_replicated


@pytest.mark.slow  # 20-25 s each, their reference init included
@pytest.mark.parametrize(
    ("case", "n_devices"),
    [
        ("llama-mlp", 1),
        ("llama-mlp", 4),
        ("tms-hidden-vector_mlp", 4),
        ("llama-shared_mlp", 1),
        ("llama-transformer", 4),
    ],
)
def test_stacked_init_is_bit_identical_to_the_per_site_reference(case: str, n_devices: int):
    cfg = parse_config(CASES[case])
    target = target_from_config(cfg)
    _check_groups(cfg, target)
    mesh = _mesh(n_devices)
    out, compile_s = init_decomposition(cfg, target, mesh, KEY)
    assert set(out) == {"components", "ci_fns", "sources"}
    if case.startswith("tms"):
        assert "linear2" not in out["components"] and "linear2" in out["ci_fns"]
        assert out["sources"]["linear2"].shape == (16, 9)
    assert {k.rsplit("_", 1)[-1] for k in compile_s} == {"stacked", "fanout"}
    ref_comps, ref_ci, ref_src = _reference(case, cfg, target)
    _assert_tree_equal(out["components"], ref_comps, "components")
    _assert_tree_equal(out["ci_fns"], ref_ci, "ci_fns")
    _assert_tree_equal(out["sources"], ref_src, "sources")
    _check_shardings(out, cfg, target, mesh)


@pytest.mark.slow  # the benchmark's baseline, not a pdctl code path: ~6-10 s of compiles
def test_per_item_init_gives_the_same_values_and_shardings(monkeypatch: pytest.MonkeyPatch):
    """The naive per-site jit (the benchmark's baseline) computes the same bits: swap it in for
    `grouped_init` inside `init_decomposition`."""
    cfg = parse_config(CASES["llama-mlp"])
    target = target_from_config(cfg)
    mesh = _mesh(4)
    monkeypatch.setattr(init_weights, "grouped_init", engine_init.per_item_init)
    out, compile_s = init_decomposition(cfg, target, mesh, KEY)
    assert {k.rsplit("_", 2)[-2:] == ["per", "item"] for k in compile_s} == {True}
    ref_comps, ref_ci, ref_src = _reference("llama-mlp", cfg, target)
    _assert_tree_equal(out["components"], ref_comps, "components")
    _assert_tree_equal(out["ci_fns"], ref_ci, "ci_fns")
    _assert_tree_equal(out["sources"], ref_src, "sources")
    _check_shardings(out, cfg, target, mesh)


def test_grouped_init_groups_by_signature_and_keeps_site_order(
    monkeypatch: pytest.MonkeyPatch,
):
    """The engine primitive on its own: items with the same signature share one stacked
    output, every item still gets `init_one(keys[i], *sig_i)` with its own key, and the result
    keeps the caller's order (interleaved signatures catch a fan-out that mixes up indices).
    No jit it builds returns more than groups x leaves arrays: the fan-out must not become one
    jit with a separately sharded output per item and leaf (its compile grows with the sites)."""

    def init_one(key, n):
        return {"w": jax.random.normal(key, (4, n)), "k": jax.random.key_data(key)}

    n = 8
    names = [f"s{i}" for i in range(n)]
    sigs = [(2 + i % 2,) for i in range(n)]  # two groups, interleaved
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.PRNGKey(0), i))(np.arange(n))
    mesh = _mesh(4)

    def spec_fn(path, shape):
        return P("fsdp", None) if path.endswith(".w") else P()

    outputs_per_jit = []
    real_jit = jax.jit

    def counting_jit(fun, **kw):
        outputs_per_jit.append(len(jax.tree.leaves(kw.get("out_shardings"))))
        return real_jit(fun, **kw)

    monkeypatch.setattr(jax, "jit", counting_jit)
    out, timings = engine_init.grouped_init(init_one, names, sigs, keys, mesh, spec_fn)
    monkeypatch.undo()
    assert list(out) == names and set(timings) == {"stacked", "fanout"}
    assert 0 < max(outputs_per_jit) <= 2 * 2, outputs_per_jit  # groups x leaves, not n x leaves
    for i, name in enumerate(names):
        want = jax.jit(init_one, static_argnums=1)(keys[i], *sigs[i])
        np.testing.assert_array_equal(np.asarray(out[name]["k"]), np.asarray(keys[i]))
        np.testing.assert_array_equal(np.asarray(out[name]["w"]), np.asarray(want["w"]))
        assert out[name]["w"].sharding.spec == P("fsdp", None)
