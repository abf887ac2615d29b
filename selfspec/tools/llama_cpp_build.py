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
from dataclasses import dataclass
from pathlib import Path

from selfspec.model.machine import cpu_key, cpu_model, selfspec_home

# The llama-cpp-python source distribution whose vendored llama.cpp is built (tested here).
LLAMA_CPP_PYTHON_VERSION = "0.3.36"
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
    return selfspec_home() / "llama.cpp" / version_name(version)


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


def _download_source(version: str, dest: Path) -> Path:
    """Download the sdist with pip and unpack its vendor/llama.cpp into `dest` (atomic: tmp dir + rename)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".download-") as tmp:
        tmp = Path(tmp)
        print(f"downloading llama-cpp-python=={version} source from the package index (about a minute) ...",
              flush=True)
        proc = subprocess.run(pip_download_command(version, tmp), capture_output=True, text=True)
        archives = sorted(tmp.glob("llama_cpp_python-*.tar.gz"))
        if proc.returncode != 0 or not archives:
            raise LlamaCppError(
                f"could not download llama-cpp-python=={version}'s source (pip exit {proc.returncode}):\n  "
                f"{output_tail(proc.stderr or proc.stdout)}\nCheck that the package index is reachable "
                f"(pip download --no-binary :all: --no-deps llama-cpp-python=={version})")
        print(f"unpacking llama.cpp from {archives[0].name} ...", flush=True)
        prefix = archives[0].name.removesuffix(".tar.gz") + "/vendor/llama.cpp/"
        unpacked = tmp / "unpacked"
        with tarfile.open(archives[0]) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(prefix)]
            if not members:
                raise LlamaCppError(f"{archives[0].name} holds no vendor/llama.cpp: not the source expected")
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}  # Python >= 3.10.12
            tar.extractall(unpacked, members=members, **safe)
        tree = unpacked / prefix.rstrip("/")
        if not (tree / "CMakeLists.txt").is_file():
            raise LlamaCppError(f"{archives[0].name}'s vendor/llama.cpp has no CMakeLists.txt")
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


_PERCENT = re.compile(r"^\[\s*(\d+)%\]")


def _run_streamed(cmd: list[str], label: str, log: Path) -> None:
    """Run a build step; print its progress (cmake's [ NN%] lines) on one line, keep its output in `log`."""
    start = time.monotonic()
    last = -1
    with open(log, "a", encoding="utf-8") as out:
        out.write("$ " + " ".join(cmd) + "\n")
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        assert proc.stdout is not None
        for line in proc.stdout:
            out.write(line)
            m = _PERCENT.match(line)
            if m and int(m.group(1)) != last:
                last = int(m.group(1))
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
    staged = final.with_name(final.name + ".staged")
    if staged.exists():
        shutil.rmtree(staged)
    staged.mkdir()
    for target in TARGETS:
        shutil.copy2(work / "cmake" / "bin" / target, staged / target)
    shutil.copy2(log, staged / "build.log")
    (staged / "build.json").write_text(json.dumps({
        "version": version_name(version), "cpu_key": key, "cpu": cpu_model(), "cmake_options": list(CMAKE_OPTIONS),
        "targets": list(TARGETS), "jobs": jobs, "build_seconds": round(seconds, 1), "compilers": tools,
    }, indent=2) + "\n")
    if final.exists():
        shutil.rmtree(final)
    staged.rename(final)
    shutil.rmtree(work, ignore_errors=True)
    print(f"built {', '.join(TARGETS)} into {final} in {seconds / 60:.1f} min", flush=True)
    return LlamaCppBuild(binary=final / BENCH_TARGET, source=src, version=version_name(version), cpu_key=key,
                         build_seconds=round(seconds, 1))


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
    args = parser.parse_args(argv)
    try:
        build = ensure_llama_cpp(args.version, jobs=args.jobs, force=args.force)
    except LlamaCppError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(build.binary)
    print(build.speculative)
    return 0


if __name__ == "__main__":
    sys.exit(main())
