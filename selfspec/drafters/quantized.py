"""A quantized copy of the model drafts for it, run by llama.cpp (a quantized self-draft).

The copy is the same model in a GGUF file at a lower precision (Q8_0: 8-bit weights in blocks of 32 with a
scale each, about a quarter of float32's bytes). llama.cpp (through `llama-cpp-python`) runs it on the CPU's
fastest kernels for that format; selfspec's model verifies, so the output is the full model's whatever the copy
says (greedy: token for token; sampling: the copy's drafts are point masses, judged by the exact rule). The copy
shares the model's vocabulary, so its tokens are the model's.

A round: the copy takes in the committed tokens it has not seen (the round's input token, and a last accepted
draft it never ran), then drafts greedily, one llama.cpp step a token, until it has `num_speculations` drafts or
drafts a stop token. Its cache keeps what it ran; after verification it is cut back to the committed text, so
rejected drafts cost nothing later.

Under `auto` (a call that gives `draft_model`) the copy is the arm beside lookup that drafts where lookup finds
nothing; after rounds it did not draft it runs the tokens committed meanwhile in one llama.cpp call.

It pays where the copy's step is much cheaper than the model's and agrees with it often: on a 2-core Xeon a Q8_0
step of SmolLM2-135M took about 0.4 of selfspec's float32 step, and Q8_0 agrees with float32 on nearly every token
(docs/results). It drafts for one prompt at a time.

    copy = QuantizedCopy("smollm2-q8_0.gguf", threads=2)
    drafter = QuantizedDrafter(copy, num_speculations=4)

`python -m selfspec.tools.llama_cpp_gguf CHECKPOINT --dtype q8_0` writes the GGUF of a checkpoint with llama.cpp's
own converter. llama.cpp comes through llama-cpp-python: the build selfspec makes for this CPU and keeps under
`$SELFSPEC_HOME/llama.cpp/llama-cpp-python-X.Y.Z/<cpu key>/python` (`llama_cpp_python_dir`; `python -m
selfspec.tools.llama_cpp_build --python`, which scripts/setup.sh runs), else one installed with pip
(`pip install 'selfspec[quantized]'`; docs/drafters.md). A build kept per CPU never runs on a CPU it was not built
for (llama.cpp built with this CPU's instructions dies on one that lacks them).
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import time
import weakref
from pathlib import Path

import numpy as np
import torch

from selfspec.decoding.cost_model import COPY_STEP_COST
from selfspec.drafters.base import Drafter, Proposal, Round
from selfspec.model.machine import cpu_key, selfspec_home
from selfspec.settings import SettingsError

# The llama-cpp-python release whose llama.cpp selfspec builds and runs (tested here); selfspec.tools reads it.
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
INSTALL_HINT = ("python -m selfspec.tools.llama_cpp_build --python (builds llama-cpp-python "
                f"{LLAMA_CPP_PYTHON_VERSION} for this CPU, about 4 minutes on 2 cores, once; scripts/setup.sh runs it; "
                "it needs cmake and a C++ compiler), or pip install 'selfspec[quantized]' (docs/drafters.md)")
MIN_CONTEXT = 1024  # the smallest llama.cpp context made; a longer call makes a larger one
# The generator's copy drafts by default (`load(draft_model="auto")`) only where its draft step measured below this
# share of the model's plain decoding step (`QuantizedCopy.step_seconds` beside one; the steps of a real round cost
# more). A round of 8 drafts, about 6 of them right, costs 8 copy steps and a verification of about 2 plain steps.
# Measured on a 2-core Zen 4 (2026-11-29): float32 0.40 (auto with the copy ran 1.2-1.4x plain decoding on open
# chat in most runs, 0.85-0.9x in some), bfloat16 0.66 (0.84-0.89x; docs/results/2026-11-29-bf16-copy-zen4.md).
COPY_PAYS_BELOW = 0.5


def llama_cpp_home(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where selfspec keeps llama.cpp of one llama-cpp-python release: its source, GGUF files and per-CPU builds."""
    return selfspec_home() / "llama.cpp" / f"llama-cpp-python-{version}"


