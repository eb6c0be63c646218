"""The engine loop and async client on the echo backend: events, n, stops, aborts, idle invariant."""

import asyncio
import random
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugins"))
from echo_backend import EOS, EchoBackend

from llmserve.config import ServerConfig
from llmserve.engine.client import EngineClient
from llmserve.engine.engine import LLMEngine
from llmserve.errors import InvalidRequestError
from llmserve.request import GenerateRequest
from llmserve.sampling import SamplingParams


def make_client(**cfg) -> EngineClient:
    config = ServerConfig(block_size=4, num_kv_blocks=cfg.pop("num_kv_blocks", 64),
                          max_num_seqs=cfg.pop("max_num_seqs", 16),
                          max_num_batched_tokens=cfg.pop("max_num_batched_tokens", 64),
                          max_model_len=cfg.pop("max_model_len", 128),
                          enable_prefix_caching=True,
                          enable_chunked_prefill=not cfg.pop("enable_chunked_prefill_off", False), **cfg)
    backend = EchoBackend(config)
    info = backend.load()
    return EngineClient(LLMEngine(backend, info, config))


async def collect(client, prompt, **sampling):
    request = GenerateRequest(prompt=prompt, sampling=SamplingParams(**sampling))
    texts, reasons, events = {}, {}, []
    async for event in client.generate(client.prepare(request)):
        events.append(event)
        for d in event.outputs:
            texts[d.index] = texts.get(d.index, "") + d.text
            if d.finish_reason:
                reasons[d.index] = (d.finish_reason, d.stop_reason)
    return texts, reasons, events


def run(coro):
    return asyncio.run(coro)


def test_generate_echoes_prompt_then_stops_on_eos():
    client = make_client()

    async def main():
        texts, reasons, events = await collect(client, "hello world", temperature=0)
        assert texts == {0: "hello world"}
        assert reasons == {0: ("stop", None)}
        assert events[0].prompt_token_ids == list(b"hello world")
        assert events[-1].finished and events[-1].usage.completion_tokens == len("hello world") + 1
        assert all(not e.finished for e in events[:-1])
        assert await client.check_idle()
    run(main())
    client.shutdown()


def test_max_tokens_stop_strings_and_n():
    client = make_client()

    async def main():
        texts, reasons, _ = await collect(client, "abcdefgh", max_tokens=3)
        assert texts == {0: "abc"} and reasons[0][0] == "length"
        texts, reasons, _ = await collect(client, "one, two, three", stop=[", t"])
        assert texts == {0: "one"} and reasons[0] == ("stop", ", t")
        texts, _, _ = await collect(client, "one, two, three", stop=[", t"], include_stop_str_in_output=True)
        assert texts == {0: "one, t"}
        texts, reasons, _ = await collect(client, "xyz", n=3)
        assert texts == {0: "xyz", 1: "xyz", 2: "xyz"} and len(reasons) == 3
        texts, reasons, _ = await collect(client, "abc", stop_token_ids=[ord("b")])
        assert texts == {0: "a"} and reasons[0] == ("stop", ord("b"))
        texts, _, _ = await collect(client, "abc", ignore_eos=True, max_tokens=6)
        assert texts[0].startswith("abc")
        assert await client.check_idle()
    run(main())
    client.shutdown()


def test_best_of_returns_ranked_full_outputs_once():
    client = make_client()

    async def main():
        texts, reasons, events = await collect(client, "rank", n=1, best_of=3)
        assert len(events) == 1 and events[0].finished
        assert [d.index for d in events[0].outputs] == [0, 1, 2]
        assert texts[0] == "rank"
    run(main())
    client.shutdown()


def test_validation_errors_before_any_event():
    client = make_client(max_model_len=32)

    async def main():
        with pytest.raises(InvalidRequestError) as err:
            await collect(client, "x" * 40)
        assert "maximum context length is 32 tokens" in err.value.message
        with pytest.raises(InvalidRequestError) as err:
            await collect(client, "abc", max_tokens=30)
        assert err.value.param == "max_tokens"
        with pytest.raises(InvalidRequestError, match="out of vocabulary"):
            async for _ in client.generate(client.prepare(GenerateRequest(prompt_token_ids=[1, 999]))):
                pass
        with pytest.raises(InvalidRequestError, match="logit_bias"):
            await collect(client, "abc", logit_bias={5000: 1.0})
    run(main())
    client.shutdown()


def test_prefix_cache_reports_cached_tokens():
    client = make_client()

    async def main():
        prompt = "a shared prefix that spans blocks " * 2
        _, _, first = await collect(client, prompt + "one", max_tokens=2)
        _, _, second = await collect(client, prompt + "two", max_tokens=2)
        assert first[-1].usage.cached_tokens == 0
        assert second[-1].usage.cached_tokens >= 64
    run(main())
    client.shutdown()


def test_burst_with_random_aborts_leaves_engine_idle():
    client = make_client(num_kv_blocks=24, max_num_seqs=8, max_model_len=64)
    rng = random.Random(7)

    async def one(i):
        request = GenerateRequest(prompt="request %d " % i * rng.randint(1, 4),
                                  sampling=SamplingParams(n=rng.choice([1, 1, 2]), ignore_eos=True,
                                                          max_tokens=rng.randint(1, 15)), priority=rng.randint(1, 5))
        stop_after = rng.choice([None, 0, 1, 3])
        count = 0
        async for _ in client.generate(client.prepare(request)):
            count += 1
            if stop_after is not None and count > stop_after:
                break  # leaving the iterator aborts the request

    async def main():
        tasks = [asyncio.create_task(one(i)) for i in range(100)]
        for task in tasks[::7]:
            await asyncio.sleep(0.001)
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for _ in range(50):  # aborts are queued commands: give the loop a moment
            try:
                if await client.check_idle():
                    break
            except AssertionError:
                await asyncio.sleep(0.02)
        assert await client.check_idle()
        assert client.engine.block_manager.num_free_blocks == 24
    run(main())
    client.shutdown()


def test_eos_id_is_not_text():
    client = make_client()

    async def main():
        texts, _, events = await collect(client, "ok", skip_special_tokens=False)
        assert texts[0] == "ok"
        assert events[-1].outputs[0].token_ids[-1] == EOS
    run(main())
    client.shutdown()


def test_pool_must_hold_one_max_length_request():
    from llmserve.errors import ConfigError

    with pytest.raises(ConfigError, match="smaller --max-model-len"):
        make_client(num_kv_blocks=8, max_model_len=64)
    with pytest.raises(ConfigError, match="chunked prefill is off"):
        make_client(max_model_len=128, max_num_batched_tokens=64, enable_chunked_prefill_off=True)


def test_a_default_context_the_pool_cannot_hold_shrinks_to_it(caplog):
    """No --max-model-len: the model's trained 512 tokens do not fit 8 blocks of 4, so the server
    serves 32 (logged with the arithmetic) and refuses longer prompts by that length."""
    with caplog.at_level("WARNING", logger="llmserve.engine"):
        client = make_client(num_kv_blocks=8, max_model_len=None)
    assert client.max_model_len == 32 and client.engine.info.max_model_len == 32
    assert "context 32 tokens, not the model's trained 512" in caplog.text and "8 blocks x 4 tokens" in caplog.text
    with pytest.raises(InvalidRequestError, match="maximum context length is 32 tokens"):
        client.prepare(GenerateRequest(prompt="x" * 40, sampling=SamplingParams(max_tokens=1)))
    texts, reasons, _ = run(collect(client, "y" * 20))
    assert len(texts[0]) == 12 and reasons[0][0] == "length"  # the room the prompt leaves
    client.shutdown()
