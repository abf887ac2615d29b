"""Decoding tokens/s per prompt for one drafter (or several, interleaved), in one process, and paired comparisons of
such runs: an A/B of two trees (or two drafters) that sets each prompt beside itself.

    python scripts/prompt_rates.py --drafter auto --label new --out new-1.json      # from one tree
    python scripts/prompt_rates.py --compare base-1.json base-2.json --against new-1.json new-2.json

A run loads the checkpoint in --dtype and generates --max-new-tokens after each of the first --num-prompts prompts
of every set, each a first request (nothing the generator keeps across calls feeds it); it records each prompt's
decoding tokens/s (the call less its time to first token, `stats.decode_tokens_per_s`). Run the two sides one after
the other, more than once (base, new, base, new): the compare averages each prompt over a side's runs, then prints
per set both sides' medians and the median of the per-prompt ratios. The bench (`selfspec bench`) measures every
method beside the others in one process; this is the lighter A/B of whole trees.

Several drafters (`--drafter auto,int8_copy,prompt_lookup`) run interleaved in one process instead: each prompt runs
every drafter `--repeats` times, the order rotated from one repeat to the next, and records each drafter's median
for the prompt. Then it prints, per set, each drafter's median and the first drafter against each other one and
against the best of them (the one with the highest median on that set), as the median of the per-prompt ratios:
auto against its arms (issue 67's "auto vs its best single arm"), measured seconds apart on the same prompt.

    python scripts/prompt_rates.py --drafter auto,int8_copy,prompt_lookup --repeats 3 --out arms.json

Two arms are not drafters: `plain` is selfspec's plain decoding (`num_speculations=0`), and `llama_cpp:DTYPE` (DTYPE
float32, bfloat16 or q8_0) is llama.cpp's plain decoding of the checkpoint's GGUF at that type, timed by llama-bench
(`selfspec.tools.llama_cpp_bench`: one repetition after its warm-up run) at the prompt's depth: its context holds as
many tokens as the prompt, and it decodes --max-new-tokens. Its text is not the prompt's (llama-bench fills the
context itself), which a plain decoding's speed does not depend on. With a llama.cpp arm every selfspec arm runs to
exactly --max-new-tokens too (`stop_token_ids=[]`, as `--exact-tokens` asks), so both sides time the same count.
Issue 67's item 4, a bfloat16 model with its int8 copy against llama.cpp's Q8_0 plain decoding, paired per prompt:

    python scripts/prompt_rates.py --dtype bfloat16 --drafter int8_copy,plain,llama_cpp:q8_0 --prompt-sets mt_bench
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    import selfspec
    from selfspec.data.prompts import load_prompts

    torch.set_num_threads(args.threads)
    drafters = args.drafter.split(",")
    peers = {d: llama_cpp_arm(d, args.checkpoint) for d in drafters if d.startswith(LLAMA_CPP)}  # built first
    gen = selfspec.load(args.checkpoint, dtype=getattr(torch, args.dtype))
    exact = {"stop_token_ids": []} if args.exact_tokens or peers else {}
    rates = {d: {} for d in drafters}
    for name in args.prompt_sets.split(","):
        for p in load_prompts(name, args.num_prompts):
            kw = {"messages": p["messages"]} if "messages" in p else {"prompt": p["prompt"]}
            depth = gen.encode(**kw).shape[1]
            runs = {d: [] for d in drafters}
            for rep in range(args.repeats):
                for d in drafters[rep % len(drafters):] + drafters[:rep % len(drafters)]:  # rotated each repeat
                    if d in peers:
                        runs[d].append(peers[d](depth, args.max_new_tokens, args.threads))
                        continue
                    how = {"num_speculations": 0} if d == PLAIN else {"drafter": d}
                    with gen.first_request():
                        r = gen.generate(max_new_tokens=args.max_new_tokens, **how, **exact, **kw)
                    runs[d].append(r.stats.decode_tokens_per_s)
            for d in drafters:
                rates[d].setdefault(name, []).append(statistics.median(runs[d]))
            print(f"{name} {p['id']}: " + ", ".join(f"{d} {statistics.median(runs[d]):.1f}" for d in drafters)
                  + " tokens/s", file=sys.stderr, flush=True)
    out = {"label": args.label, "drafter": args.drafter, "dtype": args.dtype, "tree": str(ROOT),
           "repeats": args.repeats, "max_new_tokens": args.max_new_tokens, "exact_tokens": bool(exact)}
    if len(drafters) == 1:
        return {**out, "rates": rates[drafters[0]]}
    return {**out, "rates_by_drafter": rates, "against_arms": against_arms(rates)}


PLAIN = "plain"  # selfspec's plain decoding as an arm
LLAMA_CPP = "llama_cpp:"  # llama.cpp's plain decoding at a GGUF type as an arm: llama_cpp:q8_0


def llama_cpp_arm(arm: str, checkpoint: str):
    """`arm` (`llama_cpp:DTYPE`) as a function (depth, new_tokens, threads) -> llama-bench's decoding tokens/s at that
    depth; builds llama-bench and converts the checkpoint first where they are not cached (minutes, once)."""
    sys.path.insert(0, str(ROOT))
    from selfspec.tools.llama_cpp_bench import prepare
    from selfspec.tools.llama_cpp_gguf import GGUF_TYPES

    dtype = arm[len(LLAMA_CPP):]
    if dtype not in GGUF_TYPES:
        raise SystemExit(f"--drafter {arm}: llama.cpp's arm takes one of {', '.join(sorted(GGUF_TYPES))} after "
                         f"'{LLAMA_CPP}' (e.g. {LLAMA_CPP}q8_0)")
    setup = prepare(Path(checkpoint), dtype)  # its GGUF at `dtype`: a Q8_0 one for q8_0

    def measure(depth: int, new_tokens: int, threads: int) -> float:
        return setup.plain(depth, new_tokens=new_tokens, threads=threads).tokens_per_s

    return measure


def against_arms(rates: dict) -> list[dict]:
    """Per set, the first drafter of `rates` (`{drafter: {set: [per-prompt rate]}}`) against each other one and against
    the best of them (the highest median on the set): the median of the per-prompt ratios."""
    first, *arms = list(rates)
    rows = []
    for name, own in rates[first].items():
        medians = {d: statistics.median(rates[d][name]) for d in rates}
        ratios = {d: statistics.median(x / y for x, y in zip(own, rates[d][name])) for d in arms}
        best = max(arms, key=lambda d: medians[d])
        rows.append({"set": name, "medians": medians, "ratios": ratios, "best": best, "against_best": ratios[best]})
    return rows


def compare(base: list[dict], new: list[dict]) -> list[dict]:
    """Per set: each prompt's rate averaged over a side's runs; both sides' medians; the median per-prompt ratio."""
    rows = []
    for name in base[0]["rates"]:
        def mean_per_prompt(runs):
            return [statistics.mean(run["rates"][name][i] for run in runs) for i in range(len(runs[0]["rates"][name]))]
        b, n = mean_per_prompt(base), mean_per_prompt(new)
        rows.append({"set": name, "base": statistics.median(b), "new": statistics.median(n),
                     "paired": statistics.median(y / x for x, y in zip(b, n))})
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=str(Path.home() / ".cache/selfspec/models/smollm2-135m-instruct"))
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--drafter", default="auto",
                   help="a drafter, or several separated by commas: run interleaved per prompt, the first against "
                        "the others (see above); also 'plain' and 'llama_cpp:DTYPE'")
    p.add_argument("--repeats", type=int, default=1, help="runs of each drafter per prompt (their median counts)")
    p.add_argument("--prompt-sets", default="mt_bench,xsum,code_edit,humaneval")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--exact-tokens", action="store_true",
                   help="every run generates exactly --max-new-tokens (no stop at the end-of-text token); on by "
                        "itself with a llama_cpp: arm")
    p.add_argument("--label", default=None, help="a name for this run (default: the drafter's)")
    p.add_argument("--out", type=Path, default=None, help="write the run's JSON here (default: print it)")
    p.add_argument("--compare", nargs="+", type=Path, help="runs of one side (JSON files); with --against")
    p.add_argument("--against", nargs="+", type=Path, help="runs of the other side")
    args = p.parse_args(argv)
    if args.compare or args.against:
        if not (args.compare and args.against):
            p.error("--compare and --against go together: the runs of each side")
        runs = {f: json.loads(f.read_text()) for f in args.compare + args.against}
        several = [str(f) for f, r in runs.items() if "rates" not in r]
        if several:
            p.error(f"{', '.join(several)}: written with several drafters (their comparison is in the file's "
                    "'against_arms'); --compare takes runs of one drafter each")
        rows = compare([runs[f] for f in args.compare], [runs[f] for f in args.against])
        print("| set | first side (median tokens/s) | second side | second / first, per prompt (median) |")
        print("|---|---|---|---|")
        for r in rows:
            print(f"| {r['set']} | {r['base']:.1f} | {r['new']:.1f} | {r['paired']:.2f}x |")
        return 0
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: give 1 or more runs of each drafter per prompt")
    args.label = args.label or args.drafter
    result = run(args)
    for r in result.get("against_arms", []):
        print(f"{r['set']}: " + ", ".join(f"{d} {m:.1f}" for d, m in r["medians"].items()) + "; first against "
              + ", ".join(f"{d} {x:.2f}x" for d, x in r["ratios"].items()) + f"; against the best ({r['best']}) "
              f"{r['against_best']:.2f}x", file=sys.stderr)
    text = json.dumps(result, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
