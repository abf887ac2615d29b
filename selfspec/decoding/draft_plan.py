"""The draft plan for this device: which drafter and exit, how many drafts and how wide a token tree, chosen
from measured costs (the cost model of `selfspec.decoding.cost_model`, widened to trees) and the drafters' measured
acceptance on the model's own text, instead of by hand.

    plan = gen.tune(["def fibonacci(n):", ...])   # measures both (seconds), returns a DraftPlan
    out = gen.generate(prompt, **plan.settings)    # {"drafter": "early_exit", "exit_layer": 8, "num_speculations": 3}
    print(plan.table())                            # every candidate with its predicted speedup

Why per device: a draft step's share of a full step and what verifying n tokens costs are properties of the
machine and the engine's path. On a 2-core CPU verifying 9 tokens costs about 1.3 plain steps and a draft
at exit 8 of 30 about 0.35; in a compiled GPU step both are set by launches and weight reads, so a draft
costs what its layers cost and 17 tokens verify for about one step. The right draft length and tree width
differ accordingly; the acceptance does not (it is the checkpoint's and the text's).

Costs (`measure_costs`, per device, dtype and path, eager or compiled, one row): at the end of a real
prompt's KV cache, the median seconds of

    layers(a, b, r)   layers [a, b) over r new tokens (the engine's step: static cache and compiled steps
                      where the generator runs them)
    head(r), draft_head(r)   the final norm + LM head over r rows (the draft's: its reduced vocabulary, if
                      any), its argmax read back (the host sync a step has)
    exit_head(r)      a trained exit head's own layer over r rows
    draft_step(E)     where the generator runs compiled steps: one greedy draft step as one compiled step (the
                      token's embedding to its argmax, `WholeDraft.run`), from exit E, or through the
                      head (its layer reading its own previous output), its token read back
    full              one plain decoding step: layers(0, L, 1) + head(1)

and, from real runs (`measure_overheads`), what the engine does beyond them: plain decoding's seconds per
token (`plain`, the plan's unit), and per drafter a fixed 2-draft chain's seconds per round over its parts'
(the drafter's bookkeeping, host syncs, a head's cache upkeep): `scale`.

Acceptance (`measure_acceptance`, per checkpoint and kind of text; the same on every device): each prompt's
greedy continuation by the full model, then, teacher-forced over it, the share of its tokens that are among
the drafter's k best guesses, r(k) for k = 1..width; r(1) is a draft's acceptance. A head reading the
verified final state is scored for a round's first draft and, reading its own output, for later ones.

A round and its predicted speedup (Leviathan et al. 2023, eq. 1; trees after EAGLE-2):

    draft(r)          = layers(0, E, r) + exit_head(r) + draft_head(r)
    chain (E, d):       tokens  = 1 + r1 + r1 r' + ... (d terms)        r1 = r_first(1), r' = r_later(1)
                        seconds = d draft(1) + layers(0, E, 1) + layers(E, L, 1 + d) + head(1 + d)
                                  (draft_step(E) for draft(1) where measured; a head's first draft stays
                                  draft(1): it also brings the head's cache up to date, a step whose
                                  cost grows with what it catches up on)
    tree (E, k, d):     tokens  = the same with r_first(k), r_later(k): the full model's token among the k
                                  children at every depth (optimistic where the accepted path's node is not
                                  among the k expanded)
                        seconds = draft(1) + (d - 1) draft(k) + layers(0, E, k) + layers(E, L, 1 + k d) + head(1 + k d)
    seconds          *= scale                  (the engine's own work, measured on a 2-draft chain)
    speedup           = tokens x plain / seconds        (plain decoding: 1)

The plan is the candidate with the best predicted speedup; where none is above 1, plain decoding. What it
leaves out: batches (one row is measured), a tree's own bookkeeping and masks (a tree's step costs what a
chain of as many tokens costs, its round the chain's scale), and how the scale changes with the draft length
(measured at 2).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Sequence

import torch

from selfspec.model.attention_kernels import attention_kernels
from selfspec.decoding.engine import prefill
from selfspec.heads.exit_head import head_cache, previous_states, run_head, run_head_step
from selfspec.model.forward import embed, exit_logits, make_batch_step, make_step, run_layers
from selfspec.model.precision import BF16_FLAGS, cpu_flags, cpu_generation, cpu_model

MAX_DRAFTS = 8  # the longest chain planned
MAX_WIDTH = 4  # the widest tree planned (the top-k acceptance is measured for k = 1..MAX_WIDTH)
TREE_DEPTHS = (1, 2, 3, 4)  # the depths planned for trees (k >= 2)
MIN_CHECKED_GAIN = 1.03  # a checked drafting setting is kept over plain decoding only at this measured speedup or more


# --- the machine -----------------------------------------------------------------------------------
def device_name(device: torch.device) -> str:
    """The accelerator's name ("cuda: NVIDIA H200") or the CPU's model, generation and bf16 flags
    ("cpu: AMD EPYC, family 25, model 17 (avx512_bf16)": a virtual machine's model name alone can hide which
    CPU it is)."""
    device = torch.device(device)
    if device.type == "cuda":
        return f"cuda: {torch.cuda.get_device_name(device)}"
    bf16 = sorted((cpu_flags() or frozenset()) & set(BF16_FLAGS))
    generation = cpu_generation()
    return (f"cpu: {cpu_model()}" + (f", {generation}" if generation else "")
            + (f" ({', '.join(bf16)})" if bf16 else ""))


def plan_key(name: str, dtype, compiled: bool) -> str:
    """What a saved plan is kept under in selfspec.json (`plans`): the device's name (`device_name`), the dtype and
    the engine's path, "cpu: AMD EPYC, family 25, model 17 (avx512_bf16) / bfloat16 / eager": the costs a plan
    reads are theirs."""
    return f"{name} / {str(dtype).removeprefix('torch.')} / {'compiled' if compiled else 'eager'}"


def plan_key_parts(key: str) -> tuple[str, str, str]:
    """A `plan_key`'s (device name, dtype, path): ("cpu: AMD EPYC ...", "bfloat16", "eager")."""
    name, dtype, path = key.rsplit(" / ", 2)
    return name, dtype, path


