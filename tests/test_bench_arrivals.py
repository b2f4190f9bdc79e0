"""The arrival process: requested rate and burstiness, checked on the generated inter-arrival times."""

import math
import statistics

import pytest

from llmbus.bench.arrivals import ArrivalProcess


def _mean_cv(gaps):
    mean = statistics.fmean(gaps)
    return mean, statistics.pstdev(gaps) / mean


@pytest.mark.parametrize("process,burstiness,expected_cv", [
    ("poisson", 1.0, 1.0), ("gamma", 0.25, 2.0), ("gamma", 4.0, 0.5), ("gamma", 1.0, 1.0),
])
def test_rate_and_burstiness(process, burstiness, expected_cv):
    gaps = ArrivalProcess(rate=8.0, process=process, burstiness=burstiness).inter_arrivals(20000, seed=3)
    mean, cv = _mean_cv(gaps)
    assert mean == pytest.approx(1 / 8.0, rel=0.05)
    assert cv == pytest.approx(expected_cv, rel=0.08)
    assert min(gaps) >= 0


def test_constant_and_all_at_once():
    assert ArrivalProcess(rate=4.0, process="constant").inter_arrivals(5, seed=0) == [0.25] * 5
    assert ArrivalProcess().inter_arrivals(3, seed=0) == [0.0] * 3
    assert ArrivalProcess(rate=4.0, process="constant").schedule(4, seed=0) == [0.0, 0.25, 0.5, 0.75]


def test_deterministic_from_seed():
    p = ArrivalProcess(rate=2.0, process="gamma", burstiness=0.5)
    assert p.inter_arrivals(50, seed=7) == p.inter_arrivals(50, seed=7)
    assert p.inter_arrivals(50, seed=7) != p.inter_arrivals(50, seed=8)
    times = p.schedule(50, seed=7)
    assert times[0] == 0.0 and all(b >= a for a, b in zip(times, times[1:]))


@pytest.mark.parametrize("kwargs,match", [
    ({"rate": 0}, "request rate"), ({"rate": -1}, "request rate"), ({"process": "uniform"}, "arrival process"),
    ({"rate": 1.0, "burstiness": 0.0, "process": "gamma"}, "burstiness"),
    ({"rate": 1.0, "burstiness": 2.0}, "gamma"), ({"rate": 1.0, "burstiness": math.inf, "process": "gamma"}, "burstiness"),
])
def test_bad_config_is_a_clear_error(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ArrivalProcess(**kwargs)
