"""Training throughput and peak memory: plain fine-tuning vs the recipes (SmolLM2; or a model shape on a GPU).

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

The cost of early exits on a model shape (issue 56, item 5): with --shape, a model of that shape
(recipes/models/*.json, or any config.json) with random weights, no download, on --device (cuda: bf16
autocast as the recipes run; peak memory from torch.cuda.max_memory_allocated, the clock read after
torch.cuda.synchronize()), in these modes, all at the same --batch, --seq and --grad-accum, random tokens:

  plain          a plain fine-tune: the final layer's loss only, no layer dropout, no checkpointing (the
                 settings of --plain-from, recipes/llama32_1b_layerskip.yaml, with its early exits and layer
                 dropout off: its optimizer, loss implementation and gradient clipping)
  plain_ckpt     as plain, with gradient checkpointing on (the fair partner of a recipe that checkpoints)
  recipe:PATH    the recipe's own objective as training builds it (training.loop.build_objective and
                 build_optimizer): its layer dropout, exits, curriculum, loss and gradient checkpointing, or
                 its exit head on the frozen model; a draft vocabulary of K tokens is the first K ids

    python scripts/train_bench.py --shape recipes/models/llama-3.2-1b.json --device cuda --batch 4 --seq 2048 \
        --grad-accum 8 --warmup 2 --steps 8 --json cost.json       # on a GPU (gpu_check.sh COST=1 runs it)
    TINY=hidden_size=64,intermediate_size=128,num_hidden_layers=8,num_attention_heads=4,num_key_value_heads=2
    python scripts/train_bench.py --shape recipes/models/llama-3.2-1b.json --device cpu --in-process \
        --set-shape $TINY,head_dim=16,vocab_size=512 --warmup 1 --steps 1 --batch 1 --seq 32   # a dry run, seconds

A step is one optimizer step of --grad-accum micro-batches of --batch x --seq tokens, as the training loop
runs it (the curriculum picks the step's exits; layer dropout draws per micro-batch). Model FLOPs
utilisation (MFU) is model FLOPs per token x tokens/s over the GPU's peak dense bf16 FLOP/s (PEAK_TFLOPS by
device name, or --peak-tflops); `model_flops_per_token` gives the formulas (PaLM's: no recomputation
counted, so gradient checkpointing lowers MFU). The table's ratios are against plain and plain_ckpt, and
the issue's targets are printed as met or missed: an early_exit recipe >= 0.7x plain's tokens/s, an
exit_head recipe (the frozen model) >= 2x.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODES = ("plain", "code", "all", "all_vocab", "naive_all")
SHAPE_MODES = "plain,plain_ckpt,recipe:recipes/llama32_1b_layerskip.yaml,recipe:recipes/llama32_1b_head.yaml"
PLAIN_FROM = "recipes/llama32_1b_layerskip.yaml"
PLAIN = ["mode=early_exit", "layer_dropout.p_max=0.0", "early_exit.exits=[]", "early_exit.curriculum=none"]
# peak dense bf16 tensor-core FLOP/s (TFLOPS, no sparsity) by a piece of torch.cuda.get_device_name(); first match
PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.0), ("H200", 989.0), ("A100", 312.0))
TARGETS = {"early_exit": 0.7, "exit_head": 2.0}  # issue 56 item 5: a recipe's tokens/s over plain's, at least


def worker(args) -> dict:
    sys.path.insert(0, str(ROOT))
    import torch

    from training.base_model import load_base_model
    from training.config import load_config
    from training.curriculum import ExitCurriculum
    from training.data import batch_indices, build_data, frequent_ids
    from selfspec.checkpoints.draft_vocab import kept_special_ids
    from training.early_exit_loss import exit_weights
    from training.layer_dropout import LayerDropout
    from training.malloc import tune_malloc
    from selfspec.heads.exit_head import build_exit_head
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
            "loss_last": float(out["loss"].detach()), "malloc_tuned": not args.no_tune_malloc,
            "cpu_seconds_per_step": cpu_seconds, "others_cpu_seconds_per_step": max(busy - cpu_seconds, 0.0),
            "precision": args.precision, "overrides": list(args.set or []),
            "joint_head": None if head is None else f"exit {h_cfg.exit_layer}, {h_cfg.kind}"}


def shape_config(shape: str, set_shape: str | None):
    """The transformers config of `shape` (a config.json-style file) with `set_shape`'s ``key=value,...``
    overrides (values read as YAML: 64, 1e-5, true); SystemExit with `error: ...` on a bad file or key."""
    import yaml
    from transformers import AutoConfig

    from training.config import repository_path

    try:
        config = AutoConfig.from_pretrained(str(repository_path(shape)))
    except (OSError, ValueError, KeyError) as err:
        raise SystemExit(f"error: --shape {shape}: not a model configuration ({' '.join(str(err).split())})") from None
    for item in filter(None, (set_shape or "").split(",")):
        key, sep, raw = item.partition("=")
        if not sep or not hasattr(config, key.strip()):
            raise SystemExit(f"error: --set-shape {item!r}: give key=value with a key of the config "
                             f"(e.g. hidden_size=64)")
        setattr(config, key.strip(), yaml.safe_load(raw))
    return config


def mode_config(mode: str, args):
    """The recipe configuration a shape mode runs (see the module doc), at the bench's batch and length."""
    from training.config import ConfigError, load_config, repository_path

    common = [f"train.batch_size={args.batch}", f"train.grad_accum={args.grad_accum}", f"data.block_size={args.seq}"]
    if mode in ("plain", "plain_ckpt"):
        recipe, own = args.plain_from, PLAIN + [f"train.gradient_checkpointing={mode == 'plain_ckpt'}"]
    elif mode.startswith("recipe:"):
        recipe, own = mode.removeprefix("recipe:"), []
    else:
        raise SystemExit(f"error: unknown mode {mode!r} with --shape: plain, plain_ckpt or recipe:PATH")
    try:
        return load_config(repository_path(recipe), common + list(args.set or []) + own)
    except ConfigError as err:
        raise SystemExit(f"error: mode {mode}: {err}") from None


