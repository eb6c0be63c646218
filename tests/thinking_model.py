"""A generated tiny model whose reasoning never ends, for the thinking-budget tests.

A 2-layer random Llama over a word-level vocabulary (``w0`` ... ``w199``, ``<think>``,
``</think>``, ``<eos>``) whose chat template opens ``<think>`` at the end of the generation
prompt, as DeepSeek-R1's and Qwen3-Thinking's templates do. The rows of ``</think>`` and of the
end-of-sequence token in its output head are zero: their logit is exactly 0 while some of the
other 200 random logits are positive at every position (each is a random projection of the
same hidden state), so greedy decoding never picks them (nor the special ``<unk>``, whose row is
zero too: every generated token is one word of the text). Left alone, the model thinks until
``max_tokens``; a thinking budget is the only way its reasoning ends.
"""

from __future__ import annotations

WORDS = 200
TEMPLATE = ("{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}"
            "{% if add_generation_prompt %}assistant <think>{% endif %}")


def build_thinking_model(path: str) -> str:
    """Write the model and its tokenizer to ``path``; return ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(WORDS)}
    for word in ("<think>", "</think>", "<eos>", "<unk>", "user", "assistant", "system"):
        vocab[word] = len(vocab)
    cfg = LlamaConfig(vocab_size=len(vocab), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      initializer_range=0.2, tie_word_embeddings=False, eos_token_id=vocab["<eos>"],
                      bos_token_id=vocab["<unk>"])
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for word in ("</think>", "<eos>", "<unk>"):
            model.lm_head.weight[vocab[word]] = 0.0
    model.save_pretrained(path)
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # words joined by spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>", bos_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return path


#: The id of ``</think>`` in the generated vocabulary.
END_ID = WORDS + 1
