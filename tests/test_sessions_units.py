"""Session affinity, the functional core and the store: keys (hashed, never raw), TTL and LRU bounds,
classification and promotion, every policy's handling of a preference, the hard lookup deadline
against deliberately slow stores, the snapshot envelope's session table and its vetting, the flags."""

from __future__ import annotations

import asyncio
import logging
import time

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from router_runtime.bootstrap.vetting import vet_sessions
from router_runtime.bootstrap.wire import (
    Limits,
    WireError,
    WireSession,
    WireSnapshot,
    decode,
    encode,
)
from router_runtime.config import parse_args
from router_runtime.kv.events import BlockStored, EventBatch
from router_runtime.kv.index import RadixIndex
from router_runtime.scheduling.presets import PolicyConfig, make_policy
from router_runtime.scheduling.types import Reason, RouteRequest, Target
from router_runtime.sessions.affinity import SessionAffinity, SessionCtx, engine_id
from router_runtime.sessions.classify import SessionState, classify, promote
from router_runtime.sessions.config import SessionConfig
from router_runtime.sessions.keys import KeySource, digest, response_digest, session_digest, tenant_of
from router_runtime.sessions.metrics import SessionMetrics
from router_runtime.sessions.snapshot import from_wire, to_wire
from router_runtime.sessions.store import Entry, LocalStore, Remembered
from router_runtime.worker import WorkerSpec

A = Target("http://a", "http://a")
B = Target("http://b", "http://b")
C = Target("http://c", "http://c")
RAW = "user-7f3a-secret-conversation"


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def affinity(store=None, **cfg) -> tuple[SessionAffinity, CollectorRegistry]:
    reg = CollectorRegistry()
    a = SessionAffinity(SessionConfig(enabled=True, **cfg), SessionMetrics(reg), store)
    a.set_workers([WorkerSpec(t.engine, t.url, incarnation="i1") for t in (A, B, C)])
    return a, reg


def value(reg, name, **labels) -> float:
    return reg.get_sample_value(name, labels) or 0.0


# ---- keys ------------------------------------------------------------------------------------------


def test_digest_is_length_prefixed_sha256_per_source_and_model():
    d = digest(KeySource.PROMPT_CACHE_KEY, "m", RAW)
    assert len(d) == 32 and RAW.encode() not in d
    assert d == digest("prompt_cache_key", "m", RAW)
    assert d != digest(KeySource.CONVERSATION_ID, "m", RAW)
    assert d != digest(KeySource.PROMPT_CACHE_KEY, "m2", RAW)
    # Length prefixes: moving a boundary between fields changes the digest.
    assert digest("header", "ab", "c") != digest("header", "a", "bc")


def test_a_tenant_scopes_every_key_and_no_tenant_keeps_the_digests_of_a_router_without_tenants():
    alice, bob = tenant_of({"Authorization": "Bearer a"}, "Authorization"), tenant_of({}, "Authorization")
    assert tenant_of({"Authorization": "Bearer a"}, None) == "" and alice != bob and "Bearer" not in alice
    body = {"model": "m", "prompt_cache_key": "pck"}
    assert session_digest(body, {}, None, tenant=alice) != session_digest(body, {}, None, tenant=bob)
    assert session_digest(body, {}, None, tenant="") == digest("prompt_cache_key", "m", "pck")
    assert response_digest("resp_1", alice) != response_digest("resp_1") == response_digest("resp_1", "")


