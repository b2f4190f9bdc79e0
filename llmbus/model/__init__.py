"""The model family (Llama, Qwen2, Mistral), its Hugging Face loader, tokenizer and demo models.

NOTE: importing this package must not import torch: the gateway imports
``llmbus.model.tokenizer`` and ``llmbus.model.config``. Torch modules are imported directly
(``llmbus.model.loader``, ``llmbus.model.llama``, ``llmbus.model.demo``).
"""