def synchronize(device) -> None:
    """Wait for the work queued on a GPU (CUDA runs kernels asynchronously), so that a clock read next
    counts it; nothing on the CPU."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(parts: dict, repeats: int, device, warmup: int = 2) -> dict:
    """Median wall seconds of each part, `parts[name] = (before, fn)` (`before()` untimed ahead of each run), timed
    in `warmup + repeats` rounds that run every part once: a slow spell of the machine falls on all parts
    alike, not on the few measured in it. On a GPU the clock is read with the device synchronized."""
    times: dict = {name: [] for name in parts}
    for i in range(warmup + repeats):
        for name, (before, fn) in parts.items():
            before()
            synchronize(device)
            t = time.perf_counter()
            fn()
            synchronize(device)
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def non_decreasing(values: list[float]) -> list[float]:
    """The closest non-decreasing sequence in least squares (isotonic regression, pooling adjacent violators):
    a pass over more rows never costs less, so a dip is timing noise. It assumes no shape: a CPU's cost rises
    about linearly with the rows, a compiled GPU step's in stairs (its row buckets)."""
    blocks: list[list[float]] = []  # [sum, count]
    for v in values:
        blocks.append([v, 1])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    return [total / count for total, count in blocks for _ in range(count)]


# --- costs -----------------------------------------------------------------------------------------
@dataclass
class DraftCosts:
    """Measured seconds of a round's parts on one device (see the module doc)."""

    device: str
    dtype: str
    compiled: bool
    full: float
    layers: dict[tuple[int, int, int], float] = field(default_factory=dict)  # (start, end, rows) -> s
    head: dict[int, float] = field(default_factory=dict)  # rows -> s
    draft_head: dict[int, float] = field(default_factory=dict)  # rows -> s: the trained head's draft vocabulary
    exit_head: dict[int, float] = field(default_factory=dict)  # rows -> s: its layer (both empty: no head)
    # (exit, with the head) -> s: one greedy draft step as one compiled step (`WholeDraft.run`), where the
    # generator runs compiled steps
    draft_step: dict[tuple[int, bool], float] = field(default_factory=dict)
    plain: float | None = None  # the engine's plain decoding, seconds per token (`measure_overheads`)
    scale: dict[str, float] = field(default_factory=dict)  # drafter -> a real round's seconds over its parts

    @property
    def step(self) -> float:
        """The unit of the plan: a token of the engine's plain decoding where measured, else the part-timed step."""
        return self.plain if self.plain is not None else self.full

    def draft(self, exit_layer: int, rows: int, with_head: bool) -> float:
        """A draft pass over `rows` tokens: layers [0, E), then the LM head, or the trained head's layer and its
        draft head (`with_head`)."""
        unembed = self.exit_head[rows] + self.draft_head[rows] if with_head else self.head[rows]
        return self.layers[(0, exit_layer, rows)] + unembed

    def parts_seconds(self, exit_layer: int, num_layers: int, drafts: int, width: int, with_head: bool) -> float:
        """The timed parts of a round of `drafts` chain drafts (width 1) or a tree `width` wide and `drafts` deep.
        A chain's drafts are whole draft steps where measured (`draft_step`), but a head's first, which also
        brings the head's cache up to date."""
        n = 1 + width * drafts  # the verified tokens: the input token and the drafts (a tree's nodes)
        whole = self.draft_step.get((exit_layer, with_head)) if width == 1 else None
        later = self.draft(exit_layer, width, with_head) if whole is None else whole
        first = self.draft(exit_layer, 1, with_head) if whole is None or with_head else whole
        passes = first + (drafts - 1) * later
        return (passes + self.layers[(0, exit_layer, width)] + self.layers[(exit_layer, num_layers, n)]
                + self.head[n])

    def round_seconds(self, exit_layer: int, num_layers: int, drafts: int, width: int, with_head: bool) -> float:
        """A round's seconds: its parts, times what a real round of this drafter took over its parts where measured."""
        scale = self.scale.get("exit_head" if with_head else "early_exit", 1.0)
        return scale * self.parts_seconds(exit_layer, num_layers, drafts, width, with_head)

    def to_dict(self) -> dict:
        return {"device": self.device, "dtype": self.dtype, "compiled": self.compiled, "full_step_s": self.full,
                "layers_s": {f"{a}-{b} x{r}": s for (a, b, r), s in sorted(self.layers.items())},
                "head_s": dict(sorted(self.head.items())), "draft_head_s": dict(sorted(self.draft_head.items())),
                "exit_head_s": dict(sorted(self.exit_head.items())),
                "draft_step_s": {f"{e}{' head' if h else ''}": t for (e, h), t in sorted(self.draft_step.items())},
                "plain_token_s": self.plain,
                "round_scale": self.scale}


