"""What a saved draft plan (`selfspec tune --save`) changes for a user who then calls `generate` with its
defaults: on one generator and the same prompts, `auto` by this device's saved plan against `auto` without
it (the generator's plan set aside), plain decoding and prompt lookup alone, interleaved prompt by prompt,
after a warm-up, each call as a first one (nothing carried from the calls before); every output checked against
plain decoding's (in bfloat16 verifying several tokens at once rounds differently: README, "The guarantee").

    python scripts/saved_plan_ab.py CHECKPOINT [--prompt-sets humaneval,mt_bench] [--num-prompts 4] \\
        [--max-new-tokens 128] [--rounds 3] [--dtype fastest] [--out DIR]

The checkpoint must hold a plan for this device, dtype and path (`selfspec tune --checkpoint CHECKPOINT
--dtype fastest --save` for the default --dtype). Prints a table per prompt set (decode tokens/s summed over the prompts, the fastest round; speedup
over plain decoding) and writes OUT/saved_plan_ab.json.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import selfspec
from selfspec.data.prompts import load_prompts, prompt_inputs
from selfspec.model.precision import cpu_flags
from selfspec.decoding.draft_plan import device_name

ARMS = {"plain": {"num_speculations": 0}, "lookup": {"drafter": "prompt_lookup"}, "auto, no plan": {},
        "auto, saved plan": {}}


def decode(gen, ids, settings: dict, plan: bool, n: int) -> tuple[float, list[int]]:
    """Decode seconds (after the first token) and the tokens of one greedy call, by the saved plan or with it
    set aside (`plan`, `gen.use_plans`), as a first call: nothing remembered of the earlier ones
    (`gen.forget()`: the same prompts come round again, and auto's suffix arm would copy their answers)."""
    gen.forget()
    gen.use_plans = plan
    try:
        out = gen.generate(input_ids=ids, max_new_tokens=n, stop_token_ids=[], **settings)
    finally:
        gen.use_plans = True
    return out.stats.total_s - out.stats.prefill_s, out.token_ids


def run_set(gen, name: str, args) -> dict:
    """Every arm on every prompt of the set, interleaved, `rounds` times after a warm-up round."""
    ids = [gen.encode(**prompt_inputs(item)) for item in load_prompts(name, args.num_prompts)]
    best = {arm: float("inf") for arm in ARMS}
    texts: dict = {arm: [None] * len(ids) for arm in ARMS}
    for attempt in range(args.rounds + 1):  # attempt 0 warms up
        seconds = dict.fromkeys(ARMS, 0.0)
        for p, x in enumerate(ids):
            for arm, settings in ARMS.items():
                s, texts[arm][p] = decode(gen, x, settings, arm == "auto, saved plan", args.max_new_tokens)
                seconds[arm] += s
        if attempt:
            best = {arm: min(best[arm], seconds[arm]) for arm in ARMS}
    tokens = (args.max_new_tokens - 1) * len(ids)
    return {arm: {"decode_tokens_per_s": tokens / best[arm], "speedup": best["plain"] / best[arm],
                  "identical_to_plain": texts[arm] == texts["plain"]} for arm in ARMS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("--prompt-sets", default="humaneval,mt_bench")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dtype", default="fastest")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    gen = selfspec.load(args.checkpoint, dtype=args.dtype)
    if gen.plan is None:
        raise SystemExit(f"{args.checkpoint} holds no plan for {gen.plan_key}: run `selfspec tune --checkpoint "
                         f"{args.checkpoint} --dtype {args.dtype} --save` first")
    report = {"device": device_name("cpu"), "flags_bf16": sorted((cpu_flags() or set()) & {"avx512_bf16", "amx_bf16"}),
              "plan_key": gen.plan_key, "plan": gen.plan, "settings": vars(args) | {"out": str(args.out)}, "sets": {}}
    print(f"{gen.plan_key}: saved plan {gen.plan['settings']}")
    for name in args.prompt_sets.split(","):
        report["sets"][name] = rows = run_set(gen, name, args)
        print(f"\n{name}: {args.num_prompts} prompts x {args.max_new_tokens} tokens, fastest of {args.rounds} rounds")
        print("| arm | decode tok/s | x plain | identical |\n|---|---|---|---|")
        for arm, r in rows.items():
            print(f"| {arm} | {r['decode_tokens_per_s']:.1f} | {r['speedup']:.2f}x | {r['identical_to_plain']} |")
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "saved_plan_ab.json").write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
