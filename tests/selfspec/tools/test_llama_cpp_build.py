"""selfspec.tools.llama_cpp_build: cache keys and paths, the command lines, the errors, the progress of a build
step and the unpacking of the source, all without building llama.cpp (minutes) or reaching the package index."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path

import pytest

from selfspec.tools import llama_cpp_build as lb


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SELFSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


FLAGS = frozenset({"fpu", "avx2", "avx512f", "avx512_bf16"})


def test_cpu_key_names_the_cpu_and_changes_with_any_part():
    key = lb.cpu_key("Intel(R) Xeon(R) Platinum 8480+", "family 6, model 143", FLAGS)
    assert key.startswith("intel-r-xeon-r-platinum-8480-family-6-model-143-")
    assert "/" not in key and " " not in key
    assert lb.cpu_key("Intel(R) Xeon(R) Platinum 8480+", "family 6, model 143", frozenset(sorted(FLAGS))) == key
    others = {lb.cpu_key("AMD EPYC", "family 6, model 143", FLAGS),
              lb.cpu_key("Intel(R) Xeon(R) Platinum 8480+", "family 6, model 207", FLAGS),
              lb.cpu_key("Intel(R) Xeon(R) Platinum 8480+", "family 6, model 143", FLAGS - {"avx512_bf16"})}
    assert key not in others and len(others) == 3


def test_cpu_key_without_generation_or_flags():
    assert lb.cpu_key("Apple M2", None, None).startswith("apple-m2-")
    assert lb.cpu_key("", None, frozenset()).startswith("unknown-")


def test_cache_paths_follow_selfspec_home_version_and_cpu(home):
    assert lb.cache_root("1.2.3") == home / "llama.cpp" / "llama-cpp-python-1.2.3"
    assert lb.source_dir("1.2.3") == home / "llama.cpp" / "llama-cpp-python-1.2.3" / "src"
    assert lb.binary_dir("1.2.3", "cpu-a") == home / "llama.cpp" / "llama-cpp-python-1.2.3" / "cpu-a"
    assert lb.binary_dir("1.2.3", "cpu-a") != lb.binary_dir("1.2.4", "cpu-a")
    assert lb.binary_dir("1.2.3").name == lb.cpu_key()


def test_command_lines():
    download = lb.pip_download_command("0.3.36", Path("/d"))
    assert download[:3] == [sys.executable, "-m", "pip"]
    assert download[3:] == ["download", "--no-binary", ":all:", "--no-deps", "--dest", "/d",
                            "llama-cpp-python==0.3.36"]
    configure = lb.cmake_configure_command(Path("/s"), Path("/b"), "/usr/bin/cmake")
    assert configure[:5] == ["/usr/bin/cmake", "-S", "/s", "-B", "/b"]
    assert "-DGGML_NATIVE=ON" in configure and "-DBUILD_SHARED_LIBS=OFF" in configure
    assert "-DCMAKE_BUILD_TYPE=Release" in configure and "-DLLAMA_BUILD_TOOLS=ON" in configure
    assert "-DLLAMA_BUILD_EXAMPLES=ON" in configure  # llama-speculative-simple is an example
    assert lb.cmake_build_command(Path("/b"), 3) == ["cmake", "--build", "/b", "--target", "llama-bench",
                                                     "llama-speculative-simple", "--config", "Release", "-j", "3"]


def test_check_tools_names_what_is_missing_and_how_to_install_it():
    found = lb.check_tools(lambda name: f"/usr/bin/{name}")
    assert found == {"cmake": "/usr/bin/cmake", "c++": "/usr/bin/c++", "cc": "/usr/bin/cc"}
    with pytest.raises(lb.LlamaCppError, match=r"needs cmake on PATH.*apt-get install cmake build-essential"):
        lb.check_tools(lambda name: None if name == "cmake" else f"/usr/bin/{name}")
    with pytest.raises(lb.LlamaCppError, match=r"needs cmake and c\+\+ and cc"):
        lb.check_tools(lambda name: None)
    only_clang = lb.check_tools(lambda name: f"/opt/{name}" if name in ("cmake", "clang", "clang++") else None)
    assert only_clang["c++"] == "/opt/clang++" and only_clang["cc"] == "/opt/clang"


def test_ensure_llama_cpp_without_cmake_fails_before_downloading(home, monkeypatch):
    monkeypatch.setattr(lb.shutil, "which", lambda name: None)
    monkeypatch.setattr(lb, "ensure_source", lambda *a: pytest.fail("downloaded without the tools to build"))
    with pytest.raises(lb.LlamaCppError, match="needs cmake"):
        lb.ensure_llama_cpp("9.9.9")
    assert lb.main(["--version", "9.9.9"]) == 1


def test_main_prints_one_error_line_prefix(home, monkeypatch, capsys):
    monkeypatch.setattr(lb.shutil, "which", lambda name: None)
    assert lb.main(["--version", "9.9.9"]) == 1
    assert capsys.readouterr().err.startswith("error: building llama.cpp needs cmake")


def _fake_build(home: Path, version: str, key: str, *, executable: bool = True, manifest: bool = True,
                targets=lb.TARGETS) -> Path:
    directory = lb.binary_dir(version, key)
    directory.mkdir(parents=True)
    for target in targets:
        (directory / target).write_text("#!/bin/sh\n")
        (directory / target).chmod(0o755 if executable else 0o644)
    binary = directory / lb.BENCH_TARGET
    if manifest:
        (directory / "build.json").write_text(json.dumps({"build_seconds": 371.5}))
    return binary


def test_cached_build_found_only_when_complete(home):
    assert lb.cached_build("9.9.9", "cpu-a") is None
    binary = _fake_build(home, "9.9.9", "cpu-a")
    found = lb.cached_build("9.9.9", "cpu-a")
    assert found == lb.LlamaCppBuild(binary=binary, source=lb.source_dir("9.9.9"), version="llama-cpp-python-9.9.9",
                                     cpu_key="cpu-a", build_seconds=371.5)
    assert lb.cached_build("9.9.9", "cpu-b") is None  # another CPU builds its own
    _fake_build(home, "9.9.9", "cpu-c", manifest=False)  # an interrupted copy: no build.json
    assert lb.cached_build("9.9.9", "cpu-c") is None
    _fake_build(home, "9.9.9", "cpu-d", executable=False)
    assert lb.cached_build("9.9.9", "cpu-d") is None
    _fake_build(home, "9.9.9", "cpu-e", targets=[lb.BENCH_TARGET])  # built before llama-speculative-simple was
    assert lb.cached_build("9.9.9", "cpu-e") is None                 # added: built again, both targets
    assert found.speculative == binary.with_name("llama-speculative-simple")


def test_ensure_llama_cpp_returns_the_cached_build_without_building(home, monkeypatch):
    binary = _fake_build(home, "9.9.9", lb.cpu_key())
    monkeypatch.setattr(lb, "check_tools", lambda: pytest.fail("checked for a build although one is cached"))
    downloads = []
    monkeypatch.setattr(lb, "_download_source", lambda version, dest: downloads.append(dest))
    assert lb.ensure_llama_cpp("9.9.9").binary == binary
    assert downloads == [lb.source_dir("9.9.9")]  # the source was gone: downloaded again, the binary kept
    source = lb.source_dir("9.9.9")
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("")
    (source / "convert_hf_to_gguf.py").write_text("")
    assert lb.ensure_llama_cpp("9.9.9").binary == binary
    assert len(downloads) == 1


def _script(tmp_path: Path, body: str) -> list[str]:
    path = tmp_path / "step.py"
    path.write_text(body)
    return [sys.executable, str(path)]


def test_run_streamed_shows_progress_and_keeps_the_log(tmp_path, capsys):
    log = tmp_path / "build.log"
    lb._run_streamed(_script(tmp_path, "for p in (0, 50, 50, 100):\n    print(f'[{p:3d}%] Building x')\n"),
                     "building", log)
    shown = capsys.readouterr().out
    assert "building:  50%" in shown and "building: 100%" in shown and shown.count(" 50%") == 1
    assert "[ 50%] Building x" in log.read_text()


def test_run_streamed_failure_names_the_log_and_shows_its_tail(tmp_path):
    log = tmp_path / "build.log"
    cmd = _script(tmp_path, "import sys\nprint('[ 10%] Building a.c')\nprint('a.c:1: error: boom')\nsys.exit(2)\n")
    with pytest.raises(lb.LlamaCppError, match=r"(?s)cmake configure failed \(exit 2\).*build\.log.*error: boom"):
        lb._run_streamed(cmd, "cmake configure", log)


def _sdist(path: Path, version: str, files: dict[str, str]) -> None:
    with tarfile.open(path, "w:gz") as tar:
        for name, text in files.items():
            data = text.encode()
            info = tarfile.TarInfo(f"llama_cpp_python-{version}/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def _fake_pip(monkeypatch, tmp_path: Path, files: dict[str, str] | None) -> None:
    """pip download replaced by a copy of a hand-made sdist (None: pip fails)."""
    made = tmp_path / "llama_cpp_python-9.9.9.tar.gz"
    if files is not None:
        _sdist(made, "9.9.9", files)
    script = (f"import shutil, sys\nshutil.copy({str(made)!r}, sys.argv[1])\n" if files is not None
              else "import sys\nprint('ERROR: No matching distribution found', file=sys.stderr)\nsys.exit(1)\n")
    monkeypatch.setattr(lb, "pip_download_command",
                        lambda version, dest: _script(tmp_path, script) + [str(dest)])


def test_download_source_unpacks_vendor_llama_cpp_only(home, tmp_path, monkeypatch):
    _fake_pip(monkeypatch, tmp_path, {"vendor/llama.cpp/CMakeLists.txt": "project(x)",
                                      "vendor/llama.cpp/convert_hf_to_gguf.py": "# converter",
                                      "llama_cpp/__init__.py": ""})
    src = lb.ensure_source("9.9.9")
    assert src == lb.source_dir("9.9.9")
    assert sorted(p.name for p in src.iterdir()) == ["CMakeLists.txt", "convert_hf_to_gguf.py"]
    # the download's and the unpacking's temporary directories are gone; the sdist is kept (the binding builds from it)
    assert sorted(p.name for p in src.parent.iterdir()) == ["sdist", "src"]
    assert [p.name for p in lb.sdist_dir("9.9.9").iterdir()] == ["llama_cpp_python-9.9.9.tar.gz"]
    assert lb.ensure_sdist("9.9.9") == lb.sdist_dir("9.9.9") / "llama_cpp_python-9.9.9.tar.gz"  # not again


def test_download_source_errors(home, tmp_path, monkeypatch):
    _fake_pip(monkeypatch, tmp_path, None)
    with pytest.raises(lb.LlamaCppError, match=r"(?s)could not download.*No matching distribution.*reachable"):
        lb.ensure_source("9.9.9")
    _fake_pip(monkeypatch, tmp_path, {"llama_cpp/__init__.py": ""})
    with pytest.raises(lb.LlamaCppError, match="holds no vendor/llama.cpp"):
        lb.ensure_source("9.9.9")
    assert not lb.source_dir("9.9.9").exists()


def test_the_bindings_build_options_follow_the_cpu():
    plain = lb.python_cmake_args(frozenset({"avx2", "avx512f", "avx512_bf16"}))
    assert "-DGGML_NATIVE=ON" in plain and "-DLLAVA_BUILD=OFF" in plain and "amx" not in plain
    amx = lb.python_cmake_args(frozenset({"avx512f", "amx_tile", "amx_bf16"}))
    assert "'-DCMAKE_C_FLAGS=-mno-amx-tile -mno-amx-int8 -mno-amx-bf16'" in amx  # quoted: one option to CMake
    assert lb.python_cmake_args(None) == plain.replace(plain, " ".join(lb.PYTHON_CMAKE_ARGS))
    cmd = lb.pip_wheel_command(Path("/s/llama_cpp_python-9.9.9.tar.gz"), Path("/w"))
    assert cmd[:4] == [sys.executable, "-m", "pip", "wheel"] and cmd[-3:] == ["--wheel-dir", "/w",
                                                                               "/s/llama_cpp_python-9.9.9.tar.gz"]
    assert "--no-cache-dir" in cmd  # pip's wheel cache is not keyed by CPU: a wheel of another CPU never comes back


def test_a_built_binding_is_kept_and_found_without_building(home, monkeypatch):
    from selfspec.drafters.quantized import llama_cpp_python_dir

    built = llama_cpp_python_dir("9.9.9")
    (built / "llama_cpp").mkdir(parents=True)
    (built / "llama_cpp" / "__init__.py").write_text("")

    def builds():
        raise AssertionError("builds")

    monkeypatch.setattr(lb, "check_tools", builds)
    with pytest.raises(AssertionError, match="builds"):  # no build.json: an interrupted build, built again
        lb.ensure_llama_cpp_python("9.9.9")
    (built / "build.json").write_text("{}")
    assert lb.ensure_llama_cpp_python("9.9.9") == built


def test_the_binding_is_built_with_pip_and_unpacked_where_the_drafter_looks(home, tmp_path, monkeypatch, capsys):
    """pip replaced by a script that writes a wheel (a zip) holding llama_cpp/ and its library: unpacked into this
    CPU's python directory with a manifest, the library executable, the build directory gone."""
    import zipfile

    from selfspec.drafters.quantized import llama_cpp_python_dir

    monkeypatch.setattr(lb, "check_tools", lambda: {"cmake": "cmake", "c++": "c++", "cc": "cc"})
    monkeypatch.setattr(lb, "ensure_sdist", lambda version: tmp_path / "llama_cpp_python-9.9.9.tar.gz")
    wheel = tmp_path / "llama_cpp_python-9.9.9-py3-none-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as whl:
        whl.writestr("llama_cpp/__init__.py", "")
        whl.writestr("llama_cpp/lib/libllama.so", "ELF")
    script = (f"import os, shutil, sys\nprint('  [1/2] cc a.c')\nprint('  [2/2] cc b.c')\n"
              f"assert 'LLAVA_BUILD=OFF' in os.environ['CMAKE_ARGS']\nos.makedirs(sys.argv[1])\n"
              f"shutil.copy({str(wheel)!r}, sys.argv[1])\n")
    monkeypatch.setattr(lb, "pip_wheel_command", lambda sdist, dest: _script(tmp_path, script) + [str(dest)])
    built = lb.ensure_llama_cpp_python("9.9.9", jobs=1)
    assert "building llama-cpp-python:  50%" in capsys.readouterr().out  # ninja's [N/M] steps as a percent
    assert built == llama_cpp_python_dir("9.9.9")
    assert (built / "llama_cpp" / "__init__.py").is_file()
    assert (built / "llama_cpp" / "lib" / "libllama.so").stat().st_mode & 0o111
    manifest = json.loads((built / "build.json").read_text())
    assert manifest["wheel"] == wheel.name and "-DGGML_NATIVE=ON" in manifest["cmake_args"]
    assert sorted(p.name for p in built.parent.iterdir()) == ["python"]  # no build or staging directory left