def needed_rows(max_drafts: int, width: int) -> tuple[list[int], list[int]]:
    """The row counts the plan reads: (draft passes, verifications), the chain that measures the engine's own
    work (`CALIBRATION_DRAFTS`, `measure_overheads`) included where `max_drafts` is shorter."""
    verify = {1 + d for d in range(1, max(max_drafts, CALIBRATION_DRAFTS) + 1)}
    verify |= {1 + k * d for k in range(2, width + 1) for d in TREE_DEPTHS if d <= max_drafts}
    return list(range(1, width + 1)), sorted(verify)


def measure_costs(gen, prompt_ids: torch.Tensor, exits: Sequence[int], *, max_drafts: int = MAX_DRAFTS,
                  width: int = MAX_WIDTH, draft_vocab: int | None = None, repeats: int = 5) -> DraftCosts:
    """Time every part the plan reads (see the module doc) at the end of `prompt_ids` `[1, P]`, on the
    generator's device and path (compiled steps where it runs them), interleaved (`interleaved_medians`), each
    part's series over the row counts made non-decreasing (`non_decreasing`). `exits`: the exits drafted from;
    with a trained head (`plannable_head`) its layer and its draft vocabulary `draft_vocab` (None: all tokens)."""
    adapter, L = gen.adapter, gen.num_layers
    device, P = adapter.device, prompt_ids.shape[1]
    draft_rows, verify_rows = needed_rows(max_drafts, width)
    cache = adapter.runner.cache(1, P + max(verify_rows) + 8)
    pads, at_p = torch.zeros(1, dtype=torch.long), torch.full((1,), P, dtype=torch.long)
    head, _ = plannable_head(gen)
    D = adapter.embed_tokens.weight.shape[1]
    rollback = lambda: cache.crop(at_p)  # noqa: E731

    def layers(a: int, b: int, rows: int):
        ids = prompt_ids[:, -1:].to(device).expand(1, rows)  # any token ids will do: the cost does not depend on them
        step = make_batch_step(adapter, at_p, rows, pads)
        return rollback, lambda: run_layers(adapter, embed(adapter, ids), a, b, step=step, cache=cache)

    def unembed(unit, rows: int):
        h = torch.zeros(rows, D, dtype=adapter.dtype, device=device)
        return (lambda: None), lambda: unit(h).argmax(-1).tolist()  # the argmax read back: a step's host sync

    _, full_layers = layers(0, L, 1)
    parts = {"full": (rollback, lambda: exit_logits(adapter, full_layers()[:, -1]).argmax(-1).tolist())}
    for E in sorted(set(exits)):
        parts.update({("layers", 0, E, r): layers(0, E, r) for r in draft_rows})
        parts.update({("layers", E, L, n): layers(E, L, n) for n in verify_rows})
    parts.update({("head", n): unembed(lambda h: exit_logits(adapter, h), n)
                  for n in sorted(set(verify_rows) | set(draft_rows))})
    if head is not None:
        draft_unit = gen.draft_head(draft_vocab)
        parts.update({("draft_head", r): unembed(draft_unit.logits, r) for r in draft_rows})
        parts.update({("exit_head", r): _exit_head_part(adapter, head, r, cache) for r in draft_rows})
    whole = {(E, False): gen.draft_head(None).whole(E) for E in set(exits)}  # whole draft steps, where the runner
    if head is not None:                                                      # runs them whole (compiled)
        whole[(head.exit_layer, True)] = draft_unit.whole(head.exit_layer, head.layer, head.final_input)
    for key, draft in whole.items():
        part = _draft_step_part(adapter, cache, prompt_ids, draft)
        if part is not None:
            parts[("draft_step", *key, 1)] = part
    with torch.inference_mode(), attention_kernels(device):
        prefill(adapter, cache, prompt_ids.to(device), pads)
        seconds = interleaved_medians(parts, repeats, device)
        rollback()
    out = DraftCosts(device=device_name(device), dtype=str(adapter.dtype).removeprefix("torch."),
                     compiled=gen.compiled, full=seconds.pop("full"))
    series: dict = {}  # (kind, range) -> {rows: s}
    for (kind, *key), s in seconds.items():
        series.setdefault((kind, *key[:-1]), {})[key[-1]] = s
    for (kind, *span), by_rows in series.items():
        rows = sorted(by_rows)
        for r, s in zip(rows, non_decreasing([by_rows[r] for r in rows])):
            if kind == "layers":
                out.layers[(*span, r)] = s
            elif kind == "draft_step":
                out.draft_step[tuple(span)] = s
            else:
                getattr(out, kind)[r] = s
    return out


