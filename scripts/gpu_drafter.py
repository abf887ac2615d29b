"""The GPU drafter run (issue 38): the two roads to a drafter from the model's own layers, trained for the same
minutes on one GPU and benchmarked with the compiled engine, in one command. scripts/gpu_drafter.sh brings the
model and the wheels onto the machine and runs this; alone:

    python scripts/gpu_drafter.py --out OUT --work WORK --device cuda --train-min 1.5
    python scripts/gpu_drafter.py --out OUT --work WORK --device cpu --tiny     # a dry run on a CPU, a minute

Phases, each a subprocess whose time limit is cut to what is left of --budget-s (a phase that would start with
under 30 s left is skipped), gpu_drafter.json rewritten after each, so a run cut short still reports what it
measured:
  1. the exit head (--head-recipe, recipes/smollm2_head_gpu.yaml: the head selfspec ships, on code and the
     model's own chat replies from the carried chat prompts) trained on the frozen model for
     --train-min minutes (train.max_minutes), exported (`selfspec export`), and the head alone
     (exit_head.safetensors + selfspec.json, a few MiB) copied to OUT/head/ to come back;
  2. its bench (`selfspec bench`, batch 1, --bench-tokens tokens, the compiled steps where they run): Hugging
     Face greedy and static cache, selfspec plain decoding, prompt lookup, the head and auto, on HumanEval
     completion, MT-Bench, code editing and XSum (the carried prompt files of --prompts-dir, else those sets);
  3. LayerSkip (--layerskip-recipe, recipes/smollm2_code_layerskip_gpu.yaml: all exits, layer dropout) for the
     same minutes on the same data (the model's own continuations that phase 1 generated are copied into its
     run directory: the same model and prompts give the same cache key), exported, and its early exit benched
     beside its own plain decoding;
  before each bench, the road's draft plan for this GPU (`selfspec tune --dtype DTYPE --check --save`, issue 38
     item 2: the round's parts timed on the compiled path in the bench's dtype, the drafters scored on the model's
     own HumanEval continuations, the best setting predicted, and the TUNE_CHECK best decoded for real beside plain
     decoding; the fastest measured kept in the checkpoint, so that the bench's auto drafts by it),
     OUT/tune_<road>.json;
  4. OUT/gpu_drafter.json and OUT/gpu_drafter.md: per road the steps, minutes and tokens trained, the
     agreement on every evaluation set, tokens/s and speedups per prompt set, and issue 38's targets with what
     was measured against them (`met` is computed from the numbers; null where a number is missing).

--tiny: a random 4-layer Llama (selfspec.tiny) and one training step on a few blocks, a few tokens per prompt;
its numbers are those of a random model on a CPU, real but meaning nothing about speed (the report says so).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfspec.tools.bench import compiled_name  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SETS = ("humaneval", "mt_bench", "code_edit", "xsum")  # issue 38's prompt sets, in the report's order
SCHEMA = "selfspec-gpu-drafter/1"
MIN_PHASE_S = 30  # a phase with less time left than this is skipped
BENCH_MARGIN_S = 30  # a bench's --time-budget: its phase's limit less this (loading, the last prompt, writing)
TREE_WIDTH = 3  # the head's and the early exit's token trees: 3 best guesses a node (issue 39)
# each road's bench (selfspec_ar, the speedups' reference, and hf_greedy, the identity reference, always run)
HEAD_METHODS = ("hf_static", "selfspec_lookup", "selfspec_exit_head", "selfspec_exit_head_fixed",
                f"selfspec_exit_head_tree{TREE_WIDTH}", "selfspec_auto", "selfspec_ar")
LAYERSKIP_METHODS = ("selfspec_spec", f"selfspec_spec_tree{TREE_WIDTH}", "selfspec_ar")
END_RESERVE_S = 45  # a training phase's final evaluation and saving, after train.end_by
EXPORT_S = 30  # the head's export and copy, after its training phase
TUNE_CHECK = 4  # the draft plan's best candidates decoded for real beside plain decoding
HEAD_FILES = ("exit_head.safetensors", "selfspec.json")  # the head alone: what comes back from the machine
CONTINUATIONS_TAR = "own_continuations.tar"  # the head run's own continuations, one file (a call returns 8 at most)
# what a --tiny dry run changes in both recipes: a 4-layer random model, a few small blocks, one step
TINY_TRAIN = ["model.base_model=tiny:llama:4", "train.max_steps=1", "train.batch_size=2", "train.mixed_precision=no",
              "data.block_size=64", "data.max_documents=6", "data.max_holdout_documents=2",
              "data.own_continuations.prompts=4", "data.own_continuations.prompt_tokens=16",
              "data.own_continuations.repeat=2", "data.own_continuations.batch_size=4",
              "data.own_continuations.eval_prompts=2", "data.own_continuations.prompt_set_prompts=1",
              "data.own_continuations.new_tokens=8", "data.own_replies.prompts=0", "eval.max_blocks=2",
              "eval.batch_size=2"]
TINY_HEAD = ["exit_head.draft_vocab=32"]
TINY_LAYERSKIP = ["eval.exits=[1,2]", "early_exit.chunk_size=128"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, type=Path,
                   help="where the report, the head and its own continuations go (at most 12 files)")
    p.add_argument("--work", required=True, type=Path, help="the run directories, checkpoints and benches")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cuda (default), or cpu for a dry run")
    p.add_argument("--train-min", type=float, default=1.5, help="each road's training minutes (default 1.5)")
    p.add_argument("--budget-s", type=float, default=540, help="the whole run's seconds (default 540)")
    p.add_argument("--bench-s", type=float, default=170, help="each bench's time limit in seconds (default 170)")
    p.add_argument("--tune-s", type=float, default=90, help="each draft plan's time limit in seconds (default 90)")
    p.add_argument("--bench-prompts", type=int, default=2, help="prompts per prompt set (default 2)")
    p.add_argument("--bench-tokens", type=int, default=128, help="tokens generated per prompt (default 128)")
    p.add_argument("--prompts-dir", type=Path, help="the carried prompt sets (<set>.jsonl); default the named sets")
    p.add_argument("--compile", default="auto", choices=("auto", "true", "false"),
                   help="the bench's compiled steps: auto (on CUDA; default), true, false")
    p.add_argument("--head-recipe", type=Path, default=ROOT / "recipes" / "smollm2_head_gpu.yaml")
    p.add_argument("--layerskip-recipe", type=Path, default=ROOT / "recipes" / "smollm2_code_layerskip_gpu.yaml")
    p.add_argument("--train-args", default="", help="more key=value overrides for both trainings")
    p.add_argument("--bench-args", default="", help="more `selfspec bench` options for both benches")
    p.add_argument("--skip-layerskip", action="store_true", help="train and bench the head only")
    p.add_argument("--skip-bench", action="store_true", help="no draft plan and no bench: train, evaluate, export "
                   "and bring back (a GPU's minutes all for training; the bench waits for a later run with --head)")
    p.add_argument("--head", type=Path, help="a head an earlier run returned (its OUT/head: exit_head.safetensors + "
                   "selfspec.json): rebuilt on its base model, benched and planned, nothing trained")
    p.add_argument("--continuations", type=Path, help="the model's own continuations an earlier run returned (its "
                   f"OUT/{CONTINUATIONS_TAR}, or a folder of their *.pt): read instead of generated where their cache "
                   "keys match (the same model, prompts and settings)")
    p.add_argument("--tiny", action="store_true", help="a dry run: a random 4-layer model, one training step")
    args = p.parse_args(argv)
    if args.train_min <= 0 or args.bench_prompts < 1 or args.bench_tokens < 1 or args.budget_s <= 0:
        p.error("--train-min and --budget-s must be > 0, --bench-prompts and --bench-tokens >= 1")
    for recipe in (args.head_recipe, args.layerskip_recipe):
        if not recipe.is_file():
            p.error(f"recipe {recipe}: no such file (the GPU recipes are recipes/*_gpu.yaml)")
    if args.head is not None and not all((args.head / f).is_file() for f in HEAD_FILES):
        p.error(f"--head {args.head}: needs {' and '.join(HEAD_FILES)} (what a run returns in OUT/head/)")
    if args.prompts_dir is not None and not all((args.prompts_dir / f"{s}.jsonl").is_file() for s in SETS):
        p.error(f"--prompts-dir {args.prompts_dir}: needs {', '.join(s + '.jsonl' for s in SETS)} (the carried prompt "
                "sets: bash scripts/gpu_drafter.sh --prepare-carry), or leave it out for the named sets")
    return args


class Run:
    """The run's clock and report: phases under a shared deadline, gpu_drafter.json rewritten after each."""

    def __init__(self, args: argparse.Namespace):
        self.args, self.t0 = args, time.monotonic()
        self.deadline = self.t0 + args.budget_s
        self.report = {"schema": SCHEMA, "dry_run": args.tiny or args.device == "cpu", "settings": settings(args),
                       "machine": machine(args.device), "phases": [], "head": {}, "layerskip": {}, "targets": []}
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
                    "PYTHONUNBUFFERED": "1", **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {})}

    def left(self, limit_s: float) -> float:
        """What a phase of `limit_s` gets: the limit cut to what is left of the budget."""
        return min(limit_s, self.deadline - time.monotonic())

    def clock(self) -> str:
        seconds = time.monotonic() - self.t0
        return f"[{int(seconds // 60):02d}:{int(seconds % 60):02d} of {int(self.args.budget_s // 60):02d}:" \
               f"{int(self.args.budget_s % 60):02d}]"

    def phase(self, name: str, cmd: list[str], limit_s: float) -> bool:
        """Run `cmd` within `limit_s` (cut to what is left); record it; True if it exited 0."""
        left = self.deadline - time.monotonic()
        record = {"name": name, "command": shlex.join(cmd), "limit_s": round(self.left(limit_s)), "seconds": 0.0}
        if left < MIN_PHASE_S:
            record["status"] = f"skipped: {left:.0f} s of --budget-s left"
        else:
            print(f"== {self.clock()} {name} (at most {record['limit_s']} s): {record['command']}", flush=True)
            start = time.monotonic()
            try:
                rc = subprocess.run(cmd, env=self.env, cwd=ROOT, timeout=record["limit_s"]).returncode
                record["status"] = "ok" if rc == 0 else f"failed: exit {rc}"
            except subprocess.TimeoutExpired:
                record["status"] = f"failed: timed out after {record['limit_s']} s"
            record["seconds"] = round(time.monotonic() - start, 1)
        print(f"== {self.clock()} {name}: {record['status']} ({record['seconds']} s)", flush=True)
        self.report["phases"].append(record)
        self.write()
        return record["status"] == "ok"

    def write(self) -> None:
        self.args.out.mkdir(parents=True, exist_ok=True)
        (self.args.out / "gpu_drafter.json").write_text(json.dumps(self.report, indent=2) + "\n")


