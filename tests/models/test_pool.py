"""The model pool without a server: slots from ``--models`` entries and a models folder, loads on
demand shared by concurrent requests, a failed load answered to each waiter and retried later,
leases, keep_alive, idle expiry and least-recently-used eviction at ``--max-loaded-models``."""

from __future__ import annotations

import asyncio
import threading

import pytest

from llmserve.config import ServerConfig
from llmserve.errors import ConfigError, OverloadedError, RequestTimeoutError
from llmserve.server.models import cached_entries, folder_entries
from llmserve.server.pool import ModelLoadError, ModelNotLoaded, ModelPool, ModelSlot, entry_slot, run_routed


class FakeEngine:
    def __init__(self, name: str) -> None:
        self.name, self.stopped = name, False

    def shutdown(self) -> None:
        self.stopped = True


def make_pool(*names: str, fail: set[str] | None = None, max_loaded: int | None = None,
              idle: float | None = None) -> tuple[ModelPool, list[str]]:
    """A pool of ``names`` (the first the default) whose loader records each load and fails for
    the names in ``fail`` (while they are in it)."""
    config = ServerConfig()
    slots = [entry_slot(config, f"{n}=/models/{n}") for n in names]
    pool = ModelPool(slots[0], slots[1:])
    loads: list[str] = []
    gate = threading.Event()
    gate.set()

    def loader(slot: ModelSlot) -> None:
        gate.wait(10)
        loads.append(slot.name)
        if fail and slot.name in fail:
            raise ConfigError(f"model path '/models/{slot.name}' does not exist\nsecond line")
        slot.engine = FakeEngine(slot.name)

    pool.loader = loader
    pool.configure(max_loaded, idle)
    pool.gate = gate
    return pool, loads


async def until(check, seconds: float = 30.0) -> bool:
    """Wait for ``check()`` (an unload finishes on a worker thread), within ``seconds``."""
    for _ in range(int(seconds / 0.01)):
        if check():
            return True
        await asyncio.sleep(0.01)
    return check()


def test_entries_name_their_models():
    config = ServerConfig(max_model_len=512)
    slot = entry_slot(config, "org/Model-1B-GGUF:Q8_0")
    assert slot.names == ["org/Model-1B-GGUF:Q8_0"] and slot.source == "org/Model-1B-GGUF:Q8_0"
    slot = entry_slot(config, "small=/data/models/tiny.gguf")
    assert slot.names == ["small"] and slot.source == "/data/models/tiny.gguf"
    assert slot.answers_to("small") and slot.answers_to("/data/models/tiny.gguf") and not slot.answers_to("tiny")
    slot = entry_slot(config, "./models/qwen3-dir/")
    assert slot.names == ["qwen3-dir"]
    # A YAML mapping carries the model's own settings; the rest are the server's.
    slot = entry_slot(config, {"model": "/m/x", "served_model_name": ["x", "x-alias"], "dtype": "bfloat16",
                               "num_kv_blocks": 64})
    assert slot.names == ["x", "x-alias"] and slot.config.llm.dtype == "bfloat16"
    assert slot.config.cache.num_kv_blocks == 64 and slot.config.llm.max_model_len == 512
    assert config.llm.dtype == "auto" and config.cache.num_kv_blocks is None  # the server's own untouched


def test_config_refuses_unknown_entry_keys_and_cli_model_repeats(tmp_path):
    with pytest.raises(ValueError, match="unknown key 'weights' in a models entry"):
        ServerConfig(models=[{"model": "/m", "weights": "x"}])
    with pytest.raises(ValueError, match="needs `model`"):
        ServerConfig(models=[{"dtype": "float32"}])
    from conftest import run_cli

    out = run_cli("config", "show", "--json", "--model", "/a", "--model", "b=/b", "--model", "org/c")
    assert out.returncode == 0, out.stderr
    import json

    shown = json.loads(out.stdout)
    assert shown["model"]["value"] == "/a" and shown["models"]["value"] == ["b=/b", "org/c"]