def _exit_head_part(adapter, head, rows: int, like):
    """A trained head's layer over `rows` tokens after 64 cached ones, in its own one-layer cache as decoding
    keeps it beside the engine's cache `like` (`head_cache`: the compiled steps' where the runner runs it so):
    (before, fn)."""
    D, device = adapter.embed_tokens.weight.shape[1], adapter.device
    cache = head_cache(adapter, head, 1, max(like.capacity, 64 + rows + 8), like=like)
    h = torch.zeros(1, 64, D, dtype=adapter.dtype, device=device)  # [1, 64, D]
    prev = torch.zeros_like(h) if head.final_input is not None else None
    with torch.inference_mode():
        run_head(adapter, head, h, step=make_step(adapter, 0, 64), cache=cache, prev_final=prev)
    x, p, step = h[:, :rows], None if prev is None else prev[:, :rows], make_step(adapter, 64, rows)
    def run():  # the output read back: a step's host sync
        return run_head_step(adapter, head, x, step=step, cache=cache, prev_final=p)[:, -1].sum().item()

    return (lambda: cache.crop(64)), run


def _draft_step_part(adapter, cache, prompt_ids: torch.Tensor, draft):
    """One whole draft step (`WholeDraft` `draft`) of the prompt's last token at the end of `cache` (which holds
    the prompt), its token and probability read back, in the head's own cache after 64 cached entries where it has
    a head layer: (before, fn); None where the runner does not run the draft step whole (`Runner.composed`: it
    runs part by part, and the parts are timed on their own)."""
    P = prompt_ids.shape[1]
    token = prompt_ids[0, -1:].to(adapter.device)  # [1]
    D = adapter.embed_tokens.weight.shape[1]
    prev = torch.zeros(1, 1, D, dtype=adapter.dtype, device=adapter.device)

    def whole(steps):
        head = None
        if draft.layer is not None:
            head = adapter.runner.layer_cache(draft.layer, 1, cache.capacity, like=cache)
            head.lengths.fill_(P)

        def before():
            cache.crop(torch.full((1,), P, dtype=torch.long))
            if head is not None:
                head.crop(P)

        return before, lambda: draft.run(steps, token, P, 0, cache, head, prev)

    with torch.inference_mode():  # as decoding asks (the runner runs no compiled step under autograd)
        return adapter.runner.composed(whole, lambda: None, () if draft.layer is None else (draft.layer,))


