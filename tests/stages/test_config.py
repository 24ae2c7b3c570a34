"""The schema in pdctl/config/, the templates and pdctl.toml.example stay in step."""

from __future__ import annotations

import copy
import re
import subprocess
import sys
import tomllib
import types
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel

from pdctl.config import (
    EXAMPLE_COMMAND,
    CiFnConfig,
    Config,
    LlamaTarget,
    LossConfig,
    OptimConfig,
    PpgdConfig,
    ResidMlpTarget,
    SiteConfig,
    TmsTarget,
    example_toml,
    fingerprint,
    main,
    match_sites,
    parse_config,
)
from pdctl.errors import PdctlError
from pdctl.registry import STAGES

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "pdctl.toml.example"
TEMPLATES = {
    "tms": "tms",
    "tms-40-10": "tms",
    "tms-5-2-id": "tms",
    "resid-mlp": "resid_mlp",
    "llama-mlp": "llama_mlp",
    "hf-lm": "hf",
    "smollm2": "hf",
    "smollm2-all": "hf",
    "smollm2-all-mlps": "hf",
}
_HEADER = re.compile(r"^#?\s*\[([A-Za-z0-9_.]+)\]\s*(#.*)?$")


def _load(path: Path) -> dict:
    return tomllib.loads(path.read_text(encoding="utf-8"))


@pytest.mark.parametrize("template", sorted(TEMPLATES))
def test_templates_parse(template: str) -> None:
    cfg = parse_config(_load(ROOT / "templates" / template / "pdctl.toml"))
    assert cfg.target.kind == TEMPLATES[template]
    assert cfg.decomp.sites, "a template must name the sites it decomposes"


def test_example_parses_and_shows_the_defaults() -> None:
    cfg = parse_config(_load(EXAMPLE))
    got = cfg.model_dump()
    want = Config().model_dump()
    # sites default to [] but the example must show the array-of-inline-tables form.
    assert [s.model_dump() for s in cfg.decomp.sites] == [
        {"pattern": "linear1", "C": 20},
        {"pattern": "linear2", "C": 20},
    ]
    got["decomp"].pop("sites")
    want["decomp"].pop("sites")
    assert got == want


def _sections(text: str) -> dict[str, str]:
    """{table name: its text}, commented-out headers (`# [train.ci_optim]`) included."""
    out: dict[str, list[str]] = {"": []}
    current = ""
    for line in text.splitlines():
        m = _HEADER.match(line)
        if m:
            current = m.group(1)
            out.setdefault(current, [])
        else:
            out[current].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def _models(annotation: typing.Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models(arg)]


def _schema_keys(
    model: type[BaseModel], section: str, seen: set[type[BaseModel]]
) -> list[tuple[str, str]]:
    """(section, key) for every field reachable from `model`; nested models are sub-tables,
    except list items (decomp.sites), whose keys live in inline tables of the parent section."""
    seen.add(model)
    keys: list[tuple[str, str]] = []
    for name, field in model.model_fields.items():
        key = field.alias or name
        subs = _models(field.annotation)
        if subs and typing.get_origin(field.annotation) is not list:
            sub_section = f"{section}.{key}" if section else key
            for sub in subs:
                keys += _schema_keys(sub, sub_section, seen)
        else:
            keys.append((section, key))
            for sub in subs:
                keys += _schema_keys(sub, section, seen)
    return keys


def test_example_documents_every_schema_key() -> None:
    sections = _sections(EXAMPLE.read_text(encoding="utf-8"))
    seen: set[type[BaseModel]] = set()
    keys = _schema_keys(Config, "", seen)
    # The walk must reach every model, or the check below proves little.
    for model in (TmsTarget, ResidMlpTarget, LlamaTarget, OptimConfig, LossConfig, PpgdConfig):
        assert model in seen
    assert {CiFnConfig, SiteConfig} <= seen
    assert ("train.ci_optim", "lr") in keys and ("target", "d_model") in keys
    assert ("decomp", "C") in keys and ("", "schema") in keys
    missing = []
    for section, key in keys:
        body = sections.get(section)
        pat = re.compile(rf"(^\s*(#\s*)?|[{{,]\s*){re.escape(key)}\s*=", re.MULTILINE)
        if body is None or not pat.search(body):
            missing.append(f"{section or '<top>'}.{key}")
    assert not missing, f"pdctl.toml.example does not document: {missing}"


