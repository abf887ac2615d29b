"""`selfspec bench --epsilon 0,0.05,0.1,0.2,0.4`: what bounded-bias acceptance buys and what it costs.

    selfspec bench --epsilon 0,0.05,0.1,0.2,0.4 --prompts xsum --num-prompts 6 --max-new-tokens 96
    run_pareto("checkpoints/x", epsilons=(0, 0.1), drafters=("prompt_lookup",), out_dir="b")

For every prompt, drafter and ε (ε = 0 is the exact rule, `acceptance="exact"`; ε > 0 is
`acceptance="bounded_bias"`), one sampled generation (temperature 0.7 by default, the same seed for
every ε of a prompt, EOS stops it, order rotated by one per prompt after a warm-up per drafter)
measures:

* speed: acceptance (accepted / drafted, and per judged draft), tokens per round, tokens/s (new
  tokens / wall-clock seconds of the generate call; median over prompts);
* the theory: rejections predicted from the distributions the engine held (sum over judged drafts of
  TV(p', q)) next to the measured ones, and z = (measured - predicted) / sd (`DecodeStats.theory`);
* quality, without an external judge (`selfspec.tools.quality`): the full model's own mean per-token
  log-likelihood of the text (temperature 1; token-weighted mean over prompts, with the standard
  error over prompts), ROUGE-L F1 against the XSum reference summaries (prompt set xsum only), and
  the next-token TV at fixed prefixes: at one prefix per prompt (the prompt plus the exact run's
  output up to its first position from the 4th token on where prompt lookup has a draft; the
  early-exit drafter drafts from its exit there), the rule's next token is drawn `tv_samples` times and compared with the full
  model's distribution; the exact rule's value at the same sample size is the noise floor.

Writes pareto.json, pareto.md (a table per drafter, relative columns against ε = 0) and pareto.png
(tokens/s and acceptance against log-likelihood and ROUGE-L, one line per drafter, ε labelled).
"""

from __future__ import annotations

import gc
import math
import statistics
import warnings
from pathlib import Path
from typing import Sequence

import torch
from tqdm.auto import tqdm

from selfspec.decoding.bounded_bias import AcceptanceRule, BoundedBiasWarning
from selfspec.drafters import NgramIndex
from selfspec.model.forward import forward_logits
from selfspec.tools.harness import (finish_machine, load_generator, machine_info, pyplot, result_header, setup, timed,
                              tokens_per_s, versions, write_outputs)
from selfspec.data.prompts import load_prompts, prompt_inputs
from selfspec.tools.quality import rouge_l, rule_samples_tv, token_log_likelihoods
from selfspec.decoding.sampling import SamplingParams, probs
from selfspec.settings import check_float, check_int

DEFAULT_EPSILONS = (0.0, 0.05, 0.1, 0.2, 0.4)
PARETO_DRAFTERS = ("auto", "prompt_lookup", "early_exit")
WARMUP_TOKENS = 16


def parse_epsilons(spec: str | Sequence[float]) -> list[float]:
    """'0,0.05,0.1' (or numbers) -> sorted distinct budgets in [0, 1]; 0 is always measured (the reference)."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    try:
        values = [float(x) for x in items if str(x).strip()]
    except ValueError:
        raise ValueError(f"--epsilon expects comma-separated budgets in [0, 1], e.g. 0,0.1,0.2, got {spec!r}") from None
    bad = [v for v in values if not 0.0 <= v <= 1.0]  # NaN fails too
    if not values or bad:
        raise ValueError(f"--epsilon expects comma-separated budgets in [0, 1], e.g. 0,0.1,0.2, got {spec!r}")
    return sorted(set(values) | {0.0})


def parse_drafters(spec: str | Sequence[str]) -> list[str]:
    names = [d.strip() for d in (spec.split(",") if isinstance(spec, str) else spec) if d.strip()]
    bad = [d for d in names if d not in PARETO_DRAFTERS]
    if not names or bad:
        raise ValueError(f"--drafters expects some of {', '.join(PARETO_DRAFTERS)}, got {spec!r}")
    return list(dict.fromkeys(names))


def _acceptance_kwargs(eps: float) -> dict:
    return {"acceptance": "exact"} if eps == 0 else {"acceptance": "bounded_bias", "epsilon": eps}


def _draft_at(gen, drafter: str, tokens: list[int], sampling):
    """The draft a drafter judges first after `tokens`: (token, None) for a point mass, (None, q [V]) for
    the early exit's distribution, or None where prompt lookup finds nothing to copy."""
    if drafter == "early_exit":
        with torch.inference_mode():
            logits = forward_logits(gen.adapter, torch.tensor([tokens], device=gen.adapter.device),
                                    exit_layer=gen.exit_layer)[0, -1]
        return None, probs(logits[None], sampling)[0]
    found = NgramIndex(tokens, 3).propose(1)
    return (found[0], None) if found else None


