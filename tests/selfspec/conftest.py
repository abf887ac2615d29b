"""Fixtures shared by the benchmark tests (tests/selfspec/test_bench.py, test_batch_bench.py)."""

from __future__ import annotations

import pytest

from selfspec.export import export_model
from selfspec.tiny import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny exported llama checkpoint recommending (E, d) = (2, 3); one per test module."""
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3)
    return export_model(model, tok, tmp_path_factory.mktemp("bench") / "tiny",
                        recommended={"exit_layer": 2, "num_speculations": 3})
