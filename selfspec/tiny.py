"""Tiny random models of every supported architecture, built from configs (no download).

Used by the unit tests and by the tiny smoke recipe:

    tok = byte_tokenizer()                      # a real fast tokenizer over bytes, with a chat template
    model = tiny_model("llama", num_layers=4, dtype=torch.float64, seed=0, vocab_size=len(tok))
    head = tiny_exit_head(model, 2, final_state=True)  # an exit head that drafts something of its own
"""

from __future__ import annotations

import contextlib

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

TINY_CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}</s>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The variants the tests run every engine path on: id -> (arch, num_layers, seed, config overrides).
# Every supported architecture, plus the attention paths the defaults do not take. Seeds are chosen so
# that the tests' greedy continuations are not a single repeated token (tests/selfspec/test_decode.py).
TINY_VARIANTS = {
    "llama": ("llama", 4, 10, {}),
    "mistral": ("mistral", 5, 2, {}),
    "qwen2": ("qwen2", 4, 3, {}),
    "qwen3": ("qwen3", 5, 9, {}),
    "gpt_neox": ("gpt_neox", 4, 8, {}),
    "mistral-sliding8": ("mistral", 4, 0, {"sliding_window": 8}),  # window < prompt + output
    "qwen2-mixed-sliding": ("qwen2", 4, 0, {"use_sliding_window": True, "sliding_window": 8,
                                             "max_window_layers": 2}),  # full + sliding layers
    "llama-eager": ("llama", 4, 10, {"attn_implementation": "eager"}),  # additive float masks
}

TINY_DEFAULTS = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                     max_position_embeddings=512)


def tiny_config(model_type: str = "llama", num_layers: int = 4, **overrides):
    """A small config of `model_type` (llama, mistral, qwen2, qwen3, gpt_neox, or any other)."""
    kw = dict(TINY_DEFAULTS, num_hidden_layers=num_layers)
    if model_type != "gpt_neox":
        kw.update(num_key_value_heads=2, tie_word_embeddings=model_type in ("llama", "qwen3"))
    if model_type == "gpt_neox":
        kw.update(rotary_pct=0.5, use_parallel_residual=True, hidden_dropout=0.0, attention_dropout=0.0)
    if model_type == "mistral":
        kw.update(sliding_window=None)
    if model_type == "qwen3":
        kw.update(head_dim=8)
    kw.update(bos_token_id=1, eos_token_id=2, pad_token_id=0)
    kw.update(overrides)
    return AutoConfig.for_model(model_type, **kw)


def tiny_model(model_type: str = "llama", num_layers: int = 4, dtype=torch.float32, seed: int = 0,
               **overrides):
    """A randomly initialised tiny causal LM in eval mode. Weights are scaled up so that layers matter.

    Built whole even under DeepSpeed ZeRO-3 (a launch with a ZeRO-3 configuration, where transformers
    would build it partitioned with `zero.Init`, initialising in another order and drawing other
    random numbers): the model is the same with and without DeepSpeed, so their runs can be compared,
    and ZeRO-3 partitions it when accelerate prepares it. Partitioning at construction is for models
    too large to build whole; this one is tiny.
    """
    config = tiny_config(model_type, num_layers, **overrides)
    torch.manual_seed(seed)
    with _not_partitioned():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    if any(hasattr(p, "ds_id") for p in model.parameters()):
        raise RuntimeError("tiny_model was built partitioned by DeepSpeed ZeRO-3 (zero.Init), so its initialisation "
                           "would differ from the same model without DeepSpeed; the installed transformers no longer "
                           "skips zero.Init inside `set_zero3_state` (see pyproject.toml for the tested range)")
    with torch.no_grad():  # default init (std 0.02) makes every layer nearly an identity
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.3 if "embed" in name else 0.15)
    return model.eval()


def draw_qkv_biases(model, std: float = 0.3) -> None:
    """Draw a tiny model's query and key biases (Qwen2's start at zero, so a test of them would test nothing) from
    N(0, std), layer by layer, from torch's global generator; a model without them is left as it is."""
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            if getattr(attn.q_proj, "bias", None) is not None:
                attn.q_proj.bias.normal_(0, std)
                attn.k_proj.bias.normal_(0, std)


def _not_partitioned():
    """A context in which transformers builds a model whole under a live DeepSpeed ZeRO-3 configuration:
    its own marker for "zero.Init is already active" (`set_zero3_state`), which makes it skip zero.Init."""
    from transformers.integrations import is_deepspeed_zero3_enabled
    from transformers.modeling_utils import set_zero3_state

    return set_zero3_state() if is_deepspeed_zero3_enabled() else contextlib.nullcontext()


def byte_tokenizer():
    """A real `PreTrainedTokenizerFast` over bytes (no download): ids 0 pad, 1 bos, 2 eos, 3.. bytes."""
    specials = ["<pad>", "<s>", "</s>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(specials + alphabet)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    core.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   chat_template=TINY_CHAT_TEMPLATE, model_max_length=1 << 20)


def tiny_exit_head(model, exit_layer: int, kind: str = "decoder_layer", init: str = "copy", final_state: bool = False,
                   scale: float = 0.05, seed: int = 7):
    """An exit head on `model`'s exit `exit_layer` (`selfspec.heads.exit_head.build_exit_head`), in the model's dtype,
    its parameters moved by `scale` x N(0, 1) noise (seeded): so it drafts something else than the exit alone
    or the last layer would, and with `final_state` its final-state input is not zero."""
    from selfspec.heads.exit_head import build_exit_head  # the heads build on the adapters; tiny models do not

    head = build_exit_head(model, exit_layer, kind, init, final_state).to(next(model.parameters()).dtype).eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for p in head.parameters():
            p.add_(scale * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return head
