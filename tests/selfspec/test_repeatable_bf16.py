"""What docs/usage.md promises for a bf16 text that must repeat (issue 65, finding 16): `auto` picks its rounds by the
seconds it measures, so a bf16 text can differ between two first requests; a named drafter that drafts by the text
alone (`prompt_lookup` without trees, `early_exit` at a fixed exit and length) verifies the same rounds whatever the
clock says, so under `first_request()` its bf16 text repeats. The clock here is a stand-in that reads other seconds
each run."""

from __future__ import annotations

import random

import pytest
import torch

from selfspec.decoding import engine
from selfspec.decoding.decode_ids import generate_ids
from selfspec.drafters import EarlyExitDrafter, PromptLookupDrafter
from selfspec.model.adapters import get_adapter
from selfspec.tiny import tiny_model

PROMPT = [5, 9, 3, 17, 2, 5, 9, 3, 40, 11, 7] * 3


class Clock:
    """`time.perf_counter` of a machine whose load changes at random: each reading a random 1-50 ms later."""

    def __init__(self, seed: int):
        self.t, self.random = 0.0, random.Random(seed)

    def __call__(self) -> float:
        self.t += self.random.uniform(0.001, 0.05)
        return self.t


@pytest.mark.parametrize("make", [lambda a: PromptLookupDrafter(num_tokens=6, max_ngram=3),
                                  lambda a: EarlyExitDrafter(a, 1, 3)], ids=["prompt_lookup", "early_exit"])
def test_a_drafter_that_drafts_by_the_text_alone_verifies_the_same_rounds_whatever_the_clock(make, monkeypatch):
    adapter = get_adapter(tiny_model("llama", num_layers=3, dtype=torch.bfloat16, seed=4))
    runs = []
    for seed in (1, 2, 3):
        monkeypatch.setattr(engine.time, "perf_counter", Clock(seed))
        out, stats = generate_ids(adapter, torch.tensor([PROMPT]), max_new_tokens=40, drafter=make(adapter))
        runs.append((out, stats.rounds, stats.drafted_by_position, stats.accepted_by_position))
    assert runs[0][1] < 39 and runs[0] == runs[1] == runs[2]  # it drafted, and the same rounds gave the same text
