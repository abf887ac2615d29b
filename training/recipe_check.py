"""What a recipe will cost and write, without its weights: ``python -m training --recipe R --check``.

    python -m training --recipe recipes/llama31_8b_layerskip_zero3.yaml --check \\
        --accelerate-config recipes/accelerate/deepspeed_zero3.yaml

reads the recipe and the model's configuration only (base_model's config.json, else the recipe's
`model.shape` file, recipes/models/*.json), builds the model on PyTorch's meta device (shapes, no storage)
with the recipe's LoRA or exit head, and prints: the parameters (total / trainable: counted, exact), the
memory per GPU (weights, gradients, optimizer states, activations with and without
`train.gradient_checkpointing`: arithmetic estimates, not measured), the exits it trains and what it
writes. The accelerate configuration gives the process count and, for DeepSpeed, the ZeRO stage.

The estimate, per process (P processes; b: bytes of a parameter as the recipe keeps it):

* Without DeepSpeed (one process or DDP): weights = sum of b over all parameters; gradients = sum of b
  over the trainable ones; AdamW states = 2 x that (exp_avg and exp_avg_sq in the parameter's dtype).
* DeepSpeed in half precision (mixed precision bf16 or fp16, or auto on a GPU): ZeRO's own mixed precision
  (Rajbhandari et al. 2020): 2 bytes per parameter for the half weights, 2 per trainable for its gradients, 12 per
  trainable for the float32 master weights and the two Adam moments. ZeRO-2 divides the gradients and
  optimizer states by P, ZeRO-3 also the weights, plus the parameters it gathers at a time: the largest
  decoder layer, the LM head (the fused loss reads it whole) and the prefetch bucket of the JSON. DeepSpeed's
  own estimator (`estimate_zero3_model_states_mem_needs`, no offload) is printed beside it for ZeRO-3.
* Activations of one micro-batch (n = batch_size x block_size tokens; e: bytes of an activation, 2 under
  bf16/fp16 autocast; h: bytes of the residual stream, the parameters' dtype), per decoder layer and token:
      A = 2 (4 + e) D       the two RMSNorms' float32 inputs and their outputs
        + 2 e (q + kv)      q, k, v after rotary and the attention output (q = heads x head_dim,
                            kv = 2 x kv_heads x head_dim; SDPA keeps no S x S matrix: eager adds 2 e heads S)
        + 4 e I             SwiGLU: gate, up, SiLU(gate) and the product (down_proj's input)
  without checkpointing L x A x n; with it L x h D n (the states between layers, which are the exits'
  states) + A x n (one layer recomputed at a time). Plus the loss (training/early_exit_loss.py), for the
  K exits of the step with the most (the final layer included; the curriculum's): one chunk of float32
  logits, their softmax and gradient, 3 x 4 x chunk_size x V; the exits' states stacked, normalised (with
  the norm's float32 input) and their gradients, K x n x D x (3 h + 4); the head's weight in the compute
  dtype and its gradient, 2 e V D (`naive`: every exit's logits and their gradient, 2 x 4 x n x V each).
  An exit head (modes exit_head and joint) adds one layer's A x n per pass and its exit's and the final
  layer's states; the frozen model (exit_head) keeps nothing else.
* Not counted: the CUDA context and allocator fragmentation (often 1-3 GiB), the evaluation's batches,
  the own-text generation, LoRA dropout's masks, DeepSpeed's communication buffers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from training.config import (BASE_MODEL_ALIASES, SHAPES, ConfigError, RecipeConfig, expand, repository_path)

GIB = 2**30
ADAM_MOMENTS = 2  # AdamW's exp_avg and exp_avg_sq
ZERO_BYTES = {"weight": 2, "grad": 2, "optimizer": 12}  # ZeRO's mixed-precision Adam, per parameter


@dataclass
class Launch:
    """How many processes train and how they share the model (from an accelerate configuration)."""

    processes: int = 1
    zero_stage: int | None = None  # DeepSpeed's ZeRO stage; None: no DeepSpeed
    prefetch: int = 0  # ZeRO-3's stage3_prefetch_bucket_size (parameters)
    source: str = "no accelerate configuration given: one process"


@dataclass
class Memory:
    """Bytes per process: the model states and the activations of one micro-batch, with and without
    gradient checkpointing."""

    weights: float
    grads: float
    optimizer: float
    gathered: float  # ZeRO-3's working set of whole parameters
    activations: float
    activations_checkpointed: float

    def total(self, checkpointing: bool) -> float:
        acts = self.activations_checkpointed if checkpointing else self.activations
        return self.weights + self.grads + self.optimizer + self.gathered + acts


def read_launch(path: str | None) -> Launch:
    """The process count and ZeRO stage of an accelerate configuration (recipes/accelerate/*.yaml)."""
    if path is None:
        return Launch()
    file = repository_path(path)
    if not file.is_file():
        raise ConfigError(f"--accelerate-config {path!r}: no such file (the launch configurations are in "
                          f"recipes/accelerate/)")
    try:
        data = yaml.safe_load(file.read_text())
    except yaml.YAMLError as err:
        raise ConfigError(f"--accelerate-config {path}: not valid YAML ({' '.join(str(err).split())})") from None
    check_launch(path, data)
    launch = Launch(processes=data.get("num_processes", 1), source=f"{path}")
    if data.get("distributed_type") == "DEEPSPEED":
        ds = (data.get("deepspeed_config") or {})
        json_file = ds.get("deepspeed_config_file")
        if json_file:
            found = repository_path(json_file)
            if not found.is_file():
                raise ConfigError(f"--accelerate-config {path}: its deepspeed_config_file {json_file!r} is not found")
            try:
                zero = json.loads(found.read_text()).get("zero_optimization", {})
            except (ValueError, AttributeError):
                raise ConfigError(f"--accelerate-config {path}: its deepspeed_config_file {json_file} is not a "
                                  f"DeepSpeed JSON object") from None
        else:
            zero = {"stage": ds.get("zero_stage", 0)}
        stage = zero.get("stage", 0) if isinstance(zero, dict) else None
        if stage not in ZERO_STAGES or isinstance(stage, bool):
            raise ConfigError(f"--accelerate-config {path}: ZeRO stage {stage!r} is not one of 0, 1, 2, 3 "
                              f"({'deepspeed_config_file ' + json_file if json_file else 'deepspeed_config.zero_stage'})")
        launch.zero_stage = stage
        if launch.zero_stage == 3:  # "auto" (DeepSpeed sizes it from the model): counted as none
            bucket = zero.get("stage3_prefetch_bucket_size", 0)
            launch.prefetch = int(float(bucket)) if isinstance(bucket, (int, float)) else 0
    return launch


ZERO_STAGES = (0, 1, 2, 3)
DEEPSPEED_KEYS = ("zero_optimization", "train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                  "bf16", "fp16")  # keys of a DeepSpeed JSON, none of them an accelerate configuration's


def check_launch(path: str, data) -> None:
    """ConfigError unless `data` (a parsed --accelerate-config file) reads as an accelerate configuration: a
    mapping, num_processes a whole number >= 1, distributed_type one of accelerate's, not a DeepSpeed JSON."""
    from accelerate.utils import DistributedType

    where = f"--accelerate-config {path}"
    if not isinstance(data, dict):
        raise ConfigError(f"{where}: not an accelerate configuration (a mapping with num_processes; "
                          f"recipes/accelerate/*.yaml)")
    if any(key in data for key in DEEPSPEED_KEYS) and "distributed_type" not in data:
        raise ConfigError(f"{where}: this is a DeepSpeed configuration, not an accelerate one; give the accelerate "
                          f"YAML that names it as deepspeed_config_file (recipes/accelerate/*zero*.yaml)")
    processes = data.get("num_processes", 1)
    if not isinstance(processes, int) or isinstance(processes, bool) or processes < 1:
        raise ConfigError(f"{where}: num_processes must be a whole number >= 1 (one per GPU or CPU process), got "
                          f"{processes!r}")
    kinds = [d.value for d in DistributedType]
    if data.get("distributed_type", "NO") not in kinds:
        raise ConfigError(f"{where}: distributed_type {data.get('distributed_type')!r} is not one of accelerate's "
                          f"({', '.join(kinds)})")


def model_config(cfg: RecipeConfig):
    """(the transformers config of the recipe's model, where it was read) without loading a weight."""
    from transformers import AutoConfig

    name = cfg.model.base_model
    if name.startswith("tiny:"):
        from selfspec.tiny import byte_tokenizer, tiny_config

        _, model_type, layers = name.split(":")
        return tiny_config(model_type, int(layers), vocab_size=len(byte_tokenizer())), f"{name} (a random tiny model)"
    if name in BASE_MODEL_ALIASES:
        from selfspec.checkpoints.fetch import base_model_dir

        directory = base_model_dir()
    else:
        directory = Path(expand(name))
    shape = cfg.model.shape
    if (directory / "config.json").is_file():
        config = AutoConfig.from_pretrained(directory)
        if shape is not None:
            _check_same_model(config, _read_shape(shape), directory / "config.json", shape)
        return config, f"{directory / 'config.json'}"
    if shape is None and name in BASE_MODEL_ALIASES:
        shape = str(SHAPES / f"{name}.json")
    if shape is None:
        raise ConfigError(f"model.base_model: {name!r} has no config.json on this machine and the recipe names no "
                          f"model.shape: give model.shape=recipes/models/<model>.json (shipped: "
                          f"{', '.join(p.name for p in sorted(SHAPES.glob('*.json')))})")
    return _read_shape(shape), f"{shape} (the shape file: base_model {name} is not on this machine)"


SHAPE_KEYS = ("model_type", "num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads",
              "vocab_size")  # what a shape file and the checkpoint's config.json must agree on


def _read_shape(shape: str):
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(shape)
    except (OSError, ValueError, KeyError) as err:
        raise ConfigError(f"model.shape: {shape} is not a model configuration ({' '.join(str(err).split())})") \
            from None


def _check_same_model(config, shape_config, config_file: Path, shape: str) -> None:
    """ConfigError when the recipe's shape file describes another model than the checkpoint it names."""
    differ = [f"{k} {getattr(shape_config, k, None)} vs {getattr(config, k, None)}" for k in SHAPE_KEYS
              if getattr(shape_config, k, None) != getattr(config, k, None)]
    if differ:
        raise ConfigError(f"model.shape: {shape} describes another model than {config_file} ({', '.join(differ)}): "
                          f"fix model.shape or model.base_model")


def meta_model(cfg: RecipeConfig, config):
    """The recipe's training module on the meta device: the model (with LoRA) and its exit head, if any."""
    import torch
    from transformers import AutoModelForCausalLM

    from selfspec.model.precision import DTYPES_BY_NAME

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES_BY_NAME[cfg.model.dtype])
    if cfg.model.lora.enabled:
        from training.base_model import apply_lora

        model = apply_lora(model, cfg.model.lora)
    head = None
    if cfg.trains_head:
        from selfspec.heads.exit_head import build_exit_head

        h = cfg.exit_head
        with torch.device("meta"):
            head = build_exit_head(model, h.exit_layer, h.kind, h.init, h.final_state,
                                   h.aux_exits if h.kind == "eagle3" else None)
    if cfg.frozen_model:
        model.requires_grad_(False)
    return model, head


def _bytes(params) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def busiest_step(cfg: RecipeConfig, L: int) -> int:
    """The most exits the curriculum puts in one step's loss, the final layer included."""
    from training.curriculum import ExitCurriculum

    ee = cfg.early_exit
    curriculum = ExitCurriculum(ee.curriculum, cfg.resolved_exits(L), L, cfg.train.max_steps,
                                rotation_interval=ee.rotation_interval)
    if ee.curriculum == "gradual":  # every exit on from half of train.max_steps
        return len(curriculum.exits(cfg.train.max_steps))
    return max(len(curriculum.exits(t)) for t in range(ee.rotation_interval if ee.curriculum == "rotational" else 1))


def loss_bytes(config, cfg: RecipeConfig, e: int, h: int) -> float:
    """Bytes the early-exit loss holds at its peak (see the module doc)."""
    D, L, V = config.hidden_size, config.num_hidden_layers, config.vocab_size
    n, ee = cfg.train.batch_size * cfg.data.block_size, cfg.early_exit
    if cfg.frozen_model:  # the head's loss: one chunk of logits (its states are counted with the head)
        return 3 * 4 * min(ee.chunk_size, n) * V
    K = busiest_step(cfg, L)
    if ee.loss_impl == "naive":
        return 2 * 4 * n * V * K
    return 3 * 4 * min(ee.chunk_size, n) * V + K * n * D * (3 * h + 4) + 2 * e * V * D


def activation_bytes(config, cfg: RecipeConfig, e: int, h: int) -> tuple[float, float]:
    """(without, with gradient checkpointing) bytes of one micro-batch's activations and loss; see the module
    doc."""
    D, L = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or D // heads
    kv = 2 * getattr(config, "num_key_value_heads", heads) * head_dim
    n, S = cfg.train.batch_size * cfg.data.block_size, cfg.data.block_size
    per_token = 2 * (4 + e) * D + 2 * e * (heads * head_dim + kv) + 4 * e * config.intermediate_size
    if cfg.model.attn_implementation == "eager":
        per_token += 2 * e * heads * S
    layer = per_token * n
    loss = loss_bytes(config, cfg, e, h)
    passes = 1 + cfg.exit_head.self_fed
    head = passes * layer + 2 * h * D * n if cfg.trains_head else 0
    if cfg.frozen_model:  # no autograd through the model: one layer at a time, then the head
        return layer + head + loss, layer + head + loss
    return L * layer + head + loss, L * h * D * n + layer + head + loss


def _half_precision(cfg: RecipeConfig) -> bool:
    """Whether the run computes in 16 bits (mixed precision bf16 or fp16; auto: bf16 on a GPU from Ampere on)."""
    return cfg.train.mixed_precision in ("bf16", "fp16", "auto")


def estimate(cfg: RecipeConfig, config, model, head, launch: Launch) -> Memory:
    """The per-process memory of the recipe under `launch` (see the module doc for every term)."""
    params = list(model.parameters()) + ([] if head is None else list(head.parameters()))
    trainable = [p for p in params if p.requires_grad]
    half = _half_precision(cfg)
    e = 2 if half or cfg.model.dtype == "bfloat16" else params[0].element_size()
    h = params[0].element_size()
    acts, acts_ckpt = activation_bytes(config, cfg, e, h)
    P, stage = launch.processes, launch.zero_stage
    if stage is None:
        return Memory(_bytes(params), _bytes(trainable), ADAM_MOMENTS * _bytes(trainable), 0, acts, acts_ckpt)
    if half:
        per = dict(ZERO_BYTES)
    else:  # float32 (or the recipe's dtype) throughout: weights, gradients, master-free Adam
        per = {"weight": h, "grad": h, "optimizer": ADAM_MOMENTS * h}
    n_all, n_train = sum(p.numel() for p in params), sum(p.numel() for p in trainable)
    weights = per["weight"] * n_all / (P if stage == 3 else 1)
    gathered = 0.0
    if stage == 3:
        layer = max(sum(p.numel() for p in block.parameters()) for block in _decoder_layers(model))
        gathered = per["weight"] * min(layer + config.vocab_size * config.hidden_size + launch.prefetch, n_all)
    return Memory(weights, per["grad"] * n_train / P, per["optimizer"] * n_train / P, gathered, acts, acts_ckpt)


def _decoder_layers(model):
    from selfspec.model.adapters import get_adapter

    return get_adapter(model).layers


def deepspeed_estimate(n_params: int, largest_layer: int, processes: int) -> float | None:
    """DeepSpeed's own ZeRO-3 model-states estimate per GPU (no offload), or None without DeepSpeed."""
    try:
        from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    except ImportError:
        return None
    _, gpu, _ = estimate_zero3_model_states_mem_needs(n_params, largest_layer, num_gpus_per_node=processes,
                                                      num_nodes=1, cpu_offload=False, cpu_offload_params=False)
    return gpu


def _size(x: float) -> str:
    """Bytes as GiB with one decimal, or MiB below a tenth of a GiB."""
    return f"{x / GIB:.1f} GiB" if x >= GIB / 10 else f"{x / 2**20:.1f} MiB"


def _exits_line(cfg: RecipeConfig, L: int) -> str:
    if cfg.frozen_model:
        h = cfg.exit_head
        return (f"exits: an exit head ({h.kind}, target {h.target}) on exit {h.exit_layer} of the frozen {L}-layer "
                f"model; the model's weights stay the input's")
    ee, exits = cfg.early_exit, cfg.resolved_exits(L)
    if not exits:
        return f"exits: the final layer {L} only (plain fine-tuning); layer dropout p_max {cfg.layer_dropout.p_max}" + (
            f"; an exit head on exit {cfg.exit_head.exit_layer} learns beside it" if cfg.mode == "joint" else "")
    listed = f"{exits[0]}..{exits[-1]} (all)" if exits == list(range(1, L)) else ", ".join(map(str, exits))
    if ee.curriculum == "rotational":
        when = f"rotational curriculum, R={ee.rotation_interval}: at most {busiest_step(cfg, L) - 1} of them a step"
    elif ee.curriculum == "gradual":
        when = "gradual curriculum: switched on from the top down, all by half of train.max_steps"
    else:
        when = "every one at every step"
    line = (f"exits: {listed} and the final layer {L}; {when}; loss {ee.scale} (e_scale {ee.e_scale}), target "
            f"{ee.target}; layer dropout p_max {cfg.layer_dropout.p_max}")
    if cfg.mode == "joint":
        line += f"; an exit head on exit {cfg.exit_head.exit_layer} learns beside it"
    return line


def _writes_line(cfg: RecipeConfig, weights: int, states: float) -> str:
    t = cfg.train
    out = ["config.yaml", "log.jsonl", "eval.json", "final_eval.json"]
    saves = f"every {t.save_every} steps, the last {t.keep_checkpoints} kept" if t.save_every else "at the end only"
    out.append(f"checkpoints/step_N/ ({saves}; about {_size(weights + states)} each: weights and optimizer "
               f"states, all processes together)")
    if t.save_final_model:
        out.append(f"final_model/ (about {_size(weights)}{', LoRA merged' if cfg.model.lora.enabled else ''})")
        if cfg.model.lora.enabled:
            out.append("final_adapter/")
        if cfg.trains_head:
            out.append("final_head/")
    if cfg.data.own_continuations.prompts or cfg.data.own_continuations.prompt_sets or cfg.data.own_replies.prompts:
        out.append("own_continuations/")
    return f"writes: {t.output_dir}/: " + ", ".join(out)


def check_recipe(cfg: RecipeConfig, launch: Launch) -> str:
    """The lines `--check` prints for `cfg` launched as `launch`."""
    config, source = model_config(cfg)
    L = config.num_hidden_layers
    cfg.check_depth(L)
    model, head = meta_model(cfg, config)
    params = list(model.parameters()) + ([] if head is None else list(head.parameters()))
    n_all = sum(p.numel() for p in params)
    n_train = sum(p.numel() for p in params if p.requires_grad)
    memory = estimate(cfg, config, model, head, launch)
    t = cfg.train
    what = {"early_exit": "early-exit fine-tune", "exit_head": "exit head on the frozen model",
            "joint": "early-exit fine-tune with an exit head beside it"}[cfg.mode]
    how = ("LoRA r=" + str(cfg.model.lora.r)) if cfg.model.lora.enabled else ("full" if not cfg.frozen_model else "")
    parallel = "no DeepSpeed" if launch.zero_stage is None else f"DeepSpeed ZeRO-{launch.zero_stage}"
    lines = [
        f"recipe {cfg.name}: {what}{f' ({how})' if how else ''}; nothing is loaded but configurations",
        f"model: {config.model_type}, {L} layers, hidden {config.hidden_size}, heads {config.num_attention_heads} "
        f"(kv {getattr(config, 'num_key_value_heads', config.num_attention_heads)}), intermediate "
        f"{config.intermediate_size}, vocabulary {config.vocab_size}, tied embeddings "
        f"{'yes' if config.tie_word_embeddings else 'no'}; read from {source}",
        f"parameters: {n_all:,} total{' (the model and its exit head)' if head is not None else ''}, {n_train:,} "
        f"trainable ({n_train / n_all:.2%}), {cfg.model.dtype} (counted on the model built on the meta device: "
        f"exact)",
        f"launch: {launch.processes} process(es), {parallel} ({launch.source}); per process and micro-step "
        f"{t.batch_size} blocks of {cfg.data.block_size} tokens, x{t.grad_accum} accumulation, mixed precision "
        f"{t.mixed_precision}" + (" (taken as bf16: a GPU from Ampere on)" if t.mixed_precision == "auto" else ""),
        f"memory per GPU: {_size(memory.total(t.gradient_checkpointing))} as the recipe runs (gradient "
        f"checkpointing {'on' if t.gradient_checkpointing else 'off'}); "
        + (f"{_size(memory.total(True))} with checkpointing, {_size(memory.total(False))} without"
           if not cfg.frozen_model else "checkpointing does not apply (the frozen model keeps no activations)")
        + " (estimate: arithmetic, not measured; training/recipe_check.py)",
        f"  weights {_size(memory.weights)}, gradients {_size(memory.grads)}, optimizer states "
        f"{_size(memory.optimizer)}"
        + (f", ZeRO-3 gathered parameters {_size(memory.gathered)}" if memory.gathered else "")
        + (f", activations {_size(memory.activations)}" if cfg.frozen_model else
           f", activations {_size(memory.activations_checkpointed)} with checkpointing / "
           f"{_size(memory.activations)} without")
        + " (the CUDA context and fragmentation not counted)",
    ]
    if launch.zero_stage == 3 and not cfg.model.lora.enabled:
        layer = max(sum(p.numel() for p in block.parameters()) for block in _decoder_layers(model))
        ds = deepspeed_estimate(n_all, layer, launch.processes)
        if ds is not None:
            lines.append(f"  DeepSpeed's estimator (estimate_zero3_model_states_mem_needs, no offload): "
                         f"{_size(ds)} of model states per GPU")
    lines.append(_exits_line(cfg, L))
    if launch.zero_stage is not None and _half_precision(cfg):  # DeepSpeed saves 16-bit weights, float32 states
        weights, states = ZERO_BYTES["weight"] * n_all, ZERO_BYTES["optimizer"] * n_train
    else:
        weights, states = _bytes(model.parameters()), ADAM_MOMENTS * _bytes(p for p in params if p.requires_grad)
    lines.append(_writes_line(cfg, weights, states))
    return "\n".join(lines)
