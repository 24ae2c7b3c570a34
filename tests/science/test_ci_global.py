"""The global shared transformer CI function (`decomp.ci_fn.type = "global_shared_transformer"`):
ONE transformer over every site's input, one CI head per site (goodfire-ai/spd, branch
feature/misc-improvements, `GlobalSharedTransformerCiFn` in spd/models/components.py).

- its forward against the torch reference on the same weights: a port of that module here
  (`_TorchGlobal`, run live when torch is installed) and numbers from the reference module
  itself (`SPD_GLOBAL`, printed by tests/science/reference_numbers.py, which runs the real code and
  checks the port against it);
- its layout: a stacked unit (`scan_layers`) gives what its sites give one by one, the
  squashing noise is each site's own draw, a missing site is refused;
- its init: shapes, statistics, and init-weights' grouped init equal to the per-site reference;
- end to end: `pdctl run` on the tiny Hugging Face Llama with the layers scanned and not, the
  CI of the two (through `pdctl.open`) equal to float32 reassociation.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pdctl.science.spd import ci as ci_mod
from pdctl.science.spd import components as comp_mod

KIND = "global_shared_transformer"
SHARED = comp_mod.SHARED_CI_KEY

# ---------------------------------------------------------------------------------------------
# a fixed case: three sites, different d_in and C, two blocks, every bias non-zero

# {site: (d_in, C)}, in the target's order (the reference sorts them by name: b, a, c -> a, b, c)
SITES = {"b.up": (6, 3), "a.down": (10, 4), "c.q": (6, 5)}
D, HEADS, FFN, N_BLOCKS = 8, 2, 12, 2
B, T = 2, 5


def global_case(n_blocks: int = N_BLOCKS) -> tuple[dict, dict]:
    """(ci_fns in pdctl's layout, {site: x (B, T, d_in)}) with fixed random weights (numpy
    seed 0) and inputs of varied scale per site."""
    rng = np.random.default_rng(0)

    def w(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    ci_fns: dict = {
        p: {"in": {"W": w(d_in, D)}, "out": {"W": w(D, C), "b": w(C, scale=0.1)}}
        for p, (d_in, C) in SITES.items()
    }
    ci_fns[SHARED] = {
        "in": {"b": w(D, scale=0.1)},
        "blocks": {
            "wq": w(n_blocks, D, HEADS, D // HEADS),
            "wk": w(n_blocks, D, HEADS, D // HEADS),
            "wv": w(n_blocks, D, HEADS, D // HEADS),
            "wo": w(n_blocks, HEADS, D // HEADS, D),
            "w1": w(n_blocks, D, FFN),
            "b1": w(n_blocks, FFN, scale=0.1),
            "w2": w(n_blocks, FFN, D),
            "b2": w(n_blocks, D, scale=0.1),
        },
    }
    x = {p: w(B, T, d_in, scale=1.0 + i) for i, (p, (d_in, _)) in enumerate(SITES.items())}
    return ci_fns, x


def _logits(ci_fns, x) -> dict[str, np.ndarray]:
    return {k: np.asarray(v) for k, v in jax.jit(ci_mod.global_ci_logits)(ci_fns, x).items()}


# ---------------------------------------------------------------------------------------------
# parity with the torch reference


def reference_state_dict(ci_fns: dict) -> dict[str, np.ndarray]:
    """pdctl's parameters as the reference module's state dict: its input projector is the
    per-site row blocks concatenated in the reference's (sorted) site order, its output head
    the per-site heads side by side; torch's Linear stores (out, in), the reference's own
    `Linear` (in, out)."""
    order = sorted(s for s in ci_fns if s != SHARED)
    shared = ci_fns[SHARED]
    sd = {
        "_input_projector.W": np.concatenate([ci_fns[s]["in"]["W"] for s in order], axis=0),
        "_input_projector.b": shared["in"]["b"],
        "_output_head.W": np.concatenate([ci_fns[s]["out"]["W"] for s in order], axis=1),
        "_output_head.b": np.concatenate([ci_fns[s]["out"]["b"] for s in order]),
    }
    blocks = shared["blocks"]
    for i in range(blocks["wq"].shape[0]):
        b = {k: np.asarray(v[i]) for k, v in blocks.items()}
        d = b["w1"].shape[0]
        for name, key in (("q_proj", "wq"), ("k_proj", "wk"), ("v_proj", "wv")):
            sd[f"_blocks.{i}.attn.{name}.weight"] = b[key].reshape(d, d).T
        sd[f"_blocks.{i}.attn.out_proj.weight"] = b["wo"].reshape(d, d).T
        sd[f"_blocks.{i}.mlp.0.W"], sd[f"_blocks.{i}.mlp.0.b"] = b["w1"], b["b1"]
        sd[f"_blocks.{i}.mlp.2.W"], sd[f"_blocks.{i}.mlp.2.b"] = b["w2"], b["b2"]
    return {k: np.ascontiguousarray(v, np.float32) for k, v in sd.items()}


def torch_reference(site_dims: dict[str, tuple[int, int]], d_model: int, n_blocks: int,
                    n_heads: int, ffn: int):  # fmt: skip
    """A port of goodfire-ai/spd's `GlobalSharedTransformerCiFn` (feature/misc-improvements,
    23a13bf2, spd/models/components.py: `Linear`, `RoPEEmbedding`, `SelfAttention`,
    `TransformerBlock`, `GlobalSharedTransformerCiFn`) to plain torch (the reference's einops /
    jaxtyping left out; every operation as there, in its order). Its parameter names are the
    reference's, so `reference_state_dict` loads into either; tests/science/reference_numbers.py
    checks it against the real module."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    class Linear(nn.Module):
        def __init__(self, d_in: int, d_out: int):
            super().__init__()
            self.W = nn.Parameter(torch.empty(d_in, d_out))
            self.b = nn.Parameter(torch.zeros(d_out))

        def forward(self, x):
            return torch.einsum("...i,io->...o", x, self.W) + self.b

    class RoPE(nn.Module):
        def __init__(self, d_head: int, base: float = 10000.0):
            super().__init__()
            inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2).float() / d_head))
            self.register_buffer("inv_freq", inv_freq)
            self.d_head = d_head

        def rotate(self, x, cos, sin):
            x1, x2 = x[..., : self.d_head // 2], x[..., self.d_head // 2 :]
            return x * cos + torch.cat([-x2, x1], dim=-1) * sin

        def forward(self, q, k):
            pos = torch.arange(q.shape[-2], dtype=self.inv_freq.dtype)
            angles = torch.einsum("s,d->sd", pos, self.inv_freq)
            cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
            sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
            return self.rotate(q, cos, sin), self.rotate(k, cos, sin)

    class SelfAttention(nn.Module):
        def __init__(self, d: int, n_heads: int):
            super().__init__()
            self.d, self.n_heads, self.d_head = d, n_heads, d // n_heads
            self.q_proj = nn.Linear(d, d, bias=False)
            self.k_proj = nn.Linear(d, d, bias=False)
            self.v_proj = nn.Linear(d, d, bias=False)
            self.out_proj = nn.Linear(d, d, bias=False)
            self.rope = RoPE(self.d_head)

        def forward(self, x):
            *lead, t, _ = x.shape

            def heads(a):
                return a.view(*lead, t, self.n_heads, self.d_head).transpose(-3, -2)

            q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
            q, k = self.rope(q, k)
            o = F.scaled_dot_product_attention(q, k, v, dropout_p=0.0, is_causal=False)
            return self.out_proj(o.transpose(-3, -2).contiguous().view(*lead, t, self.d))

    class Block(nn.Module):
        def __init__(self, d: int, n_heads: int, ffn: int):
            super().__init__()
            self.d = d
            self.attn = SelfAttention(d, n_heads)
            self.mlp = nn.Sequential(Linear(d, ffn), nn.GELU(), Linear(ffn, d))

        def forward(self, x):
            x = x + self.attn(F.rms_norm(x, (self.d,)))
            return x + self.mlp(F.rms_norm(x, (self.d,)))

    class GlobalSharedTransformer(nn.Module):
        def __init__(self):
            super().__init__()
            self.order = sorted(site_dims)
            self.splits = [site_dims[s][1] for s in self.order]
            total_in = sum(d for d, _ in site_dims.values())
            total_c = sum(c for _, c in site_dims.values())
            self._input_projector = Linear(total_in, d_model)
            self._output_head = Linear(d_model, total_c)
            self._blocks = nn.ModuleList(Block(d_model, n_heads, ffn) for _ in range(n_blocks))

        def forward(self, acts):
            xs = [F.rms_norm(acts[s], (acts[s].shape[-1],)) for s in self.order]
            x = self._input_projector(torch.cat(xs, dim=-1))
            assert x.ndim == 3
            for block in self._blocks:
                x = block(x)
            out = torch.split(self._output_head(x), self.splits, dim=-1)
            return {s: out[i] for i, s in enumerate(self.order)}

    return GlobalSharedTransformer()


def run_torch_reference(module, ci_fns: dict, x: dict) -> dict[str, np.ndarray]:
    """`module` (the port, or the real reference) loaded with pdctl's `ci_fns`, on `x`."""
    import torch

    sd = {k: torch.from_numpy(v) for k, v in reference_state_dict(ci_fns).items()}
    missing, unexpected = module.load_state_dict(sd, strict=False)
    assert not unexpected and all(k.endswith("inv_freq") for k in missing), (missing, unexpected)
    with torch.no_grad():
        out = module({p: torch.from_numpy(np.asarray(v)) for p, v in x.items()})
    return {p: v.numpy() for p, v in out.items()}


# The real reference module (goodfire-ai/spd feature/misc-improvements 23a13bf2,
# `GlobalSharedTransformerCiFn` with mlp_hidden_dims [FFN]) on `global_case()`: its logits at
# positions (0, 0), (0, 4), (1, 2) of each site (tests/science/reference_numbers.py).
SPD_GLOBAL = {
    "b.up": [
        [4.038903, -3.820479, -5.136601],
        [7.080391, 1.409847, -0.341320],
        [0.124135, 0.386557, -9.763398],
    ],
    "a.down": [
        [20.764423, -5.288407, 3.580080, -0.555945],
        [10.217772, -5.598095, 0.693124, -2.826372],
        [0.181589, -1.976999, 4.743992, -1.967909],
    ],
    "c.q": [
        [-7.225641, -16.522224, -0.849855, -14.119821, 12.959476],
        [-4.900981, -4.622730, 0.191539, -9.448993, 5.207512],
        [-11.521909, 3.079889, -0.951619, -1.066331, -3.000776],
    ],
}


def test_global_matches_the_numbers_of_the_torch_reference():
    ci_fns, x = global_case()
    z = _logits(ci_fns, x)
    for p, want in SPD_GLOBAL.items():
        got = [z[p][0, 0], z[p][0, 4], z[p][1, 2]]
        # float32 on both sides in different summation orders, the reference printed to 6
        # decimals
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6, err_msg=p)


