"""A decode-only step's decoder layers in one C call (``cpu_native.decode_layers``): the same
hidden states and caches as the layer modules (bf16 bit for bit; float32 up to the order of sums),
and logits that track transformers."""

from __future__ import annotations

import pytest
import torch
import transformers  # the independent reference

from llmbus.kernels import cpu_native
from llmbus.kernels.backends import CpuPagedAttentionBackend
from llmbus.kernels.cpu import CpuAttentionBackend
from llmbus.engine.config import EngineConfig
from llmbus.engine.engine import Engine
from llmbus.engine.sampling_params import SamplingParams
from llmbus.kv.formats import KVFormat
from llmbus.model.loader import load_model
from tests.model_factory import PagedDriver, write_random_model

# the dtype's linear kernel: AVX-512 or AVX2 with FMA (bf16 with the bf16 dot instruction where there is one)
needs_bf16 = pytest.mark.skipif(not cpu_native.has_linear_bf16(), reason="no bf16 linear kernel here (or no C compiler)")
DTYPES = [pytest.param("bfloat16", marks=needs_bf16),
          pytest.param("float32", marks=pytest.mark.skipif(not cpu_native.has_linear_f32(), reason="no float32 linear kernel here"))]

CASES = {
    "llama_gqa2": ("llama", {}),
    "qwen2_bias": ("qwen2", {"num_attention_heads": 8, "num_key_value_heads": 2}),  # q/k/v biases, GQA 4
    "llama_all_bias": ("llama", {"attention_bias": True, "mlp_bias": True}),
    # multi-head, head_dim 64 (the kernels' specialised loops, bf16 dot products over the head)
    "llama_mha_d64": ("llama", {"hidden_size": 256, "num_key_value_heads": 4, "intermediate_size": 256}),
}


def _packed_model(model_dir, dtype: str = "bfloat16"):
    model = load_model(model_dir, dtype=dtype).model
    model.backend = CpuAttentionBackend()
    assert model.pack_cpu_weights()
    assert model.decode_stack is not None
    return model


class _Counted:
    """Counts the calls of ``cpu_native.decode_layers`` (the real one runs)."""

    def __init__(self, monkeypatch) -> None:
        self.calls = 0
        real = cpu_native.decode_layers

        def counted(*args, **kwargs):
            self.calls += 1
            return real(*args, **kwargs)

        monkeypatch.setattr(cpu_native, "decode_layers", counted)


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """bf16: identical; float32: within the rounding of sums taken in another order."""
    return torch.equal(x, y) if x.dtype != torch.float32 else torch.allclose(x, y, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layers_equal_the_layer_modules(tmp_path, monkeypatch, name, threads, dtype):
    arch, overrides = CASES[name]
    model_dir = write_random_model(tmp_path, {"num_hidden_layers": 3, **overrides}, seed=5, architecture=arch)
    model = _packed_model(model_dir, dtype)
    stack = model.decode_stack
    counted = _Counted(monkeypatch)
    fused, plain = PagedDriver(model, seed=1), PagedDriver(model, seed=1)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _step_both(model, stack, fused, plain)
    finally:
        torch.set_num_threads(old)
    assert counted.calls == 19  # every decode-only step; not the one with a prefill chunk
    assert all(_same(x, y) for x, y in zip(fused.caches, plain.caches))


def _step_both(model, stack, fused: PagedDriver, plain: PagedDriver) -> None:
    """The same steps through ``fused`` (layers in one call) and ``plain`` (the modules), logits
    compared step by step: three prompts, then 20 decode steps, a fourth sequence joining at the
    tenth through a mixed step."""
    g = torch.Generator().manual_seed(3)
    prompts = {s: torch.randint(0, 512, (n,), generator=g).tolist() for s, n in (("a", 40), ("b", 17), ("c", 70))}
    try:
        for driver, decode_stack in ((fused, stack), (plain, None)):
            model.decode_stack = decode_stack
            driver.step(list(prompts.items()))  # prefill chunks: the layer modules either way
        for i in range(20):  # every sequence decodes; one joins late through a mixed step
            step = [(s, [int(t)]) for s, t in zip("abc", torch.randint(0, 512, (3,), generator=g))]
            if i == 10:
                step.append(("d", torch.randint(0, 512, (9,), generator=g).tolist()))
            elif i > 10:
                step.append(("d", [7]))
            outs = {}
            for driver, decode_stack in ((fused, stack), (plain, None)):
                model.decode_stack = decode_stack
                outs[driver is fused] = driver.step(step)
            assert all(_same(x, y) for x, y in zip(outs[True], outs[False])), f"step {i}"
    finally:
        model.decode_stack = stack


@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_decode_tracks_transformers(tmp_path, monkeypatch, dtype):
    """Token-by-token decoding through the fused layers: in bf16 as close to transformers' fp32
    logits as transformers' own bf16 run; in float32 within 1e-4 of them."""
    model_dir = write_random_model(tmp_path, {"num_hidden_layers": 3}, seed=11, architecture="llama")
    ids = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(12)).tolist()
    with torch.no_grad():
        ref32 = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()(
            torch.tensor([ids])).logits[0].float()
        ref16 = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).eval()(
            torch.tensor([ids])).logits[0].float()
    counted = _Counted(monkeypatch)
    driver = PagedDriver(_packed_model(model_dir, dtype))
    got = torch.cat(driver.step([("a", ids[:20])]) + [driver.step([("a", [t])])[0] for t in ids[20:]])
    assert counted.calls == 40
    ours_err, hf_err = (got - ref32).abs().max().item(), (ref16 - ref32).abs().max().item()
    if dtype == "float32":
        assert ours_err < 1e-4, ours_err
    else:
        assert ours_err < max(2 * hf_err, 0.02), (ours_err, hf_err)


