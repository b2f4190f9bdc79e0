"""Service metrics: the families (``llmbus.metrics``), their records on the wire, what an engine
counts as it steps (a real engine on a random model), and a service answering
``llmbus.metrics.<instance_id>`` on a real nats-server."""

from __future__ import annotations

import asyncio
import math

import pytest

from llmbus.bus import subjects
from llmbus.bus.connection import connect
from llmbus.bus.service import ServiceOptions, run_service
from llmbus.engine.llm import LLM
from llmbus.engine.sampling_params import SamplingParams
from llmbus.metrics import Histogram, Metric, labelled, render, scalar
from llmbus.protocol import MetricFamily, MetricSample, MetricsReply, MetricsRequest, ProtocolError, decode, encode
from tests.metrics_text import parse, total
from tests.model_factory import write_random_model

CONFIG = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.08)  # fmt: skip


def test_histogram_buckets_are_inclusive_and_cumulative():
    h = Histogram("x_seconds", "x", ("kind",), (0.1, 1.0, 10.0))
    for v in (0.05, 0.1, 0.5, 1.0, 3.0, 99.0):
        h.observe(v, "a")
    h.observe(2.0, "b")
    fam = h.family()
    a, b = fam.samples
    assert a.labels == ["a"] and a.counts == [2, 4, 5] and a.count == 6 and a.sum == pytest.approx(103.65)
    assert b.labels == ["b"] and b.counts == [0, 0, 1] and b.count == 1
    got = parse(render([fam]))
    assert got['x_seconds_bucket{kind="a",le="0.1"}'] == 2
    assert got['x_seconds_bucket{kind="a",le="+Inf"}'] == 6  # 99 is past every bound
    assert got['x_seconds_count{kind="b"}'] == 1 and got['x_seconds_sum{kind="b"}'] == 2


def test_a_half_recorded_observation_never_puts_inf_below_a_bucket():
    h = Histogram("x_seconds", "x", (), (0.1, 1.0))
    h.observe(5.0)
    h.observe(0.5)
    h.series[()][-1] -= 1  # as a scrape sees it between the engine thread's bucket and count updates
    (s,) = h.family().samples
    assert s.counts == [0, 1] and s.count == 2


def test_families_of_one_name_from_several_instances_render_as_one():
    c = Metric("jobs_total", "Jobs.", "counter", ("kind",))
    c.add(2, "a")
    c.add(3, "a")
    one = labelled(c.family(), instance="w1", role="prefill")
    two = labelled(c.family(), instance="w2", role="decode")
    text = render([one, two, scalar("up", 'a "quoted"\nhelp', 1)])
    assert text.count("# TYPE jobs_total counter") == 1
    got = parse(text)
    assert got['jobs_total{instance="w1",role="prefill",kind="a"}'] == 5
    assert total(got, "jobs_total", kind="a") == 10
    assert got["up"] == 1
    assert "# HELP up a \"quoted\"\\nhelp" in text


def test_a_family_s_own_label_named_as_the_scrape_s_becomes_exported():
    """A service's family with its own ``role`` label (the router's workers gauge had one) scraped
    with the answering service's ``role``: a name twice in a sample makes Prometheus refuse the
    whole scrape, so the family's own is renamed ``exported_role``, as Prometheus renames a
    target's clashing labels."""
    g = Metric("workers", "Workers.", "gauge", ("model", "role"))
    g.set(2, "m", "decode")
    text = render([labelled(g.family(), instance="r1", role="router")])
    assert parse(text) == {'workers{instance="r1",role="router",model="m",exported_role="decode"}': 2}
    with pytest.raises(AssertionError, match="a label twice"):  # the test parser refuses what Prometheus does
        parse('# TYPE w gauge\nw{role="a",role="b"} 1\n')


def test_label_values_are_escaped_and_odd_numbers_written_as_prometheus_reads_them():
    g = Metric("g", "g", "gauge", ("name",))
    g.set(math.inf, 'a"b\\c\nd')
    g.set(math.nan, "n")
    g.set(0.25, "q")
    text = render([g.family()])
    assert 'g{name="a\\"b\\\\c\\nd"} +Inf' in text
    assert 'g{name="n"} NaN' in text and 'g{name="q"} 0.25' in text


def test_a_family_shaped_otherwise_by_another_service_is_left_out():
    a = Metric("m", "m", "counter", ("x",))
    a.add(1, "1")
    b = Metric("m", "m", "gauge", ())  # same name, other kind and labels: not mixed into a's
    b.set(7)
    got = parse(render([a.family(), b.family()]))
    assert got == {'m{x="1"}': 1}