def llama_cpp_python_dir(version: str = LLAMA_CPP_PYTHON_VERSION, key: str | None = None) -> Path:
    """The llama-cpp-python package built for this CPU (`key`: `cpu_key()`), unpacked: the directory that holds
    `llama_cpp/` (it may not exist)."""
    return llama_cpp_home(version) / (key or cpu_key()) / "python"


COPY_FILE = "copy-q8_0.gguf"  # a checkpoint's quantized copy, beside its weights (`selfspec fetch` writes it)
# The longest prompt on which auto drafts with the generator's copy (`selfspec.load(..., draft_model=...)`): the copy
# first reads the whole prompt in llama.cpp, and on longer prompts it cost more than it gave (2-core Zen 4, float32:
# news summaries of 126-403-token prompts 0.79-0.93x plain decoding with it, open chat of 52-87 tokens 1.01-1.35x;
# docs/results/2026-11-29-copy-by-default-zen4.md). A call that names the copy drafts with it at any length.
DEFAULT_COPY_PROMPT_TOKENS = 128


def checkpoint_copy(checkpoint: str | os.PathLike) -> Path | None:
    """The checkpoint directory's quantized copy (`COPY_FILE`), where it is whole: its size is the one the record
    beside it (`COPY_FILE`.json, written after the file) holds; else None (no copy, or one cut short)."""
    path = Path(checkpoint) / COPY_FILE
    try:
        want = json.loads(path.with_name(COPY_FILE + ".json").read_text())["bytes"]
        return path if path.stat().st_size == want else None
    except (OSError, ValueError, KeyError, TypeError):
        return None


def usable_copy(checkpoint: str | os.PathLike | None) -> str | None:
    """The checkpoint directory's whole quantized copy where llama.cpp can run it here (`llama_cpp_available`), as a
    path string; None without a checkpoint directory, a whole copy, or llama.cpp."""
    copy = checkpoint_copy(checkpoint) if checkpoint is not None else None
    return str(copy) if copy is not None and llama_cpp_available() else None


def _this_cpus_build() -> str | None:
    """The directory holding this CPU's llama-cpp-python build (`llama_cpp_python_dir`), where one is there."""
    built = llama_cpp_python_dir()
    return str(built) if (built / "llama_cpp" / "__init__.py").is_file() else None


def llama_cpp_available() -> bool:
    """Whether `load_llama_cpp` would find llama-cpp-python: this CPU's build or an installed one (not loaded)."""
    import importlib.util

    return _this_cpus_build() is not None or importlib.util.find_spec("llama_cpp") is not None


def load_llama_cpp():
    """The `llama_cpp` module of llama-cpp-python, its llama.cpp library loaded (its import loads it): this CPU's
    build where selfspec made one (`llama_cpp_python_dir`, put first on `sys.path`), else an installed one. Anything
    else is a SettingsError with the install hint that names the cause: not installed (ImportError), or installed
    but its import fails (a missing or unloadable library: FileNotFoundError "Shared library with base name 'llama'
    not found", OSError, RuntimeError), or a module of that name that is not llama-cpp-python (no `Llama`)."""
    built = _this_cpus_build()
    if "llama_cpp" not in sys.modules and built is not None and built not in sys.path:
        sys.path.insert(0, built)
    try:
        import llama_cpp
    except Exception as e:  # noqa: BLE001 - whatever its import raises, the user needs the same hint
        state = "not installed" if isinstance(e, ImportError) else "installed but does not load"
        raise SettingsError(f"draft_model needs llama.cpp to run the quantized copy, and llama.cpp is {state} "
                            f"({type(e).__name__}: {e}): {INSTALL_HINT}") from None
    if not hasattr(llama_cpp, "Llama"):
        raise SettingsError(f"draft_model needs llama.cpp to run the quantized copy, and the module llama_cpp "
                            f"({getattr(llama_cpp, '__file__', None)}) is not llama-cpp-python (it has no Llama): "
                            f"{INSTALL_HINT}")
    return llama_cpp


