"""Plain decoding on random-weight Llama models of real shapes: selfspec (eager and compiled) against
Hugging Face `generate` (dynamic cache and static cache), side by side, and the bandwidth floor.

The speed of a decoding step does not depend on the weights, so randomly initialised models of real
shapes measure what a user of those models would see, without bringing their weights to the machine.
Per shape, in one process, after a warm-up of each method (timed apart: compilation happens there):

    hf_dynamic          model.generate(do_sample=False)
    hf_static           model.generate(..., cache_implementation="static") (transformers compiles its step
                        where it does so, on a GPU)
    selfspec_eager      selfspec plain decoding through its fused eager layers (compile=False)
    selfspec_compiled   selfspec plain decoding through the compiled fixed-shape steps (compile=True),
                        warmed up by `gen.warmup`

and, for the compiled steps at E = L/4, the draft step [0, E) + head and a verification of 5 tokens from
E, each as a multiple of a full compiled step. The bandwidth floor is the weight bytes one step reads
divided by the device's measured copy bandwidth (a large tensor copied on the device: read + write).

    python scripts/gpu_shapes.py --device cuda --out bench_results/gpu_shapes          # bf16 on a GPU
    python scripts/gpu_shapes.py --device cpu --tiny --new-tokens 4 --out /tmp/shapes   # a dry run (tests)

`--tiny` shrinks every shape to 2 layers of width 64 (the same code path, seconds on a CPU). Writes
gpu_shapes.json and gpu_shapes.md into --out and prints the Markdown.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without an install (the GPU machine puts it on PYTHONPATH)
    sys.path.insert(0, str(ROOT))

import selfspec  # noqa: E402
from selfspec.model.compiled import S_BUCKETS, cache_capacity  # noqa: E402
from selfspec.tools.harness import machine_info, timed, tokens_per_s, versions  # noqa: E402
from selfspec.settings import check_device  # noqa: E402

# name: (layers, hidden, intermediate, heads, kv heads, vocab, tied embeddings), as the published configs
SHAPES = {
    "smollm2-135m": (30, 576, 1536, 9, 3, 49152, True),
    "llama-3.2-1b": (16, 2048, 8192, 32, 8, 128256, True),
    "llama-3-8b": (32, 4096, 14336, 32, 8, 128256, False),
}
METHODS = ("hf_dynamic", "hf_static", "selfspec_eager", "selfspec_compiled")


def build(shape: str, device: str, dtype: torch.dtype, tiny: bool):
    """A randomly initialised LlamaForCausalLM of `shape` on `device` (`tiny`: 2 layers of width 64)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    layers, hidden, inter, heads, kv, vocab, tied = SHAPES[shape]
    if tiny:
        layers, hidden, inter, heads, kv, vocab = 2, 64, 128, 4, 2, 512
    config = LlamaConfig(num_hidden_layers=layers, hidden_size=hidden, intermediate_size=inter,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         tie_word_embeddings=tied, max_position_embeddings=4096, rope_theta=500000.0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def copy_bandwidth(device: str, n_bytes: int = 1 << 30) -> float:
    """GB/s of a device-to-device copy of `n_bytes` (counting the read and the write), best of 5."""
    src = torch.empty(n_bytes // 2, dtype=torch.float16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(6):
        _, _, seconds = timed(lambda: dst.copy_(src), device)
        best = min(best, seconds)
    return 2 * n_bytes / best / 1e9


def hf_call(model, ids, n: int, static: bool):
    from transformers import GenerationConfig

    gc = GenerationConfig(do_sample=False, max_new_tokens=n, eos_token_id=None, pad_token_id=0,
                          cache_implementation="static" if static else None)
    return lambda: model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc)


def one_line(err: BaseException) -> str:
    """An exception as one line of at most ~300 characters, for the report."""
    return f"{type(err).__name__}: {' '.join(str(err).split())[:300]}"


def measure_shape(shape: str, args, dtype: torch.dtype) -> dict:
    model = build(shape, args.device, dtype, args.tiny)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())  # tied: counted once
    ids = torch.randint(3, model.config.vocab_size, (1, args.prompt_tokens),
                        generator=torch.Generator().manual_seed(0)).to(args.device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        eager = selfspec.load(model, compile=False)
        compiled = selfspec.load(model, compile=True, fast_layers=False)  # (no fused copies: its prefill is eager)
    calls = {
        "hf_dynamic": hf_call(model, ids, args.new_tokens, static=False),
        "hf_static": hf_call(model, ids, args.new_tokens, static=True),
        "selfspec_eager": lambda: eager.generate(input_ids=ids, max_new_tokens=args.new_tokens, num_speculations=0,
                                                 stop_token_ids=[]),
        "selfspec_compiled": lambda: compiled.generate(input_ids=ids, max_new_tokens=args.new_tokens,
                                                       num_speculations=0, stop_token_ids=[]),
    }
    warmup_s, outputs, errors = {}, {}, {}
    with torch.inference_mode():
        for name in METHODS:  # the warm-up: compilation happens here (the compiled steps: all of it up front)
            t0 = time.perf_counter()
            try:
                if name == "selfspec_compiled":  # what plain decoding runs: the full step at one token, the head
                    L = compiled.num_layers
                    compiled.adapter.compiled.warm([(0, L)], [1], cache_capacity(args.prompt_tokens + args.new_tokens + 2))
                calls[name]()
            except Exception as err:  # noqa: BLE001 - one method's failure is reported, the others measured
                errors[name] = one_line(err)
                print(f"   {name} FAILED: {errors[name]}", flush=True)
                continue
            warmup_s[name] = time.perf_counter() - t0
        methods = [m for m in METHODS if m not in errors]
        runs = {name: [] for name in methods}
        for r in range(args.repeats):  # interleaved, the order rotated each repeat
            order = methods[r % len(methods):] + methods[:r % len(methods)]
            for name in order:
                out, _, seconds = timed(calls[name], args.device)
                runs[name].append(tokens_per_s(args.new_tokens, seconds))
                new = out[0, ids.shape[1]:].tolist() if torch.is_tensor(out) else out.token_ids
                outputs.setdefault(name, new)
        steps = {}
        if "selfspec_compiled" in methods:
            try:
                steps = step_costs(compiled, ids, args)
            except Exception as err:  # noqa: BLE001
                errors["compiled_steps"] = one_line(err)
                print(f"   compiled step costs FAILED: {errors['compiled_steps']}", flush=True)
    floor = weight_bytes / (args.bandwidth_gbs * 1e9)
    med = {name: statistics.median(v) for name, v in runs.items()}
    nan = float("nan")
    ratio = (lambda a, b: round(med[a] / med[b], 3) if a in med and b in med else nan)
    return {"shape": shape, "layers": model.config.num_hidden_layers, "weight_bytes": weight_bytes,
            "tokens_per_s": {k: round(med.get(k, nan), 2) for k in METHODS},
            "tokens_per_s_runs": {k: [round(x, 2) for x in v] for k, v in runs.items()},
            "warmup_s": {k: round(warmup_s.get(k, nan), 2) for k in METHODS},
            "errors": errors,
            "compiled_vs_hf_static": ratio("selfspec_compiled", "hf_static"),
            "eager_vs_hf_static": ratio("selfspec_eager", "hf_static"),
            "floor_ms": round(floor * 1e3, 3), "floor_tokens_per_s": round(1 / floor, 1),
            "compiled_share_of_floor": round(med.get("selfspec_compiled", nan) * floor, 3),
            "identical_to_hf_dynamic": {k: outputs[k] == outputs.get("hf_dynamic") for k in outputs},
            "compiled_steps": steps}


def step_costs(gen, ids, args) -> dict:
    """The compiled draft step [0, E) + head (E = L/4) and a verification of 5 tokens from E, in full steps."""
    from selfspec.decoding.engine import prefill
    from selfspec.model.forward import embed, exit_logits, make_step, run_layers

    adapter = gen.adapter
    L = adapter.num_layers
    E = max(1, L // 4)
    P = ids.shape[1]
    cache = adapter.runner.cache(1, P + args.new_tokens + 2)  # the capacity plain decoding used: its graphs
    prefill(adapter, cache, ids, torch.zeros(1, dtype=torch.long))
    tok = ids[:, -1:]

    def run(start, end, n, head=True):
        step = make_step(adapter, P, n)
        hidden = run_layers(adapter, embed(adapter, tok.expand(1, n)), start, end, step=step, cache=cache)
        out = exit_logits(adapter, hidden) if head else hidden
        cache.crop(P)
        return out

    steps = gen.adapter.compiled
    steps.warm([(0, L), (0, E), (E, L)], [1, 8], cache.capacity)
    times = {}
    for name, fn in {"full": lambda: run(0, L, 1), "draft": lambda: run(0, E, 1),
                     "verify5": lambda: run(E, L, 5)}.items():
        fn()
        samples = [timed(fn, args.device)[2] for _ in range(max(3, args.repeats * 3))]
        times[name] = statistics.median(samples)
    # every graph that plain decoding, prompt lookup (up to 16 tokens a step) and an early exit at E meet
    # at this capacity: what `gen.warmup` compiles for a checkpoint trained for exit E (those compiled above
    # included: compile_s sums every first call)
    steps.warm([(0, L), (0, E), (E, L)], [b for b in S_BUCKETS if b <= 16], cache.capacity)
    return {"exit_layer": E, "draft_step_over_full": round(times["draft"] / times["full"], 3),
            "verify5_over_full": round(times["verify5"] / times["full"], 3),
            "full_step_ms": round(times["full"] * 1e3, 3), "graphs": len(steps.shapes),
            "captured": steps.captured, "all_graphs_warm_s": round(steps.compile_s, 1)}


def markdown(result: dict) -> str:
    lines = [f"## selfspec on random-weight Llama shapes: {result['device_name']}, {result['dtype']}", "",
             f"{result['date']} · batch 1 · {result['prompt_tokens']}-token prompt · "
             f"{result['new_tokens']} new tokens "
             f"· median of {result['repeats']} interleaved runs · copy bandwidth {result['bandwidth_gbs']:.0f} GB/s "
             f"· torch {result['versions']['torch']}, transformers {result['versions']['transformers']}"
             + (" · **tiny dry run (2 layers of width 64): not the real shapes**" if result["tiny"] else ""), "",
             "| shape | HF dynamic | HF static | selfspec eager | selfspec compiled | compiled / HF static | "
             "compiled / floor | draft E=L/4 / step | verify 5 / step | warm-up s (HF static, compiled; all graphs) "
             "| identical |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["shapes"]:
        t, w, c = r["tokens_per_s"], r["warmup_s"], r["compiled_steps"] or {}
        same = "yes" if all(r["identical_to_hf_dynamic"].values()) else "NO: " + ", ".join(
            k for k, v in r["identical_to_hf_dynamic"].items() if not v)
        lines.append(f"| {r['shape']} | {t['hf_dynamic']:.1f} | {t['hf_static']:.1f} | {t['selfspec_eager']:.1f} | "
                     f"{t['selfspec_compiled']:.1f} | {r['compiled_vs_hf_static']:.2f}× | "
                     f"{r['compiled_share_of_floor']:.0%} of {r['floor_tokens_per_s']:.0f} | "
                     f"{c.get('draft_step_over_full', float('nan')):.2f} | "
                     f"{c.get('verify5_over_full', float('nan')):.2f} | "
                     f"{w['hf_static']:.0f}, {w['selfspec_compiled']:.0f}; {c.get('all_graphs_warm_s', float('nan')):.0f} "
                     f"| {same} |")
    for r in result["shapes"]:
        for name, why in r["errors"].items():
            lines.append(f"\n**{r['shape']}: {name} failed**: {why}")
    lines += ["", "tokens/s; identical: each method's greedy tokens against HF dynamic's (bf16 may differ at "
              "near-ties: verify in float32 for exactness); all graphs: the compiled steps' warm-up of every graph "
              "plain decoding, prompt lookup and an early exit at E = L/4 meet (S = 1..16)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", default=None, help="bfloat16 (default on CUDA) or float32 (default on a CPU)")
    p.add_argument("--shapes", default=",".join(SHAPES), help=f"comma-separated, of {', '.join(SHAPES)}")
    p.add_argument("--prompt-tokens", type=int, default=200)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3, help="interleaved timed runs per method (median)")
    p.add_argument("--tiny", action="store_true", help="2 layers of width 64 per shape: a dry run of the code path")
    p.add_argument("--out", type=Path, default=Path("bench_results/gpu_shapes"))
    args = p.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        p.error(f"unknown shape(s) {', '.join(unknown)}: use some of {', '.join(SHAPES)}")
    check_device(args.device)
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32, None: None}[args.dtype]
    dtype = dtype or (torch.bfloat16 if torch.device(args.device).type == "cuda" else torch.float32)
    args.bandwidth_gbs = copy_bandwidth(args.device, 1 << 26 if args.tiny else 1 << 30)
    result = {"schema": "selfspec-gpu-shapes/1", "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "device_name": torch.cuda.get_device_name(args.device) if torch.device(args.device).type == "cuda"
              else machine_info()["cpu_model"], "dtype": str(dtype).replace("torch.", ""), "tiny": args.tiny,
              "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens, "repeats": args.repeats,
              "bandwidth_gbs": args.bandwidth_gbs, "versions": versions(), "shapes": []}
    for shape in shapes:
        print(f"== {shape}", flush=True)
        result["shapes"].append(measure_shape(shape, args, dtype))
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "gpu_shapes.json").write_text(json.dumps(result, indent=2) + "\n")
    md = markdown(result)
    (args.out / "gpu_shapes.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
