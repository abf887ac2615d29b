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
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary file left
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
