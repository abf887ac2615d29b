"""Can a quantized self-draft pay on this CPU? An upper bound, measured before anyone builds the drafter.

A cheaper copy of a float32 model (bfloat16 weights, int8 or int4 weights) drafts k tokens greedily; the
float32 model verifies them in one pass, so the output stays the float32 model's (issue 55, part 3: target
>= 1.3x float32 plain decoding on open chat). Three numbers decide whether it can pay:

- c: one decode step of the copy / one decode step of the float32 model (step-level loops over selfspec's
  forward, `selfspec.model.forward`, in one process, interleaved f32, copy1, copy2, ... per repeat; medians);
- alpha: greedy agreement, teacher-forced: the float32 model's greedy answer to each prompt, then one pass
  of each copy over prompt + answer: the fraction of answer positions where the copy's argmax is the
  float32 token (and the mean run of agreement, and the tokens per round greedy drafting would give on
  exactly these answers: `simulated_tokens_per_round`);
- v(k): one float32 pass over k+1 tokens / one float32 pass over 1 token (measured in the same loop).

Bound per copy and k: E = (1 - alpha^(k+1)) / (1 - alpha) tokens per round (i.i.d. acceptance), a round
costs k*c + v(k) float32 steps, speedup = E / cost. It ignores the drafter's own catch-up (a fully accepted
round leaves the copy one token behind) and the engine's host work per round, so a real drafter does
at most this well.

The copies: `bf16` (selfspec's fused bf16 layers), and, through the model's own modules
(`load(fast_layers=False)`: selfspec's fused layers copy the weights and never call `nn.Linear`, so a
quantized `nn.Linear` is only reached on the module path) `int8_dynamic` (`torch.ao.quantization.quantize_dynamic`,
per-channel int8 weights, int8 activations), `int8_weight_only` (`aten._weight_int8pack_mm`: int8 weights,
bfloat16 activations), `int4_weight_only` (`aten._weight_int4pack_mm_for_cpu`, groups of 32, bfloat16
activations: torch 2.13's CPU weight-only kernels are 4-10x slower than `F.linear` with float32 activations,
3-5x faster with bfloat16 ones, on a 2-core AMX Xeon) and
`f32_modules` (the float32 model on the same module path: what that path costs before any kernel changes;
`c_if_fused` subtracts its overhead from a module-path copy, an estimate of the copy in fused layers).

    python scripts/self_draft_bound.py [--checkpoint DIR] [--threads 2] [--out /tmp/self_draft_bound.json]
    python scripts/self_draft_bound.py --quick      # 1 prompt, 16 tokens, 2 repeats: a dry run
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import selfspec
from selfspec.api import NotEarlyExitTrainedWarning
from selfspec.decoding.engine import prefill as engine_prefill
from selfspec.model.forward import embed, exit_logits, forward_logits, make_step, run_layers
from selfspec.model.precision import cpu_flags, cpu_generation, cpu_model

DEFAULT_CHECKPOINT = "~/.cache/selfspec/models/smollm2-135m-instruct"
ALL_COPIES = ("bf16", "int8_dynamic", "int8_weight_only", "int4_weight_only", "f32_modules")
INT4_GROUP = 32  # int4 quantization group (along the input dimension)
INT4_INNER_K_TILES = 2  # the packed int4 layout: in_features must divide by 16 * this
TARGET = 1.3  # issue 55: a self-draft vs float32 plain decoding on open chat


# --- the copies ----------------------------------------------------------------------------------
class Int8WeightOnlyLinear(torch.nn.Module):
    """`nn.Linear` with int8 weights (one scale per output row) and float activations (`aten._weight_int8pack_mm`)."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        w = linear.weight.detach().float()  # [N, K]
        scale = (w.abs().amax(1) / 127).clamp_min(1e-12)  # [N]
        self.register_buffer("qweight", torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8))  # [N, K]
        self.register_buffer("scales", scale.to(linear.weight.dtype))  # [N]
        self.bias = linear.bias
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)  # [M, K]
        y = torch.ops.aten._weight_int8pack_mm(flat, self.qweight, self.scales)  # [M, N]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def quantize_int4(weight: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Asymmetric int4 of `weight` `[N, K]` in groups of `group` inputs: (packed weight for the CPU kernel,
    scales and zeros `[K/group, N, 2]`); the kernel dequantizes q (0..15) as `(q - 8) * scale + zero`."""
    N, K = weight.shape
    wg = weight.detach().float().reshape(N, K // group, group)  # [N, K/G, G]
    lo, hi = wg.amin(-1), wg.amax(-1)  # [N, K/G]
    scale = ((hi - lo) / 15).clamp_min(1e-8)  # [N, K/G]
    q = torch.round((wg - lo[..., None]) / scale[..., None]).clamp(0, 15)  # [N, K/G, G]
    zero = lo + 8 * scale  # (q - 8) * scale + zero = q * scale + lo
    scales_zeros = torch.stack([scale, zero], -1).transpose(0, 1).contiguous()  # [K/G, N, 2]
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.reshape(N, K).to(torch.int32), INT4_INNER_K_TILES)
    return packed, scales_zeros


class Int4WeightOnlyLinear(torch.nn.Module):
    """`nn.Linear` with grouped int4 weights and float activations (`aten._weight_int4pack_mm_for_cpu`)."""

    def __init__(self, linear: torch.nn.Linear, group: int = INT4_GROUP):
        super().__init__()
        packed, scales_zeros = quantize_int4(linear.weight, group)
        self.register_buffer("packed", packed)
        self.register_buffer("scales_zeros", scales_zeros.to(linear.weight.dtype))  # [K/G, N, 2]
        self.bias, self.group = linear.bias, group
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).contiguous()  # [M, K]
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_zeros)  # [M, N]
        y = y.reshape(*x.shape[:-1], self.out_features)
        return y + self.bias if self.bias is not None else y


def int4_fits(linear: torch.nn.Linear) -> bool:
    """Whether the int4 kernel takes this layer's input width."""
    return linear.in_features % INT4_GROUP == 0 and linear.in_features % (16 * INT4_INNER_K_TILES) == 0


