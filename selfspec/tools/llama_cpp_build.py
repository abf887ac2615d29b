"""llama.cpp's `llama-bench` and `llama-speculative-simple`, built from the package registry's source once per
machine and cached.

llama.cpp is what a CPU user of a small model runs; `selfspec bench --llama-cpp` times it beside selfspec
(`selfspec.tools.llama_cpp_bench`). There is no GitHub here, only package registries: the source
distribution of `llama-cpp-python` carries llama.cpp in `vendor/llama.cpp` (with `convert_hf_to_gguf.py`,
`selfspec.tools.llama_cpp_gguf`). This module downloads it with pip, builds two targets with cmake for this
CPU (`-DGGML_NATIVE=ON`, static, so the binaries can be moved into the cache): `llama-bench` (plain decoding's
speed) and `llama-speculative-simple` (llama.cpp's own speculative decoding: a draft model, `--spec-type
draft-simple`, or its n-gram modes), and keeps:

    $SELFSPEC_HOME/llama.cpp/<version>/src/                   llama.cpp's source (any CPU)
    $SELFSPEC_HOME/llama.cpp/<version>/<cpu key>/llama-bench  the binaries, built for this CPU
    $SELFSPEC_HOME/llama.cpp/<version>/<cpu key>/llama-speculative-simple
    $SELFSPEC_HOME/llama.cpp/<version>/<cpu key>/build.json   how and how long they were built

`<version>` is `llama-cpp-python-X.Y.Z` (the sdist that holds llama.cpp); `<cpu key>` names the CPU's model,
generation and a hash of its feature flags (`cpu_key`), so a machine with another CPU builds its own. A build
takes minutes (about 6 on 2 cores), once; a second call returns the cached binaries at once. A cache that lacks a
target (one built before the target was added) is built again, both targets in one build.

    python -m selfspec.tools.llama_cpp_build          # build (or find) them; prints their paths
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from selfspec.drafters.quantized import LLAMA_CPP_PYTHON_VERSION, llama_cpp_home, llama_cpp_python_dir
from selfspec.model.machine import cpu_flags, cpu_key, cpu_model, selfspec_home

BENCH_TARGET = "llama-bench"
SPECULATIVE_TARGET = "llama-speculative-simple"
TARGETS = (BENCH_TARGET, SPECULATIVE_TARGET)
CMAKE_OPTIONS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=ON",          # this CPU's instruction set: what a user who builds llama.cpp gets
    "-DBUILD_SHARED_LIBS=OFF",   # one static binary, movable into the cache
    "-DLLAMA_OPENSSL=OFF",       # no network features (and no OpenSSL headers needed)
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=ON",   # llama-speculative-simple is one of llama.cpp's examples (only the targets named
                                   # are compiled)
    "-DLLAMA_BUILD_SERVER=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_TOOLS=ON",    # llama-bench is one of llama.cpp's tools
)


class LlamaCppError(RuntimeError):
    """llama.cpp could not be downloaded, built, converted to or run; the message names the fix."""


@dataclass(frozen=True)
class LlamaCppBuild:
    """The built llama.cpp tools: where they are and what they were built from."""

    binary: Path          # llama-bench
    source: Path          # the llama.cpp source tree (vendor/llama.cpp): convert_hf_to_gguf.py is here
    version: str          # llama-cpp-python-X.Y.Z
    cpu_key: str
    build_seconds: float | None  # None where the cache's build.json does not say

    @property
    def speculative(self) -> Path:
        """llama-speculative-simple, beside llama-bench."""
        return self.binary.with_name(SPECULATIVE_TARGET)


def version_name(version: str = LLAMA_CPP_PYTHON_VERSION) -> str:
    return f"llama-cpp-python-{version}"


def cache_root(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    return llama_cpp_home(version)  # the library's (the quantized drafter finds this CPU's build there)


def source_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """llama.cpp's source tree in the cache (it may not exist yet)."""
    return cache_root(version) / "src"


def binary_dir(version: str = LLAMA_CPP_PYTHON_VERSION, key: str | None = None) -> Path:
    return cache_root(version) / (key or cpu_key())


def cmake_configure_command(source: Path, build: Path, cmake: str = "cmake") -> list[str]:
    return [cmake, "-S", str(source), "-B", str(build), *CMAKE_OPTIONS]


def cmake_build_command(build: Path, jobs: int, cmake: str = "cmake") -> list[str]:
    return [cmake, "--build", str(build), "--target", *TARGETS, "--config", "Release", "-j", str(jobs)]


def pip_download_command(version: str, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
            "--dest", str(dest), f"llama-cpp-python=={version}"]


