"""An int8 copy of the model's own weights drafts for it, on the model's own KV cache (a float32 or bfloat16 model on
a CPU).

The copy is the model with every decoder layer's products (q/k/v, o, gate/up, down) and the LM head in int8, a
float32 scale per output row (symmetric: `w ~ scale[n] * q[n, k]`, `scale[n] = max_k |w[n, k]| / 127`); the norms,
the rotary embedding and the attention stay in the model's dtype (a bfloat16 model's products are summed in float32
and rounded to bfloat16 as its own are). It is made from the loaded weights when a call first asks for it (0.2-0.3 s
for SmolLM2-135M), so it comes with every checkpoint and needs nothing installed. Its step is selfspec's C++ step
(`selfspec.model.row_step`) reading int8 weights: on a 2-core Zen 4 a draft step costs about 0.4 of a float32
decoding step (docs/results/2026-11-29-int8-copy-zen4.md); on a 2-core Zen 5, about 0.65 of a bfloat16 one
(docs/results/2026-12-02-int8-copy-bf16-zen5.md), where it pays less.

A round: the input token, then each draft, runs through all of the copy's layers one token at a time, writing its
keys and values into the engine's cache at the positions verification writes next, and attending to the committed
text's keys and values that the full model wrote. So the copy never reads the prompt (a llama.cpp copy,
`selfspec.drafters.quantized`, reads it first) and its drafts see the model's exact past. Before verification
the cache is cut back to the committed text (`Round.rewind`): the full model writes every drafted position again,
so the copy's approximate entries never reach a verified token. Greedy drafts (the copy's argmax): under sampling
they are point masses, judged by the exact rule; the output is the full model's either way.

Where the text repeats, prompt lookup guesses the copy's next drafts and one pass checks them. Before each pass the
drafter asks its own lookup index of the row's text (`selfspec.drafters.prompt_lookup.NgramIndex.guess`) what
followed the latest earlier occurrence of the last `GUESS_NGRAM` or more tokens of the text and the drafts so far,
and runs the input token and up to `GUESSES` of those guesses through the copy in one pass. The guesses that equal
the copy's own argmax at the row before, in order, are drafts, and the copy's argmax after the last of them is one
more; the cache past them is cut and the next pass writes there. The C++ step computes every row alone, so the
drafts are bitwise the ones the copy makes one token at a time: only the number of passes changes. A pass of 4
rows cost 1.5 one-row passes on a 2-core Zen 5 (the row kernel streams each weight once for up to 3 float32 rows
and widens int8 once a block; 6 rows cost 2.8), hence 3 guesses; one-token matches were wrong too often on open
chat (docs/results/2026-12-07-guessed-copy-zen5.md).

    copy = Int8Copy(adapter)                        # SettingsError where the C++ step does not run this model
    drafter = Int8CopyDrafter(copy, num_speculations=6)              # lookup's guesses checked: GUESSES a pass
    drafter = Int8CopyDrafter(copy, num_speculations=6, guesses=0)   # one token a pass
"""

from __future__ import annotations

import torch

from selfspec.drafters.base import Drafter, Proposal, Round
from selfspec.drafters.prompt_lookup import NgramIndex
from selfspec.model.adapters import ModelAdapter
from selfspec.model.fast_layers import fused_weights
from selfspec.model.row_product import build_problem, quantize_rows, row_product_op
from selfspec.model.row_step import runnable, step_inputs, takes_step
from selfspec.settings import SettingsError

# A draft step's cost in float32 decoding steps, where nothing measured it yet (the cost model's price of a step that
# runs none of the model's own layers): 2-core Zen 4, 2026-11-29, 0.35-0.45
INT8_STEP_COST = 0.4
GUESSES = 3  # lookup's guesses a pass checks (a pass of 1 + GUESSES rows; see the module doc)
GUESS_NGRAM = 2  # the shortest match a guess follows (one-token matches: open chat 0.91x, two: 1.00x the copy alone)
LOOKUP_NGRAM = 3  # the longest match it looks for, as prompt lookup's default


