"""Dataset attributions: gradient x input of a component's CI logit, against finite
differences on a tiny two-layer Llama (pdctl's `llama_mlp`, every site decomposed), and the
command over an LM harvest."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import cli, cli_fails, make_run

from pdctl.harvest import attributions as A
from pdctl.harvest import db

SITES = ("layers.0.attn.v", "layers.0.mlp.up", "layers.1.attn.q", "layers.1.mlp.down")


def _tiny_llama(kind: str = "mlp"):
    """The target, its weights, four sites' components (C = 4) and CI functions (one hidden
    layer of 8), drawn with numpy (no init program to compile), and two token sequences."""
    from pdctl.science.targets.llama_mlp import LlamaMLP

    target = LlamaMLP(vocab_size=64, d_model=16, n_layers=2, n_heads=2, d_mlp=32, seq_len=8)
    rng = np.random.default_rng(0)

    def draw(shape, std=0.3):
        return jnp.asarray(rng.normal(0.0, std, shape), jnp.float32)

    params = jax.tree.map(lambda a: draw(a.shape), jax.eval_shape(target.init, jax.random.key(0)))
    shapes = target.site_shapes()
    comps = {p: {"V": draw((shapes[p][0], 4)), "U": draw((4, shapes[p][1]))} for p in SITES}
    # mlp: each component's MLP on its x @ V[:, c]; vector_mlp: on the whole site input
    width = {p: 1 if kind == "mlp" else shapes[p][0] for p in SITES}
    ci_fns = {p: {"0": {"W": draw((4, width[p], 8)), "b": draw((4, 8))},
                  "1": {"W": draw((4, 8, 1)), "b": draw((4, 1))}} for p in SITES}  # fmt: skip
    x = rng.integers(0, 64, (2, 8)).astype(np.int32)
    return target, params, comps, ci_fns, x


def _f64(tree):
    return jax.tree.map(
        lambda a: jnp.asarray(a, jnp.float64) if jnp.issubdtype(a.dtype, jnp.floating) else a,
        tree,
    )


@pytest.mark.slow  # two compiles of a two-layer Llama's backward: ~5 s each
@pytest.mark.parametrize("kind", ["mlp", "vector_mlp"])
def test_attributions_equal_finite_differences_on_a_tiny_llama(kind: str):
    """The z attributed is the CI logit the evaluation computes on the clean forward; each
    upstream component's attribution equals the derivative of z along W += eps V[:, c] U[c, :]
    (the target's own override, not the masked forward), and each input position's along the
    embedded token scaled by 1 + eps, by central differences in float64."""
    from pdctl.science.spd.ci import ci_fn_apply
    from pdctl.science.spd.losses import clean_forward
    from pdctl.science.targets.base import Residual, apply_sites

    target, params, comps, ci_fns, x = _tiny_llama(kind)
    site, c, t = "layers.1.mlp.down", 2, np.array([5, 7])
    paths = SITES
    with jax.enable_x64(True):
        params, comps, ci_fns = _f64(params), _f64(comps), _f64(ci_fns)
        z, g_in, g_comp = A.attribute(target, params, comps, ci_fns, kind, site, c, x, t)
        assert z.dtype == np.float64 and g_in.dtype == np.float64

        def logit(x_in):
            V = comps[site]["V"]
            return np.asarray(ci_fn_apply(kind, ci_fns[site], x_in, x_in @ V))[[0, 1], t, c]

        clean = clean_forward(target, params, jnp.asarray(x), paths, prefix=False)
        # the same operations in another program: float32 parts (see below) round alike to ~1e-8
        np.testing.assert_allclose(z, logit(clean.site_inputs[site]), rtol=1e-6)

        def z_at(x_in):
            V = comps[site]["V"]
            return ci_fn_apply(kind, ci_fns[site], x_in, x_in @ V)[jnp.arange(2), t, c]

        @jax.jit
        def z_jit(delta, scale):
            """z with each site p's W + delta[p] (the target's own override), the embedded
            stream times scale (B, T)."""
            first = Residual(0)
            apply_sites(target, params, jnp.asarray(x), residual=first)
            _, got = apply_sites(target, params, jnp.asarray(x),
                                 lambda x_in, W, d: x_in @ (W + d), delta, capture=(site,),
                                 start=Residual(0, first.x * scale[..., None]))  # fmt: skip
            return z_at(got[site])

        zero = {p: jnp.zeros_like(comps[p]["V"] @ comps[p]["U"]) for p in paths}
        one = jnp.ones((2, 8), jnp.float64)

        def z_with(delta=None, scale=None):
            return np.asarray(z_jit({**zero, **(delta or {})}, one if scale is None else scale))

        # The target computes its RMSNorm statistics, RoPE and attention scores in float32
        # (whatever the weights' dtype): z carries float32 rounding (~1e-8 here), so the
        # differences take eps = 3e-3 (measured: rounding / eps and the eps^2 truncation each
        # leave <= 5e-6) and the comparison an atol of 1e-5 beside rtol 1e-3; the attributions
        # checked reach 3e-2 (mlp) and 1e-1 (vector_mlp).
        eps = 3e-3
        checked = 0
        for p in paths:
            for cc in range(4):
                uv = jnp.outer(comps[p]["V"][:, cc], comps[p]["U"][cc, :])
                fd = (z_with({p: eps * uv}) - z_with({p: -eps * uv})) / (2 * eps)
                np.testing.assert_allclose(g_comp[p][:, cc], fd, rtol=1e-3, atol=1e-5,
                                           err_msg=f"{p} #{cc}")  # fmt: skip
                checked += bool(np.any(np.abs(fd) > 1e-4))
        assert checked >= 10  # most upstream components do move z (not a test of zeros)
        assert not np.any(g_comp[site])  # the site's own components: after its input
        for tp in range(8):
            s = np.ones((2, 8))
            up, down = s.copy(), s.copy()
            up[:, tp] += eps
            down[:, tp] -= eps
            fd = (z_with(scale=jnp.asarray(up)) - z_with(scale=jnp.asarray(down))) / (2 * eps)
            np.testing.assert_allclose(g_in[:, tp], fd, rtol=1e-3, atol=1e-5, err_msg=f"t' {tp}")
        assert np.all(g_in[0, 6:] == 0) and np.any(g_in[0, :6] != 0)  # causal: t' > t is 0


def test_attribution_sums_the_component_and_ranks_sources():
    mean = {"a": np.array([0.5, -0.2, 0.0]), "b": np.array([0.5, 0.7, -0.9])}
    got = A._ranked(mean, ["a", "b"], 2)
    assert got == {
        "raises": [("b", 1, 0.7), ("a", 0, 0.5)],
        "lowers": [("b", 2, -0.9), ("a", 1, -0.2)],
    }


@pytest.mark.slow  # a tiny Llama through its stages, harvest and attributions
def test_attributions_command_on_an_lm_harvest(tmp_path: Path):
    """`pdctl attributions` on a tiny llama-mlp run's harvest: rows for the components
    asked for, equal to `attribute` on the harvest's top examples, averaged."""
    import sqlite3

    from pdctl.engine import sharding
    from pdctl.project import Project
    from pdctl.stages.decomposition import load_decomposition
    from pdctl.stages.env import StageEnv, corpus_tokens

    run = make_run(tmp_path, "llama-mlp", "lm", pretrain={"steps": 2, "log_every": 1},
                   warmup={"steps": 2, "log_every": 1})  # fmt: skip
    for stage in ("init-weights", "pretrain", "warmup"):  # the warmup's decomposition will do
        assert cli("--project", run, stage).exit_code == 0, stage
    r = cli("--project", run, "harvest", "--stage", "warmup", "--tokens", "256", "--effects",
            "0", "--top-k", "4")  # fmt: skip
    assert r.exit_code == 0, r.output
    r = cli("--project", run, "attributions", "--components", "16", "--top", "5")
    assert r.exit_code == 0, r.output
    path = run / "harvest" / "harvest.db"
    con = db.open_readonly(path)
    (n,) = con.execute("SELECT min(16, count(*)) FROM components WHERE count > 0").fetchone()
    assert f"attributed {n} components over " in r.output and n > 4, (n, r.output)
    done = con.execute("SELECT DISTINCT site, component FROM attr_inputs").fetchall()
    assert len(done) == n
    site, c = next(d for d in done if d[0] == "layers.0.mlp.down")  # mlp.up is upstream of it
    ex = con.execute("SELECT position FROM examples WHERE site = ? AND component = ? AND "
                     "kind = 'top' ORDER BY rank", (site, c)).fetchall()  # fmt: skip
    offsets = dict(con.execute("SELECT offset, attr FROM attr_inputs WHERE site = ? AND "
                               "component = ?", (site, c)).fetchall())  # fmt: skip
    sources = con.execute("SELECT kind, source_site, source_component, attr FROM attr_sources "
                          "WHERE site = ? AND component = ? ORDER BY kind, rank",
                          (site, c)).fetchall()  # fmt: skip
    con.close()
    project = Project.load(run / "pdctl.toml")
    dec = load_decomposition(project, "warmup")
    T = project.config.data.seq_len
    env = StageEnv(project, "train", sharding.make_mesh(1, 1, jax.devices()[:1]), dec.target)
    windows = np.asarray(corpus_tokens(env, "eval"))[: (256 // T) * T].reshape(-1, T)
    pos = np.array([p for (p,) in ex])
    w, t = np.divmod(pos, T)
    kind = project.config.decomp.ci_fn.type
    _, g_in, g_comp = A.attribute(dec.target, dec.params, dec.components, dec.ci_fns, kind,
                                  site, c, windows[w], t)  # fmt: skip
    want = {o: g_in[(t + o) >= 0, (t + o)[(t + o) >= 0]].sum() / len(t) for o in range(-8, 1)}
    want = {o: v for o, v in want.items() if np.any(t + o >= 0)}
    assert sorted(offsets) == sorted(want)
    np.testing.assert_allclose(
        [offsets[o] for o in sorted(want)], [want[o] for o in sorted(want)], rtol=1e-6
    )  # fmt: skip  (stored as float32)
    mean = {p: v.mean(axis=0) for p, v in g_comp.items()}
    for kind_, s, sc, v in sources:
        assert (v > 0) == (kind_ == "raises")
        np.testing.assert_allclose(v, mean[s][sc], rtol=1e-6)
    assert any(k == "raises" for k, *_ in sources)
    # a second run replaces the tables
    assert cli("--project", run, "attributions", "--components", "1").exit_code == 0
    con = sqlite3.connect(path)
    assert con.execute("SELECT count(DISTINCT site || component) FROM attr_inputs").fetchone() == (
        1,
    )
    con.close()


def test_attributions_bad_input_is_one_line_and_writes_nothing(tmp_path: Path):
    from test_cluster import _synthetic_run

    run = _synthetic_run(tmp_path)  # a toy's harvest
    path = run / "harvest" / "harvest.db"
    before = path.read_bytes()
    line = cli_fails(2, "--project", run, "attributions")
    assert "attributions: language-model harvests only (this harvest is of a tms run)" in line
    assert "--components: must be >= 1, got 0" in cli_fails(
        2, "--project", run, "attributions", "--components", "0"
    )
    assert "--top: must be an integer, got 'x'" in cli_fails(
        2, "--project", run, "attributions", "--top", "x"
    )
    assert path.read_bytes() == before
    fresh = make_run(tmp_path, "tms", "fresh")
    assert "no harvest here" in cli_fails(2, "--project", fresh, "attributions")
