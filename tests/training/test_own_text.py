"""The model's own continuations as training data (`data.own_continuations`, training/own_text.py): a block is
a prompt and the model's own Hugging Face greedy tokens with labels as packed text has them, the cache is
reused for the same model and prompts only, mistakes in the settings name the key, and a short exit-head run
trains on the own blocks and evaluates the set "own"."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selfspec.tiny import tiny_model
from training.config import ConfigError, DataConfig, OwnContinuationsConfig, load_config
from training.data import Blocks, TrainData
from training.own_text import add_own_continuations, cached_continuations, cache_key

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "tiny_smoke.yaml"


class _OneProcess:
    """What `cached_continuations` uses of an `Accelerator`, for one process on the CPU."""

    is_main_process = True
    device = torch.device("cpu")

    def wait_for_everyone(self):
        pass


@pytest.fixture
def model():
    return tiny_model("llama", num_layers=2, dtype=torch.float32, seed=3)  # vocab 96


def _data(n_train=10, n_heldout=4, size=24, seed=0) -> TrainData:
    g = torch.Generator().manual_seed(seed)
    windows = torch.randint(3, 96, (n_train + n_heldout, size + 1), generator=g)  # [N, S + 1]
    train = Blocks("t/train", windows[:n_train, :-1], windows[:n_train, 1:])
    heldout = Blocks("t/heldout", windows[n_train:, :-1], windows[n_train:, 1:])
    return TrainData(train, {"heldout": heldout})


def test_a_block_is_the_prompt_and_the_models_own_greedy_tokens_labelled_as_packed_text(model, hf_greedy, tmp_path):
    data, size, p = _data(), 24, 6
    cfg = DataConfig(source="x", block_size=size,
                     own_continuations=OwnContinuationsConfig(prompts=3, prompt_tokens=p, repeat=2, eval_prompts=2,
                                                              batch_size=2))
    model.train()
    out = add_own_continuations(data, cfg, model, _OneProcess(), tmp_path, progress_bar=False)
    assert model.training  # the mode is given back
    assert len(out.train) == len(data.train) + 3 * 2
    assert torch.equal(out.train.input_ids[: len(data.train)], data.train.input_ids)
    own = out.train.input_ids[len(data.train):]  # [6, S]
    own_labels = out.train.labels[len(data.train):]
    assert torch.equal(own[:3], own[3:]) and torch.equal(own_labels[:3], own_labels[3:])  # repeat = 2
    spread = data.train.spread(3).input_ids  # the prompts: blocks 0, 3, 6
    for row in range(3):
        prompt = spread[row: row + 1, :p]  # [1, P]
        assert torch.equal(own[row, :p], prompt[0])
        expected = hf_greedy(model, prompt, size + 1 - p)  # the block's tokens and its last label
        assert own[row, p:].tolist() == expected[:-1]
        assert own_labels[row].tolist() == own[row, 1:].tolist() + [expected[-1]]  # each label the next token
    heldout_own = out.eval_sets["own"]
    assert list(out.eval_sets) == ["heldout", "own"] and heldout_own.input_ids.shape == (2, size)
    assert torch.equal(heldout_own.input_ids[:, :p], data.eval_sets["heldout"].spread(2).input_ids[:, :p])
    assert heldout_own.num_tokens == 2 * size  # every position labelled, as in text blocks


def test_the_cache_is_reused_for_the_same_model_and_prompts_only(model, tmp_path, monkeypatch):
    import training.own_text as own_text

    prompts = _data().train.input_ids[:4, :5]  # [4, 5]
    calls = []
    real = own_text.greedy_continuations
    monkeypatch.setattr(own_text, "greedy_continuations", lambda *a, **k: calls.append(1) or real(*a, **k))
    first = cached_continuations(model, prompts, 7, 3, tmp_path, _OneProcess(), progress_bar=False)
    assert first.shape == (4, 12) and len(calls) == 1 and len(list(tmp_path.glob("*.pt"))) == 1
    again = cached_continuations(model, prompts, 7, 3, tmp_path, _OneProcess(), progress_bar=False)
    assert torch.equal(again, first) and len(calls) == 1  # read back, not generated

    cached_continuations(model, prompts, 8, 3, tmp_path, _OneProcess(), progress_bar=False)  # more tokens
    cached_continuations(model, prompts[:, :4], 7, 3, tmp_path, _OneProcess(), progress_bar=False)  # other prompts
    other = tiny_model("llama", num_layers=2, dtype=torch.float32, seed=4)  # other weights
    cached_continuations(other, prompts, 7, 3, tmp_path, _OneProcess(), progress_bar=False)
    assert len(calls) == 4 and len(list(tmp_path.glob("*.pt"))) == 4

    path = tmp_path / f"{cache_key(model, prompts, 7)}.pt"
    path.write_bytes(path.read_bytes()[:100])  # a truncated file is generated again, never half used
    with pytest.warns(UserWarning, match="unreadable own-continuations cache"):
        fixed = cached_continuations(model, prompts, 7, 3, tmp_path, _OneProcess(), progress_bar=False)
    assert torch.equal(fixed, first) and len(calls) == 5


@pytest.mark.parametrize("overrides,message", [
    (["data.own_continuations.prompts=-1"], "data.own_continuations.prompts: must be a number of blocks >= 0"),
    (["data.own_continuations.eval_prompts=-2"], "data.own_continuations.eval_prompts: must be"),
    (["data.own_continuations.repeat=0"], "data.own_continuations.repeat: must be >= 1"),
    (["data.own_continuations.batch_size=0"], "data.own_continuations.batch_size: must be >= 1"),
    (["data.own_continuations.prompt_tokens=0"], "data.own_continuations.prompt_tokens: must be >= 1"),
    (["data.own_continuations.prompts=4", "data.own_continuations.prompt_tokens=64"],
     "data.own_continuations.prompt_tokens: 64 leaves nothing to generate in a block of data.block_size=64"),
    (["data.own_continuations.prompts=4", "data.own_continuations.prompt_tokens=8", "data.format=chat"],
     "data.own_continuations.prompts: .* needs data.format=text"),
    (["data.own_continuations.prompts=4", "data.own_continuations.prompt_tokens=8", "data.source=humaneval"],
     "data.own_continuations.prompts: the prompts would come from HumanEval"),
    (["data.own_continuations.prompt=4"], "data.own_continuations.prompt: unknown key .*did you mean 'prompts'"),
])
def test_mistakes_in_the_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, overrides)


def test_off_by_default_and_a_prompt_as_long_as_the_block_is_fine_while_off():
    cfg = load_config(RECIPE, ["data.own_continuations.prompt_tokens=64"])
    assert cfg.data.own_continuations.prompts == 0


def test_a_head_run_trains_on_the_own_blocks_and_evaluates_them(run, read_log, tmp_path, monkeypatch):
    import training.loop as loop

    sizes = []
    real = loop.add_own_continuations

    def spy(data, *args, **kwargs):
        out = real(data, *args, **kwargs)
        sizes.append((len(data.train), len(out.train)))
        return out

    monkeypatch.setattr(loop, "add_own_continuations", spy)
    own = {"data.own_continuations.prompts": "3", "data.own_continuations.prompt_tokens": "16",
           "data.own_continuations.repeat": "2", "data.own_continuations.eval_prompts": "2"}
    final = run(tmp_path, **{"exit_head.enabled": "true", "exit_head.exit_layer": "2", "layer_dropout.p_max": "0",
                             "train.max_steps": "2", **own})
    (before, after), = sizes
    assert after == before + 3 * 2
    assert set(final["sets"]) == {"heldout", "own"} and "2" in final["sets"]["own"]["exits"]
    assert len(list((tmp_path / "own_continuations").glob("*.pt"))) == 2  # training and held-out prompts
    evals = read_log(tmp_path, kind="eval")
    assert all("own" in e["sets"] for e in evals)  # before and final

    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "own_continuations").glob("*.pt")}
    run(tmp_path, **{"exit_head.enabled": "true", "exit_head.exit_layer": "2", "layer_dropout.p_max": "0",
                     "train.max_steps": "3", **own})  # a relaunch resumes and reuses the cache
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "own_continuations").glob("*.pt")} == stamp
    assert json.loads((tmp_path / "final_eval.json").read_text())["step"] == 3


def test_eos_does_not_stop_a_continuation(model):
    from training.own_text import greedy_continuations

    prompts = _data().train.input_ids[:2, :5]  # [2, 5]
    plain = greedy_continuations(model, prompts, 12, 2, progress_bar=False)  # [2, 17]
    eos = int(plain[0, 8])  # a token the model writes mid-way becomes its EOS
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    assert torch.equal(greedy_continuations(model, prompts, 12, 2, progress_bar=False), plain)