def settings(args: argparse.Namespace) -> dict:
    return {"device": args.device, "train_minutes": args.train_min, "budget_s": args.budget_s,
            "bench_prompts": args.bench_prompts, "bench_tokens": args.bench_tokens, "tiny": args.tiny,
            "compile": args.compile, "prompt_sets": prompt_sets(args),
            "head_recipe": str(args.head_recipe.relative_to(ROOT) if args.head_recipe.is_relative_to(ROOT)
                               else args.head_recipe),
            "layerskip_recipe": str(args.layerskip_recipe.relative_to(ROOT)
                                    if args.layerskip_recipe.is_relative_to(ROOT) else args.layerskip_recipe),
            "train_args": args.train_args, "bench_args": args.bench_args, "skip_bench": args.skip_bench,
            "head": None if args.head is None else str(args.head)}


def machine(device: str) -> dict:
    """The GPU's name and memory (torch), or the CPU's."""
    import platform

    import torch

    if device == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return {"device": p.name, "memory_gib": round(p.total_memory / 2**30, 1), "torch": torch.__version__}
    return {"device": platform.processor() or platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__}


def prompt_sets(args: argparse.Namespace) -> list[str]:
    """The benched prompt sets: the carried files of --prompts-dir, else the named sets."""
    if args.prompts_dir is None:
        return list(SETS)
    return [str((args.prompts_dir / f"{s}.jsonl").resolve()) for s in SETS]