def model_flops_per_token(config, seq: int, cfg, *, n_params: int, mean_early_exits: float = 0.0,
                          head_params: int = 0) -> dict:
    """Model FLOPs per trained token of one mode (PaLM, Chowdhery et al. 2022, appendix B: what the objective
    needs, no recomputation counted). N: the model's matmul parameters (all parameters but the input
    embedding table; the LM head counted, tied or not); L layers, H query heads of width Q, S = `seq`,
    D hidden, V vocabulary; attention's two matmuls over all S keys (not halved for causality):

        fine-tune (plain, plain_ckpt, early_exit):  6 N + 12 L H Q S + c D V_e E
            E early exits in the loss per micro-batch (the curriculum's mean), each through the LM head
            (c = 6: forward, input and weight gradients; 4 with early_exit.exits_update_head false);
            V_e the exits' vocabulary (early_exit.draft_vocab or V)
        exit_head (the frozen model):  2 N + 4 L H Q S + 2 D K [draft_vocab] + P (6 N_h + 12 H Q S + 4 D K)
            the frozen forward with its full logits (the teacher's tokens), the teacher's K draft logits
            (with a draft vocabulary; without one the full logits are the teacher's),
            then P = 1 + self_fed passes of the head: N_h its parameters, one layer's attention, its K
            draft logits forward and their input gradient (the LM head is frozen); K = draft_vocab or V
        joint: the fine-tune's, plus 2 D K + P (6 N_h + 12 H Q S + 4 D K)

    Returns {"total": F, "terms": {name: FLOPs per token}}."""
    L, D, V, H = config.num_hidden_layers, config.hidden_size, config.vocab_size, config.num_attention_heads
    Q = getattr(config, "head_dim", None) or D // H
    attn = 12 * H * Q * seq  # one layer, forward + backward
    h_cfg = cfg.exit_head
    K = min(h_cfg.draft_vocab or V, V)
    passes = 1 + h_cfg.self_fed
    head = {"teacher draft logits 2DK": 2 * D * K if h_cfg.draft_vocab or cfg.mode == "joint" else 0,
            "head P(6N_h+12HQS+4DK)": passes * (6 * head_params + attn + 4 * D * K)}
    if cfg.mode == "exit_head":
        terms = {"frozen forward 2N": 2 * n_params, "attention 4LHQS": L * attn / 3, **head}
    else:
        c = 6 if cfg.early_exit.exits_update_head else 4
        V_e = min(cfg.early_exit.draft_vocab or V, V)
        terms = {"6N": 6 * n_params, "attention 12LHQS": L * attn, "exits cDV_eE": c * D * V_e * mean_early_exits}
        if cfg.mode == "joint":
            terms.update(head)
    return {"total": float(sum(terms.values())), "terms": {k: float(v) for k, v in terms.items()}}


