"""`pdctl.toml.example`, rendered from the schema (`pdctl.config.schema`: its field descriptions
and the tables' docstrings): `python -m pdctl.config --example > pdctl.toml.example`; a test
fails when the committed file differs."""

from __future__ import annotations

import argparse
import json
import re
import sys
import textwrap
import typing
from typing import Any

from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from pdctl.config.schema import Config

EXAMPLE_COMMAND = "python -m pdctl.config --example > pdctl.toml.example"

# Text blocks below are laid out as they appear in the file, each line behind "# ".
EXAMPLE_HEADER = f"""\
pdctl.toml.example: every key pdctl reads, in schema order, each set to its default.
Generated from the schema in pdctl/config/schema.py (its field descriptions and docstrings);
after changing the schema, regenerate it with
  {EXAMPLE_COMMAND}
(tests/stages/test_config.py fails while this file and the schema differ).

A run directory holds one pdctl.toml (`pdctl new NAME -t TEMPLATE` writes one from a template).
Every table and key is optional except `schema`; a key left out takes the default shown here.
Unknown keys and wrong types are errors that name the key (TOML types are strict: write
`steps = 5`, not `steps = "5"` or `steps = 5.0`; a float key accepts an integer).
Lines that start with `# key =` document keys that are off by default or belong to another
variant; remove the `# ` to use them."""

STATE_TABLES_DOC = """\
pdctl appends its own tables after a marker line at the end of this file and rewrites only
those (atomically); everything above them stays byte for byte as you wrote it. Do not edit them.
One table per stage, [state.init_weights], [state.pretrain], [state.warmup], [state.train]:
  status       running | done | failed | interrupted (`pdctl status` shows "pending" if absent)
  step, steps  last completed step, and the stage's total
  checkpoint   path of the latest checkpoint
  metrics      last logged metrics (a table; nested per site where it applies)
  wall_s       wall-clock seconds of the stage
  compile_s    compile seconds per jitted function (a table)
  step_ms      mean step time in milliseconds (with samples/s, tokens/s, MFU where measured)
  fingerprint  hash of the config tables the stage depends on; an edit that changes it makes
               the stage (and every later one) "stale" in `pdctl status`. mesh, distributed,
               tracking, checkpoint, compile and measure do not count.
  devices, mesh  device count/kind and the mesh shape the stage ran on
  versions     pdctl and JAX versions
  updated_at   UTC time of the last write; plus e.g. the wandb run id (a resume continues it)"""

_WIDTH = 100
# A key line longer than this keeps its comment two spaces after it instead of pushing the
# comment column of its whole block to the right.
_ALIGN_MAX = 40


def example_toml() -> str:
    """pdctl.toml.example: every table in schema order, every key at its default with its
    description as a comment, the other variants and optional keys commented out."""
    cfg = Config()
    seen: set[type[BaseModel]] = set()
    lines = _commented(EXAMPLE_HEADER)
    lines += ["", *_keys(Config, cfg, describe=True, off=False)]
    for name, field in Config.model_fields.items():
        if _is_table(field):
            lines += ["", *_table(name, field, getattr(cfg, name), seen)]
    rule = "# ---- What pdctl writes "
    lines += ["", rule + "-" * (_WIDTH - len(rule)), *_commented(STATE_TABLES_DOC)]
    return "\n".join(lines) + "\n"


def _commented(text: str) -> list[str]:
    return [f"# {line}".rstrip() for line in text.splitlines()]


def _submodels(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _submodels(arg)]


def _is_table(field: FieldInfo) -> bool:
    """A nested model is a [table]; a list of models (decomp.sites) is an array of inline tables."""
    return bool(_submodels(field.annotation)) and typing.get_origin(field.annotation) is not list


def _table(
    path: str, field: FieldInfo, value: Any, seen: set[type[BaseModel]], off: bool = False
) -> list[str]:
    """A table: its header, what it is (the field's description on the header line, the model's
    docstring the first time the model appears), its keys, then its sub-tables."""
    models = _submodels(field.annotation)
    if len(models) > 1:
        return _variants(path, field, value)
    [model] = models
    off = off or value is None  # an optional table ([train.ci_optim]) is shown commented out
    pre = "# " if off else ""
    header = f"{pre}[{path}]"
    desc = field.description or ""
    if len(header) + 4 + len(desc) <= _WIDTH and "\n" not in desc:
        lines = [f"{header}  # {desc}" if desc else header]
    else:
        lines = [header, *_paragraph(desc)]
    first = model not in seen
    seen.add(model)
    if first and _doc(model):
        lines += _paragraph(_doc(model), sentence=False)
    lines += _keys(model, value, describe=first, off=off)
    for name, sub in model.model_fields.items():
        if _is_table(sub):
            sub_value = getattr(value, name) if value is not None else sub.default
            lines += ["", *_table(f"{path}.{name}", sub, sub_value, seen, off)]
    return lines


