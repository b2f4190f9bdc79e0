"""Exact INT4 tail rows in the engine (llmbus.kv.formats): which rows a step reads and writes,
that running sequences hold them and give them back, and that a handed-over sequence starts its
row from the exact tail it received (or, without one, from the block it received)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from llmbus.kernels import quant_reference as qr
from llmbus.kernels import reference as ref
from llmbus.engine.attention import build_attention_metadata
from llmbus.engine.llm import LLM
from llmbus.engine.runner import TailRows
from llmbus.engine.sampling_params import SamplingParams
from llmbus.kv.formats import KVFormat
from llmbus.model.demo import make_demo_model

BS = 16
GREEDY = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True)


def test_rows_switch_only_when_a_step_seals_from_its_row_and_starts_a_block():
    rows = TailRows(5)  # an odd count: the spare row is never handed out
    assert rows.rows_for("a", 0, 20, BS) == (0, 0, True)  # no earlier keys to read: one row
    assert rows.rows_for("a", 20, 1, BS) == (0, 0, False)
    assert rows.rows_for("a", 21, 30, BS) == (0, 1, False)  # seals block 1 from row 0, starts block 3
    assert rows.rows_for("a", 51, 13, BS) == (1, 1, False)  # seals, starts nothing: no switch
    assert rows.rows_for("b", 0, 1, BS)[:2] == (2, 2)
    assert rows.rows_for("c", 0, 1, BS) == (-1, -1, False)  # none left
    assert rows.num_held == 4
    seq = type("Seq", (), {"request_id": "a"})()
    rows.release(seq)
    rows.release(seq)  # idempotent
    assert rows.num_held == 2
    first, later, new = rows.rows_for("c", 0, 1, BS)
    assert new and first == later and first in (0, 1)  # a's rows, handed on


def test_no_step_writes_the_row_it_seals_from():
    """Random chunkings: a sealing token's row holds its block's earlier keys (written by earlier
    steps, in that row), and no token of the same step writes that row (the kernel would race)."""
    rnd = random.Random(0)
    for trial in range(200):
        rows = TailRows(2)
        table = list(range(40))
        written: dict[int, int] = {}  # position -> row its key went to
        done = 0
        while done < 300:
            n = rnd.choice([1, 1, 1, rnd.randint(2, 40)])
            first, later, _ = rows.rows_for("s", done, n, BS)
            meta, pos = build_attention_metadata([(table, done, n)], BS, "cpu", [(first, later)])
            tails, slots = meta.tail_slots.tolist(), meta.slot_mapping.tolist()
            end = done + n
            sealed = {p // BS for p in range(done, end) if p % BS == BS - 1}
            writes = {tails[i] // BS for i, p in enumerate(range(done, end)) if p // BS not in sealed}
            for i, p in enumerate(range(done, end)):
                assert tails[i] % BS == slots[i] % BS
                if p % BS == BS - 1 and p // BS * BS < done:  # seals a block holding earlier keys
                    row = tails[i] // BS
                    assert all(written[q] == row for q in range(p // BS * BS, done)), trial
                    assert row not in writes, trial
            for i, p in enumerate(range(done, end)):
                if p // BS not in sealed:
                    written[p] = tails[i] // BS
            done = end


def test_metadata_refuses_one_row_for_a_seal_and_a_new_block():
    with pytest.raises(ValueError, match="need two different rows"):
        build_attention_metadata([(list(range(4)), 5, 20)], BS, "cpu", [(3, 3)])
    meta, _ = build_attention_metadata([(list(range(4)), 5, 20)], BS, "cpu", [(3, 1)])
    assert meta.tail_slots.tolist()[:11] == list(range(3 * BS + 5, 4 * BS))  # block 0 seals from row 3
    assert meta.tail_slots.tolist()[11:] == list(range(BS, BS + 9)) and meta.tail_rows.tolist() == [1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_demo_model(tmp_path_factory.mktemp("tails") / "demo-small", "small")


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(10, 2000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("kv_format", ["int4", "int4r"])
def test_running_sequences_hold_rows_that_hold_their_exact_kv(model_dir, kv_format):
    """Layer 0's keys and values depend only on the tokens, so the int4 engine's row must equal what
    a model-dtype engine caches for the same prompt, bit for bit (int4r: its keys rotated)."""
    exact = LLM(model_dir, dtype="float32", device="cpu").engine
    quant = LLM(model_dir, dtype="float32", device="cpu", kv_format=kv_format, max_num_seqs=4).engine
    prompt = _prompt(37)
    for e in (exact, quant):
        e.add_request("r", prompt, GREEDY)
        e.step()  # the prompt, in one chunk: blocks 0 and 1 sealed, 5 keys in the filling block
    assert quant.leak_check()["tail_rows"] == 2
    row = quant.runner.tails.rows_for("r", 37, 1, BS)[0]
    block = exact._seqs["r"].block_table[2]
    want = exact.runner.kv_caches[0][:, block, :5]
    if kv_format == "int4r":
        want = torch.stack((qr.rotate(want[0]), want[1]))
    cache = quant.runner.kv_caches[0]
    # NOTE: int4r's rotation is a matmul over the step's rows, whose last bits may depend on their count
    assert torch.allclose(cache.k_tail[row * BS : row * BS + 5], want[0], rtol=0, atol=1e-5 if kv_format == "int4r" else 0)
    assert torch.equal(cache.v_tail[row * BS : row * BS + 5], want[1])
    quant.abort("r")
    assert quant.leak_check()["tail_rows"] == 0


def test_rows_come_back_after_finish_abort_and_preemption(model_dir):
    # NOTE: 12 blocks for 4 sequences growing to 50 tokens (4 blocks each) forces preemptions
    llm = LLM(model_dir, dtype="float32", device="cpu", kv_format="int4", num_blocks=12, max_num_seqs=4)
    engine = llm.engine
    outs = llm.generate([_prompt(30, s) for s in range(4)], GREEDY)
    assert engine.num_preemptions > 0
    assert all(len(o.token_ids) == 20 for o in outs)
    engine.add_request("x", _prompt(9), GREEDY)
    engine.step()
    assert engine.leak_check()["tail_rows"] == 2
    engine.abort("x")
    leaks = engine.leak_check()
    assert leaks["tail_rows"] == 0 and leaks["free_blocks"] == leaks["total_blocks"]


@pytest.mark.parametrize("kv_format", ["int4", "int4r"])
def test_handed_over_sequence_starts_its_row_from_the_exact_tail_it_received(model_dir, kv_format):
    """The handoff carries the filling block's exact keys and values (rows past the blocks,
    ``tail_tokens``); the decode engine's row starts from them. Without them (a tail-less handoff)
    it starts from the block's per-token codes."""
    prefill = LLM(model_dir, dtype="float32", device="cpu", kv_format=kv_format).engine
    decode = LLM(model_dir, dtype="float32", device="cpu", kv_format=kv_format).engine
    prefill.add_request("h", _prompt(21), GREEDY, prefill_only=True)
    prefill.step()
    exact = [(c.k_tail.clone(), c.v_tail.clone()) for c in prefill.runner.kv_caches]  # the one sequence's rows, 0 first
    state, kv = prefill.export_sequence("h")
    assert prefill.leak_check()["tail_rows"] == 0
    assert state["tail_tokens"] == 5 and state["tail_dtype"] == "float32" and kv.shape[0] > 2  # 2 blocks, then the tail
    bare = {k: v for k, v in state.items() if not k.startswith("tail_")} | {"request_id": "bare"}
    decode.import_sequence(state, kv, GREEDY)
    decode.import_sequence(bare, kv[:2], GREEDY)
    decode.step()  # computes token 21 into block 1 (offset 5), starting the rows from offsets 0..4
    for rid in ("h", "bare"):
        mine = decode.runner.tails.rows_for(rid, 22, 1, BS)[0]
        block = decode._seqs[rid].block_table[1]
        for layer, cache in enumerate(decode.runner.kv_caches):
            got = (cache.k_tail[mine * BS : mine * BS + 5], cache.v_tail[mine * BS : mine * BS + 5])
            want = (exact[layer][0][:5], exact[layer][1][:5])
            decoded = ref.dequantize_blocks(cache, torch.tensor([block]), torch.tensor([False]))[:, 0, :5]
            for i in range(2):
                if rid == "h":
                    assert torch.equal(got[i], want[i])
                else:  # per-token codes of those
                    assert torch.equal(got[i], decoded[i]) and torch.allclose(got[i], want[i], atol=0.5)
    for rid in ("h", "bare"):
        decode.abort(rid)
    assert decode.leak_check()["tail_rows"] == 0 and not decode.runner.tails.received