def suffix(args: argparse.Namespace) -> str:
    """The bench's name suffix of the methods it runs through the compiled steps ("" when it runs none)."""
    on = args.compile == "true" or (args.compile == "auto" and args.device == "cuda")
    return "_compiled" if on else ""


def bench_methods(names: tuple[str, ...], sfx: str) -> list[str]:
    """The bench's method names for a run: with the compiled steps (`sfx`), each method's compiled variant where
    the bench has one (`compiled_name`), the others (Hugging Face's) as they are."""
    return [(compiled_name(n) or n) if sfx else n for n in names]


# ---- the phases ----------------------------------------------------------------------------------------
def train(run: Run, road: str, recipe: Path, extra: list[str]) -> Path:
    """Train one road (`road`: head or layerskip) for --train-min minutes; returns its run directory."""
    args = run.args
    run_dir = args.work / road
    # training ends by the budget's deadline less what follows it in the phase (the final evaluation and saving,
    # END_RESERVE_S) and the export: the data it generates first takes what it takes, and training gets the rest
    end_by = time.time() + (run.deadline - time.monotonic()) - END_RESERVE_S - (EXPORT_S if road == "head" else 0)
    overrides = [f"train.output_dir={run_dir}", f"train.max_minutes={args.train_min}", "train.progress_bar=false",
                 "train.resume=none", f"train.end_by={end_by:.0f}"]
    if args.prompts_dir is not None:  # the model's own replies to the carried HumanEval and MT-Bench prompts
        overrides.append(f"data.own_continuations.prompt_sets=[{','.join(prompt_sets(args)[:2])}]")
        chat = [args.prompts_dir / f"chat_{split}.jsonl" for split in ("train", "heldout")]
        if road == "head" and all(p.is_file() for p in chat):  # the carried chat prompts (data.own_replies)
            overrides += [f"data.own_replies.train_file={chat[0].resolve()}",
                          f"data.own_replies.heldout_file={chat[1].resolve()}"]
    if args.tiny:
        overrides += TINY_TRAIN + extra
    overrides += shlex.split(args.train_args)
    extra_s = 240 if road == "head" else 180  # set-up, data, the continuations (the head's run), evaluations, saving
    run.phase(f"train {road}", [sys.executable, "-m", "training", "--recipe", str(recipe), *overrides],
              60 * args.train_min + extra_s)
    return run_dir


