"""Native CPU kernels for the torch backend, compiled on first use with the system C compiler.

Only what plain torch does badly on a CPU lives here: decode attention read straight from the
paged KV pool (``csrc/paged_decode.c``). The shared library is built once per source, compiler
flags and machine into ``~/.cache/llmserve/kernels`` (``LLMSERVE_KERNEL_CACHE`` overrides it;
a per-user temp folder when home is not writable)
and loaded with ctypes, so there is no build step at install time and nothing to ship per CPU.
Without a compiler, or with ``LLMSERVE_CPU_KERNELS=0``, ``decode_kernel()`` returns None and the
backend keeps its torch path.
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
from typing import Callable

import torch

from . import switches

log = logging.getLogger("llmserve.backend.torch")

_SOURCE = Path(__file__).with_name("csrc") / "paged_decode.c"
_FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c11"]
_lock = threading.Lock()
DecodeKernel = Callable[..., None]
_loaded: dict[str, DecodeKernel | None] = {}


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


def _build(compiler: str) -> Path:
    source = _SOURCE.read_bytes()
    # The key covers everything that changes the binary: source, flags, compiler, CPU model.
    cpu = platform.machine() + platform.processor()
    try:
        cpu += next((ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")), "")
    except OSError:
        pass
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS, cpu]).encode()).hexdigest()[:16]
    target = _cache_dir() / f"paged_decode-{key}.so"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    log.info("compiling the CPU decode-attention kernel (once per machine) into %s", target.parent)
    # Build next to the target and rename: concurrent first starts never load a half-written file.
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        out = Path(tmp) / target.name
        proc = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", str(out), "-lm"],
                              capture_output=True, text=True, timeout=120)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "compiler failed")
        os.replace(out, target)
    return target


def decode_kernel() -> DecodeKernel | None:
    """The paged decode-attention function, or None when it cannot be had here (logged once)."""
    with _lock:
        if "decode" in _loaded:
            return _loaded["decode"]
        fn = None
        if not switches.enabled(switches.CPU_KERNELS):
            log.info("native CPU kernels disabled by LLMSERVE_CPU_KERNELS")
        elif not (compiler := os.environ.get("CC") or shutil.which("gcc") or shutil.which("cc")):
            log.info("no C compiler found: decode attention stays on the torch path")
        else:
            try:
                lib = ctypes.CDLL(str(_build(compiler)))
                fn = _wrap(lib.paged_decode_f32)
            except (OSError, RuntimeError, subprocess.SubprocessError) as exc:
                log.warning("the CPU decode-attention kernel is unavailable (%s); using the torch path", exc)
        _loaded["decode"] = fn
        return fn


def _wrap(cfn: ctypes._CFuncPtr) -> DecodeKernel:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    cfn.argtypes = [ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64, ctypes.c_int]
    cfn.restype = ctypes.c_int

    def paged_decode(q: torch.Tensor, blocks_view: torch.Tensor, tables: torch.Tensor, ctx: torch.Tensor,
                     out: torch.Tensor, scale: float, window: int | None) -> None:
        """``q``/``out [nd, H, D]``, ``blocks_view [2*kvh, nblocks, bs, D]``, ``tables [nd * max_blocks]``
        and ``ctx [nd]`` (int64): every tensor contiguous fp32 / int64 on the CPU."""
        nd, H, D = q.shape
        two_kvh, nblocks, bs, _ = blocks_view.shape
        rc = cfn(q.data_ptr(), blocks_view.data_ptr(), tables.data_ptr(), ctx.data_ptr(), out.data_ptr(),
                 nd, H, two_kvh // 2, D, nblocks, bs, tables.numel() // max(nd, 1), scale, window or 0,
                 torch.get_num_threads())
        if rc != 0:
            raise MemoryError("the decode-attention kernel could not allocate its scratch memory")

    return paged_decode
