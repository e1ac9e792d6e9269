"""Services on the process cluster (e2e/cluster/services.py): ClusterIPs route and names resolve, as
kube-proxy and the cluster DNS make them on a real one.

The first tests check the pure parts (no cluster); the last runs pods on the local cluster.
"""

import ipaddress
import struct
import subprocess
import time
import urllib.request

from test_node_agent import SERVE_NAME, _container, _local_only, _pod_body

from e2e.cluster.services import answer, resolv_conf, rules, service_ports, stale_chains


def _svc(name: str, ip: str, *ports: tuple[str, int], ns: str = "ns") -> dict:
    return {
        "metadata": {"name": name, "namespace": ns},
        "spec": {"clusterIP": ip, "ports": [{"name": n, "port": p} for n, p in ports]},
    }


def _slice(svc: str, port: tuple[str, int], *endpoints: tuple[str, bool], ns: str = "ns") -> dict:
    return {
        "metadata": {"namespace": ns, "labels": {"kubernetes.io/service-name": svc}},
        "addressType": "IPv4",
        "ports": [{"name": port[0], "port": port[1]}],
        "endpoints": [{"addresses": [a], "conditions": {"ready": r}} for a, r in endpoints],
    }


def test_each_port_goes_to_its_ready_endpoints_and_one_without_is_refused():
    services = [
        _svc("web", "10.96.0.20", ("http", 80), ("admin", 81)),
        _svc("empty", "10.96.0.21", ("", 80)),
        _svc("headless", "None", ("", 80)),
    ]
    slices = [
        _slice("web", ("http", 7000), ("10.244.0.5", True), ("10.244.0.6", True), ("10.244.0.7", False)),
        _slice("web", ("admin", 7001), ("10.244.0.5", True)),
    ]
    ports = service_ports(services, slices)
    assert [(p.service, p.port_name, p.endpoints) for p in ports] == [
        ("empty", "", ()),
        ("web", "admin", (("10.244.0.5", 7001),)),
        ("web", "http", (("10.244.0.5", 7000), ("10.244.0.6", 7000))),
    ]
    text = rules(ports)
    nat = text.split("*filter")[0]
    # Two endpoints: the first taken half the time, the other the rest; the not-ready one never.
    assert "--probability 0.5000000000 -j DNAT --to-destination 10.244.0.5:7000" in nat
    assert "-j DNAT --to-destination 10.244.0.6:7000" in nat and "10.244.0.7" not in nat
    assert "-A RF-SERVICES -d 10.96.0.20/32 -p tcp -m tcp --dport 81 -j RF-SVC-" in nat
    assert "-A RF-REJECT -d 10.96.0.21/32 -p tcp -m tcp --dport 80 -j REJECT" in text.split("*filter")[1]
    # A port that went away leaves its chain behind: it is deleted after the rewrite.
    before = rules(service_ports(services, slices))
    after = rules(service_ports(services[1:], []))
    assert len(stale_chains(before, after)) == 2 and stale_chains(after, before) == []


def _query(name: str, qtype: int = 1, qid: int = 7) -> bytes:
    qname = b"".join(bytes([len(p)]) + p.encode() for p in name.split(".")) + b"\0"
    return struct.pack("!HHHHHH", qid, 0x0100, 1, 0, 0, 0) + qname + struct.pack("!HH", qtype, 1)


def test_a_service_name_resolves_to_its_address_and_any_other_name_does_not():
    table = {
        "web.ns.svc.cluster.local": ["10.96.0.20"],
        "db.ns.svc.cluster.local": ["10.244.0.8", "10.244.0.9"],
    }

    def lookup(name):
        return table.get(name)

    reply = answer(_query("Web.NS.svc.cluster.local"), lookup)
    qid, flags, _, ancount = struct.unpack("!HHHH", reply[:8])
    assert (qid, flags & 0xF, ancount) == (7, 0, 1)
    assert ipaddress.IPv4Address(reply[-4:]) == ipaddress.IPv4Address("10.96.0.20")
    assert struct.unpack("!H", answer(_query("db.ns.svc.cluster.local"), lookup)[6:8]) == (2,)
    nx = answer(_query("web.other.svc.cluster.local"), lookup)
    assert struct.unpack("!HH", nx[:4])[1] & 0xF == 3  # NXDOMAIN
    aaaa = answer(_query("web.ns.svc.cluster.local", qtype=28), lookup)
    assert struct.unpack("!HHHH", aaaa[:8])[1:] == (0x8580, 1, 0)  # the name exists, no IPv6 for it
    notify = bytearray(_query("web.ns.svc.cluster.local"))
    notify[2] |= 4 << 3  # opcode NOTIFY: not a query, not answered
    assert answer(bytes(notify), lookup) is None
    assert answer(b"\0" * 5, lookup) is None and answer(_query("x")[:-2], lookup) is None


