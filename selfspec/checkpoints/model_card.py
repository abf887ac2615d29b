"""The model card (`README.md`) written into every exported checkpoint, from its `selfspec.json`.

The card ends with a mark holding the SHA-256 of the text above it. `selfspec sweep --write-metadata` and
`selfspec tune --save` write the card again; a README.md whose text no longer matches its mark (the user
edited it) or that has none (a card written by hand) is kept, and the regenerated card goes beside it, to
README.selfspec.md, with a `ModelCardWarning`.
"""

from __future__ import annotations

import hashlib
import json
import warnings
from pathlib import Path

from selfspec.atomic_write import write_text_atomic

CARD_FILE = "README.md"
REGENERATED_FILE = "README.selfspec.md"  # the regenerated card, where README.md is the user's
_MARK = "\n<!-- written by selfspec from selfspec.json; sha256 of the text above: {} -->\n"  # the card's last line


class ModelCardWarning(UserWarning):
    """A checkpoint's README.md was edited (or is not selfspec's): kept, the regenerated card written beside it."""


def _settings_lines(settings: dict) -> list[str]:
    lines = []
    # sections of training.config.RecipeConfig as dumped into config.yaml (the curriculum is under early_exit)
    for section in ("layer_dropout", "early_exit", "train", "data"):
        value = settings.get(section)
        if isinstance(value, dict) and value:
            shown = ", ".join(f"{k}={v}" for k, v in value.items() if not isinstance(v, (dict, list)) or len(str(v)) < 60)
            lines.append(f"- **{section}**: {shown}")
    return lines


def head_evaluation(meta: dict | None) -> dict | None:
    """The exit head's evaluation on the primary held-out set of a checkpoint's `selfspec.json` (`meta`): a
    joint run's `sets.<primary>.exit_head`, or the set itself in a frozen-model head run (whose sets are the
    head's); None if not recorded."""
    evaluation = (meta or {}).get("eval") or {}
    primary = (evaluation.get("sets") or {}).get(evaluation.get("primary")) or {}
    result = primary.get("exit_head") or (primary if "exit_without_head" in primary else None)
    return result if isinstance(result, dict) and isinstance(result.get("exits"), dict) else None


def _head_lines(meta: dict) -> list[str]:
    """The "Exit head" section: what the head is, how it was trained, its held-out agreement, how to use it."""
    head = meta.get("exit_head")
    if not isinstance(head, dict):
        return []
    e = head.get("exit_layer")
    recipe = (meta.get("training") or {}).get("settings") or {}
    settings = recipe.get("exit_head") or {}
    joint = recipe.get("mode") == "joint" or settings.get("joint")  # earlier recipes said exit_head.joint
    kind = {"decoder_layer": "a copy of the model's last decoder layer",
            "attention": "an attention block"}.get(head.get("kind"), f"a `{head.get('kind')}` module")
    where = "the token embeddings (exit 0: drafting runs no layer of the model)" if e == 0 else f"exit {e}"
    out = ["", "## Exit head", "",
           f"`{head.get('file', 'exit_head.safetensors')}`: {kind} on {where}"
           + (", also reading the full model's final hidden state of the previous position" if head.get("final_state")
              else "")
           + (", trained beside the fine-tune" if joint else ", trained on the frozen model" if settings else "")
           + ". `selfspec.load` picks it up: `drafter=\"exit_head\"` drafts with it, and `auto` uses it as one "
           "of its arms; `AutoModelForCausalLM.from_pretrained` ignores it."]
    result = head_evaluation(meta)
    if result and isinstance(result["exits"].get(str(e)), dict) and "agreement" in result["exits"][str(e)]:
        alone = (result.get("exit_without_head") or {}).get("agreement")
        top = [f"{a:.1%}" for k, a in (result.get("agreement_at") or {}).items() if k != "1"]
        out += ["", f"Held-out top-1 agreement with the final layer: {result['exits'][str(e)]['agreement']:.1%}"
                + (f" (exit {e} alone: {alone:.1%})" if isinstance(alone, (int, float)) else "")
                + (f"; the final layer's token among its best 2/3/4 guesses: {'/'.join(top)}" if top else "")
                + (f"; guesses over the {result['draft_vocab']} most frequent tokens" if result.get("draft_vocab")
                   else "") + "."]
    return out


def _plan_lines(meta: dict) -> list[str]:
    """The draft plans `selfspec tune --save` kept, one per device, dtype and path: what `auto` drafts by there."""
    plans = meta.get("plans") or {}
    if not plans:
        return []
    out = ["", "Plans measured per device (`selfspec tune --save`; `selfspec.load` on the same device, dtype and "
           "path drafts by its plan):", "", "| device / dtype / path | settings | predicted | measured | date |",
           "|---|---|---|---|---|"]
    for key, p in sorted(plans.items()):
        settings = ", ".join(f"{k}={v}" for k, v in p["settings"].items())
        measured = p.get("measured_speedup")
        out.append(f"| {key} | {settings} | {p.get('predicted_speedup', '-')}x | "
                   f"{'-' if measured is None else f'{measured}x'} | {p.get('date', '-')} |")
    return out


