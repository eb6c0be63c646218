"""Compile ``csrc/<name>.c`` once per source, flags and machine, cache the shared library, load it.

Each library is built into ``~/.cache/llmserve/kernels`` (``LLMSERVE_KERNEL_CACHE`` overrides it;
a per-user temp folder when home is not writable) and loaded with ctypes, so there is no build
step at install time and nothing to ship per CPU. Without a compiler or when the build fails,
``library()`` returns None and the caller keeps its torch path. Whether to use the kernels at
all is the backend's choice (``TorchOptions.cpu_kernels``), not this module's.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

from llmserve import progress

log = logging.getLogger("llmserve.backend.torch")

CSRC = Path(__file__).with_name("csrc")
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
_loaded: dict[str, ctypes.CDLL | None] = {}
_building: dict[str, threading.Lock] = {}

PTR, I64, INT, F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float


def _cache_dir() -> Path:
    """``$LLMSERVE_KERNEL_CACHE``, else ``~/.cache/llmserve/kernels``, else (no writable home,
    e.g. a locked-down service user) a per-user folder under the system temp dir."""
    explicit = os.environ.get("LLMSERVE_KERNEL_CACHE")
    if explicit:
        return Path(explicit)
    home = Path.home() / ".cache" / "llmserve" / "kernels"
    try:
        home.mkdir(parents=True, exist_ok=True)
        if os.access(home, os.W_OK):
            return home
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"llmserve-kernels-{os.getuid() if hasattr(os, 'getuid') else 'user'}"


def _build(compiler: str, name: str, flags: list[str]) -> Path:
    path = CSRC / f"{name}.c"
    # Shared headers are part of every kernel's source as far as the cache is concerned.
    source = path.read_bytes() + b"".join(h.read_bytes() for h in sorted(CSRC.glob("*.h")))
    # The key covers everything that changes the binary: source, flags, compiler, CPU model.
    cpu = platform.machine() + platform.processor()
    try:
        cpu += next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "")
    except OSError:
        pass
    key = hashlib.sha256(source + " ".join([compiler, *flags, cpu]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU kernel %s (once per machine) into %s", name, target.parent)
    # Build next to the target and rename: concurrent first starts never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp, progress.phase(f"compiling the CPU kernel {name}"):
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *flags, str(path), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "compiler failed")
        os.replace(out, target)
    return target


def library(name: str, what: str) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` built and loaded, or None when it cannot be had here (logged once)."""
    with _lock:
        if name in _loaded:
            return _loaded[name]
        own = _building.setdefault(name, threading.Lock())
    with own:  # one build per kernel; different kernels build side by side
        if name in _loaded:
            return _loaded[name]
        lib = _compile_and_load(name, what, _FLAGS)
        _loaded[name] = lib
        return lib


def _compile_and_load(name: str, what: str, flags: list[str]) -> ctypes.CDLL | None:
    if not (compiler := os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")):
        log.info("no C compiler found: %s stays on the torch path", what)
        return None
    try:
        return ctypes.CDLL(str(_build(compiler, name, flags)))
    except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
        log.warning("the CPU %s kernel is unavailable (%s); using the torch path", what, exc)
        return None


def baseline_library(name: str, what: str) -> ctypes.CDLL | None:
    """``csrc/<name>.c`` built without AVX-512 (``-mno-avx512f``): the code every AVX2 CPU
    runs, for tests that hold the AVX-512 paths to it on a CPU that has both. Not cached in
    this process: ``library()`` keeps returning the regular build."""
    return _compile_and_load(name, f"{what} (AVX2)", [*_FLAGS, "-mno-avx512f"])


def kernel_names() -> list[str]:
    """Every kernel this package can build (``csrc/*.c``)."""
    return sorted(p.stem for p in CSRC.glob("*.c"))


def build_all() -> dict[str, bool]:
    """Build (or find cached) every kernel, two compilers at a time; ``name -> usable``.
    ``llmserve warmup`` calls it so that the first ``serve`` finds them built."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(kernel_names(), pool.map(lambda n: library(n, n) is not None, kernel_names())))


def bind(lib: ctypes.CDLL, name: str, restype: Any, *argtypes: Any) -> ctypes._CFuncPtr:
    """``lib.name`` with its C signature declared."""
    fn = getattr(lib, name)
    fn.argtypes, fn.restype = list(argtypes), restype
    return fn