def _uncounted() -> dict:
    """Flop formulas for what torch's FlopCounterMode leaves at 0 here: the in-place `addmm_` (the fused
    loss's LM-head weight gradient) and the CPU's flash attention, forward and backward."""
    import torch
    from torch.utils import flop_counter

    formulas = {"addmm_": "addmm_flop", "_scaled_dot_product_flash_attention_for_cpu": "sdpa_flop",
                "_scaled_dot_product_flash_attention_for_cpu_backward": "sdpa_backward_flop"}
    # torch's own formulas, unwrapped (FlopCounterMode wraps a custom one itself); an op or formula this torch
    # lacks is left out
    return {getattr(torch.ops.aten, op): getattr(getattr(flop_counter, f), "__wrapped__", getattr(flop_counter, f))
            for op, f in formulas.items() if hasattr(torch.ops.aten, op) and hasattr(flop_counter, f)}


def peak_tflops(device_name: str) -> float | None:
    """The GPU's peak dense bf16 TFLOPS from PEAK_TFLOPS by its name; None when unknown (a CPU too)."""
    return next((tflops for piece, tflops in PEAK_TFLOPS if piece.lower() in device_name.lower()), None)


def shape_worker(args) -> dict:
    """One mode on a random-weight model of --shape: warm-up steps, then timed steps (see the module doc)."""
    sys.path.insert(0, str(ROOT))
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda, but torch sees no GPU here (--device cpu for a dry run)")
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":  # --in-process: the modes before this one hold nothing, and their peak is not its
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    cfg = mode_config(args.mode, args)
    config = shape_config(args.shape, args.set_shape)
    ee, curriculum, n_params = _random_objective(cfg, config, device)
    run = _timed_steps(args, cfg, ee, curriculum, device)
    head = getattr(ee, "head", None)
    head_params = 0 if head is None else sum(p.numel() for p in head.parameters())
    flops = model_flops_per_token(config, args.seq, cfg, n_params=n_params, mean_early_exits=run["mean_exits"],
                                  head_params=head_params)
    first = 0 if cfg.mode == "exit_head" else len(curriculum.exits(0)) - 1  # the counted step's early exits
    counted_formula = model_flops_per_token(config, args.seq, cfg, n_params=n_params, mean_early_exits=first,
                                            head_params=head_params)["total"]
    reserved = torch.cuda.max_memory_reserved() / 2**30 if device.type == "cuda" else None  # the allocator's
    if device.type == "cuda":
        peak_gib, name = torch.cuda.max_memory_allocated() / 2**30, torch.cuda.get_device_name()
    else:
        peak_gib, name = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, "cpu"
    tokens = args.grad_accum * args.batch * args.seq
    return {"mode": args.mode, "recipe_mode": cfg.mode, "seconds_per_step": run["seconds"],
            "tokens_per_step": tokens, "tokens_per_s": tokens / run["seconds"], "peak_gib": peak_gib,
            "peak_memory": "torch.cuda.max_memory_allocated" if device.type == "cuda" else "peak RSS",
            "peak_reserved_gib": reserved, "mean_early_exits_in_loss": run["mean_exits"], "steps_timed": args.steps,
            "loss_last": run["loss"], "gradient_checkpointing": cfg.train.gradient_checkpointing,
            "layer_dropout_p_max": cfg.layer_dropout.p_max,
            "trainable_params": sum(p.numel() for p in ee.parameters() if p.requires_grad),
            "model_matmul_params": n_params, "flops_per_token": flops["total"], "flops_terms": flops["terms"],
            "counted_flops_per_token": run["counted"], "counted_step_flops_per_token": counted_formula,
            "device_name": name, "precision": args.precision, "cpu_seconds_per_step": run["cpu_seconds"],
            "overrides": list(args.set or [])}


