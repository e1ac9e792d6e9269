"""In-flight prefix predictions (router_runtime/scheduling/inflight_prefix.py), as the kv_aware preset
runs them: a fan-out's copies follow the first one before any engine has stored a block; a prediction
ends when the index confirms it, after its bound, or with its target; it never counts as a cache claim
in the audit; siblings share them over the load reports, bounded. Pure (the real index, a clock the test
moves, the report's own encoding and vetting), then over real HTTP and ZMQ."""

from __future__ import annotations

import asyncio

import pytest

from router_runtime.fleet.gossip import GossipRejected, PredictionPacker, encode_report, vet_report
from router_runtime.kv.events import BlockStored, EventBatch
from router_runtime.kv.index import RadixIndex
from router_runtime.proxy.audit import AuditOutcome, Prediction, judge
from router_runtime.scheduling.framework import Cycle, Profile
from router_runtime.scheduling.inflight_prefix import MAX_SHARED_KEYS, InflightPrefix, in_one_report
from router_runtime.scheduling.presets import PolicyConfig, make_policy
from router_runtime.scheduling.types import Prediction as Predicted
from router_runtime.scheduling.types import Reason, RouteRequest, Shared, Target
from router_runtime.worker import Carrier
from tests.support import predicted_blocks, router_over_fakes

BS = 4
TARGETS = [Target(e, f"http://{e}", 0) for e in ("a", "b", "c", "d")]
N = 128
PROMPT = list(range(1000, 1000 + N * BS + 1))  # 128 full reusable blocks (the last token is computed)
# One in-flight request costs 16 blocks, as the defaults price it at block size 16 (256 tokens).
LOAD_COST = {"load_cost_tokens": 16 * BS}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def kv_aware(clock: Clock, **tuning) -> tuple[Profile, InflightPrefix]:
    profile = make_policy("kv_aware", PolicyConfig(**(LOAD_COST | tuning)))
    [inflight] = [s for s in profile.scorers if isinstance(s, InflightPrefix)]
    inflight._clock = clock  # the preset's own plugin, on the test's clock
    return profile, inflight


def burst(profile: Profile, index: RadixIndex, n: int, prompt=PROMPT) -> list:
    """``n`` copies decided one after the other, each dispatched before the next (loads counted)."""
    loads: dict[Target, float] = {}
    out = []
    for _ in range(n):
        d = profile.choose(RouteRequest(tokens=prompt), TARGETS, loads, index)
        loads[d.target] = loads.get(d.target, 0) + 1
        out.append(d)
    return out


def store(index: RadixIndex, target: Target, tokens: list[int], first_hash: int = 1) -> None:
    blocks = len(tokens) // BS
    hashes = tuple(range(first_hash, first_hash + blocks))
    stored = BlockStored(hashes, None, tuple(tokens[: blocks * BS]), BS)
    index.apply_batch(target.carrier, EventBatch(0.0, (stored,)))


def test_a_fan_outs_copies_follow_the_first_before_anything_is_stored():
    clock = Clock()
    index = RadixIndex(BS)
    profile, inflight = kv_aware(clock)
    first, *copies = burst(profile, index, 4)
    assert first.reason is Reason.NO_MATCH and first.inflight_blocks == 0
    assert {d.target for d in copies} == {first.target}
    assert {(d.reason, d.inflight_blocks, d.matched_blocks) for d in copies} == {(Reason.INFLIGHT, N, 0)}
    assert inflight.predicted_blocks(first.target.carrier) == N

    # Off (no predictions): the same burst scatters, as it did before (each copy to the least loaded).
    profile, _ = kv_aware(clock, inflight_ttl_s=0.0)
    assert len({d.target for d in burst(profile, RadixIndex(BS), 4)}) == 4


