"""The decision trace: every routing policy driven through the routing-quality workload in one process,
each step's inputs and decision written down, so a change to how decisions are made can prove it makes
the same ones (``tests/test_decision_trace.py`` replays ``tests/data/decision_trace.json.gz``).

    python -m bench.decision_trace --record tests/data/decision_trace.json.gz   # on the code to match
    python -m bench.decision_trace --check tests/data/decision_trace.json.gz    # the first difference

No network, no clock: four targets (engine e2 has two DP ranks), each with the fake engine's own
``RankCache`` (a device tier too small for the workload, and a host tier: evictions, tier mixes), whose
events feed one ``RadixIndex`` as a router's would. A request stays in flight for a few steps (the loads
the policies balance), is admitted when routed, and caches its prompt and reply when it ends. Returning
conversations prefer the target of their previous turn (vouched two times in three); some requests
carry a cache salt; every 50 steps one target is unhealthy for 10, and every 200 a target restarts
empty (``remove_target``). Each policy runs twice: default tunables, and tight ones (a guard that trips,
no tie spreading, a small text tree). The state a step sees depends on every earlier decision, so the
first differing decision is reported and the rest are not compared.
"""

from __future__ import annotations

import argparse
import gzip
import json
import random
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from bench.routing_quality import Params, build_workload
from router_runtime.kv.events import Dialect, EventBatch
from router_runtime.kv.index import RadixIndex
from router_runtime.scheduling.presets import POLICY_NAMES, PolicyConfig, make_policy
from router_runtime.scheduling.types import Decision, RouteRequest, Target
from routerfleet_fake_engine.cache import CacheConfig, RankCache
from routerfleet_fake_engine.hashing import PLAIN

WORKLOAD = Params(convs=160, groups=6, sys_tokens=(256, 512), user_tokens=(24, 96), active=16, seed=23)
TARGETS = (
    Target("e0", "http://e0", 0),
    Target("e1", "http://e1", 0),
    Target("e2", "http://e2", 0),
    Target("e2", "http://e2", 1),
)
CONFIGS = {
    "default": PolicyConfig(seed=7),
    "tight": PolicyConfig(
        balance_abs_threshold=2,
        balance_rel_threshold=1.2,
        load_cost_tokens=48.0,
        host_weight=0.3,
        spread_ties=False,
        cache_threshold=0.5,
        max_tree_size=6000,
        seed=7,
    ),
}
BLOCK = 16
DEVICE_BLOCKS = 96
HOST_BLOCKS = 64

Choose = Callable[[str, PolicyConfig], "Chooser"]


class Chooser:
    """What the trace drives: the five policies' one decision call, the end of the request it sent, and
    their target forgetting."""

    def choose(self, request: RouteRequest, targets, loads, index) -> Decision: ...

    def ended(self, decision: Decision) -> None: ...

    def remove_target(self, target: Target) -> int: ...


def name(t: Target | None) -> str | None:
    return None if t is None else f"{t.engine}:{t.rank}"


@dataclass
class _Flight:
    decision: Decision
    ends: int  # the step it completes at
    tokens: list[int]  # prompt + reply: cached when it ends


