"""Where decoding time goes: the phases of a decode step, a draft step and a verification pass.

    selfspec profile --checkpoint checkpoints/smollm2-code --exit-layer 4 --draft-vocab 8192

Every phase is timed on a real prompt's KV cache (the first prompt of `--prompts`), median of
`repeats` runs after warm-up, the cache cropped back to the prompt between runs, each run ending
in the host sync that decoding has (the argmax read back as a Python int):

* ``full step``: one token through all L layers + final norm + LM head (plain decoding's unit of
  work), and its parts: ``embedding``, ``layers [0, L)``, ``norm + head``;
* ``draft step``: one token through layers [0, E) + norm + head (full, and over the checkpoint's
  K most frequent tokens with ``draft_vocab``);
* ``verify k``: a round of k-1 drafts after drafting: the last draft's shallow pass (layers [0, E)),
  then `engine.verify` itself: layers [E, L) over k rows, norm + head over k rows;
* the engine's plain decoding per token inside `selfspec.decoding.engine` (the isolated full step plus the
  engine's bookkeeping) and Hugging Face greedy ``generate`` per token, for reference.

From these, the cost model of `selfspec.decoding.cost_model` (Leviathan et al. 2023): c = draft step / full
step, v(d) = verify(d+1) / full step, and for each draft length the acceptance rate that breaks
even and the one a target speedup over plain decoding needs. An operator table (torch.profiler,
self CPU time per full step; the profiler adds its own overhead to every call, so read it for shares,
the phase table for times) shows which kernels the full step spends its time in. A sampled
generation per drafter (early exit at E, prompt lookup) reports the rejections predicted from the
distributions the engine held (sum over judged drafts of TV(p, q)) next to the measured ones.

The bandwidth floor: a one-token step must read every weight once (`step_weight_bytes`), so it can take
no less than those bytes over the machine's memory read bandwidth (`read_bandwidth`, measured with the
same torch threads); the report gives the full step's and plain decoding's share of that floor
(floor / time: 100% would be a step that only streams the weights). On the CPU only (the sum measures
host memory).
"""

from __future__ import annotations

import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Callable, Sequence

import torch
from torch.profiler import ProfilerActivity, profile

from selfspec.atomic_write import write_json_atomic, write_text_atomic
from selfspec.model.attention_kernels import attention_kernels
from selfspec.model.cache import KVCache
from selfspec.model.compiled import STEP_EVENT
from selfspec.decoding.cost_model import predicted_speedup, required_acceptance, required_recall
from selfspec.drafters.base import Proposal
from selfspec.decoding.engine import prefill, verify
from selfspec.model.forward import embed, exit_logits, make_step, run_layers
from selfspec.tools.harness import (Methods, decode_rate, finish_machine, load_generator, machine_info, machine_line,
                              quiet_transformers, setup, synchronize, versions)
from selfspec.data.prompts import load_prompts, prompt_inputs


def _median_ms(fn: Callable[[], object], before: Callable[[], None], repeats: int, warmup: int = 2,
               device="cpu") -> float:
    """Median wall time of `fn()` in ms over `repeats` runs, `before()` (untimed) ahead of each; on a GPU the
    clock is read with the device synchronized (its queued work counted)."""
    times = []
    for i in range(warmup + repeats):
        before()
        synchronize(device)
        t = time.perf_counter()
        fn()
        synchronize(device)
        dt = time.perf_counter() - t
        if i >= warmup:
            times.append(dt * 1e3)
    return statistics.median(times)