def test_a_prediction_is_credited_below_a_confirmed_block():
    clock = Clock()
    index = RadixIndex(BS)
    profile, _ = kv_aware(clock)
    [sent] = burst(profile, index, 1)
    other = next(t for t in TARGETS if t != sent.target)
    # 120 blocks stored elsewhere beat 128 predicted at 0.9 (115.2); 110 do not.
    store(index, other, PROMPT[: 120 * BS])
    d = profile.choose(RouteRequest(tokens=PROMPT), TARGETS, {}, index)
    assert (d.target, d.reason, d.matched_blocks) == (other, Reason.PREFIX, 120)
    index.clear_carrier(other.carrier)
    store(index, other, PROMPT[: 110 * BS])
    d = profile.choose(RouteRequest(tokens=PROMPT), TARGETS, {}, index)
    assert (d.target, d.reason, d.inflight_blocks) == (sent.target, Reason.INFLIGHT, N)


def test_a_prediction_ends_with_its_request_so_a_later_eviction_is_not_papered_over():
    clock = Clock()
    index = RadixIndex(BS)
    profile, inflight = kv_aware(clock)
    [sent] = burst(profile, index, 1)
    store(index, sent.target, PROMPT[: 40 * BS])  # the engine has published part of it so far
    d = profile.choose(RouteRequest(tokens=PROMPT), TARGETS, {}, index)
    assert (d.target, d.reason, d.matched_blocks, d.inflight_blocks) == (
        sent.target,
        Reason.PREFIX,
        40,
        N - 40,
    )
    profile.ended(d)
    profile.ended(sent)  # both requests are over: the index alone is the witness now
    assert inflight.predicted_blocks(sent.target.carrier) == 0
    index.clear_carrier(sent.target.carrier)  # what it stored is evicted (or the engine reset)
    d = profile.choose(RouteRequest(tokens=PROMPT), TARGETS, {}, index)
    assert d.reason is Reason.NO_MATCH and d.inflight_blocks == 0
    profile.ended(d)
    profile.ended(d)  # told twice (a bug elsewhere): nothing is undone twice
    assert inflight.predicted_blocks(d.target.carrier) == 0


def test_a_prediction_built_on_stored_blocks_falls_with_them():
    """A request sent where the index confirmed 40 blocks predicts the other 88 there. The engine then
    drops those 40 (an eviction, a reset) while the request still runs: what it predicted no longer
    continues anything the engine holds, so nothing is credited there."""
    clock = Clock()
    index = RadixIndex(BS)
    profile, _ = kv_aware(clock)
    store(index, TARGETS[1], PROMPT[: 40 * BS])
    [sent] = burst(profile, index, 1)
    assert (sent.target, sent.matched_blocks) == (TARGETS[1], 40)
    d = profile.choose(RouteRequest(tokens=PROMPT), TARGETS, {sent.target: 1}, index)
    assert (d.target, d.inflight_blocks) == (TARGETS[1], N - 40)
    profile.ended(d)
    index.clear_carrier(TARGETS[1].carrier)
    d = profile.choose(RouteRequest(tokens=PROMPT), TARGETS, {sent.target: 1}, index)
    assert d.inflight_blocks == 0 and d.reason is Reason.NO_MATCH


def test_a_prediction_lasts_its_bound_at_most():
    clock = Clock()
    index = RadixIndex(BS)
    profile, inflight = kv_aware(clock, inflight_ttl_s=2.0)
    [sent] = burst(profile, index, 1)
    clock.now += 1.9
    assert profile.choose(RouteRequest(tokens=PROMPT), TARGETS, {}, index).reason is Reason.INFLIGHT
    clock.now += 2.1  # the second decision renewed it for 2 s; past that, nothing is left
    assert inflight.predicted_blocks(sent.target.carrier) == 0
    assert profile.choose(RouteRequest(tokens=PROMPT), TARGETS, {}, index).reason is Reason.NO_MATCH


def test_a_prediction_is_a_prefix_in_its_namespace_and_only_full_reusable_blocks():
    clock = Clock()
    index = RadixIndex(BS)
    profile, _ = kv_aware(clock)
    [sent] = burst(profile, index, 1)
    # A request sharing the first 10 blocks, then differing: credited those 10.
    diverging = [*PROMPT[: 10 * BS], *range(5000, 5000 + 8 * BS)]
    d = profile.choose(RouteRequest(tokens=diverging), TARGETS, {}, index)
    assert (d.target, d.inflight_blocks) == (sent.target, 10)
    # Another adapter's or salt's blocks are other keys: nothing predicted for them.
    for other in (RouteRequest(tokens=PROMPT, lora_name="sql"), RouteRequest(tokens=PROMPT, cache_salt="t2")):
        assert profile.choose(other, TARGETS, {}, index).inflight_blocks == 0


