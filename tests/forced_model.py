"""A generated tiny model (and its tokenizer alone) for forced tool calls in a family's own syntax.

The vocabulary spells any printable ASCII text one character per token, and also holds the tags
of the XML and JSON formats as whole regular tokens (``<tool_call>``, ``<parameter=``, ...) and
the harmony, ChatML and other special-token markers as special tokens (``<|channel|>``,
``<|call|>``, ``<|im_end|>``, ``[TOOL_CALLS]``, ``<|tool_call_begin|>``, ...), as the real
families' vocabularies do. The weights are random (a 2-layer Llama): what it writes
is noise, so only the constraint makes it a call.

``family`` picks the chat template (the family's real template from ``tests/parsers/templates``
when present, else a minimal one in its format) and the end-of-sequence ids: ``<|im_end|>`` for
Qwen3-Coder and hermes, ``<|return|>`` and ``<|call|>`` for gpt-oss (as gpt-oss's generation
config lists them).
"""

from __future__ import annotations

import os

TEMPLATES = os.path.join(os.path.dirname(__file__), "parsers", "templates")
BASE = ["<tool_call>", "</tool_call>", "<function=", "</function>", "<parameter=", "</parameter>",
        '{"', '": ', '", "', "true", "false", "null"]
REGULAR = [*BASE, "<tool_calls>", "</tool_calls>", "functools"]
HARMONY = ["<|start|>", "<|end|>", "<|channel|>", "<|message|>", "<|constrain|>", "<|call|>", "<|return|>"]
CHATML = ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]
#: The markers that are special tokens in their families' vocabularies (Kimi-K2, DeepSeek,
#: Mistral, InternLM, Granite).
MARKERS = ["<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>",
           "<|tool_call_argument_begin|>", "<|tool_call_end|>", "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>",
           "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>", "[TOOL_CALLS]", "[ARGS]", "[CALL_ID]",
           "<|action_start|>", "<|plugin|>", "<|action_end|>", "<|tool_call|>"]

_MINIMAL = {
    "qwen3-coder": ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools>"
                    "<|im_end|>\n{% endif %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"),
    "gpt-oss": ("{% for m in messages %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endfor %}"
                "{% if add_generation_prompt %}<|start|>assistant{% endif %}"),
}
_MINIMAL["hermes-3"] = _MINIMAL["qwen3-coder"]


def template(family: str) -> str:
    """The family's real chat template when the test data has it, else a minimal one."""
    path = os.path.join(TEMPLATES, family + ".jinja")
    if os.path.exists(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return _MINIMAL[family]


def build_tokenizer(family: str = "qwen3-coder", every_family: bool = True):
    """The tokenizer alone (a ``PreTrainedTokenizerFast``); ``every_family`` false keeps only the
    qwen3-coder, hermes, harmony and ChatML tags."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = [chr(c) for c in range(32, 127)] + ["\n", "\t"]
    vocab = {t: i for i, t in enumerate(["<unk>", *chars, *(REGULAR if every_family else BASE)])}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    eos = "<|return|>" if family == "gpt-oss" else "<|im_end|>"
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token=eos)
    fast.add_special_tokens({"additional_special_tokens": HARMONY + CHATML + (MARKERS if every_family else [])})
    fast.chat_template = template(family)
    return fast


def build_forced_model(path: str, family: str) -> str:
    """Write the model and tokenizer of ``family`` to ``path``; return ``path``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    # The served models keep the vocabulary their end-to-end runs were checked with: the random
    # weights, and so what greedy decoding writes inside the constraint, follow its size (a larger
    # one made the parallel qwen3-coder run write calls until max_tokens).
    fast = build_tokenizer(family, every_family=False)
    eos = [fast.convert_tokens_to_ids(t) for t in (("<|return|>", "<|call|>") if family == "gpt-oss"
                                                    else ("<|im_end|>",))]
    cfg = LlamaConfig(vocab_size=len(fast), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=eos[0], bos_token_id=0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(eos_token_id=eos, bos_token_id=0)
    model.save_pretrained(path)
    fast.save_pretrained(path)
    return path
