"""Prefix reuse through the whole service: a prompt whose 1,024-token prefix left the prefill
worker's own cache is served from kvpool's CPU tier, with the same greedy output and the cached
prompt tokens reported in usage."""

from __future__ import annotations

import asyncio
import random
import time

import openai
import pytest

from llmbus.bus.connection import connect
from llmbus.bus.kvclient import KVPoolClient
from llmbus.engine.llm import LLM
from llmbus.engine.sampling_params import SamplingParams
from tests.e2e.stack import Stack

MODEL = "demo"
BLOCKS = 72  # per worker: 1,152 tokens, so one 1,040-token prompt evicts another's prefix
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    s = Stack(MODEL, model_dir, tmp_path_factory.mktemp("e2e-data"), "--token-timeout", "30",
              f"--worker-arg=--num-blocks={BLOCKS}")  # fmt: skip
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack):
    return openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)


def pool_stats(stack: Stack):
    async def read():
        nc = await connect(stack.nats_url)
        try:
            return await KVPoolClient(nc).stats()
        finally:
            await nc.close()

    return asyncio.run(read())


def complete(client, prompt: list[int]):
    return client.completions.create(model=MODEL, prompt=prompt, max_tokens=8, temperature=0,
                                     extra_body={"ignore_eos": True})  # fmt: skip


def test_prefix_evicted_from_tier0_is_served_from_kvpool(client, stack, model_dir):
    rng = random.Random(5)
    prefix = [rng.randrange(10, 1900) for _ in range(1024)]
    prompt = prefix + [rng.randrange(10, 1900) for _ in range(16)]
    other = [rng.randrange(10, 1900) for _ in range(1040)]
    first = complete(client, prompt)
    assert first.usage.prompt_tokens == 1040 and first.usage.prompt_tokens_details.cached_tokens == 0
    complete(client, other)  # evicts most of the first prompt's blocks from the prefill worker's cache
    before = pool_stats(stack).tiers[0]
    again = complete(client, prompt)
    after = pool_stats(stack).tiers[0]
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 1024  # 64 full blocks; the rest computed
    served = after.hits - before.hits
    assert served >= 56, f"only {served} blocks came from kvpool's CPU tier"  # the rest stayed in tier 0
    ref = LLM(model_dir, dtype="float32", device="cpu").generate(
        [prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]  # fmt: skip
    assert again.choices[0].text == ref.text  # and equal to an in-process engine without any cache
    assert stack.wait_idle()["kvpool_leased_blocks"] == 0


def test_request_ending_on_its_first_token_still_stores_its_prefix(client, stack):
    """max_tokens=1 finishes at prefill (no handoff): the prompt's full blocks still reach kvpool."""
    rng = random.Random(9)
    prompt = [rng.randrange(10, 1900) for _ in range(20 * 16 + 5)]
    before = pool_stats(stack).tiers[0].blocks
    out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
    assert out.usage.completion_tokens == 1
    for _ in range(50):  # the store happens just after the response
        if pool_stats(stack).tiers[0].blocks >= before + 20:
            break
        time.sleep(0.1)
    assert pool_stats(stack).tiers[0].blocks >= before + 20
    assert stack.wait_idle()["kvpool_leased_blocks"] == 0


@pytest.fixture(scope="module")
def colocated(model_dir, tmp_path_factory):
    s = Stack(MODEL, model_dir, tmp_path_factory.mktemp("e2e-colocated"), "--token-timeout", "30", "--colocated",
              f"--worker-arg=--num-blocks={BLOCKS}")  # fmt: skip
    yield s
    s.stop()


def test_colocated_worker_writes_back_what_it_evicts(colocated, model_dir):
    """One worker for both phases stores a prompt's blocks in kvpool when it evicts them (not when
    the request ends): a prompt nothing evicted costs kvpool nothing; an evicted one is served
    from kvpool's CPU tier."""
    client = openai.OpenAI(base_url=colocated.base_url, api_key="unused", max_retries=0, timeout=120)
    rng = random.Random(11)
    prefix = [rng.randrange(10, 1900) for _ in range(1024)]
    prompt = prefix + [rng.randrange(10, 1900) for _ in range(16)]
    other = [rng.randrange(10, 1900) for _ in range(1040)]
    empty = pool_stats(colocated).tiers[0].blocks
    first = complete(client, prompt)
    time.sleep(1.0)  # longer than the write-back period: nothing was evicted, nothing is stored
    assert pool_stats(colocated).tiers[0].blocks == empty
    complete(client, other)  # evicts most of the first prompt's blocks from the worker's cache
    # NOTE: until the write-back is done, not just past 56 blocks: evicted chains arrive one
    # write-back period (0.25 s) apart, and a request sent before the one holding the blocks right
    # after the worker's own finds nothing in kvpool to continue from
    seen: list[int] = []
    for _ in range(100):
        seen.append(pool_stats(colocated).tiers[0].blocks)
        if seen[-1] >= empty + 56 and len(seen) >= 6 and len(set(seen[-6:])) == 1:
            break
        time.sleep(0.1)
    assert seen[-1] >= empty + 56
    before = pool_stats(colocated).tiers[0]
    again = complete(client, prompt)
    after = pool_stats(colocated).tiers[0]
    assert again.choices[0].text == first.choices[0].text
    assert again.usage.prompt_tokens_details.cached_tokens == 1024
    assert after.hits - before.hits >= 56
    assert colocated.wait_idle()["kvpool_leased_blocks"] == 0
