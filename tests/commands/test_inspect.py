"""`pdctl inspect-sharding`: abstract layout, bytes per device, compiled memory and donation,
plus the compile cache and profiler traces of real (tiny) stage runs.

Stage runs go through subprocesses: a stage holds its run directory's lock until its process
exits, so a second stage in this process could not take it."""

from __future__ import annotations

import json
import math
import re
import shutil
import tomllib
from pathlib import Path

import pytest
from helpers import edit_config, make_run, pdctl_process
from typer.testing import CliRunner

from pdctl.cli import app
from pdctl.engine import sharding

# ---- tiny runs -------------------------------------------------------------------------------


def tiny_llama(parent: Path, name: str = "llama", data: int = 1, fsdp: int = -1) -> Path:
    sites = [{"pattern": "layers.*.mlp.up", "C": 16}, {"pattern": "layers.*.mlp.down", "C": 16}]
    return make_run(
        parent,
        "llama-mlp",
        name,
        tiny=False,
        target={"vocab_size": 64, "d_model": 32, "n_layers": 1, "n_heads": 2, "d_mlp": 64},
        data={"seq_len": 8, "synthetic_bytes": 20000},
        mesh={"data": data, "fsdp": fsdp, "fsdp_min_param_size": 256},
        decomp={"sites": sites},
        pretrain={"steps": 4, "batch_size": 8, "log_every": 2},
        warmup={"steps": 4, "log_every": 2},
        train={
            "steps": 4,
            "batch_size": 8,
            "log_every": 2,
            "eval_every": 4,
            "eval_batch_size": 8,
        },
    )


def tiny_tms(parent: Path, name: str = "tms", **compile_table) -> Path:
    return make_run(
        parent,
        "tms",
        name,
        tiny=False,
        pretrain={"steps": 6, "batch_size": 64, "log_every": 2},
        warmup={"steps": 4, "log_every": 2},
        train={"steps": 4, "batch_size": 64, "log_every": 2, "eval_every": 4},
        **({"compile": compile_table} if compile_table else {}),
    )


def pdctl(run: Path, *args: str, env: dict[str, str] | None = None, timeout: float = 300):
    return pdctl_process(*args, project=run, env=env, timeout=timeout)


def invoke(*args: str):
    return CliRunner().invoke(app, list(args))


def ok_json(*args: str) -> dict:
    result = invoke(*args, "--json")
    assert result.exit_code == 0, (result.output, result.exception)
    return json.loads(result.stdout)


ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2, "int32": 4, "uint32": 4}


def shards_of(spec: list, mesh: dict[str, int]) -> int:
    names = [n for a in spec for n in (a if isinstance(a, list) else [a]) if n is not None]
    return math.prod(mesh[n] for n in names)


def check_rows(report: dict) -> None:
    """Every row's bytes follow from its shape, dtype and spec; totals are the rows' sum."""
    mesh = report["mesh"]
    per_kind: dict[str, int] = {}
    for r in report["rows"]:
        one = math.prod(r["shape"]) * ITEMSIZE[r["dtype"]]
        shards = shards_of(r["spec"], mesh)
        assert r["shards"] == shards, r
        assert r["bytes"] == r["count"] * one, r
        assert r["bytes_per_device"] * shards == r["count"] * one, r
        assert r["sharded"] == (shards > 1), r
        per_kind[r["kind"]] = per_kind.get(r["kind"], 0) + r["bytes_per_device"]
    t = report["totals"]
    assert t["per_device"] == per_kind
    assert t["per_device_total"] == sum(r["bytes_per_device"] for r in report["rows"])
    assert t["bytes_total"] == sum(r["bytes"] for r in report["rows"])
    assert t["donated_per_device"] == sum(
        r["bytes_per_device"] for r in report["rows"] if r["donated"]
    )
    assert t["sharded_per_device"] + t["replicated_per_device"] == t["per_device_total"]


# ---- layout ------------------------------------------------------------------------------------