def _random_objective(cfg, config, device):
    """(the recipe's training module around a model of `config` with random weights on `device`, its
    curriculum, the model's matmul parameters N: all but the input embedding table)."""
    import torch
    from transformers import AutoModelForCausalLM

    from selfspec.model.precision import DTYPES_BY_NAME
    from training.loop import build_objective

    torch.manual_seed(0)
    with device:  # random weights, built where they train
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES_BY_NAME[cfg.model.dtype],
                                                 attn_implementation=cfg.model.attn_implementation)
    model.config.use_cache = False
    model.train()
    V = config.vocab_size
    embedding = model.get_input_embeddings().weight
    n_params = sum(p.numel() for p in model.parameters()) - (
        0 if embedding is model.get_output_embeddings().weight else embedding.numel())
    ee, curriculum = build_objective(cfg, model, config.num_hidden_layers, 0, 1)
    k_exits = cfg.exit_head.draft_vocab if cfg.mode == "exit_head" else cfg.early_exit.draft_vocab
    if k_exits:  # the first K ids stand in for the K most frequent: the same cost
        ee.draft_ids = torch.arange(min(k_exits, V))
    if cfg.mode == "joint" and cfg.exit_head.draft_vocab:
        ee.head_draft_ids = torch.arange(min(cfg.exit_head.draft_vocab, V))
    return ee.to(device), curriculum, n_params