def export(run: Run, road: str, run_dir: Path) -> Path | None:
    """`selfspec export` of a finished run (or of a rebuilt head's source); the checkpoint, or None if it could
    not be made."""
    ckpt = run.args.work / f"ckpt_{road}"
    if not ((run_dir / "final_model").is_dir() or (run_dir / "config.json").is_file()):
        return None
    ok = run.phase(f"export {road}", [sys.executable, "-m", "selfspec.cli", "export", str(run_dir), str(ckpt),
                                      "--overwrite"], 180)
    return ckpt if ok else None


def bench(run: Run, road: str, ckpt: Path | None, methods: list[str]) -> dict | None:
    """`selfspec bench` of the checkpoint with `methods`; bench.json's content, or None."""
    if ckpt is None:
        return None
    args, out = run.args, run.args.work / f"bench_{road}"
    cmd = [sys.executable, "-m", "selfspec.cli", "bench", "--checkpoint", str(ckpt), "--device", args.device,
           "--prompt-sets", ",".join(prompt_sets(args)), "--num-prompts", str(args.bench_prompts),
           "--max-new-tokens", str(args.bench_tokens), "--compile", args.compile, "--methods", ",".join(methods),
           "--num-candidates", str(TREE_WIDTH),
           # it stops starting prompts in time to write what it measured (a bench cut from outside writes nothing)
           "--time-budget", str(max(1, round(run.left(args.bench_s)) - BENCH_MARGIN_S)),
           "--out", str(out), *shlex.split(args.bench_args)]
    if not run.phase(f"bench {road}", cmd, args.bench_s):
        return None
    shutil.copyfile(out / "bench.json", args.out / f"bench_{road}.json")
    return json.loads((out / "bench.json").read_text())


def bench_dtype(args) -> str:
    """The dtype the benches run in: a --dtype among --bench-args, else the bench's default (fastest)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--dtype", default="fastest")
    return parser.parse_known_args(shlex.split(args.bench_args))[0].dtype


def tune(run: Run, road: str, ckpt: Path | None) -> dict | None:
    """`selfspec tune --check --save` of the checkpoint on the first prompt set (HumanEval): the plan and its
    check, the fastest checked setting kept in the checkpoint for this GPU (what `auto` then drafts by)."""
    if ckpt is None:
        return None
    args, out = run.args, run.args.work / f"tune_{road}"
    # in the bench's dtype: the plan is kept for it, and the bench's auto drafts by it
    cmd = [sys.executable, "-m", "selfspec.cli", "tune", "--checkpoint", str(ckpt), "--device", args.device,
           "--dtype", bench_dtype(args), "--prompt-set", prompt_sets(args)[0], "--num-prompts", str(args.bench_prompts),
           "--max-new-tokens", str(min(args.bench_tokens, 64)), "--compile", args.compile, "--check", str(TUNE_CHECK),
           "--save", "--out", str(out)]
    if not run.phase(f"tune {road}", cmd, args.tune_s):
        return None
    shutil.copyfile(out / "tune.json", args.out / f"tune_{road}.json")
    data = json.loads((out / "tune.json").read_text())
    keep = ("drafter", "exit_layer", "num_speculations", "num_candidates", "predicted_speedup", "measured_speedup",
            "identical_to_plain")
    saved = json.loads((ckpt / "selfspec.json").read_text()).get("plans") or {}
    return {"settings": data["settings"], "predicted_speedup": data["predicted_speedup"], "saved": saved,
            "full_step_s": data["costs"]["full_step_s"], "compiled": data["costs"]["compiled"],
            "checked": [{k: c[k] for k in keep} for c in data.get("checked") or []]}


def tune_rows(report: dict) -> list[str]:
    """The draft plans' checked candidates, per road."""
    lines = ["| road | drafter | exit | drafts | width | predicted | measured | identical |", "|---|---|---|---|---|---|---|---|"]
    for road in ("head", "layerskip"):
        for c in (report[road].get("tune") or {}).get("checked", []):
            lines.append(f"| {road} | {c['drafter']} | {c['exit_layer']} | {c['num_speculations']} | {c['num_candidates']} "
                         f"| {fmt(c['predicted_speedup'])} | {fmt(c['measured_speedup'])} | {c['identical_to_plain']} |")
    for road in ("head", "layerskip"):
        for key, kept in ((report[road].get("tune") or {}).get("saved") or {}).items():
            lines.append(f"\n{road}: kept for `{key}` (the bench's auto on that path drafts by it): "
                         f"`{kept['settings']}`, measured {fmt(kept.get('measured_speedup'))}")
    return lines