def _commented_block(text: str, start: str) -> str:
    """The `# key = value` lines that follow the line `start`, uncommented."""
    lines = text.splitlines()
    i = lines.index(start) + 1
    body = []
    while i < len(lines) and lines[i].startswith("#"):
        if re.match(r"^# \w+ = ", lines[i]):
            body.append(lines[i][2:])
        elif body:
            break
        i += 1
    return "\n".join(body)


@pytest.mark.parametrize("model", [ResidMlpTarget, LlamaTarget])
def test_example_other_target_kinds_show_their_defaults(model: type[BaseModel]) -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    kind = model.model_fields["kind"].default
    [start] = [ln for ln in text.splitlines() if ln.startswith(f'# kind = "{kind}"')]
    block = tomllib.loads(f'kind = "{kind}"\n' + _commented_block(text, start))
    assert set(block) == set(model.model_fields)
    assert model.model_validate(block) == model()


def test_example_ci_optim_block_shows_optim_defaults() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    block = tomllib.loads(_commented_block(text, "# [train.ci_optim]"))
    assert set(block) == set(OptimConfig.model_fields)
    assert OptimConfig.model_validate(block) == OptimConfig()
    # Uncommented, it is a valid config in which ci_optim is set.
    raw = _load(EXAMPLE)
    raw["train"]["ci_optim"] = block
    assert parse_config(raw).train.ci_optim == OptimConfig()
    assert parse_config(_load(EXAMPLE)).train.ci_optim is None


def test_example_is_generated_from_the_schema() -> None:
    text = EXAMPLE.read_text(encoding="utf-8")
    assert text == example_toml(), f"pdctl.toml.example is stale: run `{EXAMPLE_COMMAND}`"
    assert EXAMPLE_COMMAND in text  # the file says how it is made
    assert max(len(line) for line in text.splitlines()) <= 100


def test_example_command_prints_the_example() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "pdctl.config", "--example"], cwd=ROOT, capture_output=True
    )
    assert (out.returncode, out.stderr) == (0, b"")
    assert out.stdout == example_toml().encode()
    with pytest.raises(SystemExit) as exc:
        main([])
    assert exc.value.code == 2


def test_every_field_is_described() -> None:
    seen: set[type[BaseModel]] = set()
    _schema_keys(Config, "", seen)
    bare = [
        f"{model.__name__}.{name}"
        for model in seen
        for name, field in model.model_fields.items()
        if not field.description
    ]
    assert not bare, f"fields without Field(description=...): {sorted(bare)}"


def _reversed(value: typing.Any) -> typing.Any:
    if isinstance(value, dict):
        return {k: _reversed(value[k]) for k in reversed(list(value))}
    return value


def test_fingerprint_ignores_key_order_and_explicit_defaults() -> None:
    a = """schema = 1
[run]
seed = 3
description = "x"
[pretrain]
steps = 5
batch_size = 7
[pretrain.optim]
lr = 0.1
schedule = "linear"
[decomp]
sites = [{ pattern = "linear1", C = 4 }]
sigmoid = "hard"
"""
    b = """schema = 1
[decomp]
sigmoid = "hard"
sites = [{ C = 4, pattern = "linear1" }]
delta_component = true
[pretrain.optim]
schedule = "linear"
lr = 0.1
[pretrain]
batch_size = 7
steps = 5
[run]
description = "x"
seed = 3
"""
    ca, cb = parse_config(tomllib.loads(a)), parse_config(tomllib.loads(b))
    cr = parse_config(_reversed(tomllib.loads(a)))
    for stage in STAGES:
        assert fingerprint(ca, stage) == fingerprint(cb, stage) == fingerprint(cr, stage)
    # ... and it does see values: pretrain.steps changes pretrain onwards, not init_weights.
    cc = parse_config(tomllib.loads(a.replace("steps = 5", "steps = 6")))
    assert fingerprint(cc, "init_weights") == fingerprint(ca, "init_weights")
    for stage in ("pretrain", "warmup", "train"):
        assert fingerprint(cc, stage) != fingerprint(ca, stage)