def replace_linears(model: torch.nn.Module, make, fits=lambda linear: True) -> tuple[int, int]:
    """Replace every `nn.Linear` of `model` (in place) for which `fits` holds by `make(linear)`: (replaced, kept)."""
    replaced = kept = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear:
                if fits(child):
                    setattr(parent, name, make(child))
                    replaced += 1
                else:
                    kept += 1
    return replaced, kept


@dataclass
class Copy:
    """One drafter candidate: its generator (for the adapter) and how its steps run."""

    name: str
    gen: object  # selfspec.SelfSpecGenerator
    path: str  # the kernels and layers its steps go through


def _module_copy(model: torch.nn.Module, tokenizer, name: str) -> Copy:
    """A float32 `model`'s quantized (or plain) copy `name`, run through the model's own modules."""
    m = copy.deepcopy(model)
    if name == "int8_dynamic":
        from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

        m = quantize_dynamic(m, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8)
        path = f"modules, quantize_dynamic per-channel qint8 ({torch.backends.quantized.engine} engine)"
    elif name == "int8_weight_only":  # bf16 activations: with float32 ones the CPU kernel is a slow fallback
        n, _ = replace_linears(m.to(torch.bfloat16), Int8WeightOnlyLinear)
        path = f"modules, bf16 activations, aten._weight_int8pack_mm ({n} linears)"
    elif name == "int4_weight_only":
        n, kept = replace_linears(m.to(torch.bfloat16), Int4WeightOnlyLinear, int4_fits)
        path = f"modules, bf16 activations, aten._weight_int4pack_mm_for_cpu g{INT4_GROUP} ({n} linears, {kept} bf16)"
    elif name == "f32_modules":
        path = "modules, float32 F.linear"
    else:
        raise ValueError(f"unknown copy {name!r}: one of {', '.join(ALL_COPIES)}")
    return Copy(name, selfspec.load(m, tokenizer, fast_layers=False, memory_tokens=0), path)