@pytest.mark.parametrize("n_blocks", [0, N_BLOCKS])
def test_global_matches_the_torch_reference_live(n_blocks):
    """pdctl's forward and the torch port on the same weights, every logit: float32 on both
    sides (sdpa against einsum-softmax, one concatenated projection against a sum of per-site
    products), so they agree to float32 rounding of values of order 1-10, not bit for bit."""
    pytest.importorskip("torch", reason="parity needs torch (the `parity` extra)")
    ci_fns, x = global_case(n_blocks)
    if n_blocks == 0:  # the reference needs no blocks either: projection then heads
        ci_fns[SHARED]["blocks"] = jax.tree.map(lambda a: a[:0], ci_fns[SHARED]["blocks"])
    want = run_torch_reference(torch_reference(SITES, D, n_blocks, HEADS, FFN), ci_fns, x)
    got = _logits(ci_fns, x)
    assert set(got) == set(want) == set(SITES)
    for p in SITES:
        assert got[p].shape == (B, T, SITES[p][1])
        np.testing.assert_allclose(got[p], want[p], rtol=1e-5, atol=1e-5, err_msg=p)


# ---------------------------------------------------------------------------------------------
# the function itself


def test_one_site_is_the_per_site_transformer():
    """With one site the global function is the per-site `transformer` with the same weights
    (the existing type, whose torch parity is tests/science/test_recipe_ci.py's): the same
    operations in the same order."""
    ci_fns, x = global_case()
    p = "a.down"
    shared = ci_fns[SHARED]
    per_site = {"in": {"W": ci_fns[p]["in"]["W"], "b": shared["in"]["b"]},
                "blocks": shared["blocks"], "out": ci_fns[p]["out"]}  # fmt: skip
    one = _logits({p: ci_fns[p], SHARED: shared}, {p: x[p]})[p]
    want = np.asarray(jax.jit(ci_mod.transformer_ci)(per_site, x[p]))
    np.testing.assert_allclose(one, want, rtol=1e-6, atol=1e-6)