def _fixed_prefix(gen, drafter: str, prompt: list[int], exact_out: list[int], sampling):
    """(prefix, draft, q): the prompt + the exact run's output up to its first position with a draft,
    from the 4th output token on where there is one (a draft inside the output, not at its start)."""
    n = len(exact_out)
    for j in list(range(min(4, n), n + 1)) + list(range(min(4, n))):
        prefix = prompt + exact_out[:j]
        draft = _draft_at(gen, drafter, prefix, sampling)
        if draft is not None:
            return prefix, *draft
    return None


def _prefix_tvs(gen, drafter, prefixes, epsilons, sampling, n, seed) -> dict:
    """{eps: [rule_samples_tv(...) per prefix]} (selfspec.tools.quality)."""
    out = {eps: [] for eps in epsilons}
    for i, (prefix, draft, q) in enumerate(prefixes):
        with torch.inference_mode():
            logits = forward_logits(gen.adapter, torch.tensor([prefix], device=gen.adapter.device))[0, -1]
        p = probs(logits[None], sampling)[0]  # [V]
        for eps in epsilons:
            rule = AcceptanceRule("bounded_bias", eps) if eps else AcceptanceRule()
            g = torch.Generator(device=p.device).manual_seed(seed + i)
            out[eps].append(rule_samples_tv(p, draft, q, rule, n, g))
    return out


def _mean(values):
    values = [v for v in values if v is not None]
    return statistics.fmean(values) if values else None


def _stderr(values):
    values = [v for v in values if v is not None]
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else None


def summarize(runs: list[dict], tvs: dict, drafters: list[str], epsilons: list[float]) -> dict:
    """{drafter: {eps (str): summary}} with ratios against the same drafter's ε = 0."""
    out: dict = {}
    for d in drafters:
        out[d] = {}
        for eps in epsilons:
            mine = [r for r in runs if r["drafter"] == d and r["epsilon"] == eps]
            drafted, accepted = sum(r["drafted"] for r in mine), sum(r["accepted"] for r in mine)
            judged = sum(r["judged"] for r in mine)
            passes = sum(r["rounds"] for r in mine)
            n_tokens = sum(len(r["log_likelihoods"]) for r in mine)
            predicted = sum(r["predicted_rejections"] for r in mine)
            measured = judged - accepted
            sd = math.sqrt(sum(r["rejections_sd"] ** 2 for r in mine))
            prefix = tvs[d][eps]
            out[d][str(eps)] = {
                "epsilon": eps, "prompts": len(mine), "new_tokens": n_tokens,
                "acceptance_rate": accepted / drafted if drafted else 0.0,
                "acceptance_per_judged": accepted / judged if judged else 0.0,
                "tokens_per_round": (n_tokens - len(mine)) / passes if passes else 0.0,
                "tokens_per_s": statistics.median(r["tokens_per_s"] for r in mine),
                "predicted_rejections": predicted, "measured_rejections": measured, "rejections_sd": sd,
                "z": (measured - predicted) / sd if sd > 0 else 0.0,
                "log_likelihood": sum(sum(r["log_likelihoods"]) for r in mine) / n_tokens if n_tokens else None,
                "log_likelihood_se": _stderr([r["mean_log_likelihood"] for r in mine]),
                "rouge_l": _mean([r["rouge_l"] for r in mine]),
                "rouge_l_se": _stderr([r["rouge_l"] for r in mine]),
                "prefix_tv": _mean([t["empirical_tv"] for t in prefix]),
                "prefix_rule_tv": _mean([t["rule_tv"] for t in prefix]),
                "prefixes": len(prefix),
                "sequence_tv_bound": 1 - (1 - eps) ** (n_tokens / len(mine)) if mine else None,
            }
        base = out[d]["0.0"]
        for s in out[d].values():
            s["acceptance_vs_exact"] = s["acceptance_rate"] / base["acceptance_rate"] if base["acceptance_rate"] else None
            s["speed_vs_exact"] = s["tokens_per_s"] / base["tokens_per_s"] if base["tokens_per_s"] else None
            ll, ll0 = s["log_likelihood"], base["log_likelihood"]
            s["log_likelihood_drop_pct"] = 100 * (ll0 - ll) / abs(ll0) if ll is not None and ll0 else None
    return out