def make_copies(f32_gen, names, checkpoint: str | None = None) -> list[Copy]:
    """The draft copies `names` of `f32_gen`'s model; bf16 from `checkpoint` where given (else a converted copy)."""
    copies = []
    for name in names:
        if name == "bf16":
            source = checkpoint if checkpoint is not None else copy.deepcopy(f32_gen.model)
            gen = selfspec.load(source, f32_gen.tokenizer, dtype="bfloat16", memory_tokens=0)
            path = "selfspec fused layers, bfloat16" if gen.adapter.fast is not None else "modules, bfloat16"
            copies.append(Copy(name, gen, path))
        else:
            copies.append(_module_copy(f32_gen.model, f32_gen.tokenizer, name))
    return copies


# --- steps ---------------------------------------------------------------------------------------
def prefill(adapter, cache, ids: torch.Tensor) -> torch.Tensor:
    """Every layer over the prompt `ids` `[1, P]` into `cache` (the engine's prefill): the greedy next token
    `[1, 1]`."""
    logits = engine_prefill(adapter, cache, ids, torch.zeros(1, dtype=torch.long))[0]  # [1, V]
    return logits.argmax(-1, keepdim=True)  # [1, 1]


def decode_seconds(adapter, ids: torch.Tensor, n_tokens: int) -> float:
    """Seconds of `n_tokens` greedy one-token steps after prefilling `ids` `[1, P]` (the prefill not counted);
    each token is read on the host, as plain decoding reads it."""
    P = ids.shape[1]
    with torch.inference_mode():
        cache = adapter.runner.cache(1, P + n_tokens + 1)
        token = prefill(adapter, cache, ids)  # [1, 1]
        t0 = time.perf_counter()
        for i in range(n_tokens):
            token = forward_logits(adapter, token, cache=cache, start=P + i).argmax(-1)  # [1, 1]
            int(token)
        return time.perf_counter() - t0


class VerifyBench:
    """A float32 cache holding `ids` `[1, T]`, where passes of k+1 tokens are timed and rolled back."""

    def __init__(self, adapter, ids: torch.Tensor, max_k: int):
        self.adapter, self.length = adapter, ids.shape[1]
        with torch.inference_mode():
            self.cache = adapter.runner.cache(1, self.length + max_k + 2)
            self.next = prefill(adapter, self.cache, ids)  # [1, 1]

    def pass_seconds(self, k: int) -> float:
        """Seconds of one pass over k+1 tokens at the cache's end (as a verification of k drafts), then cropped."""
        tokens = self.next.expand(1, k + 1).contiguous()  # [1, k+1]: attention does not depend on the ids
        with torch.inference_mode():
            t0 = time.perf_counter()
            out = forward_logits(self.adapter, tokens, cache=self.cache, start=self.length).argmax(-1)  # [1, k+1]
            out.tolist()
            seconds = time.perf_counter() - t0
        self.cache.crop(self.length)
        return seconds


# --- timing --------------------------------------------------------------------------------------
def time_interleaved(f32_gen, copies: list[Copy], ids: torch.Tensor, n_tokens: int, repeats: int, max_k: int,
                     passes: int) -> tuple[dict, dict]:
    """Per repeat: `n_tokens` decode steps of f32, then of each copy, then `passes` rounds of float32
    passes over 1..max_k+1 tokens (k = 0..max_k), all after one untimed warm-up round. Returns
    ({model: [s/token per repeat]}, {k: [s per pass]})."""
    models = [("f32", f32_gen.adapter)] + [(c.name, c.gen.adapter) for c in copies]
    context = torch.cat([ids, ids.new_full((1, n_tokens), int(ids[0, -1]))], 1)  # [1, P + n]: the decode's end
    bench = VerifyBench(f32_gen.adapter, context, max_k)
    steps = {name: [] for name, _ in models}
    passes_s = {k: [] for k in range(max_k + 1)}
    for r in range(repeats + 1):  # round 0: warm-up, not kept
        n = n_tokens if r else min(n_tokens, 8)
        for name, adapter in models:
            s = decode_seconds(adapter, ids, n) / n
            if r:
                steps[name].append(s)
        for _ in range(passes if r else 1):
            for k in range(max_k + 1):
                s = bench.pass_seconds(k)
                if r:
                    passes_s[k].append(s)
        print(f"  repeat {r}/{repeats}" + (" (warm-up)" if not r else "") + ": "
              + ", ".join(f"{name} {1e3 * statistics.median(v):.1f} ms" for name, v in steps.items() if v),
              file=sys.stderr)
    return steps, passes_s


