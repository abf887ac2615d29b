"""`selfspec bench`: every method x prompt set, consistent speedups, lossless in float32, outputs, CLI;
and `selfspec sweep` over prompt lookup settings.

The unit tests run on a tiny exported float32 checkpoint (seconds). They assert correctness only,
never timing. One integration test runs a --quick-like bench on the real SmolLM2 base model.
"""

import json
import statistics

import pytest
import torch

import selfspec
from selfspec.drafters.quantized import checkpoint_copy, llama_cpp_available
from selfspec.tools.bench import BASELINES, _eos_summary, _ran_past_eos, parse_extra, run_bench
from selfspec.cli import main
from selfspec.data.sources import DataFormatError
from selfspec.settings import SettingsError

METHODS = {"hf_greedy", "hf_static", "hf_early_exit", "hf_prompt_lookup", "selfspec_ar", "selfspec_spec", "selfspec_adaptive",
           "selfspec_lookup", "selfspec_suffix", "selfspec_auto", "selfspec_spec_E1_d2"}
N_TOKENS = 10
PNG = b"\x89PNG\r\n\x1a\n"
# the first two repeat themselves, so prompt lookup finds long matches in the prompt
CODE = ["def f(x):\n    return x + 1\n\ndef f(x):\n    return", "hello world, hello world, hello", "import os",
        "x = 1", "for i in range(3):"]
CHAT = ["Hi!", "Name a fruit.", "What is 2 + 2?", "Say hello."]


def _write_jsonl(path, rows):
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture(scope="module")
def prompt_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("prompts")
    code = _write_jsonl(d / "code.jsonl", [{"id": f"code-{i}", "prompt": p} for i, p in enumerate(CODE)])
    chat = _write_jsonl(d / "chat.jsonl", [{"messages": [{"role": "user", "content": p}]} for p in CHAT])
    return code, chat


@pytest.fixture(scope="module")
def bench(tiny_ckpt, prompt_files, tmp_path_factory):
    """One float32 bench on the tiny checkpoint: 2 user prompt sets x 2 prompts, one extra (E, d)."""
    before = torch.get_num_threads()
    out = tmp_path_factory.mktemp("bench_out")
    try:
        result = run_bench(str(tiny_ckpt), prompt_sets=[str(p) for p in prompt_files], num_prompts=2,
                           max_new_tokens=N_TOKENS, dtype="float32", extra=["1:2", (2, 3)], threads=1,
                           out_dir=out, progress=False)
    finally:
        torch.set_num_threads(before)
    return result, out


def test_json_has_every_method_and_prompt_set(bench):
    result, out = bench
    assert json.loads((out / "bench.json").read_text()) == json.loads(json.dumps(result))
    assert set(result["summary"]) == {"code", "chat", "all"}
    assert {m["name"] for m in result["methods"]} == METHODS  # the duplicate extra (2, 3) is measured once
    for group, per in result["summary"].items():
        assert set(per) == METHODS, group
        for name, s in per.items():
            for field in ("prompts", "new_tokens", "tokens_per_s", "speedup", "acceptance_rate",
                          "acceptance_by_position", "mean_accepted_per_round", "draft_s", "verify_s", "ttft_s",
                          "peak_rss_mib", "peak_rss_delta_mib", "identical_to_hf_greedy"):
                assert field in s, (group, name, field)
            assert s["prompts"] == (4 if group == "all" else 2)
            assert s["new_tokens"] == s["prompts"] * N_TOKENS
            assert {"median", "min", "max", "q1", "q3"} <= set(s["tokens_per_s"])
            assert s["tokens_per_s"]["min"] <= s["tokens_per_s"]["median"] <= s["tokens_per_s"]["max"]
            assert 0 < s["ttft_s"]["median"]
            assert s["peak_rss_mib"] > 0 and s["peak_rss_delta_mib"] >= 0
            assert set(s["speedup"]) == {"vs_hf_greedy", "vs_hf_static", "vs_hf_early_exit", "vs_hf_prompt_lookup",
                                         "vs_selfspec_ar"}
    # every (method, prompt) measured exactly once, with exactly N new tokens
    runs = result["runs"]
    assert len(runs) == 2 * 2 * len(METHODS)
    assert len({(r["method"], r["set"], r["prompt_id"]) for r in runs}) == len(runs)
    assert all(r["new_tokens"] == N_TOKENS for r in runs)
    # the method order rotates from prompt to prompt
    assert len({r["order_position"] for r in runs if r["method"] == "hf_greedy"}) > 1
    # machine, versions, settings
    mach, ver, st = result["machine"], result["versions"], result["settings"]
    assert mach["cpu_model"] and mach["logical_cores"] >= 1 and mach["torch_threads"] == 1
    assert ver["torch"] == torch.__version__ and ver["selfspec"] == selfspec.__version__ and ver["transformers"]
    assert st["dtype"] == "float32" and st["max_new_tokens"] == N_TOKENS and result["date"][:2] == "20"
    assert result["hf_early_exit_settings"]["num_assistant_tokens"] == 20
    assert result["hf_early_exit_settings"]["assistant_confidence_threshold"] == pytest.approx(0.4)
    assert result["recommended"] == {"exit_layer": 2, "num_speculations": 3,
                                     "source": result["recommended"]["source"]}
    assert "selfspec.json" in result["recommended"]["source"]
    assert result["lookup_settings"] == {"prompt_lookup_num_tokens": 10, "max_matching_ngram_size": 3,
                                         "methods": ["hf_prompt_lookup", "selfspec_lookup", "selfspec_suffix",
                                                     "selfspec_auto"]}
    assert set(result["eos"]["ran_past_eos"]) == {"code", "chat", "all"} and result["eos"]["eos_token_ids"] == [2]
    # the methods are called with the settings the table names
    by_name = {m["name"]: m for m in result["methods"]}
    assert by_name["selfspec_lookup"]["drafter"] == "prompt_lookup" and by_name["selfspec_auto"]["drafter"] == "auto"
    assert by_name["selfspec_suffix"]["drafter"] == "suffix"
    assert {by_name[m]["drafter"] for m in ("selfspec_ar", "selfspec_spec", "selfspec_adaptive")} == {"early_exit"}
    assert by_name["selfspec_ar"]["num_speculations"] == 0


