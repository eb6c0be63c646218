"""The tensor-parallel worker process (ranks 1..N-1) and the step messages rank 0 sends it.

A message is one ``Connection.send_bytes`` of little-endian int64 values (no pickling):
``[kind, ...]``. A step is ``[STEP, mode, items, (tokens, start, blocks, sample, targets) per
item, token ids..., block tables...]`` with ``targets`` = -1 when the item asks for no prompt
logprobs; ``[KV, num_blocks, block_size]`` sizes the KV pool; ``[STOP]`` ends the worker.
The worker answers the load and the KV pool with ``ok`` or ``error:<Type>:<message>``.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
from multiprocessing.connection import Connection
from typing import Any

import torch

from llmserve import ServerConfig
from llmserve import KVCacheSpec, StepItem

log = logging.getLogger("llmserve.backend.torch.tp")

STEP, KV, STOP = 1, 2, 3
MODE_STEP, MODE_ALL = 0, 1  # logits of the rows a step samples / of every fed row (forward_logits)
_ITEM = 5


def encode_step(batch: list[StepItem], mode: int) -> bytes:
    """A step's batch as the worker needs it: what the forward and the logits rows depend on."""
    head = [STEP, mode, len(batch)]
    tokens: list[int] = []
    tables: list[int] = []
    for it in batch:
        targets = it.prompt_logprob_targets
        head += [len(it.token_ids), it.start_pos, len(it.block_table), int(it.sample),
                 -1 if targets is None else len(targets)]
        tokens += it.token_ids
        tables += it.block_table
    return torch.tensor(head + tokens + tables, dtype=torch.int64).numpy().tobytes()


def decode(message: bytes) -> list[int]:
    return torch.frombuffer(bytearray(message), dtype=torch.int64).tolist()


def decode_step(values: list[int]) -> tuple[int, list[StepItem]]:
    """(mode, items) of a decoded ``STEP`` message; items carry placeholder prompt-logprob targets."""
    mode, n = values[1], values[2]
    at = 3 + n * _ITEM
    items: list[StepItem] = []
    shapes = [values[3 + i * _ITEM: 3 + (i + 1) * _ITEM] for i in range(n)]
    tables_at = at + sum(s[0] for s in shapes)
    for n_tok, start, n_blocks, sample, targets in shapes:
        items.append(StepItem(seq_id=len(items), token_ids=values[at:at + n_tok], start_pos=start,
                              block_table=values[tables_at:tables_at + n_blocks], sample=bool(sample),
                              prompt_logprob_targets=None if targets < 0 else [0] * targets))
        at += n_tok
        tables_at += n_blocks
    return mode, items


def logit_rows(batch: list[StepItem], first_row: list[int]) -> list[int]:
    """The hidden rows whose logits a step computes: as ``TorchBackend.step`` picks them."""
    rows: list[int] = []
    for i, it in enumerate(batch):
        if it.prompt_logprob_targets is not None:
            rows += range(first_row[i], first_row[i] + len(it.prompt_logprob_targets))
        if it.sample:
            rows.append(first_row[i] + len(it.token_ids) - 1)
    return rows


def _watch_parent(parent_pid: int) -> None:
    """End this process when rank 0 is gone, whatever it is blocked in."""
    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)

    threading.Thread(target=watch, name="llmserve-tp-parent", daemon=True).start()


def _reply(conn: Connection, exc: BaseException | None) -> None:
    text = "ok" if exc is None else f"error:{type(exc).__name__}:{str(exc).splitlines()[0] if str(exc) else ''}"
    conn.send_bytes(text.encode())


def run(rank: int, world: int, config: ServerConfig, options: Any, init_method: str, conn: Connection, parent_pid: int,
        cores: list[int]) -> None:
    """Entry point of a spawned worker: join the group, load the shard, then replay rank 0's steps."""
    os.environ["LLMSERVE_PROGRESS"] = "off"  # rank 0 reports the start-up
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format=f"%(asctime)s %(levelname)s tp-rank{rank} %(name)s: %(message)s")
    _watch_parent(parent_pid)
    from .tensor_parallel import TensorParallelBackend

    code = 0
    backend = TensorParallelBackend(config, options, rank=rank, world=world)
    try:
        conn.send_bytes(b"hello")
        backend.start_rank(init_method, cores)
        try:
            backend.load()
        except Exception as exc:  # rank 0 raises it as the load's error
            _reply(conn, exc)
            raise
        _reply(conn, None)
        while True:
            values = decode(conn.recv_bytes())
            if values[0] == STEP:
                mode, items = decode_step(values)
                backend.replay(mode, items)
            elif values[0] == KV:
                try:
                    backend.init_kv_cache(KVCacheSpec(block_size=values[2], num_blocks=values[1]))
                except Exception as exc:  # rank 0 raises it
                    _reply(conn, exc)
                    raise
                _reply(conn, None)
            else:
                break
    except (EOFError, ConnectionError):
        code = 1  # rank 0 is gone
    except BaseException as exc:  # noqa: BLE001 - one line; rank 0 fails the server
        log.error("tensor-parallel rank %d failed: %s: %s", rank, type(exc).__name__, exc)
        code = 1
    finally:
        backend.close()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        os._exit(code)  # no interpreter teardown: a daemon thread or a collective must not keep it
