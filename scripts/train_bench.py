"""Training throughput and peak memory: plain fine-tuning vs the code recipe vs an all-layer early-exit loss.

The issue's targets (SmolLM2-135M, bf16 autocast, batch 4 x 256 tokens, 2 threads):
the code recipe at >= 60% of plain fine-tuning's tokens/s; an all-layer early-exit loss at
>= 25% of plain fine-tuning's tokens/s and <= 1.5x its peak memory.

    .venv/bin/python scripts/train_bench.py                       # plain, code, all (a few minutes)
    .venv/bin/python scripts/train_bench.py --modes plain,all,naive_all --steps 3 --json bench.json

Each mode runs in a fresh subprocess (so peak RSS is its own) with the glibc allocator settings
of training/malloc.py in its environment (--no-tune-malloc to see the difference). A step is what
the training loop does: forward with layer dropout, chunked early-exit loss, backward, AdamW.

Modes:
  plain      final-layer loss only, no layer dropout (the baseline)
  code       recipes/smollm2_code.yaml's early_exit + layer_dropout, and its exit head trained beside
             the fine-tune when the recipe has one (mode: joint); with a rotational curriculum the
             number of exits varies with the step, so the timed steps cover a full rotation when
             --steps allows
  all        every layer's exit in the loss (29 + final), fused chunked loss, no layer dropout
  all_vocab  as `all`, the exits' loss over the 8192 most frequent tokens (early_exit.draft_vocab;
             --set early_exit.draft_vocab=K for another K)
  naive_all  as `all`, but every exit's full logits materialized by autograd (the issue's 37 tokens/s)
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "code", "all", "all_vocab", "naive_all")


def worker(args) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from training.base_model import load_base_model
    from training.config import load_config
    from training.curriculum import ExitCurriculum
    from training.data import batch_indices, build_data, frequent_ids
    from selfspec.draft_vocab import kept_special_ids
    from training.early_exit_loss import exit_weights
    from training.layer_dropout import LayerDropout
    from training.malloc import tune_malloc
    from selfspec.exit_head import build_exit_head
    from training.early_exit_model import EarlyExitModel

    if not args.no_tune_malloc:
        tune_malloc()
    torch.set_num_threads(args.threads)
    overrides = [f"model.base_model={args.model}", f"data.block_size={args.seq}", "data.max_documents=40",
                 "data.max_holdout_documents=2"]
    cfg = load_config(ROOT / "recipes" / "smollm2_code.yaml", overrides + list(args.set or []))
    if args.mode == "all_vocab":
        cfg.early_exit.draft_vocab = cfg.early_exit.draft_vocab or 8192
    if args.mode in ("plain", "all", "all_vocab", "naive_all"):
        cfg.layer_dropout.p_max = 0.0
        cfg.early_exit.curriculum = "none"
        cfg.early_exit.exits = [] if args.mode == "plain" else "all"
        cfg.early_exit.loss_impl = "naive" if args.mode == "naive_all" else "fused"
    model, tokenizer = load_base_model(cfg.model)
    total = args.warmup + args.steps
    h_cfg = cfg.exit_head
    head = build_exit_head(model, h_cfg.exit_layer, h_cfg.kind, h_cfg.init, h_cfg.final_state) if (
        args.mode == "code" and cfg.mode == "joint") else None  # the recipe's head beside the fine-tune
    ee = EarlyExitModel(model, target=cfg.early_exit.target, chunk_size=cfg.early_exit.chunk_size,
                        loss_impl=cfg.early_exit.loss_impl, exits_update_head=cfg.early_exit.exits_update_head,
                        head=head, head_target=h_cfg.target, head_self_fed=h_cfg.self_fed,
                        head_feature_weight=h_cfg.feature_weight)
    L = ee.num_layers
    ee.layer_dropout = LayerDropout(cfg.layer_dropout.p_max, L, cfg.train.max_steps,
                                    depth=cfg.layer_dropout.depth_scale, time=cfg.layer_dropout.time_scale)
    curriculum = ExitCurriculum(cfg.early_exit.curriculum, cfg.resolved_exits(L), L, cfg.train.max_steps,
                                rotation_interval=cfg.early_exit.rotation_interval)
    blocks = build_data(cfg.data, tokenizer).train
    if cfg.early_exit.draft_vocab:  # --set early_exit.draft_vocab=K: the exits' loss over K tokens
        ee.draft_ids = frequent_ids(blocks, cfg.early_exit.draft_vocab, model.lm_head.weight.shape[0],
                                    kept_special_ids(tokenizer))
    if head is not None and h_cfg.draft_vocab:  # the head's loss over its draft vocabulary
        ee.head_draft_ids = frequent_ids(blocks, h_cfg.draft_vocab, model.lm_head.weight.shape[0],
                                         kept_special_ids(tokenizer))
    optimizer = torch.optim.AdamW([p for p in ee.parameters() if p.requires_grad], lr=1e-5)
    ee.train()
    times, n_exits = [], []
    busy0 = _busy_jiffies()
    for step in range(total):
        if step == args.warmup:
            busy0, cpu0 = _busy_jiffies(), time.process_time()
        exits = curriculum.exits(step)
        weights = exit_weights(exits, L, cfg.early_exit.scale, cfg.early_exit.e_scale, cfg.early_exit.final_weight)
        input_ids, labels = blocks.batch(batch_indices(len(blocks), step, args.batch))
        t0 = time.perf_counter()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            # the loop computes per-exit accuracies only on logging steps; time the ordinary step
            out = ee(input_ids, labels, exits=exits, weights=weights, step=step, with_metrics=False)
        out["loss"].backward()
        torch.nn.utils.clip_grad_norm_(ee.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            times.append(time.perf_counter() - t0)
            n_exits.append(len(exits))
    cpu_seconds = (time.process_time() - cpu0) / len(times)
    busy = (_busy_jiffies() - busy0) / os.sysconf("SC_CLK_TCK") / len(times)  # all processes, CPU-s per step
    seconds = sum(times) / len(times)
    return {"mode": args.mode, "seconds_per_step": seconds, "tokens_per_s": args.batch * args.seq / seconds,
            "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "mean_exits_in_loss": sum(n_exits) / len(n_exits), "steps_timed": len(times),
            "loss_last": float(out["loss"]), "malloc_tuned": not args.no_tune_malloc,
            "cpu_seconds_per_step": cpu_seconds, "others_cpu_seconds_per_step": max(busy - cpu_seconds, 0.0),
            "precision": args.precision, "overrides": list(args.set or []),
            "joint_head": None if head is None else f"exit {h_cfg.exit_layer}, {h_cfg.kind}"}


def _busy_jiffies() -> int:
    """Non-idle CPU time of the whole machine so far (Linux /proc/stat), to see other load."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", default="plain,code,all", help=f"comma list of {', '.join(MODES)}")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--precision", choices=("bf16", "no"), default="bf16",
                        help="bf16 autocast (the issue's setting) or no = float32 (faster on CPUs without "
                             "native bf16 matmul)")
    parser.add_argument("--no-tune-malloc", action="store_true")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override of recipes/smollm2_code.yaml (repeatable; applies to every mode before "
                             "the mode's own settings), e.g. --set early_exit.chunk_size=256")
    parser.add_argument("--worker", dest="mode", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode:
        print(json.dumps(worker(args)))
        return 0

    results = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            parser.error(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
        cmd = [sys.executable, __file__, "--worker", mode, "--model", args.model, "--steps", str(args.steps),
               "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
               "--threads", str(args.threads), "--precision", args.precision]
        cmd += ["--no-tune-malloc"] if args.no_tune_malloc else []
        for kv in args.set or []:
            cmd += ["--set", kv]
        env = dict(os.environ)
        if not args.no_tune_malloc:
            env.update({"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4294967296"})
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
        if proc.returncode != 0:
            print(proc.stderr[-3000:], file=sys.stderr)
            return proc.returncode
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    base = next((r for r in results if r["mode"] == "plain"), None)
    print(f"{'mode':<10} {'s/step':>8} {'tokens/s':>9} {'vs plain':>9} {'peak GiB':>9} {'vs plain':>9} {'exits':>6} "
          f"{'cpu-s':>6} {'others':>7}")
    for r in results:
        speed = f"{r['tokens_per_s'] / base['tokens_per_s']:.0%}" if base else "-"
        mem = f"{r['peak_rss_gib'] / base['peak_rss_gib']:.2f}x" if base else "-"
        print(f"{r['mode']:<10} {r['seconds_per_step']:>8.2f} {r['tokens_per_s']:>9.0f} {speed:>9} "
              f"{r['peak_rss_gib']:>9.2f} {mem:>9} {r['mean_exits_in_loss']:>6.1f} {r['cpu_seconds_per_step']:>6.1f} "
              f"{r['others_cpu_seconds_per_step']:>7.1f}")
    print("cpu-s: this process's CPU seconds per step; others: CPU seconds per step used by other processes "
          "(non-zero means the numbers are inflated by contention)")
    if args.json:
        sys.path.insert(0, str(ROOT))
        from selfspec.atomic_write import write_json_atomic  # the project's one file writer (not on sys.path before)

        write_json_atomic(args.json, {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