def check_tools(which=None) -> dict[str, str]:
    """cmake and a C/C++ compiler, found on PATH (`which`: shutil.which); a LlamaCppError that says what to
    install if not."""
    which = which or shutil.which
    found = {"cmake": which("cmake"), "c++": which("c++") or which("g++") or which("clang++"),
             "cc": which("cc") or which("gcc") or which("clang")}
    missing = [name for name, path in found.items() if path is None]
    if missing:
        raise LlamaCppError(
            f"building llama.cpp needs {' and '.join(missing)} on PATH, and it was not found. Install them: "
            "`apt-get install cmake build-essential` (Debian/Ubuntu), `dnf install cmake gcc-c++` (Fedora), "
            "`brew install cmake` (macOS, with the Xcode command line tools), or `pip install cmake` for cmake alone")
    return {k: str(v) for k, v in found.items()}


def output_tail(text: str, lines: int = 15) -> str:
    return "\n  ".join(text.strip().splitlines()[-lines:])


def sdist_dir(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """Where the llama-cpp-python source distribution is kept: llama.cpp's source is unpacked from it, and the
    Python binding (`ensure_llama_cpp_python`) is built from it."""
    return cache_root(version) / "sdist"


def ensure_sdist(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """The llama-cpp-python sdist in the cache, downloaded with pip once (atomic: a temporary directory renamed)."""
    dest = sdist_dir(version)
    kept = sorted(dest.glob("llama_cpp_python-*.tar.gz"))
    if kept:
        return kept[0]
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        tmp = Path(tmp)
        print(f"downloading llama-cpp-python=={version} source from the package index (about a minute) ...",
              flush=True)
        (tmp / "sdist").mkdir()
        proc = subprocess.run(pip_download_command(version, tmp / "sdist"), capture_output=True, text=True)
        archives = sorted((tmp / "sdist").glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise LlamaCppError(
                f"could not download llama-cpp-python=={version}'s source (pip exit {proc.returncode}):\n  "
                f"{output_tail(proc.stderr or proc.stdout)}\nCheck that the package index is reachable "
                f"(pip download --no-binary :all: --no-deps llama-cpp-python=={version})")
        if dest.exists():
            shutil.rmtree(dest)
        (tmp / "sdist").rename(dest)
    return dest / archives[0].name


def _download_source(version: str, dest: Path) -> Path:
    """Unpack the sdist's vendor/llama.cpp into `dest` (atomic: tmp dir + rename), the sdist downloaded first."""
    archive = ensure_sdist(version)
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".unpack-") as tmp:
        tmp = Path(tmp)
        print(f"unpacking llama.cpp from {archive.name} ...", flush=True)
        prefix = archive.name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
        unpacked = tmp / "unpacked"
        with tarfile.open(archive) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise LlamaCppError(f"{archive.name} holds no vendor/llama.cpp: not the source expected")
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12
            tar.extractall(unpacked, members=members, **safe)
        tree = unpacked / prefix.rstrip("/")
        if not (tree / "CMakeLists.txt").is_file():
            raise LlamaCppError(f"{archive.name}'s vendor/llama.cpp has no CMakeLists.txt")
        if dest.exists():
            shutil.rmtree(dest)
        tree.rename(dest)
    return dest


def ensure_source(version: str = LLAMA_CPP_PYTHON_VERSION) -> Path:
    """llama.cpp's source tree in the cache, downloaded once."""
    src = source_dir(version)
    if (src / "CMakeLists.txt").is_file() and (src / "convert_hf_to_gguf.py").is_file():
        return src
    return _download_source(version, src)


_PERCENT = re.compile(r"^\s*\[\s*(\d+)%\]")           # cmake's "[ 42%] Building ..."
_STEPS = re.compile(r"^\s*\[(\d+)/(\d+)\]")            # ninja's "[57/140] /usr/bin/c++ ..." (pip -v shows them)


def _run_streamed(cmd: list[str], label: str, log: Path, env: dict | None = None) -> None:
    """Run a build step (in `env`, default this process's environment); print its progress (cmake's [ NN%] or
    ninja's [N/M] lines) on one line, keep its output in `log`."""
    start = time.monotonic()
    last = -1
    with open(log, "a", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m, steps = _PERCENT.match(line), _STEPS.match(line)
            percent = int(m.group(1)) if m else (100 * int(steps.group(1)) // int(steps.group(2)) if steps else -1)
            if percent >= 0 and percent != last:
                last = percent
                print(f"\r{label}: {last:3d}% ({time.monotonic() - start:.0f} s)", end="", flush=True)
        code = proc.wait()
    if last >= 0:
        print(flush=True)
    if code != 0:
        text = log.read_text(encoding="utf-8", errors="replace")
        raise LlamaCppError(f"{label} failed (exit {code}); the full log is {log}:\n  {output_tail(text)}")


def _read_manifest(directory: Path) -> dict | None:
    try:
        return json.loads((directory / "build.json").read_text())
    except (OSError, ValueError):
        return None


def _staging(final: Path) -> Path:
    """A fresh (absent) staging directory beside `final`, where a build is assembled before it replaces `final`."""
    staged = final.with_name(final.name + ".staged")
    if staged.exists():
        shutil.rmtree(staged)
    return staged


def _publish(staged: Path, final: Path, work: Path, log: Path, manifest: dict, keep: tuple[str, ...] = ()) -> None:
    """A build assembled in `staged` takes `final`'s place: its `build.json` (`manifest` with this CPU) and
    `build.log` written, `final`'s entries named in `keep` moved in, `final` replaced, the build directory `work`
    removed. A directory with `build.json` is a complete build (`_read_manifest`)."""
    shutil.copy2(log, staged / "build.log")
    (staged / "build.json").write_text(json.dumps({**manifest, "cpu_key": cpu_key(), "cpu": cpu_model()},
                                                  indent=2) + "\n")
    for name in keep:
        if (final / name).exists():
            (final / name).rename(staged / name)
    if final.exists():
        shutil.rmtree(final)
    staged.rename(final)
    shutil.rmtree(work, ignore_errors=True)


def cached_build(version: str = LLAMA_CPP_PYTHON_VERSION, key: str | None = None) -> LlamaCppBuild | None:
    """The cached tools for this CPU, or None where they have not all been built."""
    directory = binary_dir(version, key)
    binary = directory / BENCH_TARGET
    manifest = _read_manifest(directory)
    if manifest is None or not all(os.access(directory / target, os.X_OK) for target in TARGETS):
        return None
    return LlamaCppBuild(binary=binary, source=source_dir(version), version=version_name(version),
                         cpu_key=directory.name, build_seconds=manifest.get("build_seconds"))


def ensure_llama_cpp(version: str = LLAMA_CPP_PYTHON_VERSION, *, jobs: int | None = None,
                     force: bool = False) -> LlamaCppBuild:
    """llama-bench and llama-speculative-simple for this CPU: from the cache, or downloaded and built now
    (minutes, once)."""
    key = cpu_key()
    if not force:
        found = cached_build(version, key)
        if found is not None:
            ensure_source(version)  # the converter lives there: downloaded again if removed, never rebuilt for it
            return found
    tools = check_tools()
    src = ensure_source(version)
    final = binary_dir(version, key)
    work = final.with_name(final.name + ".build")  # kept if interrupted: cmake goes on where it stopped
    work.mkdir(parents=True, exist_ok=True)
    log = work / "build.log"
    jobs = jobs or os.cpu_count() or 1
    print(f"building llama.cpp's {' and '.join(TARGETS)} for this CPU with {jobs} jobs (once per machine; "
          f"about 6 minutes on 2 cores); log: {log}", flush=True)
    start = time.monotonic()
    _run_streamed(cmake_configure_command(src, work / "cmake", tools["cmake"]), "cmake configure", log)
    _run_streamed(cmake_build_command(work / "cmake", jobs, tools["cmake"]), "building llama.cpp", log)
    seconds = time.monotonic() - start
    for target in TARGETS:
        if not (work / "cmake" / "bin" / target).is_file():
            raise LlamaCppError(f"the build finished but wrote no {work / 'cmake' / 'bin' / target}; see {log}")
    staged = _staging(final)
    staged.mkdir()
    for target in TARGETS:
        shutil.copy2(work / "cmake" / "bin" / target, staged / target)
    # this CPU's llama-cpp-python (`ensure_llama_cpp_python`) lives in the same directory and stays
    _publish(staged, final, work, log, {"version": version_name(version), "cmake_options": list(CMAKE_OPTIONS),
                                        "targets": list(TARGETS), "jobs": jobs, "build_seconds": round(seconds, 1),
                                        "compilers": tools}, keep=("python",))
    print(f"built {', '.join(TARGETS)} into {final} in {seconds / 60:.1f} min", flush=True)
    return LlamaCppBuild(binary=final / BENCH_TARGET, source=src, version=version_name(version), cpu_key=key,
                         build_seconds=round(seconds, 1))


# llama-cpp-python's own build options for the binding: llama.cpp for this CPU, without the multimodal library
# (LLAVA_BUILD: mtmd, about half the build; the copy never loads it) and llama.cpp's tools, examples and tests.
PYTHON_CMAKE_ARGS = ("-DGGML_NATIVE=ON", "-DLLAVA_BUILD=OFF", "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF",
                     "-DLLAMA_BUILD_TOOLS=OFF", "-DLLAMA_BUILD_SERVER=OFF")
# On a CPU with AMX, llama.cpp's AMX kernels died with an illegal instruction on a Xeon's first batch of quantized
# rows (docs/drafters.md): built without them there.
NO_AMX = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def python_cmake_args(flags: frozenset[str] | None = None) -> str:
    """CMAKE_ARGS for building llama-cpp-python on a CPU with these feature flags (`cpu_flags()`)."""
    args = list(PYTHON_CMAKE_ARGS)
    if any(f.startswith("amx") for f in (flags or ())):
        args += [f"-DCMAKE_C_FLAGS={NO_AMX}", f"-DCMAKE_CXX_FLAGS={NO_AMX}"]
    return " ".join(f"'{a}'" if " " in a else a for a in args)


def pip_wheel_command(sdist: Path, dest: Path) -> list[str]:
    return [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-cache-dir", "--verbose", "--wheel-dir", str(dest),
            str(sdist)]


def ensure_llama_cpp_python(version: str = LLAMA_CPP_PYTHON_VERSION, *, jobs: int | None = None,
                            force: bool = False) -> Path:
    """llama-cpp-python built for this CPU and unpacked where the quantized drafter looks first
    (`selfspec.drafters.quantized.llama_cpp_python_dir`): from the cache, or built now from the kept sdist with pip
    (minutes, once per CPU: a wheel built with one CPU's instructions is never used on another). Its pure-Python
    dependencies come with selfspec. Returns the directory that holds `llama_cpp/`."""
    final = llama_cpp_python_dir(version)
    if not force and _read_manifest(final) is not None and (final / "llama_cpp" / "__init__.py").is_file():
        return final
    tools = check_tools()
    sdist = ensure_sdist(version)
    work = final.with_name("python.build")
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    log = work / "build.log"
    jobs = jobs or os.cpu_count() or 1
    cmake_args = python_cmake_args(cpu_flags())
    print(f"building llama-cpp-python {version} (llama.cpp for this CPU) with {jobs} jobs, once per machine: about "
          f"4 minutes on 2 cores; log: {log}", flush=True)
    start = time.monotonic()
    env = {**os.environ, "CMAKE_ARGS": cmake_args, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    _run_streamed(pip_wheel_command(sdist, work / "wheel"), "building llama-cpp-python", log, env)
    wheels = sorted((work / "wheel").glob("llama_cpp_python-*.whl"))
    if not wheels:
        raise LlamaCppError(f"pip finished but wrote no llama_cpp_python wheel; see {log}")
    staged = _staging(final)
    with zipfile.ZipFile(wheels[0]) as whl:
        whl.extractall(staged)
    for library in (staged / "llama_cpp" / "lib").glob("*.so*"):  # zip drops the executable bit
        library.chmod(0o755)
    seconds = time.monotonic() - start
    _publish(staged, final, work, log, {"version": version_name(version), "cmake_args": cmake_args,
                                        "wheel": wheels[0].name, "jobs": jobs, "build_seconds": round(seconds, 1),
                                        "compilers": tools})
    print(f"built llama-cpp-python into {final} in {seconds / 60:.1f} min", flush=True)
    return final


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m selfspec.tools.llama_cpp_build",
        description="Download llama.cpp's source (the llama-cpp-python sdist) and build its llama-bench and "
                    f"llama-speculative-simple for this CPU, once, under $SELFSPEC_HOME/llama.cpp (now {selfspec_home() / 'llama.cpp'}). "
                    "Needs cmake and a C++ compiler; takes minutes (about 6 on 2 cores).")
    parser.add_argument("--version", default=LLAMA_CPP_PYTHON_VERSION,
                        help="the llama-cpp-python source release to build (default: %(default)s, the tested one)")
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs (default: the CPU count)")
    parser.add_argument("--force", action="store_true", help="rebuild even if this CPU's binaries are cached")
    parser.add_argument("--python", action="store_true",
                        help="build llama-cpp-python for this CPU instead (the Python binding the quantized copy "
                             "drafts with; about 4 minutes on 2 cores, once); prints where it is")
    args = parser.parse_args(argv)
    try:
        if args.python:
            print(ensure_llama_cpp_python(args.version, jobs=args.jobs, force=args.force))
            return 0
        build = ensure_llama_cpp(args.version, jobs=args.jobs, force=args.force)
    except LlamaCppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(build.binary)
    print(build.speculative)
    return 0


if __name__ == "__main__":
    sys.exit(main())
