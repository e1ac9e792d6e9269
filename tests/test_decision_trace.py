"""Every policy makes the recorded decisions (bench/decision_trace.py says how the trace is driven;
re-record it only for a change meant to alter decisions, once the old trace replays with that change
turned off)."""

from __future__ import annotations

from pathlib import Path

from bench import decision_trace

RECORDED = Path(__file__).parent / "data" / "decision_trace.json.gz"


def test_every_policy_makes_the_recorded_decisions():
    assert decision_trace.first_difference(decision_trace.load(str(RECORDED))) is None


def test_the_replay_notices_a_different_decision():
    recorded = decision_trace.load(str(RECORDED))
    step = recorded["kv_aware/default"][100]
    made, step["target"] = step["target"], "elsewhere"
    assert (
        decision_trace.first_difference(recorded) == f"kv_aware/default step 100: target elsewhere -> {made}"
    )