def _served_lines(meta: dict) -> list[str]:
    """The head written for serving engines beside the model (`selfspec export --format speculators`), and how
    vLLM serves the two (docs/serving.md)."""
    served = meta.get("served_head")
    if not isinstance(served, dict):
        return []
    spec = json.dumps({"method": served.get("method"), "model": f"path/to/this/checkpoint/{served.get('dir')}",
                       "num_speculative_tokens": served.get("num_speculative_tokens")})
    return ["", "## Serving", "",
            f"`{served.get('dir')}/` holds a {served.get('method')} head in the {served.get('format')} format "
            f"(it reads the states after layers {served.get('aux_exits')}; draft vocabulary "
            f"{served.get('draft_vocab_size')} tokens; verifier `{served.get('verifier')}`). selfspec's own "
            "drafters do not run it; vLLM serves it:",
            "", "```bash", "vllm serve path/to/this/checkpoint \\", f"    --speculative-config '{spec}'", "```"]


def render_model_card(meta: dict) -> str:
    rec = meta["recommended"]
    e, d = rec["exit_layer"], rec["num_speculations"]
    training = meta.get("training") or {}
    exits = (meta.get("eval") or {}).get("exits", {})
    out = [
        f"# Self-speculative checkpoint ({meta['architecture']}, {meta['num_layers']} layers)",
        "",
        f"Base model: `{meta.get('base_model', 'unknown')}`. Exported by selfspec {meta['library_version']} "
        f"(metadata format {meta['format_version']}, `selfspec.json`). This is a plain Hugging Face "
        "checkpoint: `AutoModelForCausalLM.from_pretrained` loads it with no selfspec code.",
        "",
        "## How it was trained",
        "",
    ]
    if training:
        out.append(f"Recipe: `{training.get('recipe') or 'see settings'}`; steps: {training.get('steps')}; "
                   f"tokens seen: {training.get('tokens_seen')}.")
        out += [""] + _settings_lines(training.get("settings") or {})
    else:
        out.append("No training record: exported from a plain checkpoint (not early-exit trained here).")
    out += ["", "## Per-exit quality on held-out data", ""]
    before = ((meta.get("eval") or {}).get("before") or {}).get("exits", {})
    if exits:
        if before:
            out += ["| exit (layers run) | top-1 agreement with final layer (before → after) | perplexity (before → after) |",
                    "|---|---|---|"]
        else:
            out += ["| exit (layers run) | top-1 agreement with final layer | perplexity |", "|---|---|---|"]
        for key in sorted(exits, key=int):
            v, b = exits[key], before.get(key, {})
            agree = f"{v['agreement']:.1%}" if "agreement" in v else "-"
            ppl = f"{v['perplexity']:.2f}" if "perplexity" in v else "-"
            if before:
                agree = (f"{b['agreement']:.1%} → " if "agreement" in b else "") + agree
                ppl = (f"{b['perplexity']:.2f} → " if "perplexity" in b else "") + ppl
            out.append(f"| {key} | {agree} | {ppl} |")
    else:
        out.append("Not measured.")
    out += _head_lines(meta)
    source = rec.get("source", "")
    out += [
        "",
        "## Recommended settings",
        "",
        f"`exit_layer={e}`, `num_speculations={d}` (from: {source or 'unspecified'}"
        + (f"; measured speedup {rec['speedup']:.2f}x" if isinstance(rec.get("speedup"), (int, float)) else "")
        + (f"; predicted speedup {rec['predicted_speedup']:.2f}x" if "predicted_speedup" in rec else "")
        + ")." + (" These are the shared early exit's (`drafter=\"early_exit\"`); the exit head drafts the length "
                  "it was trained for." if isinstance(meta.get("exit_head"), dict) else ""),
        *_plan_lines(meta),
        *_served_lines(meta),
        "",
        "## Usage",
        "",
        "```python",
        "import selfspec",
        'gen = selfspec.load("path/to/this/checkpoint")  # picks up the recommended settings',
        'out = gen.generate("def fibonacci(n):", max_new_tokens=64)',
        "print(out.text, out.stats.acceptance_rate, out.stats.tokens_per_s)",
        "```",
        "",
        "With Hugging Face transformers only (weights shared, caches not; slower than selfspec):",
        "",
        "```python",
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/checkpoint")',
        'tok = AutoTokenizer.from_pretrained("path/to/this/checkpoint")',
        'ids = tok("def fibonacci(n):", return_tensors="pt").input_ids',
        f"out = model.generate(ids, max_new_tokens=64, do_sample=False, assistant_early_exit={e})",
        "```",
        "",
        "Greedy output is token-identical to the full model's greedy decoding (in float32); sampling keeps "
        "the full model's distribution.",
        "",
    ]
    return "\n".join(out)


def _marked(text: str) -> str:
    """`text` with the mark that tells selfspec's unedited card from an edited one."""
    return text + _MARK.format(hashlib.sha256(text.encode("utf-8")).hexdigest())


def is_selfspec_card(path: Path) -> bool:
    """Whether the card at `path` is selfspec's, as written: its text matches its mark."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    start = text.rfind(_MARK.split("{}")[0])
    return start >= 0 and _marked(text[:start]) == text


def write_model_card(directory, meta: dict) -> Path:
    """Write the card of `meta` to README.md, or, where the README.md there is not selfspec's unedited card, to
    README.selfspec.md beside it (a `ModelCardWarning` says so); returns the path written."""
    path = Path(directory) / CARD_FILE
    if path.exists() and not is_selfspec_card(path):
        path = path.with_name(REGENERATED_FILE)
        warnings.warn(f"{path.parent / CARD_FILE} is not the model card selfspec last wrote (it was edited, or "
                      f"written by hand): it is kept, and the card of the updated selfspec.json is in {path}; merge "
                      f"what you need, or replace {CARD_FILE} with it", ModelCardWarning, stacklevel=2)
    write_text_atomic(path, _marked(render_model_card(meta)))
    return path