@pytest.mark.slow
def test_preview_8_devices_bytes_match_shapes(tmp_path: Path) -> None:
    """--devices 8 (a child process; this one has 4): fsdp=-1 from the config, then an explicit
    data=2,fsdp=4 mesh; every array's bytes per device = shape x itemsize / shards."""
    run = tiny_llama(tmp_path)
    full = ok_json("--project", str(run), "inspect-sharding", "--devices", "8", "--all")
    assert full["devices"] == 8 and full["mesh"] == {"data": 1, "fsdp": 8, "tp": 1}
    assert full["stage"] == "train" and not full["grouped"]
    check_rows(full)
    assert any(r["sharded"] for r in full["rows"])
    assert set(full["totals"]["per_device"]) == {
        "target",
        "components",
        "ci_fns",
        "sources",
        "optimizer",
        "loop",
        "batch",
    }
    # V (d_in, C) shards over C, U (C, d_out) over C; the frozen target is not donated.
    by_path = {r["path"]: r for r in full["rows"]}
    v = by_path["trainable.components.layers.0.mlp.up.V"]
    u = by_path["trainable.components.layers.0.mlp.up.U"]
    assert v["spec"] == [None, "fsdp"] and u["spec"] == ["fsdp", None]
    assert v["donated"] and not by_path["target.embed"]["donated"]
    assert by_path["target.embed"]["sharded"]

    grouped = ok_json(
        "--project",
        str(run),
        "inspect-sharding",
        "--devices",
        "8",
        "--mesh",
        "data=2,fsdp=4",
        "--stage",
        "init_weights",
    )
    assert grouped["mesh"] == {"data": 2, "fsdp": 4, "tp": 1} and grouped["grouped"]
    check_rows(grouped)
    assert any(r["sharded"] for r in grouped["rows"])
    assert set(grouped["totals"]["per_device"]) == {"target", "components", "ci_fns", "sources"}
    groups = {r["path"]: r for r in grouped["rows"]}
    assert "components.layers.*.mlp.up.V" not in groups  # one layer: nothing to group
    # An LM target: [mesh] decomposition = "auto" shards the component axis over data x fsdp.
    assert grouped["decomposition"] == ["data", "fsdp"]
    assert groups["components.layers.0.mlp.up.V"]["shards"] == 8
    assert groups["components.layers.0.mlp.up.V"]["spec"] == [None, ["data", "fsdp"]]


def test_groups_expand_with_all(tmp_path: Path) -> None:
    """Same-shaped sites of several layers are one row; --all lists each; same totals."""
    run = tiny_llama(tmp_path, fsdp=-1)
    edit_config(run, {"target": {"n_layers": 3}})
    args = ("--project", str(run), "inspect-sharding", "--stage", "warmup")
    grouped = ok_json(*args)
    full = ok_json(*args, "--all")
    check_rows(grouped)
    check_rows(full)
    assert grouped["totals"] == full["totals"]
    assert len(grouped["rows"]) < len(full["rows"])
    g = {r["path"]: r for r in grouped["rows"]}["components.layers.*.mlp.up.V"]
    assert g["count"] == 3 and g["paths"] == [f"components.layers.{i}.mlp.up.V" for i in range(3)]
    assert g["bytes_per_device"] == 3 * math.prod(g["shape"]) * 4 // g["shards"]


def test_text_output(tmp_path: Path) -> None:
    run = tiny_tms(tmp_path)
    result = invoke(
        "--project",
        str(run),
        "inspect-sharding",
        "--stage",
        "pretrain",
        "--devices",
        "4",
        "--mesh",
        "data=2,fsdp=2",
    )
    assert result.exit_code == 0, (result.output, result.exception)
    out = result.stdout
    assert "pretrain: 4 cpu devices, mesh data=2 x fsdp=2 x tp=1" in out
    for word in ("params.linear1.W", "replicated", "optimizer state", "largest replicated"):
        assert word in out


