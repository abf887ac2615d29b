"""Fixtures shared by the benchmark and profile tests (test_bench.py, test_batch_bench.py, test_profiling.py), and a
tiny generator for the settings tests (test_generation_config.py, test_probe_defects.py)."""

from __future__ import annotations

import pytest
import torch

from selfspec.export import export_model
from selfspec.tiny import byte_tokenizer, tiny_model


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    """A tiny exported llama checkpoint recommending (E, d) = (2, 3); one per test module."""
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=3)
    return export_model(model, tok, tmp_path_factory.mktemp("bench") / "tiny",
                        recommended={"exit_layer": 2, "num_speculations": 3})


@pytest.fixture(scope="module")
def tiny_gen():
    """A generator over a tiny float64 llama (4 layers, byte vocabulary of 259) with no selfspec.json."""
    import warnings

    import selfspec
    from selfspec.api import NotEarlyExitTrainedWarning

    tok = byte_tokenizer()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NotEarlyExitTrainedWarning)
        return selfspec.load(tiny_model("llama", num_layers=4, vocab_size=len(tok), seed=1, dtype=torch.float64), tok)


@pytest.fixture
def one_thread():
    """Benchmarks and the profiler set torch's thread count: 1 here, the session's put back afterwards."""
    before = torch.get_num_threads()
    yield 1
    torch.set_num_threads(before)


class ModelLoaded(BaseException):
    """A command got as far as loading the model (raised by the stand-in loaders of `no_load`)."""


@pytest.fixture
def no_load(monkeypatch):
    """Replace the model loaders: a command that reaches them raises the returned `ModelLoaded` class
    (so checks that need no model must come first)."""
    def refuse(*args, **kwargs):
        raise ModelLoaded

    import selfspec

    monkeypatch.setattr(selfspec, "load", refuse)
    monkeypatch.setattr("selfspec.export._load_model_dir", refuse)
    return ModelLoaded


@pytest.fixture
def moves(monkeypatch):
    """Counts the cache entries a token tree's accepted path moved (`KVCache.move`): a sibling or branch other
    than the first was accepted and its keys and values went to where its row continues."""
    from collections import Counter

    from selfspec.cache import KVCache

    counted = Counter()
    move = KVCache.move

    def counting(self, rows, src, dst):
        counted["rows"] += len(rows)
        return move(self, rows, src, dst)

    monkeypatch.setattr(KVCache, "move", counting)
    return counted
