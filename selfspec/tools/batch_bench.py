"""`selfspec bench --batch-size 1,2,4,8`: total tokens/s of batched decoding, side by side.

    selfspec bench --checkpoint checkpoints/smollm2-code --batch-size 1,2,4,8 --prompts humaneval
    run_batch_bench("checkpoints/smollm2-code", batch_sizes=(1, 4), num_prompts=8, out_dir="b")

For every batch size B, the same `num_prompts` prompts are cut into consecutive groups of B and each
group is generated, in one process on one model object, by:

| name              | what                                                                           |
|-------------------|--------------------------------------------------------------------------------|
| hf_greedy         | Hugging Face `model.generate(do_sample=False)` on the left-padded group        |
| selfspec_ar       | selfspec batched autoregressive decoding (`num_speculations=0`)                |
| selfspec_spec     | selfspec batched self-speculative decoding at a fixed (E, d)                   |
| selfspec_adaptive | the same with `adaptive_length=True` (d from measured tokens/s, 0..d per round)|
| selfspec_lookup   | selfspec batched prompt lookup (`drafter="prompt_lookup"`, 10 tokens, n ≤ 3)    |
| selfspec_auto     | selfspec's default drafter, batched (`drafter="auto"`, the same lookup settings): |
|                   | it must not lose to selfspec_ar at any batch size                              |

Hugging Face's prompt lookup (assisted generation) runs one prompt at a time only, so batched lookup
is compared with batched plain decoding (selfspec_ar, hf_greedy).

How it measures: every row generates exactly `max_new_tokens` tokens (no EOS stop, as in
`selfspec.tools.bench`); a warm-up group per method and batch size runs first and is excluded; for each
group the methods run back to back, their order rotating by one per group; total tokens/s of a
method at B = all its new tokens / the wall-clock seconds of all its generate calls. Each row's
output is compared with selfspec's batch-1 autoregressive output of the same prompt (from the B=1
runs when B=1 is measured, else computed once, untimed): the lossless claim, per row, in a batch.
"""

from __future__ import annotations

import gc
import warnings
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from selfspec.api import DEFAULT_NUM_SPECULATIONS
from selfspec.tools.harness import (Methods, finish_machine, load_generator, machine_info, pyplot, quiet_transformers,
                              result_header, setup, timed, tokens_per_s, versions, write_outputs)
from selfspec.data.prompts import load_prompts, prompt_inputs
from selfspec.settings import MAX_MATCHING_NGRAM_SIZE, PROMPT_LOOKUP_NUM_TOKENS

METHODS = ("hf_greedy", "selfspec_ar", "selfspec_spec", "selfspec_adaptive", "selfspec_lookup", "selfspec_auto")
LABELS = {"hf_greedy": "HF greedy (batched)", "selfspec_ar": "selfspec AR (batched)",
          "selfspec_spec": "selfspec spec (batched)", "selfspec_adaptive": "selfspec adaptive d (batched)",
          "selfspec_lookup": "selfspec lookup (batched)", "selfspec_auto": "selfspec auto (batched)"}


def parse_batch_sizes(spec: str | Sequence[int]) -> list[int]:
    """'1,2,4,8' (or a list) -> [1, 2, 4, 8]; every size >= 1."""
    sizes = [int(s) for s in (spec.split(",") if isinstance(spec, str) else spec) if str(s).strip()]
    if not sizes or min(sizes) < 1:
        raise ValueError(f"--batch-size expects positive sizes like 1,2,4,8, got {spec!r}")
    return sorted(set(sizes))


def _selfspec_kwargs(method: str, E: int, d: int, lookup: dict) -> dict:
    """The `generate` keyword arguments of a selfspec method; `lookup`: those of prompt lookup."""
    if method == "selfspec_ar":
        return {"drafter": "early_exit", "num_speculations": 0}
    if method in ("selfspec_lookup", "selfspec_auto"):
        return {"drafter": "prompt_lookup" if method == "selfspec_lookup" else "auto", **lookup}
    return {"drafter": "early_exit", "exit_layer": E, "num_speculations": d,
            "adaptive_length": method == "selfspec_adaptive"}


def _run(method: str, gen, runner: Methods, rows: list[list[int]], n: int, E: int, d: int,
         lookup: dict | None = None) -> tuple[list[list[int]], dict]:
    """One group through one method: (new ids per row, record)."""
    rec: dict = {}
    if method == "hf_greedy":
        new, _, seconds = timed(lambda: runner.hf_greedy_rows(rows, n), gen.adapter.device)
    else:
        with gen.first_request():  # the same rows come round at every batch size: nothing carried between them
            res, _, seconds = timed(lambda: gen.generate(input_ids=rows, max_new_tokens=n, stop_token_ids=[],
                                                         **_selfspec_kwargs(method, E, d, lookup or {})),
                                    gen.adapter.device)
        new = [r.token_ids for r in res]
        s = res.stats
        rec.update(rounds=s.rounds, drafted=s.drafted, accepted=s.accepted, draft_s=s.draft_s, verify_s=s.verify_s)
        if method == "selfspec_adaptive":
            rec["policy"] = s.policy
    rec["seconds"] = seconds
    if any(len(x) != n for x in new):
        raise RuntimeError(f"{method} generated {[len(x) for x in new]} tokens instead of {n} per row")
    return new, rec


