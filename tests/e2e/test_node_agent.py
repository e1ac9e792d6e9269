"""The process node agent (e2e/cluster/node_agent.py) runs pods as local processes on a real control plane.

The e2e test runs `python -m e2e.cluster run --node-agent node-1 -- python -m e2e.cluster.node_smoke`
in a subprocess (private netns); the other tests check the agent's pure helpers. Deselect with
`-m "not e2e"`.
"""

import subprocess
import sys
from pathlib import Path

import pytest

from e2e.cluster.node_agent import (
    ContainerRuntime,
    compute_pod_status,
    container_argv,
    container_env,
    expand,
    resolve_port,
)

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.e2e
NOW = "2026-01-01T00:00:00Z"


def _pod(**spec) -> dict:
    return {
        "metadata": {"name": "p", "namespace": "ns", "uid": "u-1", "labels": {"app": "x"}},
        "spec": {"nodeName": "node-1", "containers": [{"name": "c"}], **spec},
        "status": {},
    }


def test_expand():
    env = {"A": "1", "B": "two"}
    assert expand("$(A)-$(B)", env) == "1-two"
    assert expand("$(MISSING) $$(A) $ $(", env) == "$(MISSING) $(A) $ $("


def test_container_env_fieldrefs_and_expansion():
    c = {
        "name": "c",
        "command": ["engine"],
        "args": ["--host", "$(POD_IP)", "--name", "$(ID)"],
        "env": [
            {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}},
            {"name": "NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}},
            {"name": "APP", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['app']"}}},
            {"name": "ID", "value": "$(NS)/$(NAME)@$(POD_IP)"},
        ],
    }
    env = container_env(_pod(), c, "10.244.0.7", "10.244.0.1")
    assert env["ID"] == "ns/p@10.244.0.7" and env["UID"] == "u-1" and env["APP"] == "x"
    assert container_argv(c, env) == ["engine", "--host", "10.244.0.7", "--name", "ns/p@10.244.0.7"]
    assert resolve_port({"ports": [{"name": "http", "containerPort": 8000}]}, "http") == 8000
    assert resolve_port({}, 9000) == 9000


def _conds(status: dict) -> dict:
    return {c["type"]: c["status"] for c in status["conditions"]}


def test_compute_pod_status_phases_and_readiness_gates():
    kw = {"pod_ip": "10.244.0.2", "host_ip": "10.244.0.1", "start_time": NOW, "now": NOW}
    pod = _pod(readinessGates=[{"conditionType": "example.com/gate"}])
    s = compute_pod_status(pod, [ContainerRuntime("c")], **kw)
    assert s["phase"] == "Pending" and s["podIPs"] == [{"ip": "10.244.0.2"}]
    assert s["containerStatuses"][0]["state"]["waiting"] == {"reason": "ContainerCreating"}
    assert _conds(s) == {
        "PodScheduled": "True",
        "Initialized": "True",
        "ContainersReady": "False",
        "Ready": "False",
    }

    running = ContainerRuntime("c", pid=42, started_at=NOW, running=True, ready=True)
    s = compute_pod_status(pod, [running], **kw)
    assert s["phase"] == "Running" and s["containerStatuses"][0]["state"]["running"] == {"startedAt": NOW}
    assert _conds(s)["ContainersReady"] == "True" and _conds(s)["Ready"] == "False"  # gate not True
    ready_cond = next(c for c in s["conditions"] if c["type"] == "Ready")
    assert ready_cond["reason"] == "ReadinessGatesNotReady"

    pod["status"]["conditions"] = [{"type": "example.com/gate", "status": "True"}]
    assert _conds(compute_pod_status(pod, [running], **kw))["Ready"] == "True"

    done = ContainerRuntime("c", started_at=NOW, exit_code=1, finished_at=NOW)
    assert compute_pod_status(_pod(restartPolicy="Never"), [done], **kw)["phase"] == "Failed"
    assert compute_pod_status(_pod(), [done], **kw)["phase"] == "Running"  # Always: being restarted


def test_node_agent_smoke(tmp_path):
    work = tmp_path / "cluster"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "e2e.cluster",
            "run",
            "--workdir",
            str(work),
            "--node-agent",
            "node-1",
            "--",
            sys.executable,
            "-m",
            "e2e.cluster.node_smoke",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if r.returncode != 0:
        logs = "".join(
            f"\n--- {p.name} (tail)\n" + "\n".join(p.read_text(errors="replace").splitlines()[-15:])
            for p in sorted((work / "logs").glob("*.log"))
        )
        pytest.fail(f"exit {r.returncode}\n--- stdout\n{r.stdout}\n--- stderr\n{r.stderr[-4000:]}{logs}")
    assert "node smoke: all checks passed" in r.stdout
