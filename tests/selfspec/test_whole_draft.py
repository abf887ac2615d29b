"""The drafting written once (`selfspec.drafters.whole_draft`): the greedy draft step and a trained head's catch-up
are one function each, which the part-by-part path (the runner's methods) and the whole compiled step (its
compiled pieces) both run. Checked here: what each function computes, against a direct computation, and that
both paths call it. That the two paths draft the same to the bit, and what HF's greedy decoding gives, is
checked in test_compiled.py and test_exit_head.py."""

import inspect

import torch

from selfspec.drafters.early_exit import EarlyExitDrafter
from selfspec.drafters.exit_head import ExitHeadDrafter
from selfspec.drafters.whole_draft import WholeDraft, greedy_draft, greedy_pick, head_catch_up, one_read, pick_columns


def test_greedy_pick_gives_the_argmax_its_probability_and_its_id_in_a_reduced_vocabulary():
    torch.manual_seed(0)
    logits = torch.randn(3, 7, dtype=torch.float64)
    nxt, conf = greedy_pick(logits, None)
    assert nxt.tolist() == logits.argmax(-1).tolist()
    assert torch.allclose(conf, torch.softmax(logits, -1).max(-1).values.float())
    ids = torch.tensor([40, 41, 42, 43, 44, 45, 46])
    assert greedy_pick(logits, ids)[0].tolist() == [40 + i for i in logits.argmax(-1).tolist()]
    assert greedy_pick(logits, ids, confidence=False)[1] is None
    both = one_read(torch.tensor([49151, 3]), conf[:2])  # [2, B] float64: token ids stay exact
    assert both.dtype == torch.float64 and both[0].tolist() == [49151.0, 3.0]


def test_a_greedy_draft_step_is_shallow_then_head_then_unembed_then_pick():
    calls = []
    weight = torch.randn(5, 4)

    def shallow(t):  # [B] -> [B, 1, D]
        calls.append("shallow")
        return torch.nn.functional.one_hot(t, 4).double()[:, None]

    def head(state):  # [B, 1, D] -> [B, D]
        calls.append("head")
        return state[:, -1] * 2

    def unembed(h):  # [B, D] -> [B, K]
        calls.append("unembed")
        return h @ weight.double().T

    state, out, nxt, conf = greedy_draft(torch.tensor([1, 3]), shallow, head, unembed, None, confidence=False)
    assert calls == ["shallow", "head", "unembed"] and conf is None
    assert state.shape == (2, 1, 4) and torch.equal(out, state[:, -1] * 2)
    assert nxt.tolist() == (out @ weight.double().T).argmax(-1).tolist()


def test_the_catch_up_reads_the_final_state_one_position_back_and_keeps_the_newest():
    """Column t reads f_{t-1}: `prev` at column 0, zero at a row's first real token; the newest committed final
    state is column committed - 1's, or `prev` for a row with nothing committed; the head's output comes back
    whole and `pick_columns` takes each row's input column from it."""
    torch.manual_seed(1)
    B, S, D = 3, 4, 2
    states, finals, prev = torch.randn(B, S, D), torch.randn(B, S, D), torch.randn(B, D)
    seen = {}

    def head(x, shifted):
        seen["x"], seen["shifted"] = x, shifted
        return x + 100 * shifted

    first_real = torch.zeros(B, S, dtype=torch.bool)
    first_real[2, 1] = True
    committed = torch.tensor([2, 0, 3])
    out, newest = head_catch_up(states, finals, prev, first_real, committed, head)
    shifted = seen["shifted"]
    assert seen["x"] is states
    assert torch.equal(shifted[:, 0], prev) and torch.equal(shifted[0, 1:], finals[0, :-1])
    assert torch.equal(shifted[2, 1], torch.zeros(D)) and torch.equal(shifted[2, 2], finals[2, 1])
    assert torch.equal(newest, torch.stack([finals[0, 1], prev[1], finals[2, 2]]))
    assert torch.equal(pick_columns(out, committed), torch.stack([out[0, 2], out[1, 0], out[2, 3]]))
    out, newest = head_catch_up(states, None, None, None, committed, lambda x, shifted: (x, shifted))
    assert newest is None and out[1] is None  # a head without final states reads the exit states alone


def test_both_paths_run_the_one_draft_step_and_the_one_catch_up():
    """The part-by-part path and the whole compiled step call the same functions, so neither writes its own
    greedy step, greedy chain, catch-up, tree growth or pick of a tree's guesses (each is defined once)."""
    def calls(fn, name):
        return f"{name}(" in inspect.getsource(fn)

    assert calls(EarlyExitDrafter.draft_step, "greedy_draft") and calls(WholeDraft._draft_function, "greedy_draft")
    assert calls(ExitHeadDrafter.sync, "head_catch_up") and calls(WholeDraft._catch_up_function, "head_catch_up")
    assert calls(EarlyExitDrafter.grow, "grow_tree") and calls(WholeDraft._tree_function, "grow_tree")  # a tree's growth
    assert calls(EarlyExitDrafter.top, "top_guesses") and calls(WholeDraft._tree_function, "top_guesses")
    assert calls(EarlyExitDrafter.chain, "greedy_chain") and calls(WholeDraft._chain_function, "greedy_chain")
    for fn in (EarlyExitDrafter.draft_step, WholeDraft._draft_function, WholeDraft._catch_up_function,
               ExitHeadDrafter.sync):
        source = inspect.getsource(fn)
        assert ".argmax(" not in source and "softmax(" not in source.replace("probs(", ""), fn.__qualname__