def test_a_models_folder_lists_ggufs_splits_and_directories(tmp_path):
    for name in ("a.Q4_K_M.gguf", "big-00001-of-00002.gguf", "big-00002-of-00002.gguf", "mmproj-a.gguf",
                 "notes.txt"):
        (tmp_path / name).write_bytes(b"x")
    (tmp_path / "hfdir").mkdir()
    (tmp_path / "hfdir" / "config.json").write_text("{}")
    (tmp_path / "empty").mkdir()
    assert folder_entries(str(tmp_path)) == [f"a.Q4_K_M={tmp_path}/a.Q4_K_M.gguf",
                                             f"big={tmp_path}/big-00001-of-00002.gguf", f"hfdir={tmp_path}/hfdir"]
    with pytest.raises(ConfigError, match="--models-dir .*cannot list it"):
        folder_entries(str(tmp_path / "missing"))


def test_the_cached_models_are_the_entries_ls_lists_each_from_its_newest_snapshot(tmp_path, monkeypatch):
    import os

    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    assert cached_entries() == []
    repo = tmp_path / "models--org--tiny" / "snapshots"
    for commit, stamp in (("a" * 40, 1_000), ("b" * 40, 2_000)):  # b is the newer snapshot
        (repo / commit).mkdir(parents=True)
        for name in ("config.json", "model.safetensors"):
            (repo / commit / name).write_bytes(b"{}")
        os.utime(repo / commit, (stamp, stamp))
    quants = tmp_path / "models--org--tiny-GGUF" / "snapshots" / ("c" * 40)
    quants.mkdir(parents=True)
    for name in ("tiny-Q8_0.gguf", "tiny-Q4_K_M.gguf", "mmproj-tiny-f16.gguf"):
        (quants / name).write_bytes(b"GGUF")  # only the magic, as a file cut short: listed all the same
    (tmp_path / "models--org--tiny" / "snapshots" / "not-a-commit").mkdir()
    assert sorted(cached_entries()) == [f"org/tiny-GGUF:Q4_K_M={quants}/tiny-Q4_K_M.gguf",
                                        f"org/tiny-GGUF:Q8_0={quants}/tiny-Q8_0.gguf", f"org/tiny={repo / ('b' * 40)}"]


def test_concurrent_requests_share_one_load():
    pool, loads = make_pool("base", "other")

    async def main() -> None:
        pool.gate.clear()  # the load blocks until both requests wait on it
        other = pool.find("other")
        waiters = [asyncio.create_task(pool.ensure(other)) for _ in range(3)]
        await asyncio.sleep(0.05)
        assert other.state == "loading" and not any(w.done() for w in waiters)
        pool.gate.set()
        await asyncio.gather(*waiters)
        assert other.state == "loaded" and other.engine.name == "other"

    asyncio.run(main())
    assert loads == ["other"]


def test_a_failed_load_reaches_every_waiter_and_is_retried_on_the_next_request():
    failing = {"broken"}
    pool, loads = make_pool("base", "broken", fail=failing)

    async def main() -> None:
        broken = pool.find("broken")
        results = await asyncio.gather(*(pool.ensure(broken) for _ in range(2)), return_exceptions=True)
        for result in results:
            assert isinstance(result, ModelLoadError) and result.status == 500
            assert str(result) == ("the model `broken` could not be loaded: model path '/models/broken' does not "
                                   "exist")
        assert broken.state == "failed" and broken.engine is None and loads == ["broken"]
        failing.clear()  # fixed on disk: the next request loads it
        await pool.ensure(broken)
        assert broken.state == "loaded" and loads == ["broken", "broken"]

    asyncio.run(main())