# ---- compiled memory and donation ---------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["pretrain", "warmup", "train"])
@pytest.mark.parametrize("template", ["tms", "llama"])
def test_compile_aliases_the_donated_state(tmp_path: Path, template: str, stage: str) -> None:
    """The compiled step aliases >= 95% of the donated state's bytes (per device), and the
    frozen target of warmup/train is an argument that is not donated."""
    if template == "tms":
        run, mesh = tiny_tms(tmp_path), "data=2,fsdp=2"
    else:
        run, mesh = tiny_llama(tmp_path), "data=1,fsdp=4"
    rep = ok_json(
        "--project", str(run), "inspect-sharding", "--stage", stage, "--mesh", mesh, "--compile"
    )
    check_rows(rep)
    m, t = rep["memory"], rep["totals"]
    assert m["available"]
    assert m["donated_bytes"] == t["donated_per_device"] > 0
    assert m["alias_bytes"] >= 0.95 * m["donated_bytes"], m
    assert m["alias_fraction"] >= 0.95 and m["donation_ok"]
    assert m["argument_bytes"] >= m["donated_bytes"]
    assert m["peak_bytes_estimate"] == (
        m["argument_bytes"] + m["output_bytes"] + m["temp_bytes"] - m["alias_bytes"]
    )
    if stage == "pretrain":
        assert t["donated_per_device"] == t["per_device_total"] - t["per_device"].get("batch", 0)
    else:
        assert t["per_device"]["target"] > 0
        assert t["donated_per_device"] == t["per_device_total"] - t["per_device"]["target"] - (
            t["per_device"].get("batch", 0)
        )


def test_init_weights_has_no_step(tmp_path: Path) -> None:
    rep = ok_json(
        "--project",
        str(tiny_tms(tmp_path)),
        "inspect-sharding",
        "--stage",
        "init-weights",
        "--compile",
    )
    assert rep["memory"] is None and any("no step" in n for n in rep["notes"])


# ---- real runs: compile cache, profiler ---------------------------------------------------------