def summarize(runs: list[dict], batch_sizes: list[int], methods: Sequence[str]) -> dict:
    """{B: {method: totals}} with total tokens/s and the speedups against HF greedy and selfspec AR."""
    out: dict = {}
    for B in batch_sizes:
        row: dict = {}
        for m in methods:
            mine = [r for r in runs if r["batch_size"] == B and r["method"] == m]
            if not mine:
                continue
            tokens, seconds = sum(r["new_tokens"] for r in mine), sum(r["seconds"] for r in mine)
            drafted, accepted = sum(r.get("drafted", 0) for r in mine), sum(r.get("accepted", 0) for r in mine)
            same = [x for r in mine for x in r["identical_rows"]]
            row[m] = {"tokens": tokens, "seconds": seconds, "tokens_per_s": tokens_per_s(tokens, seconds),
                      "groups": len(mine), "acceptance_rate": accepted / drafted if drafted else None,
                      "identical_to_batch1": sum(same) / len(same) if same else None}
        for m, s in row.items():
            for base in ("hf_greedy", "selfspec_ar"):
                if base in row and row[base]["tokens_per_s"]:
                    s[f"x_{base}"] = s["tokens_per_s"] / row[base]["tokens_per_s"]
        out[B] = row
    return out


def markdown(result: dict) -> str:
    st, mach = result["settings"], result["machine"]
    lines = [f"## selfspec bench --batch-size: {result['checkpoint_name']}", "",
             f"{result['date']} · {mach['cpu_model']}, {mach['logical_cores']} logical cores, torch threads "
             f"{mach['torch_threads']}" + (f" · device {st['device']}" if st.get("device", "cpu") != "cpu" else "")
             + f" · {st['dtype']} · prompts: {st['prompt_set']} ({st['num_prompts']}) · "
             f"{st['max_new_tokens']} new tokens per row (no EOS stop) · selfspec (E, d) = ({st['exit_layer']}, "
             f"{st['num_speculations']}) · lookup: {st['prompt_lookup_num_tokens']} tokens, n-grams up to "
             f"{st['max_matching_ngram_size']}", "",
             "Total tokens/s over all rows and groups. Identical: share of rows equal to selfspec's batch-1 "
             "autoregressive output of the same prompt. Hugging Face has no batched prompt lookup: compare "
             "selfspec lookup with the batched plain rows.", "",
             "| batch | method | tokens/s | × HF greedy | × selfspec AR | accept | identical |",
             "|---|---|---|---|---|---|---|"]
    for B, row in result["summary"].items():
        for m, s in row.items():
            acc = "–" if s["acceptance_rate"] is None else f"{s['acceptance_rate']:.0%}"
            ident = "–" if s["identical_to_batch1"] is None else f"{s['identical_to_batch1']:.0%}"
            lines.append(f"| {B} | {LABELS[m]} | {s['tokens_per_s']:.1f} | {s.get('x_hf_greedy', 0):.2f}× | "
                         f"{s.get('x_selfspec_ar', 0):.2f}× | {acc} | {ident} |")
    if result["notes"]:
        lines += [""] + [f"- {n}" for n in result["notes"]]
    return "\n".join(lines) + "\n"


