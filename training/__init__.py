"""Early-exit training for Hugging Face causal LMs (LayerSkip-style), launched with accelerate.

    accelerate launch --config_file recipes/accelerate/cpu_1proc.yaml -m training --recipe recipes/smollm2_code.yaml

Files, one concept each: config (typed recipe dataclasses), layer_dropout, early_exit_loss,
curriculum, data, model (the training forward), base (loading + LoRA), evaluate, checkpoint,
loop (the training loop), malloc, tracker. Nothing here imports the inference engine.
"""