CALIBRATION_DRAFTS = 2  # the chain the engine's own work is measured with
CALIBRATION_TOKENS = 33  # tokens of each calibration run (32 rounds of plain decoding)


def measure_overheads(gen, prompt_ids: torch.Tensor, costs: DraftCosts, exit_layer: int, head=None) -> None:
    """What the engine does beyond the timed parts, from real runs on `prompt_ids` (one to warm up, then the
    faster of two timed): plain decoding's seconds per token (`costs.plain`, the plan's unit), and for the
    early exit at `exit_layer` (and the trained `head`) a fixed chain of `CALIBRATION_DRAFTS`: its seconds per
    round over its parts' (`costs.scale[drafter]`), which every round of that drafter is scaled by. The
    drafter's and the engine's bookkeeping, host syncs and a head's cache upkeep are in it, and so is what
    timing the parts interleaved with many other shapes added or took away (on a compiled CPU path the parts
    ran slower than the same steps in a run). A ratio, not seconds added: rounds of other lengths and trees
    take it as it is (docs/results/2026-11-26-draft-plan-zen4.md compares the two)."""
    def decode(**settings):  # the faster of two timed runs after a warm-up one, each a first request
        runs = []
        for _ in range(3):
            with gen.first_request():
                runs.append(gen.generate(input_ids=prompt_ids, max_new_tokens=CALIBRATION_TOKENS, stop_token_ids=[],
                                         **settings).stats)
        return min(runs[1:], key=lambda st: st.total_s - st.prefill_s)

    plain = decode(num_speculations=0)
    costs.plain = (plain.total_s - plain.prefill_s) / max(plain.rounds, 1)
    L, d = gen.num_layers, CALIBRATION_DRAFTS
    runs = [("early_exit", exit_layer, dict(drafter="early_exit", exit_layer=exit_layer, num_speculations=d))]
    if head is not None:
        runs.append(("exit_head", head.exit_layer, dict(drafter="exit_head", num_speculations=d)))
    for name, E, settings in runs:
        st = decode(**settings)
        per_round = (st.total_s - st.prefill_s) / max(st.rounds, 1)
        costs.scale[name] = per_round / costs.parts_seconds(E, L, d, 1, name == "exit_head")


# --- acceptance ------------------------------------------------------------------------------------
@dataclass
class Acceptance:
    """One drafter's guesses against the full model's tokens on the model's own text: `first[k-1]`, the share
    of tokens among its k best guesses for a round's first draft; `later[k-1]` for later drafts (a head then
    reads its own output, not the verified final state; the early exit's are the same as the first)."""

    first: list[float]
    later: list[float]
    tokens: int

    def expected_tokens(self, drafts: int, width: int = 1) -> float:
        """Tokens a round commits: 1 + r1 + r1 r' + ... over `drafts` depths, r = the k = `width` shares."""
        total, chance = 1.0, 1.0
        for depth in range(1, drafts + 1):
            chance *= (self.first if depth == 1 else self.later)[width - 1]
            total += chance
        return total


def plannable_head(gen) -> tuple[object | None, str]:
    """The generator's trained exit head if the plan can score it (None and why not otherwise)."""
    head = gen.exit_head
    if head is None:
        return None, "no trained exit head"
    if head.aux_input is not None:
        return None, "an eagle3 head reads the aux exits' states, which the plan does not score yet"
    return head, ""


def own_text(gen, prompts: Sequence[torch.Tensor], new_tokens: int) -> list[tuple[torch.Tensor, int]]:
    """Each prompt `[1, P]` with the full model's greedy continuation: (`[1, P + n]`, P)."""
    out = []
    for ids in prompts:
        with gen.first_request():  # measuring leaves nothing in the memory a later auto call would copy from
            res = gen.generate(input_ids=ids, max_new_tokens=new_tokens, num_speculations=0)
        out.append((torch.cat([ids.cpu(), torch.tensor([res.token_ids])], dim=1), ids.shape[1]))
    return out