@needs_bf16
def test_bad_slots_and_tables_are_refused(tmp_path):
    model = _packed_model(write_random_model(tmp_path, {"num_hidden_layers": 2}, seed=2))
    driver = PagedDriver(model, num_blocks=8)
    driver.step([("a", list(range(5, 25)))])
    caches = driver.caches
    cfg, attn = model.config, model.layers[0].self_attn
    h = torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.zeros(1, cfg.head_dim // 2, dtype=torch.bfloat16)
    lens = torch.tensor([21], dtype=torch.int32)

    def run(slot: int, table: list[int]) -> None:
        cpu_native.decode_layers(h, cos, sin, model.decode_stack, caches, torch.tensor([slot]),
                                 torch.tensor([table], dtype=torch.int32), lens, attn.num_heads,
                                 cfg.intermediate_size, 1e-6, attn.scale)  # fmt: skip

    before = [c.clone() for c in caches]
    with pytest.raises(ValueError, match="slot"):
        run(8 * 16, [0, 1])
    assert all(torch.equal(a, b) for a, b in zip(before, caches))  # refused before any write
    with pytest.raises(ValueError, match="outside the cache"):
        run(20, [0, 99])
    with pytest.raises(ValueError, match="layer addresses"):
        cpu_native.decode_layers(h, cos, sin, model.decode_stack[:1], caches, torch.tensor([20]),
                                 torch.tensor([[0, 1]], dtype=torch.int32), lens, attn.num_heads,
                                 cfg.intermediate_size, 1e-6, attn.scale)  # fmt: skip


@needs_bf16
def test_a_layer_table_is_checked_again_after_an_edit(tmp_path):
    """The check that every layer has its weights is kept from step to step (a model's table does
    not change), but not past an edit in place or for another table."""
    model = _packed_model(write_random_model(tmp_path, {"num_hidden_layers": 2}, seed=2))
    driver = PagedDriver(model, num_blocks=8)
    driver.step([("a", list(range(5, 25)))])
    cfg, attn = model.config, model.layers[0].self_attn
    cos = sin = torch.zeros(1, cfg.head_dim // 2, dtype=torch.bfloat16)

    def run(layers: torch.Tensor) -> None:
        h = torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16)
        cpu_native.decode_layers(h, cos, sin, layers, driver.caches, torch.tensor([20]),
                                 torch.tensor([driver.tables["a"]], dtype=torch.int32), torch.tensor([21], dtype=torch.int32),
                                 attn.num_heads, cfg.intermediate_size, 1e-6, attn.scale)  # fmt: skip

    stack = model.decode_stack.clone()
    run(stack)
    run(stack)  # found whole before: not checked again
    stack[1, 3] = 0  # layer 1 loses its o projection
    with pytest.raises(ValueError, match="norm and projection weights"):
        run(stack)
    other = model.decode_stack.clone()
    other[0, 0] = 0
    with pytest.raises(ValueError, match="norm and projection weights"):
        run(other)
    run(model.decode_stack)


@needs_bf16
def test_fused_layers_can_be_turned_off(tmp_path, monkeypatch):
    model_dir = write_random_model(tmp_path, {"num_hidden_layers": 2}, seed=4)
    monkeypatch.setenv("LLMBUS_CPU_FUSED_LAYERS", "0")
    model = load_model(model_dir, dtype="bfloat16").model
    assert model.pack_cpu_weights() and model.decode_stack is None
    monkeypatch.setenv("LLMBUS_CPU_GEMM", "onednn")  # not blocked: no stack either (nor packing where
    monkeypatch.delenv("LLMBUS_CPU_FUSED_LAYERS")  # oneDNN has no bf16)
    model = load_model(model_dir, dtype="bfloat16").model
    assert model.pack_cpu_weights() == bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    assert model.decode_stack is None


@needs_bf16
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_engine_generates_the_same_tokens_with_the_fused_layers(tmp_path, monkeypatch, micro_batches):
    """Through the engine (its runner, the CPU backend, micro-batches on threads), greedy tokens and
    logprobs with the layers in one call equal the modules'."""
    model_dir = write_random_model(tmp_path, {"num_hidden_layers": 3, "dtype": "bfloat16"}, seed=6)
    counted = _Counted(monkeypatch)
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("LLMBUS_CPU_FUSED_LAYERS", flag)
        engine = Engine.from_model_dir(str(model_dir), EngineConfig(dtype="bfloat16", device="cpu", num_threads=2,
                                                                    cpu_micro_batches=micro_batches))  # fmt: skip
        assert (engine.model.decode_stack is not None) == (flag == "1")
        params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0)
        for i, n in enumerate((1, 9, 30)):  # a one-token prompt too
            engine.add_request(f"r{i}", list(range(3, 3 + n)), params)
        got: dict[str, list] = {}
        while engine.has_unfinished():
            for out in engine.step():
                got.setdefault(out.request_id, []).extend((t, lp.logprob) for t, lp in zip(out.new_token_ids, out.logprobs))
        outs[flag] = got
    assert outs["1"] == outs["0"]
    assert counted.calls >= 9


