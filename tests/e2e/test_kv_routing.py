"""Routing by cached prefix through the whole service: `llmbus up --colocated --prefill 2`, two
conversations from the real openai client, turns interleaved; every turn after the first is sent
to the worker that holds its conversation and reports the earlier turn's prompt as cached."""

from __future__ import annotations

import random
import time

import httpx
import openai
import pytest

from tests.e2e.stack import Stack
from tests.metrics_text import parse, total

MODEL = "demo"
pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    s = Stack(MODEL, model_dir, tmp_path_factory.mktemp("e2e-kvr"), "--token-timeout", "30", "--colocated",
              "--prefill", "2")  # fmt: skip
    yield s
    s.stop()


def test_each_turn_goes_where_its_conversation_is_cached(stack):
    client = openai.OpenAI(base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120)
    metrics_url = stack.base_url.removesuffix("/v1") + "/metrics"
    deadline = time.monotonic() + 60
    while total(parse(httpx.get(metrics_url, timeout=30).text), "llmbus_router_workers", model=MODEL, worker_role="prefill") < 2:
        assert time.monotonic() < deadline, "the router never saw both prefill workers"
        time.sleep(0.2)
    rng = random.Random(11)
    chats = [[rng.randrange(10, 1900) for _ in range(100)] for _ in range(2)]
    turns = 4
    for turn in range(turns):
        for c, prompt in enumerate(chats):
            out = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0,
                                            extra_body={"ignore_eos": True})  # fmt: skip
            expected = 0 if turn == 0 else (len(prompt) - 40) // 16 * 16  # the last turn's full blocks
            assert (turn, c, out.usage.prompt_tokens_details.cached_tokens) == (turn, c, expected)
            chats[c] = prompt + [rng.randrange(10, 1900) for _ in range(40)]
    after = parse(httpx.get(metrics_url, timeout=30).text)
    assert total(after, "llmbus_router_directed_total", model=MODEL) == 2 * (turns - 1)
    assert total(after, "llmbus_router_lookup_failures_total") == 0