def test_only_explicit_keys_are_eligible_in_precedence_order():
    h = {"x-session-id": "hdr"}
    body = {"model": "m", "prompt_cache_key": "pck", "conversation_id": "cid"}
    assert session_digest(body, h, "x-session-id") == digest("prompt_cache_key", "m", "pck")
    assert session_digest({"model": "m", "conversation_id": "cid"}, h, "x-session-id") == digest(
        "conversation_id", "m", "cid"
    )
    assert session_digest({"model": "m"}, h, "x-session-id") == digest("header", "m", "hdr")
    assert session_digest({"model": "m"}, h, None) is None
    # The Responses API's conversation (an id or an object), Anthropic's user id only when opted in.
    for conv in ("conv_1", {"id": "conv_1"}):
        assert session_digest({"model": "m", "conversation": conv}, {}, None) == digest(
            "conversation", "m", "conv_1"
        )
    anthropic_body = {"model": "m", "metadata": {"user_id": "u-7"}}
    assert session_digest(anthropic_body, {}, None) is None
    assert session_digest(anthropic_body, {}, None, user_ids=True) == digest("metadata.user_id", "m", "u-7")
    assert session_digest({"metadata": "u"}, {}, None, user_ids=True) is None
    # Not a usable key: ineligible (never an error), and nothing derived from the payload.
    for bad in ({"prompt_cache_key": 5}, {"conversation_id": ""}, {"prompt_cache_key": "x" * 5000}):
        assert session_digest({**bad, "prompt": "hello"}, {}, "x-session-id") is None


# ---- the store -------------------------------------------------------------------------------------


def test_ttl_expires_entries_from_their_last_write_not_their_last_read():
    clock = Clock()
    evicted = []
    s = LocalStore(ttl_s=600, max_entries=10, clock=clock, on_evict=evicted.append)
    v = Remembered("http://a", None, "i1")
    s.put_nowait(b"k" * 32, v)
    clock.t += 599
    assert s.get_nowait(b"k" * 32) == v  # a read does not extend the TTL
    clock.t += 1
    assert s.get_nowait(b"k" * 32) is None and evicted == ["ttl"] and len(s) == 0
    s.put_nowait(b"k" * 32, v)
    clock.t += 300
    s.put_nowait(b"k" * 32, v)  # a write does
    clock.t += 500
    assert s.get_nowait(b"k" * 32) == v


def test_lru_bound_evicts_the_least_recently_used():
    clock = Clock()
    evicted = []
    s = LocalStore(ttl_s=600, max_entries=3, clock=clock, on_evict=evicted.append)
    keys = [bytes([i]) * 32 for i in range(5)]
    for k in keys[:3]:
        s.put_nowait(k, Remembered("http://a", None, ""))
    s.get_nowait(keys[0])  # now most recently used
    s.put_nowait(keys[3], Remembered("http://b", None, ""))
    assert len(s) == 3 and s.get_nowait(keys[1]) is None and s.get_nowait(keys[0]) is not None
    assert evicted == ["capacity"]
    # Expired entries at the LRU end go before a live one is evicted.
    clock.t += 700
    s.put_nowait(keys[4], Remembered("http://c", None, ""))
    assert "ttl" in evicted and len(s) <= 3


def test_inherit_takes_fresh_vetted_entries_and_keeps_ours():
    clock = Clock()
    s = LocalStore(ttl_s=600, max_entries=10, clock=clock)
    mine = Remembered("http://a", None, "i1")
    s.put_nowait(b"a" * 32, mine)
    n = s.inherit(
        [
            Entry(b"a" * 32, Remembered("http://b", None, "i1"), 1.0),  # ours wins
            Entry(b"b" * 32, Remembered("http://b", None, "i1"), 10.0),
            Entry(b"c" * 32, Remembered("http://c", None, "i1"), 700.0),  # expired already
        ]
    )
    assert n == 1 and s.get_nowait(b"a" * 32) == mine
    clock.t += 591
    assert s.get_nowait(b"b" * 32) is None  # its age counted against the TTL


# ---- classification and promotion ------------------------------------------------------------------


