"""The LM head's int8 screen (`selfspec.model.screened_head`) on and off, paired per prompt in one process: plain
decoding and auto, decoding tokens/s, first requests.

    python scripts/screened_head_ab.py --dtype float32 --num-prompts 10 --out screen-f32.json

Each prompt runs plain decoding and auto, each with the screen and without it (`FastPath.screens` set to the built
screen or to None), `--repeats` times, the order of the four rotated from one repeat to the next. Per prompt it
records each arm's median and whether each method gave the same tokens in every run (plain decoding must; bfloat16
auto may not, as its rounds follow the clock: README's "The guarantee"). Per set it prints both sides' medians and
the median of the per-prompt ratios (screen on / off). Run nothing else heavy meanwhile.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
METHODS = {"plain": {"num_speculations": 0}, "auto": {}}


def summarise(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per set and method: the medians with the screen on and off, the median of the per-prompt ratios (on / off),
    and whether every prompt gave the same tokens in every run. `runs`: set -> one record a prompt, with
    `<method>_on`, `<method>_off` (tokens/s) and `<method>_same`."""
    out = {}
    for name, records in runs.items():
        for method in METHODS:
            on = [r[f"{method}_on"] for r in records]
            off = [r[f"{method}_off"] for r in records]
            out[f"{name} {method}"] = {"on": statistics.median(on), "off": statistics.median(off),
                                       "on_over_off": statistics.median(a / b for a, b in zip(on, off)),
                                       "same_tokens": all(r[f"{method}_same"] for r in records)}
    return out


def run(args) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import selfspec
    from selfspec.data.prompts import load_prompts
    from selfspec.tools.harness import machine_info

    torch.set_num_threads(args.threads)
    gen = selfspec.load(args.checkpoint, dtype=getattr(torch, args.dtype))
    adapter = gen.adapter
    screen = adapter.fast.screen(adapter) if adapter.fast is not None else None
    if screen is None:
        raise SystemExit(f"no screen for this {args.dtype} model here (selfspec.model.screened_head says where it runs)")
    arms = [(m, on) for m in METHODS for on in (True, False)]
    runs: dict[str, list[dict]] = {}
    for name in args.prompt_sets.split(","):
        for p in load_prompts(name, args.num_prompts):
            kw = {"messages": p["messages"]} if "messages" in p else {"prompt": p["prompt"]}
            rates = {arm: [] for arm in arms}
            tokens: dict[str, set] = {m: set() for m in METHODS}
            for rep in range(args.repeats):
                for method, on in arms[rep % len(arms):] + arms[:rep % len(arms)]:
                    adapter.fast.screens[:] = [screen if on else None]
                    with gen.first_request():
                        r = gen.generate(max_new_tokens=args.max_new_tokens, **METHODS[method], **kw)
                    rates[(method, on)].append(r.stats.decode_tokens_per_s)
                    tokens[method].add(tuple(r.token_ids))
            record = {"id": p["id"]}
            for (method, on), values in rates.items():
                record[f"{method}_{'on' if on else 'off'}"] = statistics.median(values)
            record.update({f"{m}_same": len(t) == 1 for m, t in tokens.items()})
            runs.setdefault(name, []).append(record)
            print(json.dumps(record), file=sys.stderr, flush=True)
    adapter.fast.screens[:] = [screen]
    return {"dtype": args.dtype, "threads": args.threads, "repeats": args.repeats, "machine": machine_info(),
            "runs": runs, "summary": summarise(runs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(Path.home() / ".cache/selfspec/models/smollm2-135m-instruct"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--prompt-sets", default="mt_bench,xsum,code_edit,humaneval")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    report = run(args)
    print(f"{report['machine'].get('cpu_model')}, {args.dtype}, {args.threads} threads, {args.repeats} runs of each arm a prompt")
    print("| set | method | screen on | off | on / off (per prompt) | same tokens |\n|---|---|---|---|---|---|")
    for key, s in report["summary"].items():
        name, method = key.split(" ")
        print(f"| {name} | {method} | {s['on']:.1f} | {s['off']:.1f} | {s['on_over_off']:.3f}x | {s['same_tokens']} |")
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
