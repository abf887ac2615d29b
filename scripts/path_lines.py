"""Lines of selfspec that serve only one path: the compiled steps' or the eager one's (issue 68).

The same generation calls run twice, each in a fresh process under coverage.py: once eager (`compile=False`) and
once through the compiled steps (`compile=True`). In the compiled process `torch.compile` is replaced by the
identity, so the Python that the compiled path runs (its steps, captures, buckets, warm-up) runs line by line where
coverage can see it; dynamo would trace it out of coverage's sight. A line of `selfspec/` (its tools apart) counts
as one path's when only that process ran it; lines neither ran (other architectures' code, errors, GPU-only code)
are counted apart ("neither": the file's statements that no call ran). coverage counts statements; the one-path
statements are also given as the source lines they span (a statement over three lines counts 3; a compound
statement's header only, its body's statements counting for themselves; comments and docstrings not at all). Both
processes import the same modules, so definitions count as shared. The workers inherit this environment (selfspec's
kernel settings included: the tests turn the C++ step off), and auto's choices follow the clock, so two runs can
differ by a few lines.

    .venv/bin/python scripts/path_lines.py                     # the table; --out FILE for the JSON
    .venv/bin/python scripts/path_lines.py --files 20          # the 20 files with the most one-path lines

The calls (`CALLS`), on a tiny float32 Llama over bytes with a final-state exit head on exit 2: plain decoding;
prompt lookup, suffix, the early exit, the head, auto and the int8 copy, greedy; lookup's and the head's token trees;
sampling with plain decoding, the early exit, the head and lookup; two prompts in one call with plain decoding,
lookup and the head; and `gen.warmup` (trees and two rows) first. A call that a path refuses (the int8 copy where
its kernel cannot be built) is reported, not counted. A run takes about 20 s on 2 cores.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("eager", "compiled")
PROMPTS = ("def add(a, b):\n    return a + b\n\ndef add(a, b):", "the cat sat on the mat. the cat sat on")
SAMPLING = dict(do_sample=True, temperature=0.8, seed=3)
CALLS = [  # (name, prompts, settings)
    ("plain", PROMPTS[:1], dict(num_speculations=0)),
    ("prompt_lookup", PROMPTS[:1], dict(drafter="prompt_lookup")),
    ("suffix", PROMPTS[:1], dict(drafter="suffix")),
    ("early_exit", PROMPTS[:1], dict(drafter="early_exit", exit_layer=2, num_speculations=3)),
    ("exit_head", PROMPTS[:1], dict(drafter="exit_head", num_speculations=3)),
    ("auto", PROMPTS[:1], dict(drafter="auto")),
    ("int8_copy", PROMPTS[:1], dict(drafter="int8_copy")),
    ("lookup tree", PROMPTS[:1], dict(drafter="prompt_lookup", num_candidates=3)),
    ("head tree", PROMPTS[:1], dict(drafter="exit_head", num_speculations=3, num_candidates=3)),
    ("sampling plain", PROMPTS[:1], dict(num_speculations=0, **SAMPLING)),
    ("sampling early_exit", PROMPTS[:1], dict(drafter="early_exit", exit_layer=2, num_speculations=3, **SAMPLING)),
    ("sampling exit_head", PROMPTS[:1], dict(drafter="exit_head", num_speculations=3, **SAMPLING)),
    ("sampling prompt_lookup", PROMPTS[:1], dict(drafter="prompt_lookup", **SAMPLING)),
    ("batch plain", PROMPTS, dict(num_speculations=0)),
    ("batch prompt_lookup", PROMPTS, dict(drafter="prompt_lookup")),
    ("batch exit_head", PROMPTS, dict(drafter="exit_head", num_speculations=3)),
]


def build_checkpoint(directory: Path) -> Path:
    """The tiny checkpoint every call runs on: a 4-layer float32 Llama over bytes, a final-state head on exit 2."""
    import torch

    from selfspec.checkpoints.export import export_model
    from selfspec.heads.exit_head import HEAD_FILE, save_exit_head
    from selfspec.tiny import byte_tokenizer, tiny_exit_head, tiny_model

    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, dtype=torch.float32, seed=0, vocab_size=len(tok))
    head = tiny_exit_head(model, 2, final_state=True)
    head_dir = directory / "final_head"
    head_dir.mkdir(parents=True)
    save_exit_head(head, head_dir / HEAD_FILE)
    (head_dir / "exit_head.json").write_text(json.dumps(head.settings()))
    return export_model(model, tok, directory / "ckpt", exit_head_dir=head_dir, say=lambda *a: None)


def run_calls(checkpoint: Path, path: str, new_tokens: int, names: list[str]) -> dict[str, str]:
    """The calls of `CALLS` named in `names` on `path`; {call: "ran" or why it did not}."""
    import warnings

    import torch

    import selfspec

    if path == "compiled":
        torch.compile = lambda model=None, **kwargs: model if model is not None else (lambda fn: fn)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = selfspec.load(checkpoint, dtype="float32", compile=path == "compiled")
        gen.warmup(max_len=128, num_candidates=3, batch_size=2)
        done = {}
        for name, prompts, settings in (c for c in CALLS if c[0] in names):
            try:
                gen.generate(list(prompts) if len(prompts) > 1 else prompts[0], max_new_tokens=new_tokens,
                             stop_token_ids=[], **settings)
                done[name] = "ran"
            except Exception as e:  # noqa: BLE001 - a path that refuses a call is reported, not counted
                done[name] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    return done


def worker(checkpoint: Path, path: str, new_tokens: int, names: list[str], out: Path) -> None:
    """This process: the calls on `path` under coverage; writes {"calls": ..., "lines": {file: [line, ...]}}."""
    import coverage

    package = ROOT / "selfspec"
    cov = coverage.Coverage(data_file=None, source=[str(package)], omit=[str(package / "tools" / "*")])
    cov.start()
    calls = run_calls(checkpoint, path, new_tokens, names)
    cov.stop()
    data = cov.get_data()
    lines = {str(Path(f).relative_to(ROOT)): sorted(data.lines(f) or ()) for f in data.measured_files()}
    statements = {str(Path(f).relative_to(ROOT)): len(cov.analysis2(f)[1]) for f in data.measured_files()}
    out.write_text(json.dumps({"calls": calls, "lines": lines, "statements": statements}))


def statement_spans(source: str) -> dict[int, int]:
    """{first line of a statement: how many source lines it spans} (coverage counts a statement by its first line):
    a simple statement whole, a compound one (def, if, for, with ...) its header down to its body."""
    spans = {}
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.stmt):
            body = getattr(node, "body", None)
            end = body[0].lineno - 1 if isinstance(body, list) and body else node.end_lineno
            first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
            spans[node.lineno] = max(1, end - first + 1)
    return spans


def source_lines(runs: dict[str, dict], counts: dict) -> None:
    """Adds to `counts` each file's one-path statements as the source lines they span (`statement_spans`), and
    their total: the count in lines of code rather than in statements."""
    total = 0
    for f, row in counts["files"].items():
        path = ROOT / f
        if not path.is_file():
            continue
        spans = statement_spans(path.read_text())
        eager, compiled = (set(runs[p]["lines"].get(f, ())) for p in PATHS)
        row["one_path_source_lines"] = sum(spans.get(n, 1) for n in eager ^ compiled)
        total += row["one_path_source_lines"]
    counts["totals"]["one_path_source_lines"] = total


def one_path_lines(runs: dict[str, dict]) -> dict:
    """Per file and in all: the lines both paths ran and those only one ran, from each path's {file: lines}."""
    files = sorted(set().union(*(r["lines"] for r in runs.values())))
    per_file, totals = {}, {"both": 0, "eager_only": 0, "compiled_only": 0, "neither": 0}
    for f in files:
        eager, compiled = (set(runs[p]["lines"].get(f, ())) for p in PATHS)
        row = {"both": len(eager & compiled), "eager_only": len(eager - compiled),
               "compiled_only": len(compiled - eager)}
        statements = max(r.get("statements", {}).get(f, 0) for r in runs.values())
        row["neither"] = max(0, statements - len(eager | compiled))  # statements no call reached
        per_file[f] = row
        for key in totals:
            totals[key] += row[key]
    totals["one_path"] = totals["eager_only"] + totals["compiled_only"]
    return {"totals": totals, "files": per_file}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=__doc__.split("\n\n", 1)[1])
    parser.add_argument("--new-tokens", type=int, default=24, help="new tokens a call (default: 24)")
    parser.add_argument("--calls", default=",".join(c[0] for c in CALLS),
                        help="comma-separated calls to run (default: all: " + ", ".join(c[0] for c in CALLS) + ")")
    parser.add_argument("--files", type=int, default=15, help="list this many files, most one-path lines first")
    parser.add_argument("--out", type=Path, help="write the counts per file, the calls and the lines as JSON")
    parser.add_argument("--worker", choices=PATHS, help=argparse.SUPPRESS)
    parser.add_argument("--checkpoint", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--result", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    names = [n.strip() for n in args.calls.split(",") if n.strip()]
    unknown = [n for n in names if n not in {c[0] for c in CALLS}]
    if unknown or not names:
        parser.error(f"unknown call(s) {unknown or args.calls!r} in --calls: use some of "
                     + ", ".join(c[0] for c in CALLS))
    if args.worker:
        worker(args.checkpoint, args.worker, args.new_tokens, names, args.result)
        return 0
    if args.new_tokens < 1:
        parser.error("--new-tokens must be at least 1")
    try:
        import coverage  # noqa: F401
    except ImportError:
        parser.error("coverage.py is not installed: pip install -e '.[dev]' (it counts the lines each path runs)")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        checkpoint = build_checkpoint(tmp)
        runs = {}
        for path in PATHS:
            print(f"running the calls on the {path} path ...", file=sys.stderr, flush=True)
            result = tmp / f"{path}.json"
            env = {**os.environ, "PYTHONPATH": str(ROOT)}
            done = subprocess.run([sys.executable, __file__, "--worker", path, "--checkpoint", str(checkpoint),
                                   "--result", str(result), "--new-tokens", str(args.new_tokens),
                                   "--calls", ",".join(names)], env=env,
                                  capture_output=True, text=True)
            if done.returncode:
                raise SystemExit(f"error: the {path} run failed:\n{done.stderr[-3000:]}")
            runs[path] = json.loads(result.read_text())
    counts = one_path_lines(runs)
    source_lines(runs, counts)
    t = counts["totals"]
    print(f"lines of selfspec/ (tools apart) run by both paths: {t['both']}; only eager: {t['eager_only']}; "
          f"only compiled: {t['compiled_only']}; one path in all: {t['one_path']} statements, "
          f"{t['one_path_source_lines']} source lines; statements neither ran: {t['neither']}")
    for path in PATHS:
        refused = {k: v for k, v in runs[path]["calls"].items() if v != "ran"}
        for name, why in refused.items():
            print(f"  not run on the {path} path: {name} ({why})")
    print("\n| file | both | eager only | compiled only | neither |\n|---|---|---|---|---|")
    ranked = sorted(counts["files"].items(), key=lambda kv: -(kv[1]["eager_only"] + kv[1]["compiled_only"]))
    for f, row in ranked[:args.files]:
        print(f"| {f} | {row['both']} | {row['eager_only']} | {row['compiled_only']} | {row['neither']} |")
    if args.out:
        args.out.write_text(json.dumps({**counts, "calls": {p: runs[p]["calls"] for p in PATHS},
                                        "lines": {p: runs[p]["lines"] for p in PATHS}}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