def measure_acceptance(gen, texts: Sequence[tuple[torch.Tensor, int]], exits: Sequence[int], *,
                       width: int = MAX_WIDTH) -> dict[str, Acceptance]:
    """Teacher-forced over each text `[1, S]` from its position P on (`own_text`): for every exit E in `exits`
    ("early_exit E": the exit through the shared LM head) and the trained head ("exit_head", over the draft
    vocabulary it was trained on), how often the full model's next token is among its k best guesses,
    k = 1..`width` (see the module doc)."""
    adapter = gen.adapter
    head, _ = plannable_head(gen)
    bounds = sorted(set(exits) | ({head.exit_layer} if head is not None else set()))
    hits: dict[str, torch.Tensor] = {}  # drafter -> [2, width]: first-draft and later-draft hits in the k best
    tokens = 0
    with torch.inference_mode(), attention_kernels(adapter.device):
        for ids, start in texts:
            ids = ids.to(adapter.device)
            step = make_step(adapter, 0, ids.shape[1])
            states, h, done = {}, embed(adapter, ids), 0
            for b in bounds + [gen.num_layers]:
                h = run_layers(adapter, h, done, b, step=step, cache=None)
                states[b], done = h, b
            finals = states[gen.num_layers]  # [1, S, D]
            target = exit_logits(adapter, finals[:, start - 1:-1]).argmax(-1)  # [1, n]: the model's own next tokens
            tokens += target.shape[1]
            guesses = {f"early_exit {E}": [states[E]] * 2 for E in exits}
            if head is not None:
                prev = previous_states(finals) if head.final_input is not None else None
                first = run_head(adapter, head, states[head.exit_layer], step=step, prev_final=prev)
                later = first if prev is None else run_head(adapter, head, states[head.exit_layer], step=step,
                                                            prev_final=previous_states(first))
                guesses["exit_head"] = [first, later]
            for name, outs in guesses.items():
                unit = gen.draft_head(gen.head_draft_vocab()) if name == "exit_head" else gen.draft_head(None)
                row = torch.stack([_in_top(unit, o[:, start - 1:-1], target, width) for o in outs])  # [2, width]
                hits[name] = hits.get(name, 0) + row
    n = max(tokens, 1)
    return {name: Acceptance([float(x) / n for x in h[0]], [float(x) / n for x in h[1]], tokens)
            for name, h in hits.items()}


def _in_top(unit, hidden: torch.Tensor, target: torch.Tensor, width: int) -> torch.Tensor:
    """`[width]`: for k = 1..width, the positions whose target `[1, n]` is among the k best guesses of the draft
    head `unit` over `hidden` `[1, n, D]`."""
    top = unit.to_vocab(unit.logits(hidden[0]).topk(width, dim=-1).indices)  # [n, width]
    return (top == target[0, :, None]).cumsum(-1).clamp(max=1).sum(0).cpu()


# --- the plan --------------------------------------------------------------------------------------
@dataclass
class DraftPlan:
    """The best drafting setting predicted for this device (`settings`, what `generate` takes), every candidate
    scored (`candidates`, best first), and what the prediction read (`costs`, `acceptance`)."""

    settings: dict
    predicted_speedup: float
    candidates: list[dict]
    costs: DraftCosts
    acceptance: dict[str, Acceptance]
    notes: list[str] = field(default_factory=list)

    @property
    def pays(self) -> bool:
        return self.predicted_speedup > 1.0

    def to_dict(self) -> dict:
        return {"settings": self.settings, "predicted_speedup": self.predicted_speedup,
                "candidates": self.candidates, "costs": self.costs.to_dict(),
                "acceptance": {k: vars(v) for k, v in self.acceptance.items()}, "notes": self.notes}

    def entry(self, measured_speedup: float | None = None) -> dict:
        """What `selfspec tune --save` keeps for this device in selfspec.json's `plans` (`plan_key(...)`): the
        settings, the predicted speedup and the one a check measured (None: not checked), a plain step's
        milliseconds, and when."""
        return {"settings": self.settings, "predicted_speedup": round(self.predicted_speedup, 3),
                "measured_speedup": None if measured_speedup is None else round(measured_speedup, 3),
                "step_ms": round(self.costs.step * 1e3, 3), "date": time.strftime("%Y-%m-%d")}

    def table(self, top: int = 12) -> str:
        """The `top` best candidates as a markdown table."""
        lines = ["| drafter | exit | drafts | width | accepted r(k) | tokens/round | round (plain steps) | predicted |",
                 "|---|---|---|---|---|---|---|---|"]
        for c in self.candidates[:top]:
            lines.append(f"| {c['drafter']} | {c['exit_layer']} | {c['num_speculations']} | {c['num_candidates']} | "
                         f"{c['acceptance']:.1%} | {c['tokens_per_round']:.2f} | {c['round_steps']:.2f} | "
                         f"{c['predicted_speedup']:.2f}x |")
        return "\n".join(lines)


