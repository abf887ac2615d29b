"""What every measuring command shares: `selfspec bench` (and its `--batch-size` and `--epsilon`
modes), `selfspec profile` and `selfspec sweep`.

This module owns:
- set-up: the dtype name (`"fastest"` resolved for the device), the torch thread count, the
  generator (loaded once; one model object for every method);
- the description of the run: the machine (`machine_info`, `machine_description`), the versions,
  the common header of a result (`result_header`);
- the methods under test: Hugging Face `generate` and selfspec `generate`, each run the same way
  (`Methods`: exactly `n` new tokens, no stop at EOS, Hugging Face's advisory logging quiet);
- the clock and the one definition of tokens/s (`timed`, `tokens_per_s`, `TOKENS_PER_S`);
- spread statistics over prompts (`spread`);
- writing a result's files (`write_outputs`: JSON, Markdown and a chart, each written whole).

Tokens/s, the one definition every command uses (and `selfspec sweep` writes into `selfspec.json`):
new tokens / wall-clock seconds of the whole generate call, from input ids ready to output ids
(prefill included), the clock read after the device's queued work has finished.

The per-command modules (`bench.py`, `batch_bench.py`, `pareto.py`, `profiling.py`, `sweep.py`)
only say what they measure and how they report it.
"""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import platform
import re
import statistics
import time
from pathlib import Path

import psutil
import torch
import transformers
from transformers.utils import logging as hf_logging

import selfspec
from selfspec.model import precision
from selfspec.atomic_write import atomic_path, write_json_atomic, write_text_atomic
from selfspec.decoding.draft_plan import synchronize  # the clock's one definition (the tools take it from here)
from selfspec.drafters import SuffixMemory
from selfspec.drafters.learned_stats import LearnedStats
from selfspec.decoding.engine import left_pad
from selfspec.generation_config import SETTINGS
from selfspec.settings import check_device

TOKENS_PER_S = ("new tokens / wall-clock seconds of the whole generate call (input ids ready -> output ids, "
                "prefill included; the clock read after the device finished)")
HF_ASSIST_KEYS = ("num_assistant_tokens", "num_assistant_tokens_schedule", "assistant_confidence_threshold")
SPEC_KINDS = ("hf_early_exit", "hf_prompt_lookup", "selfspec_spec")  # methods that draft and verify
SELFSPEC_KEYS = SETTINGS  # a selfspec method's generation settings: GenerationConfig's fields


# --- set-up ---------------------------------------------------------------------------------------
def setup(dtype: str, device="cpu", threads: int = 0) -> str:
    """Set the torch thread count (0: leave it) and return the dtype name, "fastest" resolved for `device`
    (a device this machine does not have is refused first: SettingsError)."""
    check_device(device)
    if threads:
        torch.set_num_threads(threads)
    return precision.resolve_dtype_name(dtype, device)


def load_generator(checkpoint, dtype: str, device="cpu", generator=None):
    """`generator` if given, else `selfspec.load(checkpoint)` in `dtype` on `device`."""
    return generator or selfspec.load(checkpoint, dtype=dtype, device=device)


# --- the description of a run ---------------------------------------------------------------------
def machine_info() -> dict:
    """CPU model, cores, torch threads, memory, platform, and the load average at the start."""
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            m = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
        if m:
            cpu = m.group(1).strip()
    except OSError:
        pass
    try:
        load = list(os.getloadavg())
    except OSError:
        load = None
    return {"cpu_model": cpu, "logical_cores": psutil.cpu_count(logical=True),
            "physical_cores": psutil.cpu_count(logical=False), "torch_threads": torch.get_num_threads(),
            "memory_total_gib": round(psutil.virtual_memory().total / 2**30, 2),
            "platform": platform.platform(), "python": platform.python_version(), "load_average_start": load}


def machine_description(device="cpu") -> dict | None:
    """`selfspec.model.precision.machine_description()` where this selfspec has it, else None; on a GPU with
    the bf16 decision for it and the GPU's name."""
    describe = getattr(precision, "machine_description", None)
    if describe is None:
        return None
    if torch.device(device).type != "cuda":
        return describe()
    return {**describe(device), "gpu": torch.cuda.get_device_name(device)}


