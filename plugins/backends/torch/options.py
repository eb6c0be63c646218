"""The torch backend's options: the ``torch:`` YAML section, ``--torch-*`` flags and their variables.

Every switch of the execution plan lives here, and nowhere else reads one: the backend hands
these values down to the fused forward, the KV cache and the native kernels. They are filled
like the server's own settings (CLI > environment > YAML > defaults, ``llmserve.config.load_options``);
the variables keep their established names (``LLMSERVE_FUSED_FORWARD=0``, ...), since this model
sets ``env_prefix``. Import-light on purpose: the CLI reads this model to build its flags.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

SECTION = "torch"


class TorchOptions(BaseModel):
    """How the torch backend runs a model (defaults: everything native that applies)."""

    model_config = ConfigDict(extra="forbid")
    env_prefix: ClassVar[str] = "LLMSERVE_"

    fused_forward: bool = Field(True, description="Run Llama-style decoders through the backend's own fused forward; "
                                                  "off: transformers' modules (for comparisons and debugging).")
    cpu_kernels: bool = Field(True, description="Use the native CPU kernels for fp32 on the CPU (decode attention, "
                                                "packed linears, norms, RoPE, greedy picking); off: torch everywhere.")
    native_step: bool = Field(True, description="Run decode-only steps of the fused forward as one native call; "
                                                "off: its Python layer loop.")
    compact_weights: bool = Field(True, description="Keep packed linears as lossless 4- or 8-bit panels where those "
                                                    "rebuild every weight bit for bit; off: fp32 panels everywhere.")
    cpu_matmul_decode: bool = Field(True, description="Torch decode attention on the CPU as plain matmuls "
                                                      "(faster there); off: scaled_dot_product_attention.")
    gguf_native: bool = Field(True, description="Serve GGUF weights in their own quantization, read from the "
                                                "memory-mapped file by the CPU kernels; off: dequantize to an fp32 "
                                                "copy cached on disk.")
    gguf_bf16_matmul: bool = Field(False, description="Multiply native GGUF weights with bf16 tile and dot-product "
                                                      "instructions (fp32 accumulation): one bf16 rounding per "
                                                      "product, of the weights in decode batches of 5-32, of the "
                                                      "activations of Q4_K/Q6_K in 1-4; prefill close to fp32. "
                                                      "Several times faster, not bit-identical; no AMX: ignored.")
    gguf_decode_activations: Literal["auto", "int8", "fp32"] = Field(
        "auto", description="What steps of up to 64 rows (16 without AVX-512 VNNI: decode steps, short prompts) "
                            "of native GGUF weights multiply: int8 activations "
                            "(rounded per 32 values, integer dot products as llama.cpp does: products 2-3x faster "
                            "on Q4_K/Q6_K, outputs within ~1% of the exact ones) against Q4_0, Q5_0, Q4_K, Q5_K "
                            "and Q6_K weights, and Q8_0 too ('int8'), or the exact fp32 activations everywhere "
                            "('fp32'). auto: int8 except where a product has Q8_0 weights (a file's precise "
                            "matrices, such as a small model's output head).")
    triton_attention: bool = Field(True, description="On CUDA, write the KV cache and run decode attention with the "
                                                     "Triton kernels that read the paged cache in place (and graph "
                                                     "decode steps unless --enforce-eager); off: torch's SDPA over "
                                                     "gathered blocks, eagerly.")
    threads: int | None = Field(None, ge=1, description="Intra-op CPU threads (default: OMP_NUM_THREADS when set, "
                                                        "else the cores this process may run on, capped by its "
                                                        "cgroup's CPU quota).")

    @classmethod
    def from_environ(cls, **given: object) -> "TorchOptions":
        """The options of a backend built without a server: ``given`` values over the
        environment variables over the defaults (what ``llmserve serve`` does without YAML)."""
        from llmserve import ServerConfig, load_options

        options, _ = load_options(SECTION, cls, ServerConfig(plugin_flags={SECTION: given}))
        return options  # type: ignore[return-value]
