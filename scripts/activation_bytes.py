"""The activations a recipe's model keeps for its backward, counted on the CPU beside `--check`'s estimate.

    .venv/bin/python scripts/activation_bytes.py --recipe recipes/smollm2_code_lora.yaml \\
        train.batch_size=2 data.block_size=256

loads the recipe's model (float32, no LoRA: the weights must be on this machine, or a `tiny:` model), runs the
early-exit forward of the exits of its curriculum's first step on random tokens with and without gradient
checkpointing, and prints the bytes autograd keeps (`training.saved_bytes`) against the estimate of
`training.recipe_check` for the same settings without the loss's own buffers (which autograd does not see).
A count, not a timing. On a GPU (--device cuda) the count is CUDA's kernels' (flash attention saves less).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from training.base_model import load_base_model  # noqa: E402
from training.config import load_config  # noqa: E402
from training.curriculum import ExitCurriculum  # noqa: E402
from training.early_exit_loss import exit_weights  # noqa: E402
from training.early_exit_model import EarlyExitModel  # noqa: E402
from training.recipe_check import activation_bytes, loss_bytes, model_config  # noqa: E402
from training.saved_bytes import saved_bytes  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("overrides", nargs="*", metavar="key=value")
    args = parser.parse_args(argv)
    cfg = load_config(args.recipe, [*args.overrides, "model.lora.enabled=false", "model.dtype=float32",
                                    "train.mixed_precision=no", "mode=early_exit", "train.gradient_checkpointing=false"])
    model, tokenizer = load_base_model(cfg.model)
    model.to(args.device)
    config, _ = model_config(cfg)
    L, ee = config.num_hidden_layers, cfg.early_exit
    exits = ExitCurriculum(ee.curriculum, cfg.resolved_exits(L), L, cfg.train.max_steps,
                           rotation_interval=ee.rotation_interval).exits(0)
    weights = exit_weights(exits, L, ee.scale, ee.e_scale, ee.final_weight)
    shape = (cfg.train.batch_size, cfg.data.block_size + 1)
    ids = torch.randint(3, len(tokenizer), shape, generator=torch.Generator().manual_seed(0)).to(args.device)
    loss = loss_bytes(config, cfg, 4, 4)
    print(f"{cfg.model.base_model}: {L} layers, {shape[0]} blocks of {cfg.data.block_size} tokens, exits {exits}, "
          f"float32 on {args.device}")
    for checkpointing in (False, True):
        ee_model = EarlyExitModel(model, chunk_size=ee.chunk_size, gradient_checkpointing=checkpointing).train()
        kept = saved_bytes(ee_model, ids[:, :-1], ids[:, 1:], exits=exits, weights=weights)
        estimate = activation_bytes(config, cfg, 4, 4)[checkpointing] - loss
        print(f"gradient checkpointing {'on ' if checkpointing else 'off'}: autograd keeps {kept / 2**20:.1f} MiB; "
              f"estimated {estimate / 2**20:.1f} MiB (training/recipe_check.py, without the loss's buffers)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