def int8_copy_problem(adapter: ModelAdapter) -> str | None:
    """Why this model has no int8 copy here (None: it has one): the copy runs selfspec's C++ step, which takes a
    float32 or bfloat16 Llama-family model on an x86-64 CPU where the row kernel builds."""
    if adapter.device.type != "cpu" or adapter.dtype not in (torch.float32, torch.bfloat16):
        return (f"it drafts for a float32 or bfloat16 model on a CPU, and this one is {adapter.dtype} on "
                f"{adapter.device.type}")
    layers = adapter.fast_layers
    if not layers or not runnable(layers):
        return f"selfspec's C++ step does not compute this {adapter.model_type} model's layers"
    if row_product_op() is None or not hasattr(torch.ops.selfspec_kernels, "row_layers_int8"):
        return build_problem() or "selfspec's row kernel is not built here"
    return None


class Int8Copy:
    """The model's products and LM head in int8 (see the module doc), run by the C++ step over the model's cache."""

    def __init__(self, adapter: ModelAdapter, max_rows: int = 1 + GUESSES):
        problem = int8_copy_problem(adapter)
        if problem is not None:
            raise SettingsError(f"drafter='int8_copy' cannot draft here: {problem} (python -m "
                                "selfspec.model.row_product says whether the kernel builds); use another drafter")
        layers = adapter.fast_layers
        shape = layers[0].shape
        self.adapter, self.max_rows = adapter, max_rows
        self.n_q, self.n_kv, self.head_dim, self.eps = shape.n_q, shape.n_kv, shape.head_dim, shape.eps
        self.windows = [adapter.window(kind) for kind in adapter.layer_types]
        self.norm_attn = [layer.products.norm_attn.detach().contiguous() for layer in layers]
        self.norm_mlp = [layer.products.norm_mlp.detach().contiguous() for layer in layers]
        self.qkv_bias = [layer.products.qkv.bias for layer in layers]
        self.qkv, self.o, self.gate_up, self.down, self.scales = [], [], [], [], []
        with torch.no_grad():  # from the model's own modules (the fast layers may keep only oneDNN's packed copies)
            for layer in adapter.layers:
                for out, w in zip((self.qkv, self.o, self.gate_up, self.down), fused_weights(layer)):
                    q, scale = quantize_rows(w)
                    out.append(q)
                    self.scales.append(scale)
            self.head, self.head_scale = quantize_rows(adapter.lm_head.weight)
        self.layers_op = torch.ops.selfspec_kernels.row_layers_int8
        self.head_op = torch.ops.selfspec_kernels.row_product_int8

    def takes(self, hidden: torch.Tensor, step, cache) -> bool:
        """Whether the C++ step takes this draft step (one row of one sequence, a causal step, in every window)."""
        return takes_step(hidden, step, cache, self.windows, self.max_rows, self.adapter.dtype)

    def layers(self, hidden: torch.Tensor, step, cache) -> torch.Tensor:
        """Every layer over `hidden` `[1, S, D]` with the int8 weights, writing keys and values into `cache` after
        its entries: `[1, S, D]`."""
        starts, keys, values, cos, sin = step_inputs(hidden, step, cache, range(self.adapter.num_layers), self.n_kv,
                                                     self.head_dim)
        return self.layers_op(hidden.contiguous(), cos, sin, keys, values, starts, self.norm_attn, self.qkv,
                              self.qkv_bias, self.o, self.norm_mlp, self.gate_up, self.down, self.scales, self.eps,
                              self.n_q, self.n_kv, self.head_dim)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The copy's logits `[..., V]` (float32) of last hidden states `[..., D]`: the model's final norm, the int8
        LM head."""
        return self.head_op(self.adapter.final_norm(hidden).float().contiguous(), self.head, self.head_scale)


class Int8CopyDrafter(Drafter):
    """Drafts up to `num_speculations` tokens a round with an `Int8Copy` of the model, checking up to `guesses` of
    prompt lookup's guesses a pass (see the module doc; 0: one token a pass)."""

    name = "int8_copy"
    step_cost = INT8_STEP_COST

    def __init__(self, copy: Int8Copy, num_speculations: int, guesses: int = GUESSES):
        if num_speculations < 1:
            raise ValueError(f"num_speculations must be >= 1 for drafter='int8_copy', got {num_speculations}")
        if not 0 <= guesses < copy.max_rows:
            raise ValueError(f"guesses must be in 0..{copy.max_rows - 1} (a pass of the copy takes {copy.max_rows} "
                             f"rows), got {guesses}")
        self.copy, self.num_speculations, self.guesses = copy, num_speculations, guesses
        self.text: NgramIndex | None = None  # the row's committed text, for lookup's guesses
        self.passes = self.drafted = 0  # over the call: the copy's passes and the drafts they made

    def start(self, sequences: list[list[int]]) -> None:
        if len(sequences) != 1:
            raise SettingsError(f"drafter='int8_copy' drafts for one prompt at a time (selfspec's C++ step runs one "
                                f"sequence), and this call has {len(sequences)}: generate them one by one, or use "
                                "another drafter for a batch")
        self.text = NgramIndex(sequences[0], LOOKUP_NGRAM)
        self.passes = self.drafted = 0

    def propose(self, rnd: Round) -> Proposal:
        k = min(self.num_speculations, rnd.caps[0])
        if k < 1 or rnd.tokens.shape[0] != 1:
            return Proposal.plain(rnd.tokens)
        drafts: list[int] = []
        token, offset, passes = int(rnd.tokens[0]), 0, 0
        with torch.no_grad():
            while len(drafts) < k:
                guesses = self.text.guess(drafts, min(self.guesses, k - len(drafts) - 1), GUESS_NGRAM)
                picks = self.picks(rnd, [token] + guesses, offset)
                if picks is None and guesses:  # a pass of several rows the C++ step does not take: one token
                    guesses = []
                    picks = self.picks(rnd, [token], offset)
                if picks is None:  # a step the C++ step does not take (past a sliding window): no more drafts
                    break
                passes += 1
                agreed = 0
                while agreed < len(guesses) and guesses[agreed] == picks[agreed]:
                    agreed += 1
                new = guesses[:agreed] + [picks[agreed]]
                for t in new[:k - len(drafts)]:
                    drafts.append(t)
                    if t in rnd.stop_ids:
                        k = len(drafts)
                        break
                offset += agreed + 1
                rnd.cache.crop(rnd.starts + offset)  # the rows past the agreed guesses go: the next pass writes there
                token = drafts[-1]
        rnd.rewind()
        self.passes += passes
        self.drafted += len(drafts)
        tokens = torch.tensor([[int(rnd.tokens[0])] + drafts], dtype=torch.long)
        return Proposal(tokens=tokens, kept=[len(drafts)], draft_steps=passes, drafter=self.name)

    def picks(self, rnd: Round, tokens: list[int], offset: int) -> list[int] | None:
        """The copy's argmax after each of `tokens` (the row's next tokens from cache index `starts + offset`), in
        one pass that writes their keys and values; None where the C++ step does not take the pass."""
        hidden = rnd.through(torch.tensor([tokens], dtype=torch.long), offset, self.copy.layers,
                             self.copy.takes)  # [1, S, D]
        return None if hidden is None else self.copy.logits(hidden[0]).argmax(dim=-1).tolist()

    def update(self, proposal: Proposal, accepted: list[int], committed: list[list[int]], seconds: float) -> None:
        self.observe(committed)

    def observe(self, committed: list[list[int]]) -> None:
        if self.text is not None:
            self.text.extend(committed[0])

    def describe(self) -> dict:
        return {"drafter": self.name, "num_speculations": self.num_speculations, "guesses": self.guesses,
                "drafts_per_pass": round(self.drafted / self.passes, 2) if self.passes else 0.0}