@needs_bf16
def test_modules_serve_where_the_fused_call_does_not(tmp_path, monkeypatch):
    model = _packed_model(write_random_model(tmp_path, {"num_hidden_layers": 2}, seed=7))
    counted = _Counted(monkeypatch)
    model.backend = CpuAttentionBackend(native=False)  # the torch decode path: no fused tables
    driver = PagedDriver(model)
    driver.step([("a", list(range(3, 20)))])
    driver.step([("a", [5])])
    assert counted.calls == 0
    model.backend = CpuAttentionBackend()
    wrong = PagedDriver(model)  # caches shaped for another model: the modules raise, as without the fused call
    wrong.caches = [torch.zeros(2, 64, 16, 4, model.config.head_dim, dtype=torch.bfloat16) for _ in wrong.caches]
    with pytest.raises(RuntimeError):
        wrong.step([("a", [5])])
    assert counted.calls == 0


@needs_bf16
def test_the_stack_follows_storage_that_moves(tmp_path):
    model = _packed_model(write_random_model(tmp_path, {"num_hidden_layers": 2}, seed=8))
    model.share_memory()  # moves every parameter's storage
    assert model.decode_stack[0, 0] == model.layers[0].input_layernorm.weight.data_ptr()
    assert model.decode_stack[1, 5] == model.layers[1].post_attention_layernorm.weight.data_ptr()