def test_every_site_sees_every_site_and_position_but_no_other_sequence():
    ci_fns, x = global_case()
    z = _logits(ci_fns, x)
    x2 = dict(x)
    x2["c.q"] = x["c.q"].copy()
    x2["c.q"][0, -1] += 1.0  # the LAST position of sequence 0 of ONE site
    z2 = _logits(ci_fns, x2)
    for p in SITES:
        assert np.abs(z2[p][0, 0] - z[p][0, 0]).max() > 1e-4, p  # all sites, bidirectional
        np.testing.assert_array_equal(z2[p][1], z[p][1])  # never another sequence
    # each site's input is RMS-normalised on its own: scaling one site's input changes nothing
    x3 = {**x, "a.down": 7.0 * x["a.down"]}
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5),
                 _logits(ci_fns, x3), z)  # fmt: skip


def _stack_case():
    """global_case with the two d_in = 6 sites as two layers of one site, stacked the way a
    scanned train state holds them (group key, leading layer axis), and the per-site view of
    the same arrays. Their C differ in global_case, so both get C = 3 here."""
    ci_fns, x = global_case()
    ci_fns["c.q"]["out"] = {"W": ci_fns["c.q"]["out"]["W"][:, :3],
                            "b": ci_fns["c.q"]["out"]["b"][:3]}  # fmt: skip
    names = {"b.up": "layers.0.mlp.up", "c.q": "layers.1.mlp.up", "a.down": "a.down"}
    per_site = {names.get(k, k): v for k, v in ci_fns.items()}
    xs = {names[k]: v for k, v in x.items()}
    unit, members = "layers.0-1.mlp.up", ["layers.0.mlp.up", "layers.1.mlp.up"]

    def stacked(tree):
        out = {k: v for k, v in tree.items() if k not in members}
        out[unit] = jax.tree.map(lambda *a: np.stack(a), *(tree[m] for m in members))
        return out

    return per_site, xs, stacked, unit, members