@pytest.fixture(scope="module")
def tms_initialized(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny TMS run with init-weights done (in a subprocess)."""
    parent = tmp_path_factory.mktemp("runs")
    run = tiny_tms(parent, cache_dir=str(parent / "unused-cache"))
    out = pdctl(run, "init-weights")
    assert out.returncode == 0, out.stderr
    return run


@pytest.mark.slow  # three fresh processes, each importing JAX and compiling: ~12 s
def test_second_process_hits_the_compile_cache(tms_initialized: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    shutil.copytree(tms_initialized, run)
    cache = tmp_path / "cache"
    p = run / "pdctl.toml"
    text = p.read_text()
    assert text.count("unused-cache") == 1
    p.write_text(re.sub(r'cache_dir = ".*"', f"cache_dir = {json.dumps(str(cache))}", text))
    env = {"JAX_LOG_COMPILES": "1"}
    hit = "Persistent compilation cache hit for 'jit_step'"
    compile_s = []
    for i in range(2):
        out = pdctl(run, "pretrain", "--fresh", env=env)
        assert out.returncode == 0, out.stderr
        assert "pretrain: done at step 6" in out.stdout
        assert "Finished XLA compilation of jit(step)" in out.stderr  # compile logs not muted
        assert (hit in out.stderr) == (i == 1), out.stderr[-3000:]
        state = tomllib.loads(p.read_text())["state"]["pretrain"]
        compile_s.append(state["compile_s"]["step"])
    assert any(cache.iterdir())
    assert compile_s[1] < compile_s[0], compile_s
    print(
        f"compile_s.step cold {compile_s[0]:.3f} s, cached {compile_s[1]:.3f} s, "
        f"ratio {compile_s[0] / compile_s[1]:.1f}x"
    )


@pytest.mark.slow  # a profiler trace of a compiled stage: ~10 s with its fixture
def test_profile_steps_write_a_trace(tms_initialized: Path) -> None:
    out = pdctl(tms_initialized, "pretrain", "--fresh", "--profile-steps", "2:4")
    assert out.returncode == 0, out.stderr
    files = [f for f in (tms_initialized / "profiles" / "pretrain").rglob("*") if f.is_file()]
    assert any(f.name.endswith(".xplane.pb") for f in files), files
    assert all(f.stat().st_size > 0 for f in files)


# ---- bad input ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--stage", "nope"], "--stage: unknown stage 'nope'"),
        (["--mesh", "data"], "--mesh: expected data=A,fsdp=B,tp=C"),
        (["--mesh", "data=x,fsdp=2"], "--mesh: expected data=A,fsdp=B,tp=C"),
        (["--mesh", "data=2,model=2"], "--mesh: expected data=A,fsdp=B,tp=C"),
        (["--mesh", "data=-1,fsdp=-1"], "--mesh: only one of mesh.data and mesh.fsdp"),
        (["--mesh", "data=0,fsdp=4"], "--mesh: mesh sizes must be positive"),
        (["--mesh", "data=2,fsdp=3"], "--mesh: data=2,fsdp=3 does not fit"),
        (["--mesh", "data=3,fsdp=2", "--devices", "8"], "--mesh: data=3,fsdp=2 does not fit"),
        (["--devices", "0"], "--devices: must be >= 1"),
        (["--mesh", "tp=3"], "--mesh: data=-1,fsdp=1,tp=3 does not fit: mesh.tp: 3 does not"),
        (["--mesh", "tp=2"], "mesh.tp: the tms target has no tensor-parallel layout"),
    ],
    ids=[
        "stage",
        "mesh-no-eq",
        "mesh-not-int",
        "mesh-axis",
        "mesh-two-wild",
        "mesh-zero",
        "mesh-no-fit",
        "mesh-no-fit-preview",
        "devices-zero",
        "tp-no-fit",
        "tp-toy",
    ],
)
def test_bad_options_are_one_line_errors(tmp_path: Path, argv: list[str], expected: str) -> None:
    run = tiny_tms(tmp_path)
    result = invoke("--project", str(run), "inspect-sharding", *argv)
    assert result.exit_code == 2, (result.output, result.exception)
    assert isinstance(result.exception, SystemExit)
    lines = result.output.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.output
    assert expected in lines[0], result.output
    assert result.stdout == ""


@pytest.mark.slow
def test_child_error_is_relayed(tmp_path: Path) -> None:
    """A config error in the --devices child comes back as its one line and exit code 2."""
    run = tiny_tms(tmp_path)
    edit_config(run, {"mesh": {"data": 3, "fsdp": 1}})
    result = invoke("--project", str(run), "inspect-sharding", "--devices", "8")
    assert result.exit_code == 2, result.output
    assert result.output.strip().splitlines() == [
        "error: mesh: data=3 x fsdp=1 = 3 devices, but 8 are available; set mesh.data = -1 to "
        "use them all"
    ]


# ---- the fit check ---------------------------------------------------------------------------


@pytest.mark.slow  # two compiles of the step and two eval programs: ~10-20 s
def test_fit_check_arithmetic_and_verdict(tmp_path: Path) -> None:
    """--device-memory compiles the train step and the evaluation's programs (4 devices, data x
    fsdp); each program's bytes are XLA's memory_analysis() of that compiled program, the
    peak is argument + output + temporaries - aliased (+ for an evaluation the train state it
    runs beside), and the verdict is peak <= budget (exit 0 either way). The step's figures
    equal the plain --compile report's."""
    import jax

    from pdctl import inspect as insp
    from pdctl.inspect import fit
    from pdctl.project import Project

    run = tiny_llama(tmp_path, data=2, fsdp=2)
    cfg = Project.load(run / "pdctl.toml").config
    report = insp.inspect(cfg, "train", devices=jax.devices()[:4], budget=(10**12, "1 TB"))
    f = report["fit"]
    names = [q["program"] for q in f["programs"]]
    assert names == ["train step", "eval: CI", "eval: masked forwards"]
    # an evaluation runs beside the train state it does not take (optimizer, sources, ...)
    held = fit.held_during_eval(insp.array_rows(insp.plan(cfg, "train", sharding_mesh(cfg, 4))))
    assert held > 0
    for q in f["programs"]:
        assert q["available"]
        parts = q["argument_bytes"] + q["output_bytes"] + q["temp_bytes"] - q["alias_bytes"]
        assert q["held_bytes"] == (held if q["program"].startswith("eval") else 0)
        assert q["peak_bytes"] == parts + q["held_bytes"] > 0
    step = f["programs"][0]
    m = report["memory"]
    assert (step["argument_bytes"], step["output_bytes"], step["temp_bytes"]) == (
        m["argument_bytes"], m["output_bytes"], m["temp_bytes"],
    )  # fmt: skip
    assert step["alias_bytes"] == m["alias_bytes"] > 0  # the donated state aliases
    # every program's figures are XLA's for that program, compiled here on its own
    p = insp.plan(cfg, "train", sharding_mesh(cfg, 4))
    compiled = fit.compile_all(p, *insp.compile_step(p))
    for q in f["programs"]:
        got = compiled[q["program"]][0].memory_analysis()
        assert (q["argument_bytes"], q["temp_bytes"], q["alias_bytes"]) == (
            got.argument_size_in_bytes, got.temp_size_in_bytes, got.alias_size_in_bytes,
        )  # fmt: skip
    peak = max(q["peak_bytes"] for q in f["programs"])
    assert f["peak_bytes"] == peak and f["fits"] and f["margin_bytes"] == 10**12 - peak
    assert len(f["largest_arrays"]) == 10
    sizes = [r["bytes_per_device"] for r in f["largest_arrays"]]
    assert sizes == sorted(sizes, reverse=True)
    # at exactly the peak it fits; one byte less and it does not
    rows = insp.array_rows(p)
    at = fit.check(p, compiled, (peak, "peak"), rows)
    assert at["fits"] and at["margin_bytes"] == 0
    under = fit.check(p, compiled, (peak - 1, "peak - 1"), rows)
    assert not under["fits"] and under["margin_bytes"] == -1


