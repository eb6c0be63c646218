"""The repos the fake Hub serves in these tests, generated: a tiny random-weight Llama in
safetensors (with a pickle and a README beside it that must not be fetched) and a GGUF repo with
Q8_0, Q4_K_M, a model split in three files and a vision projector. (The file named Q4_K_M holds
Q4_0 blocks: K-quant blocks need rows of 256 weights, wider than this model; what matters here is
the name the pick goes by.)"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import threading
import time
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

GGUF_SHAPE = {"hidden": 64, "inter": 128, "heads": 2, "kv_heads": 1, "tied": True}


def read_folder(folder: str) -> dict[str, bytes]:
    out = {}
    for here, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(here, name)
            out[os.path.relpath(path, folder).replace(os.sep, "/")] = Path(path).read_bytes()
    return out


@functools.lru_cache(maxsize=1)
def safetensors_repo() -> dict[str, bytes]:
    from tokenizers import Tokenizer, models
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    with tempfile.TemporaryDirectory() as folder:
        cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                          num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128, eos_token_id=1)
        LlamaForCausalLM(cfg).save_pretrained(folder)
        tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(64)}, unk_token="t0"))
        PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", eos_token="t3").save_pretrained(folder)
        files = read_folder(folder)
    assert any(f.endswith(".safetensors") for f in files)
    files["pytorch_model.bin"] = b"a pickle that must never be fetched"
    files["README.md"] = b"# tiny\n"
    files["original/consolidated.safetensors"] = b"not fetched: only the top level is"
    return files


@functools.lru_cache(maxsize=1)
def gguf_repo() -> dict[str, bytes]:
    from gguf_writer import write_tiny_gguf

    with tempfile.TemporaryDirectory() as folder:
        write_tiny_gguf(os.path.join(folder, "tiny-Q8_0.gguf"), qtype="Q8_0", seed=1, **GGUF_SHAPE)
        write_tiny_gguf(os.path.join(folder, "tiny-Q4_K_M.gguf"), qtype="Q4_0", seed=2, **GGUF_SHAPE)
        write_tiny_gguf(os.path.join(folder, "tiny-F16.gguf"), qtype="F16", seed=3, split_max_tensors=8,
                        **GGUF_SHAPE)
        files = read_folder(folder)
    files["mmproj-tiny-f16.gguf"] = b"GGUF a vision projector (not a real one)"
    files["README.md"] = b"# tiny GGUF\n"
    return files


def files_under(path: str | Path) -> list[str]:
    root = Path(path)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()) if root.exists() else []


ROOT = Path(__file__).resolve().parents[2]


def cli(*args: str, env: dict[str, str], timeout: float = 300) -> "subprocess.CompletedProcess[str]":
    """``python -m llmserve ARGS`` with ``env`` over this process's environment; stdout and stderr
    are pipes, so progress is in its non-terminal (plain) form."""
    return subprocess.run([sys.executable, "-m", "llmserve", *args], capture_output=True, text=True,
                          env={**os.environ, **env}, timeout=timeout, cwd=ROOT)


class Server:
    """``llmserve serve ARGS`` on a free loopback port, its output collected as it comes."""

    def __init__(self, *args: str, env: dict[str, str]) -> None:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen([sys.executable, "-m", "llmserve", "serve", *args, "--port", str(self.port),
                                      "--device", "cpu"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env={**os.environ, **env}, cwd=ROOT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout or []), daemon=True)
        self.reader.start()

    @property
    def log(self) -> str:
        return "".join(self.lines)

    def wait(self, predicate, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if predicate():
                return
            if self.proc.poll() is not None:
                self.reader.join(5)
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log}")
            time.sleep(0.1)
        raise AssertionError(f"timed out:\n{self.log}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.reader.join(5)
