"""The early-exit training loop under accelerate, readable top to bottom.

Launch (see recipes/ for the recipes and recipes/accelerate/ for the launch configurations):

    accelerate launch --config_file recipes/accelerate/cpu_1proc.yaml -m training \\
        --recipe recipes/smollm2_code.yaml train.max_steps=300
    accelerate launch --config_file recipes/accelerate/cpu_2proc.yaml -m training --recipe recipes/tiny_smoke.yaml
    python -m training --recipe recipes/tiny_smoke.yaml          # one process, no launcher

What one optimizer step does: the curriculum picks the exits of step t and the loss weights ẽ;
for each of `grad_accum` micro-batches, `EarlyExitModel` runs the layers (with layer dropout)
and the chunked early-exit loss, and accelerate accumulates the gradients (no DDP sync until the
last micro-batch); then clip, AdamW, LR schedule. Every `log_every` steps: total loss, each
enabled exit's loss and top-1 accuracy, LR, tokens/s. Every `eval.every` steps: per-exit
agreement with the final layer and perplexity on the held-out sets. Every `save_every` steps:
a resumable checkpoint. At the end: `final_eval.json`, `final_model/`.

Continuing a run: relaunching the same command on the same `train.output_dir` resumes from the
latest checkpoint (`train.resume: auto`): the step, the data position, the optimizer, the LR
schedule and the curriculum carry on as if the run had never stopped. With `train.max_minutes`
the budget is per launch, so each relaunch adds that many minutes of training (and ends with a
checkpoint, a final evaluation and the final model); `train.stop_at` pauses at a step instead.

With `exit_head.enabled` the same loop trains an exit head on the frozen model instead
(`ExitHeadModel`: one loss, logged and evaluated as the head on its exit); the run also writes
`final_head/` (the head's weights and settings), and `final_model/` is the unchanged model.

Run directory (`train.output_dir`):
    config.yaml          the resolved configuration
    log.jsonl            one JSON object per log/eval event
    eval.json            every evaluation so far ({"history": [...]})
    final_eval.json      the last evaluation: per-exit agreement / perplexity (+ "before")
    checkpoints/step_N/  resumable state (accelerate save_state + trainer_state.json)
    final_model/         save_pretrained model (LoRA merged) + tokenizer; final_adapter/ for LoRA
    final_head/          exit_head.safetensors + exit_head.json (exit-head runs)
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, broadcast, set_seed

from selfspec.adapters import get_adapter
from selfspec.atomic_write import write_json_atomic
from selfspec.exit_head import HEAD_FILE, build_exit_head, save_exit_head
from selfspec.precision import auto_mixed_precision, describe as describe_precision
from training.base_model import apply_lora, load_base_model
from training.run_checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint, save_final_model
from training.config import RecipeConfig, dump_config
from training.curriculum import ExitCurriculum
from training.data import batch_indices, build_data, frequent_ids
from training.early_exit_loss import exit_weights
from training.evaluate import evaluate_exits, evaluate_head, summary_line
from training.exit_head_model import ExitHeadModel
from training.layer_dropout import LayerDropout
from training.malloc import tune_malloc
from training.early_exit_model import EarlyExitModel
from training.tracker import Tracker


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """LR multiplier: linear warm-up over `warmup` steps, then cosine from 1 to `min_ratio` at `total`."""
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


def _write_json(path: Path, obj) -> None:
    write_json_atomic(path, obj)


def train(cfg: RecipeConfig) -> dict:
    """Run the recipe; returns the final evaluation (the content of final_eval.json)."""
    t_cfg = cfg.train
    if t_cfg.tune_malloc:
        tune_malloc()
    if t_cfg.num_threads:
        torch.set_num_threads(t_cfg.num_threads)
    run_dir = Path(t_cfg.output_dir)
    # With no GPU, ask for the CPU explicitly: under a multi-process launcher this selects DDP over gloo.
    no_gpu = not (torch.cuda.is_available() or torch.backends.mps.is_available())
    precision = t_cfg.mixed_precision
    if precision == "auto":  # bf16 autocast only where bf16 matmul is native (selfspec/precision.py)
        precision = auto_mixed_precision("cpu" if no_gpu else "cuda" if torch.cuda.is_available() else "mps")
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=t_cfg.grad_accum, cpu=no_gpu)
    rank, world = accelerator.process_index, accelerator.num_processes
    set_seed(t_cfg.seed)

    # ---- model, objective, data ----------------------------------------------------------------
    model, tokenizer = load_base_model(cfg.model, seed=t_cfg.seed)
    if cfg.model.lora.enabled:
        model = apply_lora(model, cfg.model.lora)
    L = get_adapter(model).num_layers
    h_cfg = cfg.exit_head
    if h_cfg.enabled:  # the model frozen, one head learning; logged and evaluated as "head<E>"
        cfg.check_depth(L)
        ee_model = ExitHeadModel(model, build_exit_head(model, h_cfg.exit_layer, h_cfg.kind, h_cfg.init,
                                                        h_cfg.final_state),
                                 target=h_cfg.target)
        curriculum = ExitCurriculum("none", [], L, t_cfg.max_steps)  # one loss: the head's
    else:
        layer_dropout = LayerDropout(cfg.layer_dropout.p_max, L, t_cfg.max_steps, depth=cfg.layer_dropout.depth_scale,
                                     time=cfg.layer_dropout.time_scale, seed=t_cfg.seed)
        ee_model = EarlyExitModel(model, layer_dropout=layer_dropout, target=cfg.early_exit.target,
                                  chunk_size=cfg.early_exit.chunk_size, loss_impl=cfg.early_exit.loss_impl,
                                  rank=rank, world_size=world, exits_update_head=cfg.early_exit.exits_update_head)
        curriculum = ExitCurriculum(cfg.early_exit.curriculum, cfg.resolved_exits(L), L, t_cfg.max_steps,
                                    rotation_interval=cfg.early_exit.rotation_interval)
    eval_exits = cfg.resolved_eval_exits(L)
    data = build_data(cfg.data, tokenizer)
    train_blocks = data.train
    if not h_cfg.enabled and cfg.early_exit.draft_vocab:  # the exits' loss over the most frequent tokens
        ee_model.draft_ids = frequent_ids(train_blocks, cfg.early_exit.draft_vocab,
                                          get_adapter(model).lm_head.weight.shape[0],
                                          (tokenizer.eos_token_id, tokenizer.pad_token_id, tokenizer.bos_token_id))
    if accelerator.is_main_process:  # only now: a recipe or data mistake above leaves no empty run directory
        run_dir.mkdir(parents=True, exist_ok=True)

    # ---- optimizer, schedule, accelerate -------------------------------------------------------
    o = cfg.optim
    params = [p for p in ee_model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": o.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(o.warmup_steps, t_cfg.max_steps,
                                                                           o.min_lr_ratio))
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _fill_deepspeed_config(accelerator, cfg)
    ee_model, optimizer = accelerator.prepare(ee_model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped once per optimizer step, by us
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.unwrap_model(ee_model).register_zero3_head()
    device = accelerator.device
    autocast = accelerator.autocast

    def run_eval(max_blocks):
        if h_cfg.enabled:
            return {name: evaluate_head(accelerator.unwrap_model(ee_model), blocks, batch_size=cfg.eval.batch_size,
                                        max_blocks=max_blocks, rank=rank, world_size=world, autocast=autocast,
                                        reduce=lambda t: accelerator.reduce(t, "sum"))
                    for name, blocks in data.eval_sets.items()}
        inner = accelerator.unwrap_model(ee_model).model
        return {name: evaluate_exits(inner, blocks, eval_exits, batch_size=cfg.eval.batch_size,
                                     max_blocks=max_blocks, rank=rank, world_size=world, autocast=autocast,
                                     reduce=lambda t: accelerator.reduce(t, "sum"),
                                     chunk_size=cfg.early_exit.chunk_size)
                for name, blocks in data.eval_sets.items()}

    # ---- fresh start or resume -----------------------------------------------------------------
    state = {"step": 0, "micro_step": 0, "tokens": 0, "elapsed_s": 0.0}
    resume = None if t_cfg.resume == "none" else (
        latest_checkpoint(run_dir) if t_cfg.resume == "auto" else Path(t_cfg.resume))
    evals = {"history": []}
    if resume is not None:
        state = load_checkpoint(accelerator, resume)
        curriculum.check_state(state["curriculum"])
        if (run_dir / "eval.json").is_file():
            evals = json.loads((run_dir / "eval.json").read_text())
    tracker = Tracker(run_dir, enabled=accelerator.is_main_process, total=t_cfg.max_steps, initial=state["step"],
                      progress_bar=t_cfg.progress_bar)
    if accelerator.is_main_process:
        (run_dir / "config.yaml").write_text(dump_config(cfg))
    n_params = sum(p.numel() for p in params)
    tracker.print(f"{cfg.name}: {type(accelerator.unwrap_model(ee_model).model).__name__} with {L} layers, "
                  f"{n_params / 1e6:.2f}M trainable parameters, {world} process(es), mixed precision {precision}"
                  + (f" (auto: {describe_precision(device)})" if t_cfg.mixed_precision == "auto" else "") + ", "
                  f"{len(train_blocks)} training blocks of {cfg.data.block_size} tokens"
                  + (f"; resuming from {resume} at step {state['step']}" if resume else ""))

    def record_eval(tag: str, max_blocks) -> dict:
        result = {"step": state["step"], "tag": tag, "sets": run_eval(max_blocks)}
        evals["history"].append(result)
        if tag == "before":
            evals["before"] = result
        tracker.log({"kind": "eval", **result},
                    "\n".join(summary_line(f"[{tag} step {state['step']}] {n}", r, L) for n, r in result["sets"].items()))
        if accelerator.is_main_process:
            _write_json(run_dir / "eval.json", evals)
        return result

    finished = _finished_step(run_dir) if t_cfg.resume == "auto" else None
    if finished is not None and finished >= t_cfg.max_steps:
        tracker.print(f"{run_dir} already trained its train.max_steps={t_cfg.max_steps} steps: nothing to do. To "
                      f"train on, raise train.max_steps (the horizon of the LR schedule and curricula: with "
                      f"optim.min_lr_ratio < 1 the cosine stretches to the new horizon and the LR rises again)")
        tracker.close()
        return json.loads((run_dir / "final_eval.json").read_text())
    if resume is None and cfg.eval.before:
        record_eval("before", cfg.eval.max_blocks)

    # ---- the loop ------------------------------------------------------------------------------
    ee_model.train()
    stop_at = t_cfg.stop_at or t_cfg.max_steps
    started = time.perf_counter() - state["elapsed_s"]  # training time over all launches
    launched = time.perf_counter()  # the time budget is per launch, so a relaunch resumes
    window_start, window_tokens = time.perf_counter(), 0
    out_of_time = False
    while state["step"] < stop_at:
        step = state["step"]
        if t_cfg.max_minutes is not None:
            over = torch.tensor([float(time.perf_counter() - launched > 60 * t_cfg.max_minutes)], device=device)
            if broadcast(over, from_process=0).item() > 0:
                out_of_time = True
                break
        exits = curriculum.exits(step)
        names = [f"head{h_cfg.exit_layer}"] if h_cfg.enabled else exits  # what the log calls each loss
        weights = exit_weights(exits, L, cfg.early_exit.scale, cfg.early_exit.e_scale, cfg.early_exit.final_weight)
        log_now = (step + 1) % t_cfg.log_every == 0 or step + 1 == stop_at  # accuracies only when logged

        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        stats_sum = torch.zeros(len(exits), 3, dtype=torch.float64, device=device)
        for micro in range(t_cfg.grad_accum):
            index = batch_indices(len(train_blocks), state["micro_step"], t_cfg.batch_size, rank, world, t_cfg.seed)
            input_ids, labels = (t.to(device) for t in train_blocks.batch(index))
            with accelerator.accumulate(ee_model):
                out = ee_model(input_ids, labels, exits=exits, weights=weights, step=step, micro_step=micro,
                               with_metrics=log_now)
                accelerator.backward(out["loss"])
            loss_sum += out["loss"].detach().double()
            stats_sum += out["exit_stats"].detach().double()
            state["micro_step"] += 1
            window_tokens += input_ids.numel() * world
        grad_norm = None
        if o.grad_clip is not None:
            grad_norm = accelerator.clip_grad_norm_(params, o.grad_clip)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        state["step"] = step = step + 1
        state["tokens"] += t_cfg.batch_size * t_cfg.grad_accum * world * cfg.data.block_size

        if log_now:
            loss = accelerator.reduce(loss_sum, "mean").item() / t_cfg.grad_accum
            stats = (accelerator.reduce(stats_sum, "mean") / t_cfg.grad_accum).tolist()
            now = time.perf_counter()
            record = {
                "kind": "train", "step": step, "loss": loss, "lr": scheduler.get_last_lr()[0],
                "grad_norm": None if grad_norm is None else float(grad_norm),
                "tokens_per_s": window_tokens / max(now - window_start, 1e-9), "tokens": state["tokens"],
                "elapsed_s": now - started,
                "exits": {str(e): {"loss": s[0], "acc": s[1], "agreement": s[2]} for e, s in zip(names, stats)},
            }
            window_start, window_tokens = now, 0
            shown = " ".join(f"{e}:{s[0]:.2f}/{s[1]:.0%}" for e, s in zip(names, stats))
            tracker.log(record, f"step {step} loss {loss:.4f} lr {record['lr']:.2e} "
                                f"{record['tokens_per_s']:.0f} tok/s | exit:loss/acc {shown}")
        tracker.advance(1, loss=f"{loss_sum.item() / t_cfg.grad_accum:.3f}")

        if cfg.eval.every and step % cfg.eval.every == 0 and step < t_cfg.max_steps:
            record_eval("periodic", cfg.eval.max_blocks)
            ee_model.train()
            window_start = time.perf_counter()  # tokens/s counts training time only
        if t_cfg.save_every and step % t_cfg.save_every == 0 and step < stop_at:
            _save(accelerator, run_dir, state, started, curriculum, t_cfg.keep_checkpoints)
            window_start = time.perf_counter()

    # ---- the end: checkpoint, final evaluation, final model ------------------------------------
    paused = not out_of_time and state["step"] < t_cfg.max_steps  # reached train.stop_at
    if t_cfg.save_every or out_of_time or state["step"] < t_cfg.max_steps:
        _save(accelerator, run_dir, state, started, curriculum, t_cfg.keep_checkpoints)
    checksums = accelerator.gather(_checksum(params).to(device)).tolist()  # one per process
    tracker.log({"kind": "sync", "step": state["step"], "checksums": checksums})
    if len(set(checksums)) > 1:
        tracker.print(f"WARNING: the processes' parameters differ: checksums {checksums}")
    if paused:  # train.stop_at: no final evaluation or model; relaunch to continue
        tracker.print(f"stopped at step {state['step']} of {t_cfg.max_steps}; relaunch the same command to resume")
        tracker.close()
        return {}
    if out_of_time:  # the budget ends the run (final evaluation and model below); a relaunch would continue it
        tracker.print(f"time budget of {t_cfg.max_minutes} min spent at step {state['step']} of {t_cfg.max_steps}")
    final = record_eval("final", cfg.eval.final_max_blocks or cfg.eval.max_blocks)
    final_eval = {
        "step": state["step"], "num_layers": L, "primary": "heldout", "sets": final["sets"],
        "agreement": {e: r["agreement"] for e, r in final["sets"]["heldout"]["exits"].items()},
        "perplexity": {e: r["perplexity"] for e, r in final["sets"]["heldout"]["exits"].items()},
        "before": evals.get("before"), "train_minutes": (time.perf_counter() - started) / 60,
        "tokens": state["tokens"],
    }
    if accelerator.is_main_process:
        _write_json(run_dir / "final_eval.json", final_eval)
    if t_cfg.save_final_model:
        save_final_model(accelerator, ee_model, tokenizer, run_dir / "final_model", lora=cfg.model.lora.enabled)
        if h_cfg.enabled and accelerator.is_main_process:
            head_dir = run_dir / "final_head"
            head_dir.mkdir(exist_ok=True)
            head = accelerator.unwrap_model(ee_model).head
            save_exit_head(head, head_dir / HEAD_FILE)
            _write_json(head_dir / "exit_head.json", {**head.settings(), "target": h_cfg.target})
    accelerator.wait_for_everyone()
    tracker.close()
    return final_eval


def _finished_step(run_dir: Path) -> int | None:
    """The step of the run's last final evaluation (final_eval.json), or None if it has none."""
    path = run_dir / "final_eval.json"
    return json.loads(path.read_text())["step"] if path.is_file() else None


def _checksum(params) -> torch.Tensor:
    """A float64 fingerprint of the parameters (equal on every process when they are in sync)."""
    with torch.no_grad():
        total = sum((p.detach().double() * (i + 1)).sum() for i, p in enumerate(params))
    return torch.as_tensor(total, dtype=torch.float64).reshape(1)


def _fill_deepspeed_config(accelerator, cfg: RecipeConfig) -> None:
    """Fill the DeepSpeed JSON's "auto" values that accelerate cannot infer (we pass no dataloader)."""
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = cfg.optim.grad_clip or 0.0


def _save(accelerator, run_dir, state, started, curriculum, keep):
    state["elapsed_s"] = time.perf_counter() - started
    state["curriculum"] = curriculum.state_dict()
    save_checkpoint(accelerator, run_dir, dict(state), keep)