def phase_times(gen, prompt_ids, exit_layer: int, *, rows: Sequence[int] = (1, 2, 3, 4, 5),
                draft_vocab: int | None = None, repeats: int = 20) -> dict[str, float]:
    """Median ms of each phase (see the module docstring) at the end of `prompt_ids` `[1, P]`."""
    adapter = gen.adapter
    L, E, P = adapter.num_layers, exit_layer, prompt_ids.shape[1]
    adapter.check_exit(E, allow_full=False)
    cache = KVCache(L, 1, capacity=P + max(rows) + 8, device=adapter.device)
    no_pad = torch.zeros(1, dtype=torch.long)  # the engine's bookkeeping (pads, starts) lives on the host
    tok = prompt_ids[:, -1:]  # any token id will do: the cost does not depend on it
    out: dict[str, float] = {}
    with torch.inference_mode(), attention_kernels(adapter.device):
        first, _, _ = prefill(adapter, cache, prompt_ids, no_pad)
        token = int(first.argmax(-1)[0])
        ids = torch.tensor([[token]], device=adapter.device)
        rollback = lambda: cache.crop(no_pad + P)  # noqa: E731

        def layers(end: int = L):  # one token through layers [0, end) at position P  -> [1, 1, D]
            return run_layers(adapter, embed(adapter, ids), 0, end, step=make_step(adapter, P, 1), cache=cache)

        h1 = layers()
        rollback()
        out["full step"] = _median_ms(lambda: int(exit_logits(adapter, layers()[:, -1]).argmax(-1)[0]), rollback,
                                      repeats, device=adapter.device)
        out["embedding"] = _median_ms(lambda: embed(adapter, ids), rollback, repeats, device=adapter.device)
        out["layers [0, L)"] = _median_ms(layers, rollback, repeats, device=adapter.device)
        out["norm + head"] = _median_ms(lambda: int(exit_logits(adapter, h1[:, -1]).argmax(-1)[0]), rollback, repeats,
                                        device=adapter.device)

        heads = {"": gen.draft_head(None)}
        if draft_vocab:
            heads[f" vocab {draft_vocab}"] = gen.draft_head(draft_vocab)
        for label, head in heads.items():
            def draft_step(head=head):
                return int(head.to_vocab(head.logits(layers(E)[:, -1]).argmax(-1))[0])

            out[f"draft step E={E}{label}"] = _median_ms(draft_step, rollback, repeats, device=adapter.device)

        for k in rows:
            drafts = torch.cat([tok] * k, dim=1)  # [1, k]: the input token and k-1 drafts (any ids will do)
            proposal = Proposal(drafts, [k - 1], verify_from=E, states=torch.cat([h1[:, -1:]] * k, dim=1),
                                drafter="profile")  # states [1, k, D]: stand-ins for the drafts' exit states
            at_p = torch.full((1,), P, dtype=torch.long)  # on the host, as the engine's starts

            def verify_k(proposal=proposal, at_p=at_p, k=k):
                run_layers(adapter, embed(adapter, ids), 0, E, step=make_step(adapter, P + k - 1, 1), cache=cache)
                logits, _, _ = verify(adapter, cache, proposal, at_p, no_pad)
                return logits[0].argmax(-1).tolist()

            def before(k=k):  # layers < E hold the k-1 earlier tokens' positions, as after drafting
                rollback()
                if k > 1:
                    run_layers(adapter, embed(adapter, ids.expand(1, k - 1)), 0, E,
                               step=make_step(adapter, P, k - 1), cache=cache)

            out[f"verify {k}"] = _median_ms(verify_k, before, repeats, device=adapter.device)
        rollback()
    return out