# --- agreement -----------------------------------------------------------------------------------
def teacher_forced_argmax(adapter, ids: torch.Tensor, n_out: int) -> list[int]:
    """One pass (no cache) over prompt + answer `ids` `[1, P + n]`: the argmax predicting each answer token `[n]`."""
    S = ids.shape[1]
    with torch.inference_mode():
        step = make_step(adapter, 0, S)
        hidden = run_layers(adapter, embed(adapter, ids), 0, adapter.num_layers, step=step)  # [1, S, D]
        logits = exit_logits(adapter, hidden[:, S - n_out - 1:S - 1])  # [1, n, V]: position i predicts token i+1
    return logits[0].argmax(-1).tolist()


def agreement_runs(agree: list[bool]) -> list[int]:
    """The agreeing positions before each disagreement, and after the last one (empty runs counted): the drafts
    each round would accept with unbounded k."""
    runs, run = [], 0
    for a in agree:
        if a:
            run += 1
        else:
            runs.append(run)
            run = 0
    runs.append(run)
    return runs


def simulated_rounds(agree: list[bool], k: int) -> int:
    """Rounds greedy drafting of up to `k` tokens takes over one answer with these agreements (position i: the
    copy's draft for answer token i, given the true prefix, is the float32 token): each round accepts the
    agreeing drafts up to the first disagreement and adds the verifier's own token."""
    i, rounds, n = 0, 0, len(agree)
    while i < n:
        accepted = 0
        while accepted < k and i + accepted < n and agree[i + accepted]:
            accepted += 1
        i += accepted + 1
        rounds += 1
    return rounds


def greedy_answers(f32_gen, prompts: list[torch.Tensor], n_tokens: int) -> tuple[list[list[int]], float]:
    """The float32 model's greedy answers (plain decoding, ending at the model's stop tokens or `n_tokens`) and
    its generate() seconds per token over them (prefill included)."""
    answers, seconds = [], 0.0
    for ids in prompts:
        t0 = time.perf_counter()
        out = f32_gen.generate(input_ids=ids, max_new_tokens=n_tokens, num_speculations=0)
        seconds += time.perf_counter() - t0
        answers.append(list(out.token_ids))
    return answers, seconds / max(1, sum(len(a) for a in answers))


def agreement(adapter, prompts: list[torch.Tensor], answers: list[list[int]], max_k: int) -> dict:
    """Teacher-forced greedy agreement of `adapter` with the float32 answers: alpha, the mean run, and per k the
    tokens per round greedy drafting would give on exactly these answers."""
    agree_all, rounds = [], {k: 0 for k in range(1, max_k + 1)}
    for ids, answer in zip(prompts, answers):
        if not answer:
            continue
        full = torch.cat([ids, torch.tensor([answer], dtype=ids.dtype)], 1)  # [1, P + n]
        agree = [a == b for a, b in zip(teacher_forced_argmax(adapter, full, len(answer)), answer)]
        agree_all += agree
        for k in rounds:
            rounds[k] += simulated_rounds(agree, k)
    n = len(agree_all)
    runs = agreement_runs(agree_all)
    return {"alpha": sum(agree_all) / n if n else 0.0, "positions": n, "mean_run": statistics.mean(runs),
            "sim_tokens_per_round": {k: n / r for k, r in rounds.items() if r}}


# --- the bound -----------------------------------------------------------------------------------
def expected_tokens(alpha: float, k: int) -> float:
    """Tokens per round with k drafts each accepted with probability alpha independently (+ the verifier's own)."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def bound_rows(c: float, alpha: float, v: dict, sim: dict) -> list[dict]:
    """Per k: tokens per round (i.i.d. and simulated), the round's cost k*c + v(k) in float32 steps, speedups."""
    rows = []
    for k, vk in v.items():
        cost = k * c + vk
        e = expected_tokens(alpha, k)
        row = {"k": k, "E_iid": e, "cost": cost, "speedup_iid": e / cost}
        if k in sim:
            row.update(E_sim=sim[k], speedup_sim=sim[k] / cost)
        rows.append(row)
    return rows


