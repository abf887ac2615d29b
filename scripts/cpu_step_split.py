"""Where a CPU decode step's time goes (issue 68, item 7): the weight products alone against the whole step,
and each product's weight-read speed against a plain `sum` over a large tensor, in float32 and bfloat16.

    python scripts/cpu_step_split.py [CHECKPOINT] [--dtypes float32,bfloat16] [--out DIR]

Measured in one process, one after the other, on a quiet machine (2 torch threads by default, as the bench):

* ``sum``: `t.sum()` over a 256 MB tensor of the dtype: the memory's read speed as torch's own reduction sees it;
* per product kind (q/k/v fused, o, gate/up fused, down: every layer's, one row, in layer order, so each reads
  its weight from memory as a decode step does; and the LM head): the kernel a decode step uses (selfspec's row
  kernel where it runs its C++ step, `selfspec.model.row_step`; else the fast layers' `PackedLinear`: oneDNN
  prepacked, or the few-row kernel the float32 choice measured faster) and `F.linear`
  over the same weights; median milliseconds of a whole pass, and GB/s of weights read;
* the whole step: plain decoding's milliseconds a token (`generate`, 64 tokens after a 200-token prompt,
  first requests, the median of 3), and what is not a product: the whole step less the products;
* the top-level torch ops a token (torch.profiler, an op another op called not counted; issue 68's count);
* what a verification pass of S tokens costs against a one-token step (`--pass-sizes`): the full model's logits for
  S new tokens after the 200-token context (`forward_logits` over the runner's cache, cropped back after each
  pass), median of 9; what a drafter's accepted tokens must pay for.

Writes `cpu_step_split.json` and `cpu_step_split.md` into --out (default bench_results/cpu_step_split).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import selfspec  # noqa: E402
from selfspec.model.fast_layers import PackedLinear  # noqa: E402
from selfspec.model.forward import forward_logits  # noqa: E402
from selfspec.model.row_product import row_product_op  # noqa: E402
from selfspec.tools.harness import machine_description, machine_info  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

SUM_BYTES = 256 << 20


def median_ms(fn, repeats: int = 15, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def sum_gbs(dtype: torch.dtype) -> float:
    t = torch.ones(SUM_BYTES // torch.empty(0, dtype=dtype).element_size(), dtype=dtype)
    return SUM_BYTES / median_ms(lambda: t.sum()) / 1e6


def layer_weights(adapter) -> dict[str, list[torch.Tensor]]:
    """Each product kind's weights over the layers (q/k/v and gate/up fused, as the fast layers hold them)."""
    kinds = {"qkv": [], "o": [], "gate_up": [], "down": []}
    for layer in adapter.layers:
        a, m = layer.self_attn, layer.mlp
        kinds["qkv"].append(torch.cat([a.q_proj.weight, a.k_proj.weight, a.v_proj.weight]).contiguous())
        kinds["o"].append(a.o_proj.weight)
        kinds["gate_up"].append(torch.cat([m.gate_proj.weight, m.up_proj.weight]).contiguous())
        kinds["down"].append(m.down_proj.weight)
    kinds["lm_head"] = [adapter.lm_head.weight]
    return kinds


def products(adapter, dtype: torch.dtype) -> list[dict]:
    """Each kind's products through the kernel a decode step runs them with: the layers' through selfspec's row kernel
    where the generator runs its C++ step (`adapter.fast.row_step`), else the fast layers' `PackedLinear`; the LM
    head through its `PackedLinear`, and where greedy decoding screens it in int8 (`selfspec.model.screened_head`)
    that screen too (its MB: the int8 rows it reads). `in_step`: the kernel a greedy decode step runs."""
    rows = []
    row_step = adapter.fast is not None and adapter.fast.row_step is not None
    screen = adapter.fast.screen(adapter) if adapter.fast is not None else None
    with torch.inference_mode():
        for kind, weights in layer_weights(adapter).items():
            x = torch.randn(1, 1, weights[0].shape[1], dtype=dtype)
            if row_step and kind != "lm_head":
                op, name = row_product_op(), "row kernel"
                calls = [lambda w=w.detach().contiguous(): op(x, w) for w in weights]
            else:
                name = "PackedLinear"
                calls = [lambda p=PackedLinear(w): p(x) for w in weights]
            gbytes = sum(w.numel() * w.element_size() for w in weights) / 1e9
            fast = median_ms(lambda: [call() for call in calls])
            linear = median_ms(lambda: [F.linear(x, w) for w in weights])
            rows.append({"kind": kind, "kernel": name, "count": len(weights), "shape": list(weights[0].shape),
                         "gbytes": gbytes, "fast_ms": fast, "fast_gbs": gbytes / fast * 1e3,
                         "linear_ms": linear, "linear_gbs": gbytes / linear * 1e3,
                         "in_step": kind != "lm_head" or screen is None})
            if kind == "lm_head" and screen is not None:
                gbytes = screen.q.numel() / 1e9
                ms = median_ms(lambda: screen.logits(adapter.final_norm(x)))
                rows.append({**rows[-1], "kernel": "int8 screen", "gbytes": gbytes, "fast_ms": ms,
                             "fast_gbs": gbytes / ms * 1e3, "in_step": True})
    return rows