@pytest.mark.parametrize("kv_format", ["int4", "int4r"])
def test_handed_over_sequence_decodes_as_if_it_had_never_moved(model_dir, kv_format):
    """Prefill on one engine, handoff, decode on another: the same tokens and logprobs as one
    engine doing both (the filling block's keys sealed from exact values once, not from codes)."""
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=1)
    prompt = _prompt(25)
    one = LLM(model_dir, dtype="float32", device="cpu", kv_format=kv_format).generate([prompt], params)[0]
    prefill = LLM(model_dir, dtype="float32", device="cpu", kv_format=kv_format).engine
    decode = LLM(model_dir, dtype="float32", device="cpu", kv_format=kv_format).engine
    prefill.add_request("m", prompt, params, prefill_only=True)
    (first,) = prefill.step()
    state, kv = prefill.export_sequence("m")
    decode.import_sequence(state, kv, params)
    tokens, logprobs = list(first.new_token_ids), [lp.logprob for lp in first.logprobs]
    while decode.has_unfinished():
        for out in decode.step():
            tokens += out.new_token_ids
            logprobs += [lp.logprob for lp in out.logprobs]
    assert tokens == one.token_ids
    assert logprobs == [lp.logprob for lp in one.logprobs]
    assert decode.leak_check()["tail_rows"] == 0


