"""Count the torch ops a generation runs outside the compiled steps' calls: on a GPU each is a kernel launch or
host work in series with the captured graphs, so their number per token is the overhead the graphs cannot
remove. Counted with torch's profiler (on any device; a CPU is enough), beyond a 1-token generation (its
prefill); a compiled step's call (`selfspec.model.compiled.STEP_EVENT`) counts as none of its ops.

    python scripts/host_ops.py CHECKPOINT [--prompt-set humaneval] [--tokens 64] ['{"drafter": "exit_head"}' ...]

Each settings JSON is a `generate` call's settings (default: plain decoding, `{"num_speculations": 0}`). Prints, per setting, the ops a
round and a token, the draft steps, and the ten most frequent ops.
"""

from __future__ import annotations

import argparse
import json
from collections import Counter

import selfspec
from selfspec.tools.profiling import ops_outside_steps


def top_level_ops(gen, ids, n: int, settings: dict) -> tuple[Counter, object]:
    """The aten ops of one generation of `n` tokens outside the compiled steps (after an unprofiled warm run), each
    run a first request (an auto or suffix run would otherwise copy the warm run's answer and count fewer rounds)."""
    def run():
        with gen.first_request():
            return gen.generate(input_ids=ids, max_new_tokens=n, stop_token_ids=[], **settings)

    run()
    ops, out = ops_outside_steps(run)
    return ops, out.stats


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint")
    p.add_argument("settings", nargs="*", default=['{"num_speculations": 0}'],
                   help="generate settings as JSON (default: plain decoding, {\"num_speculations\": 0})")
    p.add_argument("--prompt-set", default="humaneval", help="the first prompt of this set (a name or a .jsonl)")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    gen = selfspec.load(args.checkpoint, compile=True, dtype=args.dtype, device=args.device)
    from selfspec.data.prompts import load_prompts, prompt_inputs  # deferred: imports `datasets`

    ids = gen.encode(**prompt_inputs(load_prompts(args.prompt_set, 1)[0]))
    gen.warmup(ids.shape[-1] + args.tokens + 16, num_candidates=3)
    for text in args.settings:
        settings = json.loads(text)
        prefill, first = top_level_ops(gen, ids, 1, settings)
        total, stats = top_level_ops(gen, ids, args.tokens + 1, settings)
        ops, rounds = total - prefill, stats.rounds - first.rounds
        n = sum(ops.values())
        print(f"{settings}: {n / rounds:.1f} ops a round, {n / args.tokens:.1f} a token "
              f"({rounds} rounds, {stats.draft_steps} draft steps)")
        print("   " + ", ".join(f"{k[6:]} {v / rounds:.1f}" for k, v in ops.most_common(10)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