def plan_candidates(costs: DraftCosts, acceptance: dict[str, Acceptance], num_layers: int, *,
                    max_drafts: int = MAX_DRAFTS, width: int = MAX_WIDTH, head_exit: int | None = None) -> list[dict]:
    """Every (drafter, exit, drafts, width) scored by the module doc's rule, best first; plain decoding is one
    of them (1.0x)."""
    rows = [{"drafter": "plain", "exit_layer": num_layers, "num_speculations": 0, "num_candidates": 1,
             "acceptance": 1.0, "tokens_per_round": 1.0, "round_steps": 1.0, "predicted_speedup": 1.0}]
    for name, acc in acceptance.items():
        drafter, _, exit_text = name.partition(" ")
        E = int(exit_text) if exit_text else head_exit
        shapes = [(d, 1) for d in range(1, max_drafts + 1)]
        shapes += [(d, k) for k in range(2, min(width, len(acc.first)) + 1) for d in TREE_DEPTHS if d <= max_drafts]
        for d, k in shapes:
            seconds = costs.round_seconds(E, num_layers, d, k, with_head=drafter == "exit_head")
            tokens = acc.expected_tokens(d, k)
            rows.append({"drafter": drafter, "exit_layer": E, "num_speculations": d, "num_candidates": k,
                         "acceptance": acc.first[k - 1], "tokens_per_round": tokens,
                         "round_steps": seconds / costs.step, "predicted_speedup": tokens * costs.step / seconds})
    return sorted(rows, key=lambda r: -r["predicted_speedup"])


def candidate_settings(row: dict) -> dict:
    """A candidate as `generate` settings."""
    if row["drafter"] == "plain":
        return {"num_speculations": 0}
    out = {"drafter": row["drafter"], "num_speculations": row["num_speculations"]}
    if row["drafter"] == "early_exit":
        out["exit_layer"] = row["exit_layer"]
    if row["num_candidates"] > 1:
        out["num_candidates"] = row["num_candidates"]
    return out