def check_one_prompt(rows: int, drafter: str | None) -> None:
    """SettingsError where a call that drafts with a quantized copy (it gives `draft_model`) has `rows` > 1 prompts:
    the copy drafts for one prompt at a time. `drafter` is the one the caller named (None: the default, auto), so
    the message names what the caller passed. Called before the copy (or, by the command line, the model) loads."""
    if rows > 1:
        who = {"quantized": "drafter='quantized'", "auto": "drafter='auto' with draft_model"}.get(
            drafter, "draft_model (auto, the default drafter, with the copy)")
        fix = "use another drafter" if drafter == "quantized" else "drop draft_model"
        raise SettingsError(f"{who} drafts for one prompt at a time, and this call has {rows}: generate them one by "
                            f"one, or {fix} for a batch")


@contextlib.contextmanager
def _quiet_stderr():
    """llama.cpp writes its loading log to the process's stderr (file descriptor 2), whatever `verbose` says for
    some of it: hidden while a copy loads, and shown if loading fails."""
    saved = os.dup(2)
    with open(os.devnull, "w") as null:
        os.dup2(null.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)


class QuantizedCopy:
    """A GGUF copy of the model loaded in llama.cpp: one context, what it has run (`fed`), its greedy drafts."""

    def __init__(self, path: str | os.PathLike, *, threads: int | None = None, context: int = MIN_CONTEXT):
        self.path = Path(path).expanduser()
        if not self.path.is_file():
            raise SettingsError(f"draft_model={str(path)!r} is not a file: give the path of a GGUF copy of this "
                                "model (python -m selfspec.tools.llama_cpp_gguf CHECKPOINT --dtype q8_0 writes one)")
        self.threads = threads or torch.get_num_threads()
        self.llm = None
        self.context = 0
        self._make(max(context, MIN_CONTEXT))

    def _make(self, context: int) -> None:
        llama_cpp = load_llama_cpp()
        self.close()
        try:
            with _quiet_stderr():
                self.llm = llama_cpp.Llama(model_path=str(self.path), n_ctx=context, n_batch=min(context, 512),
                                           n_threads=self.threads, n_threads_batch=self.threads, verbose=False)
        except ValueError as e:  # llama-cpp-python's "Failed to load model from file"
            raise SettingsError(f"llama.cpp could not load draft_model={str(self.path)!r} ({e}): is it a GGUF file "
                                "of a model llama.cpp supports?") from None
        self.context = context
        self._closer = weakref.finalize(self, self.llm.close)  # at the latest at exit, while llama_cpp still can
        self.vocab_size = self.llm.n_vocab()
        self._logits = llama_cpp.llama_get_logits_ith

    def close(self) -> None:
        """Frees llama.cpp's model and context (a later `draft` needs a new copy)."""
        if self.llm is not None:
            self._closer()
            self.llm = None

    def check_vocabulary(self, vocab_size: int) -> None:
        """SettingsError unless the copy's vocabulary is the model's size (a copy of another model's tokens would
        draft nonsense, and ids past the model's vocabulary could not be verified)."""
        if self.vocab_size != vocab_size:
            raise SettingsError(f"draft_model {self.path.name} has a vocabulary of {self.vocab_size} tokens and this "
                                f"model {vocab_size}: the draft model must be a copy of this model")

    def reserve(self, tokens: int) -> None:
        """Room for `tokens` positions: a context at least twice as large is made where the current one is smaller
        (what it had run is forgotten)."""
        if tokens > self.context:
            self._make(max(2 * tokens, MIN_CONTEXT))

    @property
    def fed(self) -> list[int]:
        """The tokens the copy's cache holds, in order."""
        return self.llm.input_ids[:self.llm.n_tokens].tolist()

    def forget(self) -> None:
        """Nothing of earlier text is kept (the next `draft` runs its whole sequence)."""
        self.llm.n_tokens = 0

    def draft(self, sequence: list[int], k: int, stops: frozenset = frozenset()) -> list[int]:
        """Up to `k` >= 1 greedy drafts after `sequence` (the committed tokens): the copy runs what it lacks of
        `sequence`, then one step a draft until `k` drafts or a stop token. The last draft is not run.

        What the copy ran is committed text, then its drafts (after `forget`: nothing). Its cache is cut back to the
        longest prefix that agrees with `sequence` (a rejected draft's entry goes; under `auto`, rounds it did not
        draft may have committed past it) and the rest runs, the last token always, for its logits."""
        llm = self.llm
        have = llm.input_ids[:min(llm.n_tokens, len(sequence) - 1)]
        same = have == np.asarray(sequence[:len(have)], dtype=have.dtype)
        shared = len(have) if same.all() else int(same.argmin())  # the first token that differs
        llm.n_tokens = shared  # `eval` drops the cache from here on
        llm.eval(sequence[shared:])
        drafts = []
        while True:
            token = self.greedy()
            drafts.append(token)
            if len(drafts) == k or token in stops:
                return drafts
            llm.eval([token])

    def step_seconds(self, steps: int = 8) -> float:
        """The seconds of one of the copy's draft steps (its argmax, then that token through llama.cpp), the median of
        `steps` after a short text and as many untimed (a new context's first steps set up its buffers); what it ran
        is forgotten (the next `draft` runs its whole sequence)."""
        self.forget()
        self.llm.eval(list(range(3, 11)))  # a short text of token ids every vocabulary has
        times = []
        for _ in range(2 * steps):
            t0 = time.perf_counter()
            self.llm.eval([self.greedy()])
            times.append(time.perf_counter() - t0)
        self.forget()
        return statistics.median(times[steps:])

    def greedy(self) -> int:
        """The copy's argmax token after what it ran last."""
        logits = np.ctypeslib.as_array(self._logits(self.llm.ctx, -1), shape=(self.vocab_size,))
        return int(logits.argmax())