def _comps(x: dict) -> dict:
    """Components of the right shapes (the global function never reads V)."""
    return {u: {"V": np.zeros((*a.shape[:-3], a.shape[-1], 3), np.float32)} for u, a in x.items()}


@pytest.mark.parametrize(
    "sampling",
    # binomial: its noise draws compile for ~4 s per layout on 2 cores
    ["continuous", pytest.param("binomial", marks=pytest.mark.slow)],
)
def test_a_stacked_unit_gives_its_sites_values_and_draws(sampling):
    """compute_ci on a stacked unit (scan_layers' layout: the members' parameters and inputs
    along a leading axis) equals compute_ci on the same sites one by one: the projection then
    sums the unit's members inside one contraction over (layer, d_in), the per-site one site
    after site, so float32 reassociation (1e-6 on logits of order 1-10). With binomial
    sampling the noise is each site's own `fold_in(key, i)` draw either way, as the per-site
    CI types draw it: ci_lower sees 1.05 z - 0.05 u, ci_upper z."""
    per_site, xs, stacked, unit, members = _stack_case()
    order = ["layers.0.mlp.up", "a.down", "layers.1.mlp.up"]
    key = jax.random.PRNGKey(3)

    def run(ci_fns, x):
        return ci_mod.compute_ci(_comps(x), ci_fns, x, KIND, "leaky_hard", "none", sampling,
                                 key, True, order)  # fmt: skip

    # one program for both layouts and the logits (each compile costs seconds)
    both = jax.jit(lambda a, b: (run(a, xs), run(b, stacked(xs)), ci_mod.global_ci_logits(a, xs)))
    (lo, up), (lo_s, up_s), z = both(per_site, stacked(per_site))
    for j, m in enumerate(members):
        np.testing.assert_allclose(lo_s[unit][j], lo[m], rtol=1e-5, atol=1e-5, err_msg=m)
        np.testing.assert_allclose(up_s[unit][j], up[m], rtol=1e-5, atol=1e-5, err_msg=m)
    np.testing.assert_allclose(lo_s["a.down"], lo["a.down"], rtol=1e-5, atol=1e-5)
    for i, p in enumerate(order):
        zp = np.asarray(z[p])
        up_want = np.where(zp > 1, 1 + 0.01 * (zp - 1), np.clip(zp, 0, 1))
        np.testing.assert_allclose(up[p], up_want, rtol=1e-6, atol=1e-6, err_msg=p)
        if sampling == "continuous":
            np.testing.assert_array_equal(lo[p], np.clip(zp, 0, 1), err_msg=p)
            continue
        u = np.asarray(jax.random.uniform(jax.random.fold_in(key, i), zp.shape, jnp.float32))
        np.testing.assert_allclose(lo[p], np.clip(1.05 * zp - 0.05 * u, 0, 1), atol=1e-6)
        assert np.abs(np.asarray(lo[p]) - np.clip(zp, 0, 1)).max() > 1e-3  # the noise is there