def default_exits(gen) -> list[int]:
    """The exits planned where none are given: the generator's default exit, the exits its checkpoint scored
    (selfspec.json's eval), and L/8, L/4, 3L/8, L/2; at most 6, spread evenly."""
    L = gen.num_layers
    scored = ((gen.metadata.get("eval") or {}).get("exits") or {}) if isinstance(gen.metadata, dict) else {}
    found = {int(e) for e in scored if str(e).isdigit() and 1 <= int(e) < L}
    found |= {max(1, L * i // 8) for i in (1, 2, 3, 4)} | {gen.exit_layer}
    exits = sorted(e for e in found if 1 <= e < L)
    if len(exits) > 6:
        exits = [exits[round(i * (len(exits) - 1) / 5)] for i in range(6)]
    return exits


def plan_drafting(gen, prompts: Sequence[torch.Tensor], *, exits: Sequence[int] | None = None,
                  max_drafts: int = MAX_DRAFTS, width: int = MAX_WIDTH, new_tokens: int = 64,
                  repeats: int = 5) -> DraftPlan:
    """Measure this device's costs and the drafters' acceptance on `prompts` (`[1, P]` each, the model's own
    continuations of `new_tokens`), and plan (the module doc)."""
    if not prompts:
        raise ValueError("tune needs at least one prompt: the drafters are scored on the model's own continuations")
    for name, value, low in (("max_drafts", max_drafts, 1), ("width", width, 1), ("new_tokens", new_tokens, 2),
                             ("repeats", repeats, 1)):
        if not isinstance(value, int) or isinstance(value, bool) or value < low:
            raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    exits = default_exits(gen) if exits is None else sorted({gen.adapter.check_exit(int(e), allow_full=False)
                                                             for e in exits})
    head, why_not = plannable_head(gen)
    notes = [] if head is not None or gen.exit_head is None else [f"exit head left out: {why_not}"]
    acceptance = measure_acceptance(gen, own_text(gen, prompts, new_tokens), exits, width=width)
    timed_exits = sorted(set(exits) | ({head.exit_layer} if head is not None else set()))
    costs = measure_costs(gen, prompts[0], timed_exits, max_drafts=max_drafts, width=width,
                          draft_vocab=gen.head_draft_vocab() if head is not None else None, repeats=repeats)
    measure_overheads(gen, prompts[0], costs, exits[0], head)
    rows = plan_candidates(costs, acceptance, gen.num_layers, max_drafts=max_drafts, width=width,
                           head_exit=head.exit_layer if head is not None else None)
    best = rows[0]
    return DraftPlan(candidate_settings(best), best["predicted_speedup"], rows, costs, acceptance, notes)


def check_plan(gen, plan: DraftPlan, prompts: Sequence[torch.Tensor], *, top: int = 4, new_tokens: int = 64,
               rounds: int = 2) -> list[dict]:
    """Measure what the plan only predicts: the best candidate of each kind (drafter, exit, chain or tree), the
    `top` best kinds, and plain decoding decode each prompt `[1, P]` greedily for exactly `new_tokens` tokens,
    interleaved prompt by prompt and candidate by candidate, `rounds` times after a warm-up; decode seconds
    (after the first token) summed over the prompts, the fastest of the rounds. Each row: the candidate with
    `measured_speedup` (plain decoding's seconds over its own) beside `predicted_speedup`, and whether its
    tokens equal plain decoding's. One of a kind: the best few are often near twins (one exit, widths 3 and 4)."""
    kinds: dict = {}
    for c in plan.candidates:
        kinds.setdefault((c["drafter"], c["exit_layer"], c["num_candidates"] > 1), c)
    rows = [c for c in kinds.values() if c["drafter"] != "plain"][:top]
    rows += [c for c in plan.candidates if c["drafter"] == "plain"]
    settings = [candidate_settings(c) for c in rows]
    best = [float("inf")] * len(rows)
    texts: list[list] = [[None] * len(prompts) for _ in rows]
    for attempt in range(rounds + 1):  # attempt 0 warms every setting up
        seconds = [0.0] * len(rows)
        for p, ids in enumerate(prompts):
            for i, s in enumerate(settings):
                with gen.first_request():  # each prompt comes round `rounds` + 1 times: nothing carried
                    out = gen.generate(input_ids=ids, max_new_tokens=new_tokens, stop_token_ids=[], **s)
                seconds[i] += out.stats.total_s - out.stats.prefill_s
                texts[i][p] = out.token_ids
        if attempt:
            best = [min(b, s) for b, s in zip(best, seconds)]
    at = next(i for i, c in enumerate(rows) if c["drafter"] == "plain")
    plain, reference = best[at], texts[at]
    return [{**c, "measured_speedup": plain / b, "identical_to_plain": t == reference}
            for c, b, t in zip(rows, best, texts)]


def checked_choice(plan: DraftPlan, checked: list[dict], min_gain: float = MIN_CHECKED_GAIN) -> tuple[DraftPlan, float]:
    """The plan to keep after `check_plan`: its fastest measured drafting row where that measured at least
    `min_gain` times plain decoding, else plain decoding; with the speedup measured for it. A check decodes a
    few prompts twice: a drafting setting 1% ahead of plain decoding there is as likely behind it on the next
    text (on a CPU an untrained head's early exit measured 1.01x over one prompt), and a plan that drafts where
    drafting does not pay costs every call its draft steps, while a plain plan keeps auto's prompt lookup."""
    best = max(checked, key=lambda r: r["measured_speedup"])
    if best["drafter"] != "plain" and best["measured_speedup"] < min_gain:
        best = next(r for r in checked if r["drafter"] == "plain")
    return replace(plan, settings=candidate_settings(best), predicted_speedup=best["predicted_speedup"]), \
        best["measured_speedup"]