def test_least_recently_used_idle_model_makes_room_and_busy_ones_are_kept():
    pool, loads = make_pool("base", "a", "b", "c", max_loaded=2)

    async def main() -> None:
        a, b, c = (pool.find(n) for n in "abc")
        await pool.ensure(pool.default)  # the default model: loaded, and not counted
        await pool.ensure(a)
        await pool.ensure(b)
        pool.lease(a)
        pool.release(a)  # a used after b: b is the least recently used
        await pool.ensure(c)
        assert [s.name for s in pool.loaded()] == ["base", "a", "c"]
        assert b.engine is None and b.state == "unloaded"
        pool.lease(a)
        pool.lease(c)  # both busy: no room for b
        with pytest.raises(OverloadedError, match="2 models are loaded .* all of them are serving requests"):
            await pool.ensure(b)
        pool.release(c)
        await pool.ensure(b)
        assert [s.name for s in pool.loaded()] == ["base", "a", "b"]

    asyncio.run(main())
    assert loads == ["base", "a", "b", "c", "b"]


def test_keep_alive_and_idle_expiry():
    pool, _ = make_pool("base", "a", idle=30.0)

    async def main() -> None:
        base, a = pool.find("base"), pool.find("a")
        await pool.ensure(a)
        engine = a.engine
        pool.lease(a)
        pool.release(a)  # the server's idle time
        assert a.expires_at is not None and 29 < a.expires_at - a.last_used <= 30
        pool.lease(a)
        assert a.expires_at is None  # in use: never expires
        pool.release(a, keep_alive=-1)  # Ollama's keep_alive -1: stay loaded
        assert a.expires_at is None
        pool.lease(a)
        pool.release(a, keep_alive=0)  # keep_alive 0: unloaded as the request ends
        assert await until(lambda: engine.stopped) and a.engine is None
        # The default model stays loaded whatever a request asks.
        pool.default.engine = FakeEngine("base")
        pool.lease(base)
        pool.release(base, keep_alive=0)
        await asyncio.sleep(0.05)
        assert base.engine is not None and not await pool.unload(base)

    asyncio.run(main())


def test_the_reaper_unloads_expired_idle_models(monkeypatch):
    import llmserve.server.pool as pool_module

    monkeypatch.setattr(pool_module, "REAP_INTERVAL_S", 0.01)
    pool, _ = make_pool("base", "a", "b")

    async def main() -> None:
        a, b = pool.find("a"), pool.find("b")
        await pool.ensure(a)
        await pool.ensure(b)
        for slot in (a, b):
            pool.lease(slot)
        pool.release(a, keep_alive=0.02)
        reaper = asyncio.create_task(pool.reap())
        await until(lambda: a.engine is None)
        reaper.cancel()
        assert a.engine is None and b.engine is not None and b.leases == 1

    asyncio.run(main())


def test_a_model_loaded_ahead_and_never_used_unloads_once_idle(monkeypatch):
    import llmserve.server.pool as pool_module

    monkeypatch.setattr(pool_module, "REAP_INTERVAL_S", 0.01)
    pool, _ = make_pool("base", "a", "b", idle=0.05)

    async def main() -> None:
        a, b = pool.find("a"), pool.find("b")
        await pool.ensure(a)  # what /models/load does: no request ever leases it
        await pool.ensure(b)
        pool.lease(b)  # b is in use, and stays loaded however long that takes
        assert a.expires_at is not None and b.expires_at is None
        reaper = asyncio.create_task(pool.reap())
        assert await until(lambda: a.engine is None)
        reaper.cancel()
        assert b.engine is not None

    asyncio.run(main())


def test_a_models_size_counts_the_gpu_memory_its_load_reserved(monkeypatch):
    import llmserve.server.pool as pool_module

    gpu = {"bytes": 0}
    monkeypatch.setattr(pool_module, "_cuda_reserved_bytes", lambda: gpu["bytes"])
    pool, _ = make_pool("base", "a")

    def loader(slot: ModelSlot) -> None:
        gpu["bytes"] += 3 * 2**30  # its weights and KV cache, on the GPU
        slot.engine = FakeEngine(slot.name)

    pool.loader = loader

    async def main() -> None:
        a = pool.find("a")
        await pool.ensure(a)
        # The RSS barely moved; the size is what the GPU took (RSS noise of a few MiB aside).
        assert 3 * 2**30 <= a.size_bytes < 3 * 2**30 + 256 * 2**20

    asyncio.run(main())