def sharding_mesh(cfg, n: int):
    import jax

    from pdctl.engine import sharding

    return sharding.make_mesh(cfg.mesh.data, cfg.mesh.fsdp, jax.devices()[:n])


@pytest.mark.slow
def test_fit_check_cli(tmp_path: Path) -> None:
    from pdctl.inspect import fit

    assert fit.parse_memory("80GiB") == 80 * 2**30
    assert fit.parse_memory("40 GB") == 40 * 10**9
    assert fit.parse_memory("1.5TiB") == int(1.5 * 2**40)
    assert fit.DEVICE_MEMORY["h200"] == 141 * 2**30
    run = tiny_tms(tmp_path)
    out = invoke("--project", str(run), "inspect-sharding", "--device-kind", "h100", "--json")
    assert out.exit_code == 0, out.output
    f = json.loads(out.stdout)["fit"]
    assert f["budget_bytes"] == 80 * 2**30 and f["fits"]
    assert f["peak_factor"] == 1.0 and f["peak_bytes"] == f["unscaled_peak_bytes"]  # a GPU kind
    text = invoke("--project", str(run), "inspect-sharding", "--device-memory", "1KiB")
    assert text.exit_code == 0 and "DOES NOT FIT" in text.stdout, text.output
    for args, says in (
        (["--device-memory", "lots"], "--device-memory: expected a size"),
        (["--device-memory", "0GB"], "--device-memory: expected a size"),
        (["--device-kind", "v100"], "--device-kind: unknown kind 'v100'"),
        (["--device-kind", "h100", "--device-memory", "8GB"], "give one of them"),
    ):
        bad = invoke("--project", str(run), "inspect-sharding", *args)
        assert bad.exit_code == 2, (args, bad.output)
        lines = [x for x in bad.stderr.splitlines() if x.strip()]
        assert len(lines) == 1 and says in lines[0], (args, bad.stderr)


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--device-memory", ""], "--device-memory: expected a size such as 80GiB or 40GB, got ''"),
        (["--device-memory", "0.5B"], "--device-memory: expected a size such as 80GiB"),
        (["--device-kind", ""], "--device-kind: unknown kind ''"),
        (["--device-memory", "", "--device-kind", ""], "give one of them"),
    ],
)
def test_an_empty_or_sub_byte_device_memory_is_one_line(tmp_path: Path, args, says) -> None:
    # these used to give exit 0 and no fit check (fast: refused before any compile)
    run = tiny_tms(tmp_path)
    bad = invoke("--project", str(run), "inspect-sharding", *args)
    assert bad.exit_code == 2, (args, bad.output)
    lines = [x for x in bad.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], bad.stderr


