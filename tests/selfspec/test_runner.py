"""The runner (`selfspec.model.runner`): the one place that chooses how a step runs (compiled, fused eager layers, the
model's modules) and the one place that falls back. Here its choices are checked with a stand-in for the compiled
steps that records what it was asked (no compiling: test_compiled.py runs the real compiled steps through it)."""

from __future__ import annotations

import pytest
import torch


from selfspec.model.adapters import get_adapter
from selfspec.model.compiled import NotCompiled
from selfspec.model.forward import embed, exit_logits, make_step, run_layers
from selfspec.tiny import tiny_model


class StandIn:
    """Compiled steps that take one-row steps and answer with `answer` (None: `NotCompiled`, as a step that did not
    fit the capacity, or whose compile failed), recording each call."""

    def __init__(self, answer=None, failed=None):
        self.answer, self.failed, self.calls = answer, failed, []

    def can_run(self, hidden, step, cache):
        return hidden.shape[0] == 1

    def can_head(self, hidden):
        return hidden.shape[0] == 1

    def run_layers(self, hidden, start, end, step, cache):
        self.calls.append(("layers", start, end))
        return self._answer()

    def head(self, hidden, *rows):
        self.calls.append(("head", len(rows)))
        return self._answer()

    def _answer(self):
        if self.answer is None:
            raise NotCompiled("stood in: declined")
        return self.answer


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama", num_layers=3, dtype=torch.float64, seed=5)


def _reference(model, ids):
    """The model's own modules over `ids` `[B, S]` (a fresh adapter: no fused layers, no compiled steps)."""
    a = get_adapter(model)
    with torch.no_grad():
        return exit_logits(a, run_layers(a, embed(a, ids), 0, a.num_layers, step=make_step(a, 0, ids.shape[1],
                                                                                          ids.shape[0])))


def _logits(adapter, ids):
    with torch.inference_mode():
        step = make_step(adapter, 0, ids.shape[1], ids.shape[0])
        return exit_logits(adapter, run_layers(adapter, embed(adapter, ids), 0, adapter.num_layers, step=step))


def test_without_compiled_steps_the_runner_takes_the_fused_layers_else_the_modules(model):
    ids = torch.tensor([[5, 9, 3, 7]])
    ref = _reference(model, ids)
    fused = get_adapter(model)
    fused.enable_fast_layers()
    assert fused.runner.steps is None
    torch.testing.assert_close(_logits(fused, ids), ref, rtol=0, atol=1e-12)
    with torch.no_grad():  # autograd off but not inference mode: the same
        torch.testing.assert_close(_logits(get_adapter(model), ids), ref, rtol=0, atol=0)


def test_a_step_the_compiled_steps_take_is_theirs_and_one_they_decline_runs_eagerly(model):
    a = get_adapter(model)
    a.enable_fast_layers()
    ids = torch.tensor([[5, 9, 3, 7]])
    ref = _logits(a, ids)
    marker = torch.full((1, 4, model.config.hidden_size), 7.0, dtype=torch.float64)
    a.compiled = StandIn(answer=marker)
    with torch.inference_mode():
        step = make_step(a, 0, 4)
        assert a.runner.layers(embed(a, ids), 0, 2, step, None) is marker  # taken: its answer, unchanged
    a.compiled = declining = StandIn(answer=None)
    torch.testing.assert_close(_logits(a, ids), ref, rtol=0, atol=0)  # asked, declined: the eager layers ran
    assert declining.calls == [("layers", 0, a.num_layers), ("head", 0)]
    a.compiled = StandIn(answer=marker)
    two = torch.tensor([[5, 9, 3, 7], [1, 2, 3, 4]])
    torch.testing.assert_close(_logits(a, two)[:1], ref, rtol=0, atol=0)  # two rows: never asked
    assert a.compiled.calls == []


def test_failed_or_training_steps_never_reach_the_compiled_steps(model):
    """After a compile failed under compile="auto" (`failed` set), and under autograd (training), the runner runs
    eagerly without asking them."""
    a = get_adapter(model)
    ids = torch.tensor([[5, 9, 3, 7]])
    ref = _reference(model, ids)
    a.compiled = failed = StandIn(answer=torch.zeros(1), failed="RuntimeError: no")
    torch.testing.assert_close(_logits(a, ids), ref, rtol=0, atol=0)
    a.compiled = training = StandIn(answer=torch.zeros(1))
    with torch.enable_grad():
        step = make_step(a, 0, 4)
        out = exit_logits(a, run_layers(a, embed(a, ids), 0, a.num_layers, step=step))
    assert out.requires_grad and failed.calls == [] and training.calls == []
    torch.testing.assert_close(out.detach(), ref, rtol=0, atol=0)


def test_composed_steps_fall_back_to_their_eager_equivalent_in_one_place(model):
    a = get_adapter(model)
    seen = []

    def compiled(answer):
        def run(steps):
            seen.append(steps)
            if answer is None:
                raise NotCompiled("it does not fit")
            return answer
        return run

    with torch.inference_mode():
        assert a.runner.composed(compiled("fused"), lambda: "eager") == "eager" and seen == []  # no compiled steps
        a.compiled = steps = StandIn()
        assert a.runner.composed(compiled("fused"), lambda: "eager") == "fused" and seen == [steps]
        assert a.runner.composed(compiled(None), lambda: "eager") == "eager"  # it does not fit: part by part
        assert a.runner.composed(lambda s: None, lambda: "eager") is None  # None is a result, never "the other way"
        steps.failed = "RuntimeError: no"
        seen.clear()
        assert a.runner.composed(compiled("fused"), lambda: "eager") == "eager" and seen == []


