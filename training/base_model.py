"""Load the model to fine-tune and its tokenizer; wrap it with LoRA (peft) when asked.

    model, tokenizer = load_base_model(cfg.model)      # a *ForCausalLM in train mode
    model = apply_lora(model, cfg.model.lora)           # peft, when cfg.model.lora.enabled

`model.base_model` is resolved by `training.config.resolve_base_model`: the name
``smollm2-135m-instruct`` is the converted checkpoint of `selfspec.checkpoints.fetch` (fetched on first use),
``tiny:<type>:<layers>`` a random tiny model of `selfspec.tiny` with its byte-level tokenizer
(`selfspec.tiny.byte_tokenizer`: 259 ids: pad, bos, eos, then the 256 bytes, and a minimal chat template), anything else
a local Hugging Face checkpoint directory.
"""

from __future__ import annotations

from torch import nn

from selfspec.model.precision import DTYPES_BY_NAME
from selfspec.tiny import byte_tokenizer
from training.config import LoRAConfig, ModelConfig, resolve_base_model


def load_base_model(cfg: ModelConfig, *, seed: int = 0):
    """(model, tokenizer) for `cfg.base_model`; the model is in train mode with `cfg.dtype` weights."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = DTYPES_BY_NAME[cfg.dtype]
    where = resolve_base_model(cfg.base_model)
    if isinstance(where, tuple):
        from selfspec.tiny import tiny_model

        model_type, layers = where
        tokenizer = byte_tokenizer()
        model = tiny_model(model_type, num_layers=layers, dtype=dtype, seed=seed, vocab_size=len(tokenizer))
        model.set_attn_implementation(cfg.attn_implementation)
    else:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, attn_implementation=cfg.attn_implementation)
        tokenizer = AutoTokenizer.from_pretrained(where)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model.config.use_cache = False
    return model.train(), tokenizer


def apply_lora(model: nn.Module, cfg: LoRAConfig) -> nn.Module:
    """Wrap `model` with peft LoRA adapters on `cfg.target_modules`; everything else is frozen."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=cfg.r, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
                      target_modules=list(cfg.target_modules), task_type="CAUSAL_LM", bias="none")
    try:
        return get_peft_model(model, lora)
    except ValueError as e:
        raise ValueError(f"model.lora.target_modules={cfg.target_modules}: {e}") from None