def test_classify_new_stale_returning():
    inc = {"http://a": "i1", "http://b": "i1"}
    cands = (A, B)
    assert classify(None, cands, inc).state is SessionState.NEW
    assert classify(Remembered("http://gone", None, "i1"), cands, inc).state is SessionState.STALE
    assert classify(Remembered("http://a", None, "i0"), cands, inc).state is SessionState.STALE  # restarted
    assert classify(Remembered("http://b", None, "i1"), (A,), inc).state is SessionState.STALE  # breaker
    c = classify(Remembered("http://b", None, "i1"), cands, inc)
    assert c.state is SessionState.RETURNING and c.preferred == B
    ranked = (Target("http://a", "http://a", 0), Target("http://a", "http://a", 1))
    c = classify(Remembered("http://a", 1, "i1"), ranked, inc)
    assert c.preferred == ranked[1]
    assert c.vouched  # nothing evicted: its whole prefix may be credited
    # Remembered as a whole engine, now targeted per rank: its first rank is a guess, preferred but never
    # credited beyond what the index shows there (the prefix may be on another rank).
    guessed = classify(Remembered("http://a", None, "i1"), ranked, inc)
    assert guessed.preferred == ranked[0] and not guessed.vouched
    assert classify(Remembered("http://a", 5, "i1"), ranked, inc).state is SessionState.STALE


def test_promote_moves_the_remembered_target_first_for_this_request_only():
    cands = (A, B, C)
    assert promote(cands, C) == (C, A, B)
    assert promote(cands, None) == cands
    assert cands == (A, B, C)


# ---- every policy honours a preference, under its load guard ---------------------------------------


def test_kv_aware_credits_the_remembered_target_and_keeps_its_guards():
    # Each decision stands alone (no request stays in flight: no in-flight prediction).
    pol = make_policy(
        "kv_aware",
        PolicyConfig(balance_abs_threshold=2, load_cost_tokens=0, spread_ties=False, inflight_ttl_s=0),
    )
    req = RouteRequest(tokens=list(range(64)), prefer=B, prefer_vouched=True)
    empty = RadixIndex(4)

    # The index sees nothing (events off): the session's memory puts the prefix on B.
    d = pol.choose(req, [B, A], {}, empty)
    assert d.target == B and d.reason is Reason.SESSION
    assert pol.choose(RouteRequest(tokens=list(range(64))), [A, B], {}, empty).target == A
    # Imbalanced: the guard goes least loaded; B is not forced.
    d = pol.choose(req, [B, A], {B: 3}, empty)
    assert d.target == A and d.reason is Reason.IMBALANCED
    # No index at all: a tie on load goes to B.
    assert pol.choose(RouteRequest(prefer=B), [B, A], {}, None).target == B
    # The load price still applies.
    priced = make_policy(
        "kv_aware",
        PolicyConfig(
            balance_abs_threshold=100, load_cost_tokens=4 * 100, spread_ties=False, inflight_ttl_s=0
        ),
    )
    assert priced.choose(req, [B, A], {B: 1}, empty).target == A


def test_kv_aware_trusts_the_index_over_a_remembered_target_that_evicted():
    """The index shows A holding 12 of the 16 blocks and B 4 (B evicted the rest under pressure)."""
    pol = make_policy(
        "kv_aware",
        PolicyConfig(balance_abs_threshold=100, load_cost_tokens=0, spread_ties=False, inflight_ttl_s=0),
    )
    tokens = list(range(64))

    def holding(blocks: dict[Target, int]) -> RadixIndex:
        index = RadixIndex(4)
        for t, n in blocks.items():
            stored = BlockStored(tuple(range(1, n + 1)), None, tuple(tokens[: 4 * n]), 4)
            index.apply_batch(t.carrier, EventBatch(0.0, (stored,)))
        return index

    shows = holding({A: 12, B: 4})
    # Vouched (nothing evicted since the last turn): the index is lagging, B holds the whole prefix.
    d = pol.choose(RouteRequest(tokens=tokens, prefer=B, prefer_vouched=True), [B, A], {}, shows)
    assert d.target == B and d.reason is Reason.PREFIX
    # Not vouched: what the index shows wins; the preference only breaks ties.
    d = pol.choose(RouteRequest(tokens=tokens, prefer=B), [B, A], {}, shows)
    assert d.target == A and d.reason is Reason.PREFIX
    even = holding({A: 4, B: 4})
    assert pol.choose(RouteRequest(tokens=tokens, prefer=B), [A, B], {}, even).target == B


