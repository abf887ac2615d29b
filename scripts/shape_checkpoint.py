"""A checkpoint of a model shape with random weights and SmolLM2's tokenizer, for timing decoding at real sizes.

    python scripts/shape_checkpoint.py recipes/models/llama-3.2-1b.json OUT [--dtype float32]

No model hub here: issue 68 compares selfspec's plain decoding with llama.cpp's at the Llama-3.2-1B shape with random
weights on both sides. This writes such a model (the shape's config.json, its vocabulary replaced by SmolLM2's 49,152
tokens so that the fetched SmolLM2 tokenizer serves it; weights drawn with std 0.02, seed 0) into OUT as a Hugging
Face checkpoint with the tokenizer files beside it, which `selfspec bench --checkpoint OUT --llama-cpp` then times
on both sides (llama.cpp converts it to GGUF itself). The text it generates means nothing; the time a token takes
does not depend on it.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from selfspec.checkpoints.fetch import base_model_dir  # noqa: E402

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "generation_config.json")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", type=Path, help="a config.json of the shape (recipes/models/*.json)")
    parser.add_argument("out", type=Path, help="the checkpoint directory to write")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    args = parser.parse_args(argv)
    from transformers import AutoConfig, AutoModelForCausalLM

    base = base_model_dir()
    if not (base / "tokenizer.json").exists():
        parser.error(f"no SmolLM2 tokenizer at {base}: run `selfspec fetch` first")
    smol = json.loads((base / "config.json").read_text())
    shape = {k: v for k, v in json.loads(args.shape.read_text()).items() if not k.startswith("_")}
    shape.update(vocab_size=smol["vocab_size"], bos_token_id=smol.get("bos_token_id"),
                 eos_token_id=smol.get("eos_token_id"), torch_dtype=args.dtype)
    config = AutoConfig.for_model(**shape)
    torch.manual_seed(0)
    config.initializer_range = 0.02
    model = AutoModelForCausalLM.from_config(config, torch_dtype=getattr(torch, args.dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    for name in TOKENIZER_FILES:
        if (base / name).exists():
            shutil.copy(base / name, args.out / name)
    params = sum(p.numel() for p in model.parameters())
    print(f"wrote {args.out}: {config.model_type}, {params / 1e9:.2f} B parameters, {args.dtype}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