def test_fingerprint_tells_target_kinds_apart_at_their_defaults() -> None:
    """Fingerprints hash the non-default values; the union tag `kind` is kept, so two target
    kinds left at their defaults (nothing else set) still differ."""
    sites = {"sites": [{"pattern": "*", "C": 4}]}
    tms, resid = (
        parse_config({"schema": 1, "target": {"kind": k}, "decomp": sites})
        for k in ("tms", "resid_mlp")
    )
    for stage in STAGES:
        assert fingerprint(tms, stage) != fingerprint(resid, stage)
    assert fingerprint(tms, "init_weights") == fingerprint(
        parse_config({"schema": 1, "decomp": sites}), "init_weights"
    )


def test_a_new_key_at_its_default_leaves_fingerprints_alone(monkeypatch) -> None:
    """What a later pdctl that adds a config key does to an existing run: the key shows up in
    the full dump at its default, not in the dump of non-default values, and no stage's
    fingerprint moves (so no stage of the run turns stale by the upgrade alone)."""
    cfg = parse_config(tomllib.loads((ROOT / "templates" / "tms" / "pdctl.toml").read_text()))
    before = {s: fingerprint(cfg, s) for s in STAGES}
    dump = type(cfg).model_dump

    def with_new_key(self, **kw):
        out = dump(self, **kw)
        if not kw.get("exclude_defaults"):
            out["train"]["loss"]["a_new_term"] = 0.0
        return out

    monkeypatch.setattr(type(cfg), "model_dump", with_new_key)
    assert {s: fingerprint(cfg, s) for s in STAGES} == before


def _sites_cfg(*sites: tuple[str, int]) -> Config:
    return parse_config(
        {"schema": 1, "decomp": {"sites": [{"pattern": p, "C": c} for p, c in sites]}}
    )


PATHS = ["layers.0.mlp_in", "layers.0.mlp_out", "layers.1.mlp_in", "layers.1.mlp_out"]


def test_match_sites_resolves_globs_in_target_order() -> None:
    cfg = _sites_cfg(("layers.1.mlp_out", 4), ("layers.*.mlp_in", 3))
    got = match_sites(cfg, PATHS)
    assert got == {"layers.0.mlp_in": 3, "layers.1.mlp_in": 3, "layers.1.mlp_out": 4}
    assert list(got) == ["layers.0.mlp_in", "layers.1.mlp_in", "layers.1.mlp_out"]


def test_match_sites_pattern_matching_nothing_is_an_error() -> None:
    cfg = _sites_cfg(("layers.*.mlp_in", 3), ("layers.*.attn", 2))
    with pytest.raises(
        PdctlError, match=r"^decomp\.sites\.1\.pattern: 'layers\.\*\.attn' matches no"
    ):
        match_sites(cfg, PATHS)