async def test_the_shell_vouches_from_the_store_write_time_and_the_writers_eviction_record():
    evicted: dict = {}
    a, _ = affinity()
    a.evicted_at = lambda: evicted
    hdr = {"x-session-id": RAW}
    a.remember(await a.begin(hdr, {}), B)
    ctx = await a.begin(hdr, {})
    assert ctx.since is not None and a.classify(ctx, (A, B)).vouched  # B never evicted
    evicted[B.carrier] = time.monotonic()  # B evicts after the memory was written
    ctx = await a.begin(hdr, {})
    c = a.classify(ctx, (A, B))
    assert c.state is SessionState.RETURNING and c.preferred == B and not c.vouched
    a.remember(ctx, B)  # the next turn ran there: B holds it again
    ctx = await a.begin(hdr, {})
    assert a.classify(ctx, (A, B)).vouched


def test_vouched_only_when_no_eviction_since_the_memory_was_written():
    inc = {"http://b": "i1"}
    mem = Remembered("http://b", None, "i1")
    assert classify(mem, (A, B), inc, since=10.0, evicted_at={}).vouched  # never evicted
    assert classify(mem, (A, B), inc, since=None, evicted_at=None).vouched
    assert classify(mem, (A, B), inc, since=10.0, evicted_at={B.carrier: 9.0}).vouched  # before
    assert not classify(mem, (A, B), inc, since=10.0, evicted_at={B.carrier: 11.0}).vouched  # after
    assert not classify(mem, (A, B), inc, since=None, evicted_at={B.carrier: 1.0}).vouched  # age unknown
    assert classify(mem, (A, B), inc, since=10.0, evicted_at={A.carrier: 11.0}).vouched  # another carrier


def test_approx_prefix_counts_the_remembered_target_as_a_holder():
    pol = make_policy("approx_prefix", PolicyConfig(balance_abs_threshold=2))
    text = "a long shared conversation so far " * 4
    pol.choose(RouteRequest(text="other " * 50), [A, B], {}, None)  # A's tree grows
    assert pol.choose(RouteRequest(text=text), [A, B], {}, None).target == B  # smallest tree
    # Returning to A: nothing in A's tree matches, yet A is the pick.
    d = pol.choose(RouteRequest(text=text + "more", prefer=A), [A, B], {}, None)
    assert d.target == A
    # Nothing matched at all: the remembered target instead of the smallest tree.
    d = pol.choose(RouteRequest(text="fresh words " * 9, prefer=A), [A, B], {}, None)
    assert d.target == A and d.reason is Reason.SESSION
    # Imbalanced: least loaded.
    assert pol.choose(RouteRequest(text=text, prefer=A), [A, B], {A: 5}, None).target == B


def test_cache_blind_policies_honour_a_preference():
    rr = make_policy("round_robin", PolicyConfig(balance_abs_threshold=2))
    assert [rr.choose(RouteRequest(prefer=C), [C, A, B], {}, None).target for _ in range(3)] == [C, C, C]
    assert rr.choose(RouteRequest(prefer=C), [C, A, B], {C: 5}, None).target == A
    assert rr.choose(RouteRequest(), [A, B, C], {}, None).target == A  # the cursor did not move
    ll = make_policy("least_loaded")
    assert ll.choose(RouteRequest(prefer=B), [B, A], {}, None).target == B
    assert ll.choose(RouteRequest(prefer=B), [B, A], {B: 1}, None).target == A
    p2 = make_policy("power_of_two", PolicyConfig(seed=1))
    assert {p2.choose(RouteRequest(prefer=C), [C, A, B], {}, None).target for _ in range(20)} == {C}
    assert {p2.choose(RouteRequest(prefer=C), [C, A, B], {C: 3}, None).target for _ in range(20)} <= {A, B}


# ---- the shell: deadline, hints, writes, metrics, no raw keys --------------------------------------


