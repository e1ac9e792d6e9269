"""The fleet load view's pure core: combining the sources, reading the engines' metrics pages, vetting a
sibling's report, and the board's ordering and ageing. No I/O."""

from __future__ import annotations

import json

import pytest

from router_runtime.fleet.board import LoadBoard
from router_runtime.fleet.engine_metrics import MetricsUnreadable, parse_engine_load
from router_runtime.fleet.gossip import GossipRejected, ReportOutcome, vet_report
from router_runtime.fleet.inflight import LoadTracker
from router_runtime.fleet.view import (
    PEER_SLACK,
    AtRead,
    Bounds,
    EngineSample,
    RankLoad,
    TargetReport,
    engine_queues,
    fleet_load,
    overclaimed,
    remote,
    unseen,
)
from router_runtime.scheduling.types import Target

A0, A1 = Target("a", "http://a", 0), Target("a", "http://a", 1)
B = Target("b", "http://b")


def test_the_engine_adds_only_what_the_routers_did_not_know_when_it_was_read():
    queues = {("a", 0): 5.0, ("a", 1): 2.0, ("b", None): 1.0}
    known = {("a", 0): 3, ("a", 1): 4}
    # a0: 2 requests no router here sent; a1: the read lags the routers (counted by them already)
    assert unseen(queues, known) == {("a", 0): 2.0, ("b", None): 1.0}
    assert fleet_load(2, 3) == 5
    assert fleet_load(0, 1, 2.0) == 3


def test_engine_queues_map_ranks_sum_whole_engines_and_split_unlabelled_totals():
    per_rank = EngineSample(0, {0: RankLoad(2, 1), 1: RankLoad(0, 4)})
    assert engine_queues(per_rank, [A0, A1]) == {("a", 0): 3.0, ("a", 1): 4.0}
    assert engine_queues(per_rank, [Target("a", "http://a")]) == {("a", None): 7.0}
    unlabelled = EngineSample(0, {None: RankLoad(5, 1)})
    assert engine_queues(unlabelled, [A0, A1]) == {("a", 0): 3.0, ("a", 1): 3.0}
    assert engine_queues(EngineSample(0, {1: RankLoad(1)}), [A0, A1]) == {("a", 1): 1.0}  # rank 0 unknown


def test_remote_drops_stale_sources_and_expires_with_the_first_to_age():
    bounds = Bounds(peer_max_age_s=2.0, engine_max_age_s=1.0)
    peers = {
        "x": (10.0, (TargetReport("b", None, 3, 0),)),
        "y": (11.0, (TargetReport("b", None, 2, 0), TargetReport("a", 0, 1, 0))),
        "old": (7.0, (TargetReport("b", None, 50, 0),)),
    }
    samples = {
        "b": (EngineSample(11.5, {None: RankLoad(9)}), AtRead({("b", None): 4})),
        "a": (EngineSample(9.0, {0: RankLoad(9)}), AtRead({})),
    }
    r = remote(peers, samples, {"a": [A0, A1], "b": [B]}, 11.6, bounds)
    assert dict(r.peers) == {("b", None): 5, ("a", 0): 1}
    assert dict(r.engines) == {("b", None): 5.0}  # a's read is 2.6 s old
    assert r.valid_until == 12.0  # x ages out first
    assert remote({}, {}, {}, 0.0, bounds).valid_until == float("inf")