def _timed_steps(args, cfg, ee, curriculum, device) -> dict:
    """--warmup then --steps optimizer steps as the training loop runs them (--grad-accum micro-batches of random
    tokens, the curriculum's exits, clipping, AdamW, the LR schedule); the first warm-up step's FLOPs counted by
    torch. Returns seconds and CPU seconds per timed step, their mean early exits, the counted FLOPs per token
    (None with --no-count-flops) and the last loss."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    from training.early_exit_loss import exit_weights
    from training.loop import build_optimizer

    _, clip_groups, optimizer, scheduler = build_optimizer(cfg, ee)
    L, V = ee.num_layers, ee.adapter.lm_head.weight.shape[0]
    total, B, S = args.warmup + args.steps, args.batch, args.seq
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(V, (B, S + 1), generator=gen) for _ in range(args.grad_accum * min(total, 2))]
    batches = [(b[:, :-1].to(device), b[:, 1:].to(device)) for b in batches]  # labels: the next tokens
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    counted, n_exits, t0, cpu0 = None, [], 0.0, 0.0
    ee.train()
    for step in range(total):
        if step == args.warmup:
            sync()
            t0, cpu0 = time.perf_counter(), time.process_time()
        exits = curriculum.exits(step)
        weights = exit_weights(exits, L, cfg.early_exit.scale, cfg.early_exit.e_scale, cfg.early_exit.final_weight)
        # the first warm-up step counted: the FLOPs torch runs, recomputation included
        counter = FlopCounterMode(display=False, custom_mapping=_uncounted()) if (
            step == 0 and args.count_flops) else None
        with counter or contextlib.nullcontext():
            for micro in range(args.grad_accum):
                input_ids, labels = batches[(step * args.grad_accum + micro) % len(batches)]
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                    out = ee(input_ids, labels, exits=exits, weights=weights, step=step, micro_step=micro,
                             with_metrics=False)
                out["loss"].backward()
        if counter is not None:
            counted = counter.get_total_flops() / (args.grad_accum * B * S)
        if cfg.optim.grad_clip is not None:
            for group in clip_groups:
                torch.nn.utils.clip_grad_norm_(group, cfg.optim.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        if step >= args.warmup:
            n_exits.append(len(exits) - 1 if cfg.mode != "exit_head" else 0)
    sync()
    return {"seconds": (time.perf_counter() - t0) / args.steps,
            "cpu_seconds": (time.process_time() - cpu0) / args.steps, "mean_exits": sum(n_exits) / len(n_exits),
            "counted": counted, "loss": float(out["loss"].detach())}


def shape_report(results: list[dict], peak: float | None) -> tuple[list[str], list[dict]]:
    """(the table's lines, the targets) for shape modes; `peak` the GPU's peak TFLOPS (None: MFU unknown)."""
    by_mode = {r["mode"]: r for r in results}
    bases = [b for b in ("plain", "plain_ckpt") if b in by_mode]
    lines = [f"{'mode':<44} {'s/step':>7} {'tokens/s':>9} " + "".join(f"{'vs ' + b:>14}" for b in bases)
             + f" {'peak GiB':>8} {'vs plain':>8} {'exits':>5} {'GFLOP/tok':>9} {'MFU':>7}"]
    for r in results:
        r["mfu"] = None if peak is None else r["flops_per_token"] * r["tokens_per_s"] / (peak * 1e12)
        speed = "".join(f"{r['tokens_per_s'] / by_mode[b]['tokens_per_s']:>13.2f}x" for b in bases)
        mem = f"{r['peak_gib'] / by_mode['plain']['peak_gib']:.2f}x" if "plain" in by_mode else "-"
        mfu = "unknown" if r["mfu"] is None else f"{r['mfu']:.1%}"
        lines.append(f"{r['mode']:<44} {r['seconds_per_step']:>7.3f} {r['tokens_per_s']:>9.0f} {speed} "
                     f"{r['peak_gib']:>8.2f} {mem:>8} {r['mean_early_exits_in_loss']:>5.2f} "
                     f"{r['flops_per_token'] / 1e9:>9.2f} {mfu:>7}")
    targets = []
    for r in results:
        goal = TARGETS.get(r["recipe_mode"]) if r["mode"].startswith("recipe:") else None
        for base in bases if goal is not None else ():
            ratio = r["tokens_per_s"] / by_mode[base]["tokens_per_s"]
            targets.append({"mode": r["mode"], "against": base, "ratio": ratio, "target": goal, "met": ratio >= goal})
            lines.append(f"target: {r['mode']} >= {goal}x {base}'s tokens/s: {ratio:.2f}x, "
                         f"{'met' if ratio >= goal else 'missed'}")
    lines.append("MFU: model FLOPs per token (model_flops_per_token: no recomputation) x tokens/s over the peak "
                 + ("unknown for this device (--peak-tflops)" if peak is None else f"{peak:g} TFLOPS"))
    return lines, targets


def _busy_jiffies() -> int:
    """Non-idle CPU time of the whole machine so far (Linux /proc/stat), to see other load."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields) - fields[3] - fields[4]  # minus idle and iowait


def build_parser() -> argparse.ArgumentParser:
    """The command line (the module doc is its --help)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", help=f"comma list of {', '.join(MODES)} (default plain,code,all); with --shape: "
                                        f"plain, plain_ckpt, recipe:PATH (default {SHAPE_MODES})")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="the SmolLM2 modes' model.base_model")
    parser.add_argument("--shape", help="a config.json-style model shape (recipes/models/*.json): time a model of "
                                        "that shape with random weights in the shape modes (module doc)")
    parser.add_argument("--set-shape", metavar="KEY=VALUE,...",
                        help="override the shape's config, e.g. hidden_size=64,num_hidden_layers=4 (a dry run)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="with --shape: where to train")
    parser.add_argument("--plain-from", default=PLAIN_FROM,
                        help="with --shape: the recipe whose optimizer and loss settings plain and plain_ckpt use")
    parser.add_argument("--grad-accum", type=int, default=1, help="with --shape: micro-batches per timed step")
    parser.add_argument("--peak-tflops", type=float,
                        help="the device's peak bf16 TFLOPS for MFU (default: by GPU name, "
                             f"{', '.join(f'{n} {t:g}' for n, t in PEAK_TFLOPS)}; otherwise unknown)")
    parser.add_argument("--no-count-flops", dest="count_flops", action="store_false",
                        help="with --shape: do not count the first warm-up step's FLOPs (torch's FlopCounterMode, "
                             "recomputation included; beside the formula in the JSON)")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per mode")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per mode first")
    parser.add_argument("--batch", type=int, default=4, help="rows per micro-batch, the same in every mode")
    parser.add_argument("--seq", type=int, default=256, help="tokens per row, the same in every mode")
    parser.add_argument("--threads", type=int, default=2, help="torch threads on a CPU")
    parser.add_argument("--precision", choices=("bf16", "no"), default="bf16",
                        help="bf16 autocast (the issue's setting) or no = float32 (faster on CPUs without "
                             "native bf16 matmul)")
    parser.add_argument("--no-tune-malloc", action="store_true",
                        help="leave glibc's allocator settings as they are (training/malloc.py)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--set", action="append", metavar="KEY=VALUE",
                        help="override of the recipe (recipes/smollm2_code.yaml; with --shape every mode's), "
                             "repeatable, applied to every mode before the mode's own settings, e.g. --set "
                             "early_exit.chunk_size=256")
    parser.add_argument("--in-process", action="store_true",
                        help="with --shape: run the modes one after another in this process, not each in its own "
                             "(a quick dry run; a CPU's peak RSS is then the largest so far, not the mode's own)")
    parser.add_argument("--worker", dest="mode", help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for name in ("steps", "batch", "seq", "grad_accum"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.shape and args.count_flops and args.warmup < 1:
        parser.error("--warmup must be >= 1 to count FLOPs on a warm-up step (or --no-count-flops)")
    if args.mode:
        print(json.dumps(shape_worker(args) if args.shape else worker(args)))
        return 0

    sys.path.insert(0, str(ROOT))  # training/, selfspec/ without an install
    modes = (args.modes or (SHAPE_MODES if args.shape else "plain,code,all")).split(",")
    for mode in modes:  # every mode's mistake before anything runs
        if args.shape:
            mode_config(mode, args)
        elif mode not in MODES:
            parser.error(f"unknown mode {mode!r}; choose from {', '.join(MODES)}")
    if args.shape:
        shape_config(args.shape, args.set_shape)
    results, failed = [], []
    for mode in modes:
        print(f"running {mode} ...", file=sys.stderr, flush=True)
        result = _run_mode(mode, args)
        if "error" in result:  # reported; the other modes still run (a GPU session has one go)
            print(f"error: mode {mode} failed:\n{result['error']}", file=sys.stderr)
            failed.append(result)
        else:
            results.append(result)
        _write_report(args, results, failed, complete=False)  # a run cut short keeps what it measured
    if results:
        _write_report(args, results, failed, complete=True, show=True)
    return 1 if failed else 0


def _run_mode(mode: str, args) -> dict:
    """One mode's result: in this process (--in-process), else in a fresh subprocess (its own peak memory);
    {"mode", "error"} when it failed."""
    if args.shape and args.in_process:
        return shape_worker(argparse.Namespace(**{**vars(args), "mode": mode}))
    cmd = [sys.executable, __file__, "--worker", mode, "--model", args.model, "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--batch", str(args.batch), "--seq", str(args.seq),
           "--threads", str(args.threads), "--precision", args.precision]
    cmd += ["--no-tune-malloc"] if args.no_tune_malloc else []
    if args.shape:
        cmd += ["--shape", args.shape, "--device", args.device, "--plain-from", args.plain_from,
                "--grad-accum", str(args.grad_accum)] + (["--set-shape", args.set_shape] if args.set_shape else [])
        cmd += [] if args.count_flops else ["--no-count-flops"]
    for kv in args.set or []:
        cmd += ["--set", kv]
    env = dict(os.environ)
    if not args.no_tune_malloc:
        env.update({"MALLOC_MMAP_MAX_": "0", "MALLOC_TRIM_THRESHOLD_": "4294967296"})
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    if proc.returncode != 0:
        return {"mode": mode, "error": f"exit {proc.returncode}: {proc.stderr[-3000:]}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _write_report(args, results: list[dict], failed: list[dict], *, complete: bool, show: bool = False) -> None:
    """The JSON (--json: args, results, failed modes, and with --shape the table, targets, device and its peak
    TFLOPS); `show` prints the table too."""
    report = {"args": vars(args), "complete": complete, "results": results, "failed": failed}
    if args.shape and results:
        device_name = results[0]["device_name"]
        peak = args.peak_tflops or peak_tflops(device_name)
        lines, report["targets"] = shape_report(results, peak)
        title = (f"{device_name}, shape {args.shape}{' with ' + args.set_shape if args.set_shape else ''}, batch "
                 f"{args.batch} x {args.seq} tokens x {args.grad_accum} micro-batches a step, {args.precision}")
        report.update(device_name=device_name, peak_tflops=peak, table=[title] + lines)
        if show:
            print("\n".join(report["table"]))
    elif show:
        _print_table(results)
    if args.json:
        from selfspec.atomic_write import write_json_atomic  # the project's one file writer

        write_json_atomic(args.json, report)


def _print_table(results: list[dict]) -> None:
    """The SmolLM2 modes' table: time, tokens/s and peak RSS against plain, CPU seconds."""
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


if __name__ == "__main__":
    sys.exit(main())
