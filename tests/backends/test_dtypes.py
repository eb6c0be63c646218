"""Dtypes of the torch backend: bf16/fp16 checkpoints kept in their dtype on the CPU, ``--dtype``
overrides, and ``--kv-cache-dtype`` (the pool's dtype and size, attention across dtypes)."""

from __future__ import annotations

import logging
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llmserve.config import ServerConfig
from llmserve.engine.backend import KVCacheSpec, StepItem
from llmserve.plugins.backends.torch import bf16_rows, loader, runner
from llmserve.plugins.backends.torch.options import TorchOptions
from llmserve.plugins.backends.torch.runner import TorchBackend

from conftest import run_cli

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LOGGER = "llmserve.backend.torch"
VOCAB = 256
BS = 4
# Token ids of a prompt (no special tokens), long enough to span several KV blocks.
PROMPT = [int(t) for t in torch.randint(2, VOCAB, (23,), generator=torch.Generator().manual_seed(3))]
TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def build_model(path: str, dtype: torch.dtype) -> None:
    """A 2-layer GQA Llama with random weights stored in ``dtype`` (config.json says so), and a
    word-level tokenizer with a plain chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=1, bos_token_id=0)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t1", bos_token="t0")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


@pytest.fixture(scope="module")
def bf16_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-bf16"))
    build_model(path, torch.bfloat16)
    return path


@pytest.fixture(scope="module")
def fp16_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-fp16"))
    build_model(path, torch.float16)
    return path


@pytest.fixture(scope="module")
def fp32_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = str(tmp_path_factory.mktemp("tiny-fp32"))
    build_model(path, torch.float32)
    return path


@pytest.fixture()
def half_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with bf16 and fp16 matmuls in hardware, whatever this one has (torch computes
    both dtypes on any CPU; only the speed differs)."""
    monkeypatch.setattr(loader, "cpu_supports", lambda dtype: True)
    monkeypatch.setattr(bf16_rows, "bf16_tiles", lambda: True)  # bf16 on tiles: auto keeps bf16 arithmetic


def reference(path: str, dtype: torch.dtype) -> torch.Tensor:
    """transformers' own forward of PROMPT in ``dtype``: logits ``[len(PROMPT), V]`` as fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa").eval()
    with torch.inference_mode():
        return model(torch.tensor([PROMPT])).logits[0].float()


def make_backend(path: str, dtype: str = "auto", kv: str = "auto", num_blocks: int = 32,
                 **options: object) -> TorchBackend:
    config = ServerConfig(model=path, dtype=dtype, device="cpu", max_model_len=None, kv_cache_dtype=kv)
    backend = TorchBackend(config, TorchOptions(threads=1, **options))
    backend.load()
    backend.init_kv_cache(KVCacheSpec(block_size=BS, num_blocks=num_blocks))
    return backend


def run_prompt(backend: TorchBackend, chunk: int = 9, decode_from: int = 15) -> torch.Tensor:
    """Logits of every PROMPT position through the paged cache: prefill chunks of ``chunk``
    tokens up to ``decode_from`` (later chunks read the earlier ones from the cache), then one
    decode step per token (each reads the whole context from the cache)."""
    table = list(range(-(-len(PROMPT) // BS)))
    out: list[torch.Tensor] = []
    pos = 0
    while pos < len(PROMPT):
        n = min(chunk, decode_from - pos) if pos < decode_from else 1
        item = StepItem(seq_id=1, token_ids=PROMPT[pos:pos + n], start_pos=pos, block_table=table, sample=False)
        out.append(backend.forward_logits([item])[0])
        pos += n
    return torch.cat(out)


def param_dtypes(backend: TorchBackend) -> set[torch.dtype]:
    return {p.dtype for p in backend.loaded.model.parameters() if p.numel()}


# ---------------------------------------------------------------------------- --dtype auto on the CPU

def test_bf16_checkpoint_runs_in_bf16(bf16_dir: str, half_cpu: None) -> None:
    """bf16 weights stay bf16 (no fp32 copy anywhere), the cache follows, and the logits are
    transformers' own bf16 forward's up to bf16 rounding."""
    backend = make_backend(bf16_dir)
    assert backend.loaded.dtype == torch.bfloat16 and param_dtypes(backend) == {torch.bfloat16}
    assert all(t.dtype == torch.bfloat16 for t in backend.loaded.model.state_dict().values() if t.is_floating_point())
    assert backend.cache.pool.dtype == torch.bfloat16 and backend.cache.decode_kernel is None
    assert "dtype=bfloat16 kv_dtype=bfloat16 " in backend.plan()
    got = run_prompt(backend)
    want = reference(bf16_dir, torch.bfloat16)
    # bf16 keeps 8 mantissa bits: the two forwards round at different places (fused
    # projections, paged attention), so they agree to a few percent of the largest logit.
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    # Against fp32 compute of the same weights, greedy picks agree except at near-ties (a tiny
    # random model has many: transformers' own bf16 forward agrees on 21 of 23 positions here).
    fp32 = reference(bf16_dir, torch.float32)
    agree = (got.argmax(-1) == fp32.argmax(-1)).float().mean().item()
    assert agree >= 0.75
    top2 = fp32.topk(2, -1).values
    clear = (top2[:, 0] - top2[:, 1]) > 2 * 0.05 * fp32.abs().max()  # margins bf16 error cannot flip
    assert clear.any() and bool((got.argmax(-1) == fp32.argmax(-1))[clear].all())
    backend.close()


def test_auto_without_bf16_tiles_computes_in_float32_on_bf16_rows(bf16_dir: str, half_cpu: None,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A CPU with bf16 instructions but no tiles: ``auto`` computes a bf16 checkpoint in float32
    with its projections as bf16 rows (faster there than bf16 arithmetic, and no fp32 copy of
    them): fp32 compute's logits."""
    monkeypatch.setattr(bf16_rows, "bf16_tiles", lambda: False)
    backend = make_backend(bf16_dir)
    assert backend.loaded.dtype == torch.float32 and param_dtypes(backend) == {torch.float32}
    assert "dtype=float32 kv_dtype=float32 " in backend.plan() and "bf16:" in backend.plan()
    assert not backend.plan().endswith("bf16:0")
    assert torch.allclose(run_prompt(backend), reference(bf16_dir, torch.float32), atol=1e-4, rtol=1e-4)
    backend.close()