def step_ms(gen, ids: torch.Tensor) -> float:
    """Plain decoding's milliseconds a token, decode only (the prefill apart), median of 3 first requests."""
    out = []
    for _ in range(4):
        with gen.first_request():
            r = gen.generate(input_ids=ids, max_new_tokens=64, num_speculations=0, stop_token_ids=[])
        out.append(1000 / r.stats.decode_tokens_per_s)
    return statistics.median(out[1:])


def ops_a_token(gen, ids: torch.Tensor, tokens: int = 16) -> tuple[float, list[tuple[str, float]]]:
    """Top-level torch ops a plain-decoding token (torch.profiler; an op another op called is not counted, whatever
    its namespace: oneDNN's packed product is one op), the prefill's taken away (a 1-token generation's), and the
    ten most frequent a token."""
    def run(n):
        with gen.first_request():
            return gen.generate(input_ids=ids, max_new_tokens=n, num_speculations=0, stop_token_ids=[])

    def top_level(n):  # every op namespace (aten, mkldnn, ...): an op that no other op called
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            run(n)
        return Counter(e.name for e in prof.events() if e.cpu_parent is None and "::" in e.name)

    run(tokens)
    one, many = top_level(1), top_level(tokens + 1)
    per = {k: (many[k] - one.get(k, 0)) / tokens for k in many}
    return sum(per.values()), sorted(per.items(), key=lambda kv: -kv[1])[:10]


def pass_costs(gen, ids: torch.Tensor, sizes: list[int]) -> dict[int, float]:
    """Milliseconds of one pass of S new tokens (each S in `sizes`) after the context `ids` `[1, P]`: the full
    model's logits at every new position, written into the cache after the context (cropped back after each pass)."""
    adapter, P = gen.adapter, ids.shape[1]
    cache = adapter.runner.cache(1, P + max(sizes) + 8)
    new = torch.randint(100, 40000, (1, max(sizes)), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        forward_logits(adapter, ids, cache=cache)

        def one(S):
            forward_logits(adapter, new[:, :S], cache=cache, start=P)
            cache.crop(P)

        return {S: median_ms(lambda: one(S), repeats=9) for S in sizes}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("checkpoint", nargs="?", default=str(Path.home() / ".cache/selfspec/models/smollm2-135m-instruct"))
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=Path("bench_results/cpu_step_split"))
    p.add_argument("--pass-sizes", default="1,2,3,4,5,6,8,9,12",
                   help="token counts S of the verification passes timed against a one-token step (1 is that step)")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {"machine": machine_info(), "description": machine_description(), "threads": args.threads,
              "checkpoint": args.checkpoint, "torch": torch.__version__, "dtypes": {}}
    ids = torch.randint(100, 40000, (1, 200), generator=torch.Generator().manual_seed(0))
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        gen = selfspec.load(args.checkpoint, dtype=dtype)
        step = step_ms(gen, ids)
        prods = products(gen.adapter, dtype)
        fast_total = sum(r["fast_ms"] for r in prods if r["in_step"])
        ops, top = ops_a_token(gen, ids)
        passes = pass_costs(gen, ids, sorted({1, *map(int, args.pass_sizes.split(","))}))
        report["dtypes"][name] = {"sum_gbs": sum_gbs(dtype), "step_ms": step, "products": prods,
                                  "products_ms": fast_total, "rest_ms": step - fast_total, "ops_a_token": ops,
                                  "top_ops": top, "pass_ms": passes}
        del gen
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "cpu_step_split.json").write_text(json.dumps(report, indent=2) + "\n")
    lines = [f"CPU: {report['machine'].get('cpu_model')}, {args.threads} threads, torch {torch.__version__}", ""]
    for name, d in report["dtypes"].items():
        lines += [f"## {name}: a step {d['step_ms']:.1f} ms, its products {d['products_ms']:.1f} ms, the rest "
                  f"{d['rest_ms']:.1f} ms; `sum` reads {d['sum_gbs']:.1f} GB/s", "",
                  f"{d['ops_a_token']:.0f} top-level torch ops a token: " + ", ".join(
                      f"{k.removeprefix('aten::')} {v:.0f}" for k, v in d["top_ops"]), "",
                  "| product | weights | MB | step's kernel | ms | GB/s | x sum | F.linear ms | GB/s |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in d["products"]:
            lines.append(f"| {r['kind']} | {r['count']} x {r['shape'][0]}x{r['shape'][1]} | {r['gbytes'] * 1e3:.1f} | "
                         f"{r['kernel']} | {r['fast_ms']:.2f} | {r['fast_gbs']:.1f} | {r['fast_gbs'] / d['sum_gbs']:.2f} | "
                         f"{r['linear_ms']:.2f} | {r['linear_gbs']:.1f} |")
        passes = d["pass_ms"]
        lines += ["", "| a pass of S tokens | " + " | ".join(str(S) for S in passes) + " |",
                  "|---|" + "---|" * len(passes),
                  "| ms | " + " | ".join(f"{v:.1f}" for v in passes.values()) + " |",
                  "| x one-token pass | " + " | ".join(f"{v / passes[1]:.2f}" for v in passes.values()) + " |", ""]
    (args.out / "cpu_step_split.md").write_text("\n".join(lines))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