def test_a_siblings_claim_the_engines_read_contradicts_is_discounted():
    """A sibling claims 1,000 requests in flight on an engine whose read, taken while it claimed them,
    counts 3 in all (1 of them ours): the engine has room for 2 of theirs, so 2 + PEER_SLACK count and
    the rest is discounted until the next read. A claim within the read's room counts whole."""
    bounds = Bounds(peer_max_age_s=2.0, engine_max_age_s=1.0)
    lie = {"x": (10.0, (TargetReport("b", None, 1000, 0),))}
    read = (
        EngineSample(10.5, {None: RankLoad(3)}),
        AtRead({("b", None): 1001}, {("b", None): 1}, {("b", None): 1000}),
    )
    r = remote(lie, {"b": read}, {"b": [B]}, 10.6, bounds)
    assert r.peers[("b", None)] == 2 + PEER_SLACK and r.discounted == {("b", None): 1000 - 2 - PEER_SLACK}
    assert overclaimed({("b", None): 3.0}, AtRead({}, {("b", None): 1}, {("b", None): 2 + PEER_SLACK})) == {}
    # Ours are held at their least: 20 of ours sent during the read leave their room to the sibling.
    churn = AtRead(known={("b", None): 30}, ours={("b", None): 0}, theirs={("b", None): 10})
    assert overclaimed({("b", None): 10.0}, churn) == {}
    # Once the read is stale, the sibling's word is all there is (no engine metrics: nothing to check).
    assert remote(lie, {"b": read}, {"b": [B]}, 11.6, bounds).peers[("b", None)] == 1000