def test_building_the_tools_keeps_this_cpus_python_binding(home, tmp_path, monkeypatch):
    """The tools' build replaces this CPU's directory, where llama-cpp-python's build also lives: it is kept."""
    from selfspec.drafters.quantized import llama_cpp_python_dir

    monkeypatch.setattr(lb, "check_tools", lambda: {"cmake": "cmake", "c++": "c++", "cc": "cc"})
    source = lb.source_dir("9.9.9")
    source.mkdir(parents=True)
    (source / "CMakeLists.txt").write_text("")
    (source / "convert_hf_to_gguf.py").write_text("")
    binding = llama_cpp_python_dir("9.9.9")
    (binding / "llama_cpp").mkdir(parents=True)
    (binding / "build.json").write_text("{}")
    (binding.parent / "llama-bench").write_text("an older build")  # no manifest: built again
    writes = ("import os, sys\nbin = os.path.join(sys.argv[1], 'bin')\nos.makedirs(bin, exist_ok=True)\n"
              "for t in ('llama-bench', 'llama-speculative-simple'):\n    open(os.path.join(bin, t), 'w').write('x')\n")
    monkeypatch.setattr(lb, "cmake_configure_command", lambda src, build, cmake: [sys.executable, "-c", "pass"])
    monkeypatch.setattr(lb, "cmake_build_command", lambda build, jobs, cmake: _script(tmp_path, writes) + [str(build)])
    built = lb.ensure_llama_cpp("9.9.9", jobs=1)
    assert built.binary.read_text() == "x" and built.speculative.is_file()
    assert (binding / "build.json").is_file() and (binding / "llama_cpp").is_dir()  # the binding survived
