"""`pdctl interp`: labelling components with any LLM, from a finished harvest (harvest.db).

export   one JSONL record per component (statistics, top and sampled contexts with the firing
         token marked, input-token PMI, output effects, a ready prompt: `prompt.TEMPLATE`), and,
         for labelled components, detection / fuzzing trials on held-out examples (`trials`)
import   labels (and optional scores) from a JSONL file into harvest.db's `labels` table
score    detection / fuzzing scores from a filled trials file (`score`)

No network by default; `--endpoint` (`endpoint.py`) sends the prompts to an OpenAI-compatible
chat-completions server the user names.
"""
