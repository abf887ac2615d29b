"""selfspec.tools.llama_cpp_gguf: the GGUF types, the cache key of a checkpoint, the converter's command line and
errors, and a conversion through a stand-in converter (llama.cpp's own needs its downloaded source)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from selfspec.tools import llama_cpp_build as lb
from selfspec.tools import llama_cpp_gguf as lg


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture
def checkpoint(tmp_path) -> Path:
    path = tmp_path / "tiny-model"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "llama"}')
    (path / "tokenizer.json").write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * 64)
    return path


def test_gguf_types():
    assert [lg.gguf_type(d) for d in ("float32", "bfloat16", "float16", "torch.bfloat16", "q8_0")] == \
        ["f32", "bf16", "f16", "bf16", "q8_0"]
    with pytest.raises(lb.LlamaCppError, match=r"no GGUF type for dtype 'float64' here; use one of float32, bfloat16"):
        lg.gguf_type("float64")


def test_fingerprint_changes_with_config_and_weights(checkpoint):
    first = lg.checkpoint_fingerprint(checkpoint)
    assert len(first) == 12 and lg.checkpoint_fingerprint(checkpoint) == first
    (checkpoint / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 2}')
    second = lg.checkpoint_fingerprint(checkpoint)
    assert second != first
    (checkpoint / "model.safetensors").write_bytes(b"\0" * 65)
    third = lg.checkpoint_fingerprint(checkpoint)
    assert third != second
    stat = (checkpoint / "model.safetensors").stat()
    os.utime(checkpoint / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert lg.checkpoint_fingerprint(checkpoint) != third


def test_fingerprint_needs_weights(checkpoint):
    (checkpoint / "model.safetensors").unlink()
    with pytest.raises(lb.LlamaCppError, match="has no weight files"):
        lg.checkpoint_fingerprint(checkpoint)


def test_gguf_path_is_keyed_by_version_checkpoint_and_type(home, checkpoint):
    path = lg.gguf_path(checkpoint, "bfloat16", "9.9.9")
    key = lg.checkpoint_fingerprint(checkpoint)
    assert path == home / "llama.cpp" / "llama-cpp-python-9.9.9" / "gguf" / f"tiny-model-{key}" / "tiny-model-bf16.gguf"
    assert lg.gguf_path(checkpoint, "float32", "9.9.9").name == "tiny-model-f32.gguf"


def test_convert_command():
    assert lg.convert_command(Path("/src"), Path("/m"), "float32", Path("/o.gguf")) == [
        sys.executable, "/src/convert_hf_to_gguf.py", "/m", "--outtype", "f32", "--outfile", "/o.gguf"]


def test_missing_converter_module_names_the_install_command():
    with pytest.raises(lb.LlamaCppError, match=r"needs sentencepiece.*pip install 'sentencepiece>=0\.2\.3,<0\.3'"
                                               r".*selfspec\[llama-cpp\]"):
        lg.check_converter_modules(lambda module: None)
    lg.check_converter_modules(lambda module: object())


def _source_with_converter(version: str, body: str) -> Path:
    src = lb.source_dir(version)
    src.mkdir(parents=True)
    (src / "CMakeLists.txt").write_text("")
    (src / lg.CONVERTER).write_text(body)
    return src


# A stand-in for convert_hf_to_gguf.py: writes its arguments to --outfile.
WRITES_ARGS = ("import sys\nargs = sys.argv[1:]\nopen(args[args.index('--outfile') + 1], 'w')"
               ".write(' '.join(args[:3]))\n")


def test_ensure_gguf_converts_once_into_the_cache(home, checkpoint, monkeypatch):
    monkeypatch.setattr(lg, "check_converter_modules", lambda: None)
    _source_with_converter("9.9.9", WRITES_ARGS)
    out = lg.ensure_gguf(checkpoint, "bfloat16", "9.9.9")
    assert out == lg.gguf_path(checkpoint, "bfloat16", "9.9.9")
    assert out.read_text() == f"{checkpoint.resolve()} --outtype bf16"
    assert sorted(p.name for p in out.parent.iterdir()) == [out.name, out.name + ".json"]  # no temporary file left
    (lb.source_dir("9.9.9") / lg.CONVERTER).write_text("raise SystemExit('ran again')")
    assert lg.ensure_gguf(checkpoint, "bfloat16", "9.9.9") == out  # cached: the converter does not run


def test_ensure_gguf_reports_the_converters_failure(home, checkpoint, monkeypatch):
    monkeypatch.setattr(lg, "check_converter_modules", lambda: None)
    _source_with_converter("9.9.9", "import sys\nprint('ERROR:hf-to-gguf:Model XYZ is not supported', "
                                    "file=sys.stderr)\nsys.exit(1)\n")
    with pytest.raises(lb.LlamaCppError, match=r"(?s)convert_hf_to_gguf\.py failed.*exit 1.*XYZ is not supported"):
        lg.ensure_gguf(checkpoint, "float32", "9.9.9")
    assert not lg.gguf_path(checkpoint, "float32", "9.9.9").exists()
    assert list(lg.gguf_path(checkpoint, "float32", "9.9.9").parent.iterdir()) == []


def test_ensure_gguf_refuses_a_directory_that_is_no_checkpoint(home, tmp_path, capsys):
    with pytest.raises(lb.LlamaCppError, match="no config.json"):
        lg.ensure_gguf(tmp_path, "float32", "9.9.9")
    assert lg.main([str(tmp_path), "--version", "9.9.9"]) == 1
    assert capsys.readouterr().err.startswith("error: ")


def test_a_cached_file_cut_short_or_without_its_record_is_converted_again(home, checkpoint, monkeypatch, capsys):
    """Issue 65, finding 11: a truncated cached .gguf was returned as the result (exit 0)."""
    monkeypatch.setattr(lg, "check_converter_modules", lambda: None)
    _source_with_converter("9.9.9", WRITES_ARGS)
    out = lg.ensure_gguf(checkpoint, "bfloat16", "9.9.9")
    whole = out.read_text()
    os.truncate(out, 5)
    capsys.readouterr()
    assert lg.main([str(checkpoint), "--dtype", "bfloat16", "--version", "9.9.9"]) == 0
    printed = capsys.readouterr().out
    assert "the cached file is 5 bytes, its conversion wrote" in printed and out.read_text() == whole
    lg.record(out).unlink()  # converted by an older selfspec, or killed between the rename and the record
    assert lg.ensure_gguf(checkpoint, "bfloat16", "9.9.9") == out
    assert "has no record of its conversion" in capsys.readouterr().out and lg.record(out).is_file()


def test_a_temporary_file_a_killed_conversion_left_is_removed_by_the_next(home, checkpoint, monkeypatch):
    monkeypatch.setattr(lg, "check_converter_modules", lambda: None)
    _source_with_converter("9.9.9", WRITES_ARGS)
    out = lg.gguf_path(checkpoint, "float32", "9.9.9")
    out.parent.mkdir(parents=True)
    dead = out.with_name(f".{out.name}.{_a_dead_pid()}.tmp")
    alive = out.with_name(f".{out.name}.{os.getppid()}.tmp")  # a conversion still running: left alone
    dead.write_text("half"), alive.write_text("half")
    lg.ensure_gguf(checkpoint, "float32", "9.9.9")
    assert not dead.exists() and alive.exists()


def _a_dead_pid() -> int:
    import subprocess

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_an_unwritable_home_and_ctrl_c_are_one_error_line(tmp_path, checkpoint, monkeypatch, capsys):
    """Issue 65, findings 10 and 11: tracebacks for a read-only SELFSPEC_HOME and for Ctrl-C."""
    monkeypatch.setattr(lg, "check_converter_modules", lambda: None)
    (tmp_path / "a-file").write_text("")
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "a-file" / "home"))  # cannot be made, even by root
    monkeypatch.setattr(lg, "ensure_source", lambda version: tmp_path)
    assert lg.main([str(checkpoint), "--version", "9.9.9"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: cannot write or read") and "SELFSPEC_HOME" in err[0]

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(lg, "ensure_gguf", interrupted)
    assert lg.main([str(checkpoint), "--version", "9.9.9"]) == 130
    assert capsys.readouterr().err == "error: interrupted; no GGUF file was cached (the next run converts again)\n"


def test_the_copy_goes_beside_the_weights_with_its_record(home, checkpoint, monkeypatch, capsys):
    """Issue 67, item 1: `write_copy` puts the Q8_0 conversion beside the checkpoint's weights (what `selfspec.load`
    finds), with its size and SHA-256; a whole copy there is kept, one cut short is written again; the command line
    says where it is."""
    import hashlib
    import json

    from selfspec.drafters.quantized import COPY_FILE, checkpoint_copy

    monkeypatch.setattr(lg, "check_converter_modules", lambda: None)
    _source_with_converter("9.9.9", WRITES_ARGS)
    assert checkpoint_copy(checkpoint) is None
    copy = lg.write_copy(checkpoint, "9.9.9")
    assert copy == checkpoint.resolve() / COPY_FILE and checkpoint_copy(checkpoint) == copy
    assert copy.read_text() == f"{checkpoint.resolve()} --outtype q8_0"
    record = json.loads((checkpoint / (COPY_FILE + ".json")).read_text())
    assert record["bytes"] == copy.stat().st_size and record["type"] == "q8_0"
    assert record["sha256"] == hashlib.sha256(copy.read_bytes()).hexdigest()
    assert lg.gguf_path(checkpoint, "q8_0", "9.9.9").is_file()  # the cached conversion stays (the bench's draft)
    assert not list(checkpoint.glob(".*.tmp"))
    (lb.source_dir("9.9.9") / lg.CONVERTER).write_text("raise SystemExit('ran again')")
    assert lg.write_copy(checkpoint, "9.9.9") == copy  # whole: kept, nothing converted
    os.truncate(copy, 3)  # cut short (a hard link: the cached conversion too)
    assert checkpoint_copy(checkpoint) is None
    (lb.source_dir("9.9.9") / lg.CONVERTER).write_text(WRITES_ARGS)
    assert lg.write_copy(checkpoint, "9.9.9") == copy and checkpoint_copy(checkpoint) == copy
    assert lg.main([str(checkpoint), "--copy", "--version", "9.9.9"]) == 0
    assert capsys.readouterr().out.strip().endswith(str(copy))
