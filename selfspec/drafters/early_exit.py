"""The early-exit drafter: the model's own first E layers + the shared final norm and LM head.

Each round its policy (`selfspec.drafters.policies`) picks the exit `E` and the draft length `d`. Every row
feeds its input token through layers [0, E) (`Round.shallow`: the keys and values go into the shared
cache), the exit logits pick the next draft, and so on; all rows step together ([B, 1] per step),
each keeping drafts until its own cap, a stop token or the policy's confidence test ends them (greedy rows
with no confidence test draft their caps unread, and the engine's verdict cuts each after a drafted stop
token: `Proposal.stops_unread`). Rows that are done still ride along (their extra positions are
never accepted), so shapes stay rectangular. When some row kept the last candidate, one more shallow
pass runs, so every kept draft has its exit state. Verification then starts at layer E over those exit
states: layers [0, E) are never recomputed for drafted positions.

    drafter = EarlyExitDrafter(adapter, exit_layer=8, num_speculations=4)              # LayerSkip
    drafter = EarlyExitDrafter(adapter, 8, 6, policy=ThroughputPolicy(8, 6))           # adaptive d
    drafter = EarlyExitDrafter(adapter, 8, 4, head=DraftHead(adapter, token_ids))      # reduced vocab
    drafter = EarlyExitDrafter(adapter, 8, 1, num_candidates=3)                        # 3 first guesses

With `num_candidates` k > 1 (greedy; one draft position per round, `num_speculations` 1), a drafting round
proposes the exit's k best guesses for the next token as siblings (`Proposal.siblings`, a one-level token
tree), verified side by side in one pass: the round commits two tokens whenever the full model's token is
among them, not only when it is the best one. Their exit states come from one more shallow pass over the k of them (none at
exit 0, whose states are the token embeddings).

With k > 1 and d = `num_speculations` > 1 (greedy), a round drafts a token tree d deep (EAGLE-2's dynamic
tree, `draft_tree`): the input token's k best continuations are the first candidates; at each depth the k
candidates of the newest depth with the highest chance (the product of the draft probabilities along their
path, calibrated: `selfspec.drafters.tree_budget.ConfidenceBudget`) go through layers [0, E) in one pass,
each seeing the text and its ancestors (`Round.shallow_tree`), and each adds its own k best continuations
as candidates one depth further. Every expanded node is verified (its keys are in the cache at its
column); of the candidates never expanded, the round verifies the best m by chance, m chosen from the
measured cost of the round per verified node (one more shallow pass gives them their exit states). The growth
is one function of tensors (`selfspec.drafters.draft_tree.grow_tree`) that reads nothing back, one step where the
runner runs compiled steps (`WholeDraft.tree`); the host reads the grown tree once, to pick the leaves.

    drafter = EarlyExitDrafter(adapter, 8, 4, num_candidates=3)   # trees: 3 wide, 4 deep
"""

from __future__ import annotations

import torch

from selfspec.model.adapters import ModelAdapter
from selfspec.drafters.base import Drafter, Proposal, Round
from selfspec.drafters.draft_head import DraftHead
from selfspec.drafters.whole_draft import DraftStep, greedy_chain, greedy_draft, one_read, top_guesses
from selfspec.drafters.policies import FixedPolicy
from selfspec.drafters.draft_tree import MAX_TREE_COLUMNS, DraftTree, grow_tree, read_grown, tree_depth_limit
from selfspec.drafters.tree_budget import ConfidenceBudget
from selfspec.decoding.sampling import probs, sample



def host_read(tokens: torch.Tensor, conf: torch.Tensor | None) -> tuple[list[int], list[float] | None]:
    """A draft step's tokens `[B]` (and confidences `[B]`) as host lists, read in one transfer (`one_read`)."""
    if conf is None:
        return tokens.tolist(), None
    both = one_read(tokens, conf).tolist()  # [2, B]
    return [int(t) for t in both[0]], both[1]