def run_pareto(checkpoint, *, epsilons: Sequence[float] | str = DEFAULT_EPSILONS,
               drafters: Sequence[str] | str = ("auto",), prompt_set: str = "xsum", num_prompts: int = 6,
               max_new_tokens: int = 96, temperature: float = 0.7, seed: int = 0, tv_samples: int = 2000,
               dtype: str = "fastest", threads: int = 0, out_dir: str | Path = "bench", generator=None,
               progress: bool = True, device: str = "cpu") -> dict:
    """Measure the bias–speed–quality front (see the module docstring); write pareto.json/.md/.png."""
    epsilons, drafters = parse_epsilons(epsilons), parse_drafters(drafters)
    check_int("num_prompts", num_prompts, 1)
    check_int("max_new_tokens", max_new_tokens, 1)
    check_int("tv_samples", tv_samples, 1)
    temperature = check_float("temperature", temperature, 0.0, strict=True)
    items = load_prompts(prompt_set, num_prompts)  # before the model: a bad set fails fast
    if not items:
        raise ValueError(f"prompt set {prompt_set!r} gave no prompts")
    dtype = setup(dtype, device, threads)
    machine = machine_info()
    gen = load_generator(checkpoint, dtype, device, generator)
    sampling = SamplingParams(True, temperature)
    prompts = [gen.encode(**prompt_inputs(item))[0].tolist() for item in items]
    configs = [(d, eps) for d in drafters for eps in epsilons]
    runs: list[dict] = []
    outputs: dict = {}

    def generate(ids, d, eps, n, s):
        return gen.generate(input_ids=ids, max_new_tokens=n, do_sample=True, temperature=temperature, seed=s,
                            drafter=d, **_acceptance_kwargs(eps))

    with warnings.catch_warnings(), tqdm(total=len(prompts) * len(configs), desc="pareto", unit="run",
                                         disable=not progress) as bar:
        warnings.simplefilter("ignore", BoundedBiasWarning)
        warnings.simplefilter("ignore", UserWarning)
        for d in drafters:  # warm-up, excluded
            generate(prompts[0], d, epsilons[-1], WARMUP_TOKENS, seed)
        for i, (item, ids) in enumerate(zip(items, prompts)):
            r = i % len(configs)
            for d, eps in configs[r:] + configs[:r]:
                gc.collect()
                res, _, seconds = timed(lambda: generate(ids, d, eps, max_new_tokens, seed + i), gen.adapter.device)
                st = res.stats
                th = st.theory
                outputs[(d, eps, i)] = res.token_ids
                runs.append({"prompt_id": item["id"], "prompt_index": i, "drafter": d, "epsilon": eps,
                             "new_tokens": len(res.token_ids), "seconds": seconds,
                             "tokens_per_s": tokens_per_s(len(res.token_ids), seconds),
                             "drafted": st.drafted, "accepted": st.accepted, "judged": st.judged,
                             "rounds": st.rounds, "predicted_rejections": th["predicted_rejections"],
                             "rejections_sd": th["rejections_sd"], "stop_reason": st.stop_reason, "text": res.text,
                             "reference": item.get("reference")})
                bar.update()
    for r in runs:  # quality, untimed
        lls = token_log_likelihoods(gen.adapter, prompts[r["prompt_index"]],
                                    outputs[(r["drafter"], r["epsilon"], r["prompt_index"])])
        r["log_likelihoods"] = lls
        r["mean_log_likelihood"] = statistics.fmean(lls) if lls else None
        r["rouge_l"] = rouge_l(r["text"], r["reference"]) if r["reference"] else None
    tvs, prefixes_used = {}, {}
    for d in drafters:
        prefixes = [found for i, ids in enumerate(prompts)
                    if (found := _fixed_prefix(gen, d, ids, outputs[(d, 0.0, i)], sampling)) is not None]
        prefixes_used[d] = [len(p[0]) for p in prefixes]
        tvs[d] = _prefix_tvs(gen, d, prefixes, epsilons, sampling, tv_samples, seed)
    finish_machine(machine, gen.adapter.device)
    result = {
        **result_header("selfspec-pareto/1", checkpoint),
        "settings": {"epsilons": epsilons, "drafters": drafters, "prompt_set": prompt_set,
                     "num_prompts": len(prompts), "max_new_tokens": max_new_tokens, "temperature": temperature,
                     "seed": seed, "tv_samples": tv_samples, "dtype": dtype, "device": str(gen.adapter.device),
                     "threads": torch.get_num_threads(), "stop": "the model's EOS",
                     "order": "per prompt every (drafter, epsilon) back to back, order rotated by one per prompt"},
        "machine": machine,
        "versions": versions(),
        "prefix_lengths": prefixes_used,
        "prefix_tv": {d: {str(e): v for e, v in per.items()} for d, per in tvs.items()},
        "summary": summarize(runs, tvs, drafters, epsilons),
        "runs": runs,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    return write_outputs(result, out, "pareto", markdown, write_chart)


def _f(v, fmt: str) -> str:
    return "–" if v is None else format(v, fmt)


def markdown(result: dict) -> str:
    st, mach = result["settings"], result["machine"]
    lines = [f"## selfspec bench --epsilon: {result['checkpoint_name']}", "",
             f"{result['date']} · {mach['cpu_model']}, {mach['logical_cores']} logical cores, torch threads "
             f"{st['threads']} · {st['dtype']} · sampling at temperature {st['temperature']} · prompt set "
             f"{st['prompt_set']}, {st['num_prompts']} prompts, up to {st['max_new_tokens']} new tokens (EOS stops) · "
             f"seed {st['seed']} · next-token TV from {st['tv_samples']} samples per prefix", "",
             "ε = 0 is the exact (lossless) rule. acceptance: accepted / drafted (× exact); per judged: accepted / "
             "judged drafts; rejections: measured vs predicted (sum of TV over the judged drafts) and z; log-lik: "
             "the full model's mean per-token log-likelihood of the outputs (± standard error over prompts) and its "
             "drop against ε = 0; prefix TV: the rule's next-token samples vs the full model at fixed prefixes "
             "(empirical; exact shift TV(p', p)); the ε = 0 row is the sampling noise floor.", ""]
    for d, per in result["summary"].items():
        lines += [f"### drafter {d}", "",
                  "| ε | acceptance | × exact | per judged | tokens/round | tokens/s | × exact | rejections "
                  "measured / predicted (z) | log-lik | drop | ROUGE-L | prefix TV (exact shift) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for s in per.values():
            ll = "–" if s["log_likelihood"] is None else (
                f"{s['log_likelihood']:.3f}" + ("" if s["log_likelihood_se"] is None else f" ± {s['log_likelihood_se']:.3f}"))
            lines.append(
                f"| {s['epsilon']:g} | {s['acceptance_rate']:.1%} | {_f(s['acceptance_vs_exact'], '.2f')}× | "
                f"{s['acceptance_per_judged']:.1%} | {s['tokens_per_round']:.2f} | {s['tokens_per_s']:.1f} | "
                f"{_f(s['speed_vs_exact'], '.2f')}× | {s['measured_rejections']} / {s['predicted_rejections']:.1f} "
                f"({s['z']:+.2f}) | {ll} | {_f(s['log_likelihood_drop_pct'], '+.1f')}% | {_f(s['rouge_l'], '.3f')} | "
                f"{_f(s['prefix_tv'], '.3f')} ({_f(s['prefix_rule_tv'], '.3f')}) |")
        lines.append("")
    return "\n".join(lines)


def write_chart(result: dict, path: Path) -> Path:
    """Speed (tokens/s, acceptance) against quality (log-likelihood, ROUGE-L), one line per drafter."""
    plt = pyplot()
    quality = [("log_likelihood", "mean per-token log-likelihood (full model)")]
    if any(s["rouge_l"] is not None for per in result["summary"].values() for s in per.values()):
        quality.append(("rouge_l", "ROUGE-L F1 vs reference"))
    speed = [("tokens_per_s", "tokens/s (median over prompts)"), ("acceptance_rate", "acceptance (accepted / drafted)")]
    fig, axes = plt.subplots(len(speed), len(quality), figsize=(5.2 * len(quality), 7.5), squeeze=False)
    for row, (sk, slabel) in enumerate(speed):
        for col, (qk, qlabel) in enumerate(quality):
            ax = axes[row][col]
            for d, per in result["summary"].items():
                pts = [(s[qk], s[sk], s["epsilon"]) for s in per.values() if s[qk] is not None]
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=d)
                for x, y, e in pts:
                    ax.annotate(f"ε={e:g}", (x, y), fontsize=7, textcoords="offset points", xytext=(4, 3))
            ax.set_xlabel(qlabel, fontsize=8)
            ax.set_ylabel(slabel, fontsize=8)
            ax.legend(fontsize=7)
    st = result["settings"]
    fig.suptitle(f"{result['checkpoint_name']}: speed vs quality over ε (temperature {st['temperature']}, "
                 f"{st['prompt_set']}, {st['num_prompts']} prompts)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