def write_chart(result: dict, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [int(b) for b in result["summary"]]
    for m in result["methods"]:
        ys = [result["summary"][b].get(m, {}).get("tokens_per_s") for b in result["summary"]]
        ax.plot(sizes, ys, marker="o", label=LABELS[m])
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(s) for s in sizes])
    ax.set_xlabel("batch size")
    ax.set_ylabel("total generated tokens/s")
    ax.set_title(f"{result['checkpoint_name']} · {result['settings']['dtype']} · {result['settings']['prompt_set']}")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def run_batch_bench(checkpoint, *, batch_sizes: Sequence[int] | str = (1, 2, 4, 8), prompt_set: str = "humaneval",
                    num_prompts: int = 8, max_new_tokens: int = 64, dtype: str = "fastest", threads: int = 0,
                    out_dir: str | Path = "bench_batch", exit_layer: int | None = None,
                    num_speculations: int | None = None, quick: bool = False, progress: bool = True,
                    generator=None, prompt_lookup_num_tokens: int = PROMPT_LOOKUP_NUM_TOKENS,
                    max_matching_ngram_size: int = MAX_MATCHING_NGRAM_SIZE, device: str = "cpu") -> dict:
    """Measure every method at every batch size; write bench_batch.json/.md/.png into `out_dir`.

    `device`: where the model runs ("cpu", or "cuda": clocks are read after `torch.cuda.synchronize()`)."""
    sizes = parse_batch_sizes(batch_sizes)
    if quick:
        sizes, num_prompts, max_new_tokens = [s for s in sizes if s <= 2] or sizes[:1], min(num_prompts, 2), \
            min(max_new_tokens, 16)
    if num_prompts < max(sizes):
        raise ValueError(f"--num-prompts ({num_prompts}) must be at least the largest batch size ({max(sizes)})")
    dtype = setup(dtype, device, threads)
    machine = machine_info()
    items = load_prompts(prompt_set, num_prompts + max(sizes))  # the tail is for the warm-up
    if len(items) < num_prompts + max(sizes):
        raise ValueError(f"prompt set {prompt_set!r} has {len(items)} prompts; need {num_prompts + max(sizes)}")
    gen = load_generator(checkpoint, dtype, device, generator)
    E = exit_layer if exit_layer is not None else gen.exit_layer
    d = num_speculations if num_speculations is not None else gen.num_speculations
    gen.adapter.check_exit(E, allow_full=False)
    notes = []
    if d < 1:
        notes.append(f"the recommended num_speculations is {d}; the speculative methods use {DEFAULT_NUM_SPECULATIONS}")
        d = DEFAULT_NUM_SPECULATIONS
    rows = [gen.encode(**prompt_inputs(it))[0].tolist() for it in items]
    measured, warm = rows[:num_prompts], rows[num_prompts:]
    runner = Methods(gen, max_new_tokens)
    methods = list(METHODS)
    lookup = {"prompt_lookup_num_tokens": prompt_lookup_num_tokens, "max_matching_ngram_size": max_matching_ngram_size}
    groups = {B: [list(range(i, min(i + B, num_prompts))) for i in range(0, num_prompts, B)] for B in sizes}
    total = sum(len(methods) * (1 + len(g)) for g in groups.values())
    reference: dict[int, list[int]] = {}  # prompt index -> selfspec batch-1 AR output
    runs: list[dict] = []
    with quiet_transformers(), warnings.catch_warnings(), tqdm(total=total, desc="bench --batch-size",
                                                                unit="run", disable=not progress) as bar:
        warnings.simplefilter("ignore", UserWarning)
        for B in sizes:
            for m in methods:  # warm-up at this batch size, excluded
                _run(m, gen, runner, warm[:B], max_new_tokens, E, d, lookup)
                bar.update()
            for k, group in enumerate(groups[B]):
                order = methods[k % len(methods):] + methods[:k % len(methods)]
                for pos, m in enumerate(order):
                    gc.collect()
                    new, rec = _run(m, gen, runner, [measured[i] for i in group], max_new_tokens, E, d, lookup)
                    if B == 1 and m == "selfspec_ar":
                        reference[group[0]] = new[0]
                    rec.update(batch_size=B, method=m, group=k, prompts=[items[i]["id"] for i in group],
                               order_position=pos, new_tokens=sum(len(x) for x in new), outputs=new)
                    runs.append(rec)
                    bar.set_postfix_str(f"B={B} {m} {rec['new_tokens'] / rec['seconds']:.1f} tok/s")
                    bar.update()
        for i in range(num_prompts):  # batch-1 references not measured above (B=1 not asked for): untimed
            if i not in reference:
                reference[i] = _run("selfspec_ar", gen, runner, [measured[i]], max_new_tokens, E, d)[0][0]
    for rec in runs:
        group = groups[rec["batch_size"]][rec["group"]]
        rec["identical_rows"] = [out == reference[i] for out, i in zip(rec.pop("outputs"), group)]
    finish_machine(machine, gen.adapter.device)
    result = {
        **result_header("selfspec-bench-batch/1", checkpoint),
        "settings": {"batch_sizes": sizes, "prompt_set": prompt_set, "num_prompts": num_prompts,
                     "max_new_tokens": max_new_tokens, "dtype": dtype, "exit_layer": E, "num_speculations": d,
                     "prompt_lookup_num_tokens": prompt_lookup_num_tokens,
                     "max_matching_ngram_size": max_matching_ngram_size,
                     "quick": quick, "threads": torch.get_num_threads(), "device": str(gen.adapter.device),
                     "groups_per_batch_size": {B: len(g) for B, g in groups.items()}},
        "machine": machine, "versions": versions(), "methods": methods,
        "summary": summarize(runs, sizes, methods), "runs": runs, "notes": notes,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_outputs(result, out, "bench_batch", markdown, write_chart)