def test_gradients_reach_every_parameter_and_a_missing_site_is_refused():
    ci_fns, x = global_case(n_blocks=1)
    comps = _comps(x)

    def total(f):
        _, up = ci_mod.compute_ci(comps, f, x, KIND, "leaky_hard")
        return sum(jnp.sum(v) for v in up.values())

    g = jax.jit(jax.grad(total))(ci_fns)
    for path, leaf in jax.tree_util.tree_leaves_with_path(g):
        assert np.isfinite(leaf).all() and np.abs(leaf).max() > 0, path
    with pytest.raises(ValueError, match=r"needs every site's input; missing \['c.q'\]"):
        ci_mod.compute_ci(comps, ci_fns, {p: x[p] for p in ("a.down", "b.up")}, KIND, "hard")
    with pytest.raises(ValueError, match="reads every site's input at once"):
        ci_mod.ci_fn_apply(KIND, ci_fns["a.down"], x["a.down"], None)


# ---------------------------------------------------------------------------------------------
# init


def test_init_layout_statistics_and_the_shared_key():
    arch = (32, 4, 2, 64)
    sites = {"l.0.up": (48, 7), "l.1.up": (48, 7)}
    fan_in = 48 + 48  # the one input projection's: every site's d_in
    hidden = comp_mod.site_ci_arch(KIND, arch, [d for d, _ in sites.values()])
    assert hidden == (*arch, fan_in)
    key = jax.random.PRNGKey(3)
    site_keys = comp_mod.site_keys(key, 2)[1]
    shared_key = comp_mod.shared_ci_key(key)

    @jax.jit
    def init(site_keys, shared_key):
        # vmapped, as init-weights' grouped init runs same-shaped sites (one RNG body to
        # compile instead of one per site)
        stack = jax.vmap(lambda k: comp_mod.init_ci_fn(k, KIND, 48, 7, hidden))(site_keys)
        per_site = {p: jax.tree.map(lambda a, j=j: a[j], stack) for j, p in enumerate(sites)}
        return per_site, comp_mod.init_shared_ci_fn(shared_key, KIND, arch)

    ci_fns, s = jax.device_get(init(site_keys, shared_key))
    for p, (d_in, C) in sites.items():
        f = ci_fns[p]
        assert jax.tree.map(np.shape, f) == {"in": {"W": (d_in, 32)},
                                             "out": {"W": (32, C), "b": (C,)}}  # fmt: skip
        assert abs(float(np.var(f["in"]["W"])) / (2 / fan_in) - 1) < 0.25, p
        assert abs(float(np.var(f["out"]["W"])) * 32 - 1) < 0.35, p
        assert float(np.abs(f["out"]["b"]).max()) == 0
    blk = s["blocks"]
    assert s["in"]["b"].shape == (32,) and float(np.abs(s["in"]["b"]).max()) == 0
    assert blk["wq"].shape == (2, 32, 4, 8) and blk["wo"].shape == (2, 4, 8, 32)
    assert blk["w1"].shape == (2, 32, 64) and blk["w2"].shape == (2, 64, 32)
    assert abs(float(np.var(blk["w1"])) * 16 - 1) < 0.1
    assert abs(float(np.var(blk["w2"])) * 64 - 1) < 0.1
    assert abs(float(np.var(blk["wk"])) * 96 - 1) < 0.1
    assert float(np.abs(blk["wv"]).max()) <= 32**-0.5
    assert all(float(np.abs(blk[b]).max()) == 0 for b in ("b1", "b2"))
    assert not np.array_equal(ci_fns["l.0.up"]["in"]["W"], ci_fns["l.1.up"]["in"]["W"])
    # the shared part's key is none of the sites' (fold 2**32 - 1 of their stream), however
    # many sites there are
    assert not any(np.array_equal(shared_key, k) for k in comp_mod.site_keys(key, 64)[1])
    assert comp_mod.init_shared_ci_fn(shared_key, "transformer", arch) is None
    with pytest.raises(ValueError, match="fan_in"):
        comp_mod.init_ci_fn(key, KIND, 4, 3, arch)