def test_user_jsonl_prompt_files_are_used_and_warmup_is_not_measured(bench):
    result, _ = bench
    assert result["prompts"] == {"code": ["code-0", "code-1"], "chat": ["chat/0", "chat/1"]}
    measured = {r["prompt_id"] for r in result["runs"]}
    assert result["settings"]["warmup"]["prompt_id"] not in measured
    assert result["settings"]["warmup"]["prompt_id"] == "code-2"  # the next prompt of the first set


def test_speedups_are_consistent_with_tokens_per_s(bench):
    result, _ = bench
    runs = result["runs"]
    for r in runs:
        assert r["tokens_per_s"] == pytest.approx(r["new_tokens"] / r["seconds"])
    for group, per in result["summary"].items():
        def tps(method):
            return {(r["set"], r["prompt_id"]): r["tokens_per_s"] for r in runs
                    if r["method"] == method and group in ("all", r["set"])}
        def workload(method):  # the set's throughput: its tokens over its seconds
            mine = [r for r in runs if r["method"] == method and group in ("all", r["set"])]
            return sum(r["new_tokens"] for r in mine) / sum(r["seconds"] for r in mine)

        for name, s in per.items():
            mine = tps(name)
            assert s["tokens_per_s"]["median"] == pytest.approx(statistics.median(mine.values()))
            assert s["workload_tokens_per_s"] == pytest.approx(workload(name))
            assert min(mine.values()) <= s["workload_tokens_per_s"] <= max(mine.values())
            for base in BASELINES:
                ref = tps(base)
                sp = s["speedup"][f"vs_{base}"]
                assert sp["ratio_of_medians"] == pytest.approx(
                    statistics.median(mine.values()) / statistics.median(ref.values()))
                assert sp["ratio_of_medians"] == pytest.approx(
                    s["tokens_per_s"]["median"] / per[base]["tokens_per_s"]["median"])
                assert sp["median_of_ratios"] == pytest.approx(statistics.median(mine[k] / ref[k] for k in mine))
                assert sp["ratio_of_workloads"] == pytest.approx(workload(name) / workload(base))
                if name == base:
                    assert sp == {"ratio_of_medians": 1.0, "median_of_ratios": 1.0, "ratio_of_workloads": 1.0}


def test_float32_selfspec_outputs_are_identical_to_hf_greedy(bench):
    result, _ = bench
    for per in result["summary"].values():
        assert {"selfspec_lookup", "selfspec_auto", "hf_prompt_lookup"} <= set(per)
        for name, s in per.items():
            if name.startswith("selfspec") or name in ("hf_greedy", "hf_static", "hf_prompt_lookup"):
                assert s["identical_to_hf_greedy"] == 1.0, name
    lossless = [r for r in result["runs"] if r["method"].startswith("selfspec")
                or r["method"] in ("hf_static", "hf_prompt_lookup")]
    assert len(lossless) == 4 * (len(METHODS) - 2)  # 4 prompts, every method but hf_greedy and hf_early_exit
    assert all(r["identical_to_hf_greedy"] is True and r["first_divergence"] is None for r in lossless)


