"""Tensor parallel for the torch backend (``--tensor-parallel-size N``): one rank per process.

The server process is rank 0: it schedules, runs its own shard and samples. It spawns ranks
1..N-1 (``tp_worker``), which load the same model and keep their shard (``tp_shard``). Every
step rank 0 sends the batch down a pipe to each worker, all ranks run the fused forward with
an all-reduce after ``o_proj`` and ``down_proj``, and the vocabulary-parallel logits are
gathered to rank 0. torch.distributed carries the collectives: gloo on the CPU (each rank
pinned to its own cores), nccl on CUDA (one GPU per rank). A worker that dies fails the
engine like any step error: rank 0's next collective or liveness check raises, and a watcher
kills an idle engine too, so the server answers in-flight requests with an error and exits.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import threading
import time
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist

from llmserve import ServerConfig
from llmserve import KVCacheSpec, ModelInfo, StepItem
from llmserve import ConfigError

from . import tp_shard, tp_worker
from .loader import LoadedModel, hf_directory, load_model
from .options import TorchOptions
from .runner import TorchBackend
from .vision import is_vision_config

log = logging.getLogger("llmserve.backend.torch.tp")

TIMEOUT_ENV = "LLMSERVE_TP_TIMEOUT"  # seconds a collective or the rendezvous may wait (default 120)


class WorkerDied(RuntimeError):
    """A tensor-parallel worker process ended while the server needed it."""


def rank_cores(world: int, rank: int, cores: list[int]) -> list[int]:
    """The cores of ``rank``: an equal share of ``cores`` (one core, shared, when there are fewer cores than ranks)."""
    if len(cores) < world:
        return [cores[rank % len(cores)]]
    per = len(cores) // world
    return cores[rank * per:(rank + 1) * per]


def _pin(cores: list[int]) -> None:
    """Pin every thread of this process (and so the threads they start) to ``cores``."""
    tasks = os.listdir("/proc/self/task") if os.path.isdir("/proc/self/task") else ["0"]
    for tid in tasks:
        try:
            os.sched_setaffinity(int(tid), cores)
        except OSError:  # a thread that just ended
            pass


class TensorParallelBackend(TorchBackend):
    """``TorchBackend`` over one shard; rank 0 (the server's) also drives the workers."""

    verifies_drafts = False  # the workers' logits rows (tp_worker.logit_rows) know one sample per item

    def __init__(self, config: ServerConfig, options: TorchOptions | None = None, rank: int = 0,
                 world: int | None = None) -> None:
        super().__init__(config, options)
        self.rank = rank
        self.world = int(world or config.parallel.tensor_parallel_size)
        self.reduce_s = 0.0  # seconds spent in all-reduces and the logits gather (debug, bench)
        self._reduce_mark = 0.0
        self._mode = tp_worker.MODE_STEP
        self._procs: list[Any] = []
        self._conns: list[Connection] = []
        self._closing = False
        self._vocab = 0
        self._shard = tp_shard.HeadShard(0, 0, 0, 0)
        self._affinity: list[int] = []  # the cores this process had before pinning (given back by close)
        self._broken = False  # a worker died: the process group cannot be torn down in order

    # ------------------------------------------------------------------ process group
    def start_rank(self, init_method: str, cores: list[int]) -> None:
        """Pin this rank's cores (CPU) or pick its GPU, then join the process group."""
        cuda = self.config.llm.device != "cpu" and torch.cuda.is_available()
        if cuda:
            if torch.cuda.device_count() < self.world:
                raise ConfigError(f"--tensor-parallel-size {self.world} needs {self.world} GPUs; "
                                  f"{torch.cuda.device_count()} visible")
            torch.cuda.set_device(self.rank)
            # Each rank loads onto its own GPU (a bare "cuda" would mean the first one to the loader).
            device = f"cuda:{self.rank}"
            llm = self.config.llm.model_copy(update={"device": device})
            self.config = self.config.model_copy(update={"llm": llm})
        elif cores and hasattr(os, "sched_setaffinity"):
            self._affinity = sorted(os.sched_getaffinity(0))
            _pin(cores)
            if self.options.threads is None:
                self.options = self.options.model_copy(update={"threads": len(cores)})
        timeout = datetime.timedelta(seconds=float(os.environ.get(TIMEOUT_ENV, "120")))
        dist.init_process_group("nccl" if cuda else "gloo", init_method=init_method, rank=self.rank,
                                world_size=self.world, timeout=timeout)

    def _spawn(self) -> None:
        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        port = int(os.environ.get("MASTER_PORT", "0")) or _free_port(addr)
        init = f"tcp://{addr}:{port}"
        cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
        ctx = torch.multiprocessing.get_context("spawn")
        for rank in range(1, self.world):
            mine, theirs = ctx.Pipe()
            proc = ctx.Process(target=tp_worker.run, name=f"llmserve-tp{rank}", daemon=True,
                               args=(rank, self.world, self.config, self.options, init, theirs, os.getpid(),
                                     rank_cores(self.world, rank, cores) if cores else []))
            proc.start()
            theirs.close()  # only the worker holds its end: its death reads as EOF here
            self._procs.append(proc)
            self._conns.append(mine)
        for rank in range(1, self.world):
            self._expect(rank, "starting", b"hello")
        self.start_rank(init, rank_cores(self.world, 0, cores) if cores else [])
        threading.Thread(target=self._watch, name="llmserve-tp-watch", daemon=True).start()

    def _expect(self, rank: int, doing: str, want: bytes = b"ok") -> None:
        """Wait for worker ``rank``'s answer, raising at once if it dies instead."""
        conn, proc = self._conns[rank - 1], self._procs[rank - 1]
        ready = wait([conn, proc.sentinel])
        if conn in ready:
            try:
                answer = conn.recv_bytes()
            except (EOFError, OSError):
                answer = b""
            if answer == want:
                return
            if answer.startswith(b"error:"):
                kind, _, text = answer[6:].decode(errors="replace").partition(":")
                if kind == "ConfigError":
                    raise ConfigError(text)
                raise WorkerDied(f"tensor-parallel rank {rank} failed while {doing}: {kind}: {text}")
        proc.join(5)
        self._broken = True
        raise WorkerDied(f"tensor-parallel rank {rank} died while {doing} (exit code {proc.exitcode})")

    def _watch(self) -> None:
        """Fail an idle engine when a worker dies (a busy one fails in its step already)."""
        ready = wait([p.sentinel for p in self._procs])
        if self._closing:
            return
        dead = [rank for rank, p in enumerate(self._procs, 1) if p.sentinel in ready]
        self._procs[dead[0] - 1].join(1)
        self._broken = True
        exc = WorkerDied(f"tensor-parallel rank {dead[0]} died (exit code {self._procs[dead[0] - 1].exitcode})")
        log.error("%s", exc)
        from llmserve import EngineLoop

        def fail() -> None:
            raise exc

        for thread in threading.enumerate():
            if isinstance(thread, EngineLoop) and thread.engine.backend is self:
                try:
                    thread.submit(fail)
                except Exception:  # noqa: BLE001 - already dead: nothing left to fail
                    pass

    def _check_workers(self) -> None:
        for rank, proc in enumerate(self._procs, 1):
            if proc.exitcode is not None:
                self._broken = True
                raise WorkerDied(f"tensor-parallel rank {rank} died (exit code {proc.exitcode})")

    def _send(self, message: bytes) -> None:
        for rank, conn in enumerate(self._conns, 1):
            try:
                conn.send_bytes(message)
            except OSError:
                raise WorkerDied(f"tensor-parallel rank {rank} is gone (its pipe is closed)") from None

    # ------------------------------------------------------------------ lifecycle
    def load(self) -> ModelInfo:
        if self.rank == 0:
            source = self.config.llm.model
            from transformers import AutoConfig

            # GGUF files go through the converted (dequantized) directory: each rank slices plain tensors.
            hf_dir = hf_directory(source, self.config.llm.cache_dir)
            cfg = AutoConfig.from_pretrained(hf_dir, trust_remote_code=self.config.llm.trust_remote_code)
            name = os.path.basename(str(source or hf_dir))
            tp_shard.check(tp_shard.text_config(cfg), self.world, f"model {name!r}")
            if is_vision_config(cfg):  # the worker ranks' steps carry no images
                raise ConfigError(f"model {name!r} reads images, which tensor parallel does not serve yet: serve it "
                                  "with --tensor-parallel-size 1")
            if not self.options.fused_forward:
                raise ConfigError("--tensor-parallel-size needs the fused forward (--torch-fused-forward)")
        try:
            if self.rank == 0:
                self._spawn()
            info = super().load()
            if self._fused is None:
                raise ConfigError("tensor parallel runs on the fused forward, which this model does not take")
            self._fused.reduce = self._all_reduce
            self._fused.heads, self._fused.kv_heads = self._shard.heads, self._shard.kv_heads
            self._kv_heads = self._shard.kv_heads
            for rank in range(1, len(self._procs) + 1):
                self._expect(rank, "loading the model")
        except BaseException:
            if self.rank == 0:
                self.close()
            raise
        log.info("tensor parallel rank %d/%d: %d of the query heads, %d KV heads", self.rank, self.world,
                 self._shard.heads, self._shard.kv_heads)
        return info

    def _load_model(self) -> LoadedModel:
        lm = load_model(self.config.llm)
        self._vocab = lm.vocab_size
        self._shard = tp_shard.shard_model(lm.model, self.world, self.rank)
        return lm

    def init_kv_cache(self, spec: KVCacheSpec) -> int:
        if self.rank != 0:
            return super().init_kv_cache(spec)
        if spec.num_blocks is None and self._require_loaded().device.type == "cpu":
            # Every rank's pool lives in the same memory: each takes its share of the fraction.
            spec = KVCacheSpec(spec.block_size, None, (spec.memory_fraction or 0.5) / self.world, spec.min_blocks)
        num_blocks = super().init_kv_cache(spec)
        self._send(torch.tensor([tp_worker.KV, num_blocks, spec.block_size], dtype=torch.int64).numpy().tobytes())
        for rank in range(1, self.world):
            self._expect(rank, "allocating its KV pool")
        return num_blocks

    def plan(self) -> str:
        return f"{super().plan()} tensor_parallel={self.world} ({dist.get_backend() if dist.is_initialized() else '-'})"

    def close(self) -> None:
        self._closing = True
        if self.rank == 0 and self._procs:
            stop = torch.tensor([tp_worker.STOP], dtype=torch.int64).numpy().tobytes()
            for conn in self._conns:
                try:
                    conn.send_bytes(stop)
                except OSError:
                    pass
            deadline = time.monotonic() + 5
            for proc in self._procs:
                proc.join(max(0.0, deadline - time.monotonic()))
                if proc.exitcode is None:
                    proc.kill()
                    proc.join(5)
            for conn in self._conns:
                conn.close()
            self._procs, self._conns = [], []
            if dist.is_initialized() and not self._broken:
                dist.destroy_process_group()
        if self._affinity:
            _pin(self._affinity)
            self._affinity = []
        super().close()

    # ------------------------------------------------------------------ collectives
    def _all_reduce(self, t: torch.Tensor) -> None:
        t0 = time.perf_counter()
        try:
            dist.all_reduce(t)
        except RuntimeError as exc:  # a peer died or timed out (gloo/nccl raise, never hang past the timeout)
            raise self._failed(exc) from exc
        self.reduce_s += time.perf_counter() - t0

    def _failed(self, exc: BaseException) -> WorkerDied:
        self._broken = True
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        return WorkerDied(f"tensor-parallel rank {self.rank}: a collective failed ({first})")

    def _gather(self, part: torch.Tensor) -> torch.Tensor:
        """Rank 0: every rank's vocabulary slice side by side, padding cut; others: ``part``."""
        t0 = time.perf_counter()
        part = part.contiguous()
        try:
            if dist.get_backend() == "nccl":
                parts = [torch.empty_like(part) for _ in range(self.world)]
                dist.all_gather(parts, part)
            else:
                parts = [torch.empty_like(part) for _ in range(self.world)] if self.rank == 0 else None
                dist.gather(part, parts, dst=0)
        except RuntimeError as exc:
            raise self._failed(exc) from exc
        self.reduce_s += time.perf_counter() - t0
        return torch.cat(parts, dim=1)[:, :self._vocab] if self.rank == 0 and parts is not None else part

    # ------------------------------------------------------------------ step
    def _forward(self, batch: list[StepItem], every_row: bool = True) -> tuple[torch.Tensor, list[int]]:
        if self.rank == 0 and self._procs:
            self._check_workers()
            if log.isEnabledFor(logging.DEBUG):  # the previous step's share of the collectives
                log.debug("tensor parallel: %.2f ms in collectives in the last step",
                          (self.reduce_s - self._reduce_mark) * 1000)
                self._reduce_mark = self.reduce_s
            if all(it.token_ids for it in batch):  # else the forward refuses it before any collective
                self._send(tp_worker.encode_step(batch, self._mode))
        return super()._forward(batch, every_row)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._gather(super()._logits(hidden))

    @torch.inference_mode()
    def forward_logits(self, batch: list[StepItem]) -> list[torch.Tensor]:
        if not batch:
            return []
        self._mode = tp_worker.MODE_ALL
        try:
            hidden, first_row = self._forward(batch)
        finally:
            self._mode = tp_worker.MODE_STEP
        logits = self._logits(hidden)
        return [logits[r:r + len(it.token_ids)] for r, it in zip(first_row, batch)]

    @torch.inference_mode()
    def replay(self, mode: int, batch: list[StepItem]) -> None:
        """A worker's share of rank 0's step: the forward, then the logits rows rank 0 gathers."""
        hidden, first_row = self._forward(batch)
        rows = list(range(hidden.shape[0])) if mode == tp_worker.MODE_ALL else tp_worker.logit_rows(batch, first_row)
        if rows:
            self._logits(hidden if rows == list(range(hidden.shape[0]))
                         else hidden[torch.tensor(rows, device=hidden.device)])


def _free_port(addr: str) -> int:
    with socket.socket() as s:
        s.bind((addr, 0))
        return int(s.getsockname()[1])