VLLM_PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:prompt_tokens_total{engine="0",model_name="m"} 1.2e+06
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 5.0
vllm:num_requests_waiting{engine="0",model_name="m\\"x"} NaN
"""

SGLANG_PAGE = """\
sglang:num_running_reqs{model_name="m"} 4.0
sglang:num_queue_reqs{model_name="m"} 6.0
sglang:token_usage{model_name="m"} 0.5
"""


def test_a_report_sorts_an_engines_whole_and_rank_targets_together():
    """An engine whose data-parallel size changed has a request in flight on its whole-engine target and
    one on a rank: the report is built (the sender's task would end on a comparison of None and 0)."""
    own = LoadTracker()
    own.acquire(Target("e", "http://e"))
    own.acquire(Target("e", "http://e", 0))
    board = LoadBoard(own, lambda: (), replica="me", incarnation="i")
    assert board.report()


def test_parse_vllm_per_rank_page():
    s = parse_engine_load(VLLM_PAGE, 3.0)
    assert s.at == 3.0
    assert s.ranks[0] == RankLoad(3, 2, 0.25, 1.2e6)
    assert s.ranks[1] == RankLoad(1, 0, None, None)


def test_parse_sglang_page_without_rank_labels():
    s = parse_engine_load(SGLANG_PAGE, 0)
    assert s.ranks == {None: RankLoad(4, 6, 0.5, None)}


@pytest.mark.parametrize(
    "page",
    ["", "# only comments\n", 'vllm:num_requests_waiting{engine="0"} 3\n', "vllm:num_requests_running{ 3\n"],
)
def test_a_page_without_running_requests_is_unreadable_not_idle(page):
    with pytest.raises(MetricsUnreadable):
        parse_engine_load(page, 0)


def test_parse_skips_garbage_values():
    page = (
        'vllm:num_requests_running{engine="0"} 2\n'
        'vllm:num_requests_waiting{engine="0"} -5\n'
        "vllm:num_requests_waiting x\n"
    )
    assert parse_engine_load(page, 0).ranks == {0: RankLoad(2, 0)}


GOOD = {
    "format": 1,
    "replica": "r",
    "incarnation": "i",
    "seq": 3,
    "targets": [["a", 0, 2, 100], ["b", None, 1, 0]],
}


def test_vet_report_takes_a_well_formed_report():
    rep = vet_report(json.dumps(GOOD).encode())
    assert (rep.replica, rep.incarnation, rep.seq) == ("r", "i", 3)
    assert rep.targets == (TargetReport("a", 0, 2, 100), TargetReport("b", None, 1, 0))


@pytest.mark.parametrize(
    "change",
    [
        {"format": True},
        {"format": "1"},
        {"replica": ""},
        {"replica": "x" * 513},
        {"incarnation": 7},
        {"seq": 2**63},
        {"seq": 1.0},
        {"targets": {}},
        {"targets": [["a", 0, 2, 100]] * 4097},
        {"targets": [["a", -1, 2, 100]]},
        {"targets": [["a", 0, True, 100]]},
        {"targets": [["a", 0, 2, 2**41]]},
        {"targets": [["a", 0, 2]]},
        {"targets": [[None, 0, 2, 0]]},
    ],
)
def test_vet_report_refuses_out_of_bounds_fields(change):
    with pytest.raises(GossipRejected):
        vet_report(json.dumps({**GOOD, **change}).encode())


def test_a_report_is_built_only_by_vetting():
    from router_runtime.fleet.gossip import PeerReport

    with pytest.raises(TypeError):
        PeerReport(object(), replica="r", incarnation="i", seq=1, targets=())


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def board(clock: Clock) -> tuple[LoadBoard, LoadTracker]:
    own = LoadTracker()
    b = LoadBoard(
        own, lambda: (A0, A1, B), replica="me", incarnation="1", bounds=Bounds(2.0, 2.0), clock=clock
    )
    return b, own


def report(replica="x", incarnation="1", seq=1, targets=(("b", None, 3, 0),)) -> bytes:
    body = {
        "format": 1,
        "replica": replica,
        "incarnation": incarnation,
        "seq": seq,
        "targets": [list(t) for t in targets],
    }
    return json.dumps(body).encode()


def test_board_combines_own_peers_and_engines_per_target():
    clock = Clock()
    b, own = board(clock)
    own.acquire(B, 40)
    assert b.accept(vet_report(report())) is ReportOutcome.ACCEPTED
    assert b.view.get(B) == 4
    b.engine_read("a", EngineSample(clock.t, {0: RankLoad(5), 1: RankLoad(0)}))
    assert (b.view.get(A0), b.view.get(A1)) == (5, 0)  # 5 requests no router here knows of
    b.engine_read("b", EngineSample(clock.t, {None: RankLoad(4)}))  # the 1 + 3 the routers know
    assert b.view.get(B) == 4
    own.release(B, 40)
    assert b.view.get(B) == 3  # the engine's read from before the release adds nothing
    mine = json.loads(b.report())
    assert mine["replica"] == "me" and mine["targets"] == []


def test_board_orders_reports_per_sender_process_and_ignores_itself():
    clock = Clock()
    b, _ = board(clock)
    assert b.accept(vet_report(report(seq=5))) is ReportOutcome.ACCEPTED
    assert b.accept(vet_report(report(seq=5, targets=()))) is ReportOutcome.STALE
    assert b.accept(vet_report(report(seq=4, targets=()))) is ReportOutcome.STALE
    assert b.view.get(B) == 3
    assert b.accept(vet_report(report(replica="me", incarnation="1"))) is ReportOutcome.SELF
    assert b.view.get(B) == 3
    # the same replica restarted (a new incarnation starts its sequence again)
    assert (
        b.accept(vet_report(report(incarnation="2", seq=1, targets=(("b", None, 1, 0),))))
        is ReportOutcome.ACCEPTED
    )
    assert b.view.get(B) == 4  # the old process's report counts until it ages out


def test_board_ages_a_silent_sibling_out_without_any_other_event():
    clock = Clock()
    b, _ = board(clock)
    b.accept(vet_report(report()))
    clock.t += 1.9
    assert b.view.get(B) == 3 and b.fresh_peers() == 1
    clock.t += 0.2
    assert b.view.get(B) == 0 and b.fresh_peers() == 0
    b.engine_read("b", EngineSample(clock.t, {None: RankLoad(2)}))
    clock.t += 2.5
    assert b.view.get(B) == 0  # the engine read aged out too


def test_board_holds_a_bounded_number_of_senders():
    from router_runtime.fleet.board import MAX_SENDERS

    clock = Clock()
    b, _ = board(clock)
    for i in range(MAX_SENDERS):
        assert b.accept(vet_report(report(incarnation=str(i)))) is ReportOutcome.ACCEPTED
    assert b.accept(vet_report(report(incarnation="one-too-many"))) is ReportOutcome.REJECTED
    assert b.accept(vet_report(report(incarnation="0", seq=2))) is ReportOutcome.ACCEPTED  # known ones go on
    clock.t += 2.1  # all aged out: room again
    assert b.accept(vet_report(report(incarnation="later"))) is ReportOutcome.ACCEPTED