def _llama_cfg(scan: bool = False):
    from pdctl.config import parse_config

    return parse_config({
        "schema": 1,
        "target": {"kind": "llama_mlp", "vocab_size": 16, "d_model": 8, "n_layers": 3,
                   "n_heads": 2, "d_mlp": 16},
        "data": {"seq_len": 4},
        "mesh": {"fsdp_min_param_size": 16},
        "decomp": {
            "sites": [{"pattern": "layers.*.mlp.up", "C": 8},
                      {"pattern": "layers.*.mlp.down", "C": 12}],
            "ci_fn": {"type": KIND, "d_model": 8, "n_heads": 2, "n_blocks": 1,
                      "ffn_hidden": 16},
        },
    })  # fmt: skip


@pytest.mark.slow  # init-weights' grouped init and the reference's per-site jits: ~25 s
def test_init_weights_is_bit_identical_to_the_reference_and_sharded_by_the_rules():
    """init-weights' grouped, sharded init (4 devices, fsdp = 4) of the global CI function
    equals the per-site reference bit for bit, the shared part included; the abstract
    decomposition the later stages restore into has the same tree."""
    from pdctl.engine import sharding
    from pdctl.stages.decomposition import abstract_decomposition, decomposed_sites
    from pdctl.stages.init_weights import init_decomposition
    from pdctl.stages.inputs import target_from_config

    cfg = _llama_cfg()
    target = target_from_config(cfg)
    key = jax.random.PRNGKey(7)
    mesh = sharding.make_mesh(1, 4, jax.devices()[:4])
    out, compile_s = init_decomposition(cfg, target, mesh, key)
    assert "ci_shared_stacked" in compile_s
    _, ref, _ = comp_mod.init_decomposition_reference(
        key, decomposed_sites(cfg, target), KIND, cfg.decomp.ci_fn.arch(), lambda C: (C + 1,)
    )
    assert jax.tree.structure(out["ci_fns"]) == jax.tree.structure(ref)
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)),
                 out["ci_fns"], ref)  # fmt: skip
    abstract = abstract_decomposition(cfg, target)["ci_fns"]
    assert jax.tree.map(lambda a: a.shape, abstract) == jax.tree.map(np.shape, ref)
    want = sharding.tree_shardings(abstract, mesh, cfg.mesh.fsdp_min_param_size)
    for got, s in zip(jax.tree.leaves(out["ci_fns"]), jax.tree.leaves(want), strict=True):
        assert got.sharding.is_equivalent_to(s, got.ndim)
    assert any(s.spec != jax.sharding.PartitionSpec() for s in jax.tree.leaves(want))


