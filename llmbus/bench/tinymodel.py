"""A tiny random Llama directory (config, safetensors, tokenizer.json) for harness checks and tests.

Nothing is downloaded: the byte-level BPE tokenizer is trained here on generated text. Use the
project's demo model (`llmbus demo-model`) for real benchmarks; this one only has to load
everywhere (our engine, Hugging Face, vllm).
"""

from __future__ import annotations

import json
import os
import random

_WORDS = ("the a of to and in is it that for on with as was at by this be from or have an are not "
          "model token cache block batch prefill decode stream request server bench latency time").split()


def write_tokenizer(out_dir: str, vocab_size: int = 512, seed: int = 0) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    rng = random.Random(seed)
    corpus = [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    template = ("{% for m in messages %}<s>{{ m['role'] }}\n{{ m['content'] }}</s>{% endfor %}"
                "{% if add_generation_prompt %}<s>assistant\n{% endif %}")
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
                   "model_max_length": 2048, "chat_template": template}, f)


def write_tiny_llama(out_dir: str, *, hidden: int = 256, layers: int = 2, heads: int = 4, kv_heads: int = 2,
                     vocab_size: int = 512, seed: int = 0) -> str:
    """Writes the model into `out_dir` (created) and returns it."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    os.makedirs(out_dir, exist_ok=True)
    write_tokenizer(out_dir, vocab_size=vocab_size, seed=seed)
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      max_position_embeddings=2048, bos_token_id=0, eos_token_id=1,
                      initializer_range=0.08, tie_word_embeddings=False, torch_dtype="float32")
    LlamaForCausalLM(cfg).to(torch.float32).save_pretrained(out_dir)
    return out_dir


if __name__ == "__main__":
    import sys

    print(write_tiny_llama(sys.argv[1] if len(sys.argv) > 1 else "tiny-llama"))