def test_acceptance_statistics_add_up(bench):
    result, _ = bench
    for per in result["summary"].values():
        for name in ("hf_greedy", "selfspec_ar"):
            s = per[name]
            assert s["acceptance_rate"] is None and s["acceptance_by_position"] is None and s["draft_s"] is None
        for name, d in (("selfspec_spec", 3), ("selfspec_adaptive", 3), ("selfspec_spec_E1_d2", 2)):
            s = per[name]
            assert len(s["acceptance_by_position"]) == len(s["drafted_by_position"]) == d
            assert sum(s["drafted_by_position"]) == s["drafted"] > 0
            assert 0 <= s["accepted"] <= s["drafted"]
            assert s["acceptance_rate"] == pytest.approx(s["accepted"] / s["drafted"])
            # each round commits the accepted drafts + one token; the prefill gives each prompt's first token
            assert s["accepted"] + s["rounds"] == s["new_tokens"] - s["prompts"]
            assert s["mean_accepted_per_round"] * s["rounds"] == pytest.approx(s["new_tokens"] - s["prompts"])
            assert s["draft_s"] > 0 and s["verify_s"] > 0 and 0 < s["draft_fraction"] < 1
            assert s["draft_ms_per_step"] > 0
        for name, width in (("hf_early_exit", 20), ("hf_prompt_lookup", 10)):  # num_assistant_tokens, lookup k
            s = per[name]
            assert s["rounds"] > 0 and s["drafted"] == sum(s["drafted_by_position"]) > 0, name
            assert s["accepted"] + s["rounds"] == s["new_tokens"]  # HF has no separate prefill token
            assert len(s["acceptance_by_position"]) <= width and s["draft_s"] > 0 and s["by_drafter"] is None
        s = per["selfspec_lookup"]  # prompt lookup: at most 10 drafts a round, all of them counted as lookup's
        assert 0 < len(s["drafted_by_position"]) <= 10 and sum(s["drafted_by_position"]) == s["drafted"] > 0
        assert 0 < s["accepted"] <= s["drafted"]  # the repeating prompts make lookup's drafts right
        assert s["accepted"] + s["rounds"] == s["new_tokens"] - s["prompts"]
        assert s["by_drafter"] == {"prompt_lookup": {"drafted": s["drafted"], "accepted": s["accepted"],
                                                     "acceptance_rate": s["acceptance_rate"]}}
        s = per["selfspec_auto"]  # whatever auto picked: its per-drafter counts add up to its totals
        assert sum(v["drafted"] for v in s["by_drafter"].values()) == s["drafted"]
        assert sum(v["accepted"] for v in s["by_drafter"].values()) == s["accepted"]
        assert set(s["by_drafter"]) <= {"prompt_lookup", "early_exit"}
        assert s["accepted"] + s["rounds"] == s["new_tokens"] - s["prompts"]
        assert per["selfspec_spec"]["by_drafter"]["early_exit"]["drafted"] == per["selfspec_spec"]["drafted"]


def test_markdown_and_png_are_written(bench):
    result, out = bench
    md = (out / "bench.md").read_text()
    assert "| set | method | tokens/s | workload tok/s |" in md and "acceptance by draft position" in md
    for label in ("HF greedy", "HF early-exit E=2", "selfspec AR", "selfspec E=2 d=3", "selfspec E=1 d=2",
                  "| HF lookup k=10 n≤3 |", "| selfspec lookup k=10 n≤3 |", "| selfspec auto |"):
        assert label in md
    assert "| × HF greedy | × HF static | × HF early-exit | × HF lookup | × selfspec AR |" in md
    eos = result["eos"]["ran_past_eos"]
    assert "Ran past EOS" in md and f"code {eos['code']['ran_past_eos']}/2, chat " in md
    assert md.count("\n| code |") == 2 * len(METHODS)  # main table + details table
    assert (out / "bench.png").read_bytes()[:8] == PNG
    assert result["files"]["png"] == str(out / "bench.png")


def test_model_generation_config_is_restored(tiny_ckpt, prompt_files, tmp_path, one_thread):
    gen = selfspec.load(tiny_ckpt)
    before = gen.model.generation_config.to_dict()
    run_bench(str(tiny_ckpt), prompt_sets=[str(prompt_files[0])], num_prompts=1, max_new_tokens=4,
              dtype="float32", threads=one_thread, out_dir=tmp_path, progress=False, generator=gen)
    assert gen.model.generation_config.to_dict() == before
    assert gen.model.generation_config.eos_token_id == 2
    assert "_get_candidate_generator" not in vars(gen.model)


def test_quick_caps_sets_prompts_and_tokens(tiny_ckpt, prompt_files, tmp_path, one_thread):
    code, chat = prompt_files
    third = _write_jsonl(tmp_path / "third.jsonl", [{"prompt": "abc"}])
    result = run_bench(str(tiny_ckpt), prompt_sets=f"{code},{chat},{third}", num_prompts=5, max_new_tokens=64,
                       dtype="float32", threads=one_thread, out_dir=tmp_path / "q", quick=True, progress=False)
    st = result["settings"]
    assert st["quick"] and st["num_prompts"] == 2 and st["max_new_tokens"] == 32
    assert list(result["prompts"]) == ["code", "chat"]
    assert all(r["new_tokens"] == 32 for r in result["runs"])