class SlowStore:
    """A store that answers in 5 s (or never, when it swallows cancellation)."""

    def __init__(self, stubborn: bool = False) -> None:
        self.stubborn = stubborn
        self.puts = 0

    async def get(self, digest):
        try:
            await asyncio.sleep(5)
        except asyncio.CancelledError:
            if not self.stubborn:
                raise
            await asyncio.sleep(5)
        return Remembered("http://a", None, "i1")

    async def put(self, digest, value):
        self.puts += 1


class FailingStore:
    async def get(self, digest):
        raise ConnectionError("down")

    async def put(self, digest, value):
        raise ConnectionError("down")


@pytest.mark.parametrize("stubborn", [False, True])
async def test_a_slow_store_never_delays_a_request_beyond_the_deadline(stubborn):
    a, reg = affinity(SlowStore(stubborn), lookup_timeout_s=0.02)
    t0 = time.perf_counter()
    ctx = await a.begin({}, {"model": "m", "prompt_cache_key": RAW})
    elapsed = time.perf_counter() - t0
    assert elapsed < 0.2, elapsed  # 20 ms deadline; generous bound for a loaded CI runner
    assert ctx.memory is None
    assert a.classify(ctx, (A, B)).state is SessionState.NEW
    assert value(reg, "routerfleet_session_lookups_total", result="timeout") == 1


async def test_a_failing_store_is_a_miss_not_an_error():
    a, reg = affinity(FailingStore())
    ctx = await a.begin({}, {"prompt_cache_key": RAW})
    assert ctx.memory is None
    assert value(reg, "routerfleet_session_lookups_total", result="error") == 1
    a.remember(ctx, A)
    await asyncio.sleep(0.01)
    assert value(reg, "routerfleet_session_writes_total", result="error") == 1


async def test_keys_are_never_stored_or_logged_raw(caplog):
    caplog.set_level(logging.DEBUG)
    a, reg = affinity()
    ctx = await a.begin({"x-session-id": RAW}, {"model": "m", "prompt": "p"})
    assert a.classify(ctx, (A, B)).state is SessionState.NEW
    a.selected(ctx, A, "kv_aware")
    a.remember(ctx, A)
    ctx2 = await a.begin({"x-session-id": RAW}, {"model": "m"})
    c = a.classify(ctx2, (A, B))
    a.selected(ctx2, c.preferred, "kv_aware")
    assert c.state is SessionState.RETURNING and c.preferred == A
    (key,) = list(a.local._d)
    assert key == digest("header", "m", RAW) and RAW.encode() not in key
    wire = encode(WireSnapshot(1, "p", "i", True, 4, "s", [], [], 0, sessions=to_wire(a.export())))
    assert RAW.encode() not in wire
    assert RAW not in caplog.text and "session selection: state=returning" in caplog.text
    assert RAW.encode() not in generate_latest(reg)
    assert (
        value(reg, "routerfleet_session_selections_total", session_state="returning", selection="remembered")
        == 1
    )


def test_every_selection_pair_and_result_starts_at_zero():
    _a, reg = affinity()
    text = generate_latest(reg).decode()
    for state in ("new", "stale", "returning"):
        for sel in ("remembered", "policy"):
            assert (
                f'routerfleet_session_selections_total{{selection="{sel}",session_state="{state}"}} 0.0'
                in text
            )
    for result in ("hit", "miss", "timeout", "error"):
        assert f'routerfleet_session_lookups_total{{result="{result}"}} 0.0' in text


