"""Routing policy: pure, exact."""

import pytest

from llmbus.protocol import InstanceInfo
from services.router.policy import (Backlog, Load, Placement, RouteError, RoutingPolicy, live_models, place)


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


def _worker(iid: str, held: int = 0, requests: int = 0, updated_at: float = 0.0) -> InstanceInfo:
    return InstanceInfo(iid, "prefill", ["m"], free_blocks=100 - held, queue_depth=requests, total_blocks=100,
                        updated_at=updated_at, block_size=16, kv_format="model", prefix_model="m")


def test_a_prompt_goes_to_the_worker_whose_cache_holds_it():
    a, b = _worker("a"), _worker("b")
    assert place([a, b], {"b": 10}, 0, 12) == Placement("b", 10)
    assert place([a, b], {"a": 3, "b": 10}, 0, 12) == Placement("b", 10)
    # equal hits: the one with less load; then the instance id
    assert place([_worker("a", held=5), b], {"a": 10, "b": 10}, 0, 12) == Placement("b", 10)
    assert place([a, b], {"a": 10, "b": 10}, 0, 12) == Placement("a", 10)


def test_the_lane_when_no_worker_saves_more_than_kvpool_would():
    a, b = _worker("a"), _worker("b")
    assert place([a, b], {}, 0, 12) == Placement()
    assert place([a, b], {"a": 6}, 6, 12) == Placement()  # kvpool gives any worker those 6 blocks
    assert place([a, b], {"a": 8}, 6, 12) == Placement("a", 8)
    assert place([], {"a": 8}, 0, 12) == Placement()


def test_a_cached_prefix_is_followed_only_while_it_outweighs_the_load():
    busy, idle = _worker("a", held=9), _worker("b")
    assert place([busy, idle], {"a": 10}, 0, 12) == Placement("a", 10)  # saves 10 blocks, 9 more held
    assert place([busy, idle], {"a": 9}, 0, 12) == Placement()  # a tie is the lane's
    # what the router sent since the last heartbeat counts as load too
    assert place([busy, idle], {"a": 10}, 0, 12, {"a": Load(1, 1)}) == Placement()
    assert place([busy, idle], {"a": 10}, 0, 12, {"b": Load(2, 1)}) == Placement("a", 10)
    # a heavier prefill cost follows the cache to a busier worker
    assert place([_worker("a", held=15), idle], {"a": 10}, 0, 12, overlap_weight=2.0) == Placement("a", 10)
    assert place([_worker("a", held=15), idle], {"a": 10}, 0, 12) == Placement()


def test_a_hot_prefix_spreads_past_the_request_imbalance():
    a, b = _worker("a", requests=3), _worker("b")
    assert place([a, b], {"a": 10}, 0, 12, max_imbalance=3) == Placement("a", 10)
    assert place([a, b], {"a": 10}, 0, 12, {"a": Load(0, 1)}, max_imbalance=3) == Placement()
    assert place([a, b], {"a": 10, "b": 4}, 0, 12, max_imbalance=2) == Placement("b", 4)


def test_the_backlog_counts_until_the_next_heartbeat():
    log = Backlog(max_age_s=5.0)
    log.add("a", 3, now=10.0)
    log.add("a", 2, now=11.0)
    log.add("gone", 7, now=10.0)
    assert log.load([_worker("a", updated_at=9.0)], now=11.5) == {"a": Load(5, 2)}
    assert log.load([_worker("a", updated_at=10.5)], now=11.5) == {"a": Load(2, 1)}  # the heartbeat saw the first
    assert log.load([_worker("gone", updated_at=0.0)], now=11.5) == {}  # forgotten with its worker
    assert log.load([_worker("a", updated_at=0.0)], now=16.5) == {}  # past max_age_s


def test_kv_routing_settings_are_checked():
    with pytest.raises(ValueError, match="overlap_weight"):
        RoutingPolicy(overlap_weight=0)
    with pytest.raises(ValueError, match="max_imbalance"):
        RoutingPolicy(max_imbalance=-1)