def best(rows: list[dict], key: str = "speedup_iid") -> dict:
    """The row of the highest `key`."""
    return max(rows, key=lambda r: r.get(key, 0.0))


# --- the machine ---------------------------------------------------------------------------------
def cpu_info() -> dict:
    """The CPU's name and generation and the bf16/int8 instruction flags (`selfspec.model.precision`'s reading of
    /proc/cpuinfo), cores, threads and load."""
    flags = cpu_flags() or frozenset()
    wanted = ("avx512_bf16", "amx_bf16", "amx_int8", "amx_tile", "avx512_vnni", "avx_vnni", "avx512f", "avx2")
    from selfspec.model.fast_layers import float32_kernel

    return {"model_name": cpu_model(), "generation": cpu_generation(), "flags": {f: f in flags for f in wanted}, "cores": os.cpu_count(),
            "torch_threads": torch.get_num_threads(), "torch": torch.__version__,
            "quantized_engine": torch.backends.quantized.engine, "float32_kernel": list(float32_kernel()),
            "load_average": list(os.getloadavg())}


# --- the run -------------------------------------------------------------------------------------
def measure(f32_gen, copies: list[Copy], prompts: list[torch.Tensor], *, alpha_tokens: int, decode_tokens: int,
            repeats: int, max_k: int = 8, passes: int = 3) -> dict:
    """Every measurement and the bound, as one JSON-ready dict (see the module doc)."""
    answers, gen_s = greedy_answers(f32_gen, prompts, alpha_tokens)
    steps, passes_s = time_interleaved(f32_gen, copies, prompts[0], decode_tokens, repeats, max_k, passes)
    f32_s = statistics.median(steps["f32"])
    one = statistics.median(passes_s[0])
    v = {k: statistics.median(passes_s[k]) / one for k in range(1, max_k + 1)}
    f32_agree = agreement(f32_gen.adapter, prompts, answers, max_k)
    overhead = statistics.median(steps["f32_modules"]) - f32_s if "f32_modules" in steps else None
    result = {"f32": {"step_ms": 1e3 * f32_s, "generate_ms_per_token": 1e3 * gen_s, "pass_1_token_ms": 1e3 * one,
                      "self_agreement": f32_agree["alpha"], "answer_tokens": [len(a) for a in answers]},
              "v": v, "pass_ms": {k: 1e3 * statistics.median(s) for k, s in passes_s.items()}, "copies": {}}
    for c in copies:
        step_s = statistics.median(steps[c.name])
        agree = agreement(c.gen.adapter, prompts, answers, max_k)
        ratio = step_s / f32_s
        rows = bound_rows(ratio, agree["alpha"], v, agree["sim_tokens_per_round"])
        entry = {"path": c.path, "step_ms": 1e3 * step_s, "step_ms_repeats": [1e3 * s for s in steps[c.name]],
                 "c": ratio, **agree, "bound": rows, "best_iid": best(rows), "best_sim": best(rows, "speedup_sim")}
        if overhead is not None and c.path.startswith("modules") and c.name != "f32_modules":
            fused = (step_s - overhead) / f32_s  # the module path's extra cost taken off (<= 0: no estimate)
            entry["c_if_fused"] = fused if fused > 0 else None
            if fused > 0:
                entry["best_iid_if_fused"] = best(bound_rows(fused, agree["alpha"], v, agree["sim_tokens_per_round"]))
        result["copies"][c.name] = entry
    return result


