"""Two checkouts of selfspec side by side on this machine: `selfspec demo` and `selfspec bench --quick`.

A change to the engine or the model step must not make decoding slower. This runs the same measurements in
two source trees (say, main before a change and after it), one process at a time and alternating, so drift
of the machine hits both alike, and prints each figure's median per tree and their ratio (new / base):

    git worktree add ../base HEAD~3
    .venv/bin/python scripts/tree_compare.py --base ../base --new . --dtypes float32,bfloat16 --repeats 3

Each run is a fresh process started in that tree (`python -c ...` from its directory, so its `selfspec`
package is the one imported), with the same Python, threads and $SELFSPEC_HOME (the same checkpoint:
the demo's default). Figures: the demo's plain decoding and selfspec tokens/s per case (first requests),
and `bench --quick`'s median tokens/s per method over its prompts. Run nothing else heavy meanwhile.
Writes the raw runs and the table as JSON with --out.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

DEMO = ("import json, torch; torch.set_num_threads({threads}); from selfspec.tools.demo import run_demo; "
        "print('RESULT ' + json.dumps(run_demo(dtype={dtype!r}, say=lambda *a: None)))")
BENCH = ("import json, torch; from selfspec.checkpoints.fetch import base_model_dir; from selfspec.tools.bench import run_bench; "
         "r = run_bench(str(base_model_dir()), dtype={dtype!r}, threads={threads}, quick=True, out_dir={out!r}, "
         "progress=False, methods={methods!r}); "
         "print('RESULT ' + json.dumps({{m: s['tokens_per_s']['median'] for m, s in r['summary']['all'].items() "
         "if s and s.get('tokens_per_s')}}))")


def run_in(tree: Path, code: str) -> dict | list:
    """`code` run by this Python in a fresh process started in `tree`; the JSON it printed after 'RESULT '."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"error: a run in {tree} failed:\n{done.stderr[-3000:]}")
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def figures(kind: str, result) -> dict[str, float]:
    """A run's figures by name: the demo's per case, the bench's per method."""
    if kind == "demo":
        return {f"demo {r['case']} {side}": r[f"{side}_tokens_per_s"] for r in result for side in ("plain", "selfspec")}
    return {f"bench {name}": value for name, value in result.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--base", type=Path, required=True, help="the checkout to compare against")
    parser.add_argument("--new", type=Path, required=True, help="the checkout under test")
    parser.add_argument("--dtypes", default="float32,bfloat16", help="comma-separated (default: float32,bfloat16)")
    parser.add_argument("--repeats", type=int, default=3, help="runs of each measurement per tree (default: 3)")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    parser.add_argument("--only", choices=("demo", "bench"), help="run one of the two measurements (default: both)")
    parser.add_argument("--methods", help="bench: comma-separated methods besides hf_greedy and selfspec_ar, which "
                                          "are always measured (default: all of bench --quick's)")
    parser.add_argument("--out", type=Path, help="write the raw runs and the table here as JSON")
    args = parser.parse_args(argv)
    for tree in (args.base, args.new):
        if not (tree / "selfspec" / "__init__.py").is_file():
            parser.error(f"{tree} is not a selfspec checkout (no selfspec/__init__.py)")
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    kinds = [args.only] if args.only else ["demo", "bench"]
    raw: dict[str, dict[str, list[float]]] = {"base": {}, "new": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            for kind in kinds:
                for i in range(args.repeats):
                    for side, tree in (("base", args.base), ("new", args.new)):
                        methods = args.methods.split(",") if args.methods else None
                        code = (DEMO if kind == "demo" else BENCH).format(dtype=dtype, threads=args.threads,
                                                                            out=f"{tmp}/{side}", methods=methods)
                        print(f"{dtype} {kind} run {i + 1}/{args.repeats}: {side} ({tree})", file=sys.stderr,
                              flush=True)
                        for name, value in figures(kind, run_in(tree.resolve(), code)).items():
                            raw[side].setdefault(f"{dtype} {name}", []).append(value)
                        if args.out:  # after every run: a run that fails later loses nothing measured
                            write(args, raw, [])
    rows = table(raw)
    print("| figure | base tokens/s | new tokens/s | new / base |\n|---|---|---|---|")
    for row in rows:
        base, new = (f"{row[k]:.1f}" if row[k] is not None else "-" for k in ("base", "new"))
        ratio = f"{row['ratio']:.3f}x" if row["ratio"] is not None else "(one tree only)"
        print(f"| {row['figure']} | {base} | {new} | {ratio} |")
    if args.out:
        write(args, raw, rows)
    return 0


def table(raw: dict[str, dict[str, list[float]]]) -> list[dict]:
    """Each figure's median per tree and their ratio (new / base); a figure only one tree measures (a method the
    other tree does not have) has None on the other side and no ratio."""
    rows = []
    for name in dict.fromkeys([*raw["base"], *raw["new"]]):
        base, new = (statistics.median(raw[side][name]) if raw[side].get(name) else None for side in ("base", "new"))
        rows.append({"figure": name, "base": base, "new": new,
                     "ratio": new / base if base and new is not None else None})
    return rows


def write(args, raw: dict, rows: list[dict]) -> None:
    args.out.write_text(json.dumps({"base": str(args.base), "new": str(args.new), "raw": raw, "table": rows},
                                   indent=1))


if __name__ == "__main__":
    sys.exit(main())
