"""The engine end to end on CPU: greedy output equals transformers token for token, under every
scheduling regime (chunked prefill, prefix caching on/off, forced preemption), and no block leaks."""

from __future__ import annotations

import random

import pytest
import torch

from llmbus.engine.llm import LLM
from llmbus.engine.sampling_params import SamplingParams
from tests.model_factory import write_random_model

MAX_NEW = 20
CONFIG = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.08,
)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("engine-model")
    write_random_model(path, CONFIG, seed=1, architecture="llama")
    return path


@pytest.fixture(scope="module")
def prompts():
    rng = random.Random(0)
    lengths = [3, 16, 17, 40, 71, 9]
    return [[rng.randrange(3, CONFIG["vocab_size"]) for _ in range(n)] for n in lengths]


@pytest.fixture(scope="module")
def hf_outputs(model_dir, prompts):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    hf.generation_config.eos_token_id = None
    hf.generation_config.pad_token_id = 0
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False)
            outs.append(gen[0, len(p):].tolist())
    # the random model must not be degenerate, or equality proves little
    assert len({tuple(o) for o in outs}) == len(outs)
    return outs


GREEDY = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

REGIMES = {
    "default": dict(),
    "chunked-small": dict(max_num_batched_tokens=8),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "no-chunking": dict(enable_chunked_prefill=False),
    "preemption": dict(num_blocks=10, max_num_batched_tokens=32),
    "one-thread": dict(num_threads=1),
    "three-microbatches": dict(num_threads=2, cpu_micro_batches=3),  # more micro-batches than cores: still exact
}


@pytest.mark.parametrize("regime", sorted(REGIMES))
def test_greedy_equals_transformers(model_dir, prompts, hf_outputs, regime):
    llm = LLM(model_dir, dtype="float32", device="cpu", **REGIMES[regime])
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == hf_outputs
    assert all(o.finish_reason == "length" for o in outs)
    leaks = llm.engine.leak_check()
    assert leaks["requests"] == 0
    assert leaks["free_blocks"] == leaks["total_blocks"]
    if regime == "preemption":
        assert llm.engine.num_preemptions > 0
    if regime == "three-microbatches":
        assert llm.engine.runner.micro_batches == 3


def test_prefix_cache_reuses_shared_prefix(model_dir, prompts, hf_outputs):
    llm = LLM(model_dir, dtype="float32", device="cpu")
    first = llm.generate([prompts[4]], GREEDY)[0]
    again = llm.generate([prompts[4]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    # 71 prompt tokens -> 4 full blocks cached (64 tokens)
    assert again.num_cached_tokens == 64
    assert again.token_ids == first.token_ids == hf_outputs[4]


def test_copies_sent_together_are_prefilled_once(model_dir, prompts, hf_outputs):
    """A request's n choices reach the engine as n copies of one prompt at once: the copies wait a
    step for the first one's blocks and read them, and still match transformers."""
    llm = LLM(model_dir, dtype="float32", device="cpu")
    outs = llm.generate([prompts[4]] * 4 + [prompts[3]], GREEDY)
    assert [o.token_ids for o in outs] == [hf_outputs[4]] * 4 + [hf_outputs[3]]
    # 71 prompt tokens: 4 full blocks computed by the first copy, read by the other three
    assert [o.num_cached_tokens for o in outs] == [0, 64, 64, 64, 0]
    leaks = llm.engine.leak_check()
    assert leaks["free_blocks"] == leaks["total_blocks"]


def test_logit_bias_steers_and_bans(model_dir, prompts, hf_outputs):
    llm = LLM(model_dir, dtype="float32", device="cpu")
    forced = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias=[(7, 100.0)])
    banned = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logit_bias=[(hf_outputs[0][0], -100.0)])
    outs = llm.generate([prompts[0], prompts[0], prompts[1]], [forced, banned, GREEDY])
    assert outs[0].token_ids == [7] * 5
    assert outs[1].token_ids[0] != hf_outputs[0][0] and hf_outputs[0][0] not in outs[1].token_ids
    assert outs[2].token_ids == hf_outputs[1]  # its batch-mates' biases are not its own
    with pytest.raises(ValueError, match="logit_bias id 512 is outside the vocabulary"):
        llm.engine.add_request("bad", prompts[0], SamplingParams(logit_bias=[(512, 1.0)]))