# ---------------------------------------------------------------------------------------------
# end to end: a tiny Llama trained with the layers scanned and not


def _hf_run(root, hf_llama, scan: bool):
    import os

    from helpers import cli, edit_config

    root.mkdir(parents=True)
    cwd = os.getcwd()
    os.chdir(root)
    try:
        assert cli("new", "x", "--template", "hf-lm").exit_code == 0
    finally:
        os.chdir(cwd)
    run = root / "x"
    edit_config(run, {
        "target": {"path": str(hf_llama["model"])},
        "data": {"path": str(hf_llama["corpus"]), "seq_len": 16},
        "checkpoint": {"every": 4},
        "decomp": {
            # d_in 32 and 64, C 8 and 4: two units of 2 layers when scanned
            "sites": [{"pattern": "*.mlp.up_proj", "C": 8}, {"pattern": "*.mlp.down_proj", "C": 4}],
            "ci_fn": {"type": KIND, "d_model": 16, "n_heads": 2, "n_blocks": 1,
                      "ffn_hidden": 32},
        },
        "warmup": {"steps": 2, "log_every": 2},
        "train": {"steps": 4, "batch_size": 8, "log_every": 2, "eval_every": 4,
                  "eval_batch_size": 4, "grad_accum_steps": 2, "scan_layers": scan},
    })  # fmt: skip
    return run