def test_predictions_are_forgotten_with_their_target_and_capped():
    clock = Clock()
    index = RadixIndex(BS)
    profile, inflight = kv_aware(clock)
    [sent] = burst(profile, index, 1)
    assert profile.remove_target(sent.target) >= N
    assert inflight.predicted_blocks(sent.target.carrier) == 0

    capped = InflightPrefix(max_predictions=1, clock=clock)
    p = Profile("capped", scorers=(capped,), picker=profile.picker, needs_tokens=True)
    only = [TARGETS[0]]
    p.choose(RouteRequest(tokens=PROMPT), only, {}, index)
    p.choose(RouteRequest(tokens=[*range(9000, 9000 + 10 * BS), 1]), only, {}, index)
    assert capped.predicted_blocks(TARGETS[0].carrier) == 10  # the oldest went first


def over_the_wire(sender: InflightPrefix, receiver: Profile, max_age_s: float = 2.0) -> None:
    """``sender``'s predictions as its load report carries them, vetted and accepted by ``receiver``."""
    report = vet_report(encode_report("r0", "inc0", 1, [], sender.shared()))
    receiver.accept_peer((report.replica, report.incarnation), report.shared, max_age_s)


def test_a_siblings_predictions_draw_the_copies_it_did_not_send():
    """Replica A sends the first copy; B, seeing A's load there (the fleet view) but not its prediction,
    sends the next one elsewhere. With A's predictions in its report, B follows A's copy."""
    clock = Clock()
    index_a, index_b = RadixIndex(BS), RadixIndex(BS)
    a, inflight_a = kv_aware(clock)
    b, inflight_b = kv_aware(clock)
    [first] = burst(a, index_a, 1)
    loads = {first.target: 1.0}  # what the fleet view tells B
    apart = b.choose(RouteRequest(tokens=PROMPT), TARGETS, loads, index_b)
    assert apart.target != first.target and apart.reason is Reason.NO_MATCH
    b.ended(apart)

    over_the_wire(inflight_a, b)
    assert inflight_b.predicted_blocks(first.target.carrier) == N
    d = b.choose(RouteRequest(tokens=PROMPT), TARGETS, loads, index_b)
    assert (d.target, d.reason, d.inflight_blocks) == (first.target, Reason.INFLIGHT, N)
    b.ended(d)
    # B's own prediction travels back: what B sent counts at A (and A's at A once, not twice).
    assert inflight_a.predicted_blocks(first.target.carrier) == N

    # A's request ends: its next report carries nothing, and B's credit is gone with it.
    a.ended(first)
    over_the_wire(inflight_a, b)
    assert inflight_b.predicted_blocks(first.target.carrier) == 0
    # A report that is never followed by another counts for its age bound at most.
    [again] = burst(a, index_a, 1)
    over_the_wire(inflight_a, b, max_age_s=2.0)
    clock.now += 2.1
    assert inflight_b.predicted_blocks(again.target.carrier) == 0
    assert b.choose(RouteRequest(tokens=PROMPT), TARGETS, {}, index_b).reason is Reason.NO_MATCH

    # Predictions off here (a ttl of 0): a sibling's count for nothing either.
    off, _ = kv_aware(clock, inflight_ttl_s=0.0)
    [sent] = burst(a, index_a, 1)
    over_the_wire(inflight_a, off)
    assert off.choose(RouteRequest(tokens=PROMPT), TARGETS, {}, index_b).reason is Reason.NO_MATCH
    a.ended(sent)