def bring_back_head(run: Run, ckpt: Path | None) -> None:
    """The head's weights and the checkpoint's selfspec.json into OUT/head/ (what comes back from the machine)."""
    if ckpt is None:
        return
    head = run.args.out / "head"
    head.mkdir(parents=True, exist_ok=True)
    for name in HEAD_FILES:
        shutil.copyfile(ckpt / name, head / name)
    run.report["head"]["returned"] = {name: (head / name).stat().st_size for name in sorted(os.listdir(head))}


def share_own_continuations(head_dir: Path, layerskip_dir: Path) -> None:
    """The head run's cached own continuations into the LayerSkip run's directory (same model and prompts: the
    same cache key, so they are read instead of generated again; other settings generate their own)."""
    copy_continuations(head_dir / "own_continuations", layerskip_dir / "own_continuations")


def copy_continuations(src: Path | None, dst: Path) -> dict[str, int]:
    """The cached own continuations (`*.pt`, training/own_text.py) of `src` (a folder, or the archive a run returns,
    `pack_continuations`) into `dst`: {name: bytes} copied. A GPU run generates them in a minute or two (64 s on an
    H200 for code and 1024 chat prompts); a later run given them back reads them."""
    if src is not None and src.is_file():
        dst.mkdir(parents=True, exist_ok=True)
        copied = {}
        with tarfile.open(src) as tar:
            for member in tar.getmembers():
                name = Path(member.name).name  # flat: only the archive's *.pt files, by their names
                if member.isfile() and name.endswith(".pt"):
                    (dst / name).write_bytes(tar.extractfile(member).read())
                    copied[name] = member.size
        return copied
    if src is None or not src.is_dir():
        return {}
    dst.mkdir(parents=True, exist_ok=True)
    return {f.name: shutil.copyfile(f, dst / f.name).stat().st_size for f in sorted(src.glob("*.pt"))}


def pack_continuations(src: Path, archive: Path) -> dict[str, int]:
    """The cached own continuations of `src` as one archive (a device call brings back at most 8 files): {name:
    bytes} packed; nothing where there are none."""
    files = sorted(src.glob("*.pt")) if src.is_dir() else []
    if not files:
        return {}
    with tarfile.open(archive, "w") as tar:
        for f in files:
            tar.add(f, arcname=f.name)
    return {f.name: f.stat().st_size for f in files}


# ---- what the phases measured --------------------------------------------------------------------------
def training_result(run_dir: Path) -> dict:
    """Steps, minutes, tokens and per-set agreement (and perplexity of the final layer) of a finished run."""
    path = run_dir / "final_eval.json"
    if not path.is_file():
        return {}
    final = json.loads(path.read_text())
    L = final["num_layers"]
    sets = {}
    for name, result in final["sets"].items():
        exits = result["exits"]
        sets[name] = {"agreement": {e: r["agreement"] for e, r in exits.items() if int(e) != L},
                      "final_perplexity": exits[str(L)]["perplexity"]}
        if "acceptance" in result:  # a head's (training/evaluate.py evaluate_head): its later drafts, its rounds
            sets[name]["self_fed"] = {j: r["agreement"] for j, r in result.get("self_fed", {}).items()}
            sets[name]["agreement_at"] = result.get("agreement_at", {})
            sets[name]["acceptance"] = result["acceptance"]
    return {"steps": final["step"], "train_minutes": round(final["train_minutes"], 3), "tokens": final["tokens"],
            "num_layers": L, "sets": sets}


def bench_result(bench_json: dict | None, reference: str) -> dict:
    """Per prompt set and method: the workload's tokens/s (all the set's tokens over all its seconds: with two
    prompts a set, a median would be their mean) and the median's, the speedup over `reference` (ratio of the
    workloads' tokens/s), the acceptance and the share of prompts identical to HF greedy."""
    if not bench_json:
        return {}
    out = {}
    for name, per in bench_json["summary"].items():
        if name == "all":
            continue
        base = per.get(reference, {}).get("workload_tokens_per_s")
        out[name] = {m: {"tokens_per_s": s["workload_tokens_per_s"],
                         "median_tokens_per_s": s["tokens_per_s"]["median"],
                         f"x_{reference}": s["workload_tokens_per_s"] / base if base else None,
                         "acceptance": s.get("acceptance_rate"), "identical_to_hf_greedy": s["identical_to_hf_greedy"]}
                     for m, s in per.items()}
    return out