def test_a_pod_searches_its_own_namespace_first_unless_it_asks_for_the_nodes_dns():
    pod = {"metadata": {"namespace": "team"}, "spec": {}}
    assert resolv_conf(pod).splitlines() == [
        "search team.svc.cluster.local svc.cluster.local cluster.local",
        "nameserver 10.244.0.1",
        "options ndots:5",
    ]
    assert resolv_conf({"metadata": {"namespace": "team"}, "spec": {"dnsPolicy": "Default"}}) is None


# A pod that looks the Services up by name, as a client in a cluster does, and says what it got.
CLIENT = """
import socket, sys, urllib.request
ns = sys.argv[1]
seen = set()
for _ in range(40):
    seen.add(urllib.request.urlopen("http://names/", timeout=5).read().decode())
print("by short name:", ",".join(sorted(seen)))
full = f"http://names.{ns}.svc.cluster.local/"
print("by full name:", urllib.request.urlopen(full, timeout=5).read().decode())
try:
    socket.getaddrinfo("nothing-here", 80)
    print("unknown: resolved")
except socket.gaierror:
    print("unknown: no such name")
try:
    socket.create_connection(("empty", 80), 5)
    print("empty: answered")
except ConnectionRefusedError:
    print("empty: refused")
"""


def _get(url: str) -> str:
    with urllib.request.urlopen(url, timeout=5) as r:
        return r.read().decode()


def serve_names(cluster, ns: str, service: str = "names") -> None:
    """Pods a and b, each answering GET / with its name on port 7000, behind ``service`` (port 80)."""
    ready = {"tcpSocket": {"port": 7000}, "periodSeconds": 1}
    for name in ("a", "b"):
        body = _pod_body(name, _container(name, "python", "-c", SERVE_NAME, readinessProbe=ready))
        body["metadata"]["labels"] = {"app": "serve-name"}
        cluster.core.create_namespaced_pod(ns, body)
    spec = {"selector": {"app": "serve-name"}, "ports": [{"port": 80, "targetPort": 7000}]}
    cluster.core.create_namespaced_service(ns, {"metadata": {"name": service}, "spec": spec})
    cluster.wait_pods_ready(ns, "app=serve-name", 2)


def both_answer(url: str, timeout: float = 30.0) -> set[str]:
    """Who answers at ``url`` within ``timeout``, until both have (a new route takes a moment)."""
    deadline, seen = time.monotonic() + timeout, set()
    while seen != {"a", "b"} and time.monotonic() < deadline:
        try:
            seen.add(_get(url))
        except OSError:
            time.sleep(0.2)
    return seen


def test_pods_and_the_node_reach_a_service_by_its_name_and_cluster_ip(cluster, namespace):
    """Two pods serve their names behind a Service: the node's processes reach both through its ClusterIP,
    a pod reaches both by the Service's short and full names, an unknown name does not resolve, a Service
    without endpoints refuses at once; when one pod goes, its ClusterIP stops sending to it."""
    _local_only(cluster, "the process cluster's own Services")
    ns, core = namespace, cluster.core
    spec = {"selector": {"app": "nobody"}, "ports": [{"port": 80, "targetPort": 7000}]}
    core.create_namespaced_service(ns, {"metadata": {"name": "empty"}, "spec": spec})
    serve_names(cluster, ns)
    ip = core.read_namespaced_service("names", ns).spec.cluster_ip
    assert ipaddress.IPv4Address(ip) in ipaddress.IPv4Network("10.96.0.0/16"), ip
    assert both_answer(f"http://{ip}/") == {"a", "b"}

    core.create_namespaced_pod(
        ns, _pod_body("c", _container("c", "python", "-c", CLIENT, ns), restartPolicy="Never")
    )
    cluster.wait_pod(ns, "c", lambda p: p.status.phase in ("Succeeded", "Failed"), "finished")
    log = cluster.container_log(ns, "c", "c")
    for line in ("by short name: a,b", "unknown: no such name", "empty: refused"):
        assert line in log, log
    assert "by full name: a" in log or "by full name: b" in log, log

    core.delete_namespaced_pod("a", ns)
    cluster.wait_pod_gone(ns, "a")
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the endpoint leaves the slice, then the rules
        if {_get(f"http://{ip}/") for _ in range(20)} == {"b"}:
            break
        time.sleep(0.5)
    assert {_get(f"http://{ip}/") for _ in range(20)} == {"b"}
    rules_now = subprocess.run(["iptables-save", "-t", "nat"], capture_output=True, text=True).stdout
    assert f"-d {ip}/32" in rules_now