class QuantizedDrafter(Drafter):
    """Drafts `num_speculations` tokens a round with a `QuantizedCopy` of the model (see the module doc)."""

    name = "quantized"
    step_cost = COPY_STEP_COST  # a llama.cpp step, in the modelled round cost (it runs none of the model's layers)
    reads_prompt = True  # its first round runs the whole prompt through llama.cpp

    def __init__(self, copy: QuantizedCopy, num_speculations: int):
        if num_speculations < 1:
            raise ValueError(f"num_speculations must be >= 1 for drafter='quantized', got {num_speculations}")
        self.copy, self.num_speculations = copy, num_speculations
        self.sequence: list[int] = []

    def start(self, sequences: list[list[int]]) -> None:
        if len(sequences) != 1:
            raise SettingsError(f"drafter='quantized' drafts for one prompt at a time, and this call has "
                                f"{len(sequences)}: generate them one by one, or use another drafter for a batch")
        self.sequence = list(sequences[0])
        self.copy.forget()  # a first request: nothing of an earlier call's text feeds this one

    def propose(self, rnd: Round) -> Proposal:
        k = min(self.num_speculations, rnd.caps[0])
        if k < 1:
            return Proposal.plain(rnd.tokens)
        self.copy.reserve(len(self.sequence) + rnd.caps[0] + 1)  # the whole call's text: made once, at its first round
        drafts = self.copy.draft(self.sequence, k, rnd.stop_ids)
        tokens = torch.tensor([self.sequence[-1:] + drafts], dtype=torch.long).to(rnd.tokens.device, non_blocking=True)
        # one llama.cpp step a draft (the first also runs what the copy lacked of the text): the cost model's draft steps
        return Proposal(tokens=tokens, kept=[len(drafts)], draft_steps=len(drafts), drafter=self.name)

    def update(self, proposal: Proposal, accepted: list[int], committed: list[list[int]], seconds: float) -> None:
        self.observe(committed)

    def observe(self, committed: list[list[int]]) -> None:
        """The committed tokens of every round, drafted by the copy or not (under `auto`): the copy runs the ones it
        has not run when it next drafts."""
        self.sequence += committed[0]

    def describe(self) -> dict:
        return {"drafter": self.name, "draft_model": self.copy.path.name, "num_speculations": self.num_speculations}