def test_dtype_float32_forces_fp32(bf16_dir: str, half_cpu: None) -> None:
    backend = make_backend(bf16_dir, dtype="float32")
    assert backend.loaded.dtype == torch.float32 and param_dtypes(backend) == {torch.float32}
    assert backend.cache.pool.dtype == torch.float32
    got = run_prompt(backend)
    assert torch.allclose(got, reference(bf16_dir, torch.float32), atol=1e-4, rtol=1e-4)
    backend.close()


def test_fp16_checkpoint_runs_in_fp16(fp16_dir: str, half_cpu: None) -> None:
    """fp16 weights stay fp16 where the CPU has fp16 matmuls (AVX512-FP16/AMX-FP16: there
    they are faster than fp32); fp16's 10 mantissa bits keep it close to transformers' fp16."""
    backend = make_backend(fp16_dir)
    assert backend.loaded.dtype == torch.float16 and param_dtypes(backend) == {torch.float16}
    assert backend.cache.pool.dtype == torch.float16
    got = run_prompt(backend)
    want = reference(fp16_dir, torch.float16)
    assert (got - want).abs().max() <= 0.01 * want.abs().max()
    assert bool((got.argmax(-1) == reference(fp16_dir, torch.float32).argmax(-1)).all())
    backend.close()


@pytest.mark.parametrize("dtype,stored,missing", [(torch.bfloat16, "bfloat16", "AVX512-BF16/AMX"),
                                                  (torch.float16, "float16", "AVX512-FP16")])
def test_half_checkpoint_on_a_cpu_without_it_runs_fp32(dtype: torch.dtype, stored: str, missing: str,
                                                       monkeypatch: pytest.MonkeyPatch, caplog) -> None:
    """Emulated half-precision matmuls are far slower than fp32: auto upcasts, and says why."""
    monkeypatch.setattr(loader, "cpu_supports", lambda d: d != dtype)
    caplog.set_level(logging.INFO, logger=LOGGER)
    assert loader.resolve_dtype("auto", torch.device("cpu"), stored) == torch.float32
    assert f"running the {stored} checkpoint in float32: this CPU has no {missing}" in caplog.text
    assert loader.resolve_dtype(stored, torch.device("cpu"), stored) == dtype  # asked for: given


def test_auto_rules(tmp_path, half_cpu: None) -> None:
    cpu = torch.device("cpu")
    assert loader.resolve_dtype("auto", cpu, None) == torch.float32          # GGUF, unstated
    assert loader.resolve_dtype("auto", cpu, "float32") == torch.float32
    assert loader.resolve_dtype("auto", cpu, "bfloat16") == torch.bfloat16
    assert loader.resolve_dtype("float32", cpu, "bfloat16") == torch.float32
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')       # older transformers' key
    assert loader.checkpoint_dtype(str(tmp_path)) == "float16"
    (tmp_path / "config.json").write_text('{"text_config": {"dtype": "bfloat16"}}')
    assert loader.checkpoint_dtype(str(tmp_path)) == "bfloat16"
    (tmp_path / "config.json").write_text("{}")
    assert loader.checkpoint_dtype(str(tmp_path)) is None


def test_fp32_checkpoint_stays_fp32(fp32_dir: str, half_cpu: None) -> None:
    backend = make_backend(fp32_dir)
    assert backend.loaded.dtype == torch.float32 and backend.cache.pool.dtype == torch.float32
    backend.close()


# ---------------------------------------------------------------------------- --kv-cache-dtype