def _engine_run(model_dir, monkeypatch, fused: str, kv_format: str, dtype: str, **env) -> tuple[dict, list]:
    monkeypatch.setenv("LLMBUS_CPU_FUSED_LAYERS", fused)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    engine = Engine.from_model_dir(str(model_dir), EngineConfig(dtype=dtype, device="cpu", num_threads=2,
                                                                kv_format=kv_format, block_size=16))  # fmt: skip
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logprobs=0)
    for i, n in enumerate((1, 9, 30, 47)):  # blocks seal during decode (16-token blocks)
        engine.add_request(f"r{i}", list(range(3, 3 + n)), params)
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend((t, lp.logprob) for t, lp in zip(out.new_token_ids, out.logprobs))
    return got, engine.runner.kv_caches


def _cache_tensors(cache) -> list[torch.Tensor]:
    return [t for t in (cache.data, cache.scale, cache.k_meta, cache.v_meta, cache.k_tail, cache.v_tail) if t is not None]


@pytest.mark.parametrize("kv_format,env", [("int8", {}), ("int4", {}), ("int4", {"LLMBUS_KV_TAILS": "0"}), ("int4r", {})])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layers_over_quantized_caches_equal_the_layer_modules(tmp_path, monkeypatch, kv_format, env, dtype):
    """int8, int4 and int4r caches (int4 with and without exact tail rows) in one C call per step: the
    same greedy tokens and logprobs and the same cache bytes (metadata and tail rows included) as the
    layer modules, which call the same quantizing writes and decodes one layer at a time (int4r: and
    the same rotations and query rounding)."""
    model_dir = write_random_model(tmp_path, {"num_hidden_layers": 3, "dtype": dtype}, seed=9)
    counted = _Counted(monkeypatch)
    fused, fused_caches = _engine_run(model_dir, monkeypatch, "1", kv_format, dtype, **env)
    calls = counted.calls
    plain, plain_caches = _engine_run(model_dir, monkeypatch, "0", kv_format, dtype, **env)
    assert calls >= 20 and counted.calls == calls  # the fused run's decode steps; none in the plain run
    assert fused == plain
    assert fused_caches[0].fmt.name == kv_format
    if kv_format.startswith("int4"):
        assert (fused_caches[0].k_tail is None) == ("LLMBUS_KV_TAILS" in env)
    for a, b in zip(fused_caches, plain_caches):
        assert all(torch.equal(x, y) for x, y in zip(_cache_tensors(a), _cache_tensors(b)))


QUANTIZED = {"int8": KVFormat("int8"), "int8_fp32_scales": KVFormat("int8", "float32"), "int4": KVFormat("int4"),
             "int4r": KVFormat("int4r")}


@pytest.mark.parametrize("name", sorted(QUANTIZED))
@pytest.mark.parametrize("dtype", DTYPES)
def test_fused_layers_over_quantized_caches_step_by_step(tmp_path, monkeypatch, name, dtype):
    """Every quantized cache kind (int8 with fp16 or fp32 scales, int4, int4r) in one call per decode step:
    the same logits and cache bytes as the modules, step by step."""
    model = _packed_model(write_random_model(tmp_path, {"num_hidden_layers": 3}, seed=5), dtype)
    model.backend = backend = CpuPagedAttentionBackend(QUANTIZED[name])
    counted = _Counted(monkeypatch)
    fused, plain = PagedDriver(model, seed=1, backend=backend), PagedDriver(model, seed=1, backend=backend)
    _step_both(model, model.decode_stack, fused, plain)
    assert counted.calls == 19
    assert fused.caches[0].fmt == QUANTIZED[name]
    for a, b in zip(fused.caches, plain.caches):
        assert all(torch.equal(x, y) for x, y in zip(_cache_tensors(a), _cache_tensors(b)))