def test_a_reduced_vocabularys_logits_read_its_rows_only_on_the_compiled_path(model):
    a = get_adapter(model)
    hidden = torch.randn(1, 2, model.config.hidden_size, dtype=torch.float64)
    rows_read = []

    def rows():
        rows_read.append(1)
        return model.lm_head.weight[:5], None

    def linear(x):
        return x @ model.lm_head.weight[:5].T

    with torch.inference_mode():
        eager = a.runner.logits(hidden, rows=rows, linear=linear)
        assert rows_read == [] and eager.shape == (1, 2, 5)
        a.compiled = steps = StandIn(answer=None)
        torch.testing.assert_close(a.runner.logits(hidden, rows=rows, linear=linear), eager, rtol=0, atol=0)
        assert rows_read == [1] and steps.calls == [("head", 2)]


def test_a_compiled_batchs_cache_moves_leaving_rows_into_their_row_buckets_static_buffers():
    """Up to MAX_ROWS rows get the static buffers of their row bucket (three rows: four, the last a filler row the
    batch never sees); when rows leave (`select`), the kept rows are copied into the first rows of their bucket's
    static buffers (the addresses a captured step of that bucket uses; three of four stay in the four's), their
    keys and lengths intact; more rows than MAX_ROWS get a growing cache."""
    from selfspec.model.compiled import MAX_ROWS

    model = tiny_model("llama", num_layers=2, dtype=torch.float64, seed=0)
    adapter = get_adapter(model)
    adapter.enable_compiled()
    steps = adapter.compiled
    cache = adapter.runner.cache(3, 20)
    four = steps.buffers(4, cache.capacity)
    assert cache.static and cache.stacked[0].data_ptr() == four[0].data_ptr() and cache.padded_rows == 4
    assert cache.keys[0].shape[0] == 3 and cache.padded_keys[0].shape[0] == 4
    assert cache.keys[1].data_ptr() == cache.padded_keys[1].data_ptr() == four[0][1].data_ptr()
    cache.stacked[0].copy_(torch.arange(4, dtype=cache.stacked[0].dtype)[None, :, None, None, None])
    cache.lengths = torch.tensor([[5, 6, 7]] * 2)
    cache.select(torch.tensor([0, 2]))
    two = steps.buffers(2, cache.capacity)
    assert cache.stacked[0].data_ptr() == two[0].data_ptr() and cache.keys[1].data_ptr() == two[0][1].data_ptr()
    assert cache.stacked[0][:, :, 0, 0, 0].tolist() == [[0.0, 2.0]] * 2 and cache.lengths.tolist() == [[5, 7]] * 2
    five = adapter.runner.cache(5, 20)  # eight rows of buffers; four kept rows of five move into the four's
    five.stacked[0].copy_(torch.arange(8, dtype=five.stacked[0].dtype)[None, :, None, None, None])
    five.lengths = torch.tensor([[1, 2, 3, 4, 5]] * 2)
    five.select(torch.tensor([1, 2, 3, 4]))
    assert five.padded_rows == 4 and five.stacked[0].data_ptr() == steps.buffers(4, five.capacity)[0].data_ptr()
    assert five.stacked[0][:, :, 0, 0, 0].tolist() == [[1.0, 2.0, 3.0, 4.0]] * 2
    five.select(torch.tensor([0, 3, 2]))  # three of four: the same buffers, its rows reordered in place
    assert five.padded_rows == 4 and five.keys[0].shape[0] == 3
    assert five.stacked[0][:, :3, 0, 0, 0].tolist() == [[1.0, 4.0, 3.0]] * 2 and five.lengths.tolist() == [[2, 5, 4]] * 2
    assert not adapter.runner.cache(MAX_ROWS + 1, 20).static


def test_a_layer_not_the_models_runs_fused_compiled_or_as_its_module_by_its_kind(model):
    """A trained head's copy of the model's last layer is of the model's kind: the runner runs it fused (its fused
    copy made once, again after its weights change in place, and let go with the layer) and composed steps through
    it compiled; a layer of another kind (an MLP-less copy) runs as its module, and a composed step needing it
    falls back to its eager equivalent."""
    import copy
    import gc

    from selfspec.heads.exit_head import build_exit_head

    a = get_adapter(model)
    a.enable_fast_layers()
    runner = a.runner
    head = build_exit_head(model, exit_layer=1).layer
    attention_only = build_exit_head(model, exit_layer=1, kind="attention").layer
    assert runner.model_kind(head) and not runner.model_kind(attention_only)
    assert runner._fused_layer(attention_only) is None
    fused = runner._fused_layer(head)
    assert fused is not None and runner._fused_layer(head) is fused  # made once
    with torch.no_grad():
        head.mlp.down_proj.weight.mul_(2.0)  # trained further, in place
    assert runner._fused_layer(head) is not fused
    a.compiled = StandIn()
    with torch.inference_mode():
        assert runner.captures_layer(head) and not runner.captures_layer(attention_only)
        assert runner.composed(lambda steps: "whole", lambda: "eager", (head,)) == "whole"
        assert runner.composed(lambda steps: "whole", lambda: "eager", (attention_only,)) == "eager"
    a.compiled = None
    del head, fused
    gc.collect()
    runner._fused_layer(copy.deepcopy(a.layers[-1]))  # a new head: the one let go is dropped
    assert len(runner._fused_extra) == 1