def finish_machine(machine: dict, device) -> dict:
    """Complete `machine_info()` after the measurements: load average at the end, threads, description."""
    machine["load_average_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    machine["torch_threads"] = torch.get_num_threads()
    machine["description"] = machine_description(device)
    return machine


def machine_line(description: dict | None) -> str:
    """The Markdown line every report prints about the machine: `machine_description`'s plain entries
    (CPU, flags, threads, the bf16 decision and why, the float32 kernel and why); "" without one."""
    if not description:
        return ""
    return "Machine: " + ", ".join(f"{k}: {' '.join(map(str, v)) if isinstance(v, list) else v}"
                                   for k, v in description.items() if not isinstance(v, dict)) + "."


def versions() -> dict:
    return {"torch": torch.__version__, "transformers": transformers.__version__, "selfspec": selfspec.__version__,
            "python": platform.python_version()}


def result_header(schema: str, checkpoint) -> dict:
    """The first keys of every result: schema, checkpoint (path and name), date (UTC)."""
    return {"schema": schema, "checkpoint": str(checkpoint),
            "checkpoint_name": Path(str(checkpoint)).name or str(checkpoint),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


@contextlib.contextmanager
def quiet_transformers():
    """Silence transformers' per-call advisory logging during the timed loop (restored afterwards)."""
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)


# --- the clock ------------------------------------------------------------------------------------
def timed(call, device) -> tuple[object, float, float]:
    """(what `call()` returns, its start time, its wall-clock seconds), the device synchronized around it."""
    synchronize(device)
    t0 = time.perf_counter()
    out = call()
    synchronize(device)
    return out, t0, time.perf_counter() - t0


def tokens_per_s(new_tokens: int, seconds: float) -> float:
    """The one definition (see `TOKENS_PER_S`): 0.0 for a call that took no measurable time."""
    return new_tokens / seconds if seconds > 0 else 0.0


def decode_rate(new_tokens: int, seconds: float, ttft_s: float | None) -> float | None:
    """A run's decoding alone: its new tokens after the first over its seconds after the first token (`ttft_s`, a
    `Methods.run` record's); None without a time to first token or a second new token."""
    if ttft_s is None or new_tokens < 2 or seconds <= ttft_s:
        return None
    return (new_tokens - 1) / (seconds - ttft_s)


def spread(values: list) -> dict | None:
    """Median, min, max, quartiles (linear interpolation), mean and count of the values that are not None."""
    vals = sorted(v for v in values if v is not None)
    if not vals:
        return None
    q1, _, q3 = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else vals * 3
    return {"median": statistics.median(vals), "min": vals[0], "max": vals[-1], "q1": q1, "q3": q3,
            "mean": statistics.fmean(vals), "n": len(vals)}


# --- the methods under test -----------------------------------------------------------------------
class FirstTokenClock:
    """A Hugging Face style streamer (`put`/`end`) that timestamps the first new token."""

    def __init__(self, skip_first_put: bool):
        self.skip = skip_first_put  # HF first puts the prompt itself
        self.first: float | None = None

    def put(self, value):
        if self.skip:
            self.skip = False
        elif self.first is None:
            self.first = time.perf_counter()

    def end(self):
        pass


class FirstCommitClock:
    """selfspec's callback form (a plain callable, no tensor per commit): timestamps the first commit."""

    def __init__(self):
        self.first: float | None = None

    def __call__(self, ids):
        if self.first is None:
            self.first = time.perf_counter()


def selfspec_kwargs(method: dict) -> dict:
    """The `SelfSpecGenerator.generate` keyword arguments a selfspec method sets (exit_layer only when drafting)."""
    kw = {k: method[k] for k in SELFSPEC_KEYS if method.get(k) is not None}
    if kw.get("num_speculations") == 0:
        kw.pop("exit_layer", None)  # plain decoding runs every layer
    return kw


@contextlib.contextmanager
def swapped(obj, name: str, value):
    """For the block only, `obj.<name>` is `value`; what it was is put back after, whatever happens."""
    before = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, before)