def test_an_imported_model_inspects_from_its_config_json_alone(tmp_path: Path) -> None:
    """The fit check's promise: a config.json is enough to lay out (and compile) a model one
    does not have; a stage that needs the weights still refuses the directory."""
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 32,
        "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 128, "max_position_embeddings": 64,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": False,
        "eos_token_id": 2,
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    run = make_run(tmp_path, "hf-lm", tiny=False, target={"path": str(model)},
                   data={"seq_len": 16})  # fmt: skip
    out = invoke("--project", str(run), "inspect-sharding", "--json")
    assert out.exit_code == 0, out.output
    rows = {r["path"] for r in json.loads(out.stdout)["rows"]}
    assert any("model.layers" in r and r.endswith(".V") for r in rows), sorted(rows)[:5]
    bad = invoke("--project", str(run), "init-weights")
    assert bad.exit_code == 2 and "no weights in" in bad.stderr, bad.output


def test_tensor_parallel_layout_is_shown_and_a_tp_the_heads_refuse_is_one_line(
    tmp_path: Path,
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 128, "max_position_embeddings": 64,
    }  # fmt: skip
    (model / "config.json").write_text(json.dumps(config))
    run = make_run(tmp_path, "hf-lm", tiny=False, target={"path": str(model)},
                   data={"seq_len": 16}, train={"batch_size": 4})  # fmt: skip
    report = ok_json("--project", str(run), "inspect-sharding", "--stage", "train", "--mesh",
                     "data=2,tp=2", "--all")  # fmt: skip
    assert report["mesh"] == {"data": 2, "fsdp": 1, "tp": 2}
    check_rows(report)
    rows = {r["path"]: r for r in report["rows"]}
    q = rows["target.model.layers.1.self_attn.q_proj.weight"]
    assert (q["spec"], q["rule"]) == ([None, "tp"], sharding.RULES[1].name)
    down_v = next(r for p, r in rows.items() if p.endswith("mlp.down_proj.V") and "mu" in p)
    assert down_v["spec"][-2:] == ["tp", "data"], down_v
    assert any("tensor parallel over tp=2" in n for n in report["notes"])
    text = invoke("--project", str(run), "inspect-sharding", "--mesh", "data=2,tp=2")
    assert "x tp=2" in text.output, text.output
    bad = invoke("--project", str(run), "inspect-sharding", "--mesh", "data=1,tp=4")
    assert bad.exit_code == 2 and bad.output.count("\n") == 1, bad.output
    assert "mesh.tp: 4 does not divide num_key_value_heads = 2 in" in bad.output


def test_a_child_that_dies_ends_with_one_error_line():
    from pdctl.inspect import child_death

    for code in (0, 1, 2, 3):  # done, or pdctl already said why
        assert child_death(64, code, "x") is None
    line = child_death(64, 250, "W spam\nLLVM ERROR: Unable to allocate section memory!\n\n")
    assert line.count("\n") == 0 and "64 simulated devices" in line and "exit 250" in line
    assert "Unable to allocate section memory" in line
    assert "vm.max_map_count" in line  # the bound that was hit, not RAM: the fix is named
    assert "signal 9" in child_death(8, -9, "")
    assert "max_map_count" not in child_death(8, -9, "")