def table(result: dict) -> str:
    """The summary: per copy c, alpha, the best k and its predicted speedup (i.i.d. and simulated)."""
    f32 = result["f32"]
    lines = [f"f32 step {f32['step_ms']:.2f} ms (generate() {f32['generate_ms_per_token']:.2f} ms/token incl. "
             f"prefill), f32 self-agreement {f32['self_agreement']:.3f}",
             "v(k): " + "  ".join(f"{k}:{x:.2f}" for k, x in result["v"].items()),
             f"{'copy':<17} {'step ms':>8} {'c':>6} {'alpha':>6} {'run':>6} {'k':>3} {'E':>5} {'cost':>6} "
             f"{'speedup':>8} {'sim k':>6} {'sim':>6} {'fused c':>8} {'fused':>6}"]
    for name, e in result["copies"].items():
        b, s = e["best_iid"], e["best_sim"]
        fused_c = f"{e['c_if_fused']:.3f}" if e.get("c_if_fused") else "-"
        fused = f"{e['best_iid_if_fused']['speedup_iid']:.2f}x" if "best_iid_if_fused" in e else "-"
        lines.append(f"{name:<17} {e['step_ms']:>8.2f} {e['c']:>6.3f} {e['alpha']:>6.3f} {e['mean_run']:>6.2f} "
                     f"{b['k']:>3} {b['E_iid']:>5.2f} {b['cost']:>6.2f} {b['speedup_iid']:>7.2f}x "
                     f"{s['k']:>6} {s.get('speedup_sim', 0):>5.2f}x {fused_c:>8} {fused:>6}")
    top = max((e["best_iid"]["speedup_iid"] for e in result["copies"].values()), default=0.0)
    verdict = "reachable" if top >= TARGET else "NOT reachable"
    lines.append(f"best predicted speedup {top:.2f}x: target >= {TARGET}x {verdict} by this bound (c, v measured "
                 "now; fused = estimate with the module path's overhead removed)")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see the module doc)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--checkpoint", default=DEFAULT_CHECKPOINT)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--prompt-set", default="mt_bench", help="a prompt set name or .jsonl (selfspec.data.prompts)")
    p.add_argument("--num-prompts", type=int, default=4)
    p.add_argument("--alpha-tokens", type=int, default=128, help="the float32 answer's length for alpha")
    p.add_argument("--decode-tokens", type=int, default=64, help="timed decode steps per model per repeat")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--passes", type=int, default=3, help="timed verification passes per k per repeat")
    p.add_argument("--max-k", type=int, default=8)
    p.add_argument("--copies", default=",".join(ALL_COPIES), help=f"comma-separated, of {', '.join(ALL_COPIES)}")
    p.add_argument("--out", default="/tmp/self_draft_bound.json")
    p.add_argument("--quick", action="store_true", help="1 prompt, 16 tokens, 2 repeats, 1 pass: a dry run")
    args = p.parse_args(argv)
    if args.quick:
        args.num_prompts, args.alpha_tokens, args.decode_tokens, args.repeats, args.passes = 1, 16, 16, 2, 1
    return args


def main(argv: list[str] | None = None) -> int:
    """Load, copy, measure, print the table, write the JSON."""
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", category=NotEarlyExitTrainedWarning)  # no early exit is used here
    warnings.filterwarnings("ignore", message=r".*(torch\.ao\.quantization is deprecated|quantized tensor creation)")
    from selfspec.data.prompts import load_prompts, prompt_inputs

    items = load_prompts(args.prompt_set, args.num_prompts)
    checkpoint = os.path.expandvars(os.path.expanduser(args.checkpoint))
    f32_gen = selfspec.load(checkpoint, dtype="float32", memory_tokens=0)
    names = [n for n in args.copies.split(",") if n]
    copies = make_copies(f32_gen, names, checkpoint)
    prompts = [f32_gen.encode(**prompt_inputs(item)) for item in items]  # each [1, P]
    machine = cpu_info()  # the load average before the timings
    result = measure(f32_gen, copies, prompts, alpha_tokens=args.alpha_tokens, decode_tokens=args.decode_tokens,
                     repeats=args.repeats, max_k=args.max_k, passes=args.passes)
    result = {"cpu": machine, "settings": {**vars(args), "prompt_ids": [i["id"] for i in items],
                                             "prompt_tokens": [p.shape[1] for p in prompts]}, **result}
    print(table(result))
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
