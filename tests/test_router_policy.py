"""Routing policy: pure, exact."""

import pytest

from llmbus.protocol import InstanceInfo
from services.router.policy import (Backlog, Load, Placement, RouteError, RoutingPolicy, live_models, place,
                                   whole)


def test_lane_by_prompt_length_threshold_is_exclusive():
    policy = RoutingPolicy(models=("a", "b"), long_threshold=8)
    assert policy.route("a", 8).lane == "short"
    assert policy.route("a", 9).lane == "long"
    assert policy.route("b", 1).model == "b"


def test_unknown_model_names_the_served_ones():
    policy = RoutingPolicy(models=("a", "b"))
    with pytest.raises(RouteError, match=r"unknown model 'c'; served models: a, b"):
        policy.route("c", 3)
    with pytest.raises(RouteError, match="none yet"):
        RoutingPolicy().route("a", 3)


def test_served_models_fall_back_to_live_instances():
    insts = [InstanceInfo("p1", "prefill", ["x"]), InstanceInfo("d1", "decode", ["y"])]
    assert live_models(insts) == {"x"}
    policy = RoutingPolicy()
    assert policy.route("x", 2, live_models(insts)).lane == "short"
    with pytest.raises(RouteError):
        policy.route("y", 2, live_models(insts))  # only a decode instance serves y


def test_config_validation():
    with pytest.raises(ValueError, match="long_threshold"):
        RoutingPolicy(long_threshold=0)
    with pytest.raises(ValueError, match="non-empty"):
        RoutingPolicy(models=("",))


def _loads(**requests: int) -> dict[str, Load]:
    return {w: Load(n) for w, n in requests.items()}


def test_a_prompt_goes_to_the_worker_whose_cache_holds_most_of_it():
    idle = _loads(a=0, b=0)
    assert place(idle, {"b": 10}, 0) == Placement("b", 10)
    assert place(idle, {"a": 3, "b": 10}, 0) == Placement("b", 10)
    assert place(_loads(a=2, b=0), {"a": 10}, 0) == Placement("a", 10)  # busier, within the imbalance
    # equal hits: the one with fewer requests; then the instance id
    assert place(_loads(a=1, b=0), {"a": 10, "b": 10}, 0) == Placement("b", 10)
    assert place(idle, {"a": 10, "b": 10}, 0) == Placement("a", 10)


def test_the_lane_when_no_worker_saves_more_than_kvpool_would():
    idle = _loads(a=0, b=0)
    assert place(idle, {}, 0) == Placement()
    assert place(idle, {"a": 6}, 6) == Placement()  # kvpool gives any worker those 6 blocks
    assert place(idle, {"a": 8}, 6) == Placement("a", 8)
    assert place(idle, {"gone": 8}, 0) == Placement()  # a worker that is not a candidate
    assert place({}, {"a": 8}, 0) == Placement()


def test_a_busy_or_full_cache_holder_is_passed_over():
    assert place(_loads(a=3, b=0), {"a": 10}, 0) == Placement()  # the lane: b has nothing better than it
    assert place(_loads(a=3, b=1, c=0), {"a": 10, "b": 5}, 0) == Placement("b", 5)
    assert place(_loads(a=3, b=1, c=0), {"a": 10, "b": 5}, 5) == Placement()
    assert place(_loads(a=3, b=0), {"a": 10}, 0, max_imbalance=3) == Placement("a", 10)
    assert place(_loads(a=1, b=0), {"a": 10}, 0, max_imbalance=0) == Placement()
    # no room: the request would wait in that worker's queue alone
    full = {"a": Load(1, room=0), "b": Load(1, room=4)}
    assert place(full, {"a": 10, "b": 4}, 0) == Placement("b", 4)
    assert place(full, {"a": 10}, 0) == Placement()
    assert place({"a": Load(1, room=None), "b": Load(1)}, {"a": 10}, 0) == Placement("a", 10)  # room unknown


def test_the_backlog_counts_what_was_sent_and_not_yet_shown_by_the_worker():
    log = Backlog(max_age_s=5.0)
    log.add("a", "r1", now=10.0)
    log.add("a", "r2", now=11.0)
    log.add("gone", "r3", now=10.0)
    assert log.since("a", 9.0, now=11.5) == 2
    assert log.since("a", 10.5, now=11.5) == 1  # a report after the first shows it
    assert log.since("a", 0.0, now=11.5) == 1  # and it is forgotten
    assert log.since("a", 0.0, now=16.5) == 0  # past max_age_s
    log.forget(["a"])
    assert log.since("gone", 0.0, now=10.5) == 0
    # a report that lists a request as taken shows it, however soon after the send it came
    log.add("a", "r4", now=20.0)
    log.add("a", "r5", now=20.0)
    log.taken("a", ["r4", "not-sent-by-this-router"])
    assert log.since("a", 19.9, now=20.01) == 1
    log.taken("nobody", ["r5"])
    assert log.since("a", 19.9, now=20.01) == 1


def test_kv_routing_settings_are_checked():
    with pytest.raises(ValueError, match="max_imbalance"):
        RoutingPolicy(max_imbalance=-1)


def test_short_prompts_go_whole_to_a_decode_pool_when_there_is_one():
    decode = InstanceInfo("d1", "decode", ["m"])
    prefill = InstanceInfo("p1", "prefill", ["m"])
    policy = RoutingPolicy(whole_threshold=32)
    assert whole(policy, "m", 32, [prefill, decode])
    assert not whole(policy, "m", 33, [prefill, decode])
    assert not whole(policy, "m", 8, [prefill])  # colocated: no decode pool
    assert not whole(policy, "other", 8, [decode])
    assert not whole(RoutingPolicy(whole_threshold=0), "m", 8, [decode])
    assert RoutingPolicy().whole_threshold == 128
    with pytest.raises(ValueError, match="whole_threshold"):
        RoutingPolicy(whole_threshold=-1)