def _variants(path: str, field: FieldInfo, value: BaseModel) -> list[str]:
    """A discriminated union ([target]): the default variant's keys, then every other variant's
    keys commented out under a `# kind = "...": what it is` line."""
    tag = field.discriminator
    if not isinstance(tag, str):
        raise TypeError(f"{path}: a union of tables needs a discriminator key")
    lines = [f"[{path}]  # {field.description}"]
    default = type(value)
    lines += _block(
        [(f"{tag} = {_toml(getattr(value, tag))}", default.model_fields[tag].description or "")]
    )
    others = [m for m in _submodels(field.annotation) if m is not default]
    for model in (default, *others):
        is_default = model is default
        if not is_default:
            lines.append("#")
        wrap = textwrap.TextWrapper(
            _WIDTH,
            initial_indent=f"# {tag} = {_toml(model.model_fields[tag].default)}: ",
            subsequent_indent="# ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        lines += wrap.wrap(_doc(model))
        lines += _keys(
            model, value if is_default else None, describe=True, off=not is_default, skip=tag
        )
    return lines


def _doc(model: type[BaseModel]) -> str:
    doc = model.__dict__.get("__doc__")  # not inherited: a model without one has none
    return " ".join(doc.split()) if doc else ""


def _sentence(text: str) -> str:
    text = text[:1].upper() + text[1:]
    return text if text.endswith(".") else text + "."


def _paragraph(text: str, prefix: str = "# ", sentence: bool = True) -> list[str]:
    wrap = textwrap.TextWrapper(
        _WIDTH,
        initial_indent=prefix,
        subsequent_indent=prefix,
        break_on_hyphens=False,
        break_long_words=False,
    )
    parts = [_sentence(p) if sentence else p for p in text.split("\n") if p]
    return [line for part in parts for line in wrap.wrap(part)]


def _keys(
    model: type[BaseModel], value: Any, *, describe: bool, off: bool, skip: str = ""
) -> list[str]:
    """The key = value lines of one table, each with its description as a trailing comment
    (when `describe`; a model shown before is not described again), comments aligned per run of
    one-line keys. `value` is the table's default (None: the fields' own defaults)."""
    lines: list[str] = []
    run: list[tuple[str, str]] = []
    for name, field in model.model_fields.items():
        if name == skip or _is_table(field):
            continue
        key = field.alias or name
        current = getattr(value, name) if value is not None else field.default
        shown = field.examples[0] if field.examples else current
        if shown is None or shown is PydanticUndefined:
            raise ValueError(f"{model.__name__}.{name}: no default or example to show")
        desc = (field.description or "") if describe else ""
        pre = "# " if off or current is None else ""
        if isinstance(shown, list) and shown and _submodels(field.annotation):
            # An array of inline tables (decomp.sites): one table per line, the item keys
            # described above them.
            lines += _block(run, off)
            run = []
            lines += _paragraph(desc, prefix=pre + "# ")
            lines.append(f"{pre}{key} = [")
            [item] = _submodels(field.annotation)
            for sub_name, sub in item.model_fields.items() if describe else ():
                text = f"{sub.alias or sub_name}: {sub.description}"
                lines += _paragraph(text, prefix=pre + "  # ", sentence=False)
            lines += [f"{pre}  {_toml(x)}," for x in shown]
            lines.append(f"{pre}]")
        else:
            run.append((f"{pre}{key} = {_toml(shown)}", desc))
    return lines + _block(run, off)


def _block(run: list[tuple[str, str]], off: bool = False) -> list[str]:
    """`key = value` lines with their comments in one column; a wrapped comment continues in
    that column, indented by two, and a description's second paragraph (after a newline) starts
    there unindented."""
    widths = [len(code) for code, _ in run if len(code) <= _ALIGN_MAX]
    column = max(widths, default=0) + 2
    lines = []
    for code, desc in run:
        if not desc:
            lines.append(code)
            continue
        col = column if len(code) <= _ALIGN_MAX else len(code) + 2
        pad = "#" + " " * (col - 1) if off else " " * col
        for i, part in enumerate(desc.split("\n")):
            wrap = textwrap.TextWrapper(
                _WIDTH - col,
                initial_indent="# ",
                subsequent_indent="#   ",
                break_on_hyphens=False,
                break_long_words=False,
            )
            for j, text in enumerate(wrap.wrap(part)):
                lines.append((code.ljust(col) if i == j == 0 else pad) + text)
    return lines


def _toml(value: Any) -> str:
    """A TOML literal for a default: the types a config field can hold."""
    if isinstance(value, BaseModel):
        value = value.model_dump(by_alias=True)
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return re.sub(r"e([+-])0*(\d)", r"e\1\2", repr(value))  # 1e-08 -> 1e-8
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string
    if isinstance(value, dict):
        return "{ " + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + " }"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    raise TypeError(f"no TOML literal for {value!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m pdctl.config", description="The pdctl.toml schema."
    )
    parser.add_argument(
        "--example",
        action="store_true",
        help="print pdctl.toml.example (every key, its default and description)",
    )
    args = parser.parse_args(argv)
    if not args.example:
        parser.error("nothing to do: pass --example")
    sys.stdout.write(example_toml())
    return 0