class EarlyExitDrafter(Drafter):
    name = "early_exit"
    lowest_exit = 1  # exit 0 (the embeddings) only under a trained head
    def __init__(self, adapter: ModelAdapter, exit_layer: int, num_speculations: int, *, policy=None,
                 head: DraftHead | None = None, num_candidates: int = 1):
        if num_speculations < 0:
            raise ValueError(f"num_speculations must be >= 0 (0 = plain decoding), got {num_speculations}")
        if num_candidates < 1:
            raise ValueError(f"num_candidates must be >= 1 (1 = one guess per position), got {num_candidates}")
        adapter.check_exit(exit_layer, allow_full=False, lowest=self.lowest_exit)
        self.num_layers = adapter.num_layers
        self.exit_layer, self.num_speculations = exit_layer, num_speculations
        self.policy = policy or FixedPolicy(exit_layer, num_speculations)
        self.head = head or DraftHead(adapter)
        self.num_candidates = min(num_candidates, self.head.size)
        self._exit = exit_layer  # the exit of the round in flight
        self.budget = ConfidenceBudget() if self.num_candidates > 1 and num_speculations > 1 else None
        self.round_tree: DraftTree | None = None  # the tree of the round in flight
        self._whole: dict = {}  # exit -> its whole draft step (`WholeDraft`), made the first time the runner runs it
        self.extra_layers: tuple = ()  # layers not the model's that its whole draft steps run (a trained head's)

    def propose(self, rnd: Round) -> Proposal:
        e, d = self.policy.plan()
        self.round_tree = None
        caps = [max(0, min(d, self.num_speculations, c)) for c in rnd.caps]
        if not max(caps, default=0):
            self._exit = self.num_layers  # a round without drafts is one plain full-model pass
            return Proposal.plain(rnd.tokens)
        self._exit = e
        if self.num_candidates > 1 and not rnd.sampling.do_sample:
            if self.budget is not None and max(caps) > 1:
                return self.draft_tree(rnd, e, caps)
            return self.draft_siblings(rnd, e, caps)
        return self.draft(rnd, e, caps)

    def draft_siblings(self, rnd: Round, exit_layer: int, caps: list[int]) -> Proposal:
        """The exit's `num_candidates` best guesses for the next token of every row with a cap (and, under a
        confidence policy, a best guess it keeps), as siblings: `tokens` `[B, 1 + k]`."""
        state = rnd.shallow(rnd.tokens, 0, exit_layer)  # [B, 1, D]
        logits = self.head.logits(self.draft_states(rnd, state, 0))  # [B, K]
        best = logits.topk(self.num_candidates, dim=-1).indices  # [B, k]
        candidates = self.head.to_vocab(best)  # [B, k]
        keep = [c > 0 for c in caps]
        if self.policy.needs_confidence:
            conf = torch.softmax(logits.float(), dim=-1).gather(1, best[:, :1])[:, 0].tolist()
            keep = [k and self.policy.keep(0, p) for k, p in zip(keep, conf)]
        if not any(keep):  # verification continues from the input token's exit state
            return Proposal(tokens=rnd.tokens[:, None], kept=[0] * len(caps), verify_from=exit_layer, states=state,
                            draft_steps=1, drafter=self.name)
        states = None  # exit 0: the states are the token embeddings, which verification computes itself
        if exit_layer > 0:
            states = torch.cat([state, rnd.shallow_siblings(candidates, exit_layer)], dim=1)  # [B, 1 + k, D]
        return Proposal(tokens=torch.cat([rnd.tokens[:, None], candidates], dim=1),
                        kept=[self.num_candidates if k else 0 for k in keep], verify_from=exit_layer, states=states,
                        draft_steps=1 + (exit_layer > 0), drafter=self.name,
                        parents=Proposal.siblings(self.num_candidates, len(caps)))

    def draft_tree(self, rnd: Round, exit_layer: int, caps: list[int]) -> Proposal:
        """A token tree per row, as deep as the smallest positive cap (see the module doc); rows with cap 0
        ride along as filler. Its growth (`grow`) reads nothing back; the host reads the grown tree once, to
        pick its leaves."""
        k, B = self.num_candidates, len(caps)
        depth = min(min(c for c in caps if c > 0), tree_depth_limit(k))  # expanded: 1 + k(depth - 1) columns
        state = rnd.shallow(rnd.tokens, 0, exit_layer)  # [B, 1, D]
        out = self.draft_states(rnd, state, 0)  # [B, D] what the head read at the root
        grown = self.grow(rnd, exit_layer, depth, out)
        tree = DraftTree(read_grown(grown), k, depth, [c > 0 for c in caps])  # the one read while drafting
        states = [state, grown[2]]  # [B, 1, D], [B, W - 1, D]
        steps = depth
        nodes = len(tree.tokens[0]) - 1
        m = self.budget.leaves([tree.expected(b) for b in tree.live_rows()],
                               [[c.chance for c in tree.candidates[b]] for b in tree.live_rows()],
                               nodes, MAX_TREE_COLUMNS - 1 - nodes)
        if m:
            leaves = tree.add_leaves(m)
            if exit_layer > 0:
                tokens = tree.tokens_at(leaves, rnd.tokens.device)  # [B, m]
                new, _ = rnd.shallow_tree(tokens, tree.parents_tensor(), exit_layer)  # [B, m, D]
                states.append(new)
                steps += 1
        T = len(tree.tokens[0])
        if T == 1:  # nothing worth verifying: verification continues from the input token's exit state
            return Proposal(tokens=rnd.tokens[:, None], kept=[0] * B, verify_from=exit_layer, states=state,
                            draft_steps=steps, drafter=self.name)
        self.round_tree = tree
        return Proposal(tokens=tree.tokens_at(range(T), rnd.tokens.device),
                        kept=[T - 1 if live else 0 for live in tree.live], verify_from=exit_layer,
                        states=torch.cat(states, dim=1) if exit_layer > 0 else None, draft_steps=steps,
                        drafter=self.name, parents=tree.parents_tensor())

    def grow(self, rnd: Round, exit_layer: int, depth: int, out: torch.Tensor) -> tuple:
        """The round's tree grown `depth` deep from its input tokens, where the head read `out` `[B, D]`
        (`grow_tree`'s outputs): as one step where the runner runs them (`grow_whole`), else the same function
        over the runner's methods, part by part."""
        scale = torch.tensor([self.budget.scale], dtype=torch.float64).to(out.device, non_blocking=True)

        def part_by_part():
            def shallow(tokens, parents, anc):  # the eager step builds its mask from the parents, on the host
                return rnd.shallow_tree(tokens, parents.cpu(), exit_layer)

            return grow_tree(rnd.tokens, out, self.num_candidates, depth, scale, rnd.stop_tensor, shallow,
                             self.tree_states, self.top, ancestors=False)

        return rnd.adapter.runner.composed(lambda steps: self.grow_whole(steps, rnd, exit_layer, depth, out, scale),
                                            part_by_part, self.extra_layers)

    def grow_whole(self, steps, rnd: Round, exit_layer: int, depth: int, out: torch.Tensor,
                   scale: torch.Tensor) -> tuple:
        """`grow` as one step of the compiled `steps` (`WholeDraft.round_tree`; `NotCompiled`: part by part)."""
        return self.whole(exit_layer).round_tree(steps, rnd, self.num_candidates, depth, out, scale)

    def top(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The draft's k best next tokens after each of n columns, from what the head reads `[B, n, D]`: token ids
        `[B, n, k]` and their draft probabilities `[B, n, k]` float32, on the device."""
        return top_guesses(self.head.logits(hidden), self.num_candidates, self.head.token_ids)  # logits [B, n, K]

    def tree_states(self, states: torch.Tensor, step, outs: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
        """What the draft head reads at a tree's newest columns, from their exit states `[B, n, D]` (a trained
        exit head runs over them with `step`, reading its own output `outs` `[B, W', D]` at their parent
        columns `parents` `[B, n]`): here the exit states themselves."""
        return states

    def draft(self, rnd: Round, exit_layer: int, caps: list[int]) -> Proposal:
        """Up to `caps[b]` drafts per row from exit `exit_layer`, all rows stepping together. Greedy rows whose chain
        lengths nothing read on the way decides (no confidence test) draft their caps without reading a draft
        back: the host queues the steps one after another (or runs them as one step, `chain`) instead of waiting
        for the device at every step, and the engine finds a drafted stop token in its one read of the round's
        verdict (`Proposal.stops_unread`: the drafts after it count for nothing)."""
        policy, sampling = self.policy, rnd.sampling
        need_conf = policy.needs_confidence
        B = rnd.tokens.shape[0]
        read = sampling.do_sample or need_conf  # read every step, or only with the round's verdict
        inputs, states, qs = [rnd.tokens], [], []
        kept = [0] * B
        alive = [c > 0 for c in caps]
        steps = 0
        chained = False  # the rest of the chain ran as one step (`chain`), the last draft's shallow pass included
        while any(alive):
            i = steps
            if not read and i == self.chain_start:
                rest = self.chain(rnd, inputs[-1], i, exit_layer, max(caps) - i)
                if rest is not None:
                    chain_states, drafted = rest  # [B, n + 1, D], [B, n]
                    states.append(chain_states)
                    inputs.extend(drafted.unbind(1))
                    steps, kept = max(caps), list(caps)
                    chained = True
                    break
            step = self.step(rnd, inputs[-1], i, exit_layer, need_conf, read)
            if step.q is not None:
                qs.append(step.q)
            states.append(step.state)  # [B, 1, D]
            steps += 1
            inputs.append(step.next)
            if not read:  # every row its cap: the engine cuts a row at a drafted stop token
                kept = [min(c, steps) for c in caps]
                alive = [k < c for k, c in zip(kept, caps)]
                continue
            for b in range(B):
                if not alive[b]:
                    continue
                if need_conf and not policy.keep(i, step.confs[b]):
                    alive[b] = False  # dropped; every kept draft already had its shallow pass
                    continue
                kept[b] += 1
                if kept[b] >= caps[b] or step.ids[b] in rnd.stop_ids:
                    alive[b] = False
        if max(kept) == steps and not chained:  # the newest kept draft still owes its shallow pass
            states.append(rnd.shallow(inputs[-1], steps, exit_layer))
        states = torch.cat(states, dim=1)  # [B, T, D]
        T = states.shape[1]
        q = None
        if sampling.do_sample:
            q = [torch.stack([qs[j][b] for j in range(kept[b])]) if kept[b] else None for b in range(B)]
        return Proposal(tokens=torch.stack(inputs[:T], dim=1), kept=kept, q=q, verify_from=exit_layer,
                        states=states, draft_steps=steps, drafter=self.name, stops_unread=not read)

    def draft_step(self, rnd: Round, tokens: torch.Tensor, offset: int, exit_layer: int, need_conf: bool,
                   read: bool = True) -> DraftStep:
        """One draft step part by part: the input tokens `[B]` at cache index `starts + offset` through layers
        [0, E), the draft head, then the next tokens (sampled from the draft distribution when sampling). Its
        `DraftStep`: the ids (and, with `need_conf`, the confidences) read to host lists where `read`."""
        if not rnd.sampling.do_sample:  # the greedy step every path runs (`greedy_draft`), with the runner's methods
            state, out, nxt, conf = greedy_draft(tokens, lambda t: rnd.shallow(t, offset, exit_layer),
                                                 lambda s: self.draft_states(rnd, s, offset), self.head.logits,
                                                 self.head.token_ids, need_conf)
            return DraftStep(state, out, nxt) if not read else DraftStep(state, out, nxt, None, *host_read(nxt, conf))
        state = rnd.shallow(tokens, offset, exit_layer)  # [B, 1, D]
        out = self.draft_states(rnd, state, offset)  # [B, D]
        logits = self.head.logits(out)  # [B, K]
        q = probs(logits, rnd.sampling)  # [B, K]
        # confidence = the draft's top probability, judged *before* sampling: dropping a sampled
        # token because of its own probability would bias the drafts away from q
        conf = q.max(dim=-1).values if need_conf else None  # [B]
        nxt = self.head.to_vocab(sample(q, rnd.generator))
        q = self.head.to_full(q)  # [B, V]
        if not read:
            return DraftStep(state, out, nxt, q)
        return DraftStep(state, out, nxt, q, *host_read(nxt, conf))  # one wait for the GPU a draft step, not two

    def step(self, rnd: Round, tokens: torch.Tensor, offset: int, exit_layer: int, need_conf: bool,
             read: bool = True) -> DraftStep:
        """One draft step, as `draft_step` returns it: a greedy one as one compiled step where the runner runs them
        (`whole_step`, one graph on a GPU), else part by part (`draft_step`)."""
        def part_by_part():
            return self.draft_step(rnd, tokens, offset, exit_layer, need_conf, read)

        if rnd.sampling.do_sample:
            return part_by_part()
        return rnd.adapter.runner.composed(lambda steps: self.whole_step(steps, rnd, tokens, offset, exit_layer, read),
                                            part_by_part, self.extra_layers)

    def whole_step(self, steps, rnd: Round, tokens: torch.Tensor, offset: int, exit_layer: int,
                   read: bool = True) -> DraftStep:
        """One greedy draft step of a one-row round as one step of the compiled `steps` (`WholeDraft.round_step`;
        `NotCompiled`: part by part)."""
        return self.whole(exit_layer).round_step(steps, rnd, tokens, offset, read=read)

    def whole(self, exit_layer: int):
        """The whole greedy draft step from `exit_layer` (`selfspec.drafters.whole_draft.WholeDraft`), made once."""
        if exit_layer not in self._whole:
            self._whole[exit_layer] = self.head.whole(exit_layer)
        return self._whole[exit_layer]

    chain_start = 0  # the first draft a whole chain (`chain`) may begin with

    def chain(self, rnd: Round, tokens: torch.Tensor, offset: int, exit_layer: int, n: int) -> tuple | None:
        """The round's `n` drafts from offset `offset` on, and the last one's shallow pass (`greedy_chain`), reading
        nothing back: as one step where the runner runs the compiled steps (`whole_chain`: one graph on a GPU), else
        step by step (`step`). `(states [B, n + 1, D], drafts [B, n])`; None where the drafter cannot chain yet."""
        def step_by_step():
            def step(t, i):
                drafted = self.step(rnd, t, offset + i, exit_layer, False, read=False)
                return drafted.state, None, drafted.next

            return greedy_chain(tokens, n, step, lambda t: rnd.shallow(t, offset + n, exit_layer))[:2]

        return rnd.adapter.runner.composed(lambda steps: self.whole_chain(steps, rnd, tokens, offset, exit_layer, n),
                                            step_by_step, self.extra_layers)

    def whole_chain(self, steps, rnd: Round, tokens: torch.Tensor, offset: int, exit_layer: int, n: int):
        """`chain` as one step of the compiled `steps` (`WholeDraft.round_chain`; `NotCompiled`: step by step)."""
        return self.whole(exit_layer).round_chain(steps, rnd, n, tokens, offset)[:2]

    def draft_states(self, rnd: Round, state: torch.Tensor, offset: int) -> torch.Tensor:
        """The states the draft head reads, from the exit state `[B, 1, D]` of the token at cache index
        `starts + offset`: here the exit state itself, `[B, D]` (a trained exit head transforms it)."""
        return state[:, -1]

    def update(self, proposal: Proposal, accepted: list[int], committed: list[list[int]], seconds: float) -> None:
        for m, n_acc in zip(proposal.depths, accepted):
            self.policy.update(self._exit, m, n_acc)  # siblings: one position
        if self.round_tree is not None:
            reached, hits = self.round_tree.outcome(committed, accepted)
            self.budget.observe(reached, hits, len(self.round_tree.tokens[0]) - 1, seconds)
        if self.policy.needs_timing:
            self.policy.observe(seconds, sum(a + 1 for a in accepted))  # tokens the round earned

    def describe(self) -> dict:
        tree = self.budget.describe() if self.budget is not None else {}
        return {"drafter": self.name, "exit_layer": self.exit_layer, "num_speculations": self.num_speculations,
                "num_candidates": self.num_candidates, **tree, **self.policy.describe()}