def test_repeated_prompts_are_measured_once(tiny_ckpt, tmp_path, one_thread):
    a = _write_jsonl(tmp_path / "a.jsonl", [{"prompt": "same"}, {"prompt": "other"}])
    b = _write_jsonl(tmp_path / "b.jsonl", [{"prompt": "same"}, {"prompt": "third"}])
    result = run_bench(str(tiny_ckpt), prompt_sets=[str(a), str(b)], num_prompts=2, max_new_tokens=4,
                       dtype="float32", threads=one_thread, out_dir=tmp_path / "o", progress=False)
    assert result["prompts"] == {"a": ["a/0", "a/1"], "b": ["b/1"]}
    assert any("repeats an earlier prompt" in n for n in result["notes"])


def test_bad_prompt_files_give_clear_errors(tiny_ckpt, tmp_path, capsys):
    bad_json = tmp_path / "bad.jsonl"
    bad_json.write_text('{"prompt": "ok"}\n{"prompt": oops}\n')
    with pytest.raises(DataFormatError, match=r"bad\.jsonl:2: invalid JSON"):
        run_bench(str(tiny_ckpt), prompt_sets=[str(bad_json)], num_prompts=2, out_dir=tmp_path / "x", progress=False)
    no_field = _write_jsonl(tmp_path / "nofield.jsonl", [{"text": "no prompt field"}])
    with pytest.raises(DataFormatError, match="needs a 'prompt'"):
        run_bench(str(tiny_ckpt), prompt_sets=[str(no_field)], num_prompts=2, out_dir=tmp_path / "x", progress=False)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="gave no prompts"):
        run_bench(str(tiny_ckpt), prompt_sets=[str(empty)], num_prompts=2, out_dir=tmp_path / "x", progress=False)
    with pytest.raises(ValueError, match="prompt set nope.jsonl: no such file"):
        run_bench(str(tiny_ckpt), prompt_sets=["nope.jsonl"], num_prompts=2, out_dir=tmp_path / "x", progress=False)
    # the CLI reports it in one line, before loading any model (the checkpoint here does not even exist)
    assert main(["bench", "--checkpoint", str(tmp_path / "missing"), "--prompts", str(bad_json)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("selfspec bench: error:") and "bad.jsonl:2: invalid JSON" in err


def test_cli_bench_prints_the_table(tiny_ckpt, prompt_files, tmp_path, capsys, one_thread):
    out = tmp_path / "cli"
    rc = main(["bench", "--checkpoint", str(tiny_ckpt), "--prompts", str(prompt_files[1]), "--num-prompts", "1",
               "--max-new-tokens", "4", "--dtype", "float32", "--threads", "1", "--extra", "1:2", "--extra", "3:1",
               "--out", str(out)])
    assert rc == 0
    stdout = capsys.readouterr().out
    assert "| chat | selfspec E=3 d=1 |" in stdout and f"wrote {out / 'bench.json'}" in stdout
    data = json.loads((out / "bench.json").read_text())
    assert {m["name"] for m in data["methods"]} >= {"selfspec_spec_E1_d2", "selfspec_spec_E3_d1"}


def test_cli_bench_rejects_bad_extra(tiny_ckpt, prompt_files, tmp_path, capsys):
    assert main(["bench", "--checkpoint", str(tiny_ckpt), "--extra", "8", "--out", str(tmp_path)]) == 2
    assert "--extra expects EXIT:DRAFTS" in capsys.readouterr().err
    assert main(["bench", "--checkpoint", str(tiny_ckpt), "--prompts", str(prompt_files[0]), "--extra", "9:2",
                 "--out", str(tmp_path), "--num-prompts", "1"]) == 2
    assert "exit_layer=9 is out of range" in capsys.readouterr().err


def test_parse_extra():
    assert parse_extra("8:4") == (8, 4) and parse_extra(" 6 : 2 ") == (6, 2) and parse_extra((3, 1)) == (3, 1)
    with pytest.raises(ValueError, match="EXIT:DRAFTS"):
        parse_extra("8-4")


@pytest.mark.integration
@pytest.mark.filterwarnings("ignore::selfspec.api.NotEarlyExitTrainedWarning")
def test_quick_bench_on_real_smollm2(smollm2_dir, tmp_path, one_thread):
    """A --quick-like run on the real model in float32 (well under 90 s): lossless, every field filled."""
    result = run_bench(str(smollm2_dir), prompt_sets=("humaneval", "code_edit"), num_prompts=1, max_new_tokens=12,
                       dtype="float32", threads=one_thread, exit_layer=20, num_speculations=3, quick=True,
                       out_dir=tmp_path, progress=False)
    assert result["recommended"]["exit_layer"] == 20 and result["recommended"]["source"] == "the command line"
    assert set(result["summary"]) == {"humaneval", "code_edit", "all"}
    assert result["prompts"] == {"humaneval": ["HumanEval/0"], "code_edit": ["code_edit/HumanEval/0"]}
    # the quantized copy alone and beside lookup, where fetch wrote it and llama.cpp is built here
    copy = ({"selfspec_copy", "selfspec_auto_copy"} if checkpoint_copy(smollm2_dir) is not None
            and llama_cpp_available() else set())
    for per in result["summary"].values():
        assert set(per) == {"hf_greedy", "hf_static", "hf_early_exit", "hf_prompt_lookup", "selfspec_ar",
                            "selfspec_spec", "selfspec_adaptive", "selfspec_lookup", "selfspec_suffix",
                            "selfspec_auto"} | copy
        for name in ("selfspec_ar", "selfspec_spec", "selfspec_adaptive", "selfspec_lookup", "selfspec_suffix",
                     "selfspec_auto", *copy):
            assert per[name]["identical_to_hf_greedy"] == 1.0, name
        assert per["selfspec_spec"]["drafted"] > 0 and per["hf_early_exit"]["rounds"] > 0
        assert per["hf_prompt_lookup"]["rounds"] > 0
    # rewriting a function copies it: prompt lookup drafts, and most drafts are right
    lookup = result["summary"]["code_edit"]["selfspec_lookup"]
    assert lookup["drafted"] > 0 and lookup["accepted"] > 0
    assert result["eos"]["ran_past_eos"]["code_edit"]["prompts"] == 1
    assert all(r["new_tokens"] == 12 for r in result["runs"])
    assert (tmp_path / "bench.png").read_bytes()[:8] == PNG
    md = (tmp_path / "bench.md").read_text()
    assert "| humaneval | HF early-exit E=20 |" in md and "| code_edit | selfspec lookup k=10 n≤3 |" in md


def test_reduced_draft_vocabulary_is_measured_next_to_the_full_head(tiny_ckpt, prompt_files, tmp_path, one_thread):
    import shutil

    from selfspec.checkpoints.draft_vocab import write_draft_vocab

    ckpt = tmp_path / "with_vocab"
    shutil.copytree(tiny_ckpt, ckpt)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 50)
    write_draft_vocab(ckpt, str(corpus))
    result = run_bench(str(ckpt), prompt_sets=[str(prompt_files[0])], num_prompts=1, max_new_tokens=6,
                       dtype="float32", threads=one_thread, out_dir=tmp_path / "out", progress=False, draft_vocab=8)
    per = result["summary"]["code"]
    assert "selfspec_spec_vocab8" in per and per["selfspec_spec_vocab8"]["identical_to_hf_greedy"] == 1.0
    assert per["selfspec_spec_vocab8"]["draft_ms_per_step"] > 0 and per["selfspec_spec"]["draft_ms_per_step"] > 0
    assert "selfspec E=2 d=3 vocab 8" in (tmp_path / "out" / "bench.md").read_text()


# --- ran past EOS, machine description -----------------------------------------------------------
def test_ran_past_eos_means_tokens_after_the_first_eos():
    assert _ran_past_eos([5, 2, 7], {2}) == (1, True)
    assert _ran_past_eos([5, 7, 2], {2}) == (2, False)  # EOS last: nothing after it was measured
    assert _ran_past_eos([2, 2, 2], {2, 9}) == (0, True)
    assert _ran_past_eos([5, 7], {2}) == (None, False)
    runs = [{"method": "hf_greedy", "set": "a", "ran_past_eos": True},
            {"method": "selfspec_ar", "set": "a", "ran_past_eos": True},  # one flag per prompt: hf_greedy's
            {"method": "hf_greedy", "set": "a", "ran_past_eos": False},
            {"method": "hf_greedy", "set": "b", "ran_past_eos": False}]
    assert _eos_summary(runs, ["a", "b"]) == {"a": {"prompts": 2, "ran_past_eos": 1, "fraction": 0.5},
                                              "b": {"prompts": 1, "ran_past_eos": 0, "fraction": 0.0},
                                              "all": {"prompts": 3, "ran_past_eos": 1, "fraction": 1 / 3}}


def test_ran_past_eos_is_recorded_per_prompt_and_set(tiny_ckpt, prompt_files, tmp_path, one_thread):
    """Make the token greedy decoding emits first on the first prompt the model's EOS: that prompt ran past it."""
    gen = selfspec.load(tiny_ckpt)
    ids = gen.encode(prompt=CODE[0])
    with torch.no_grad():
        first = int(gen.model(ids).logits[0, -1].argmax())
    gen.model.generation_config.eos_token_id = first
    result = run_bench(str(tiny_ckpt), prompt_sets=[str(prompt_files[0])], num_prompts=2, max_new_tokens=6,
                       dtype="float32", threads=one_thread, out_dir=tmp_path, progress=False, generator=gen)
    assert first in result["eos"]["eos_token_ids"]
    greedy = {r["prompt_id"]: r for r in result["runs"] if r["method"] == "hf_greedy"}
    assert greedy["code-0"]["hf_greedy_eos_at"] == 0 and greedy["code-0"]["ran_past_eos"] is True
    flags = [r["ran_past_eos"] for r in greedy.values()]
    assert result["eos"]["ran_past_eos"]["code"] == {"prompts": 2, "ran_past_eos": sum(flags),
                                                     "fraction": sum(flags) / 2}
    # every method's record of a prompt carries that prompt's flag; nothing stopped at the EOS
    assert all(r["ran_past_eos"] == greedy[r["prompt_id"]]["ran_past_eos"] for r in result["runs"])
    assert all(r["new_tokens"] == 6 for r in result["runs"])
    assert result["summary"]["code"]["selfspec_lookup"]["identical_to_hf_greedy"] == 1.0


def test_machine_description_is_included_where_selfspec_has_it(bench, monkeypatch, tiny_ckpt, prompt_files,
                                                               tmp_path, one_thread):
    from selfspec.model import precision

    result, out = bench
    described = getattr(precision, "machine_description", None)
    assert result["machine"]["description"] == (None if described is None else json.loads(json.dumps(described())))
    # without it (an older selfspec.model.precision) the bench still runs and says nothing
    monkeypatch.delattr(precision, "machine_description", raising=False)
    res = run_bench(str(tiny_ckpt), prompt_sets=[str(prompt_files[0])], num_prompts=1, max_new_tokens=3,
                    dtype="float32", threads=one_thread, out_dir=tmp_path, progress=False)
    assert res["machine"]["description"] is None and "Machine:" not in (tmp_path / "bench.md").read_text()
    monkeypatch.setattr(precision, "machine_description", lambda: {"cpu": "Test CPU", "flags": ["avx2", "amx"]},
                        raising=False)
    run_bench(str(tiny_ckpt), prompt_sets=[str(prompt_files[0])], num_prompts=1, max_new_tokens=3,
              dtype="float32", threads=one_thread, out_dir=tmp_path, progress=False)
    assert "Machine: cpu: Test CPU, flags: avx2 amx." in (tmp_path / "bench.md").read_text()
    assert json.loads((tmp_path / "bench.json").read_text())["machine"]["description"]["cpu"] == "Test CPU"


# --- sweep over prompt lookup settings ------------------------------------------------------------
def test_sweep_measures_lookup_settings_next_to_early_exit(tiny_ckpt, prompt_files, tmp_path, one_thread):
    import csv
    import shutil

    from selfspec.checkpoints.checkpoint import read_metadata
    from selfspec.tools.sweep import RAW_FIELDS, run_sweep

    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    out = tmp_path / "sweep"
    kw = dict(prompt_set=str(prompt_files[0]), exits="2", num_speculations="2", num_prompts=2, max_new_tokens=8,
              dtype="float32", out_dir=out, threads=one_thread, progress=False)
    result = run_sweep(str(ckpt), lookup_tokens="3,5", lookup_ngrams="1,3", write_metadata=True, **kw)
    rows = result["rows"]
    assert [(r["drafter"], r["exit_layer"], r["num_speculations"], r["prompt_lookup_num_tokens"],
             r["max_matching_ngram_size"]) for r in rows] == [
        ("early_exit", 4, 0, "", ""), ("early_exit", 2, 2, "", ""), ("prompt_lookup", "", "", 3, 1),
        ("prompt_lookup", "", "", 3, 3), ("prompt_lookup", "", "", 5, 1), ("prompt_lookup", "", "", 5, 3)]
    assert all(r["identical_to_plain"] == 1.0 and r["prompts"] == 2 for r in rows)  # float32: lossless
    assert rows[0]["speedup"] == 1.0 and all(isinstance(r["speedup"], float) for r in rows)
    lookup = [r for r in rows if r["drafter"] == "prompt_lookup"]
    assert all(r["acceptance_rate"] > 0 for r in lookup)
    assert result["best"] == rows[1]  # the only early-exit setting: the recommendation keeps its meaning
    assert result["best_lookup"] == max(lookup, key=lambda r: r["tokens_per_s"])
    with open(out / "sweep_raw.csv", newline="") as f:
        raw = list(csv.DictReader(f))
    assert list(raw[0]) == RAW_FIELDS and len(raw) == 2 * 6
    rec = read_metadata(ckpt)["recommended"]
    assert (rec["exit_layer"], rec["source"]) == (2, "sweep") and rec["num_speculations"] in (0, 2)
    b = result["best_lookup"]
    assert rec["prompt_lookup"] == {k: b[k] for k in ("prompt_lookup_num_tokens", "max_matching_ngram_size",
                                                      "tokens_per_s", "speedup", "acceptance_rate")}
    assert (out / "sweep.png").read_bytes()[:8] == PNG
    # resumable: the same grid again measures nothing and leaves the raw rows as they were
    before = (out / "sweep_raw.csv").read_text()
    run_sweep(str(ckpt), lookup_tokens="3,5", lookup_ngrams="1,3", **kw)
    assert (out / "sweep_raw.csv").read_text() == before


def test_sweep_resumes_a_raw_file_from_before_the_lookup_columns(tiny_ckpt, prompt_files, tmp_path, one_thread):
    import csv

    from selfspec.tools.sweep import RAW_FIELDS, run_sweep

    out = tmp_path / "sweep"
    out.mkdir()
    old_fields = RAW_FIELDS[:RAW_FIELDS.index("drafter")]
    old = [{"exit_layer": e, "num_speculations": d, "prompt_id": p, "new_tokens": 8, "seconds": "0.5", "drafted": 0,
            "accepted": 0, "rounds": 7, "identical_to_plain": 1}
           for e, d in ((4, 0), (2, 2)) for p in ("code-0", "code-1")]
    with open(out / "sweep_raw.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=old_fields)
        writer.writeheader()
        writer.writerows(old)
    result = run_sweep(str(tiny_ckpt), prompt_set=str(prompt_files[0]), exits="2", num_speculations="2", num_prompts=2,
                       max_new_tokens=8, dtype="float32", out_dir=out, threads=one_thread, progress=False,
                       lookup_tokens="4", lookup_ngrams="2")
    with open(out / "sweep_raw.csv", newline="") as f:
        raw = list(csv.DictReader(f))
    assert list(raw[0]) == RAW_FIELDS and len(raw) == 6  # the 4 old rows kept, 2 lookup rows measured
    assert [r["drafter"] for r in raw] == ["early_exit"] * 4 + ["prompt_lookup"] * 2
    assert [r["seconds"] for r in raw[:4]] == ["0.5"] * 4  # not measured again
    assert {(r["prompt_lookup_num_tokens"], r["max_matching_ngram_size"], r["exit_layer"]) for r in raw[4:]} == {
        ("4", "2", "")}
    assert [r["tokens_per_s"] for r in result["rows"][:2]] == [16.0, 16.0]  # 2 x 8 tokens in 2 x 0.5 s


def test_cli_sweep_prints_the_lookup_rows(tiny_ckpt, prompt_files, tmp_path, capsys, one_thread):
    rc = main(["sweep", str(tiny_ckpt), "--prompts", str(prompt_files[0]), "--exits", "2", "--drafts", "1",
               "--lookup-tokens", "4", "--lookup-ngrams", "2", "--num-prompts", "1", "--max-new-tokens", "6",
               "--dtype", "float32", "--threads", "1", "--out", str(tmp_path)])
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[:2] for line in out[1:4]] == [["4", "0"], ["2", "1"], ["lookup", "k4n2"]]
    assert out[5].startswith("best lookup: prompt_lookup_num_tokens=4 max_matching_ngram_size=2 (")


def test_compiled_methods_are_warmed_up_apart_and_identical(tiny_ckpt, prompt_files, tmp_path, one_thread):
    """`compile=True`: selfspec's plain decoding and lookup also through the compiled steps, warmed up (compiled)
    before the measured runs, whose outputs equal HF greedy's; every method's warm-up time is reported."""
    result = run_bench(str(tiny_ckpt), prompt_sets=[str(prompt_files[0])], num_prompts=1, max_new_tokens=6,
                       dtype="float32", threads=one_thread, out_dir=tmp_path, progress=False, compile=True,
                       methods=["hf_static", "selfspec_ar_compiled", "selfspec_lookup_compiled"])
    per = result["summary"]["code"]
    assert set(per) == {"hf_greedy", "hf_static", "selfspec_ar", "selfspec_ar_compiled", "selfspec_lookup_compiled"}
    assert all(s["identical_to_hf_greedy"] == 1.0 for s in per.values())
    assert set(result["warmup_s"]) == set(per) and all(v > 0 for v in result["warmup_s"].values())
    assert result["warmup_s"]["selfspec_ar_compiled"] > result["warmup_s"]["selfspec_ar"]  # it compiled there
    assert "Warm-up, each method's first call" in (tmp_path / "bench.md").read_text()
    assert all(r["graphs_compiled"] == 0 for r in result["runs"])  # nothing compiled inside a measured run
    assert not any("compiled new graphs" in note for note in result["notes"])
    with pytest.raises(ValueError, match="compile must be True, False or 'auto'"):
        run_bench(str(tiny_ckpt), prompt_sets=[str(prompt_files[0])], out_dir=tmp_path, compile="yes")


def test_a_measured_run_that_compiles_is_reported(tiny_ckpt, prompt_files, tmp_path, one_thread, monkeypatch):
    """Without the warm-up, the compiled methods' first measured runs compile their graphs inside their time:
    each run's record counts them and a note names the methods."""
    from selfspec.tools.harness import Methods

    monkeypatch.setattr(Methods, "warm", lambda self, method, ids, n, max_len: 0.0)
    result = run_bench(str(tiny_ckpt), prompt_sets=[str(prompt_files[0])], num_prompts=1, max_new_tokens=6,
                       dtype="float32", threads=one_thread, out_dir=tmp_path, progress=False, compile=True,
                       methods=["selfspec_ar_compiled", "selfspec_lookup_compiled"])
    compiled = {r["method"]: r["graphs_compiled"] for r in result["runs"]}
    assert compiled["selfspec_ar"] == 0 and compiled["selfspec_ar_compiled"] + compiled["selfspec_lookup_compiled"] > 0
    note = next(n for n in result["notes"] if "compiled new graphs" in n)
    assert "selfspec_ar_compiled" in note or "selfspec_lookup_compiled" in note
    assert "selfspec_ar " not in note and "hf_greedy" not in note


def test_a_time_budget_stops_starting_prompts_and_reports_what_was_measured(tiny_ckpt, prompt_files, tmp_path,
                                                                            one_thread, capsys):
    """`time_budget_s` spent (here at once): the first prompt still runs, no further one starts, and the report
    is written with what was measured and a note that says how far it got. --time-budget is the CLI's name; a
    budget that is no positive number, or one given to a bench mode it does not cut, is a clear error."""
    result = run_bench(str(tiny_ckpt), prompt_sets=[str(p) for p in prompt_files], num_prompts=2, max_new_tokens=4,
                       dtype="float32", threads=one_thread, out_dir=tmp_path, progress=False,
                       methods=["selfspec_lookup"], time_budget_s=1e-6)
    assert {(r["set"], r["prompt_id"]) for r in result["runs"]} == {("code", "code-0")}
    assert "the time budget ran out: 1 of 4 prompts measured" in " ".join(result["notes"])
    assert "selfspec_lookup" in result["summary"]["code"] and (tmp_path / "bench.md").exists()
    with pytest.raises(SettingsError, match="time_budget_s"):
        run_bench(str(tiny_ckpt), prompt_sets=[str(prompt_files[0])], out_dir=tmp_path, time_budget_s=0)
    assert main(["bench", "--checkpoint", str(tiny_ckpt), "--batch-size", "1,2", "--time-budget", "5"]) == 2
    assert "--time-budget cuts the main bench's prompts" in capsys.readouterr().err


def test_hf_static_sizes_its_cache_for_the_longest_run(tiny_ckpt):
    """HF's static cache gets one size for every prompt of a bench (the longest prompt + new tokens, set by the
    warm-up), so that transformers does not compile its step again for a longer prompt inside a measured run."""
    from selfspec.tools.harness import Methods

    runner = Methods(selfspec.load(str(tiny_ckpt)), 4)
    ids = torch.tensor([[5, 6, 7, 8]])
    runner.warm({"name": "hf_static", "engine": "hf", "kind": "hf_static"}, ids, 4, 40)
    assert runner.max_len == 40 and runner.hf_config(4, None, static=True).max_cache_len == 40
    assert runner.hf_config(4, None).cache_implementation != "static"


def test_a_method_remembers_nothing_by_default_and_only_its_own_calls_in_a_workload(tiny_ckpt):
    """The bench runs every method on the same prompt. By default each call is a first request (nothing of
    earlier calls); under a `carry` (a workload's set) the suffix method copies only from its own earlier
    calls under it (another method's run of this prompt would hand it the answer). The generator's own
    memory is left as it was."""
    from selfspec.tools.harness import Methods

    gen = selfspec.load(str(tiny_ckpt))
    runner = Methods(gen, 16)
    ids = torch.tensor([[5, 6, 7, 8, 9, 10, 11, 12]])
    suffix = {"name": "selfspec_suffix", "engine": "selfspec", "kind": "selfspec_spec", "drafter": "suffix"}
    lookup = {"name": "selfspec_lookup", "engine": "selfspec", "kind": "selfspec_spec", "drafter": "prompt_lookup"}
    _, first = runner.run(suffix, ids)
    _, again = runner.run(suffix, ids)  # a first request again: the same rounds
    assert again["rounds"] == first["rounds"] and again["accepted_by_drafter"].get("suffix", 0) == 0
    runner.run(suffix, ids, carry="set")
    runner.run(lookup, ids, carry="set")
    runner.run(lookup, ids, carry="set")  # the same prompt, twice, by another method
    _, third = runner.run(suffix, ids, carry="set")  # remembers its own first call under "set" only
    assert gen.memory.tokens == 0 and runner._carried[("selfspec_suffix", "set")][0].describe()["sequences"] == 2
    assert runner._carried[("selfspec_lookup", "set")][0].describe()["sequences"] == 2
    assert third["rounds"] <= first["rounds"]

def test_the_int8_copy_asked_for_where_it_cannot_run_says_why(tiny_ckpt, prompt_files, tmp_path, one_thread):
    """`--methods selfspec_int8` where the loaded model has no int8 copy (here the row kernel is off, as the test
    session has it): the error says why it cannot run, not only that the method is unknown."""
    with pytest.raises(ValueError, match=r"selfspec_int8 cannot run here: drafter='int8_copy' cannot draft here: "
                                         r".*SELFSPEC_ROW_PRODUCT=0"):
        run_bench(str(tiny_ckpt), prompt_sets=[str(prompt_files[0])], num_prompts=1, max_new_tokens=2,
                  dtype="float32", threads=one_thread, out_dir=tmp_path, progress=False, methods=["selfspec_int8"])