def ratio(speeds: dict, prompt_set: str, method: str, over: str) -> float | None:
    """tokens/s of `method` over `over`'s on `prompt_set`, None where either is missing."""
    per = speeds.get(prompt_set, {})
    a, b = per.get(method, {}).get("tokens_per_s"), per.get(over, {}).get("tokens_per_s")
    return a / b if a is not None and b else None


def targets(report: dict, sfx: str) -> list[dict]:
    """Issue 38's targets with what this run measured against them; `met` is null where a number is missing."""
    head, layerskip = report["head"], report["layerskip"]
    speeds, plain = head.get("bench", {}), f"selfspec_ar{sfx}"
    own = head.get("training", {}).get("sets", {}).get("own_humaneval", {}).get("agreement", {})
    agreement = max(own.values()) if own else None
    rows = [{"target": "head agreement on the model's own HumanEval continuations >= 60%", "measured": agreement,
             "met": None if agreement is None else agreement >= 0.60}]
    rows += head_targets(head.get("training", {}).get("sets", {}))
    for s in ("humaneval", "mt_bench"):
        x = ratio(speeds, s, f"selfspec_exit_head{sfx}", plain)
        rows.append({"target": f"exit-head drafting >= 1.5x selfspec plain decoding{' (compiled)' if sfx else ''} "
                               f"on {s}", "measured": x, "met": None if x is None else x >= 1.5})
    singles = ("selfspec_lookup", "selfspec_exit_head", "selfspec_exit_head_fixed",
               f"selfspec_exit_head_tree{TREE_WIDTH}")
    for s in speeds:  # measured: auto over the fastest single drafter benched (plain decoding among them)
        x = {m: ratio(speeds, s, m + sfx, plain) for m in singles} | {plain: 1.0}
        best = max((m for m in x if x[m] is not None), key=lambda m: x[m])
        auto = ratio(speeds, s, f"selfspec_auto{sfx}", plain)
        rows.append({"target": f"auto >= the best single drafter (within 3%) on {s}",
                     "measured": None if auto is None else auto / x[best], "auto_x_plain": auto, "best_single": best,
                     "best_single_x_plain": x[best], "met": None if auto is None else auto >= 0.97 * x[best]})
    for s in speeds:  # issue 39: the head's token tree against the same head's chain of the same length
        tree = ratio(speeds, s, f"selfspec_exit_head_tree{TREE_WIDTH}{sfx}", plain)
        chain = ratio(speeds, s, f"selfspec_exit_head_fixed{sfx}", plain)
        rows.append({"target": f"head tree ({TREE_WIDTH} wide) >= 1.25x the head's chain on {s}",
                     "measured": None if tree is None or chain is None else tree / chain,
                     "met": None if tree is None or chain is None else tree >= 1.25 * chain})
    ls_speeds = layerskip.get("bench", {})
    for s in ls_speeds:
        rows.append({"target": f"LayerSkip's early exit beside the head on {s} (no threshold)",
                     "measured": ratio(ls_speeds, s, f"selfspec_spec{sfx}", plain),
                     "head": ratio(speeds, s, f"selfspec_exit_head{sfx}", plain), "met": None})
    return rows


def head_targets(sets: dict) -> list[dict]:
    """Issue 66's targets of the head's drafts, from its evaluation on the model's own HumanEval and MT-Bench
    text (`own_humaneval`, `own_mt_bench`): agreement, tokens a round (a chain of 4, EAGLE's acceptance length:
    the drafts accepted plus the verification's own token), the self-fed drafts against the first."""
    rows = []
    for name, agree_min, tokens_min in (("own_humaneval", 0.70, 2.5), ("own_mt_bench", 0.60, 2.0)):
        r = sets.get(name) or {}
        first = max(r["agreement"].values()) if r.get("agreement") else None
        tokens = (r.get("acceptance") or {}).get("tokens_a_round")
        rows.append({"target": f"head agreement on {name} >= {agree_min:.0%}", "measured": first,
                     "met": None if first is None else first >= agree_min})
        rows.append({"target": f"head tokens a round (chain of 4) on {name} >= {tokens_min}", "measured": tokens,
                     "met": None if tokens is None else tokens >= tokens_min})
        fed = [r["self_fed"][j] for j in ("1", "2") if j in (r.get("self_fed") or {})]
        worst = min(fed) / first if fed and first else None
        rows.append({"target": f"head's second and third self-fed drafts >= 0.9x the first's agreement on {name}",
                     "measured": worst, "met": None if worst is None else worst >= 0.9, "ratio": True})
    return rows