def test_match_sites_site_matched_twice_is_an_error() -> None:
    cfg = _sites_cfg(("layers.*", 3), ("layers.0.mlp_in", 2))
    with pytest.raises(PdctlError, match=r"^decomp\.sites\.1\.pattern: .*'layers\.0\.mlp_in'.*"):
        match_sites(cfg, PATHS)
    with pytest.raises(PdctlError, match="already matched"):
        match_sites(cfg, PATHS)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        # nothing to decompose is a mistake, not a no-op run
        (lambda raw: raw["decomp"].__setitem__("sites", []), "decomp.sites: empty"),
        # every float in the config is finite
        (lambda raw: raw["train"]["optim"].__setitem__("lr", float("inf")), "train.optim.lr"),
        (lambda raw: raw["train"]["optim"].__setitem__("lr", float("nan")), "train.optim.lr"),
    ],
)
def test_mistakes_are_one_line_errors_naming_the_key(edit, message):
    raw = _load(ROOT / "templates" / "tms" / "pdctl.toml")
    edit(raw)
    with pytest.raises(PdctlError) as err:
        parse_config(raw)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_scan_layers_auto_and_fingerprints(tmp_path) -> None:
    """`[train] scan_layers` is true, false or "auto" (the default; anything else is one line
    naming the key); "auto" scans an imported model whose sites sit in AUTO_SCAN_LAYERS layers
    or more. No value of it, nor leaving it out (an old run's config, whose default was false),
    moves any fingerprint: it changes how the step runs, not what it computes."""
    import json

    import numpy as np

    from pdctl.config import AUTO_SCAN_LAYERS
    from pdctl.science.targets.hf import HFCausalLM, read_hf_config
    from pdctl.stages.inputs import scan_layers, with_scan

    base = {"schema": 1, "target": {"kind": "hf", "path": "unused"}, "data": {"path": "unused"}}
    cfgs = {}
    for v in (None, True, False, "auto"):
        raw = copy.deepcopy(base)
        raw["decomp"] = {"sites": [{"pattern": "*.mlp.*", "C": 4}]}
        if v is not None:
            raw["train"] = {"scan_layers": v}
        cfgs[v] = parse_config(raw)
    assert cfgs[None].train.scan_layers == "auto"
    for stage in STAGES:
        assert len({fingerprint(c, stage) for c in cfgs.values()}) == 1, stage
    for bad in ("yes", 1):
        with pytest.raises(PdctlError) as e:
            parse_config({**base, "decomp": {"sites": []}, "train": {"scan_layers": bad}})
        assert str(e.value) == (
            f'train.scan_layers: must be true, false, "auto" or "all", got {bad!r}'
        )

    n = AUTO_SCAN_LAYERS
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32,
        "intermediate_size": 48, "num_hidden_layers": n + 2, "num_attention_heads": 4,
    }))  # fmt: skip
    target = HFCausalLM(spec=read_hf_config(tmp_path, need_weights=False), seq_len=8)

    def resolved(pattern: str, setting: typing.Any = "auto") -> bool:
        raw = {**base, "decomp": {"sites": [{"pattern": pattern, "C": 4}]}}
        return scan_layers(parse_config({**raw, "train": {"scan_layers": setting}}), target)

    assert resolved("*.mlp.*")  # n + 2 layers
    assert resolved(f"*.[0-{n - 1}].mlp.*")  # exactly n layers
    assert not resolved(f"*.[0-{n - 2}].mlp.*")  # n - 1 layers
    assert not resolved("*.mlp.*", False) and resolved("*.0.mlp.*", True)  # as set
    assert resolved("*.0.mlp.*", "all") == "all"  # the site-less layers scanned too
    # "auto" below the threshold: the site-less layers scanned on a TPU (the mesh's devices,
    # an AOT topology's included), unrolled on a CPU
    raw = {**base, "decomp": {"sites": [{"pattern": "*.0.mlp.*", "C": 4}]}}
    cfg = parse_config(raw)
    on = types.SimpleNamespace
    assert scan_layers(cfg, target, on(devices=np.array([on(platform="tpu")]))) == "all"
    assert scan_layers(cfg, target, on(devices=np.array([on(platform="cpu")]))) is False
    assert scan_layers(cfg, target) is False  # this machine's backend: the CPU
    assert with_scan(target, "all").scan_siteless and not with_scan(target, True).scan_siteless