@pytest.fixture(scope="module")
def hf_prompt_logprobs(model_dir, prompts):
    """Per prompt, transformers' log-softmax at each position over the prompt: [n - 1, vocab]."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        return [hf(torch.tensor([p])).logits[0, :-1].float().log_softmax(-1) for p in prompts]


@pytest.mark.parametrize("regime", ["default", "chunked-small", "preemption"])
def test_prompt_logprobs_equal_transformers(model_dir, prompts, hf_prompt_logprobs, hf_outputs, regime):
    llm = LLM(model_dir, dtype="float32", device="cpu", **REGIMES[regime])
    llm.generate([prompts[4]], GREEDY)  # its blocks are now cached: a scoring request must not read them
    params = [SamplingParams(max_tokens=MAX_NEW, temperature=0, ignore_eos=True, prompt_logprobs=k) for k in (0, 3)]
    outs = llm.generate([prompts[4], prompts[1], prompts[0], prompts[3]], params + params)
    for out, i, k in zip(outs, (4, 1, 0, 3), (0, 3, 0, 3)):
        ref, prompt = hf_prompt_logprobs[i], prompts[i]
        assert out.token_ids == hf_outputs[i]
        assert [e.token_id for e in out.prompt_logprobs] == prompt[1:]
        got = torch.tensor([e.logprob for e in out.prompt_logprobs])
        torch.testing.assert_close(got, ref.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], atol=2e-4, rtol=1e-4)
        for e, row in zip(out.prompt_logprobs, ref):
            assert len(e.top) == k
            if k:
                assert [t for t, _ in e.top] == row.topk(k).indices.tolist()
    assert outs[0].num_cached_tokens == 0
    if regime == "preemption":
        assert llm.engine.num_preemptions > 0
    leaks = llm.engine.leak_check()
    assert leaks["free_blocks"] == leaks["total_blocks"]


def test_seeded_sampling_is_independent_of_batch(model_dir, prompts):
    llm = LLM(model_dir, dtype="float32", device="cpu")
    seeded = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=1234, ignore_eos=True)
    alone = llm.generate([prompts[2]], seeded)[0].token_ids
    noisy = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)
    batch = llm.generate(prompts[:2] + [prompts[2]] + prompts[3:], [noisy, noisy, seeded, noisy, noisy, noisy])
    assert batch[2].token_ids == alone
    other = llm.generate([prompts[2]], SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True))
    assert other[0].token_ids != alone


def test_stop_conditions(model_dir, prompts, hf_outputs):
    llm = LLM(model_dir, dtype="float32", device="cpu")
    target = hf_outputs[1]
    stop_tok = target[5]
    first = target.index(stop_tok)
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=MAX_NEW, temperature=0, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop"
    assert out.token_ids == target[: first + 1]
    out = llm.generate([prompts[1]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert (out.finish_reason, out.token_ids) == ("length", target[:4])


def test_logprobs_match_transformers(model_dir, prompts, hf_outputs):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    llm = LLM(model_dir, dtype="float32", device="cpu")
    out = llm.generate([prompts[3]], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True, logprobs=3))[0]
    full = torch.tensor([prompts[3] + out.token_ids[:-1]])
    with torch.no_grad():
        ref = torch.log_softmax(hf(full).logits[0, len(prompts[3]) - 1 :].float(), dim=-1)
    assert len(out.logprobs) == 5
    for i, lp in enumerate(out.logprobs):
        assert lp.token_id == out.token_ids[i]
        assert abs(lp.logprob - ref[i, lp.token_id].item()) < 1e-4
        top_ids = [t for t, _ in lp.top]
        assert top_ids == ref[i].topk(3).indices.tolist()


def test_prompt_tokens_left_counts_neither_computed_cached_nor_running_tokens(model_dir, prompts):
    """What a prefill worker's pull budget reads (from its event loop's thread): a prompt's tokens
    not yet computed, less the chunk of the step now running, less prefix-cache hits once
    scheduled; None for a request the engine does not hold."""
    llm = LLM(model_dir, dtype="float32", device="cpu", max_num_batched_tokens=32)
    engine = llm.engine
    seen = []
    execute = engine.runner.execute

    def watched(out):
        seen.append(engine.prompt_tokens_left("a"))
        return execute(out)

    engine.runner.execute = watched
    p = prompts[4]  # 71 tokens: chunks of 32, 32, 7
    engine.add_request("a", p, GREEDY)
    assert engine.prompt_tokens_left("a") == 71 and engine.prompt_tokens_left("b") is None
    engine.step()
    assert seen == [71 - 32] and engine.prompt_tokens_left("a") == 71 - 32
    engine.step()
    engine.step()
    assert seen == [39, 7, 0] and engine.prompt_tokens_left("a") == 1  # decoding: its last token next
    engine.abort("a")
    assert engine.prompt_tokens_left("a") is None
    seen.clear()
    engine.add_request("a", p, GREEDY)  # again: 64 tokens in the prefix cache
    engine.step()
    assert seen == [0] and engine.prompt_tokens_left("a") == 1


def test_abort_frees_blocks_at_once(model_dir, prompts):
    llm = LLM(model_dir, dtype="float32", device="cpu")
    engine = llm.engine
    total = engine.leak_check()["total_blocks"]
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", p, GREEDY)
    engine.step()
    engine.step()
    assert engine.num_free_blocks < total
    for i in range(len(prompts)):
        assert engine.abort(f"r{i}")
    assert not engine.abort("r0")  # idempotent
    assert not engine.has_unfinished()
    assert engine.leak_check() == {"requests": 0, "handoffs": 0, "free_blocks": total, "total_blocks": total,
                                    "tail_rows": 0}


def test_prefill_handoff_then_import_continues_identically(model_dir, prompts, hf_outputs):
    prefill = LLM(model_dir, dtype="float32", device="cpu").engine
    decode = LLM(model_dir, dtype="float32", device="cpu").engine
    prefill.add_request("h", prompts[4], GREEDY, prefill_only=True)
    first = []
    while prefill.has_unfinished():
        for out in prefill.step():
            first.extend(out.new_token_ids)
            assert out.finish_reason == "handoff"
    state, kv = prefill.export_sequence("h")
    assert prefill.leak_check()["requests"] == 0
    decode.import_sequence(state, kv, GREEDY)
    rest = []
    while decode.has_unfinished():
        for out in decode.step():
            rest.extend(out.new_token_ids)
    assert first + rest == hf_outputs[4]
    leaks = decode.leak_check()
    assert leaks["free_blocks"] == leaks["total_blocks"]


def test_a_pending_handoff_holds_its_id_and_its_context(model_dir, prompts):
    """A finished prefill's KV awaiting export keeps its request id (a second request under it
    would overwrite it, or be aborted with it); aborting it says it dropped something; and an
    engine whose context cannot hold the prompt plus the tokens already generated refuses the
    import instead of decoding past its max_model_len."""
    prefill = LLM(model_dir, dtype="float32", device="cpu").engine
    prefill.add_request("h", prompts[4], GREEDY, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    with pytest.raises(ValueError, match="already in use"):
        prefill.add_request("h", prompts[3], GREEDY)
    state, kv = prefill.export_sequence("h")
    n = len(state["prompt_token_ids"]) + len(state["output_token_ids"])
    short = LLM(model_dir, dtype="float32", device="cpu", max_model_len=n).engine
    with pytest.raises(ValueError, match=f"and {len(state['output_token_ids'])} generated but the model's context is {n}"):
        short.import_sequence(state, kv, GREEDY)
    prefill.add_request("g", prompts[3], GREEDY, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    assert prefill.abort("g") is True and prefill.abort("g") is False
    assert prefill.leak_check()["handoffs"] == 0


def test_imports_wait_while_a_preempted_sequence_waits_to_resume(model_dir):
    """A sequence preempted for blocks goes first: while one waits to resume, import_sequence
    refuses (OutOfBlocks, which a decode worker waits out) instead of taking the blocks it needs,
    which a steady stream of handoffs could otherwise do for ever."""
    from llmbus.engine.engine import OutOfBlocks

    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    prefill = LLM(model_dir, dtype="float32", device="cpu").engine
    states = {}
    for rid, n in (("a", 20), ("b", 40), ("c", 5)):
        prefill.add_request(rid, list(range(3, 3 + n)), params, prefill_only=True)
        while prefill.has_unfinished():
            prefill.step()
        states[rid] = prefill.export_sequence(rid)
    decode = LLM(model_dir, dtype="float32", device="cpu", num_blocks=6).engine
    for rid in ("a", "b"):
        decode.import_sequence(*states[rid], params)
    while not decode.resuming:
        decode.step()
    assert decode.num_preemptions == 1 and decode.num_free_blocks >= 1
    with pytest.raises(OutOfBlocks, match="resume"):
        decode.import_sequence(*states["c"], params)
    while decode.resuming or decode.num_free_blocks == 0:  # b back in the batch, and c's block free
        decode.step()
    decode.import_sequence(*states["c"], params)
    while decode.has_unfinished():
        decode.step()
    # the same again, but aborts empty the engine, which then takes no step: resuming is current
    for rid in ("a", "b"):
        decode.import_sequence(*states[rid], params)
    while not decode.resuming:
        decode.step()
    assert decode.abort("a") and decode.abort("b") and not decode.resuming
    decode.import_sequence(*states["c"], params)
    while decode.has_unfinished():
        decode.step()
    leaks = decode.leak_check()
    assert leaks["requests"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


def test_a_handoff_state_that_does_not_add_up_is_refused_before_it_is_decoded(model_dir, prompts):
    """A handoff comes off the bus: whatever its state claims is checked before the sequence joins
    the batch, where a token outside the vocabulary or a salt that is no string would stop the
    engine at its next step."""
    prefill = LLM(model_dir, dtype="float32", device="cpu").engine
    decode = LLM(model_dir, dtype="float32", device="cpu").engine
    prefill.add_request("h", prompts[4], GREEDY, prefill_only=True)
    while prefill.has_unfinished():
        prefill.step()
    state, kv = prefill.export_sequence("h")
    n = len(state["prompt_token_ids"]) + len(state["output_token_ids"])
    for bad, message in (({"output_token_ids": [decode.vocab_size]}, "outside the vocabulary"),
                         ({"output_token_ids": [-1]}, "outside the vocabulary"),
                         ({"output_token_ids": ["7"]}, "outside the vocabulary"),
                         ({"cache_salt": 5}, "cache_salt must be a string"),
                         ({"num_computed_tokens": 0}, "0 computed tokens"),
                         ({"num_computed_tokens": n}, f"has {n} computed tokens for {n} tokens"),
                         ({"num_computed_tokens": "3"}, "'3' computed tokens"),
                         ({"num_cached_tokens": -1}, "-1 cached tokens")):
        with pytest.raises(ValueError, match=message):
            decode.import_sequence(state | bad, kv, GREEDY)
    with pytest.raises(ValueError, match="expected \\[.*\\] for"):  # rows of another layout's width
        decode.import_sequence(state, kv[:, :, :-8], GREEDY)
    write_blocks = decode.write_blocks

    def failing_write(*args):
        raise RuntimeError("out of device memory")  # after the blocks were allocated

    decode.write_blocks = failing_write
    with pytest.raises(RuntimeError, match="out of device memory"):
        decode.import_sequence(state, kv, GREEDY)
    decode.write_blocks = write_blocks
    assert decode.leak_check() == {"requests": 0, "handoffs": 0, "free_blocks": decode.leak_check()["total_blocks"],
                                    "total_blocks": decode.leak_check()["total_blocks"], "tail_rows": 0}
    decode.import_sequence(state, kv, GREEDY)  # the same state, as prefill wrote it, decodes
    while decode.has_unfinished():
        decode.step()


@pytest.mark.parametrize(
    "prompt, message",
    [([], "empty"), ([1] * 600, "context"), ([1, 99999], "vocabulary")],
)
def test_bad_prompts_are_clear_errors(model_dir, prompt, message):
    llm = LLM(model_dir, dtype="float32", device="cpu")
    with pytest.raises(ValueError, match=message):
        llm.generate([prompt], GREEDY)
    assert llm.engine.leak_check()["requests"] == 0


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(temperature=-1.0), "temperature"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(max_tokens=0), "max_tokens"),
        (dict(min_p=2.0), "min_p"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    ],
)
def test_invalid_sampling_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


def test_a_cache_smaller_than_the_context_is_said_at_start(model_dir, caplog):
    """A pool that cannot hold one full-context sequence (or a context past the model's positions)
    is a warning at start: such a sequence ends with finish_reason "length" at the pool's size."""
    with caplog.at_level("WARNING", logger="llmbus.engine"):
        llm = LLM(model_dir, dtype="float32", device="cpu", num_blocks=2, block_size=16, max_model_len=4096)
    assert "holds 32 tokens (2 blocks of 16), under the 512-token context" in caplog.text
    assert "max_model_len 4096 exceeds the model's 512 positions; using 512" in caplog.text
    out = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=100, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) < 32
    caplog.clear()
    with caplog.at_level("WARNING", logger="llmbus.engine"):
        LLM(model_dir, dtype="float32", device="cpu", num_blocks=64, block_size=16)
    assert "KV cache holds" not in caplog.text