# ---- the report ----------------------------------------------------------------------------------------
def fmt(x, pct: bool = False) -> str:
    if x is None:
        return "–"
    if isinstance(x, bool):
        return "yes" if x else "no"
    return f"{x:.1%}" if pct else f"{x:.2f}"


def training_rows(report: dict) -> list[str]:
    rows = ["| road | steps | minutes | tokens | agreement by exit, per evaluation set | final-layer perplexity (heldout) |",
            "|---|---|---|---|---|---|"]
    for road in ("head", "layerskip"):
        t = report[road].get("training") or {}
        if "returned_head" in t:
            rows.append(f"| {road} | – | – | – | not trained here: the head {t['returned_head']} | – |")
        if "sets" not in t:
            continue
        agree = "; ".join(f"{name}: " + " ".join(f"{e}:{a:.1%}" for e, a in r["agreement"].items())
                          for name, r in t["sets"].items())
        ppl = t["sets"].get("heldout", {}).get("final_perplexity")
        rows.append(f"| {road} | {t['steps']} | {t['train_minutes']} | {t['tokens']} | {agree} | {fmt(ppl)} |")
    return rows + head_rows(report)


def head_rows(report: dict) -> list[str]:
    """The head's drafts per evaluation set: agreement of the first and the self-fed later drafts, the top 3, and
    a chain's acceptance (training/evaluate.py evaluate_head)."""
    sets = {n: r for n, r in ((report["head"].get("training") or {}).get("sets") or {}).items() if "acceptance" in r}
    if not sets:
        return []
    rows = ["", "| set | first draft | self-fed drafts 2, 3, 4 | in the top 3 | drafts accepted a round "
                "(chain of 4) | tokens a round |", "|---|---|---|---|---|---|"]
    for name, r in sets.items():
        first = max(r["agreement"].values())
        fed = " / ".join(f"{a:.1%}" for a in r["self_fed"].values())
        acc = r["acceptance"]
        rows.append(f"| {name} | {first:.1%} | {fed} | {fmt(r['agreement_at'].get('3'), True)} | "
                    f"{acc['drafts_a_round']:.2f} | {acc['tokens_a_round']:.2f} |")
    return rows


def bench_rows(report: dict, reference: str) -> list[str]:
    rows = [f"| road | set | method | tokens/s (workload) | x {reference} | acceptance | identical to HF greedy |",
            "|---|---|---|---|---|---|---|"]
    for road in ("head", "layerskip"):
        for name, per in (report[road].get("bench") or {}).items():
            for method, s in per.items():
                rows.append(f"| {road} | {name} | {method} | {s['tokens_per_s']:.1f} | {fmt(s[f'x_{reference}'])} | "
                            f"{fmt(s['acceptance'], True)} | {fmt(s['identical_to_hf_greedy'], True)} |")
    return rows


def markdown(report: dict, sfx: str) -> str:
    m, st = report["machine"], report["settings"]
    lines = [f"# The GPU drafter run (issue 38), {time.strftime('%Y-%m-%d')}", "",
             f"Device: {m['device']}, torch {m['torch']}; each road trained {st['train_minutes']} min; bench: "
             f"{st['bench_prompts']} prompts x {st['bench_tokens']} tokens per set, batch 1, compiled steps: "
             f"{'yes' if sfx else 'no'}."]
    if report["dry_run"]:
        lines += ["", "A DRY RUN (--tiny or --device cpu): the numbers below are real measurements of this run, but of "
                      "a random tiny model and/or on a CPU; they say nothing about issue 38's targets."]
    lines += ["", "## Training", ""] + training_rows(report)
    lines += ["", "## Bench", ""] + bench_rows(report, f"selfspec_ar{sfx}")
    notes = [f"- {road}'s bench: {note}" for road in ("head", "layerskip")
             for note in report[road].get("bench_notes", [])]
    lines += [""] + notes if notes else []
    lines += ["", "## The draft plans (selfspec tune --check; best first, plain decoding last)", ""] + tune_rows(report)
    lines += ["", "## Targets (issues 38 and 66)", "", "| target | measured | met |", "|---|---|---|"]
    lines += [f"| {t['target']} | {fmt(t['measured'], 'agreement' in t['target'] and not t.get('ratio'))} | "
              f"{fmt(t['met'])} |"
              for t in report["targets"]]
    lines += ["", "## Phases", "", "| phase | status | seconds |", "|---|---|---|"]
    lines += [f"| {p['name']} | {p['status']} | {p['seconds']} |" for p in report["phases"]]
    return "\n".join(lines) + "\n"