def test_a_tail_that_does_not_fit_the_handoff_is_refused(model_dir):
    prefill = LLM(model_dir, dtype="float32", device="cpu", kv_format="int4").engine
    decode = LLM(model_dir, dtype="float32", device="cpu", kv_format="int4").engine
    prefill.add_request("t", _prompt(21), GREEDY, prefill_only=True)
    prefill.step()
    state, kv = prefill.export_sequence("t")
    with pytest.raises(ValueError, match="shape \\[2, 4, 1288\\]; expected \\[4, 4, 1288\\] for 21 tokens and a tail of 5"):
        decode.import_sequence(state, kv[:2], GREEDY)
    with pytest.raises(ValueError, match="handoff tail of 4 float32 tokens for 21 computed tokens"):
        decode.import_sequence(state | {"tail_tokens": 4}, kv, GREEDY)
    int8 = LLM(model_dir, dtype="float32", device="cpu", kv_format="int8").engine
    with pytest.raises(ValueError, match="16-token int8 blocks"):
        int8.import_sequence(state, kv, GREEDY)
    assert decode.leak_check()["free_blocks"] == decode.leak_check()["total_blocks"] and not decode.runner.tails.received


def test_budget_pays_for_the_rows(model_dir):
    engine = LLM(model_dir, dtype="float32", device="cpu", kv_format="int4", kv_cache_bytes=1 << 22,
                 max_num_seqs=8).engine
    fmt = KVFormat("int4")
    rows = 16 * fmt.tail_row_bytes(engine.layout)
    assert engine.runner.num_blocks == ((1 << 22) - rows) // fmt.bytes_per_block(engine.layout)
    assert engine.runner.kv_caches[0].num_tail_rows == 16


def test_rows_can_be_switched_off_for_comparison(model_dir, monkeypatch):
    monkeypatch.setenv("LLMBUS_KV_TAILS", "0")
    engine = LLM(model_dir, dtype="float32", device="cpu", kv_format="int4").engine
    assert engine.runner.tails is None and engine.runner.kv_caches[0].k_tail is None
    out = LLM(model_dir, dtype="float32", device="cpu", kv_format="int4").generate([_prompt(20)], GREEDY)[0]
    assert len(out.token_ids) == 20


def test_bench_cpu_decode_compares_tails_in_one_process(model_dir, tmp_path):
    """The harness behind docs/benchmarks.md's step-time figure, on the small model."""
    import json
    import subprocess
    import sys

    script = str(Path(__file__).resolve().parents[1] / "scripts" / "bench_cpu_decode.py")
    out = tmp_path / "tails.json"
    proc = subprocess.run(
        [sys.executable, script, "--model-dir", str(model_dir), "--batch", "2",
         "--prompt-len", "8", "--warm-steps", "1", "--runs", "2", "--kv-format", "int4", "--compare", "tails",
         "--interleave", "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    runs = json.loads(out.read_text())["runs"]
    assert len(runs) == 2 and all(r["tails"] > 0 and r["no-tails"] > 0 for r in runs)
    bad = subprocess.run([sys.executable, script, "--model-dir", str(model_dir),
                          "--compare", "layers", "--interleave"], capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2 and "--interleave works with --compare tails only" in bad.stderr
