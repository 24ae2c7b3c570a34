"""The prompts pdctl writes for an LLM: one to label a component, one per scoring trial.

`TEMPLATE` (id `TEMPLATE_ID`, recorded in every exported record) is filled with
`string.Template` from a component's record:

  $key              site:component, e.g. layers.0.mlp.up:17
  $site             the decomposed weight's name
  $kind             what the decomposed model is (meta.kind of the harvest)
  $rate             how often it fires: percent of harvested positions (and 1 in N)
  $stats            count, mean and max causal importance (CI)
  $input_tokens     input tokens by PMI with the firing, ln p(token | fires) / p(token), and
                    their counts
  $output_effects   next tokens whose log-probability ablating it raises / lowers (nats)
  $features         toys only: its CI on each one-hot input feature
  $top_examples     the top examples by CI, the token it fires on between << and >>
  $sample_examples  sampled firing examples (uniform over firing positions), marked the same way

A section with nothing to show says "(none)". The reply asked for is one JSON object
{"label": ..., "reasoning": ...}, which `pdctl interp import` (and `--endpoint`) reads.
"""

from __future__ import annotations

from string import Template
from typing import Any

TEMPLATE_ID = "pdctl-label-v1"

TEMPLATE = Template("""\
You are labelling one component of a neural network that was decomposed with Stochastic \
Parameter Decomposition. A component is a rank-one piece of one weight matrix. At each token \
the decomposition gives every component a causal importance (CI) between 0 and 1; the component \
"fires" on a token when its CI there is above the threshold.

Component $key (weight $site of a $kind model)
Firing rate: $rate
$stats

Input tokens most associated with its firing (PMI in nats, count):
$input_tokens

Effect on the next token when it is ablated where it fires (nats):
$output_effects

CI on each one-hot input feature:
$features

Examples where it fires most strongly (the token it fires on is marked <<like this>>; its CI \
in brackets):
$top_examples

Randomly sampled examples where it fires:
$sample_examples

Task: give a short label (2 to 6 words) for what this component responds to. Name specific \
tokens or a specific pattern when the evidence shows one; answer "unclear" when it does not. \
Reply with one JSON object and nothing else: \
{"label": "<the label>", "reasoning": "<one or two sentences>"}
""")

DETECTION = Template("""\
A neural network component has been labelled: "$label"

Below are $n text snippets, each with one token marked <<like this>>. In some of them the \
component fires on the marked token; in the others the marked token is one where it does not \
fire.

$examples
For each example in order, answer "yes" if, going by the label, the component fires on the \
marked token, else "no". Reply with one JSON object and nothing else: \
{"predictions": ["yes", "no", ...]} ($n answers).
""")

FUZZING = Template("""\
A neural network component has been labelled: "$label"

Below are $n text snippets where the component fires. In some of them the marked tokens \
(<<like this>>) are the tokens where it fires; in the others the same number of tokens are \
marked at random.

$examples
For each example in order, answer "yes" if, going by the label, the marked tokens are where \
the component fires, else "no" (marked at random). Reply with one JSON object and nothing \
else: {"predictions": ["yes", "no", ...]} ($n answers).
""")


def _num(x: Any, digits: int = 3) -> str:
    return "?" if x is None else f"{x:.{digits}g}"


def _lines(items: list[str]) -> str:
    return "\n".join(items) if items else "(none)"


def _examples(examples: list[dict[str, Any]]) -> str:
    return _lines([f"{i + 1}. [{_num(e['ci'])}] {e['text']}" for i, e in enumerate(examples)])


def label_prompt(record: dict[str, Any], kind: str) -> str:
    """The label prompt for one exported record (see the module for its sections)."""
    st = record["stats"]
    f = st["frequency"]
    rate = f"{100 * f:.3g}% of positions" + (f" (1 in {1 / f:.0f})" if f > 0 else "")
    stats = (f"Fires on {st['count']} positions; mean CI {_num(st['mean_ci'])}, "
             f"max CI {_num(st['max_ci'])}")  # fmt: skip
    tokens = [f"{t['token']!r} PMI {_num(t['pmi'])} (count {t['count']})"
              for t in record["input_tokens"]["pmi"]]  # fmt: skip
    eff = record["output_effects"]
    effects = [f"raises {t['token']!r} by {_num(t['nats'])}" for t in eff["raised"]]
    effects += [f"lowers {t['token']!r} by {_num(abs(t['nats']))}" for t in eff["lowered"]]
    features = [f"feature {x['feature']}: {_num(x['ci'])}" for x in record["features"]]
    return TEMPLATE.substitute(
        key=record["key"], site=record["site"], kind=kind, rate=rate, stats=stats,
        input_tokens=_lines(tokens), output_effects=_lines(effects), features=_lines(features),
        top_examples=_examples(record["top"]), sample_examples=_examples(record["sample"]),
    )  # fmt: skip


def trial_prompt(task: str, label: str, texts: list[str]) -> str:
    examples = "".join(f"Example {i + 1}: {t}\n\n" for i, t in enumerate(texts))
    tpl = DETECTION if task == "detection" else FUZZING
    return tpl.substitute(label=label, n=len(texts), examples=examples)