async def test_hints_are_used_only_when_trusted():
    header = {"X-RouterFleet-Last-Engine": engine_id("http://b", "i1", None)}
    untrusted, reg = affinity()
    ctx = await untrusted.begin(header, {})
    assert untrusted.classify(ctx, (A, B)).state is SessionState.NEW
    assert value(reg, "routerfleet_session_hints_total", result="ignored") == 1
    trusted, reg = affinity(trust_hints=True)
    ctx = await trusted.begin(header, {})
    assert trusted.classify(ctx, (A, B)).preferred == B
    ctx = await trusted.begin({"X-RouterFleet-Last-Engine": "e1.nonsense"}, {})
    assert trusted.classify(ctx, (A, B)).state is SessionState.STALE
    assert value(reg, "routerfleet_session_hints_total", result="unknown") == 1
    # A restarted engine has a new id: the echoed old one names nothing.
    trusted.set_workers([WorkerSpec("http://b", "http://b", incarnation="i2")])
    ctx = await trusted.begin(header, {})
    assert trusted.classify(ctx, (B,)).state is SessionState.STALE


def test_classified_once_retries_keep_the_state():
    a, _reg = affinity()
    ctx = SessionCtx(b"d" * 32)
    ctx.memory = Remembered("http://b", None, "i1")
    assert a.classify(ctx, (A, B)).state is SessionState.RETURNING
    assert a.classify(ctx, (A,)).state is SessionState.RETURNING  # the retry without B


# ---- the peer snapshot -----------------------------------------------------------------------------


def _snap(sessions):
    return WireSnapshot(1, "p", "i", True, 4, "s", [], [], 0, sessions=sessions)


def test_session_table_round_trips_in_the_envelope_and_is_vetted():
    entries = [
        WireSession(bytes([i]) * 32, f"http://e{i % 3}", None if i % 2 else i % 4, "i1", 1000 * i)
        for i in range(10)
    ]
    got = decode(encode(_snap(entries)), Limits()).sessions
    assert got == entries
    assert decode(encode(_snap([])), Limits()).sessions == []
    kept = vet_sessions(got, {"http://e0": "i1", "http://e1": "i2"})
    assert {s.engine for s in kept} == {"http://e0"}
    assert [e.value for e in from_wire(kept)] == [Remembered(s.engine, s.rank, "i1") for s in kept]
    with pytest.raises(WireError):
        decode(encode(_snap(entries)), Limits(max_sessions=5))


def test_malformed_session_tables_are_refused():
    import msgpack
    import xxhash

    def envelope(sessions):
        body = msgpack.unpackb(msgpack.unpackb(encode(_snap([])), raw=False)["body"], raw=False)
        body["sessions"] = sessions
        b = msgpack.packb(body, use_bin_type=True)
        return msgpack.packb({"format": 1, "body": b, "checksum": xxhash.xxh3_128_digest(b)})

    good = {"targets": [["e", -1, "i"]], "digest": b"x" * 32, "target": b"\0" * 4, "age_ms": b"\0" * 4}
    assert len(decode(envelope(good), Limits()).sessions) == 1
    for bad in (
        {**good, "digest": b"x" * 31},
        {**good, "target": b"\1\0\0\0"},
        {**good, "targets": [["e", "r", "i"]]},
        {**good, "age_ms": b"\0"},
        [1, 2],
    ):
        with pytest.raises(WireError):
            decode(envelope(bad), Limits())


# ---- flags -----------------------------------------------------------------------------------------


def test_flags():
    c = parse_args(["--worker", "url=http://h:1"]).sessions
    assert c == SessionConfig()
    assert not c.enabled and not c.trust_hints and c.ttl_s == 600 and c.max_entries == 100_000
    assert c.key_header == "x-session-id" and c.lookup_timeout_s == 0.02
    c = parse_args(
        [
            "--worker",
            "url=http://h:1",
            "--session-affinity",
            "--session-ttl-ms",
            "1000",
            "--session-max-entries",
            "5",
            "--session-lookup-timeout-ms",
            "7",
            "--session-header",
            "x-conv",
            "--session-trust-hints",
        ]
    ).sessions
    assert (c.enabled, c.ttl_s, c.max_entries, c.lookup_timeout_s, c.key_header, c.trust_hints) == (
        True,
        1.0,
        5,
        0.007,
        "x-conv",
        True,
    )
    with pytest.raises(SystemExit):
        parse_args(["--worker", "url=http://h:1", "--session-hint-header", "bad header"])