def run(policy: str, config_name: str, make: Choose = make_policy) -> Iterator[dict]:
    """One policy's trace, step by step (each a JSON-able dict: the inputs, then the decision)."""
    chooser = make(policy, CONFIGS[config_name])
    rng = random.Random(f"{policy}/{config_name}")
    index = RadixIndex(BLOCK)
    cfg = CacheConfig(Dialect.VLLM_033, BLOCK, DEVICE_BLOCKS, HOST_BLOCKS)
    caches = {t: RankCache(cfg) for t in TARGETS}
    flights: list[_Flight] = []
    served: dict[int, Target] = {}  # conversation -> the target of its last turn

    def admit(t: Target, tokens: list[int], step: int) -> None:
        events = caches[t].admit(tokens, PLAIN).events
        if events:
            index.apply_batch(t.carrier, EventBatch(float(step), events))

    for step, turn in enumerate(build_workload(WORKLOAD)):
        for f in [f for f in flights if f.ends <= step]:
            flights.remove(f)
            admit(f.decision.target, f.tokens, step)
            chooser.ended(f.decision)
        if step and step % 200 == 0:
            gone = TARGETS[(step // 200) % len(TARGETS)]
            caches[gone].reset()
            index.remove_carrier(gone.carrier)
            chooser.remove_target(gone)
        sick = TARGETS[(step // 50) % len(TARGETS)] if step % 50 < 10 else None
        targets = [t for t in TARGETS if t != sick]
        loads = {t: 0 for t in targets}
        for f in flights:
            if f.decision.target in loads:
                loads[f.decision.target] += 1
        prefer = served.get(turn.conv) if turn.index else None
        prefer = prefer if prefer in targets else None
        if prefer is not None:
            targets = [prefer, *(t for t in targets if t != prefer)]
        tokens = turn.prompt_ids
        salt = f"s{turn.group}" if turn.conv % 7 == 3 else None
        request = RouteRequest(
            tokens=tokens,
            text=turn.prompt,
            cache_salt=salt,
            prefer=prefer,
            prefer_vouched=prefer is not None and step % 3 != 0,
        )
        d = chooser.choose(request, targets, loads, index)
        yield {
            "step": step,
            "targets": [name(t) for t in targets],
            "loads": [loads[t] for t in targets],
            "prefer": name(prefer),
            "vouched": request.prefer_vouched,
            "salt": salt,
            "tokens": len(tokens),
            "target": name(d.target),
            "reason": str(d.reason),
            "blocks": [d.matched_blocks, d.total_blocks, *d.tier_blocks],
            "chars": [d.matched_chars, d.total_chars],
        }
        served[turn.conv] = d.target
        if salt is None:
            admit(d.target, tokens, step)
        reply = list(turn.reply.encode("ascii"))
        flights.append(_Flight(d, step + rng.randint(1, 9), tokens + reply))


def traces(make: Choose = make_policy) -> Iterator[tuple[str, list[dict]]]:
    for policy in POLICY_NAMES:
        for config_name in CONFIGS:
            yield f"{policy}/{config_name}", list(run(policy, config_name, make))


def first_difference(recorded: dict[str, list[dict]], make: Choose = make_policy) -> str | None:
    """None when every policy makes the recorded decisions; else where the first one differs."""
    seen = set()
    for label, steps in traces(make):
        seen.add(label)
        want = recorded.get(label)
        if want is None:
            return f"{label}: not in the recording"
        for got, was in zip(steps, want, strict=False):
            if got != was:
                keys = [k for k in got if got[k] != was.get(k)]
                return (
                    f"{label} step {got['step']}: {', '.join(f'{k} {was.get(k)} -> {got[k]}' for k in keys)}"
                )
        if len(steps) != len(want):
            return f"{label}: {len(steps)} steps, recorded {len(want)}"
    missing = set(recorded) - seen
    return f"recorded but not run: {', '.join(sorted(missing))}" if missing else None


def load(path: str) -> dict[str, list[dict]]:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.decision_trace", description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--record", metavar="PATH", help="write the trace of the code as it is")
    mode.add_argument(
        "--check", metavar="PATH", help="replay a recorded trace; exit 1 at the first difference"
    )
    args = ap.parse_args(argv)
    if args.record:
        recorded = dict(traces())
        with gzip.GzipFile(args.record, "wb", mtime=0) as f:
            f.write(json.dumps(recorded, separators=(",", ":"), sort_keys=True).encode())
        n = sum(len(v) for v in recorded.values())
        reasons = sorted({s["reason"] for v in recorded.values() for s in v})
        print(
            f"recorded {n} decisions of {len(recorded)} runs to {args.record} (reasons: {', '.join(reasons)})"
        )
        return 0
    diff = first_difference(load(args.check))
    print(diff or "every decision is the recorded one")
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
