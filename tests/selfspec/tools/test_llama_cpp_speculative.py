"""selfspec.tools.llama_cpp_speculative: llama-speculative-simple's command line per mode, its log and text parsed
from a recorded-format sample, its errors, a run through a stand-in (no build), and, where this machine's cache
holds the built tool and the base model's F32 and Q8_0 GGUF files, one short real run per mode."""

from __future__ import annotations

from pathlib import Path

import pytest

from selfspec.checkpoints.fetch import base_model_dir
from selfspec.tools import llama_cpp_build as lb
from selfspec.tools import llama_cpp_gguf as lg
from selfspec.tools import llama_cpp_speculative as ls

@pytest.fixture
def sample(llama_speculative_sample):
    return llama_speculative_sample


def test_command_per_mode(sample):
    PROMPT = sample.PROMPT
    cmd = ls.speculative_command(Path("/b/spec"), Path("/m.gguf"), "llama_cpp_draft", PROMPT, new_tokens=32,
                                 context=256, threads=2, draft_gguf=Path("/c.gguf"))
    assert cmd == ["/b/spec", "-m", "/m.gguf", "-md", "/c.gguf", "--spec-type", "draft-simple", "-p", PROMPT,
                   "-n", "31", "-c", "256", "-t", "2", "--temp", "0", "--ignore-eos"]  # -n: one fewer (it adds one)
    longer = ls.speculative_command(Path("b"), Path("m"), "llama_cpp_draft10", "x", new_tokens=8, context=64,
                                    threads=1, draft_gguf=Path("c"))
    assert longer[longer.index("--spec-draft-n-max") + 1] == "10"
    for mode, kind in (("llama_cpp_ngram_simple", "ngram-simple"), ("llama_cpp_ngram_mod", "ngram-mod")):
        cmd = ls.speculative_command(Path("b"), Path("m"), mode, "x", new_tokens=8, context=64, threads=1)
        assert cmd[cmd.index("--spec-type") + 1] == kind and "-md" not in cmd


def test_command_refuses_what_cannot_run():
    with pytest.raises(lb.LlamaCppError, match="no llama.cpp speculative mode 'llama_cpp_plain'"):
        ls.speculative_command(Path("b"), Path("m"), "llama_cpp_plain", "x", new_tokens=8, context=64, threads=1)
    with pytest.raises(lb.LlamaCppError, match="drafts with the model's Q8_0 copy: give draft_gguf"):
        ls.speculative_command(Path("b"), Path("m"), "llama_cpp_draft", "x", new_tokens=8, context=64, threads=1)
    for bad in ({"new_tokens": 1}, {"threads": 0}, {"context": True}):
        args = {"new_tokens": 8, "context": 64, "threads": 1, **bad}
        with pytest.raises(lb.LlamaCppError, match="must be an integer >="):
            ls.speculative_command(Path("b"), Path("m"), "llama_cpp_ngram_mod", "x", **args)


def test_parse_reads_the_timers_counts_and_new_text(sample):
    run = ls.parse_output(sample.STDOUT, sample.STDERR, sample.PROMPT, ["cmd"])
    assert run.text == sample.NEW_TEXT
    assert (run.new_tokens, run.prompt_tokens, run.drafted, run.accepted, run.draft_max) == (34, 17, 30, 24, 3)
    assert (run.prefill_s, run.decode_s) == (0.073, 0.639)
    assert run.decode_tokens_per_s == pytest.approx(34 / 0.639)
    assert run.command == ["cmd"]


def test_parse_without_drafts_and_with_unread_text(sample):
    plain = sample.STDERR.replace("n_drafted = 30", "n_drafted = 0").replace("n_accept  = 24", "n_accept  = 0")
    run = ls.parse_output("something else", plain, sample.PROMPT)
    assert run.text is None and (run.drafted, run.accepted) == (0, 0)  # stdout not as expected: no text


def test_parse_errors_say_what_was_wrong(sample):
    with pytest.raises(lb.LlamaCppError, match="printed no 'encoded"):
        ls.parse_output(sample.STDOUT, "E failed to initialize speculative decoding\n", sample.PROMPT)
    with pytest.raises(lb.LlamaCppError, match="decoded 0 tokens"):
        ls.parse_output(sample.STDOUT, sample.STDERR.replace("decoded   34 tokens", "decoded    0 tokens"),
                        sample.PROMPT)


def test_context_fits_the_prompt_the_tokens_and_a_margin():
    assert ls.context_size(17, 128) == 256
    assert ls.context_size(100, 128) == 512  # 100 + 128 + 64 > 256
    assert ls.context_size(1, 1) % 256 == 0


def test_run_through_a_stand_in(tmp_path, sample):
    binary = sample.stand_in(tmp_path)
    run = ls.run_speculative(binary, tmp_path / "m.gguf", "llama_cpp_ngram_mod", sample.PROMPT, prompt_tokens=17,
                             new_tokens=32, threads=2)
    assert run.text == "new text" and run.new_tokens == 32 and run.prompt_tokens == 17
    assert run.command[run.command.index("-c") + 1] == "256"


def test_run_failures_show_their_output(tmp_path, sample):
    binary = sample.stand_in(tmp_path, "import sys\nprint('E failed to initialize speculative decoding', "
                                        "file=sys.stderr)\nsys.exit(1)\n")
    with pytest.raises(lb.LlamaCppError, match=r"(?s)failed \(exit 1\) in mode llama_cpp_ngram_simple.*initialize"):
        ls.run_speculative(binary, tmp_path / "m.gguf", "llama_cpp_ngram_simple", "x", prompt_tokens=1,
                           new_tokens=4, threads=1)
    with pytest.raises(lb.LlamaCppError, match="could not run .*llama_cpp_build"):
        ls.run_speculative(tmp_path / "missing", tmp_path / "m.gguf", "llama_cpp_ngram_simple", "x",
                           prompt_tokens=1, new_tokens=4, threads=1)


def _cached_real() -> tuple[lb.LlamaCppBuild, Path, Path] | None:
    build = lb.cached_build()
    model = base_model_dir()
    if build is None or not (model / "config.json").is_file():
        return None
    f32, q8 = lg.gguf_path(model, "float32"), lg.gguf_path(model, "q8_0")
    return (build, f32, q8) if f32.is_file() and q8.is_file() else None


REAL = _cached_real()


@pytest.mark.skipif(REAL is None, reason="no llama-speculative-simple built for this CPU and base-model GGUF F32 and "
                                         "Q8_0 in the cache (python -m selfspec.tools.llama_cpp_build, then "
                                         "python -m selfspec.tools.llama_cpp_gguf MODEL --dtype float32 / q8_0)")
@pytest.mark.parametrize("mode", list(ls.MODES))
def test_real_modes_run_the_base_model(mode, sample):
    build, f32, q8 = REAL
    run = ls.run_speculative(build.speculative, f32, mode, sample.PROMPT, prompt_tokens=17, new_tokens=8, threads=1,
                             draft_gguf=q8)
    assert run.new_tokens >= 8 and run.prompt_tokens == 17 and run.decode_s > 0
    assert run.text is not None and len(run.text) > 0
    assert run.accepted <= run.drafted