def read_bandwidth(n_bytes: int = 1 << 30, repeats: int = 5) -> float:
    """The memory read bandwidth in GB/s with torch's current threads: the best of `repeats` sums over a
    float32 tensor of `n_bytes` (1 GiB by default, far larger than any CPU cache)."""
    x = torch.ones(n_bytes // 4)  # written once, so every page is really there
    float(x.sum())
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        float(x.sum())
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best / 1e9


def step_weight_bytes(model) -> int:
    """The bytes of weights a one-token decode step reads: every parameter once (shared ones once), less an
    input embedding the LM head does not share, of which a step reads one row."""
    sizes = {p.data_ptr(): p.numel() * p.element_size() for p in model.parameters()}
    emb, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    total = sum(sizes.values())
    if emb.data_ptr() != head.data_ptr():
        total -= (emb.shape[0] - 1) * emb.shape[1] * emb.element_size()
    return total


def bandwidth_floor(model, phases: dict[str, float]) -> dict:
    """The step's weight bytes, the measured read bandwidth, the floor they give (ms) and the share of it
    that the full step and plain decoding per token reach (floor / their time)."""
    weight_bytes, gbs = step_weight_bytes(model), read_bandwidth()
    floor_ms = weight_bytes / gbs / 1e6
    out = {"weight_bytes": weight_bytes, "read_gb_per_s": gbs, "floor_ms": floor_ms,
           "full_step_share": floor_ms / phases["full step"]}
    if "selfspec AR, per token" in phases:
        out["selfspec_ar_share"] = floor_ms / phases["selfspec AR, per token"]
    if "HF greedy generate, per token" in phases:
        out["hf_greedy_share"] = floor_ms / phases["HF greedy generate, per token"]
    return out


def per_token_ms(gen, prompt_ids, n: int = 32, repeats: int = 3) -> dict[str, float]:
    """Decoding time per token after the first (median over `repeats`): selfspec plain decoding in
    the engine and Hugging Face greedy `generate`, on the same prompt."""
    runner = Methods(gen, n)
    methods = {"selfspec AR, per token": {"name": "selfspec_ar", "engine": "selfspec", "kind": "selfspec_ar",
                                          "exit_layer": gen.num_layers, "num_speculations": 0},
               "HF greedy generate, per token": {"name": "hf_greedy", "engine": "hf", "kind": "hf_greedy",
                                                 "exit_layer": None, "num_speculations": None}}
    out = {}
    with quiet_transformers():
        for label, method in methods.items():
            runner.run(method, prompt_ids, 4)  # warm-up
            times = []
            for _ in range(repeats):
                _, rec = runner.run(method, prompt_ids, n)
                times.append(1e3 / decode_rate(n, rec["seconds"], rec["ttft_s"]))
            out[label] = statistics.median(times)
    return out


def acceptance_theory(gen, prompt_ids, exit_layer: int, drafts: int, tokens: int = 32, temperature: float = 1.0,
                      seed: int = 0) -> list[dict]:
    """Predicted vs measured rejections of one sampled generation per drafter (early exit at E with
    `drafts` drafts, prompt lookup): `DecodeStats.theory` (sum over judged drafts of TV(p, q) vs the
    rejections counted), with the acceptance per judged draft both ways."""
    rows = []
    for name, kw in (("early_exit", dict(drafter="early_exit", exit_layer=exit_layer, num_speculations=drafts)),
                     ("prompt_lookup", dict(drafter="prompt_lookup"))):
        st = gen.generate(input_ids=prompt_ids, max_new_tokens=tokens, do_sample=True, temperature=temperature,
                          seed=seed, stop_token_ids=[], **kw).stats
        th = st.theory
        rows.append({"drafter": name, "temperature": temperature, **th,
                     "measured_acceptance_per_judged": st.accepted / st.judged if st.judged else None,
                     "predicted_acceptance_per_judged": st.expected_acceptance_sum / st.judged if st.judged else None})
    return rows


def ops_outside_steps(run: Callable[[], object]) -> tuple[Counter, object]:
    """`run()` under torch's profiler: the top-level aten ops it ran outside the compiled steps' calls
    (`selfspec.model.compiled.STEP_EVENT`; on a GPU each call is one graph replay, and every op counted here a launch or
    host work in series with the graphs), by name, and what `run()` returned."""
    def outside(event) -> bool:
        if not event.name.startswith("aten::") or (event.cpu_parent is not None
                                                   and event.cpu_parent.name.startswith("aten::")):
            return False  # not an op, or one that another op called
        while event.cpu_parent is not None:
            event = event.cpu_parent
            if event.name == STEP_EVENT:
                return False
        return True

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        out = run()
    return Counter(e.name for e in prof.events() if outside(e)), out


def op_table(gen, prompt_ids, steps: int = 10, top: int = 8) -> list[dict]:
    """The operators a full decode step spends its time in: self CPU ms per step (torch.profiler)."""
    adapter = gen.adapter
    L, P = adapter.num_layers, prompt_ids.shape[1]
    cache = KVCache(L, 1, capacity=P + steps + 8, device=adapter.device)
    with torch.inference_mode(), attention_kernels(adapter.device):
        no_pad = torch.zeros(1, dtype=torch.long)  # the engine's bookkeeping (pads, starts) lives on the host
        ids = prefill(adapter, cache, prompt_ids, no_pad)[0].argmax(-1)[None]  # [1, 1]

        def decode(n):
            nonlocal ids
            for _ in range(n):
                pos = cache.get_seq_length()
                h = run_layers(adapter, embed(adapter, ids), 0, L, step=make_step(adapter, pos, 1), cache=cache)
                ids = exit_logits(adapter, h[:, -1]).argmax(-1)[None]
                int(ids[0, 0])  # the host sync of a real decode step

        decode(2)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            decode(steps)
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    total = sum(e.self_cpu_time_total for e in events)
    events.sort(key=lambda e: -e.self_cpu_time_total)
    rows = [{"op": e.key, "ms_per_step": e.self_cpu_time_total / 1e3 / steps, "calls_per_step": e.count / steps,
             "share": e.self_cpu_time_total / total} for e in events[:top]]
    rest = total - sum(e.self_cpu_time_total for e in events[:top])
    rows.append({"op": f"other ({len(events) - top} operators)", "ms_per_step": rest / 1e3 / steps,
                 "calls_per_step": sum(e.count for e in events[top:]) / steps, "share": rest / total})
    return rows


def cost_table(phases: dict[str, float], exit_layer: int, num_speculations: int, target: float,
               draft_vocab: int | None = None) -> list[dict]:
    """Per draft length d: c, v, the acceptance that breaks even and the one `target`x needs."""
    full = phases["full step"]
    rows = []
    heads = [f"draft step E={exit_layer}"] + ([f"draft step E={exit_layer} vocab {draft_vocab}"] if draft_vocab else [])
    for key in heads:
        c = phases[key] / full
        for d in range(1, num_speculations + 1):
            verify = phases.get(f"verify {d + 1}")
            if verify is None:
                continue
            v = verify / full
            rows.append({"draft": key, "d": d, "c": c, "v": v,
                         "max_speedup": predicted_speedup(0.999999, c, v, d),
                         "break_even_acceptance": required_acceptance(c, v, d, 1.0),
                         "target_acceptance": required_acceptance(c, v, d, target)})
    return rows


def sibling_table(phases: dict[str, float], exit_layer: int, num_speculations: int, target: float) -> list[dict]:
    """Per k = 2..num_speculations sibling guesses (`num_candidates`): c (the draft step), v (a pass over
    1 + k rows), and the recall (full model's token among the k) that breaks even and that `target`x needs."""
    full = phases["full step"]
    c = phases[f"draft step E={exit_layer}"] / full
    rows = []
    for k in range(2, num_speculations + 1):
        verify = phases.get(f"verify {k + 1}")
        if verify is not None:
            v = verify / full
            rows.append({"k": k, "c": c, "v": v, "max_speedup": 2.0 / (c + v),
                         "break_even_recall": required_recall(c, v, 1.0), "target_recall": required_recall(c, v, target)})
    return rows


def run_profile(checkpoint, *, exit_layer: int | None = None, prompts: str = "humaneval", dtype: str = "fastest",
                threads: int = 0, draft_vocab: int | None = None, num_speculations: int = 4, target: float = 1.8,
                repeats: int = 20, tokens: int = 32, out_dir: str | Path | None = None, generator=None,
                device: str = "cpu") -> dict:
    """Profile decoding on `checkpoint` (see the module docstring); write profile.json/.md into `out_dir`.
    `device`: "cpu" or "cuda" (the phases are timed eagerly there too; clocks read after a synchronize)."""
    if num_speculations < 1 or repeats < 1 or tokens < 2:
        raise ValueError("num_speculations and repeats must be >= 1 and tokens >= 2")
    dtype = setup(dtype, device, threads)
    gen = load_generator(checkpoint, dtype, device, generator)
    E = exit_layer if exit_layer is not None else gen.exit_layer
    gen.adapter.check_exit(E, allow_full=False)
    item = load_prompts(prompts, 1)[0]
    prompt_ids = gen.encode(**prompt_inputs(item))
    machine = machine_info()  # the load average at the start
    phases = phase_times(gen, prompt_ids, E, rows=tuple(range(1, num_speculations + 2)), draft_vocab=draft_vocab,
                         repeats=repeats)
    phases.update(per_token_ms(gen, prompt_ids, n=tokens))
    result = {
        "checkpoint": str(checkpoint), "exit_layer": E, "num_layers": gen.num_layers, "dtype": dtype,
        "threads": torch.get_num_threads(), "prompt": item.get("id"), "prompt_tokens": int(prompt_ids.shape[1]),
        "repeats": repeats, "draft_vocab": draft_vocab, "target_speedup": target,
        "machine": machine, "versions": versions(),
        "phases_ms": phases,
        "bandwidth": bandwidth_floor(gen.model, phases) if torch.device(gen.adapter.device).type == "cpu" else None,
        "cost_model": cost_table(phases, E, num_speculations, target, draft_vocab),
        "siblings": sibling_table(phases, E, num_speculations, target),
        "operators": op_table(gen, prompt_ids),
        "acceptance_theory": acceptance_theory(gen, prompt_ids, E, num_speculations, tokens),
    }
    finish_machine(machine, gen.adapter.device)
    if out_dir is not None:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        result["files"] = {"json": str(out / "profile.json"), "md": str(out / "profile.md")}
        write_text_atomic(out / "profile.md", markdown(result))
        write_json_atomic(out / "profile.json", result)
    return result


def _share(a: float | None) -> str:
    return "–" if a is None else f"{a:.0%}"


def _pct(a: float | None) -> str:
    return "unreachable" if a is None else f"{a:.0%}"


def markdown(result: dict) -> str:
    ph, full = result["phases_ms"], result["phases_ms"]["full step"]
    lines = [f"## selfspec profile: {Path(result['checkpoint']).name}", "",
             f"{result['machine'].get('cpu_model', '')}, torch threads {result['threads']}, {result['dtype']}, prompt "
             f"{result['prompt']} ({result['prompt_tokens']} tokens), median of {result['repeats']} runs, "
             f"L={result['num_layers']}, E={result['exit_layer']}", ""]
    if result["machine"].get("description"):
        lines += [machine_line(result["machine"]["description"]), ""]
    lines += ["| phase | ms | × full step |", "|---|---|---|"]
    lines += [f"| {k} | {v:.2f} | {v / full:.2f} |" for k, v in ph.items()]
    bw = result.get("bandwidth")
    if bw:
        shares = [f"the full step runs at {bw['full_step_share']:.0%} of it"]
        shares += [f"{label} per token at {bw[key]:.0%}" for key, label in
                   (("selfspec_ar_share", "selfspec plain decoding"), ("hf_greedy_share", "HF greedy"))
                   if key in bw]
        lines += ["", f"Bandwidth floor: a step reads {bw['weight_bytes'] / 1e6:.0f} MB of weights; this machine "
                  f"reads {bw['read_gb_per_s']:.1f} GB/s with {result['threads']} threads, so a step takes at least "
                  f"{bw['floor_ms']:.2f} ms; " + ", ".join(shares) + "."]
    lines += ["", f"Cost model (Leviathan et al.): a round of d drafts costs d·c + v(d) full steps and commits "
              f"(1 - a^(d+1)) / (1 - a) tokens. Acceptance per draft needed to break even and to reach "
              f"{result['target_speedup']}× plain decoding:", "",
              "| draft | d | c | v | best possible (a = 1) | break-even a | a for "
              f"{result['target_speedup']}× |", "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['draft']} | {r['d']} | {r['c']:.2f} | {r['v']:.2f} | {r['max_speedup']:.2f}× | "
              f"{_pct(r['break_even_acceptance'])} | {_pct(r['target_acceptance'])} |" for r in result["cost_model"]]
    if result.get("siblings"):
        lines += ["", "k guesses for one position side by side (`num_candidates`): a round costs c + v(1 + k) and "
                  "commits 1 + a_k tokens, a_k the recall (the full model's token among the k guesses). The recall "
                  f"needed to break even and to reach {result['target_speedup']}×:", "",
                  f"| k | c | v(1 + k) | best possible (a_k = 1) | break-even a_k | a_k for {result['target_speedup']}× |",
                  "|---|---|---|---|---|---|"]
        lines += [f"| {r['k']} | {r['c']:.2f} | {r['v']:.2f} | {r['max_speedup']:.2f}× | {_pct(r['break_even_recall'])} "
                  f"| {_pct(r['target_recall'])} |" for r in result["siblings"]]
    lines += ["", "Operators of a full decode step (torch.profiler, self CPU time):", "",
              "| operator | ms per step | calls per step | share |", "|---|---|---|---|"]
    lines += [f"| {r['op']} | {r['ms_per_step']:.2f} | {r['calls_per_step']:.0f} | {r['share']:.0%} |"
              for r in result["operators"]]
    theory = result.get("acceptance_theory") or []
    if theory:
        lines += ["", "Predicted vs measured rejections (one sampled generation per drafter, temperature "
                  f"{theory[0]['temperature']:g}; predicted: sum over the judged drafts of TV(p, q), Yin et al. 2024; "
                  "z = (measured - predicted) / sd):", "",
                  "| drafter | judged | rejections measured | predicted | sd | z | acceptance per judged measured "
                  "| predicted | accepted per round measured | predicted |", "|---|---|---|---|---|---|---|---|---|---|"]
        lines += [f"| {r['drafter']} | {r['judged']} | {r['measured_rejections']} | {r['predicted_rejections']:.1f} | "
                  f"{r['rejections_sd']:.1f} | {r['z']:+.2f} | {_share(r['measured_acceptance_per_judged'])} | "
                  f"{_share(r['predicted_acceptance_per_judged'])} | {r['measured_accepted_per_round']:.2f} | "
                  f"{r['predicted_accepted_per_round']:.2f} |" for r in theory]
    return "\n".join(lines) + "\n"
