"""The drain's rule (router_runtime/proxy/drain.py), as a pure function of what arrived and when."""

from __future__ import annotations

from pytest import approx

from router_runtime.proxy.drain import Drain


def drain(**kw) -> Drain:
    return Drain(minimum=5.0, maximum=12.0, quiet=1.0, began=100.0, **kw)


def test_nothing_arriving_drains_the_minimum():
    d = drain()
    assert d.remaining(100.0) == approx(5.0)
    assert d.remaining(104.5) == approx(0.5)
    assert d.remaining(105.0) == approx(0.0)
    assert Drain(minimum=0.0, maximum=12.0, began=100.0).remaining(100.0) == 0.0  # 0: no drain


def test_an_arrival_late_in_the_drain_holds_it_a_quiet_second_longer():
    d = drain(last=104.8)
    assert d.remaining(105.0) == approx(0.8)  # quiet since 104.8: until 105.8
    assert d.remaining(105.8) == approx(0.0)
    d.last = 101.0  # early arrivals change nothing: the minimum still holds
    assert d.remaining(101.5) == approx(3.5)


def test_arrivals_that_never_stop_end_at_the_maximum():
    d = drain(last=111.9)
    assert d.remaining(111.95) == approx(0.05)  # the maximum, not the quiet second
    d.last = 112.5
    assert d.remaining(112.6) == approx(0.0)


def test_the_summary_says_what_arrived_and_when():
    d = drain()
    assert d.summary(105.0) == "drained 5.0s: 0 requests and 0 picks arrived"
    d.request(), d.pick(), d.pick()
    d.last = 107.25
    assert d.summary(108.3) == "drained 8.3s: 1 requests and 2 picks arrived, the last 7.2s in"