def test_memory_short_of_a_models_measured_size_unloads_idle_models_first(monkeypatch):
    import llmserve.server.pool as pool_module

    free = {"bytes": 10 * 2**30}
    monkeypatch.setattr(pool_module, "available_memory", lambda device: free["bytes"])
    pool, loads = make_pool("base", "a", "b")

    async def main() -> None:
        a, b = pool.find("a"), pool.find("b")
        await pool.ensure(a)
        b.size_bytes = 4 * 2**30  # what b took when it last loaded
        free["bytes"] = 2 * 2**30  # less than that is free now: the idle a goes first
        original = pool.unload

        async def unload(slot, force=False):
            free["bytes"] += 3 * 2**30  # a's memory comes back
            return await original(slot, force)

        pool.unload = unload
        await pool.ensure(b)
        assert a.engine is None and b.engine is not None
        # Nothing idle to unload: the load is tried anyway (it says itself whether it fits).
        pool.lease(b)
        a.size_bytes, free["bytes"] = 8 * 2**30, 1
        await pool.ensure(a)
        assert a.engine is not None and b.engine is not None

    asyncio.run(main())
    assert loads == ["a", "b", "a"]


def test_files_size_reads_local_weights_only(tmp_path):
    from llmserve.server.pool import files_size

    (tmp_path / "model.safetensors").write_bytes(b"x" * 100)
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "m.gguf").write_bytes(b"x" * 7)
    assert files_size(str(tmp_path)) == 107
    assert files_size(str(tmp_path / "m.gguf")) == 7
    assert files_size("org/not-fetched") == 0


def test_input_modalities_are_the_loaded_models_own_and_text_before_it_loads():
    from llmserve.engine.backend import ModelInfo

    slot = entry_slot(ServerConfig(), "v=/models/v")
    assert slot.input_modalities == ["text"]  # not loaded: what every model takes
    slot.model = ModelInfo(name="v", path="/models/v", max_model_len=8, vocab_size=8, eos_token_ids=[0],
                           tokenizer=None)
    assert slot.input_modalities == ["text"]  # a backend that says nothing: text
    slot.model = ModelInfo(name="v", path="/models/v", max_model_len=8, vocab_size=8, eos_token_ids=[0],
                           tokenizer=None, input_modalities=("text", "image"))
    assert slot.input_modalities == ["text", "image"]  # a vision model's images served: it says so


def test_a_request_whose_deadline_passes_while_its_model_loads_times_out_and_the_load_goes_on():
    import time
    from types import SimpleNamespace

    from llmserve.request_context import RequestContext, reset_context, set_context

    pool, _ = make_pool("base", "slow")
    release, loads = threading.Event(), []

    def loader(slot: ModelSlot) -> None:
        release.wait(60)  # held until the first request has given up
        loads.append(slot.name)
        slot.engine = FakeEngine(slot.name)

    pool.loader = loader
    rolled_back: list[int] = []
    context = SimpleNamespace(pool=pool, admission=SimpleNamespace(rollback=lambda ctx, n: rolled_back.append(n)))
    slow = pool.find("slow")

    async def route() -> str:  # a dialect's handler: its model must be loaded first
        if slow.engine is None:
            raise ModelNotLoaded(slow)
        return "served"

    async def main() -> None:
        token = set_context(RequestContext("r1", started=time.monotonic(), deadline=time.monotonic() + 0.05,
                                           sequences=1))
        try:
            with pytest.raises(RequestTimeoutError, match="^the request timed out while the model `slow` was "
                                                          "loading$") as err:
                await run_routed(context, route)
        finally:
            reset_context(token)
        assert err.value.status == 408 and rolled_back == [1]
        # The load it started is still running, for the requests that come next.
        pending = slow.loading
        assert slow.state == "loading" and pending is not None and not pending.done() and loads == []
        release.set()
        await pending  # that same load completes
        assert slow.state == "loaded" and loads == ["slow"]
        assert await run_routed(context, route) == "served" and loads == ["slow"]  # and serves the next request

    try:
        asyncio.run(main())
    finally:
        release.set()
