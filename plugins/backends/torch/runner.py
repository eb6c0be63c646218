"""TorchBackend: runs a transformers causal LM with a paged KV cache, one packed forward per
engine step, and samples on the same device."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import logging
import threading
from typing import Any

import torch

from llmserve import progress
from llmserve import Backend, ConfigError, KVCacheSpec, ModelInfo, ServerConfig, StepItem, StepResult

from .attention import PagedKVCache, StepMetadata, kv_cache_dtype, step_context
from .cpu_threads import set_cpu_threads
from .fused import FusedDecoder
from . import bf16_rows
from .fused_gemma4 import Gemma4Decoder
from .fused_hybrid import HybridDecoder
from .kv_layout import kv_layout
from .loader import LoadedModel, load_model
from .options import TorchOptions
from .recurrent import RecurrentStates, hybrid_shape, install
from .sampler import Sampler, ranked_prompt_logprobs
from .step_batch import pack_batch
from .mrope import step_positions
from .vision import VisionInputs, splice

log = logging.getLogger("llmserve.backend.torch")
OWN_FORWARDS = {"gemma4_text": Gemma4Decoder}  # model types whose fused forward is a module of its own


def _available_cpu_memory() -> int:
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    raise ConfigError("cannot determine available memory; pass an explicit number of KV blocks")


class TorchBackend(Backend):
    """Backend over PyTorch + transformers; works on CPU and CUDA (Triton paged attention and
    graphed decode steps there).

    ``options`` decide the execution plan; without them (a backend built outside the server)
    the ``LLMSERVE_*`` variables and the defaults do, as ``TorchOptions.from_environ`` says.
    """

    verifies_drafts = True  # step() samples at proposed tokens' positions (StepItem.num_draft_tokens)

    def __init__(self, config: ServerConfig, options: TorchOptions | None = None) -> None:
        super().__init__(config)
        self.options = options if options is not None else TorchOptions.from_environ()
        self.loaded: LoadedModel | None = None
        self.cache: PagedKVCache | None = None
        self.sampler: Sampler | None = None
        self._decoder: Any = None   # the base model (hidden states), set by load()
        self._lm_head: Any = None
        self._packed_head: Any = None  # lm_head in the native CPU kernel's layout, when it applies
        self._fused: FusedDecoder | HybridDecoder | Gemma4Decoder | None = None  # our own forward, where it applies
        self._ops: Any = None  # the native elementwise operations, when they apply
        self._native = False  # native CPU kernels apply (CPU, fp32, options.cpu_kernels)
        self._gguf: Any = None  # a GGUF file's own weights (gguf_model.GGUFParts) on the native GGUF path
        self._graphs: Any = None  # cuda.graphs.DecodeGraphs when decode steps replay CUDA graphs
        self.vision: VisionInputs | None = None  # a vision-language model's image path
        self._hybrid: Any = None  # recurrent.hybrid_shape of a model with recurrent layers
        self.states: RecurrentStates | None = None  # their state slots, allocated with the KV cache
        self._kernel = False  # the KV cache and the fused forward go through cuda/ops.py's operators
        self.steps = 0  # steps run (with ``_graphs.replayed``: the share of graphed steps)

    # ------------------------------------------------------------------ lifecycle
    def load(self) -> ModelInfo:
        opts = self.options
        if self.config.llm.device != "cuda":
            set_cpu_threads(opts.threads)
            if opts.cpu_kernels and self.config.llm.dtype in ("auto", "float32"):
                self.warm_up(wait=False)  # the compilers run while the weights load
        from .gguf_model import load_native, native_gguf_path

        gguf_path = native_gguf_path(self.config, opts)
        if gguf_path is not None:  # the file's own quantized weights; no fp32 copy
            self.loaded, self._gguf = load_native(self.config.llm, gguf_path, bf16_matmul=opts.gguf_bf16_matmul,
                                                  activations=opts.gguf_decode_activations)
            lm = self.loaded
        else:
            lm = self.loaded = self._load_model()
        model = lm.model
        self._decoder = (model.get_decoder() if hasattr(model, "get_decoder")
                         else getattr(model, model.base_model_prefix))
        self._lm_head = model.get_output_embeddings()
        # Native CPU kernels: fp32 on the CPU only, unless the options turn them off.
        pack = self._native = lm.device.type == "cpu" and lm.dtype == torch.float32 and opts.cpu_kernels
        ops, embedding = None, None
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        # Packing searches each matrix for lossless 4/8-bit panels: seconds per model, so it reports (in
        # weights: one matrix, the head, may be a large part). A vision model's tower is not packed.
        scope = [self._decoder, self._lm_head] if lm.processor is not None else [model]
        linears = [m for part in scope for m in part.modules() if isinstance(m, torch.nn.Linear)] if (
            opts.fused_forward) else [self._lm_head]
        weights = sum(m.weight.numel() for m in linears if isinstance(m, torch.nn.Linear))
        packing = pack and self._gguf is None  # GGUF weights are used as the file stores them
        with progress.phase("packing weights", weights, "weights") if packing else contextlib.nullcontext():
            if pack:
                from .native.ops import elementwise_ops, packed_linear

                ops = self._ops = elementwise_ops()
                if self._gguf is not None:
                    self._packed_head = self._gguf.head
                elif type(self._lm_head) is torch.nn.Linear:
                    # A copy: the weight is usually tied to the input embedding, which keeps its layout
                    # (or, a bf16 checkpoint's, shares the embedding's bf16 rows).
                    embedding = bf16_rows.Embedding.of(model) if opts.compact_weights else None
                    self._packed_head = (embedding.head(self._lm_head.bias) if embedding else None) or packed_linear(
                        self._lm_head.weight, self._lm_head.bias, opts.compact_weights)
            self._kernel = self._kernel_ops(lm.device, model)
            if self._kernel and ops is None:
                from .cuda.ops import KernelOps

                ops = KernelOps()  # norms, SiLU-mul and RoPE + KV store as one Triton launch each
            self._hybrid = hybrid_shape(model)
            if opts.fused_forward:
                builder = OWN_FORWARDS.get(cfg.model_type, HybridDecoder if self._hybrid is not None else FusedDecoder)
                self._fused = builder.build(model, pack=packing, ops=ops, compact=opts.compact_weights,
                                            native_decode=opts.native_step, weights=self._gguf)
        if lm.dtype == torch.float32:  # a bf16 checkpoint's linears left in bf16 (bf16_rows.py)
            if self._fused is not None and embedding is not None:
                embedding.take(self._fused)
            if self._packed_head is not None and self._lm_head.weight.dtype == torch.bfloat16:
                self._lm_head.weight.data = self._lm_head.weight.data.new_empty(0)  # its bf16 rows hold it
            bf16_rows.widen_leftovers(model)
        if self._gguf is not None and self._fused is None:
            raise ConfigError(f"the fused forward cannot run {lm.name}; serve it with --no-torch-gguf-native")
        self._layout = kv_layout(cfg)  # which layers keep keys and values, and of what shape
        self._num_layers = len(self._layout.shapes)
        state_bytes = 0
        if self._hybrid is not None:  # only the attention layers keep keys and values
            install(model)
            self._num_layers = len(self._hybrid.attention)
            state_bytes = RecurrentStates.bytes_per_slot(self._hybrid.shape, len(self._hybrid.recurrent), lm.dtype)
        self._kv_heads, self._head_dim = self._layout.shapes[0]
        self._softcap = getattr(cfg, "final_logit_softcapping", None)
        self._logit_scale = getattr(cfg, "logit_scale", None)  # (logit transforms of their *ForCausalLM.forward)
        if getattr(cfg, "logits_scaling", None):  # Granite divides its logits by this instead
            self._logit_scale = 1.0 / float(cfg.logits_scaling)
        self.vision = VisionInputs.build(lm.vision_model or model, lm.processor, lm.tokenizer,  # (mmproj: its own)
                                         lm.device) if lm.processor else None
        self.sampler = Sampler(lm.vocab_size, lm.eos_token_ids, lm.device)
        if ops is not None:
            self.sampler.greedy_kernel = ops.greedy
        return ModelInfo(
            name=lm.name, path=lm.path, max_model_len=lm.max_model_len, vocab_size=lm.vocab_size,
            eos_token_ids=lm.eos_token_ids, tokenizer=lm.tokenizer, chat_template=lm.chat_template,
            dtype=str(lm.dtype).removeprefix("torch."), device=lm.device.type, quantization=self._stored_as(),
            num_parameters=self._gguf.parameters if self._gguf is not None else None,
            weight_bytes=self._gguf.weight_bytes if self._gguf is not None else None,
            input_modalities=("text", "image") if self.vision is not None else ("text",), media=self.vision,
            state_bytes=state_bytes,
        )

    def _load_model(self) -> LoadedModel:
        """The loaded model, before anything is fused or packed (tensor parallel keeps its shard here);
        a bf16 checkpoint's linears stay bf16 where the fused forward will pack them (``bf16_rows.py``)."""
        opts = self.options
        return load_model(self.config.llm, bf16_linears=opts.cpu_kernels and opts.fused_forward
                          and opts.compact_weights)

    def _stored_as(self) -> str | None:
        """The packed linears' formats, e.g. ``lossless panels: q4 120, q8 1`` (None when none is packed)."""
        fused = self._fused
        linears = [self._packed_head, *(fused.linears() if fused else ())]
        formats = [f for f in (getattr(lin, "format", None) for lin in linears if lin is not None) if f]
        if self._gguf is not None:
            types = self._gguf.types
            counts = ", ".join(f"{t} {types.count(t)}" for t in sorted(set(types)))
            return f"quantized as in the file: {counts} matrices"
        if not formats:
            return None
        counts = ", ".join(f"{f} {formats.count(f)}" for f in ("q4", "q8", "bf16", "f32") if f in formats)
        return f"packed for the CPU kernels: {counts} matrices"

    def warm_up(self, wait: bool = True) -> None:
        """What ``llmserve warmup`` does ahead of a first start: build (or find cached) every
        native CPU kernel and convert a GGUF model into its cache (or, for one served in its
        own quantization, cache its config and tokenizer). ``wait=False`` (a load) only
        starts the kernel builds, on a thread of their own, while the weights load."""
        from .loader import hf_directory
        from .native.build import build_all

        if not wait:
            threading.Thread(target=build_all, name="llmserve-kernels", daemon=True).start()
            return
        if self.options.cpu_kernels:
            built = build_all()
            log.info("native CPU kernels: %s", ", ".join(f"{name} {'ready' if ok else 'unavailable'}"
                                                          for name, ok in built.items()))
        from .gguf_model import native_gguf_path, prepare

        gguf_path = native_gguf_path(self.config, self.options)
        if gguf_path is not None:  # served from the file itself: only its config and tokenizer are cached
            prepare(gguf_path, self.config.llm.cache_dir)
            return
        hf_directory(self.config.llm.model, self.config.llm.cache_dir)

    def init_kv_cache(self, spec: KVCacheSpec) -> int:
        lm = self._require_loaded()
        try:
            kv_dtype = kv_cache_dtype(self.config.cache.kv_cache_dtype, lm.dtype)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        shapes = None if self._layout.uniform else self._layout.shapes
        per_block = PagedKVCache.bytes_per_block(self._num_layers, spec.block_size, self._kv_heads,
                                                 self._head_dim, kv_dtype, shapes)
        states = self._init_states(spec.state_slots, spec.state_snapshots)
        if spec.num_blocks is not None:
            num_blocks = int(spec.num_blocks)
        else:
            if lm.device.type == "cuda":
                free = torch.cuda.mem_get_info(lm.device)[0]
            else:
                free = _available_cpu_memory()
            budget = int(free * float(spec.memory_fraction or 0.5))
            if states > budget:
                raise ConfigError(f"the recurrent states of {spec.state_slots} sequences take "
                                  f"{states / 2**30:.2f} GiB, more than the cache's {budget / 2**30:.2f} GiB: lower "
                                  "--max-num-seqs or raise --kv-cache-memory-fraction")
            num_blocks = (budget - states) // per_block
        # Fewer than spec.min_blocks is refused by the engine, for every backend alike.
        try:
            self.cache = PagedKVCache(self._num_layers, num_blocks, spec.block_size, self._kv_heads,
                                      self._head_dim, kv_dtype, lm.device, native=self._native,
                                      matmul_decode=self.options.cpu_matmul_decode,
                                      kernel_ops=self._kernel, shapes=shapes)
        except ValueError as exc:  # a cache dtype this model's path cannot read (int8 off the native kernels)
            raise ConfigError(f"--kv-cache-dtype {self.config.cache.kv_cache_dtype}: {exc}") from None
        except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
            raise ConfigError(
                f"cannot allocate a KV cache of {num_blocks} blocks ({num_blocks * per_block / 2**30:.1f} GiB): "
                f"{str(exc).splitlines()[0]}; use fewer KV blocks or a smaller --max-model-len"
            ) from None
        self.cache.layer_of = self.states.kv_layers if self.states is not None else self._layout.layer_of
        log.info("KV cache: %d blocks x %d tokens (%.2f GiB, %s, %s)", num_blocks, spec.block_size,
                 num_blocks * per_block / 2**30, lm.device, str(kv_dtype).removeprefix("torch."))
        if self.cache.kernel_ops and lm.device.type == "cuda" and not self.config.llm.enforce_eager:
            from .cuda.graphs import cuda_capture_in

            self.enable_decode_graphs(cuda_capture_in(torch.cuda.graph_pool_handle()))
        log.info("execution plan: %s", self.plan())
        return num_blocks

    def _init_states(self, slots: int, snapshots: int) -> int:
        """Allocate the recurrent states of ``slots`` sequences and ``snapshots`` saved ones (a
        hybrid model); their bytes."""
        if self._hybrid is None:
            return 0
        lm = self._require_loaded()
        if slots < 1:
            raise ConfigError(f"{lm.name} keeps a recurrent state per sequence: the engine must ask for state slots")
        shape, linear, attention, _ = self._hybrid
        size = (slots + snapshots) * RecurrentStates.bytes_per_slot(shape, len(linear), lm.dtype)
        try:
            self.states = RecurrentStates(shape, linear, attention, slots, lm.dtype, lm.device, snapshots)
        except (RuntimeError, MemoryError) as exc:
            raise ConfigError(f"cannot allocate the recurrent states of {slots} sequences ({size / 2**30:.2f} GiB): "
                              f"{str(exc).splitlines()[0]}; lower --max-num-seqs") from None
        if self._native and self._hybrid.kind == "gated-deltanet":
            from .native.ops import deltanet_decode

            self.states.decode_kernel = deltanet_decode()
        log.info("recurrent states: %d slots + %d saved x %d %s layers (%.2f GiB)", slots, snapshots,
                 len(linear), self._hybrid.kind, size / 2**30)
        return size

    def _kernel_ops(self, device: torch.device, model: Any) -> bool:
        """The KV cache goes through the Triton operators: CUDA, the option on, Triton importable,
        and no attention sinks (gpt-oss: the torch attention applies them, the operators do not)."""
        if device.type != "cuda" or not self.options.triton_attention:
            return False
        if any(isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
            log.info("attention sinks: decode and prefill attention run in torch, not the Triton operators")
            return False
        if importlib.util.find_spec("triton") is None:
            log.warning("Triton is not installed: decode attention uses torch's SDPA over gathered blocks")
            return False
        return True

    def enable_decode_graphs(self, capture: Any, max_model_len: int | None = None) -> bool:
        """Replay decode steps from graphs recorded by ``capture`` (``cuda/graphs.py``): needs the
        fused forward on one rank, the kernel operators and a RoPE that depends on the position
        alone. False (steps stay eager) otherwise."""
        from .cuda.graphs import DecodeGraphs

        lm, fused, cache = self._require_loaded(), self._fused, self.cache
        if fused is None or cache is None or not cache.kernel_ops:
            return False
        if fused.reduce is not None:  # tensor parallel: every rank runs each step; graphs stay off
            log.info("decode graphs not used with tensor parallelism")
            return False
        if any(lay.moe is not None for lay in fused.layers):  # routing reads expert counts back each layer
            log.info("decode graphs not used: mixture-of-experts layers pick their experts on the host")
            return False
        limit = int(max_model_len or self.config.llm.max_model_len or lm.max_model_len)
        if not fused.tabulate_rope(limit, lm.dtype):
            log.info("decode graphs not used: the RoPE type depends on the sequence length")
            return False
        width = -(-limit // cache.block_size)

        def forward(ids: torch.Tensor, pos: torch.Tensor, meta: StepMetadata) -> torch.Tensor:
            return self._logits(fused.forward(ids, pos, cache, meta))

        graphs = DecodeGraphs(forward, self.config.scheduler.max_num_seqs, width, cache.block_size,
                              lm.device, cache.decode_segments)
        with torch.inference_mode():
            graphs.capture(capture)
        self._graphs = graphs
        return True

    def plan(self) -> str:
        """What runs each part of a step, as ``key=value`` pairs (logged once the KV cache exists,
        when every choice is known): forward, decode and prefill attention, linears, small per-layer
        operations, the one-call native step and the packed panels per format."""
        lm, cache, fused = self._require_loaded(), self.cache, self._fused
        linears = [self._packed_head, *(fused.linears() if fused else ())]
        formats = [getattr(lin, "format", None) for lin in linears if lin is not None]
        if cache is not None and cache.decode_kernel is not None:
            attention = "native"
        elif cache is not None and cache.kernel_ops:
            attention = "triton" if lm.device.type == "cuda" else "reference"
        else:
            attention = "matmul" if lm.device.type == "cpu" and self.options.cpu_matmul_decode else "sdpa"
        if cache is not None and cache.prefill_kernel is not None:
            prefill = "native"
        elif cache is not None and cache.kernel_ops:
            prefill = "triton" if lm.device.type == "cuda" else "reference"
        else:
            prefill = "sdpa"
        step = fused is not None and cache is not None and fused.native_step(cache) is not None
        kv = f" kv_dtype={str(cache.pool.dtype).removeprefix('torch.')}" if cache is not None else ""
        return (f"device={lm.device.type} dtype={str(lm.dtype).removeprefix('torch.')}{kv} "
                f"threads={torch.get_num_threads()} forward={'fused' if fused else 'transformers'} "
                f"decode_attention={attention} prefill_attention={prefill} "
                f"linears={'gguf' if self._gguf else 'packed' if any(formats) else 'torch'} "
                f"elementwise={'native' if self._ops is not None else 'triton' if self._kernel and fused else 'torch'} "
                f"native_step={'on' if step else 'off'} "
                f"panels=f32:{formats.count('f32')},q4:{formats.count('q4')},q8:{formats.count('q8')},"
                f"bf16:{formats.count('bf16')}"
                + (f" weights=gguf:{','.join(sorted(set(self._gguf.types)))}" if self._gguf is not None else "")
                + (" gguf_matmul=bf16-amx" if self._gguf is not None and self._gguf.bf16_matmul else "")
                + (" gguf_decode=int8" if self._gguf is not None and self._gguf.int8_decode else "")
                + (f" cuda_graphs={len(self._graphs.buckets)}" if self._graphs is not None else "")
                + (f" recurrent={self._hybrid.kind}:{len(self._hybrid.recurrent)}-layers,{self.states.slots}-slots,"
                   f"{self.states.snapshots}-saved,step={'native' if self.states.decode_kernel else 'torch'}"
                   if self.states is not None and self._hybrid else "")
                + (f" WARNING=unverified-architecture:{lm.unverified}" if lm.unverified else ""))

    def release(self, seq_ids: list[int]) -> None:
        if self.sampler is not None:
            self.sampler.release(seq_ids)

    def close(self) -> None:
        device = self.loaded.device if self.loaded else None
        self.cache = self.loaded = self.sampler = self.states = None
        self._decoder = self._lm_head = self._fused = self._packed_head = self._ops = self._gguf = None
        if device is not None and device.type == "cuda":
            torch.cuda.empty_cache()

    def _require_loaded(self) -> LoadedModel:
        if self.loaded is None:
            raise RuntimeError("TorchBackend.load() has not been called")
        return self.loaded

    # ------------------------------------------------------------------ step
    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        head = self._lm_head
        if self._packed_head is not None:
            logits = self._packed_head(hidden)
        elif (hidden.device.type == "cpu" and hidden.shape[0] <= 128 and type(head) is torch.nn.Linear
                and head.bias is None and hidden.dtype != torch.float16):  # fp16: F.linear is faster
            # The vocab-sized matmul with the weight as the left operand: MKL handles this
            # tall-skinny shape better on few rows (logits + sampling of a batch-32 step: ~37 -> ~31 ms);
            # one bf16 row is faster still as a matrix-vector product (fused.py's _TorchLinear).
            if hidden.shape[0] == 1 and hidden.dtype == torch.bfloat16:
                logits = torch.mv(head.weight, hidden[0]).unsqueeze(0).float()
            else:
                logits = torch.mm(head.weight, hidden.t()).t().float()
        else:
            logits = head(hidden).float()
        if self._logit_scale is not None:
            logits = logits * self._logit_scale
        if self._softcap is not None:
            logits = torch.tanh(logits / self._softcap) * self._softcap
        return logits

    def _forward(self, batch: list[StepItem], every_row: bool = True) -> tuple[torch.Tensor, list[int]]:
        """One packed forward writing the batch's KV; final hidden states ``[T, hidden]`` + first rows
        (``every_row=False``: only the rows sampled or scored are read, ``step_batch.read_rows``)."""
        if self.cache is None:
            raise RuntimeError("TorchBackend.init_kv_cache() has not been called")
        if any(not it.token_ids for it in batch):
            raise ValueError("every StepItem must feed at least one token")
        input_ids, positions, meta, first_row = pack_batch(self.cache, self.loaded.device, batch, every_row)
        if self.states is not None:
            meta.states = self.states.step(batch, first_row, meta.num_decode)
        if meta.fresh_blocks is not None:
            self.cache.zero_blocks(meta.fresh_blocks)
        # Image features where a prompt's images sit (vision.py), in place of those tokens' embeddings;
        # Qwen-VL: positions along three axes, moved by the images at or before the fed tokens.
        images = self.vision.embeddings(batch, first_row) if self.vision and any(it.media for it in batch) else None
        rope = step_positions(batch, first_row, positions) if self.vision and self.vision.mrope else None
        if self._fused is not None:
            return self._fused.forward(input_ids, positions, self.cache, meta, images, rope), first_row
        fed: dict[str, Any] = {"input_ids": input_ids[None]}
        if images is not None:
            embeds = self._decoder.get_input_embeddings()(input_ids)
            fed = {"inputs_embeds": embeds[None]}
            if (deep := splice(embeds, images)) is not None:  # Qwen3-VL's deeper features, by its own arguments
                rows = torch.zeros_like(input_ids, dtype=torch.bool).index_fill_(0, deep[0], True)
                fed |= {"visual_pos_masks": rows[None], "deepstack_visual_embeds": list(deep[1])}
        with step_context(self.cache, meta):  # (three-axis positions after the token indices: transformers' form)
            fed_positions = positions[None] if rope is None else torch.cat((positions[None], rope))[:, None]
            out = self._decoder(**fed, position_ids=fed_positions, use_cache=False)
        return out[0][0], first_row

    @torch.inference_mode()
    def forward_logits(self, batch: list[StepItem]) -> list[torch.Tensor]:
        """Logits ``[len(token_ids), V]`` of every fed position per item (tests, debugging); no sampling."""
        if not batch:
            return []
        hidden, first_row = self._forward(batch)
        return [self._logits(hidden[r:r + len(it.token_ids)]) for r, it in zip(first_row, batch)]

    @torch.inference_mode()
    def step(self, batch: list[StepItem]) -> list[StepResult]:
        if not batch:
            return []
        self.steps += 1
        if self._graphs is not None and self._graphs.fits(batch) and not (self.vision and self.vision.eager(batch)):
            outs = self.sampler.sample(self._graphs.run(batch), batch)
            return [StepResult(seq_id=it.seq_id, token_id=o.token_id, logprob=o.logprob, top=o.top)
                    for it, o in zip(batch, outs)]
        if any(it.prompt_logprob_targets and len(it.prompt_logprob_targets) > len(it.token_ids) for it in batch):
            raise ValueError("more prompt_logprob_targets than fed tokens")
        hidden, first_row = self._forward(batch, every_row=False)
        # Only the rows someone needs go through lm_head (vocab-sized matmul).
        rows: list[int] = []
        sample_at: list[int] = []
        sampled: list[tuple[int, StepItem]] = []  # (batch index, the item as sampled at that row)
        plp_at: dict[int, int] = {}
        for i, it in enumerate(batch):
            if it.prompt_logprob_targets is not None:
                plp_at[i] = len(rows)
                rows += range(first_row[i], first_row[i] + len(it.prompt_logprob_targets))
            if it.sample:
                d = it.num_draft_tokens  # proposals to verify: one sample at each of their positions too
                last = first_row[i] + len(it.token_ids) - 1
                for j in range(d + 1):
                    sample_at.append(len(rows))
                    rows.append(last - d + j)
                    sampled.append((i, it if j == 0 else dataclasses.replace(
                        it, output_ids=[*it.output_ids, *it.token_ids[len(it.token_ids) - d:][:j]])))
        results = [StepResult(seq_id=it.seq_id) for it in batch]
        for i in plp_at:
            results[i].prompt_logprobs = []  # filled below when there are targets
        if not rows:
            return results
        if rows == list(range(hidden.shape[0])):
            logits = self._logits(hidden)
        else:
            logits = self._logits(hidden[torch.tensor(rows, device=hidden.device)])

        if sampled:
            sel = logits if len(sample_at) == logits.shape[0] else logits[torch.tensor(sample_at, device=logits.device)]
            outs = self.sampler.sample(sel, [it for _, it in sampled])
            for (i, it), o in zip(sampled, outs):
                res = results[i]
                if res.token_id is None:
                    res.token_id, res.logprob, res.top = o.token_id, o.logprob, o.top
                else:  # the sample at a proposal's position
                    if res.draft_samples is None:
                        res.draft_samples = []
                    res.draft_samples.append(StepResult(seq_id=it.seq_id, token_id=o.token_id, logprob=o.logprob,
                                                        top=o.top))
        for i, start in plp_at.items():
            it = batch[i]
            targets = it.prompt_logprob_targets
            if not targets:
                continue
            k = (it.sampling.prompt_logprobs if it.sampling is not None else None) or 0
            results[i].prompt_logprobs, results[i].prompt_ranks = ranked_prompt_logprobs(
                logits[start:start + len(targets)], targets, k)
        return results
