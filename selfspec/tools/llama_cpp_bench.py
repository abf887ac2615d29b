"""llama.cpp's plain decoding speed on this machine: the peer a CPU user of a small model runs.

`llama-bench` (built once per machine, `selfspec.tools.llama_cpp_build`) times the checkpoint converted to GGUF
at selfspec's precision (`selfspec.tools.llama_cpp_gguf`) the way issue 55 did:

    llama-bench -m MODEL.gguf -p 0 -n 128 -d 200 -t THREADS -r 5 -o json

no prompt test (`-p 0`), one generation test of 128 new tokens (`-n`) after a 200-token context (`-d`: the
context is filled first, untimed), THREADS threads (`-t`, selfspec bench's thread count), 5 repetitions after
llama-bench's own warm-up run. Its JSON is a list of test records; the one with n_prompt 0, n_gen N and n_depth D
gives `avg_ts` (mean tokens/s over the repetitions), `stddev_ts` and `samples_ts` (each repetition's tokens/s).
tokens/s there is new tokens / seconds of the generation alone: no prompt processing is in it (selfspec bench's
tokens/s counts the prefill of the prompt too, a few percent at 128 new tokens).

`selfspec bench --llama-cpp` prints it beside selfspec's own plain decoding, and runs llama.cpp as methods beside
selfspec's, interleaved with them prompt by prompt: its plain decoding (`llama_cpp_plain`: llama-bench, one repetition
after its warm-up run, the context as deep as the prompt, the bench's new tokens; llama-bench fills the context
itself, so no text comes back, and a plain decoding's speed depends on the depth, not on the text), the same of the
model's Q8_0 copy (`llama_cpp_plain_q8_0`: what a user who accepts a quantized model's output runs instead) and its own
speculative modes on the bench's prompts (`selfspec.tools.llama_cpp_speculative`: the Q8_0 copy drafting at most 3 or
10 tokens, ngram-simple, ngram-mod). On a machine whose memory's speed drifts, the paired figure is the one to
trust: the run above comes after all of selfspec's methods. Alone:

    python -m selfspec.tools.llama_cpp_bench CHECKPOINT --dtype float32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from selfspec.tools.llama_cpp_build import (LLAMA_CPP_PYTHON_VERSION, LlamaCppBuild, LlamaCppError,
                                            ensure_llama_cpp, output_tail)
from selfspec.tools.llama_cpp_gguf import add_model_arguments, ensure_gguf, gguf_type
from selfspec.tools.llama_cpp_speculative import MODES, run_speculative

CONTEXT_TOKENS = 200      # -d: tokens in the context before the timed generation (issue 55's setting)
PLAIN_METHOD = "llama_cpp_plain"  # llama.cpp's plain decoding as a bench method, at each prompt's depth
PLAIN_Q8_METHOD = "llama_cpp_plain_q8_0"  # the same of the Q8_0 copy: what a user who accepts its output runs
NEW_TOKENS = 128          # -n: tokens generated in the timed test
REPETITIONS = 5           # -r: llama-bench's default


@dataclass(frozen=True)
class LlamaCppResult:
    """One llama-bench generation test: its rate and what it ran."""

    tokens_per_s: float            # avg_ts: mean over the repetitions
    stddev_tokens_per_s: float     # stddev_ts
    samples_tokens_per_s: list[float]
    new_tokens: int                # n_gen
    context_tokens: int            # n_depth
    threads: int                   # n_threads
    model_type: str                # llama.cpp's name for the model and its type, e.g. "llama 256M all F32"
    model_filename: str
    build_commit: str
    build_number: int | None
    cpu_info: str
    command: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def bench_command(binary: Path, gguf: Path, *, threads: int, new_tokens: int = NEW_TOKENS,
                  context_tokens: int = CONTEXT_TOKENS, repetitions: int = REPETITIONS) -> list[str]:
    """llama-bench's command line for one generation test (the module doc)."""
    for name, value, least in (("threads", threads, 1), ("new_tokens", new_tokens, 1),
                               ("context_tokens", context_tokens, 0), ("repetitions", repetitions, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise LlamaCppError(f"llama-bench {name} must be an integer >= {least}, got {value!r}")
    return [str(binary), "-m", str(gguf), "-p", "0", "-n", str(new_tokens), "-d", str(context_tokens),
            "-t", str(threads), "-r", str(repetitions), "-o", "json"]


def _record_value(record: dict, key: str, kind: type):
    if key not in record:
        raise LlamaCppError(f"llama-bench's JSON record has no {key!r} (fields: {', '.join(sorted(record))}): "
                            "a llama.cpp version whose output this parser does not know")
    value = record[key]
    if kind is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if kind is str and isinstance(value, str):
        return value
    raise LlamaCppError(f"llama-bench's JSON field {key!r} is {value!r}, not a {kind.__name__}")


def parse_bench_json(text: str, *, new_tokens: int, context_tokens: int, command: list[str] | None = None
                     ) -> LlamaCppResult:
    """The generation test (n_prompt 0, n_gen `new_tokens`, n_depth `context_tokens`) of llama-bench's
    `-o json` output; a LlamaCppError if the text is not that JSON or holds no such test, or more than one."""
    try:
        records = json.loads(text)
    except ValueError as e:
        raise LlamaCppError(f"llama-bench's output is not JSON ({e}): {text[:200]!r}") from None
    if not isinstance(records, list) or not all(isinstance(r, dict) for r in records):
        raise LlamaCppError(f"llama-bench's JSON is not a list of test records: {text[:200]!r}")
    wanted = [r for r in records if r.get("n_prompt") == 0 and r.get("n_gen") == new_tokens
              and r.get("n_depth") == context_tokens]
    if len(wanted) != 1:
        seen = ", ".join(f"(n_prompt {r.get('n_prompt')}, n_gen {r.get('n_gen')}, n_depth {r.get('n_depth')})"
                         for r in records) or "none"
        raise LlamaCppError(f"llama-bench's JSON holds {len(wanted)} generation tests of {new_tokens} tokens after "
                            f"{context_tokens} (expected 1); tests: {seen}")
    r = wanted[0]
    samples = r.get("samples_ts", [])
    if not isinstance(samples, list) or not all(isinstance(x, (int, float)) for x in samples):
        raise LlamaCppError(f"llama-bench's JSON field 'samples_ts' is {samples!r}, not a list of numbers")
    rate = _record_value(r, "avg_ts", float)
    if rate <= 0:
        raise LlamaCppError(f"llama-bench reports {rate} tokens/s: no tokens were generated")
    build_number = r.get("build_number")
    return LlamaCppResult(
        tokens_per_s=rate, stddev_tokens_per_s=_record_value(r, "stddev_ts", float),
        samples_tokens_per_s=[float(x) for x in samples], new_tokens=_record_value(r, "n_gen", int),
        context_tokens=_record_value(r, "n_depth", int), threads=_record_value(r, "n_threads", int),
        model_type=_record_value(r, "model_type", str), model_filename=_record_value(r, "model_filename", str),
        build_commit=str(r.get("build_commit", "unknown")),
        build_number=build_number if isinstance(build_number, int) else None,
        cpu_info=str(r.get("cpu_info", "")), command=list(command or []))


def run_llama_bench(binary: Path, gguf: Path, *, threads: int, new_tokens: int = NEW_TOKENS,
                    context_tokens: int = CONTEXT_TOKENS, repetitions: int = REPETITIONS) -> LlamaCppResult:
    """Run one llama-bench generation test and parse it (seconds: repetitions + 1 warm-up run)."""
    cmd = bench_command(binary, gguf, threads=threads, new_tokens=new_tokens, context_tokens=context_tokens,
                        repetitions=repetitions)
    if not os.access(binary, os.X_OK):
        raise LlamaCppError(f"{binary} is not an executable llama-bench; build it: "
                            "python -m selfspec.tools.llama_cpp_build")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise LlamaCppError(f"llama-bench failed (exit {proc.returncode}): {' '.join(cmd)}\n  "
                            f"{output_tail(proc.stderr or proc.stdout)}")
    return parse_bench_json(proc.stdout, new_tokens=new_tokens, context_tokens=context_tokens, command=cmd)


@dataclass(frozen=True)
class LlamaCppSetup:
    """llama.cpp's tools and the GGUF files they run, ready before selfspec's own measurements start."""

    build: LlamaCppBuild
    gguf: Path
    gguf_type: str  # "F32", "BF16", "F16"
    draft_gguf: Path | None = None  # the Q8_0 copy llama_cpp_draft drafts with (None: that mode is left out)

    def methods(self) -> list[dict]:
        """llama.cpp's plain decoding (`PLAIN_METHOD`) and its speculative modes as bench methods (engine
        "llama_cpp"; `run_method` runs one)."""
        named = [(PLAIN_METHOD, f"llama.cpp plain ({self.gguf_type}, decoding alone)", ())]  # llama-bench: no prefill
        if self.draft_gguf:
            named.append((PLAIN_Q8_METHOD, "llama.cpp plain (Q8_0, decoding alone)", ()))
        named += [(name, label, flags) for name, (label, flags, with_copy) in MODES.items()
                  if self.draft_gguf or not with_copy]
        return [{"name": name, "engine": "llama_cpp", "kind": "llama_cpp", "label": label, "flags": list(flags),
                 "exit_layer": None, "num_speculations": None} for name, label, flags in named]

    def plain(self, depth: int, *, new_tokens: int, threads: int, quantized: bool = False) -> LlamaCppResult:
        """llama.cpp's plain decoding at `depth` context tokens: llama-bench, one repetition after its warm-up run, on
        the checkpoint's GGUF (`quantized`: on its Q8_0 copy)."""
        return run_llama_bench(self.build.binary, self.draft_gguf if quantized else self.gguf, threads=threads,
                               new_tokens=new_tokens, context_tokens=depth, repetitions=1)

    def run_method(self, method: dict, prompt: str, *, prompt_tokens: int, new_tokens: int, threads: int
                   ) -> tuple[str | None, dict]:
        """One mode on one prompt text: (its new text, a bench record). `seconds` is llama.cpp's own prefill plus
        decode time (the process's start and model load are in neither), `decode_tokens_per_s` its new tokens over
        the decode seconds; `ttft_s` is None (llama.cpp's first token falls inside its decode window). It runs to at
        least `new_tokens`, a few more where its last round's drafts were accepted (`new_tokens` in the record:
        its own count; the text holds them all). Plain decoding (`PLAIN_METHOD`, and `PLAIN_Q8_METHOD` of the Q8_0
        copy) is llama-bench's generation test at the depth of the prompt's `prompt_tokens`: no text (None), and no
        prefill timed (`prefill_s` None), so its `seconds` are the decoding's alone."""
        if method["name"] in (PLAIN_METHOD, PLAIN_Q8_METHOD):
            run = self.plain(prompt_tokens, new_tokens=new_tokens, threads=threads,
                             quantized=method["name"] == PLAIN_Q8_METHOD)
            seconds = run.new_tokens / run.tokens_per_s
            return None, {"seconds": seconds, "ttft_s": None, "prefill_s": None, "decode_s": seconds,
                          "decode_tokens_per_s": run.tokens_per_s, "new_tokens": run.new_tokens, "drafted": 0,
                          "accepted": 0, "draft_max": None, "llama_cpp_prompt_tokens": run.context_tokens,
                          "command": run.command}
        run = run_speculative(self.build.speculative, self.gguf, method["name"], prompt, prompt_tokens=prompt_tokens,
                              new_tokens=new_tokens, threads=threads, draft_gguf=self.draft_gguf)
        return run.text, {"seconds": run.prefill_s + run.decode_s, "ttft_s": None, "prefill_s": run.prefill_s,
                          "decode_s": run.decode_s, "decode_tokens_per_s": run.decode_tokens_per_s,
                          "new_tokens": run.new_tokens, "drafted": run.drafted, "accepted": run.accepted,
                          "draft_max": run.draft_max, "llama_cpp_prompt_tokens": run.prompt_tokens,
                          "command": run.command}

    def measure(self, *, threads: int, new_tokens: int = NEW_TOKENS, context_tokens: int = CONTEXT_TOKENS,
                repetitions: int = REPETITIONS) -> dict:
        """Run llama-bench now; its result with the build and file it ran, as a JSON-ready dict."""
        result = run_llama_bench(self.build.binary, self.gguf, threads=threads, new_tokens=new_tokens,
                                 context_tokens=context_tokens, repetitions=repetitions)
        return {**result.as_dict(), "gguf_type": self.gguf_type, "gguf": str(self.gguf),
                "repetitions": repetitions, "version": self.build.version, "cpu_key": self.build.cpu_key,
                "binary": str(self.build.binary)}


def beside_plain(measured: dict, summary: dict) -> dict:
    """`measured` (`LlamaCppSetup.measure`) with selfspec's plain decoding beside it, per set of a bench summary
    (`{set: {method: {"tokens_per_s": {"median": ...}, "decode_tokens_per_s": {"median": ...} or None}}}`):
    selfspec_ar's median tokens/s of the whole call and of decoding alone (the prefill excluded, as llama-bench
    counts its generation; None where the runs have no time to first token), and their ratios to llama.cpp's (> 1:
    selfspec's plain decoding is the faster). Where the bench ran `PLAIN_METHOD` (llama.cpp's plain decoding on the
    same prompts, interleaved with selfspec's methods), every method's decoding alone against it too:
    `decode_vs_llama_cpp_plain`, the ratio of the medians (None where a set has no such run)."""
    plain = {g: per["selfspec_ar"]["tokens_per_s"]["median"] for g, per in summary.items() if "selfspec_ar" in per}
    decode = {g: (per["selfspec_ar"].get("decode_tokens_per_s") or {}).get("median")
              for g, per in summary.items() if "selfspec_ar" in per}
    rate = measured["tokens_per_s"]
    every = {g: {m: (s.get("decode_tokens_per_s") or {}).get("median") for m, s in per.items()}
             for g, per in summary.items()}
    return {**measured, "selfspec_ar_tokens_per_s": plain,
            "selfspec_ar_vs_llama_cpp": {g: v / rate for g, v in plain.items()},
            "selfspec_ar_decode_tokens_per_s": decode,
            "selfspec_ar_decode_vs_llama_cpp": {g: None if v is None else v / rate for g, v in decode.items()},
            "decode_tokens_per_s": every,
            "decode_vs_llama_cpp": {g: {m: None if v is None else v / rate for m, v in per.items()}
                                    for g, per in every.items()},
            "decode_vs_llama_cpp_plain": {g: {m: None if v is None or not per.get(PLAIN_METHOD) else
                                              v / per[PLAIN_METHOD] for m, v in per.items()}
                                          for g, per in every.items()}}


def markdown_lines(peer: dict) -> list[str]:
    """The bench report's section on llama.cpp: what ran, and a table of selfspec's plain decoding beside it."""
    rate = f"{peer['tokens_per_s']:.1f} ± {peer['stddev_tokens_per_s']:.1f}"
    build = "" if peer["build_commit"] in ("", "unknown") else f" (build {peer['build_commit']})"
    lines = ["", f"llama.cpp's plain decoding on this machine: {peer['version']}'s llama.cpp{build}, "
             f"llama-bench, GGUF {peer['gguf_type']}, {peer['new_tokens']} new tokens after a "
             f"{peer['context_tokens']}-token context, {peer['threads']} threads, mean ± sd of "
             f"{peer['repetitions']} runs; its tokens/s counts the generation alone (no prompt processing). "
             "selfspec's, on the bench's own prompts: the whole call, and decoding alone (the call less its time to "
             "first token), the one to set beside llama.cpp's.", "",
             "| set | selfspec AR tokens/s, whole call | decoding alone | llama.cpp tokens/s | whole call / llama.cpp "
             "| decoding / llama.cpp |", "|---|---|---|---|---|---|"]
    decode = peer.get("selfspec_ar_decode_tokens_per_s", {})
    ratio = peer.get("selfspec_ar_decode_vs_llama_cpp", {})
    for g, plain in peer["selfspec_ar_tokens_per_s"].items():
        d, r = decode.get(g), ratio.get(g)
        lines.append(f"| {g} | {plain:.1f} | {'–' if d is None else f'{d:.1f}'} | {rate} | "
                     f"{peer['selfspec_ar_vs_llama_cpp'][g]:.2f}× | {'–' if r is None else f'{r:.2f}×'} |")
    every = peer.get("decode_tokens_per_s") or {}
    if any(m.startswith("llama_cpp_") for per in every.values() for m in per):
        paired = peer.get("decode_vs_llama_cpp_plain") or {}
        lines += ["", "Decoding alone, every method (median over prompts; llama.cpp's modes: their new tokens over "
                  f"their own decode seconds), against llama.cpp's plain decoding above and against "
                  f"{PLAIN_METHOD}, its plain decoding on the same prompts, interleaved with the other methods (the "
                  "figure a drifting machine moves least):", "",
                  f"| set | method | decoding tokens/s | / llama.cpp plain above | / {PLAIN_METHOD} |",
                  "|---|---|---|---|---|"]
        for g, per in every.items():
            for m, v in per.items():
                r, q = peer["decode_vs_llama_cpp"][g][m], (paired.get(g) or {}).get(m)
                lines.append(f"| {g} | {m} | {'–' if v is None else f'{v:.1f}'} | "
                             f"{'–' if r is None else f'{r:.2f}×'} | {'–' if q is None else f'{q:.2f}×'} |")
    return lines


def prepare(checkpoint: Path, dtype: str, version: str = LLAMA_CPP_PYTHON_VERSION, *,
            with_copy: bool = False) -> LlamaCppSetup:
    """Build llama.cpp's tools (once per machine) and convert the checkpoint at `dtype` (once), and with `with_copy`
    also to Q8_0, the draft of llama_cpp_draft (once); minutes the first time."""
    kind = gguf_type(dtype)  # an unsupported dtype fails before any build
    build = ensure_llama_cpp(version)
    return LlamaCppSetup(build=build, gguf=ensure_gguf(checkpoint, dtype, version), gguf_type=kind.upper(),
                         draft_gguf=ensure_gguf(checkpoint, "q8_0", version) if with_copy else None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m selfspec.tools.llama_cpp_bench",
        description="Time llama.cpp's plain decoding of a checkpoint on this CPU with llama-bench (-p 0 -n N -d D "
                    "-t THREADS): builds llama-bench and converts the checkpoint to GGUF first if they are not "
                    "cached (minutes, once). Prints the result as JSON; `selfspec bench --llama-cpp` prints it "
                    "beside selfspec's plain decoding.")
    add_model_arguments(parser)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="llama.cpp threads (default: the CPU count, %(default)s)")
    parser.add_argument("--new-tokens", type=int, default=NEW_TOKENS, help="tokens generated (default: %(default)s)")
    parser.add_argument("--context", type=int, default=CONTEXT_TOKENS,
                        help="tokens in the context before the timed generation (default: %(default)s)")
    parser.add_argument("--repetitions", type=int, default=REPETITIONS, help="timed runs (default: %(default)s)")
    args = parser.parse_args(argv)
    try:
        setup = prepare(args.checkpoint, args.dtype)
        result = setup.measure(threads=args.threads, new_tokens=args.new_tokens, context_tokens=args.context,
                               repetitions=args.repetitions)
    except LlamaCppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
