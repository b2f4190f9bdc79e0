"""Routing policy: pure, exact."""

import pytest

from llmbus.protocol import InstanceInfo
from services.router.policy import RouteError, RoutingPolicy, live_models, pick_instance


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


def test_pick_instance_least_loaded_then_most_free():
    insts = [
        InstanceInfo("p1", "prefill", ["m"], free_blocks=10, queue_depth=2),
        InstanceInfo("p2", "prefill", ["m"], free_blocks=5, queue_depth=1),
        InstanceInfo("p3", "prefill", ["m"], free_blocks=9, queue_depth=1),
        InstanceInfo("p4", "prefill", ["other"], queue_depth=0),
        InstanceInfo("d1", "decode", ["m"], queue_depth=0),
    ]
    assert pick_instance(insts, "m", "prefill").instance_id == "p3"
    assert pick_instance(insts, "m", "decode").instance_id == "d1"
    assert pick_instance(insts, "zzz", "prefill") is None


def test_config_validation():
    with pytest.raises(ValueError, match="long_threshold"):
        RoutingPolicy(long_threshold=0)
    with pytest.raises(ValueError, match="non-empty"):
        RoutingPolicy(models=("",))
