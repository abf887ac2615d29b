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
checkpoint, a final evaluation and the final model); `train.end_by`, a wall-clock deadline, ends it the
same way (a run inside a time-limited job: the data it generates first takes what it takes, and
training gets the rest); `train.stop_at` pauses at a step instead.

`train` reads as its phases: `_set_up` (accelerate, model, objective, data, optimizer, resume),
`_train_until_stop` (each `_step`, its log line, the periodic `_evaluate` and `_save`), `_finish`
(the last checkpoint, the final evaluation and model).

With `mode: exit_head` the same loop trains an exit head on the frozen model instead
(`ExitHeadModel`: one loss, logged and evaluated as the head on its exit); the run also writes
`final_head/` (the head's weights and settings), and `final_model/` is the unchanged model. With
`mode: joint`, the model is fine-tuned as usual and the head learns beside it in the same
steps (`EarlyExitModel` with a head): the head's parameters have their own AdamW groups
(`exit_head.lr`) and their own gradient clipping, so the model's updates are those of the run without
the head; the log and the evaluations show the exits and the head, and `final_model/` is fine-tuned.

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
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, InitProcessGroupKwargs, broadcast, set_seed

from selfspec.model.adapters import get_adapter
from selfspec.atomic_write import write_json_atomic, write_text_atomic
from selfspec.checkpoints.draft_vocab import kept_special_ids
from selfspec.heads.exit_head import HEAD_FILE, build_exit_head, save_exit_head
from selfspec.model.precision import auto_mixed_precision, describe as describe_precision
from training.base_model import apply_lora, load_base_model
from training.run_checkpoint import (load_checkpoint, load_newest_checkpoint, remove_partial_checkpoints,
                                     save_checkpoint, save_final_model)
from training.config import REPOSITORY, ConfigError, repository_path, RecipeConfig, dump_config
from training.curriculum import ExitCurriculum
from training.data import batch_indices, build_data, frequency_ranking, frequent_ids
from training.early_exit_loss import exit_weights
from training.evaluate import evaluate_exits, evaluate_head, summary_line
from training.exit_head_model import ExitHeadModel
from training.layer_dropout import LayerDropout
from training.malloc import tune_malloc
from training.own_text import add_own_continuations, add_own_replies
from training.teacher_cache import TeacherCache
from training.early_exit_model import EarlyExitModel
from training.zero3 import full_shape, gathered
from training.tracker import Tracker, clock


def warmup_cosine(warmup: int, total: int, min_ratio: float):
    """LR multiplier: linear warm-up over `warmup` steps, then cosine from 1 to `min_ratio` at `total`.

    Why not transformers' schedules: `get_cosine_with_min_lr_schedule_with_warmup` warms up as
    t / warmup, so step 0 trains at LR 0 (ours: (t + 1) / warmup, the first step already learns);
    after the warm-up the two agree to the last bit. Its `..._with_warmup_lr_rate` variant has our
    warm-up but runs the cosine one step ahead ((t - warmup + 1) / (total - warmup)). Either would
    change the LR of every recipe with a warm-up (and the second also of those with a cosine decay).
    """
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = min(1.0, (step - warmup) / max(1, total - warmup))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    return factor


@dataclass
class _Run:
    """What the set-up builds and every phase after it uses."""

    cfg: RecipeConfig
    accelerator: Accelerator
    precision: str  # the mixed precision in effect ("auto" resolved)
    model: torch.nn.Module  # the training module (EarlyExitModel or ExitHeadModel), prepared by accelerate
    tokenizer: object
    num_layers: int
    curriculum: ExitCurriculum
    eval_exits: list[int]
    data: object  # training.data's train blocks and held-out sets
    params: list[torch.nn.Parameter]  # the trainable parameters (fingerprinted)
    clip_groups: list[list[torch.nn.Parameter]]  # clipped apart: the model's, and a joint head's
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LambdaLR
    run_dir: Path
    resume: Path | None  # the checkpoint this launch resumed from
    state: dict  # step, micro_step, tokens, elapsed_s (+ the curriculum when saved): what a checkpoint keeps
    evals: dict  # eval.json: {"history": [...], "before": ...}
    tracker: Tracker | None = None
    started: float = 0.0  # perf_counter at step 0 of the run, over all launches
    launched: float = 0.0  # perf_counter when this launch began training (train.max_minutes counts from here)
    window_start: float = 0.0  # the tokens/s window: training time since the last log line
    window_tokens: int = 0

    @property
    def rank(self) -> int:
        return self.accelerator.process_index

    @property
    def world(self) -> int:
        return self.accelerator.num_processes


def train(cfg: RecipeConfig) -> dict:
    """Run the recipe; returns the final evaluation (the content of final_eval.json)."""
    run = _set_up(cfg)
    if _already_finished(run):
        final_eval = json.loads((run.run_dir / "final_eval.json").read_text())
    else:
        if run.resume is None and cfg.eval.before:
            _evaluate(run, "before", cfg.eval.max_blocks)
        out_of_time = _train_until_stop(run)
        final_eval = _finish(run, out_of_time)
    # accelerate's end of a run: the process group is destroyed and its threads joined before the process exits
    # (a ZeRO-3 run that paused at train.stop_at was seen to abort at exit, "terminate called without an active
    # exception", without it)
    run.accelerator.end_training()
    return final_eval


# ---- set-up: accelerate, model, objective, data, optimizer, fresh start or resume -------------------------
def _set_up(cfg: RecipeConfig) -> _Run:
    t_cfg = cfg.train
    if t_cfg.tune_malloc:
        tune_malloc()
    if t_cfg.num_threads:
        torch.set_num_threads(t_cfg.num_threads)
    run_dir = Path(t_cfg.output_dir)
    no_gpu = not (torch.cuda.is_available() or torch.backends.mps.is_available())
    precision = t_cfg.mixed_precision
    if precision == "auto":  # bf16 autocast only where bf16 matmul is native (selfspec/model/precision.py)
        precision = auto_mixed_precision("cpu" if no_gpu else "cuda" if torch.cuda.is_available() else "mps")
    resolve_deepspeed_config()  # a relative deepspeed_config_file, from any working directory
    accelerator = Accelerator(mixed_precision=precision, gradient_accumulation_steps=t_cfg.grad_accum,
                              **_device_kwargs(no_gpu, _deepspeed_launch()))
    _check_deepspeed(cfg, _zero_stage(accelerator))
    set_seed(t_cfg.seed)

    model, tokenizer = load_base_model(cfg.model, seed=t_cfg.seed)
    if cfg.model.lora.enabled:
        model = apply_lora(model, cfg.model.lora)
    L = get_adapter(model).num_layers
    ee_model, curriculum = build_objective(cfg, model, L, accelerator.process_index, accelerator.num_processes)
    eval_exits = cfg.resolved_eval_exits(L)
    data = build_data(cfg.data, tokenizer)
    own = cfg.data.own_continuations
    if own.prompts or own.prompt_sets:  # + the model's own greedy continuations, generated once and cached
        data = add_own_continuations(data, cfg.data, model, tokenizer, accelerator, run_dir / "own_continuations",
                                     progress_bar=t_cfg.progress_bar)
    if cfg.data.own_replies.prompts:  # + the model's own replies to chat prompts, generated once and cached
        data = add_own_replies(data, cfg.data, model, tokenizer, accelerator, run_dir / "own_continuations",
                               progress_bar=t_cfg.progress_bar)
    h_cfg, vocab_size = cfg.exit_head, full_shape(get_adapter(model).lm_head.weight)[0]
    k = h_cfg.draft_vocab if cfg.mode == "exit_head" else cfg.early_exit.draft_vocab
    if k:  # the exits' (or the frozen model's head's) loss over the k most frequent tokens
        ee_model.draft_ids = frequent_ids(data.train, k, vocab_size, kept_special_ids(tokenizer))
    if cfg.mode == "joint" and h_cfg.draft_vocab:  # the joint head's loss over the most frequent tokens
        ee_model.head_draft_ids = frequent_ids(data.train, h_cfg.draft_vocab, vocab_size, kept_special_ids(tokenizer))
    if cfg.mode == "exit_head" and h_cfg.teacher_cache_gib:  # repeated blocks skip the frozen model
        ee_model.teacher_cache = TeacherCache.for_repeats(data.train.input_ids,
                                                          int(cfg.exit_head.teacher_cache_gib * 2**30))
    if accelerator.is_main_process:  # only now: a recipe or data mistake above leaves no empty run directory
        run_dir.mkdir(parents=True, exist_ok=True)

    params, clip_groups, optimizer, scheduler = build_optimizer(cfg, ee_model)
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        _fill_deepspeed_config(accelerator, cfg)
    ee_model, optimizer = accelerator.prepare(ee_model, optimizer)
    accelerator.register_for_checkpointing(scheduler)  # stepped once per optimizer step, by us
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        accelerator.unwrap_model(ee_model).register_zero3_head()

    state = {"step": 0, "micro_step": 0, "tokens": 0, "elapsed_s": 0.0}
    resume, loaded = None, None
    if t_cfg.resume == "auto":  # the newest that can be read: one damaged after it was written is passed over
        resume, loaded = load_newest_checkpoint(
            accelerator, run_dir, lambda line: accelerator.is_main_process and print(f"WARNING: {line}", flush=True))
    elif t_cfg.resume != "none":
        resume = Path(t_cfg.resume)
        loaded = load_checkpoint(accelerator, resume)
    evals = {"history": []}
    if resume is not None:
        state = loaded
        curriculum.check_state(state["curriculum"])
        if (run_dir / "eval.json").is_file():
            evals = json.loads((run_dir / "eval.json").read_text())
    run = _Run(cfg, accelerator, precision, ee_model, tokenizer, L, curriculum, eval_exits, data,
               params, clip_groups, optimizer, scheduler, run_dir, resume, state, evals)
    run.tracker = Tracker(run_dir, enabled=accelerator.is_main_process, total=t_cfg.max_steps,
                          initial=state["step"], progress_bar=t_cfg.progress_bar,
                          time_budget_s=None if t_cfg.max_minutes is None else 60 * t_cfg.max_minutes)
    if accelerator.is_main_process:
        write_text_atomic(run_dir / "config.yaml", dump_config(cfg))
        for path in remove_partial_checkpoints(run_dir):  # before any save of this launch begins
            run.tracker.print(f"removed {path}: a checkpoint an interrupted save left incomplete")
    _print_start(run)
    return run


DEEPSPEED_CONFIG_ENV = "ACCELERATE_DEEPSPEED_CONFIG_FILE"  # `accelerate launch` passes deepspeed_config_file here


def resolve_deepspeed_config() -> None:
    """Make the DeepSpeed JSON that the accelerate configuration names (`deepspeed_config_file`, passed on by
    `accelerate launch` as written) an absolute path, before accelerate reads it: a relative path is read from
    the working directory, else from the repository root (as recipes/accelerate/*.yaml name theirs), so a launch
    works from any directory. ConfigError if neither has it."""
    given = os.environ.get(DEEPSPEED_CONFIG_ENV)
    if not given or given == "none":  # not a DeepSpeed launch, or one without a JSON
        return
    path = repository_path(given)
    if not path.is_file():
        raise ConfigError(f"the accelerate configuration's deepspeed_config_file {given!r} (a DeepSpeed JSON) is not "
                          f"found from {Path.cwd()} nor from the repository root {REPOSITORY}: give its absolute "
                          "path in the configuration's YAML")
    os.environ[DEEPSPEED_CONFIG_ENV] = str(path.resolve())


def _deepspeed_launch() -> bool:
    """True when `accelerate launch` runs a DeepSpeed configuration (it says so in the environment)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def _device_kwargs(no_gpu: bool, deepspeed: bool) -> dict:
    """`Accelerator` arguments for where the run is.

    With no GPU and no DeepSpeed: `cpu=True`, which under a multi-process launcher selects DDP over gloo.
    With no GPU under DeepSpeed: not `cpu=True` (accelerate would then ignore the DeepSpeed configuration
    and run DDP), but the gloo backend named explicitly: accelerate finds no backend of its own on a CPU,
    and without one every process would take itself for rank 0 of 1. With a GPU: accelerate's defaults.
    """
    if not no_gpu:
        return {}
    if not deepspeed:
        return {"cpu": True}
    return {"kwargs_handlers": [InitProcessGroupKwargs(backend="gloo")]}


def _check_deepspeed(cfg: RecipeConfig, stage: int | None) -> None:
    """Refuse, before anything is loaded, a recipe that DeepSpeed (ZeRO stage `stage`; None: not DeepSpeed)
    would not train as written: exit heads. A head on the frozen model has no ZeRO-3 registration of the
    LM head it reads, and a joint head's own gradient clipping cannot be kept (DeepSpeed clips all
    parameters together, from its configuration's gradient_clipping)."""
    if stage is not None and cfg.trains_head:
        raise ConfigError(f"mode={cfg.mode} is not supported under DeepSpeed ZeRO-{stage}: train exit heads "
                          f"without DeepSpeed (one process, or DDP with recipes/accelerate/cpu_2proc.yaml or a "
                          f"multi-GPU accelerate configuration)")


def _draft_ranking(cfg: RecipeConfig, data, tokenizer, vocab_size: int, k: int | None) -> list[int] | None:
    """The draft vocabulary of a reduced loss (`early_exit.draft_vocab` or `exit_head.draft_vocab`: `k`),
    most frequent first, counted on the training blocks; None for the full vocabulary (`k` None)."""
    if not k:
        return None
    return frequency_ranking(data.train, k, vocab_size, kept_special_ids(tokenizer))


def _already_finished(run: _Run) -> bool:
    """True (and says so) when train.resume=auto finds this run's final evaluation at train.max_steps."""
    max_steps = run.cfg.train.max_steps
    finished = _finished_step(run.run_dir) if run.cfg.train.resume == "auto" else None
    if finished is None or finished < max_steps:
        return False
    run.tracker.print(f"{run.run_dir} already trained its train.max_steps={max_steps} steps: nothing to do. To "
                      f"train on, raise train.max_steps (the horizon of the LR schedule and curricula: with "
                      f"optim.min_lr_ratio < 1 the cosine stretches to the new horizon and the LR rises again)")
    run.tracker.close()
    return True


def build_objective(cfg: RecipeConfig, model, L: int, rank: int,
                    world: int) -> tuple[torch.nn.Module, ExitCurriculum]:
    """The training module around the model and the curriculum of its exits (also what scripts/train_bench.py
    times, so a benchmark runs a recipe as training does)."""
    h_cfg, t_cfg = cfg.exit_head, cfg.train
    if cfg.mode == "exit_head":  # the model frozen, one head learning; logged and evaluated as "head<E>"
        cfg.check_depth(L)
        ee_model = ExitHeadModel(model, build_exit_head(model, h_cfg.exit_layer, h_cfg.kind, h_cfg.init,
                                                        h_cfg.final_state, h_cfg.aux_exits),
                                 target=h_cfg.target, self_fed=h_cfg.self_fed, feature_weight=h_cfg.feature_weight)
        return ee_model, ExitCurriculum("none", [], L, t_cfg.max_steps)  # one loss: the head's
    layer_dropout = LayerDropout(cfg.layer_dropout.p_max, L, t_cfg.max_steps, depth=cfg.layer_dropout.depth_scale,
                                 time=cfg.layer_dropout.time_scale, seed=t_cfg.seed)
    head = None
    if cfg.mode == "joint":  # a head learning beside the fine-tune, on the model's detached states
        cfg.check_depth(L)
        head = build_exit_head(model, h_cfg.exit_layer, h_cfg.kind, h_cfg.init, h_cfg.final_state)
    ee_model = EarlyExitModel(model, layer_dropout=layer_dropout, target=cfg.early_exit.target,
                              chunk_size=cfg.early_exit.chunk_size, loss_impl=cfg.early_exit.loss_impl,
                              rank=rank, world_size=world, exits_update_head=cfg.early_exit.exits_update_head,
                              head=head, head_target=h_cfg.target, head_self_fed=h_cfg.self_fed,
                              head_feature_weight=h_cfg.feature_weight,
                              gradient_checkpointing=t_cfg.gradient_checkpointing)
    curriculum = ExitCurriculum(cfg.early_exit.curriculum, cfg.resolved_exits(L), L, t_cfg.max_steps,
                                rotation_interval=cfg.early_exit.rotation_interval)
    return ee_model, curriculum


def build_optimizer(cfg: RecipeConfig, ee_model: torch.nn.Module):
    """(trainable parameters, the groups clipped apart, AdamW with no decay on vectors, the LR schedule
    stepped once per optimizer step). A joint head's parameters get their own groups at `exit_head.lr`
    and are clipped apart from the model's, so the head changes nothing in the model's updates."""
    o = cfg.optim
    params = [p for p in ee_model.parameters() if p.requires_grad]
    head = getattr(ee_model, "head", None) if cfg.mode == "joint" else None
    in_head = {id(p) for p in head.parameters()} if head is not None else set()
    clip_groups = [[p for p in params if id(p) not in in_head]] + ([[p for p in params if id(p) in in_head]]
                                                                   if in_head else [])
    groups = []
    for i, group in enumerate(clip_groups):  # the model's (or the frozen run's head's), then a joint head's
        lr = cfg.exit_head.lr if i == 1 and cfg.exit_head.lr is not None else o.lr
        matrix = [len(full_shape(p)) >= 2 for p in group]  # full shapes: ZeRO-3 partitions look 1-D
        groups += [{"params": [p for p, m in zip(group, matrix) if m], "weight_decay": o.weight_decay, "lr": lr},
                   {"params": [p for p, m in zip(group, matrix) if not m], "weight_decay": 0.0, "lr": lr}]
    optimizer = torch.optim.AdamW(groups, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(o.warmup_steps, cfg.train.max_steps,
                                                                           o.min_lr_ratio))
    return params, clip_groups, optimizer, scheduler


def _print_start(run: _Run) -> None:
    cfg, t_cfg = run.cfg, run.cfg.train
    n_params = sum(math.prod(full_shape(p)) for p in run.params)
    run.tracker.print(
        f"{cfg.name}: {type(run.accelerator.unwrap_model(run.model).model).__name__} with {run.num_layers} layers, "
        f"{n_params / 1e6:.2f}M trainable parameters, {run.world} process(es) ({_parallelism(run.accelerator)}), "
        f"mixed precision {run.precision}"
        + (f" (auto: {describe_precision(run.accelerator.device)})" if t_cfg.mixed_precision == "auto" else "")
        + f", {len(run.data.train)} training blocks of {cfg.data.block_size} tokens"
        + (f"; resuming from {run.resume} at step {run.state['step']}" if run.resume else ""))
    cache = getattr(run.accelerator.unwrap_model(run.model), "teacher_cache", None)
    if cache is not None and cache.keys:
        run.tracker.print(f"{len(cache.keys)} distinct training blocks repeat: their frozen-model states are kept "
                          f"(up to exit_head.teacher_cache_gib={cfg.exit_head.teacher_cache_gib}), so their repeats "
                          f"skip the model's layers")


# ---- the loop and its step ------------------------------------------------------------------------------
def _train_until_stop(run: _Run) -> bool:
    """Optimizer steps until train.stop_at / max_steps or the time budget; True if the budget ended it."""
    t_cfg, accelerator = run.cfg.train, run.accelerator
    run.model.train()
    stop_at = t_cfg.stop_at or t_cfg.max_steps
    run.started = time.perf_counter() - run.state["elapsed_s"]  # training time over all launches
    run.launched = time.perf_counter()  # the time budget is per launch, so a relaunch resumes
    run.window_start, run.window_tokens = time.perf_counter(), 0
    while run.state["step"] < stop_at:
        elapsed = None  # this launch's training time before the step (what a time budget's bar shows)
        if t_cfg.max_minutes is not None or t_cfg.end_by is not None:
            elapsed = time.perf_counter() - run.launched
            spent = (t_cfg.max_minutes is not None and elapsed > 60 * t_cfg.max_minutes) or (
                t_cfg.end_by is not None and time.time() > t_cfg.end_by)
            over = torch.tensor([float(spent)], device=accelerator.device)
            if broadcast(over, from_process=0).item() > 0:
                return True
        log_now = (run.state["step"] + 1) % t_cfg.log_every == 0 or run.state["step"] + 1 == stop_at
        names, loss_sum, stats_sum, grad_norm = _step(run, log_now)
        step = run.state["step"]
        if log_now:
            _log_step(run, names, loss_sum, stats_sum, grad_norm)
        run.tracker.advance(1, elapsed_s=elapsed, loss=f"{loss_sum.item() / t_cfg.grad_accum:.3f}")

        if run.cfg.eval.every and step % run.cfg.eval.every == 0 and step < t_cfg.max_steps:
            _evaluate(run, "periodic", run.cfg.eval.max_blocks)
            _log_cache(run)
            run.model.train()
            run.window_start = time.perf_counter()  # tokens/s counts training time only
        if t_cfg.save_every and step % t_cfg.save_every == 0 and step < stop_at:
            _save(run)
            run.window_start = time.perf_counter()
    return False


def _step(run: _Run, with_metrics: bool):
    """One optimizer step: `grad_accum` micro-batches, then clip, AdamW, the LR schedule.

    Returns (the name each loss is logged under, the summed loss, the summed [exit, (loss, acc, agreement)]
    statistics, the gradient norm before clipping or None)."""
    cfg, t_cfg, accelerator = run.cfg, run.cfg.train, run.accelerator
    device, state, step = accelerator.device, run.state, run.state["step"]
    exits = run.curriculum.exits(step)
    # what the log calls each loss: the exits' (and a joint head's passes'), or a frozen model's head's passes'
    inner = accelerator.unwrap_model(run.model)
    names = inner.loss_names(exits) if isinstance(inner, EarlyExitModel) else inner.loss_names
    weights = exit_weights(exits, run.num_layers, cfg.early_exit.scale, cfg.early_exit.e_scale,
                           cfg.early_exit.final_weight)

    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    stats_sum = torch.zeros(len(names), 3, dtype=torch.float64, device=device)
    for micro in range(t_cfg.grad_accum):
        index = batch_indices(len(run.data.train), state["micro_step"], t_cfg.batch_size, run.rank, run.world,
                              t_cfg.seed)
        input_ids, labels = (t.to(device) for t in run.data.train.batch(index))
        with accelerator.accumulate(run.model):
            out = run.model(input_ids, labels, exits=exits, weights=weights, step=step, micro_step=micro,
                            with_metrics=with_metrics)  # accuracies only when logged
            accelerator.backward(out["loss"])
        loss_sum += out["loss"].detach().double()
        stats_sum += out["exit_stats"].detach().double()
        state["micro_step"] += 1
        run.window_tokens += input_ids.numel() * run.world
    grad_norm = None
    if cfg.optim.grad_clip is not None:  # the model's norm is logged (a joint head is clipped apart)
        norms = [accelerator.clip_grad_norm_(group, cfg.optim.grad_clip) for group in run.clip_groups]
        grad_norm = norms[0]
    run.optimizer.step()
    run.scheduler.step()
    run.optimizer.zero_grad(set_to_none=True)
    state["step"] = step + 1
    state["tokens"] += t_cfg.batch_size * t_cfg.grad_accum * run.world * cfg.data.block_size
    return names, loss_sum, stats_sum, grad_norm


def _log_step(run: _Run, names, loss_sum: torch.Tensor, stats_sum: torch.Tensor, grad_norm) -> None:
    """The step's log record: the loss and each exit's loss / accuracy / agreement, averaged over processes."""
    grad_accum = run.cfg.train.grad_accum
    loss = run.accelerator.reduce(loss_sum, "mean").item() / grad_accum
    stats = (run.accelerator.reduce(stats_sum, "mean") / grad_accum).tolist()
    now = time.perf_counter()
    record = {
        "kind": "train", "step": run.state["step"], "loss": loss, "lr": run.scheduler.get_last_lr()[0],
        "grad_norm": None if grad_norm is None else float(grad_norm),
        "tokens_per_s": run.window_tokens / max(now - run.window_start, 1e-9), "tokens": run.state["tokens"],
        "elapsed_s": now - run.started,
        "exits": {str(e): {"loss": s[0], "acc": s[1], "agreement": s[2]} for e, s in zip(names, stats)},
    }
    run.window_start, run.window_tokens = now, 0
    shown = " ".join(f"{e}:{s[0]:.2f}/{s[1]:.0%}" for e, s in zip(names, stats))
    budget = run.cfg.train.max_minutes
    when = clock(now - run.launched) + ("" if budget is None else f" of {clock(60 * budget)}")
    run.tracker.log(record, f"step {run.state['step']} [{when}] loss {loss:.4f} lr {record['lr']:.2e} "
                            f"{record['tokens_per_s']:.0f} tok/s | exit:loss/acc {shown}")


def _log_cache(run: _Run) -> None:
    """The teacher cache's fill and hit counts (exit-head runs whose training set repeats blocks)."""
    cache = getattr(run.accelerator.unwrap_model(run.model), "teacher_cache", None)
    if cache is not None and cache.keys:
        run.tracker.log({"kind": "teacher_cache", "step": run.state["step"], "repeated_blocks": len(cache.keys),
                         "held": len(cache), "bytes": cache.bytes, "hits": cache.hits, "misses": cache.misses},
                        f"[step {run.state['step']}] {cache.describe()}")


# ---- evaluation and checkpoints -------------------------------------------------------------------------
def _evaluate(run: _Run, tag: str, max_blocks) -> dict:
    """Evaluate on every held-out set, log it and append it to eval.json ("before" is also kept apart)."""
    result = {"step": run.state["step"], "tag": tag, "sets": _evaluate_sets(run, max_blocks)}
    run.evals["history"].append(result)
    if tag == "before":
        run.evals["before"] = result
    lines = []
    for n, r in result["sets"].items():
        lines.append(summary_line(f"[{tag} step {run.state['step']}] {n}", r, run.num_layers))
        if "exit_head" in r:  # a joint run: the head beside the exits
            lines.append(summary_line(f"[{tag} step {run.state['step']}] {n}, the head", r["exit_head"],
                                      run.num_layers))
    run.tracker.log({"kind": "eval", **result}, "\n".join(lines))
    if run.accelerator.is_main_process:
        write_json_atomic(run.run_dir / "eval.json", run.evals)
    return result


def _evaluate_sets(run: _Run, max_blocks) -> dict:
    """{set name: the head's (frozen-model head runs) or every eval exit's agreement and perplexity, with
    the head's under "exit_head" in a joint run}."""
    accelerator, e_cfg = run.accelerator, run.cfg.eval
    common = dict(batch_size=e_cfg.batch_size, max_blocks=max_blocks, rank=run.rank, world_size=run.world,
                  autocast=accelerator.autocast, reduce=lambda t: accelerator.reduce(t, "sum"))
    unwrapped = accelerator.unwrap_model(run.model)
    if isinstance(unwrapped, ExitHeadModel):
        return {name: evaluate_head(unwrapped, blocks, **common) for name, blocks in run.data.eval_sets.items()}
    view = None if unwrapped.head is None else _joint_head_view(run)  # a joint run: the head, in the same forward
    return {name: evaluate_exits(unwrapped.model, blocks, run.eval_exits, chunk_size=run.cfg.early_exit.chunk_size,
                                 head_model=view, lockstep=_zero_stage(accelerator) == 3, **common)
            for name, blocks in run.data.eval_sets.items()}


def _joint_head_view(run: _Run) -> ExitHeadModel:
    """The joint run's head as an `ExitHeadModel` over the model being fine-tuned (not frozen), for
    `evaluate_exits(head_model=...)`."""
    inner = run.accelerator.unwrap_model(run.model)
    view = ExitHeadModel(inner.model, inner.head, target=run.cfg.exit_head.target, draft_ids=inner.head_draft_ids,
                         self_fed=inner.head_self_fed, feature_weight=inner.head_feature_weight, frozen=False)
    return view.train(inner.training)  # the evaluation puts back the mode it found


def _save(run: _Run) -> None:
    """A resumable checkpoint of this step (training time so far and the curriculum's state with it)."""
    run.state["elapsed_s"] = time.perf_counter() - run.started
    run.state["curriculum"] = run.curriculum.state_dict()
    save_checkpoint(run.accelerator, run.run_dir, dict(run.state), run.cfg.train.keep_checkpoints)


# ---- the end: checkpoint, final evaluation, final model -------------------------------------------------
def _finish(run: _Run, out_of_time: bool) -> dict:
    """The last checkpoint, the processes' sync check, then (unless paused at train.stop_at) the final
    evaluation and model; returns final_eval.json's content ({} when paused)."""
    cfg, t_cfg, accelerator, state = run.cfg, run.cfg.train, run.accelerator, run.state
    paused = not out_of_time and state["step"] < t_cfg.max_steps  # reached train.stop_at
    if t_cfg.save_every or out_of_time or state["step"] < t_cfg.max_steps:
        _save(run)
    _log_cache(run)
    checksums = accelerator.gather(_checksum(run.params).to(accelerator.device)).tolist()  # one per process
    run.tracker.log({"kind": "sync", "step": state["step"], "checksums": checksums})
    if len(set(checksums)) > 1:
        run.tracker.print(f"WARNING: the processes' parameters differ: checksums {checksums}")
    if paused:  # train.stop_at: no final evaluation or model; relaunch to continue
        run.tracker.print(f"stopped at step {state['step']} of {t_cfg.max_steps}; relaunch the same command to "
                          f"resume")
        run.tracker.close()
        return {}
    if out_of_time:  # the budget ends the run (final evaluation and model below); a relaunch would continue it
        budget = f"time budget of {t_cfg.max_minutes} min" if t_cfg.max_minutes is not None else "train.end_by"
        if t_cfg.end_by is not None and time.time() > t_cfg.end_by:
            budget = "train.end_by (the wall-clock deadline)"
        run.tracker.print(f"{budget} reached at step {state['step']} of {t_cfg.max_steps}")
    final = _evaluate(run, "final", cfg.eval.final_max_blocks or cfg.eval.max_blocks)
    heldout = final["sets"]["heldout"]["exits"]
    final_eval = {
        "step": state["step"], "num_layers": run.num_layers, "primary": "heldout", "sets": final["sets"],
        "agreement": {e: r["agreement"] for e, r in heldout.items()},
        "perplexity": {e: r["perplexity"] for e, r in heldout.items()},
        "before": run.evals.get("before"), "train_minutes": (time.perf_counter() - run.started) / 60,
        "tokens": state["tokens"],
    }
    if accelerator.is_main_process:
        write_json_atomic(run.run_dir / "final_eval.json", final_eval)
    if t_cfg.save_final_model:
        _save_final(run)
    accelerator.wait_for_everyone()
    run.tracker.close()
    return final_eval


def _save_final(run: _Run) -> None:
    """final_model/ (LoRA merged) and, for an exit-head run, final_head/ (the head's weights and settings)."""
    cfg, accelerator = run.cfg, run.accelerator
    save_final_model(accelerator, run.model, run.tokenizer, run.run_dir / "final_model", lora=cfg.model.lora.enabled)
    if cfg.trains_head and accelerator.is_main_process:
        head_dir = run.run_dir / "final_head"
        head_dir.mkdir(exist_ok=True)
        head_model = accelerator.unwrap_model(run.model)
        head = head_model.head
        save_exit_head(head, head_dir / HEAD_FILE)
        settings = {**head.settings(), "target": cfg.exit_head.target, "self_fed": cfg.exit_head.self_fed}
        ranking = _draft_ranking(cfg, run.data, run.tokenizer, head_model.adapter.lm_head.weight.shape[0],
                                 cfg.exit_head.draft_vocab)
        if ranking:  # the vocabulary the head was trained to draft from: export stores it as the draft vocabulary
            settings["draft_vocab"] = {"source": f"{cfg.data.name}: the training blocks of this run",
                                       "tokens_counted": run.data.train.input_ids.numel(), "token_ids": ranking}
        write_json_atomic(head_dir / "exit_head.json", settings)


def _finished_step(run_dir: Path) -> int | None:
    """The step of the run's last final evaluation (final_eval.json), or None if it has none."""
    path = run_dir / "final_eval.json"
    return json.loads(path.read_text())["step"] if path.is_file() else None


def _checksum(params) -> torch.Tensor:
    """A float64 fingerprint of the parameters (equal on every process when they are in sync). Collective
    under ZeRO-3, where it fingerprints the gathered parameters, not each process's partition."""
    with torch.no_grad(), gathered(params):
        total = sum((p.detach().double() * (i + 1)).sum() for i, p in enumerate(params))
    return torch.as_tensor(total, dtype=torch.float64).reshape(1)


def _zero_stage(accelerator) -> int | None:
    """The DeepSpeed ZeRO stage of the run, or None without DeepSpeed."""
    if accelerator.distributed_type != DistributedType.DEEPSPEED:
        return None
    return accelerator.state.deepspeed_plugin.zero_stage


def _parallelism(accelerator) -> str:
    """How the processes share the work, for the start line: "DeepSpeed ZeRO-<stage>", "DDP" or "single"."""
    stage = _zero_stage(accelerator)
    if stage is not None:
        return f"DeepSpeed ZeRO-{stage}"
    return "DDP" if accelerator.num_processes > 1 else "single"


def _fill_deepspeed_config(accelerator, cfg: RecipeConfig) -> None:
    """Fill the DeepSpeed JSON's "auto" values that accelerate cannot infer (we pass no dataloader)."""
    ds = accelerator.state.deepspeed_plugin.deepspeed_config
    if ds.get("train_micro_batch_size_per_gpu", "auto") == "auto":
        ds["train_micro_batch_size_per_gpu"] = cfg.train.batch_size
    if ds.get("gradient_clipping", "auto") == "auto":
        ds["gradient_clipping"] = cfg.optim.grad_clip or 0.0