def test_metric_records_round_trip_and_refuse_what_prometheus_could_not_read():
    fam = Histogram("h", "h", ("k",), (1.0,))
    fam.observe(0.5, "v")
    reply = MetricsReply("prefill-1", "prefill", [fam.family(), scalar("s", "s", 3)])
    assert decode(MetricsReply, encode(reply)) == reply
    assert decode(MetricsRequest, encode(MetricsRequest())) == MetricsRequest()
    with pytest.raises(ValueError, match="kind"):
        MetricFamily("a", "a", "summary")
    with pytest.raises(ValueError, match="names must match"):
        MetricFamily("a-b", "a", "gauge")
    with pytest.raises(ValueError, match="label values"):
        MetricFamily("a", "a", "gauge", ["x"], samples=[MetricSample([])])
    with pytest.raises(ValueError, match="bucket counts"):
        MetricFamily("a", "a", "histogram", [], [1.0, 2.0], [MetricSample([], counts=[1])])
    with pytest.raises(ProtocolError, match="role"):
        decode(MetricsReply, encode(MetricsReply("x", "router", [])).replace(b"router", b"nobody"))
    with pytest.raises(ProtocolError, match="names must match"):
        decode(MetricsReply, encode(MetricsReply("x", "router", [scalar("zz_q", "s", 1)])).replace(b"zz_q", b"zz-q"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("metrics-model")
    write_random_model(path, CONFIG, seed=3, architecture="llama")
    return path


def _counts(llm: LLM) -> dict[str, float]:
    return parse(render(llm.engine.stats.families()))


def test_an_engine_counts_its_steps_tokens_and_cache_hits(model_dir):
    llm = LLM(model_dir, dtype="float32", device="cpu", warmup=True)
    assert _counts(llm) == {}  # the warm-up's dummy requests are not counted
    prompt = list(range(5, 5 + 40))  # 2 full blocks of 16, and 8 tokens more
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], greedy)[0]
    again = llm.generate([prompt], greedy)[0]
    assert (first.num_cached_tokens, again.num_cached_tokens) == (0, 32)
    got = _counts(llm)
    assert got["llmbus_engine_generation_tokens_total"] == len(first.token_ids) + len(again.token_ids) == 12
    assert got["llmbus_engine_prompt_tokens_total"] == 80
    assert got["llmbus_engine_cached_prompt_tokens_total"] == 32
    assert got["llmbus_engine_prefill_tokens_total"] == 40 + 8  # the second computed past its cached blocks
    assert got['llmbus_engine_requests_finished_total{reason="length"}'] == 2
    assert got['llmbus_engine_step_seconds_count{kind="prefill"}'] == 2
    assert got['llmbus_engine_step_seconds_count{kind="decode"}'] == 10  # 5 more tokens each
    assert got["llmbus_engine_step_tokens_sum"] == 48 + 10
    assert got["llmbus_engine_step_sequences_sum"] == 12
    assert got.get("llmbus_engine_preemptions_total", 0) == 0


def test_an_engine_counts_preemptions_and_aborts(model_dir):
    llm = LLM(model_dir, dtype="float32", device="cpu", num_blocks=10, max_num_batched_tokens=32)
    prompts = [[7 + i + j for j in range(30)] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    got = _counts(llm)
    assert llm.engine.num_preemptions > 0
    assert got["llmbus_engine_preemptions_total"] == llm.engine.num_preemptions
    assert got["llmbus_engine_generation_tokens_total"] == sum(len(o.token_ids) for o in outs) == 80
    assert got["llmbus_engine_prompt_tokens_total"] == 120  # a recompute is not a second first token
    assert got["llmbus_engine_prefill_tokens_total"] > 120  # ... but its tokens are computed again
    engine = llm.engine
    engine.add_request("gone", list(range(3, 20)), SamplingParams(max_tokens=4))
    engine.step()
    assert engine.abort("gone") and not engine.abort("gone")
    assert _counts(llm)['llmbus_engine_requests_finished_total{reason="abort"}'] == 1


def test_a_service_answers_its_metrics_request(nats_server):
    calls = []

    async def body(ctx):
        c = Metric("things_total", "Things.", "counter", ("kind",))
        c.add(4, "x")
        ctx.add_metrics(lambda: [c.family()])
        ctx.add_metrics(lambda: 1 / 0)  # a broken source: the others still answer
        await ctx.ready()
        nc = await connect(nats_server)
        try:
            msg = await nc.request(subjects.metrics(ctx.instance_id), encode(MetricsRequest()), timeout=5)
            calls.append(decode(MetricsReply, msg.data))
        finally:
            await nc.close()

    options = ServiceOptions(role="router", nats_url=nats_server, instance_id="router-metrics-test")
    assert asyncio.run(run_service(options, body)) == 0
    (reply,) = calls
    assert (reply.instance_id, reply.role) == ("router-metrics-test", "router")
    assert parse(render(reply.families)) == {'things_total{kind="x"}': 4}