def test_two_profiles_shares_fit_one_report_a_sibling_accepts():
    """A disaggregated replica shares its prefill profile's predictions and its decode side's in one
    report: in order, cut at a report's bounds (a sibling refuses a larger report whole)."""
    on = Carrier("p", 0)
    prefill = Shared(tuple(Predicted(on, 0, [i]) for i in range(3)))
    decode = Shared(tuple(Predicted(Carrier("d", 0), 0, list(range(1000))) for _ in range(10)), {"d": ("x",)})
    both = in_one_report(prefill, decode)
    assert both.predictions[:3] == prefill.predictions and both.adapters == {"d": ("x",)}
    assert sum(len(p.keys) for p in both.predictions) <= MAX_SHARED_KEYS
    assert len(both.predictions) == 3 + MAX_SHARED_KEYS // 1000
    raw = encode_report("r", "i", 1, (), both)  # and a sibling's vetting takes it
    assert len(vet_report(raw).shared.predictions) == len(both.predictions)


def test_a_lying_sibling_credits_only_the_requests_own_blocks_at_the_prediction_weight():
    clock = Clock()
    index = RadixIndex(BS)
    b, inflight = kv_aware(clock)
    keys = index.keys_for(PROMPT[: N * BS])
    target = TARGETS[2]
    lies = [
        Predicted(target.carrier, 0, [*keys, *range(1, 1000)]),  # more blocks than the prompt has
        Predicted(target.carrier, 0, keys[:64]),
        Predicted(target.carrier, 64, keys[64:]),  # chained: counted once, never twice
        Predicted(target.carrier, 3, keys[:10]),  # keys out of place: credits nothing
    ]
    b.accept_peer(("liar", "1"), Shared(tuple(lies)), 2.0)
    # Another engine holding all 128 blocks confirmed still wins over 128 predicted at 0.9.
    store(index, TARGETS[0], PROMPT[: N * BS])
    d = b.choose(RouteRequest(tokens=PROMPT), TARGETS, {}, index)
    assert (d.target, d.matched_blocks) == (TARGETS[0], N)
    score = inflight.score(Cycle.of(RouteRequest(tokens=PROMPT), TARGETS, {}, index))
    assert min(score.costs) == -0.9 * N  # the request's own 128 blocks, no more
    # Without the fleet view's sharing (--no-share-predictions) a sibling's report is not counted.
    quiet, off = kv_aware(clock, inflight_share=False)
    quiet.accept_peer(("liar", "1"), Shared(tuple(lies)), 2.0)
    assert off.predicted_blocks(target.carrier) == 0 and off.shared() == Shared()


