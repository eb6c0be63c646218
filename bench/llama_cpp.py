"""llama.cpp's tools for the GGUF benchmark: ``llama-server``, ``llama-quantize`` and the
``convert_hf_to_gguf.py`` converter.

The binaries are taken from ``--llama-cpp DIR`` (a build or install folder; searched below it)
or from PATH; failing that they are built from the llama.cpp sources that the
llama-cpp-python sdist vendors: the sdist is fetched with pip into the cache folder
(``~/.cache/llmserve/llama.cpp/`` by default), unpacked, configured with cmake (CPU only,
``-DGGML_NATIVE=ON``, no curl) and only the two targets are built. The converter always comes
from the unpacked sdist (with its ``gguf-py``). This is bench-only tooling: nothing in the
package or the tests depends on it.

    python bench/llama_cpp.py                 # find or build, then print the paths
    python bench/llama_cpp.py --jobs 2 --llama-cpp /opt/llama.cpp/build
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

DEFAULT_CACHE = Path.home() / ".cache" / "llmserve" / "llama.cpp"
TARGETS = ("llama-server", "llama-quantize")


@dataclass
class LlamaCpp:
    """Paths of the llama.cpp tools the benchmark runs."""

    server: Path
    quantize: Path
    source: Path | None  # the vendored llama.cpp tree (None when only binaries were found)

    @property
    def converter(self) -> Path:
        if self.source is None:
            raise RuntimeError("no llama.cpp source tree: run bench/llama_cpp.py without --llama-cpp once")
        return self.source / "convert_hf_to_gguf.py"

    @property
    def gguf_py(self) -> Path:
        return self.converter.parent / "gguf-py"

    def converter_env(self) -> dict[str, str]:
        """Environment for running the converter with the vendored ``gguf`` package first."""
        path = os.pathsep.join(p for p in (str(self.gguf_py), os.environ.get("PYTHONPATH", "")) if p)
        return {**os.environ, "PYTHONPATH": path}


def log(msg: str) -> None:
    print(f"[llama.cpp] {msg}", flush=True)


def find_binary(name: str, llama_cpp_dir: Path | None) -> Path | None:
    """``name`` below ``llama_cpp_dir`` (bin/ or anywhere under it), else on PATH."""
    if llama_cpp_dir is not None:
        for candidate in (llama_cpp_dir / name, llama_cpp_dir / "bin" / name):
            if candidate.is_file() and os.access(candidate, os.X_OK):
                return candidate
        found = sorted(p for p in llama_cpp_dir.rglob(name) if p.is_file() and os.access(p, os.X_OK))
        if found:
            return found[0]
        return None
    which = shutil.which(name)
    return Path(which) if which else None


def unpacked_source(cache: Path) -> Path:
    """The vendored llama.cpp folder of the llama-cpp-python sdist, fetched and unpacked once."""
    sdist_dir = cache / "sdist"
    archives = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    if not archives:
        sdist_dir.mkdir(parents=True, exist_ok=True)
        log(f"downloading the llama-cpp-python sdist into {sdist_dir}")
        # pip reads the sdist's metadata through its build backend (scikit-build-core), in an
        # isolated environment: a minute, but nothing is compiled.
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps",
                        "llama-cpp-python", "-d", str(sdist_dir)], check=True)
        archives = sorted(sdist_dir.glob("llama_cpp_python-*.tar.gz"))
    archive = archives[-1]
    root = cache / archive.name.removesuffix(".tar.gz")
    source = root / "vendor" / "llama.cpp"
    if not (source / "CMakeLists.txt").is_file():
        log(f"unpacking {archive.name}")
        with tarfile.open(archive) as tar:
            tar.extractall(cache, filter="data")
    if not (source / "CMakeLists.txt").is_file():
        raise RuntimeError(f"{archive} has no vendor/llama.cpp/CMakeLists.txt")
    return source


def cmake_exe() -> str:
    """cmake from PATH or the venv; pip-installed into the venv when missing."""
    found = shutil.which("cmake") or shutil.which("cmake", path=str(Path(sys.executable).parent))
    if found:
        return found
    log("cmake not found: pip-installing it into this environment")
    subprocess.run([sys.executable, "-m", "pip", "install", "cmake"], check=True)
    return str(Path(sys.executable).parent / "cmake")


def amx_flags_supported() -> bool:
    """Whether the C compiler takes -mno-amx-* (GCC 11+, recent clang; x86 only)."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        return False
    probe = subprocess.run([cc, "-mno-amx-int8", "-x", "c", "-E", "-", "-o", os.devnull], input="",
                           capture_output=True, text=True)
    return probe.returncode == 0


