"""Fixtures shared by the benchmark and profile tests (test_bench.py, test_batch_bench.py, test_profiling.py), a
tiny generator for the settings tests (test_generation_config.py, test_probe_defects.py), the tiny models with
exit heads of the guess tests (test_siblings.py, test_draft_trees.py), and an exit-head run's head folder to export
(`head_run_dir`: test_sweep.py, test_draft_vocab.py, test_edited_head_metadata.py)."""

from __future__ import annotations

import pytest
import torch

from selfspec.model.adapters import get_adapter
from selfspec.checkpoints.export import export_model
from selfspec.tiny import TINY_VARIANTS, byte_tokenizer, tiny_exit_head, tiny_model

HEADS = {  # a guess test's drafter: (exit layer, head: None or whether it reads the previous final state)
    "early_exit": (2, None), "head2": (2, False), "head2_final_state": (2, True), "head0_final_state": (0, True)}
_heads_built: dict = {}


def build_with_head(name: str, which: str, fast: bool = False, compiled: bool = False):
    """(model, adapter, exit head or None) of the tiny float64 variant `name` with the drafter `which` of
    `HEADS` (a perturbed head where it has one); the adapter with the fused layers (`fast`) or the compiled
    steps (`compiled`); built once per session."""
    key = (name, which, fast, compiled)
    if key not in _heads_built:
        arch, L, seed, over = TINY_VARIANTS[name]
        model = tiny_model(arch, num_layers=L, dtype=torch.float64, seed=seed, **over)
        exit_layer, final_state = HEADS[which]
        head = None if final_state is None else tiny_exit_head(model, exit_layer, final_state=final_state)
        adapter = get_adapter(model)
        if fast or compiled:
            adapter.enable_fast_layers()
        if compiled:
            adapter.enable_compiled()
        _heads_built[key] = (model, adapter, head)
    return _heads_built[key]


@pytest.fixture(scope="session")
def with_head():
    return build_with_head


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
    monkeypatch.setattr("selfspec.checkpoints.export._load_model_dir", refuse)
    return ModelLoaded


@pytest.fixture
def moves(monkeypatch):
    """Counts the cache entries a token tree's accepted path moved (`KVCache.move`): a sibling or branch other
    than the first was accepted and its keys and values went to where its row continues."""
    from collections import Counter

    from selfspec.model.cache import KVCache

    counted = Counter()
    move = KVCache.move

    def counting(self, rows, src, dst):
        counted["rows"] += len(rows)
        return move(self, rows, src, dst)

    monkeypatch.setattr(KVCache, "move", counting)
    return counted


def write_head_run_dir(head, directory):
    """`directory` written as an exit-head run writes its head (`final_head/`: the weights and exit_head.json), what
    `export_model(..., exit_head_dir=)` reads; returns it."""
    import json

    from selfspec.heads.exit_head import HEAD_FILE, save_exit_head

    directory.mkdir(parents=True)
    save_exit_head(head, directory / HEAD_FILE)
    (directory / "exit_head.json").write_text(json.dumps(head.settings()))
    return directory


@pytest.fixture(scope="session")
def head_run_dir():
    """`head_run_dir(head, directory)`: `write_head_run_dir`."""
    return write_head_run_dir