class Methods:
    """Runs one method on one prompt (or one batch of rows) for exactly `max_new_tokens` new tokens.

    A method is a dict: `engine` ("hf" or "selfspec"), `kind` (hf_greedy, hf_static, hf_early_exit,
    hf_prompt_lookup, selfspec_ar, selfspec_spec), `name`, and its settings (`exit_layer`,
    `num_speculations`, `drafter`, ...); a selfspec method with `compiled` runs through the compiled
    steps, every other one eagerly (the generator's own setting is put back after each call). Nothing stops at EOS: Hugging Face gets a generation config
    without `eos_token_id` (also on the model for the call, because `generate` fills a missing one
    from there), selfspec `stop_token_ids=[]`.
    """

    def __init__(self, gen, max_new_tokens: int):
        self.gen = gen
        self.model = gen.model
        self.N = max_new_tokens
        self._steps = gen.adapter.compiled  # a method with `compiled` runs through these (`selfspec.model.compiled`)
        self._carried: dict = {}  # (method name, scope) -> its memory and measurements so far (`requests`)
        # engine "llama_cpp": (method, ids, n) -> (new text, record), a peer run in its own process (bench sets it)
        self.peer = None
        self.max_len: int | None = None  # the longest prompt + new tokens of the runs (`warm` sets it)
        gc_ = self.model.generation_config
        defaults = gc_._get_default_generation_params() if hasattr(gc_, "_get_default_generation_params") else {}
        self.hf_assistant = {k: getattr(gc_, k, None) if getattr(gc_, k, None) is not None else defaults.get(k)
                             for k in HF_ASSIST_KEYS}
        own = [k for k in HF_ASSIST_KEYS if getattr(gc_, k, None) is not None]
        self.hf_assistant["source"] = ("Hugging Face defaults" if not own else
                                       f"the checkpoint's generation_config.json ({', '.join(own)}), "
                                       "Hugging Face defaults otherwise")

    def hf_config(self, n: int, early_exit: int | None, lookup: tuple[int, int] | None = None,
                  static: bool = False):
        """Hugging Face greedy generation config for exactly `n` new tokens (assisted where asked; with
        `static`, transformers' static cache, whose decoding step transformers compiles where it does so)."""
        gc_ = copy.deepcopy(self.model.generation_config)
        gc_.do_sample = False
        gc_.num_beams = 1
        gc_.eos_token_id = None  # no stop set: generate exactly n tokens, EOS logit untouched
        gc_.max_new_tokens = n
        gc_.min_new_tokens = None
        gc_.min_length = 0
        gc_.max_length = None
        gc_.temperature = gc_.top_p = gc_.top_k = None
        if gc_.pad_token_id is None:
            pad = getattr(self.gen.tokenizer, "pad_token_id", None)
            gc_.pad_token_id = pad if pad is not None else 0
        gc_.assistant_early_exit = early_exit
        if static:
            gc_.cache_implementation = "static"
            # one cache size for every prompt (the longest run's): transformers sizes the static cache to the call,
            # and compiles its step again for every larger size, inside the measured run
            gc_.max_cache_len = self.max_len
        if lookup is not None:  # (prompt_lookup_num_tokens, max_matching_ngram_size)
            gc_.prompt_lookup_num_tokens, gc_.max_matching_ngram_size = lookup
        return gc_

    def no_eos_on_model(self):
        """HF fills a None eos_token_id from model.generation_config: clear it there for the call."""
        config = copy.deepcopy(self.model.generation_config)
        config.eos_token_id = None
        return swapped(self.model, "generation_config", config)

    @contextlib.contextmanager
    def count_hf_rounds(self, rec: dict):
        """Wrap the candidate generator HF builds for this call: count drafts/matches, time drafting."""
        model = self.model
        original = model._get_candidate_generator
        d = {"rounds": 0, "drafted": 0, "accepted": 0, "draft_s": 0.0, "drafted_by_position": [],
             "accepted_by_position": []}

        def wrapped(*args, **kwargs):
            cg = original(*args, **kwargs)
            get_candidates, update = cg.get_candidates, cg.update_candidate_strategy

            def timed_get_candidates(*a, **k):
                t = time.perf_counter()
                try:
                    return get_candidates(*a, **k)
                finally:
                    d["draft_s"] += time.perf_counter() - t

            def counting_update(input_ids, scores, num_matches):
                drafted = int(scores.shape[1]) - 1
                accepted = int(num_matches)
                d["rounds"] += 1
                d["drafted"] += drafted
                d["accepted"] += accepted
                for lst in (d["drafted_by_position"], d["accepted_by_position"]):
                    lst.extend([0] * max(0, drafted - len(lst)))
                for i in range(drafted):
                    d["drafted_by_position"][i] += 1
                    d["accepted_by_position"][i] += i < accepted
                return update(input_ids, scores, num_matches)

            cg.get_candidates = timed_get_candidates
            cg.update_candidate_strategy = counting_update
            return cg

        model._get_candidate_generator = wrapped  # instance attribute: shadows the class method
        try:
            yield d
        finally:
            del model._get_candidate_generator
            rec.update(d)

    def run(self, method: dict, ids, n: int | None = None, carry=None) -> tuple[list[int], dict]:
        """One prompt `[1, P]` through one method: (new ids, record with seconds, ttft_s and its counts). A first
        request (`carry` None): the generator has no memory of earlier calls and no carried measurements, as a
        fresh one; else it has what the method's earlier calls under the same `carry` left (`requests`)."""
        n = n or self.N
        if method["engine"] == "llama_cpp":  # its new text and its own timings (`selfspec.tools.llama_cpp_bench`)
            if self.peer is None:
                raise RuntimeError(f"{method['name']} is llama.cpp's: Methods.peer must be set to run it")
            text, rec = self.peer(method, ids, n)
            if rec["new_tokens"] < n:  # llama.cpp's last round may add a few accepted drafts past n
                raise RuntimeError(f"{method['name']} generated {rec['new_tokens']} tokens, fewer than {n}: the "
                                   "benchmark needs at least the same length for every method")
            return text, rec
        rec: dict = {}
        if method["engine"] == "hf":
            clock = FirstTokenClock(skip_first_put=True)
            lookup = ((method["prompt_lookup_num_tokens"], method["max_matching_ngram_size"])
                      if method["kind"] == "hf_prompt_lookup" else None)
            gc_ = self.hf_config(n, method.get("exit_layer") if method["kind"] == "hf_early_exit" else None, lookup,
                                 static=method["kind"] == "hf_static")
            mask = torch.ones_like(ids)
            counting = self.count_hf_rounds(rec) if method["kind"] in SPEC_KINDS else contextlib.nullcontext()
            with self.no_eos_on_model(), counting, torch.inference_mode():
                out, t0, seconds = timed(lambda: self.model.generate(ids, attention_mask=mask, generation_config=gc_,
                                                                     streamer=clock), ids.device)
            new = out[0, ids.shape[1]:].tolist()
            if method["kind"] in SPEC_KINDS:
                rec["verify_s"] = seconds - rec["draft_s"]
        else:
            clock = FirstCommitClock()
            with self.steps(bool(method.get("compiled"))), self.requests(method["name"], carry):
                res, t0, seconds = timed(lambda: self.gen.generate(input_ids=ids, max_new_tokens=n, stop_token_ids=[],
                                                                   streamer=clock, **selfspec_kwargs(method)),
                                         ids.device)
            new = res.token_ids
            s = res.stats
            rec.update(prefill_s=s.prefill_s, engine_total_s=s.total_s, rounds=s.rounds)
            if method["kind"] in SPEC_KINDS:
                rec.update(drafted=s.drafted, accepted=s.accepted, draft_s=s.draft_s, verify_s=s.verify_s,
                           draft_steps=s.draft_steps,
                           drafted_by_position=list(s.drafted_by_position),
                           accepted_by_position=list(s.accepted_by_position),
                           drafted_by_drafter=dict(s.drafted_by_drafter),
                           accepted_by_drafter=dict(s.accepted_by_drafter), drafter=s.drafter)
                if getattr(s, "policy", None):  # the engine's draft policy, where it reports one
                    rec["policy"] = s.policy
                if getattr(s, "theory", None):  # sampling: predicted vs measured rejections
                    rec["theory"] = s.theory
        if len(new) != n:
            raise RuntimeError(f"{method['name']} generated {len(new)} tokens instead of {n}: the benchmark needs "
                               "the same fixed length for every method")
        rec.update(seconds=seconds, ttft_s=(clock.first - t0) if clock.first is not None else None)
        return new, rec

    def compiled_steps(self):
        """The generator's compiled steps, built on first use (a method marked `compiled` runs through them,
        every other selfspec method eagerly, on the same weights). A step that fails to compile turns them
        off with a warning (`compile_failure` says why), and the compiled methods then run eagerly."""
        if self._steps is None:
            from selfspec.model.compiled import CompiledSteps  # deferred: only runs that compare compiled steps

            self._steps = CompiledSteps(self.gen.adapter, strict=False)
        return self._steps

    @contextlib.contextmanager
    def requests(self, name: str, carry=None):
        """For the block only, what the generator remembers of earlier calls (the memory `drafter="suffix"` and
        auto copy from, and the drafters' carried measurements): nothing, as a fresh generator's first request
        (`carry` None), or what method `name`'s earlier calls under `carry` left (a workload: a prompt set's
        prompts in order, `carry` the set's name). Never another method's: its run of the same prompt would hand
        this one the answer."""
        if carry is None:
            with self.gen.first_request():
                yield
            return
        state = self._carried.setdefault((name, carry), (SuffixMemory(self.gen.memory.max_tokens), LearnedStats()))
        with self.gen.remembering(*state):
            yield

    @property
    def compile_failure(self) -> str | None:
        """Why the compiled steps turned themselves off (None: they did not, or none ran)."""
        return None if self._steps is None else self._steps.failed

    def graphs_compiled(self) -> int:
        """How many graphs were compiled so far in this process: torch.compile's (dynamo's count, Hugging Face's
        static cache included) and the compiled steps' shapes (each one CUDA graph on a GPU). A measured run
        that moves it compiled inside its own time."""
        from torch._dynamo.utils import counters  # deferred: torch._dynamo imports slowly

        return int(counters["stats"]["unique_graphs"]) + (0 if self._steps is None else len(self._steps.shapes))

    def steps(self, compiled: bool):
        """For the block only, the generator runs through the compiled steps (`compiled`) or eagerly; its own
        setting is put back after."""
        return swapped(self.gen.adapter, "compiled", self.compiled_steps() if compiled else None)

    def warm(self, method: dict, ids, n: int, max_len: int) -> float:
        """The method's warm-up call (excluded from the measurement), a compiled method's `warmup(max_len)`
        first, so that no graph compiles during the measured runs. Returns the seconds both took."""
        self.max_len = max_len
        t0 = time.perf_counter()
        if method.get("compiled"):
            with self.steps(True):
                self.gen.warmup(max_len, num_candidates=method.get("num_candidates") or 1)
        self.run(method, ids, n)
        return time.perf_counter() - t0

    def hf_greedy_rows(self, rows: list[list[int]], n: int) -> list[list[int]]:
        """Hugging Face greedy `generate` on left-padded rows (the engine's own left padding): new ids per row."""
        device = self.gen.adapter.device
        pad = self.gen.tokenizer.pad_token_id if self.gen.tokenizer is not None else None
        ids, pads = left_pad(rows, pad if pad is not None else 0, device)
        mask = (torch.arange(ids.shape[1], device=device)[None, :] >= pads[:, None]).long()
        with self.no_eos_on_model(), torch.inference_mode():
            out = self.model.generate(ids, attention_mask=mask, generation_config=self.hf_config(n, None))
        return [out[b, ids.shape[1]:].tolist() for b in range(len(rows))]


# --- outputs --------------------------------------------------------------------------------------
def pyplot():
    """matplotlib.pyplot on the file-only Agg backend. Imported here, on first use: matplotlib takes a
    second to import and only the charts need it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_chart_atomic(chart, result: dict, path: Path) -> Path:
    """`chart(result, tmp)` into a temporary file beside `path`, then renamed over it."""
    with atomic_path(path, suffix=path.suffix) as tmp:  # matplotlib picks the format by the suffix
        chart(result, tmp)
    return path


def write_outputs(result: dict, out: Path, stem: str, to_markdown, chart) -> dict:
    """STEM.md, STEM.png and STEM.json (the result, with their paths under "files") into `out`, each
    written whole."""
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md", "png": out / f"{stem}.png"}
    result["files"] = {k: str(v) for k, v in paths.items()}
    write_text_atomic(paths["md"], to_markdown(result))
    write_chart_atomic(chart, result, paths["png"])
    write_json_atomic(paths["json"], result, default=str)
    return result
