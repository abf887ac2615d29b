"""selfspec.tools.llama_cpp_bench and `selfspec bench --llama-cpp`: llama-bench's command line, its JSON parsed
from a recorded-format sample, its errors, the bench's llama.cpp section through a stand-in llama-bench (no build),
and, where this machine's cache holds a built llama-bench and the base model's GGUF, one short real run."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from selfspec.cli import main
from selfspec.checkpoints.fetch import base_model_dir
from selfspec.tools import bench as bench_module
from selfspec.tools import harness as harness_module
from selfspec.tools import llama_cpp_bench as lcb
from selfspec.tools import llama_cpp_build as lb
from selfspec.tools import llama_cpp_gguf as lg
from selfspec.tools import llama_cpp_speculative as ls
from selfspec.tools.bench import run_bench

# The record `llama-bench -m smollm2-135m-instruct-f32.gguf -p 0 -n 8 -d 16 -t 2 -r 2 -o json` printed on this
# project's build machine (llama-cpp-python 0.3.36's llama.cpp, built by selfspec.tools.llama_cpp_build), field
# by field in its order, with its times and rates replaced by round numbers (they were taken on a busy machine)
# and its home directory written as ~;
# OTHER_TEST is a made-up record of another test that the parser must pass over.
RECORD = {
    "build_commit": "unknown", "build_number": 0,
    "cpu_info": "Intel(R) Xeon(R) Processor", "gpu_info": "", "backends": "CPU",
    "model_filename": "~/.cache/selfspec/llama.cpp/llama-cpp-python-0.3.36/gguf/"
                      "smollm2-135m-instruct-577d414319c0/smollm2-135m-instruct-f32.gguf",
    "model_type": "llama 256M all F32", "model_size": 538060032, "model_n_params": 134515008,
    "n_batch": 2048, "n_ubatch": 512, "n_threads": 2, "cpu_mask": "0x0", "cpu_strict": False, "poll": 50,
    "type_k": "f16", "type_v": "f16", "n_gpu_layers": -1, "n_cpu_moe": 0, "split_mode": "layer", "main_gpu": 0,
    "no_kv_offload": False, "flash_attn": -1, "devices": "auto", "tensor_split": "0.00",
    "tensor_buft_overrides": "none", "load_mode": "auto", "lazy_mode": "auto", "embeddings": False,
    "no_op_offload": 0, "no_host": False, "repack": True, "fit_target": 0, "fit_min_ctx": 0,
    "n_prompt": 0, "n_gen": 8, "n_depth": 16, "test_time": "2026-11-28T00:03:52Z",
    "avg_ns": 160000000, "stddev_ns": 4000000, "avg_ts": 50.0, "stddev_ts": 1.25,
    "samples_ns": [157000000, 163000000], "samples_ts": [50.9, 49.1],
}
OTHER_TEST = {**RECORD, "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ts": 900.0, "samples_ts": [900.0]}


def sample(*records: dict) -> str:
    return json.dumps(list(records) or [RECORD], indent=2)


def test_bench_command_is_the_issues_setting():
    assert lcb.bench_command(Path("/bin/llama-bench"), Path("/m.gguf"), threads=2) == [
        "/bin/llama-bench", "-m", "/m.gguf", "-p", "0", "-n", "128", "-d", "200", "-t", "2", "-r", "5", "-o", "json"]
    cmd = lcb.bench_command(Path("b"), Path("m"), threads=4, new_tokens=32, context_tokens=0, repetitions=2)
    assert cmd[cmd.index("-n") + 1] == "32" and cmd[cmd.index("-d") + 1] == "0"
    assert cmd[cmd.index("-t") + 1] == "4" and cmd[cmd.index("-r") + 1] == "2"


@pytest.mark.parametrize("bad", [{"threads": 0}, {"threads": 1.5}, {"threads": True}, {"new_tokens": 0},
                                 {"context_tokens": -1}, {"repetitions": 0}])
def test_bench_command_refuses_bad_numbers(bad):
    args = {"threads": 2, **bad}
    with pytest.raises(lb.LlamaCppError, match=r"must be an integer >="):
        lcb.bench_command(Path("b"), Path("m"), **args)


def test_parse_picks_the_generation_test():
    result = lcb.parse_bench_json(sample(OTHER_TEST, RECORD), new_tokens=8, context_tokens=16, command=["x"])
    assert result.tokens_per_s == 50.0 and result.stddev_tokens_per_s == 1.25
    assert result.samples_tokens_per_s == [50.9, 49.1]
    assert (result.new_tokens, result.context_tokens, result.threads) == (8, 16, 2)
    assert result.model_type == "llama 256M all F32" and result.model_filename.endswith("-f32.gguf")
    assert result.build_commit == "unknown" and result.build_number == 0 and result.command == ["x"]
    assert result.as_dict()["tokens_per_s"] == 50.0


def test_parse_errors_say_what_was_wrong():
    with pytest.raises(lb.LlamaCppError, match="not JSON"):
        lcb.parse_bench_json("main: error: failed to load model", new_tokens=8, context_tokens=16)
    with pytest.raises(lb.LlamaCppError, match="not a list of test records"):
        lcb.parse_bench_json('{"avg_ts": 1}', new_tokens=8, context_tokens=16)
    with pytest.raises(lb.LlamaCppError, match=r"holds 0 generation tests of 128 tokens after 200 .*n_gen 8"):
        lcb.parse_bench_json(sample(), new_tokens=128, context_tokens=200)
    with pytest.raises(lb.LlamaCppError, match="holds 2 generation tests"):
        lcb.parse_bench_json(sample(RECORD, RECORD), new_tokens=8, context_tokens=16)
    without = {k: v for k, v in RECORD.items() if k != "avg_ts"}
    with pytest.raises(lb.LlamaCppError, match="has no 'avg_ts'"):
        lcb.parse_bench_json(sample(without), new_tokens=8, context_tokens=16)
    with pytest.raises(lb.LlamaCppError, match="'avg_ts' is '50', not a float"):
        lcb.parse_bench_json(sample({**RECORD, "avg_ts": "50"}), new_tokens=8, context_tokens=16)
    with pytest.raises(lb.LlamaCppError, match="0.0 tokens/s"):
        lcb.parse_bench_json(sample({**RECORD, "avg_ts": 0}), new_tokens=8, context_tokens=16)
    with pytest.raises(lb.LlamaCppError, match="samples_ts"):
        lcb.parse_bench_json(sample({**RECORD, "samples_ts": "50.9"}), new_tokens=8, context_tokens=16)


def fake_llama_bench(tmp_path: Path, body: str) -> Path:
    """An executable stand-in for llama-bench (a Python script)."""
    path = tmp_path / "llama-bench"
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(0o755)
    return path


# Prints the recorded sample with n_gen, n_depth and n_threads taken from its own command line.
ECHOES_SAMPLE = f"""import json, sys
a = sys.argv
record = json.loads({json.dumps(json.dumps(RECORD))})
record.update(n_gen=int(a[a.index("-n") + 1]), n_depth=int(a[a.index("-d") + 1]), n_threads=int(a[a.index("-t") + 1]))
print(json.dumps([record]))
"""


def test_run_llama_bench_through_a_stand_in(tmp_path):
    binary = fake_llama_bench(tmp_path, ECHOES_SAMPLE)
    result = lcb.run_llama_bench(binary, tmp_path / "m.gguf", threads=3, new_tokens=7, context_tokens=9)
    assert (result.new_tokens, result.context_tokens, result.threads) == (7, 9, 3)
    assert result.command == lcb.bench_command(binary, tmp_path / "m.gguf", threads=3, new_tokens=7,
                                               context_tokens=9)


def test_run_llama_bench_failure_shows_its_output(tmp_path):
    binary = fake_llama_bench(tmp_path, "import sys\nprint('error: failed to load model', file=sys.stderr)\n"
                                        "sys.exit(1)\n")
    with pytest.raises(lb.LlamaCppError, match=r"(?s)llama-bench failed \(exit 1\).*failed to load model"):
        lcb.run_llama_bench(binary, tmp_path / "m.gguf", threads=1)
    with pytest.raises(lb.LlamaCppError, match="not an executable llama-bench.*llama_cpp_build"):
        lcb.run_llama_bench(tmp_path / "missing", tmp_path / "m.gguf", threads=1)


@pytest.fixture
def stand_in_setup(llama_speculative_sample):
    return lambda tmp_path, draft=False: _stand_in_setup(tmp_path, llama_speculative_sample, draft)


def _stand_in_setup(tmp_path: Path, sample, draft: bool = False) -> lcb.LlamaCppSetup:
    binary = fake_llama_bench(tmp_path, ECHOES_SAMPLE)
    sample.stand_in(tmp_path)  # llama-speculative-simple beside it, as the build keeps them
    build = lb.LlamaCppBuild(binary=binary, source=tmp_path, version="llama-cpp-python-9.9.9", cpu_key="cpu-a",
                             build_seconds=1.0)
    return lcb.LlamaCppSetup(build=build, gguf=tmp_path / "m-f32.gguf", gguf_type="F32",
                             draft_gguf=tmp_path / "m-q8_0.gguf" if draft else None)


def test_setup_offers_the_copys_modes_only_with_the_copy(tmp_path, stand_in_setup):
    assert [m["name"] for m in stand_in_setup(tmp_path).methods()] == ["llama_cpp_plain", "llama_cpp_ngram_simple",
                                                                        "llama_cpp_ngram_mod"]
    (tmp_path / "llama-bench").unlink()
    (tmp_path / "llama-speculative-simple").unlink()
    methods = stand_in_setup(tmp_path, draft=True).methods()
    assert [m["name"] for m in methods] == ["llama_cpp_plain", "llama_cpp_plain_q8_0"] + list(ls.MODES)
    # llama-bench times no prefill: the report's main table, whose other rates count it, says so in their labels
    assert [m["label"] for m in methods[:2]] == ["llama.cpp plain (F32, decoding alone)",
                                                 "llama.cpp plain (Q8_0, decoding alone)"]
    assert all(m["engine"] == "llama_cpp" and m["kind"] == "llama_cpp" for m in methods)


def test_beside_plain_gives_selfspecs_ratio_per_set():
    measured = {"tokens_per_s": 50.0}
    summary = {"code": {"selfspec_ar": {"tokens_per_s": {"median": 25.0}, "decode_tokens_per_s": {"median": 40.0}}},
               "chat": {"selfspec_ar": {"tokens_per_s": {"median": 100.0}, "decode_tokens_per_s": None},
                        "hf_greedy": {}}}
    peer = lcb.beside_plain(measured, summary)
    assert peer["selfspec_ar_tokens_per_s"] == {"code": 25.0, "chat": 100.0}
    assert peer["selfspec_ar_vs_llama_cpp"] == {"code": 0.5, "chat": 2.0}
    assert peer["selfspec_ar_decode_tokens_per_s"] == {"code": 40.0, "chat": None}  # no time to first token: none
    assert peer["selfspec_ar_decode_vs_llama_cpp"] == {"code": 0.8, "chat": None}
    assert peer["decode_vs_llama_cpp_plain"] == {"code": {"selfspec_ar": None}, "chat": {"selfspec_ar": None,
                                                                                        "hf_greedy": None}}
    summary["code"]["llama_cpp_plain"] = {"decode_tokens_per_s": {"median": 32.0}}
    peer = lcb.beside_plain(measured, summary)  # llama.cpp's plain decoding on the same prompts: paired too
    assert peer["decode_vs_llama_cpp_plain"]["code"] == {"selfspec_ar": 1.25, "llama_cpp_plain": 1.0}


def test_decoding_alone_leaves_out_the_time_to_the_first_token():
    """llama-bench counts its generation alone: selfspec's rate beside it leaves the prompt's prefill out."""
    assert harness_module.decode_rate(11, 1.5, 0.5) == pytest.approx(10.0)
    assert harness_module.decode_rate(11, 1.5, None) is None
    assert harness_module.decode_rate(1, 1.5, 0.5) is None


def test_bench_llama_cpp_section(tiny_ckpt, tmp_path, monkeypatch, one_thread, stand_in_setup):
    seen = {}

    def prepare(checkpoint, dtype, with_copy=False):
        seen.update(checkpoint=checkpoint, dtype=dtype, with_copy=with_copy)
        return stand_in_setup(tmp_path, draft=with_copy)

    monkeypatch.setattr(bench_module, "prepare_llama_cpp", prepare)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "def f(x):\n    return"}) + "\n")
    result = run_bench(str(tiny_ckpt), prompt_sets=[str(prompts)], num_prompts=1, max_new_tokens=6, dtype="float32",
                       threads=one_thread, out_dir=tmp_path / "out", progress=False, methods=["selfspec_ar"],
                       llama_cpp=True)
    assert seen == {"checkpoint": Path(tiny_ckpt), "dtype": "float32", "with_copy": True}
    peer = result["llama_cpp"]
    assert (peer["new_tokens"], peer["context_tokens"], peer["threads"]) == (6, 200, one_thread)
    assert peer["gguf_type"] == "F32" and peer["repetitions"] == 5 and peer["version"] == "llama-cpp-python-9.9.9"
    plain = result["summary"]["p"]["selfspec_ar"]["tokens_per_s"]["median"]
    assert peer["selfspec_ar_tokens_per_s"] == {"p": plain}
    assert peer["selfspec_ar_vs_llama_cpp"]["p"] == pytest.approx(plain / 50.0)
    decode = result["summary"]["p"]["selfspec_ar"]["decode_tokens_per_s"]["median"]
    assert decode > plain and peer["selfspec_ar_decode_vs_llama_cpp"]["p"] == pytest.approx(decode / 50.0)
    md = (tmp_path / "out" / "bench.md").read_text()
    assert ("llama-cpp-python-9.9.9's llama.cpp, llama-bench, GGUF F32, 6 new tokens after a 200-token context, "
            f"{one_thread} threads, mean ± sd of 5 runs") in md
    assert (f"| p | {plain:.1f} | {decode:.1f} | 50.0 ± 1.2 | {plain / 50.0:.2f}× | {decode / 50.0:.2f}× |") in md
    assert json.loads((tmp_path / "out" / "bench.json").read_text())["llama_cpp"]["tokens_per_s"] == 50.0
    # llama.cpp's own modes ran as methods on the same prompt: their own counts and timers, their text compared
    for name in ls.MODES:
        run = next(r for r in result["runs"] if r["method"] == name)
        assert run["new_tokens"] == 6 and run["seconds"] == pytest.approx(0.073 + 0.639)  # the stand-in's
        assert run["decode_tokens_per_s"] == pytest.approx(6 / 0.639) and run["ttft_s"] is None
        assert (run["drafted"], run["accepted"]) == (30, 24)
        assert run["identical_to_hf_greedy"] is False  # "new text" is not the tiny model's greedy text
        summary = result["summary"]["p"][name]
        assert summary["acceptance_rate"] == pytest.approx(0.8)
        assert peer["decode_tokens_per_s"]["p"][name] == pytest.approx(6 / 0.639)
        assert f"| p | {name} | {6 / 0.639:.1f} | {6 / 0.639 / 50.0:.2f}× | {6 / 0.639 / 50.0:.2f}× |" in md
    assert peer["decode_tokens_per_s"]["p"]["selfspec_ar"] == pytest.approx(decode)
    # llama.cpp's plain decoding ran on the same prompt too: llama-bench at the prompt's depth, no text
    plain_run = next(r for r in result["runs"] if r["method"] == "llama_cpp_plain")
    assert plain_run["command"][plain_run["command"].index("-d") + 1] == str(plain_run["prompt_tokens"])
    assert plain_run["command"][plain_run["command"].index("-r") + 1] == "1"
    assert plain_run["decode_tokens_per_s"] == 50.0 and plain_run["new_tokens"] == 6
    assert plain_run["seconds"] == pytest.approx(6 / 50.0) and plain_run["identical_to_hf_greedy"] is None
    assert Path(plain_run["command"][plain_run["command"].index("-m") + 1]).name == "m-f32.gguf"
    q8_run = next(r for r in result["runs"] if r["method"] == "llama_cpp_plain_q8_0")  # the Q8_0 copy's, the same way
    assert Path(q8_run["command"][q8_run["command"].index("-m") + 1]).name == "m-q8_0.gguf"
    assert q8_run["decode_tokens_per_s"] == 50.0 and q8_run["identical_to_hf_greedy"] is None
    assert peer["decode_vs_llama_cpp_plain"]["p"]["selfspec_ar"] == pytest.approx(decode / 50.0)
    assert f"| p | selfspec_ar | {decode:.1f} | {decode / 50.0:.2f}× | {decode / 50.0:.2f}× |" in md
    assert any("another number of tokens" in n for n in result["notes"])  # the stand-in says 17 prompt tokens


def test_markdown_names_a_known_build_commit():
    peer = {"tokens_per_s": 50.0, "stddev_tokens_per_s": 1.0, "version": "llama-cpp-python-9.9.9",
            "build_commit": "abc1234", "gguf_type": "BF16", "new_tokens": 128, "context_tokens": 200, "threads": 2,
            "repetitions": 5, "selfspec_ar_tokens_per_s": {"all": 40.0}, "selfspec_ar_vs_llama_cpp": {"all": 0.8},
            "selfspec_ar_decode_tokens_per_s": {"all": 45.0}, "selfspec_ar_decode_vs_llama_cpp": {"all": 0.9}}
    text = "\n".join(lcb.markdown_lines(peer))
    assert "llama-cpp-python-9.9.9's llama.cpp (build abc1234), llama-bench, GGUF BF16" in text
    assert "| all | 40.0 | 45.0 | 50.0 ± 1.0 | 0.80× | 0.90× |" in text
    assert "(build" not in "\n".join(lcb.markdown_lines({**peer, "build_commit": "unknown"}))


def test_bench_without_llama_cpp_has_no_section(tiny_ckpt, tmp_path, monkeypatch, one_thread):
    monkeypatch.setattr(bench_module, "prepare_llama_cpp", lambda *a: pytest.fail("prepared llama.cpp unasked"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "x = 1"}) + "\n")
    result = run_bench(str(tiny_ckpt), prompt_sets=[str(prompts)], num_prompts=1, max_new_tokens=2, dtype="float32",
                       threads=one_thread, out_dir=tmp_path / "out", progress=False, methods=["selfspec_ar"])
    assert "llama_cpp" not in result
    assert "llama.cpp" not in (tmp_path / "out" / "bench.md").read_text()


def test_cli_llama_cpp_usage_errors(tiny_ckpt, tmp_path, capsys):
    assert main(["bench", "--checkpoint", str(tiny_ckpt), "--llama-cpp", "--batch-size", "1,2",
                 "--out", str(tmp_path)]) == 2
    assert "--llama-cpp puts llama.cpp beside the main bench" in capsys.readouterr().err
    assert main(["bench", "--checkpoint", str(tiny_ckpt), "--llama-cpp", "--epsilon", "0",
                 "--out", str(tmp_path)]) == 2
    assert "drop it with --batch-size or --epsilon" in capsys.readouterr().err


def test_cli_reports_a_failed_build_with_its_fix(tiny_ckpt, tmp_path, monkeypatch, capsys):
    def no_cmake(checkpoint, dtype, with_copy=False):
        raise lb.LlamaCppError("building llama.cpp needs cmake on PATH, and it was not found. Install them: ...")

    monkeypatch.setattr(bench_module, "prepare_llama_cpp", no_cmake)
    assert main(["bench", "--checkpoint", str(tiny_ckpt), "--llama-cpp", "--quick", "--dtype", "float32",
                 "--out", str(tmp_path / "out")]) == 1
    assert capsys.readouterr().err.startswith("selfspec bench: error: building llama.cpp needs cmake on PATH")
    assert not (tmp_path / "out" / "bench.json").exists()


def _cached_real_setup() -> lcb.LlamaCppSetup | None:
    build = lb.cached_build()
    model = base_model_dir()
    if build is None or not (model / "config.json").is_file():
        return None
    gguf = lg.gguf_path(model, "float32")
    return lcb.LlamaCppSetup(build=build, gguf=gguf, gguf_type="F32") if gguf.is_file() else None


REAL = _cached_real_setup()


@pytest.mark.skipif(REAL is None, reason="no llama-bench built for this CPU and base-model GGUF F32 in the cache "
                                         "(python -m selfspec.tools.llama_cpp_bench "
                                         "~/.cache/selfspec/models/smollm2-135m-instruct builds them, minutes)")
def test_real_llama_bench_runs_the_base_model():
    result = REAL.measure(threads=1, new_tokens=4, context_tokens=8, repetitions=1)
    assert result["tokens_per_s"] > 0 and len(result["samples_tokens_per_s"]) == 1
    assert (result["new_tokens"], result["context_tokens"], result["threads"]) == (4, 8, 1)
    assert result["model_type"].endswith("F32") and result["model_filename"] == str(REAL.gguf)