@pytest.mark.parametrize("kv,want,tol", [("auto", torch.float32, 1e-4), ("float32", torch.float32, 1e-4),
                                         ("bfloat16", torch.bfloat16, 0.03), ("float16", torch.float16, 0.004)])
def test_kv_cache_dtype_with_an_fp32_model(fp32_dir: str, kv: str, want: torch.dtype, tol: float) -> None:
    """The cache keeps keys and values in its dtype; attention casts them back when it reads, so
    the logits stay within the cache dtype's rounding of the fp32 cache's (tolerance: a fraction
    of the largest logit: bf16 has 8 mantissa bits, fp16 11)."""
    backend = make_backend(fp32_dir, kv=kv)
    assert backend.cache.pool.dtype == want and backend.loaded.dtype == torch.float32
    assert f"kv_dtype={str(want).removeprefix('torch.')} " in backend.plan()
    if want != torch.float32:
        assert backend.cache.decode_kernel is None and backend.cache.write_kv is None  # native kernels are fp32
    got = run_prompt(backend)
    fp32 = reference(fp32_dir, torch.float32)
    assert (got - fp32).abs().max() <= tol * fp32.abs().max()
    backend.close()


def test_fp32_cache_with_a_bf16_model(bf16_dir: str, half_cpu: None) -> None:
    backend = make_backend(bf16_dir, kv="float32")
    assert backend.cache.pool.dtype == torch.float32 and backend.cache.decode_kernel is None
    got = run_prompt(backend)
    want = reference(bf16_dir, torch.bfloat16)
    assert (got - want).abs().max() <= 0.05 * want.abs().max()
    backend.close()


def test_a_half_cache_holds_twice_the_blocks(fp32_dir: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The pool is sized in the cache dtype's bytes: the same memory budget holds twice the
    blocks in bf16 or fp16 as in fp32."""
    per_block_fp32 = 2 * 2 * 2 * BS * 16 * 4  # layers x (K, V) x kv heads x block x head_dim x 4 bytes
    monkeypatch.setattr(runner, "_available_cpu_memory", lambda: 1000 * per_block_fp32)
    blocks = {}
    for kv in ("float32", "bfloat16", "float16"):
        backend = TorchBackend(ServerConfig(model=fp32_dir, dtype="auto", device="cpu", max_model_len=None,
                                            kv_cache_dtype=kv), TorchOptions(threads=1, cpu_kernels=False))
        backend.load()
        blocks[kv] = backend.init_kv_cache(KVCacheSpec(block_size=BS, memory_fraction=0.5))
        assert backend.cache.num_blocks == blocks[kv]
        backend.close()
    assert blocks == {"float32": 500, "bfloat16": 1000, "float16": 1000}


def test_a_bad_kv_cache_dtype_is_refused(tmp_path) -> None:
    result = run_cli("serve", "--kv-cache-dtype", "fp4", timeout=60)
    assert result.returncode != 0
    assert ("kv-cache-dtype: must be one of 'auto', 'float32', 'bfloat16', 'float16', 'int8', 'q8_0', 'fp8', "
            "'fp8_e4m3' or 'fp8_e5m2', got 'fp4'" in result.stderr), result.stderr
    assert "Traceback" not in result.stderr
    config = tmp_path / "llmserve.yaml"
    config.write_text("kv-cache-dtype: int4\n")
    result = run_cli("config", "show", "--config", str(config), timeout=60)
    assert result.returncode != 0 and "got 'int4' (from yaml:" in result.stderr
    config.write_text("kv-cache-dtype: bfloat16\n")
    result = run_cli("config", "show", "--config", str(config), timeout=60)
    assert result.returncode == 0 and '"bfloat16"' in result.stdout


# ---------------------------------------------------------------------------- end to end

def test_serve_a_bf16_model(bf16_dir: str, server_process) -> None:
    """``llmserve serve`` on a bf16 checkpoint answers an OpenAI chat request; /metrics parses and
    reports the configured cache dtype."""
    openai = pytest.importorskip("openai")
    parser = pytest.importorskip("prometheus_client.parser")
    import httpx

    server = server_process("--model", bf16_dir, "--device", "cpu", "--kv-cache-dtype", "bfloat16",
                            "--num-kv-blocks", "64", "--block-size", "4")
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
    reply = client.chat.completions.create(model=os.path.basename(bf16_dir), max_tokens=6, temperature=0,
                                           messages=[{"role": "user", "content": "t5 t7 t9"}])
    assert reply.choices[0].message.content and reply.usage.completion_tokens > 0
    families = {f.name: f for f in parser.text_string_to_metric_families(httpx.get(server.url + "/metrics").text)}
    info = families["vllm:cache_config_info"].samples[0]
    assert info.labels["cache_dtype"] == "bfloat16" and info.labels["num_gpu_blocks"] == "64"
    assert "kv_dtype=bfloat16" in server.log  # the execution plan, and the ready summary:
    assert "KV pool  64 blocks x 4 tokens = 256 tokens in bfloat16" in server.log