@needs_bf16
def test_quantized_caches_the_kernels_do_not_serve_keep_the_modules(tmp_path, monkeypatch):
    """int4 with LLMBUS_CPU_INT4_FUSED=0 (its per-layer path is the torch reference) and int8 caches
    that are not contiguous: the layers run one by one."""
    model = _packed_model(write_random_model(tmp_path, {"num_hidden_layers": 2}, seed=7))
    counted = _Counted(monkeypatch)
    model.backend = backend = CpuPagedAttentionBackend(KVFormat("int4"))
    monkeypatch.setattr(cpu_native, "INT4_FUSED", False)
    driver = PagedDriver(model, backend=backend)
    driver.step([("a", list(range(3, 20)))])
    driver.step([("a", [5])])
    monkeypatch.setattr(cpu_native, "INT4_FUSED", True)
    model.backend = backend = CpuPagedAttentionBackend(KVFormat("int8"))
    driver = PagedDriver(model, backend=backend)
    for c in driver.caches:  # a strided view of a larger allocation
        c.data = torch.zeros(2, 2 * c.num_blocks, *c.data.shape[2:], dtype=torch.int8)[:, : c.num_blocks]
    driver.step([("a", list(range(3, 20)))])
    driver.step([("a", [5])])
    assert counted.calls == 0


@needs_bf16
def test_bad_int4_tail_slots_and_mismatched_caches_are_refused(tmp_path):
    """Refused before any write: a tail slot at the wrong block offset, tail rows past the cache's,
    and layers whose caches differ (here: in their tail rows)."""
    model = _packed_model(write_random_model(tmp_path, {"num_hidden_layers": 2}, seed=2))
    model.backend = backend = CpuPagedAttentionBackend(KVFormat("int4"))
    driver = PagedDriver(model, num_blocks=8, backend=backend)
    driver.caches = backend.allocate_cache(driver.layout, 8, "cpu", tail_rows=2)
    driver.step([("a", list(range(5, 25)))])
    caches = driver.caches
    cfg, attn = model.config, model.layers[0].self_attn
    h = torch.zeros(1, cfg.hidden_size, dtype=torch.bfloat16)
    cos = sin = torch.zeros(1, cfg.head_dim // 2, dtype=torch.bfloat16)
    table, lens = torch.tensor([driver.tables["a"]], dtype=torch.int32), torch.tensor([21], dtype=torch.int32)
    slot = driver.tables["a"][1] * 16 + 4

    def run(tail_slot: int, tail_row: int, layers=caches) -> None:
        cpu_native.decode_layers(h, cos, sin, model.decode_stack, layers, torch.tensor([slot]), table, lens,
                                 attn.num_heads, cfg.intermediate_size, 1e-6, attn.scale, torch.tensor([tail_slot]),
                                 torch.tensor([tail_row]))  # fmt: skip

    before = [t.clone() for c in caches for t in _cache_tensors(c)]
    with pytest.raises(ValueError, match="tail slot"):
        run(16 + 5, 1)
    with pytest.raises(ValueError, match="tail_rows"):
        run(16 + 4, 2)
    other = backend.allocate_cache(driver.layout, 8, "cpu", tail_rows=1)
    with pytest.raises(ValueError, match="tail rows each"):
        run(16 + 4, 1, [caches[0], other[1]])
    assert all(torch.equal(a, b) for a, b in zip(before, [t for c in caches for t in _cache_tensors(c)]))
    run(16 + 4, 1)  # a good one writes
    assert not all(torch.equal(a, b) for a, b in zip(before, [t for c in caches for t in _cache_tensors(c)]))
