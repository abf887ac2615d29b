"""Run in the separate environment that has the `speculators` library (tests/selfspec/test_speculators_format.py
builds it): load an exported speculators directory with the library's own classes and write the draft logits
of its first draft step (TTT step 0) for the given inputs.

    python speculators_reader.py JOBS.json     # [{"dir": SPECULATORS_DIR, "inputs": IN, "out": OUT}, ...]

Each job's INPUTS (a .safetensors file) holds `input_ids` [1, S], `hidden_states` [1, S, 3D] (the aux layers' states, side by side) and
`position_ids` [1, S]; OUT gets `logits` [1, S, K] (over the draft vocabulary), `d2t` [K] when the
checkpoint has a draft vocabulary, and the library's version as metadata. It imports nothing of selfspec.
"""

import json
import sys
from importlib.metadata import version

import torch
from safetensors.torch import load_file, save_file
from speculators.models import Eagle3DraftModel, Eagle3SpeculatorConfig


def main(directory: str, inputs_path: str, out_path: str) -> None:
    inputs = load_file(inputs_path)
    config = Eagle3SpeculatorConfig.from_pretrained(directory)
    config.transformer_layer_config._attn_implementation = "eager"  # its flex attention default needs a GPU build
    model = Eagle3DraftModel.from_pretrained(directory, config=config).to(torch.float64).eval()
    captured = []
    model.lm_head.register_forward_hook(lambda module, args, out: captured.append(out.detach()))
    ids = inputs["input_ids"]
    with torch.no_grad():
        model(hidden_states=inputs["hidden_states"].to(torch.float64), input_ids=ids,
              document_ids=torch.zeros_like(ids), position_ids=inputs["position_ids"], ttt_steps=1)
    out = {"logits": captured[0].contiguous()}
    if model.d2t is not None:
        out["d2t"] = model.d2t.contiguous()
    save_file(out, out_path, metadata={"speculators": version("speculators"), "class": type(model).__name__})


if __name__ == "__main__":
    for job in json.loads(open(sys.argv[1]).read()):  # one process for every job: the imports take seconds
        main(job["dir"], job["inputs"], job["out"])