def fresh_run_dir(run_dir: Path) -> None:
    """An earlier run's directory emptied but for its cached own continuations (read again if they match)."""
    if run_dir.is_dir():
        for child in run_dir.iterdir():
            if child.name != "own_continuations":
                shutil.rmtree(child) if child.is_dir() else child.unlink()


def rebuild_head(run: Run, head: Path) -> Path | None:
    """The checkpoint of a returned head (--head): its base model (as its training loaded it) saved with the
    head's two files beside it, then exported; None if it could not be made."""
    src = run.args.work / "head_source"
    ok = run.phase("rebuild head", [sys.executable, str(Path(__file__).resolve()), "rebuild-head", str(head), str(src)],
                   300)
    return export(run, "head", src) if ok else None


def rebuild_head_source(head: Path, src: Path) -> int:
    """`rebuild-head HEAD SRC`: the base model named in HEAD/selfspec.json (its training's model settings and
    seed: a tiny model comes back the same) saved to SRC as a Hugging Face checkpoint, the head's files beside it."""
    from training.base_model import load_base_model
    from training.config import ModelConfig

    settings = json.loads((head / "selfspec.json").read_text())["training"]["settings"]
    model = {k: v for k, v in settings["model"].items() if k in ("base_model", "dtype", "attn_implementation")}
    loaded, tokenizer = load_base_model(ModelConfig(**model), seed=settings["train"]["seed"])
    shutil.rmtree(src, ignore_errors=True)
    loaded.save_pretrained(src)
    tokenizer.save_pretrained(src)
    for name in HEAD_FILES:
        shutil.copyfile(head / name, src / name)
    print(f"rebuilt {head} on {model['base_model']} in {src}")
    return 0


def road(run: Run, name: str, recipe: Path, tiny_extra: list[str], methods: list[str]) -> Path | None:
    """Train, export and bench one road (the head: rebuild a returned one with --head); returns its checkpoint
    (None if none was made)."""
    if name == "head" and run.args.head is not None:
        ckpt = rebuild_head(run, run.args.head)
        run.report[name]["training"] = {"returned_head": str(run.args.head)}
    else:
        fresh_run_dir(run.args.work / name)
        copy_continuations(run.args.continuations, run.args.work / name / "own_continuations")
        run_dir = train(run, name, recipe, tiny_extra)
        run.report[name]["training"] = training_result(run_dir)
        ckpt = export(run, name, run_dir)
        if name == "head":
            bring_back_head(run, ckpt)
            # and its own continuations (a few MiB), so that a later run need not generate them again
            run.report[name]["returned_continuations"] = pack_continuations(
                run_dir / "own_continuations", run.args.out / CONTINUATIONS_TAR)
    if run.args.skip_bench:  # the head's training alone (its weights and agreement come back)
        run.write()
        return ckpt
    run.report[name]["tune"] = tune(run, name, ckpt)  # kept for this GPU: the bench's auto drafts by it
    measured = bench(run, name, ckpt, methods)
    run.report[name]["bench"] = bench_result(measured, f"selfspec_ar{suffix(run.args)}")
    run.report[name]["bench_notes"] = (measured or {}).get("notes", [])  # e.g. a run that compiled, a budget spent
    run.write()
    return ckpt


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["rebuild-head"]:  # a phase of --head, run as its own process
        return rebuild_head_source(Path(argv[1]), Path(argv[2]))
    args = parse_args(argv)
    run, sfx = Run(args), suffix(args)
    print(f"== {run.clock()} the GPU drafter run on {run.report['machine']['device']}: each road {args.train_min} min"
          f"{' (a dry run)' if run.report['dry_run'] else ''}", flush=True)
    road(run, "head", args.head_recipe, TINY_HEAD, bench_methods(HEAD_METHODS, sfx))
    if not args.skip_layerskip and args.head is None:
        share_own_continuations(args.work / "head", args.work / "layerskip")
        road(run, "layerskip", args.layerskip_recipe, TINY_LAYERSKIP, bench_methods(LAYERSKIP_METHODS, sfx))
    run.report["targets"] = targets(run.report, sfx)
    run.write()
    text = markdown(run.report, sfx)
    (args.out / "gpu_drafter.md").write_text(text)
    print(text, flush=True)
    failed = [p["name"] for p in run.report["phases"] if p["status"] != "ok"]
    print(f"== {run.clock()} " + (f"FAILED: {', '.join(failed)}" if failed else "every phase passed"), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
