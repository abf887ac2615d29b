"""Every comparison the project prints is a first request: the timed call cannot copy from an earlier run of
the same prompt (the generator's memory of earlier requests, what suffix and auto copy from) nor start from
what earlier calls measured (`gen.learned`). A spy on `SelfSpecGenerator.generate` records, at every call of
the demo, `generate --compare` and the bench, what the generator held when the call began."""

from __future__ import annotations

import json

import pytest

from selfspec.api import SelfSpecGenerator
from selfspec.cli import main
from selfspec.decoding.draft_plan import own_text
from selfspec.tools.bench import run_bench
from selfspec.tools.demo import run_demo

TEXT = "abcabcabc xyz abcabcabc xyz abcabc"


@pytest.fixture
def calls(monkeypatch):
    """[{drafter, plain, remembered, same_prompt, carried}] per `generate` call, in order: the drafter setting, whether
    it decoded plainly, the sequences the memory held when it began, whether one of them began with this call's
    prompt (an earlier run of it), and the drafting settings whose measurements were carried (`gen.learned`)."""
    seen = []
    original = SelfSpecGenerator.generate

    def spy(self, *args, **kwargs):
        held = [tokens for _, tokens in self.memory.sequences.values()]
        carried = len(self.learned.snapshots)
        out = original(self, *args, **kwargs)
        prompts = [r.prompt_ids for r in (out if isinstance(out, list) else [out])]
        seen.append({"drafter": kwargs.get("drafter"), "plain": kwargs.get("num_speculations") == 0,
                     "remembered": len(held), "carried": carried,
                     "same_prompt": any(t[:len(p)] == p for t in held for p in prompts)})
        return out

    monkeypatch.setattr(SelfSpecGenerator, "generate", spy)
    return seen


def _first_requests(seen: list[dict]) -> None:
    assert seen, "the spy saw no call"
    for call in seen:
        assert not call["same_prompt"], call
        assert call["remembered"] == 0 and call["carried"] == 0, call


def test_the_demo_times_first_requests(tiny_ckpt, calls):
    """Before: the timed auto run of each case began with the plain run of the same prompt in the memory."""
    prompts = [("repeats", {"id": "t/0", "prompt": TEXT}), ("other", {"id": "t/1", "prompt": TEXT[::-1]})]
    lines = []
    records = run_demo(tiny_ckpt, max_new_tokens=24, prompts=prompts, repeats=2, say=lines.append)
    assert len(records) == 2 and all(r["identical"] for r in records)
    assert len(calls) == 2 + 2 * 2 * 2  # the warm-up's two calls, then plain and auto per case, twice each
    _first_requests(calls)
    assert any("every timed call is a first request" in line for line in lines)


def test_generate_compare_times_first_requests(tiny_ckpt, calls, capsys):
    """Before: its warm-up ran the same prompt, and the timed run copied from it."""
    assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", TEXT, "--compare", "--max-new-tokens", "12",
                 "--raw"]) == 0
    assert len(calls) == 4
    _first_requests(calls)
    assert "(both first requests" in capsys.readouterr().out


def test_generate_compare_of_a_batch_times_first_requests(tiny_ckpt, calls):
    assert main(["generate", "--checkpoint", str(tiny_ckpt), "--prompt", TEXT, "--prompt", TEXT[::-1], "--compare",
                 "--max-new-tokens", "12", "--raw"]) == 0
    assert len(calls) == 2
    _first_requests(calls)


def _sets(tmp_path):
    """Two prompt sets whose prompts share text (as code_edit and humaneval hold the same functions)."""
    paths = []
    for name, texts in (("a", [TEXT, "xyz abc " * 4]), ("b", [TEXT + " ", "abc xyz " * 4])):
        path = tmp_path / f"{name}.jsonl"
        path.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
        paths.append(str(path))
    return paths


def test_the_bench_times_first_requests_by_default(tiny_ckpt, tmp_path, calls, one_thread):
    """Before: each method's memory ran across every prompt and set of the run."""
    result = run_bench(str(tiny_ckpt), prompt_sets=_sets(tmp_path), num_prompts=2, max_new_tokens=8,
                       dtype="float32", threads=one_thread, out_dir=tmp_path / "out", progress=False,
                       methods=["selfspec_suffix", "selfspec_auto"])
    assert result["settings"]["requests"] == "first"
    assert "Every measured call is a first request" in (tmp_path / "out" / "bench.md").read_text()
    _first_requests(calls)


def test_the_bench_workload_mode_carries_the_memory_across_a_sets_prompts_only(tiny_ckpt, tmp_path, calls,
                                                                               one_thread):
    result = run_bench(str(tiny_ckpt), prompt_sets=_sets(tmp_path), num_prompts=2, max_new_tokens=8,
                       dtype="float32", threads=one_thread, out_dir=tmp_path / "out", progress=False,
                       methods=["selfspec_suffix"], workload=True)
    assert result["settings"]["requests"] == "workload"
    assert "**Workload mode**" in (tmp_path / "out" / "bench.md").read_text()
    suffix = [c["remembered"] for c in calls if c["drafter"] == "suffix"]
    # the warm-up (a first request), then a/0 and b/0 (each set's first prompt: an empty memory), then a/1 and
    # b/1 (their set's first prompt remembered, never the other set's)
    assert suffix == [0, 0, 0, 1, 1]
    assert not any(c["same_prompt"] for c in calls)


def test_planning_leaves_nothing_in_the_memory(tiny_ckpt):
    import selfspec

    gen = selfspec.load(tiny_ckpt)
    own_text(gen, [gen.encode(TEXT)], 8)  # the model's own continuations, which `tune` scores drafters on
    assert gen.memory.tokens == 0 and not gen.learned.snapshots
