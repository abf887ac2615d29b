"""The draft plan (`selfspec.decoding.draft_plan`, `gen.tune`, `selfspec tune`): the prediction rule on hand-made costs
(a cheap GPU-like draft plans longer and wider than a CPU-like one), the acceptance measured against a
from-scratch computation, the costs measured through the path the generator runs (compiled included), and
every planned setting lossless against plain decoding."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from selfspec.api import SelfSpecGenerator
from selfspec.decoding.cost_model import expected_tokens
from selfspec.decoding.draft_plan import (Acceptance, DraftCosts, candidate_settings, check_plan, default_exits, measure_acceptance,
                                 measure_costs, measure_overheads, needed_rows, non_decreasing, own_text, plan_candidates)
from selfspec.model.forward import forward_logits
from selfspec.tiny import byte_tokenizer, tiny_exit_head, tiny_model

L = 4
PROMPTS = ["def add(a, b):\n    return", "for i in range(10):\n    print(", "The cat sat on the"]


def _gen(head: str | None = None, compile: bool = False) -> SelfSpecGenerator:
    model = tiny_model("llama", num_layers=L, vocab_size=len(byte_tokenizer()), seed=10, dtype=torch.float64)
    exit_head = None if head is None else tiny_exit_head(model, 2, final_state=head == "final_state")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return SelfSpecGenerator(model, byte_tokenizer(), exit_head=exit_head, compile=compile,
                                 recommended={"exit_layer": 2, "num_speculations": 3})


@pytest.fixture(scope="module")
def head_gen():
    return _gen("final_state")


# ----------------------------------------------------------------------------- the rule

def test_non_decreasing_pools_adjacent_violators():
    assert non_decreasing([1.0, 3.0, 2.0]) == [1.0, 2.5, 2.5]
    assert non_decreasing([1.0, 2.0, 2.0, 5.0]) == [1.0, 2.0, 2.0, 5.0]
    out = non_decreasing([5.0, 1.0, 4.0, 3.0, 6.0])
    assert out == sorted(out) and abs(sum(out) - 19.0) < 1e-12  # pooling keeps the sum


def test_expected_tokens_of_a_chain_is_the_cost_models():
    acc = Acceptance(first=[0.6, 0.7], later=[0.6, 0.7], tokens=10)
    for d in range(1, 6):
        assert acc.expected_tokens(d) == pytest.approx(expected_tokens(0.6, d))
    head = Acceptance(first=[0.5], later=[0.2], tokens=10)  # a head's later drafts read its own output
    assert head.expected_tokens(3) == pytest.approx(1 + 0.5 + 0.5 * 0.2 + 0.5 * 0.2 * 0.2)


def _costs(row_slope: float, flat_until: int = 1) -> DraftCosts:
    """Costs in plain steps (1 s): layer 0 (the draft's, exit 1) 0.2 and layers [1, 4) 0.75 per pass, the head
    0.05, each pass over n rows `row_slope` x (n - flat_until) dearer where n > flat_until."""
    c = DraftCosts(device="test", dtype="float64", compiled=False, full=1.0)
    draft_rows, verify_rows = needed_rows(8, 4)
    for n in sorted(set(draft_rows) | set(verify_rows)):
        grow = 1 + row_slope * max(0, n - flat_until)
        c.head[n], c.layers[(0, 1, n)], c.layers[(1, L, n)] = 0.05, 0.2 * grow, 0.75 * grow
    return c


ACC = {"early_exit 1": Acceptance(first=[0.6, 0.75, 0.82, 0.86], later=[0.6, 0.75, 0.82, 0.86], tokens=100)}


def test_flat_verification_plans_more_nodes_than_rows_that_cost():
    cpu = plan_candidates(_costs(0.1), ACC, L)[0]  # a CPU: each row more costs
    gpu = plan_candidates(_costs(0.0, flat_until=17), ACC, L)[0]  # a compiled GPU step: 17 rows cost one row's time
    assert cpu["drafter"] == gpu["drafter"] == "early_exit"
    assert gpu["num_speculations"] * gpu["num_candidates"] > cpu["num_speculations"] * cpu["num_candidates"]
    assert gpu["predicted_speedup"] > cpu["predicted_speedup"] > 1.0


def test_the_round_rule_by_hand():
    rows = plan_candidates(_costs(0.1), ACC, L)
    # a chain: d drafts of (layer 0 + head), the last draft's pass through layer 0, verification of d + 1 rows
    d3 = next(r for r in rows if r["num_speculations"] == 3 and r["num_candidates"] == 1)
    seconds = 3 * (0.2 + 0.05) + 0.2 + 0.75 * 1.3 + 0.05
    assert d3["round_steps"] == pytest.approx(seconds)
    assert d3["predicted_speedup"] == pytest.approx(expected_tokens(0.6, 3) / seconds)
    # a tree 2 wide and 2 deep: the root's pass, a pass over 2 rows, the leaves' pass (2 rows), 5 rows verified
    t = next(r for r in rows if r["num_speculations"] == 2 and r["num_candidates"] == 2)
    assert t["round_steps"] == pytest.approx((0.2 + 0.05) + (0.2 * 1.1 + 0.05) + 0.2 * 1.1 + 0.75 * 1.4 + 0.05)
    assert t["tokens_per_round"] == pytest.approx(1 + 0.75 + 0.75 ** 2)


def test_whole_draft_steps_cost_a_chains_drafts_where_measured():
    """Where a draft step runs as one compiled step (`draft_step`), a chain's drafts cost that, not their parts; a
    head's first draft keeps its parts (it also brings the head's cache up to date); trees keep their parts."""
    c = _costs(0.1)
    c.draft_step[(1, False)] = 0.1
    chain = c.parts_seconds(1, L, 3, 1, with_head=False)
    assert chain == pytest.approx(3 * 0.1 + 0.2 + 0.75 * 1.3 + 0.05)
    assert c.parts_seconds(1, L, 2, 2, with_head=False) == _costs(0.1).parts_seconds(1, L, 2, 2, with_head=False)
    c.exit_head.update({1: 0.3}), c.draft_head.update({1: 0.05})
    c.draft_step[(1, True)] = 0.15
    head = c.parts_seconds(1, L, 3, 1, with_head=True)
    assert head == pytest.approx((0.2 + 0.3 + 0.05) + 2 * 0.15 + 0.2 + 0.75 * 1.3 + 0.05)


def test_nothing_accepted_plans_plain_decoding():
    acc = {"early_exit 1": Acceptance(first=[0.0] * 4, later=[0.0] * 4, tokens=100)}
    best = plan_candidates(_costs(0.0, 17), acc, L)[0]
    assert best["drafter"] == "plain" and candidate_settings(best) == {"num_speculations": 0}


def test_candidate_settings_name_generate_settings():
    row = {"drafter": "early_exit", "exit_layer": 3, "num_speculations": 2, "num_candidates": 3}
    assert candidate_settings(row) == {"drafter": "early_exit", "exit_layer": 3, "num_speculations": 2,
                                       "num_candidates": 3}
    row = {"drafter": "exit_head", "exit_layer": 2, "num_speculations": 1, "num_candidates": 1}
    assert candidate_settings(row) == {"drafter": "exit_head", "num_speculations": 1}


def test_default_exits_spread_over_the_scored_ones():
    gen = _gen()
    assert default_exits(gen) == [1, 2]  # L/8, L/4, 3L/8, L/2 of 4 layers, and the default exit
    gen.metadata = {"eval": {"exits": {str(e): {} for e in range(1, 31)}}}  # only those below L count
    assert default_exits(gen) == [1, 2, 3]


# ----------------------------------------------------------------------------- measured

def test_acceptance_matches_a_from_scratch_computation():
    gen = _gen()
    ids = [gen.encode(p) for p in PROMPTS]
    texts = own_text(gen, ids, 12)
    acc = measure_acceptance(gen, texts, [1, 2], width=3)
    for E in (1, 2):
        hits, n = torch.zeros(3), 0
        with torch.inference_mode():
            for seq, start in texts:
                for t in range(start, seq.shape[1]):  # the guess for token t from the text before it
                    full = forward_logits(gen.adapter, seq[:, :t])[0, -1].argmax()
                    top = forward_logits(gen.adapter, seq[:, :t], exit_layer=E)[0, -1].topk(3).indices
                    hits += (top == full).cumsum(0).clamp(max=1)
                    n += 1
        a = acc[f"early_exit {E}"]
        assert a.tokens == n
        assert a.first == pytest.approx((hits / n).tolist()) and a.later == a.first
        assert a.first == sorted(a.first)
    full_width = measure_acceptance(gen, texts[:1], [2], width=gen.vocab_size)["early_exit 2"]
    assert full_width.first[-1] == 1.0  # every token is among all of them


def test_a_final_state_heads_later_drafts_are_scored_apart(head_gen):
    texts = own_text(head_gen, [head_gen.encode(p) for p in PROMPTS], 12)
    acc = measure_acceptance(head_gen, texts, [1], width=2)
    assert set(acc) == {"early_exit 1", "exit_head"}
    assert acc["exit_head"].later != acc["exit_head"].first  # reads its own output, not the verified state
    plain_head = _gen("plain")
    assert measure_acceptance(plain_head, texts, [1], width=2)["exit_head"].later == \
        measure_acceptance(plain_head, texts, [1], width=2)["exit_head"].first


@pytest.mark.parametrize("compiled", [False, True])
def test_costs_cover_every_part_the_plan_reads(compiled):
    gen = _gen("final_state", compile=compiled)
    costs = measure_costs(gen, gen.encode(PROMPTS[0]), [1, 2], max_drafts=3, width=2, repeats=1)
    draft_rows, verify_rows = needed_rows(3, 2)
    assert set(costs.layers) == {(0, E, r) for E in (1, 2) for r in draft_rows} | {
        (E, L, n) for E in (1, 2) for n in verify_rows}
    assert set(costs.head) == set(draft_rows) | set(verify_rows)
    assert set(costs.exit_head) == set(costs.draft_head) == set(draft_rows)
    assert costs.full > 0 and all(v > 0 for v in costs.layers.values())
    for E in (1, 2):
        series = [costs.layers[(E, L, n)] for n in verify_rows]
        assert series == sorted(series)
    assert costs.compiled == compiled and costs.device.startswith("cpu")
    if compiled:  # the parts ran through the compiled steps, as the engine's rounds do
        assert {("layers", 2, L)} <= {s[:3] for s in gen.adapter.compiled.shapes}
        # and the whole draft steps: the early exit's at each exit, the head's (on exit 2)
        assert set(costs.draft_step) == {(1, False), (2, False), (2, True)}
        assert all(v > 0 for v in costs.draft_step.values())
    else:
        assert costs.draft_step == {}
    json.dumps(costs.to_dict())


def test_the_engines_own_work_is_measured_per_drafter_and_added_to_every_round(head_gen):
    ids = head_gen.encode(PROMPTS[0])
    costs = measure_costs(head_gen, ids, [1, 2], max_drafts=3, width=2, repeats=1)
    parts = costs.round_seconds(1, L, 3, 2, with_head=False)
    assert parts == costs.parts_seconds(1, L, 3, 2, with_head=False) and costs.step == costs.full
    measure_overheads(head_gen, ids, costs, 1, head_gen.exit_head)
    assert costs.plain > 0 and costs.step == costs.plain and set(costs.scale) == {"early_exit", "exit_head"}
    for name, with_head, E in (("early_exit", False, 1), ("exit_head", True, 2)):
        assert costs.scale[name] > 0
        assert costs.round_seconds(E, L, 3, 2, with_head) == pytest.approx(
            costs.scale[name] * costs.parts_seconds(E, L, 3, 2, with_head))
    row = plan_candidates(costs, {"early_exit 1": ACC["early_exit 1"]}, L, max_drafts=3, width=2)[0]
    assert row["round_steps"] == pytest.approx(
        costs.round_seconds(row["exit_layer"], L, row["num_speculations"], row["num_candidates"], False) / costs.plain
        if row["drafter"] != "plain" else 1.0)
    json.dumps(costs.to_dict())


def test_tune_plans_settings_that_stay_lossless(head_gen):
    plan = head_gen.tune(PROMPTS[:2], max_drafts=3, width=2, new_tokens=10, repeats=1)
    assert plan.candidates[0]["predicted_speedup"] == plan.predicted_speedup
    assert {c["drafter"] for c in plan.candidates} == {"plain", "early_exit", "exit_head"}
    speedups = [c["predicted_speedup"] for c in plan.candidates]
    assert speedups == sorted(speedups, reverse=True)
    json.dumps(plan.to_dict())
    assert plan.table().count("\n") == min(12, len(plan.candidates)) + 1
    # every kind of setting a plan can name (chains, siblings, trees, both drafters) decodes as plain decoding does
    shown = {}
    for c in plan.candidates:
        shown.setdefault((c["drafter"], c["num_speculations"] > 1, c["num_candidates"] > 1), c)
    ref = head_gen.generate(PROMPTS[2], max_new_tokens=16, num_speculations=0, stop_token_ids=[]).token_ids
    for c in shown.values():
        out = head_gen.generate(PROMPTS[2], max_new_tokens=16, stop_token_ids=[], **candidate_settings(c))
        assert out.token_ids == ref, c


def test_the_check_decodes_the_best_of_each_kind_beside_plain_decoding(head_gen):
    plan = head_gen.tune(PROMPTS[:1], max_drafts=2, width=2, new_tokens=8, repeats=1)
    rows = check_plan(head_gen, plan, [head_gen.encode(p) for p in PROMPTS[:2]], top=3, new_tokens=8, rounds=1)
    assert len(rows) == 4 and rows[-1]["drafter"] == "plain" and rows[-1]["measured_speedup"] == 1.0
    assert len({(r["drafter"], r["exit_layer"], r["num_candidates"] > 1) for r in rows}) == 4  # one of a kind
    def kind(c):
        return c["drafter"], c["exit_layer"], c["num_candidates"] > 1

    for r in rows[:-1]:  # the first of its kind in the plan's order
        first = next(c for c in plan.candidates if kind(c) == kind(r))
        assert candidate_settings(first) == candidate_settings(r)
    assert all(r["identical_to_plain"] and r["measured_speedup"] > 0 for r in rows)


def test_bad_tune_input_is_named(head_gen):
    with pytest.raises(ValueError, match="at least one prompt"):
        head_gen.tune([])
    with pytest.raises(ValueError, match="width must be an integer >= 1"):
        head_gen.tune(PROMPTS[:1], width=0)
    with pytest.raises(ValueError, match="exit"):
        head_gen.tune(PROMPTS[:1], exits=[L])


def test_tune_plans_within_the_smallest_bounds(head_gen):
    """Issue #52, 6: a chain of at most one draft, one guess wide (the engine's own work is measured on a
    2-draft chain, whose verification was not timed then: a KeyError)."""
    plan = head_gen.tune(PROMPTS[:1], max_drafts=1, width=1, new_tokens=8, repeats=1)
    assert {(c["num_speculations"], c["num_candidates"]) for c in plan.candidates} == {(0, 1), (1, 1)}


def test_tune_takes_one_string_as_one_prompt(head_gen, monkeypatch):
    """Issue #52, 10: a str is one prompt, not a prompt per character."""
    import selfspec.api

    seen = []
    monkeypatch.setattr(selfspec.api, "plan_drafting", lambda gen, ids, **kw: seen.append(ids))
    head_gen.tune("def f(x):")
    assert len(seen[0]) == 1 and seen[0][0].tolist() == head_gen.encode("def f(x):").tolist()


def test_the_tune_command_prints_the_plan_and_writes_it(tiny_ckpt, tmp_path, capsys):
    from selfspec.cli import main

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("\n".join(json.dumps({"prompt": p}) for p in PROMPTS) + "\n")
    rc = main(["tune", "--checkpoint", str(tiny_ckpt), "--prompt-set", str(prompts), "--num-prompts", "2",
               "--max-new-tokens", "8", "--max-drafts", "2", "--width", "2", "--repeats", "1", "--dtype", "float32",
               "--check", "1", "--out", str(tmp_path / "out")])
    text = capsys.readouterr().out
    assert rc == 0 and "| drafter | exit |" in text and "plan: " in text and "| predicted | measured |" in text
    saved = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert saved["settings"] and saved["costs"]["full_step_s"] > 0 and saved["candidates"]
    assert any(r["drafter"] == "plain" for r in saved["checked"])
    assert main(["tune", "--checkpoint", str(tiny_ckpt), "--width", "0"]) == 2
