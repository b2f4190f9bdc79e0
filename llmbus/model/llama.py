"""The Llama-architecture decoder (Llama 2/3, Qwen2/2.5, Mistral) over a paged KV cache.

Tokens of a whole batched step arrive flattened (``[T]``); the attention backend, given at
construction, writes each layer's new keys/values into that layer's cache object and attends per
sequence using the step's ``AttentionMetadata``. q/k/v and gate/up projections are fused: the
loader stacks the Hugging Face weights (``q;k;v`` and ``gate;up`` along the output dim).
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F
from torch import nn

from llmbus.kernels import cpu_native, reference
from llmbus.kernels.kv_cache import PagedKVCache
from llmbus.engine.attention import AttentionBackend, AttentionMetadata, TorchAttentionBackend
from llmbus.model.config import ModelConfig
from llmbus.model.cpu_linear import PackedWeight, can_pack, linear, pack
from llmbus.model.rope import RotaryEmbedding


def _param(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(shape, dtype=dtype, device=device), requires_grad=False)


class RMSNorm(nn.Module):
    """HF's RMSNorm: normalise in fp32, cast back, then scale by the weight."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _param(size, dtype=dtype, device=device)
        self.fused = False  # one pass in C (llmbus.kernels.cpu_native) where it applies: set with packed weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused and (y := cpu_native.rms_norm(x, self.weight, self.eps)) is not None:
            return y
        return reference.rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        d = cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_size, self.kv_size = self.num_heads * d, self.num_kv_heads * d
        self.scale = d**-0.5
        self.qkv_weight = _param(self.q_size + 2 * self.kv_size, cfg.hidden_size, dtype=dtype, device=device)
        self.qkv_bias = _param(self.q_size + 2 * self.kv_size, dtype=dtype, device=device) if cfg.qkv_bias else None
        self.o_weight = _param(cfg.hidden_size, self.q_size, dtype=dtype, device=device)
        self.o_bias = _param(cfg.hidden_size, dtype=dtype, device=device) if cfg.o_bias else None
        self.packed: dict[str, PackedWeight] = {}  # "qkv", "o": packed weights (LlamaForCausalLM.pack_cpu_weights)

    def forward(self, x, cos, sin, cache, meta: AttentionMetadata, backend: AttentionBackend,
                fused: bool = False) -> torch.Tensor:
        """``fused``: the rotation in place by ``llmbus.kernels.fused`` (Triton)."""
        t = x.shape[0]
        qkv = linear(x, self.qkv_weight, self.qkv_bias, self.packed.get("qkv"))
        # q and k sit side by side in qkv: rotate both heads' sets in one pass, then split.
        qk = qkv[:, : self.q_size + self.kv_size].view(t, -1, self.head_dim)
        if fused:
            from llmbus.kernels import fused as triton_fused  # NOTE: imports Triton, which CPU steps never need

            qk = triton_fused.rotary_(qk, cos, sin)
        else:
            rotated = cpu_native.rope(qk, cos, sin) if self.packed else None  # packed: the CPU fast path
            qk = rotated if rotated is not None else reference.rotary(qk, cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = qkv[:, self.q_size + self.kv_size :].view(t, self.num_kv_heads, self.head_dim)
        out = backend.forward(q, k, v, cache, meta, self.scale)
        return linear(out.reshape(t, self.q_size), self.o_weight, self.o_bias, self.packed.get("o"))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        i, h = cfg.intermediate_size, cfg.hidden_size
        self.gate_up_weight = _param(2 * i, h, dtype=dtype, device=device)
        self.gate_up_bias = _param(2 * i, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.down_weight = _param(h, i, dtype=dtype, device=device)
        self.down_bias = _param(h, dtype=dtype, device=device) if cfg.mlp_bias else None
        self.packed: dict[str, PackedWeight] = {}  # "gate_up", "down"

    def forward(self, x: torch.Tensor, fused: bool = False) -> torch.Tensor:
        """``fused``: SiLU-and-multiply by ``llmbus.kernels.fused`` (Triton)."""
        gate_up = linear(x, self.gate_up_weight, self.gate_up_bias, self.packed.get("gate_up"))
        if fused:
            from llmbus.kernels import fused as triton_fused

            act = triton_fused.silu_mul(gate_up)
        else:
            act = cpu_native.silu_mul(gate_up) if self.packed else None  # packed: the CPU fast path
        if act is None:
            gate, up = gate_up.chunk(2, dim=-1)
            # in place on the fresh gate_up output: the same values as silu(gate) * up, one buffer
            act = F.silu(gate, inplace=True).mul_(up)
        return linear(act, self.down_weight, self.down_bias, self.packed.get("down"))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, dtype: torch.dtype, device) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.self_attn = Attention(cfg, dtype, device)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device)
        self.mlp = MLP(cfg, dtype, device)

    def forward(self, h, cos, sin, cache, meta, backend) -> torch.Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class LlamaForCausalLM(nn.Module):
    """Parameters are allocated uninitialised; ``llmbus.model.loader`` fills them.

    ``backend`` may be swapped after loading (``model.backend = ...``) as long as the caches
    handed to ``forward`` come from that backend's ``allocate_cache``."""

    def __init__(self, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device="cpu",
                 backend: AttentionBackend | None = None) -> None:
        super().__init__()
        self.config = config
        self.backend = backend or TorchAttentionBackend()
        v, h = config.vocab_size, config.hidden_size
        self.embed_tokens = _param(v, h, dtype=dtype, device=device)
        self.layers = nn.ModuleList(DecoderLayer(config, dtype, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(h, config.rms_norm_eps, dtype, device)
        # NOTE: with tied embeddings there is no lm_head parameter; the embedding doubles as it.
        self.lm_head = None if config.tie_word_embeddings else _param(v, h, dtype=dtype, device=device)
        rope_device = "cpu" if torch.device(device).type == "meta" else device
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings, rope_device)
        self.packed_lm_head: PackedWeight | None = None
        # int64 [L, 10] weight addresses for cpu_native.decode_layers (set by pack_cpu_weights where
        # every projection is blocked): a step of only decodes runs all its layers in one C call
        self.decode_stack: torch.Tensor | None = None
        # the layers' norms, residual adds, rotation and SiLU-and-multiply in llmbus.kernels.fused (Triton):
        # None = on CUDA unless LLMBUS_TRITON_FUSED=0; True/False forces it (tests run it on CPU
        # under the Triton interpreter)
        self.fused_ops: bool | None = None

    def _apply(self, fn, recurse=True):  # keep the rope frequencies on the parameters' device
        out = super()._apply(fn, recurse)
        if self.embed_tokens.device.type != "meta":
            self.rotary.to(self.embed_tokens.device)
        if self.decode_stack is not None:  # NOTE: the norms' and biases' storage may have moved
            self.decode_stack = self._decode_stack()
        return out

    def pack_cpu_weights(self) -> bool:
        """Reorder every projection weight once into a layout for a faster CPU product
        (``llmbus.model.cpu_linear``: ours blocked for bf16 and float32 on CPUs with AVX-512 or
        AVX2, else oneDNN's) and free the plain copies, so the model holds one copy of each.
        Returns False, changing nothing, where packing is unsupported (not CPU, fp16, a weight no
        layout takes).

        After this the projection parameters are empty: the model only runs forward."""
        if self.packed_lm_head is not None:
            return False
        projections = [(module, name) for layer in self.layers
                       for module, name in ((layer.self_attn, "qkv"), (layer.self_attn, "o"), (layer.mlp, "gate_up"),
                                            (layer.mlp, "down"))]  # fmt: skip
        if not all(can_pack(w) for w in [*(getattr(m, f"{n}_weight") for m, n in projections), self.lm_head_weight]):
            return False  # not CPU, fp16, or e.g. bf16 outputs not a multiple of 16 where oneDNN has no bf16
        for module, name in projections:
            param = getattr(module, f"{name}_weight")
            module.packed[name] = pack(param)
            param.data = param.data.new_empty(0)
        self.packed_lm_head = pack(self.lm_head_weight)
        for norm in [self.norm] + [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]:
            norm.fused = True
        if self.lm_head is not None:  # NOTE: a tied head is the embedding table, still needed for lookups
            self.lm_head.data = self.lm_head.data.new_empty(0)
        self.decode_stack = self._decode_stack()
        return True

    def _decode_stack(self) -> torch.Tensor | None:
        """The layers' weight addresses for ``cpu_native.decode_layers``, or None where it does not
        serve: a projection not blocked (oneDNN's layout), a weight of another dtype or not contiguous,
        ``LLMBUS_CPU_FUSED_LAYERS=0`` (the per-layer modules run, for comparison)."""
        if os.environ.get("LLMBUS_CPU_FUSED_LAYERS", "1") == "0":
            return None
        dtype = self.embed_tokens.dtype
        if dtype not in (torch.bfloat16, torch.float32):
            return None
        rows = []
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            tensors = [layer.input_layernorm.weight, attn.packed["qkv"].blocked, attn.qkv_bias, attn.packed["o"].blocked,
                       attn.o_bias, layer.post_attention_layernorm.weight, mlp.packed["gate_up"].blocked,
                       mlp.gate_up_bias, mlp.packed["down"].blocked, mlp.down_bias]  # fmt: skip
            if any(t is not None and (t.dtype != dtype or not t.is_contiguous()) for t in tensors):
                return None
            if any(tensors[i] is None for i in (0, 1, 3, 5, 6, 8)):  # norms and projections: blocked ones
                return None
            rows.append([0 if t is None else t.data_ptr() for t in tensors])
        return torch.tensor(rows, dtype=torch.int64)

    def _decode_layers(self, h: torch.Tensor, cos, sin, kv_caches: list, meta: AttentionMetadata) -> bool:
        """All layers in one C call when the step is only decodes and the attention backend's fused
        kernel serves the caches; False (nothing done) otherwise."""
        if self.decode_stack is None or meta.num_decodes != h.shape[0]:
            return False
        c, cfg = kv_caches[0], self.config
        if isinstance(c, torch.Tensor):
            if c.dim() != 5 or (c.shape[0], *c.shape[3:]) != (2, cfg.num_key_value_heads, cfg.head_dim):
                return False  # not this model's cache layout: the modules raise on it
        elif (not isinstance(c, PagedKVCache) or c.model_dtype != h.dtype
              or (c.layout.num_kv_heads, c.layout.head_dim) != (cfg.num_key_value_heads, cfg.head_dim)):
            return False
        tables_for = getattr(self.backend, "native_decode_tables", None)
        native = tables_for(c, meta, cfg.num_attention_heads) if tables_for else None
        if native is None:
            return False
        attn = self.layers[0].self_attn
        cpu_native.decode_layers(h, cos, sin, self.decode_stack, kv_caches, meta.slot_mapping, native.tables,
                                 native.lens, attn.num_heads, cfg.intermediate_size,
                                 self.layers[0].input_layernorm.eps, attn.scale, meta.tail_slots,
                                 meta.tail_rows)  # fmt: skip
        return True

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.embed_tokens if self.lm_head is None else self.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[object],
                meta: AttentionMetadata) -> torch.Tensor:
        """``input_ids``/``positions`` ``[T]`` int64 (the step's tokens, decodes first) ->
        final hidden states ``[T, hidden]`` in the model dtype. Writes every layer's KV cache."""
        if input_ids.dim() != 1 or positions.shape != input_ids.shape:
            raise ValueError(
                f"input_ids and positions must be 1-D and the same length, got {tuple(input_ids.shape)} "
                f"and {tuple(positions.shape)}"
            )
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"expected {len(self.layers)} per-layer KV caches, got {len(kv_caches)}")
        h = F.embedding(input_ids, self.embed_tokens)
        cos, sin = self.rotary.cos_sin(positions, h.dtype)
        if self._fused(h):
            return self._fused_layers(h, cos, sin, kv_caches, meta)
        if not self._decode_layers(h, cos, sin, kv_caches, meta):
            for layer, cache in zip(self.layers, kv_caches):
                h = layer(h, cos, sin, cache, meta, self.backend)
        return self.norm(h)

    def _fused(self, h: torch.Tensor) -> bool:
        if self.fused_ops is None:
            self.fused_ops = h.is_cuda and os.environ.get("LLMBUS_TRITON_FUSED", "1") != "0"
        return self.fused_ops

    def _fused_layers(self, h: torch.Tensor, cos, sin, kv_caches: list, meta: AttentionMetadata) -> torch.Tensor:
        """The layers with their glue in ``llmbus.kernels.fused``: ``residual`` carries ``h`` and each norm
        adds the previous sublayer's output into it first, so a layer is four element-wise launches
        (rotation, norm with the add, SiLU-and-multiply, the next norm with the add), plus the first norm."""
        from llmbus.kernels import fused as triton_fused

        residual = h
        norms = [n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm)]
        norms.append(self.norm)
        x = triton_fused.rms_norm(h, norms[0].weight, norms[0].eps)
        for i, (layer, cache) in enumerate(zip(self.layers, kv_caches)):
            a = layer.self_attn(x, cos, sin, cache, meta, self.backend, fused=True)
            x = triton_fused.rms_norm(a, norms[2 * i + 1].weight, norms[2 * i + 1].eps, residual)
            m = layer.mlp(x, fused=True)
            x = triton_fused.rms_norm(m, norms[2 * i + 2].weight, norms[2 * i + 2].eps, residual)
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, hidden]`` -> ``[N, vocab]`` float32 (the product is formed in the model dtype, as HF does)."""
        return linear(hidden, self.lm_head_weight, None, self.packed_lm_head).float()