def test_a_report_shares_the_newest_predictions_within_its_bounds_and_vetting_refuses_the_rest():
    clock = Clock()
    index = RadixIndex(BS)
    a, inflight = kv_aware(clock)
    long_prompt = list(range(1, 1 + 3000 * BS + 1))
    for i in range(4):  # 4 x 3000 blocks: only two fit the report's bound
        a.choose(RouteRequest(tokens=[i, *long_prompt]), TARGETS, {}, index)
    shared = inflight.shared().predictions
    assert [len(p.keys) for p in shared] == [3000, 3000]
    assert sum(len(p.keys) for p in shared) <= MAX_SHARED_KEYS
    assert shared[0].keys[0] == index.keys_for([3, *long_prompt[: BS - 1]])[0]  # the newest first

    good = Predicted(Carrier("e", 0), 0, [1, 2])
    body = encode_report("r", "i", 1, [], Shared((good,))).decode()
    vetted = vet_report(body.encode()).shared.predictions
    assert vetted == (Predicted(Carrier("e", 0), 0, (1, 2)),)
    # Each prediction is packed once for the reports that carry it, to the same bytes.
    packer, other = PredictionPacker(), Predicted(Carrier("f", 1), 2, [3])
    assert encode_report("r", "i", 1, [], Shared((good,)), packer).decode() == body
    assert packer([good])[0] is packer([other, good])[1]  # the same wire form, not packed again
    again = vet_report(encode_report("r", "i", 2, [], Shared((other, good)), packer))
    assert again.shared.predictions == (
        Predicted(Carrier("f", 1), 2, (3,)),
        Predicted(Carrier("e", 0), 0, (1, 2)),
    )
    packed = body.split('"predictions":')[1][:-1]
    for bad in (
        packed.replace('"e",0,0', '"e",true,0'),  # a bool is not a rank
        packed.replace('"e",0,0', '"e",0,-1'),
        packed.replace('"e",0,0', '"",0,0'),
        '[["e",0,0,"not base64!"]]',
        '[["e",0,0,"AAAA"]]',  # 3 bytes: not whole keys
        '[["e",0,0,""]]',
        '[["e",0,0]]',
        '{"e": 1}',
        "[" + ",".join([packed[1:-1]] * 1025) + "]",  # more predictions than a report holds
        '[["e",0,0,"' + "A" * (4 * (8 * MAX_SHARED_KEYS + 2) // 3 + 4) + '"]]',
    ):
        doc = body.split('"predictions":')[0] + '"predictions":' + bad + "}"
        with pytest.raises(GossipRejected):
            vet_report(doc.encode())


def test_the_audit_counts_an_inflight_guess_apart_from_the_index_claim():
    bs = BS
    on_prediction = Prediction(tokens=0, block_size=bs, reusable_tokens=32 * bs, inflight_tokens=32 * bs)
    # The engine reused the first copy's blocks: the guess paid, and nobody missed anything.
    a = judge(on_prediction, 32 * bs)
    assert (a.outcome, a.inflight_reused_tokens, a.missed_hit_tokens) == (AuditOutcome.EXACT, 32 * bs, 0)
    # It had not stored them yet: computed again, no false hit (the index claimed nothing).
    a = judge(on_prediction, 0)
    assert (a.outcome, a.inflight_reused_tokens, a.false_hit_tokens) == (AuditOutcome.EXACT, 0, 0)
    # The index's part stays a claim: short of it is a false hit, whatever was in flight.
    a = judge(Prediction(tokens=8 * bs, block_size=bs, inflight_tokens=8 * bs), 4 * bs)
    assert (a.outcome, a.false_hit_tokens) == (AuditOutcome.FALSE_HIT, 4 * bs)


@pytest.mark.timeout(60)
async def test_copies_sent_at_once_through_a_router_land_on_one_engine_and_the_audit_counts_the_guess():
    """Over real HTTP and ZMQ: 4 fake engines, one router, a 2k-token prompt sent 4 times at once. The
    engines have published nothing when the copies are decided; the copies after the first follow it on
    their in-flight prediction, and the audit finds the engine served all that was predicted."""
    bs = 16
    prompt = list(range(300, 300 + 128 * bs + 1))
    engine = {"prefill_us_per_token": 50, "decode_tokens_per_s": 0}
    async with router_over_fakes(4, bs, engine=engine) as (engines, router, url, s):

        async def copy() -> dict:
            body = {"model": "m", "prompt": prompt, "max_tokens": 2}
            async with s.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                return await r.json()

        answers = await asyncio.gather(*(copy() for _ in range(4)))
        served = [sum(st.requests.values()) for e in engines for st in e.rank_stats]
        assert sorted(served) == [0, 0, 0, 4], served
        assert predicted_blocks(router) == 0  # every request has ended, and its prediction with it
        cached = sorted(a["usage"]["prompt_tokens_details"]["cached_tokens"] for a in answers)
        assert cached == [0, 128 * bs, 128 * bs, 128 * bs]  # the fake engine caches at admission

        get = router.registry.get_sample_value
        engine = engines[served.index(4)].http_url
        labels = {"engine": engine, "policy": "kv_aware", "doubtful": "false"}
        assert get("routerfleet_routing_decisions_total", {"policy": "kv_aware", "reason": "inflight"}) == 3
        assert get("routerfleet_audit_inflight_predicted_tokens_total", labels) == 3 * 128 * bs
        assert get("routerfleet_audit_inflight_reused_tokens_total", labels) == 3 * 128 * bs
        assert get("routerfleet_audit_missed_hit_tokens_total", labels) == 0
        assert get("routerfleet_audit_false_hit_tokens_total", labels) == 0