@pytest.mark.slow  # two `pdctl run`s of the tiny Llama (compiles dominate): ~4 min on 2 cores
def test_pdctl_run_scanned_and_not_give_the_same_ci(tmp_path, hf_llama):
    """`pdctl run` (init-weights, warmup, train with 2 micro-batches and its evaluation) on the
    2-layer Llama with the global CI function, with `scan_layers` true (every site stacked
    over the two layers: the train state holds each CI head and input projection as one array
    per unit) and false. Both finish with finite losses; the trained parameters and the CI
    `pdctl.open` computes from them agree across the two.

    Why not bit for bit: the scanned step runs the blocks in a loop and sums the stacked
    sites' projections in one contraction over (layer, d_in), the unrolled one site after
    site: float32 reassociation, which 4 AdamW steps carry into the parameters (by up to ~lr =
    5e-5 per step where a gradient is near zero and its sign differs; seen: 5e-8). So: the
    same checkpoint through both layouts to 1e-5, the two trained runs' parameters to the
    tolerance test_hf_pipeline's layout test uses for trained arrays and their CI to 1e-4
    (seen: 5e-7). Then `pdctl harvest` (the evaluation's CI program and the output effects,
    both through `compute_ci`) runs on the scanned run."""
    import json

    from helpers import cli

    import pdctl
    from pdctl.project import Project
    from pdctl.science.spd import evaluate
    from pdctl.science.spd.stacked import Stacking, per_site
    from pdctl.stages.decomposition import load_decomposition
    from pdctl.stages.inputs import with_scan

    runs = {}
    for scan in (True, False):
        run = _hf_run(tmp_path / f"scan-{scan}", hf_llama, scan)
        r = cli("--project", run, "run")
        assert r.exit_code == 0, r.output
        tr = Project.load(run / "pdctl.toml").stage("train")
        assert tr["status"] == "done" and tr["step"] == 4
        lines = [json.loads(x) for x in (run / "metrics" / "train.jsonl").read_text().splitlines()]
        assert any("total" in m for m in lines)
        assert all(np.isfinite(m["total"]) for m in lines if "total" in m)
        assert np.isfinite(tr["eval"]["ce_ci_masked"]), tr["eval"]
        runs[scan] = run
    tokens = np.random.default_rng(0).integers(0, 90, (3, 16))
    cis = {s: pdctl.open(runs[s]).target().ci(tokens) for s in runs}
    sites = list(cis[True])
    assert len(sites) == 4 and set(cis[False]) == set(sites)  # up, down x 2 layers
    for p in sites:
        assert cis[True][p].shape == (3, 16, 4 if "down_proj" in p else 8)
        d = np.abs(cis[True][p] - cis[False][p]).max()
        print(f"{p}: max |CI scanned - CI unrolled| after 4 steps {d:.3g}")
        np.testing.assert_allclose(cis[True][p], cis[False][p], rtol=1e-4, atol=1e-4, err_msg=p)
    # the scanned run's checkpoint (stored stacked, read back per site) in both layouts
    project = Project.load(runs[True] / "pdctl.toml")
    dec = load_decomposition(project, "train")
    assert SHARED in dec.ci_fns and "model.layers.1.mlp.up_proj" in dec.ci_fns
    scanned = with_scan(dec.target, True)
    paths = [p for p in dec.target.site_paths() if p in dec.components]
    stacking = Stacking.plan(scanned, paths, lambda p: jax.tree.map(np.shape, dec.ci_fns[p]))
    assert not stacking.trivial
    cfg = project.config
    lo, _ = evaluate.compute_ci_jit(
        with_scan(dec.target, False), dec.params, dec.components, dec.ci_fns, cfg, tokens
    )
    stacked = [stacking.stack(t) for t in (dec.components, dec.ci_fns)]
    lo_s, _ = evaluate.compute_ci_jit(scanned, dec.params, *stacked, cfg, tokens)
    lo_s = per_site(lo_s)
    for p in sites:
        np.testing.assert_allclose(lo_s[p], lo[p], rtol=1e-5, atol=1e-5, err_msg=p)
        np.testing.assert_allclose(cis[True][p], lo[p], rtol=1e-5, atol=1e-5, err_msg=p)
    # export names the shared part under its reserved key
    scanned_arrays = np.load(_export(runs[True], tmp_path / "s.npz"))
    names = set(scanned_arrays.files)
    assert f"ci_fns.{SHARED}.blocks.wq" in names
    assert "ci_fns.model.layers.1.mlp.down_proj.out.W" in names
    # the trained parameters of the two runs
    unrolled_arrays = np.load(_export(runs[False], tmp_path / "u.npz"))
    assert set(unrolled_arrays.files) == names
    for k in sorted(names):
        if k.startswith(("ci_fns.", "components.")):
            d = np.abs(scanned_arrays[k] - unrolled_arrays[k]).max()
            print(f"{k}: max |scanned - unrolled| {d:.3g}")
            np.testing.assert_allclose(scanned_arrays[k], unrolled_arrays[k], rtol=2e-3,
                                       atol=2e-5, err_msg=k)  # fmt: skip
    r = cli("--project", runs[True], "harvest", "--tokens", "256", "--effects", "1",
            "--top-k", "2")  # fmt: skip
    assert r.exit_code == 0, r.output
    assert (runs[True] / "harvest" / "harvest.db").is_file()
    # attributions' per-site CI gradient does not exist for one function of every site: one line
    r = cli("--project", runs[True], "attributions")
    assert r.exit_code == 2 and "not available for decomp.ci_fn.type" in r.output, r.output


def _export(run, out):
    from helpers import cli

    r = cli("--project", run, "export", "--out", out, "--stage", "train")
    assert r.exit_code == 0, r.output
    return out