def test_kernels_over_the_gpus_shared_memory_stop_the_engine_at_start(model_dir, monkeypatch):
    """A warm-up step whose kernel needs more shared memory than the GPU has (Triton's
    OutOfResources: every step would fail the same way) fails the engine's start with the format,
    shape and bytes needed; other warm-up failures are logged and the engine starts."""
    from triton.runtime.errors import OutOfResources

    from llmbus.engine.engine import Engine

    def too_big(self):
        raise OutOfResources(288768, 232448, "shared memory")

    monkeypatch.setattr(Engine, "warmup", too_big)
    with pytest.raises(ValueError, match=r"--kv-format int8 at head_dim \d+ and --block-size 16 need 288768 bytes of "
                                         r"GPU shared memory a program, over this GPU's 232448: this model and KV format cannot run on it"):
        LLM(model_dir, warmup=True, kv_format="int8", num_blocks=8)

    def fails(self):
        raise RuntimeError("a compile failed")

    monkeypatch.setattr(Engine, "warmup", fails)
    assert LLM(model_dir, warmup=True, kv_format="int8", num_blocks=8).engine.leak_check()["requests"] == 0


def test_warmup_runs_each_kind_of_step_and_leaves_nothing_behind(model_dir, prompts):
    """Engine.warmup (on by default on CUDA, asked for here): a prompt alone, decodes beside
    prompts (one with a context past a 128-token tile), decodes alone; then no request, no held
    or indexed block, no tail row, and the next requests' tokens are what a cold engine gives."""
    from llmbus.engine import runner as runner_module

    kinds, tokens = [], []
    execute = runner_module.ModelRunner.execute

    def recording(self, out):
        decodes = sum(e.num_new_tokens == 1 for e in out.scheduled)
        kinds.append(("decodes" if decodes else "") + ("+prompt" if decodes < len(out.scheduled) else ""))
        tokens.append(sum(e.num_new_tokens for e in out.scheduled))
        return execute(self, out)

    runner_module.ModelRunner.execute = recording
    try:
        warm = LLM(model_dir, warmup=True, kv_format="int4", num_blocks=32)
        n = len(kinds)
        LLM(model_dir, warmup=True, num_blocks=4)  # too small for the dummy prompts: skipped
        assert len(kinds) == n
    finally:
        runner_module.ModelRunner.execute = execute
    assert kinds[:3] == ["+prompt", "decodes+prompt", "decodes+prompt"] and "decodes" in kinds[3:]
    # last, a prompt of a whole step's budget (here the model's length: 511 of 512 positions), alone
    assert kinds[n - 1] == "+prompt" and tokens[n - 1] == warm.engine.max_model_len - 1 == 511
    engine = warm.engine
    assert engine.leak_check() == {"requests": 0, "handoffs": 0, "free_blocks": 32, "total_blocks": 32, "tail_rows": 0}
    assert engine.block_manager.num_cached_blocks == 0 and engine.block_manager.enable_prefix_caching
    cold = LLM(model_dir, warmup=False, kv_format="int4", num_blocks=32)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=1)
    got, want = warm.generate(prompts[:3], params), cold.generate(prompts[:3], params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_two_checkpoints_of_one_shape_never_share_a_cached_block(model_dir, tmp_path):
    """A block's hash roots at the checkpoint's identity (``LoadedModel.model_id``), not its
    directory's name: another model of the same shapes, in a directory of the same name, names
    the same prompt's blocks differently, so neither tier 0 nor kvpool hands it this model's KV."""
    from llmbus.engine.config import EngineConfig
    from llmbus.engine.engine import Engine

    other = write_random_model(tmp_path / model_dir.name, CONFIG, seed=2, architecture="llama")
    config = EngineConfig(dtype="float32", device="cpu", num_blocks=16)
    a, b = (Engine.from_model_dir(str(d), config) for d in (model_dir, other))
    prompt = list(range(3, 3 + 4 * a.block_manager.block_size))
    assert a.block_manager.model_id == a.loaded.model_id != b.block_manager.model_id
    assert not set(a.prefix_hashes(prompt)) & set(b.prefix_hashes(prompt))
    again = Engine.from_model_dir(str(model_dir), config)
    assert again.prefix_hashes(prompt) == a.prefix_hashes(prompt)