def build(source: Path, build_dir: Path, jobs: int) -> None:
    """Configure and build only the server and quantize targets, streaming progress (both steps
    are quick no-ops on an up-to-date build)."""
    cmake = cmake_exe()
    generator = [] if (build_dir / "CMakeCache.txt").is_file() or not shutil.which("ninja") else ["-G", "Ninja"]
    # -march=native turns on AMX where the CPU reports it, and ggml's AMX matmul crashes on
    # such VMs (Sapphire Rapids guests: SIGSEGV in ggml_backend_amx_mul_mat on the first
    # Q8_0/Q4_0 product, llama.cpp issue 20824); without it the usual AVX-512 repacked kernels
    # run. An explicit -mno-* wins over -march=native whatever the order.
    no_amx = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16" if amx_flags_supported() else ""
    cmd = [cmake, "-S", str(source), "-B", str(build_dir), *generator, "-DCMAKE_BUILD_TYPE=Release",
           "-DLLAMA_CURL=OFF", "-DGGML_NATIVE=ON", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_BUILD_TESTS=OFF",
           "-DLLAMA_BUILD_EXAMPLES=OFF", "-DBUILD_SHARED_LIBS=OFF", f"-DCMAKE_C_FLAGS={no_amx}",
           f"-DCMAKE_CXX_FLAGS={no_amx}"]
    log("configuring: " + " ".join(cmd))
    configure = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if configure.returncode != 0:
        print(configure.stdout, file=sys.stderr)
        raise RuntimeError(f"configuring llama.cpp failed (exit {configure.returncode})")
    cmd = [cmake, "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", *TARGETS]
    log("building: " + " ".join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        # Ninja's "[n/m]" and make's "[ p%]" lines are the progress; warnings are left out.
        if line.startswith("[") or "error" in line.lower():
            print(f"[llama.cpp]   {line.rstrip()[:160]}", flush=True)
    if proc.wait() != 0:
        raise RuntimeError(f"building llama.cpp failed (exit {proc.returncode}); rerun: {' '.join(cmd)}")


def ensure(llama_cpp_dir: str | Path | None = None, cache: str | Path | None = None, jobs: int = 2,
           need_source: bool = False) -> LlamaCpp:
    """Find llama-server and llama-quantize in ``llama_cpp_dir`` or on PATH, else build them in
    the cache folder. The cached build is brought up to date on every call (a no-op of seconds
    when it is), so a build that was cut short, or one made with other flags, is finished
    rather than used. ``need_source`` also unpacks the vendored sources (for the converter)."""
    cache_dir = Path(cache).expanduser() if cache else DEFAULT_CACHE
    given = Path(llama_cpp_dir).expanduser() if llama_cpp_dir else None
    binaries = [find_binary(name, given) for name in TARGETS]
    if None in binaries and given is not None:
        raise RuntimeError(f"{given} has no llama-server / llama-quantize")
    source = unpacked_source(cache_dir) if (None in binaries or need_source) else None
    if None in binaries:
        assert source is not None
        build(source, cache_dir / "build", jobs)
        binaries = [find_binary(name, cache_dir / "build" / "bin") for name in TARGETS]
        if None in binaries:
            raise RuntimeError(f"the build left no {TARGETS} under {cache_dir / 'build' / 'bin'}")
    server, quantize = binaries
    assert server is not None and quantize is not None
    return LlamaCpp(server, quantize, source)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--llama-cpp", default=None, help="folder holding llama-server and llama-quantize")
    ap.add_argument("--cache", default=None, help=f"download and build folder (default {DEFAULT_CACHE})")
    ap.add_argument("--jobs", type=int, default=2, help="parallel compile jobs")
    args = ap.parse_args()
    tools = ensure(args.llama_cpp, args.cache, args.jobs, need_source=True)
    print(f"llama-server:   {tools.server}")
    print(f"llama-quantize: {tools.quantize}")
    print(f"converter:      {tools.converter}")
    print(f"gguf-py:        {tools.gguf_py}")


if __name__ == "__main__":
    main()
