"""Services for the process cluster: what kube-proxy and the cluster DNS give a real one.

    python -m e2e.cluster.services --kubeconfig kube-proxy.kubeconfig

Runs in the run's network namespace (e2e/cluster/netns.py), beside the node agent, as the identity
``system:kube-proxy`` (bound to ``system:node-proxier``: it reads Services and EndpointSlices). It keeps
two things in step with them:

- **ClusterIPs route**, as kube-proxy's iptables mode does: each Service port's ClusterIP is DNATed to
  one of its ready endpoints, picked at random per connection, for pods (PREROUTING: their traffic
  reaches the node over the bridge) and for the node's own processes (OUTPUT: the tests, the control
  plane). A connection that a pod makes through a ClusterIP to a pod is masqueraded to the node's
  address, so the answer comes back through the node (the pods share one bridge; without it the answer
  would go straight to the client, from an address it never dialled). A port with no ready endpoint is
  refused at once, as kube-proxy refuses it. Everything lives in chains of its own (``RF-*``), rewritten
  whole with ``iptables-restore --noflush`` on every change.
- **Names resolve**, as the cluster DNS does (``ClusterFirst``): an A query for
  ``<service>.<namespace>.svc.cluster.local`` is answered with the Service's ClusterIP, or with its ready
  endpoints' addresses when it is headless; any other name is NXDOMAIN (the run has no other network).
  The node agent points each pod's ``/etc/resolv.conf`` here (``DNS_IP``), with the usual search path.

``rules`` and ``answer`` are pure; the rest reads the API and applies them.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import ipaddress
import logging
import signal
import struct
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from router_runtime.discovery.reflector import ListWatch, ReflectorMetrics
from routerfleet_kube import KubeClient

from .cluster import SERVICE_CIDR
from .netns import BRIDGE, NODE_IP, in_private_netns

log = logging.getLogger("e2e.cluster.services")

DNS_IP = NODE_IP  # where pods' resolv.conf points: the node's address on the bridge
DNS_PORT = 53
DOMAIN = "cluster.local"
TTL_S = 1  # answers change as endpoints do: clients ask again soon (Envoy's STRICT_DNS does)
WATCH_S = 300
SLICES = "/apis/discovery.k8s.io/v1/endpointslices"
CHAIN = "RF-SERVICES"  # nat: ClusterIP:port -> a per-port chain of endpoints
MASQ = "RF-MASQ"  # nat POSTROUTING: a pod's connection to a ClusterIP answered through the node
REJECT = "RF-REJECT"  # filter: ports without endpoints, refused at once


@dataclass(frozen=True, slots=True)
class ServicePort:
    namespace: str
    service: str
    port_name: str
    cluster_ip: str
    port: int
    protocol: str  # TCP, UDP
    endpoints: tuple[tuple[str, int], ...]  # ready (address, port)


def ready_endpoints(slices: Iterable[dict]) -> dict[tuple[str, str], dict[str, set[tuple[str, int]]]]:
    """(namespace, service) -> port name -> its ready (address, port)s, from the EndpointSlices."""
    ready: dict[tuple[str, str], dict[str, set[tuple[str, int]]]] = {}
    for s in slices:
        meta = s.get("metadata", {})
        owner = (meta.get("labels") or {}).get("kubernetes.io/service-name")
        if not owner or s.get("addressType") != "IPv4":
            continue
        by_port = ready.setdefault((meta.get("namespace", ""), owner), {})
        for p in s.get("ports") or []:
            if p.get("port") is None:
                continue
            for e in s.get("endpoints") or []:
                if (e.get("conditions") or {}).get("ready") is False:
                    continue
                for a in e.get("addresses") or []:
                    by_port.setdefault(p.get("name") or "", set()).add((a, int(p["port"])))
    return ready


def service_ports(services: Iterable[dict], slices: Iterable[dict]) -> list[ServicePort]:
    """Every routed port of every Service with a ClusterIP, with its ready endpoints (matched by port
    name, as kube-proxy matches them)."""
    ready = ready_endpoints(slices)
    out = []
    for svc in services:
        meta, spec = svc.get("metadata", {}), svc.get("spec", {})
        ip = spec.get("clusterIP")
        if not ip or ip == "None" or spec.get("type") == "ExternalName":
            continue
        key = (meta.get("namespace", ""), meta.get("name", ""))
        for p in spec.get("ports") or []:
            name = p.get("name") or ""
            eps = tuple(sorted(ready.get(key, {}).get(name, ())))
            proto = p.get("protocol") or "TCP"
            out.append(ServicePort(key[0], key[1], name, ip, int(p["port"]), proto, eps))
    return sorted(out, key=lambda sp: (sp.namespace, sp.service, sp.port_name))


def rules(ports: Iterable[ServicePort]) -> str:
    """The ``iptables-restore --noflush`` input that makes ``ports`` route: our chains, flushed and
    written whole (the jumps into them are made once, by ``hook``)."""
    nat = [f":{CHAIN} - [0:0]", f":{MASQ} - [0:0]"]
    flt = [f":{REJECT} - [0:0]"]
    body_nat, body_flt = [], []
    for sp in ports:
        proto = sp.protocol.lower()
        match = f"-d {sp.cluster_ip}/32 -p {proto} -m {proto} --dport {sp.port}"
        if not sp.endpoints:
            body_flt.append(f"-A {REJECT} {match} -j REJECT")
            continue
        chain = (
            "RF-SVC-"
            + hashlib.sha256(f"{sp.namespace}/{sp.service}:{sp.port_name}".encode()).hexdigest()[:16].upper()
        )
        nat.append(f":{chain} - [0:0]")
        body_nat.append(f"-A {CHAIN} {match} -j {chain}")
        n = len(sp.endpoints)
        for i, (addr, port) in enumerate(sp.endpoints):
            pick = f"-m statistic --mode random --probability {1 / (n - i):.10f} " if i < n - 1 else ""
            body_nat.append(f"-A {chain} -p {proto} {pick}-j DNAT --to-destination {addr}:{port}")
    body_nat.append(
        f"-A {MASQ} -o {BRIDGE} -m conntrack --ctstate DNAT -m addrtype ! --src-type LOCAL -j MASQUERADE"
    )
    return "\n".join(["*nat", *nat, *body_nat, "COMMIT", "*filter", *flt, *body_flt, "COMMIT", ""])


def stale_chains(existing: str, wanted: str) -> list[str]:
    """The per-port chains in ``existing`` (``iptables-save -t nat``) that ``wanted`` no longer has."""

    def chains(text: str) -> set[str]:
        return {line[1:].split()[0] for line in text.splitlines() if line.startswith(":RF-SVC-")}

    return sorted(chains(existing) - chains(wanted))


# --------------------------------------------------------------------------------------------- DNS


def answer(query: bytes, lookup: Callable[[str], list[str] | None]) -> bytes | None:
    """The reply to one DNS query (``lookup``: a name's IPv4 addresses, None when it does not exist),
    or None for a packet that is not a query we can read."""
    if len(query) < 12:
        return None
    qid, flags, qdcount = struct.unpack("!HHH", query[:6])
    if flags & 0x8000 or (flags >> 11) & 0xF or qdcount != 1:  # an answer, not a query, not one question
        return None
    labels, i = [], 12
    while True:
        if i >= len(query):
            return None
        n = query[i]
        if n == 0:
            i += 1
            break
        if n & 0xC0 or i + 1 + n > len(query):
            return None
        labels.append(query[i + 1 : i + 1 + n].decode("ascii", "replace").lower())
        i += 1 + n
    if i + 4 > len(query):
        return None
    qtype, qclass = struct.unpack("!HH", query[i : i + 4])
    question = query[12 : i + 4]
    rd = flags & 0x0100
    addrs = lookup(".".join(labels))
    if addrs is None:
        return struct.pack("!HHHHHH", qid, 0x8480 | rd | 3, 1, 0, 0, 0) + question  # NXDOMAIN
    records = b""
    if qtype in (1, 255) and qclass == 1:  # A (or ANY): the addresses; else no data for the name
        for a in addrs:
            records += struct.pack("!HHHIH", 0xC00C, 1, 1, TTL_S, 4) + ipaddress.IPv4Address(a).packed
        count = len(addrs)
    else:
        count = 0
    # QR, AA (the cluster's own names), RA; RD as asked.
    return struct.pack("!HHHHHH", qid, 0x8480 | rd, 1, count, 0, 0) + question + records


def names(services: Iterable[dict], slices: Iterable[dict]) -> dict[str, list[str]]:
    """``<service>.<namespace>.svc.cluster.local`` -> its addresses: the ClusterIP, or a headless
    Service's ready endpoints."""
    ready = ready_endpoints(slices)
    out: dict[str, list[str]] = {}
    for svc in services:
        meta, spec = svc.get("metadata", {}), svc.get("spec", {})
        ns, name = meta.get("namespace", ""), meta.get("name", "")
        ip = spec.get("clusterIP")
        if ip and ip != "None":
            addrs = [ip]
        else:
            addrs = sorted({a for eps in ready.get((ns, name), {}).values() for a, _ in eps})
        out[f"{name}.{ns}.svc.{DOMAIN}"] = [a for a in addrs if _ipv4(a)]  # A records only
    return out


def _ipv4(address: str) -> bool:
    try:
        return isinstance(ipaddress.ip_address(address), ipaddress.IPv4Address)
    except ValueError:
        return False


def resolv_conf(pod: dict) -> str | None:
    """A pod's ``/etc/resolv.conf`` as kubelet writes it for ``dnsPolicy: ClusterFirst`` (the default):
    the cluster DNS, searched in the pod's namespace first. None for any other policy (the node's own)."""
    policy = pod.get("spec", {}).get("dnsPolicy") or "ClusterFirst"
    if policy not in ("ClusterFirst", "ClusterFirstWithHostNet"):
        return None
    ns = pod.get("metadata", {}).get("namespace", "default")
    return f"search {ns}.svc.{DOMAIN} svc.{DOMAIN} {DOMAIN}\nnameserver {DNS_IP}\noptions ndots:5\n"


# ------------------------------------------------------------------------------------------- shell


class Services:
    """Services and EndpointSlices, listed and watched; the rules and names rewritten after a change."""

    def __init__(self, api: KubeClient) -> None:
        self.changed = asyncio.Event()
        registry = CollectorRegistry()  # the reflectors keep their series; nothing serves them here

        def metrics(kind: str) -> ReflectorMetrics:
            return ReflectorMetrics(registry, f"{kind}_", synced="listed", errors="errors", lists="lists")

        async def changed() -> None:
            self.changed.set()

        self.watched = {
            kind: ListWatch(metrics(kind), path, changed, watch_timeout_s=WATCH_S)
            for kind, path in (("services", "/api/v1/services"), ("endpointslices", SLICES))
        }
        for w in self.watched.values():
            w.client = api
        self.names: dict[str, list[str]] = {}
        self._applied: str | None = None

    async def apply_changes(self) -> None:
        while True:
            await self.changed.wait()
            self.changed.clear()
            services = list(self.watched["services"].objects.values())
            slices = list(self.watched["endpointslices"].objects.values())
            self.names = names(services, slices)
            wanted = rules(service_ports(services, slices))
            if wanted != self._applied:
                try:
                    await asyncio.to_thread(restore, wanted)
                    self._applied = wanted
                except subprocess.CalledProcessError as e:  # logged, and tried again shortly
                    log.error("iptables failed (%s): %s", e.returncode, (e.stderr or "").strip()[-500:])
                    self.changed.set()
                    await asyncio.sleep(1.0)
            await asyncio.sleep(0.05)  # a burst of events is one rewrite

    def lookup(self, name: str) -> list[str] | None:
        return self.names.get(name.rstrip("."))


def hook() -> None:
    """The node forwards (pods reach ClusterIPs through it) and has a route to the Service range (its own
    processes' connections need one before OUTPUT rewrites them); our chains, and the jumps into them
    from the built-in ones (made once: iptables-restore leaves built-in chains alone with --noflush)."""
    if not in_private_netns():  # never the host's own network
        raise RuntimeError("e2e.cluster.services runs only in the run's network namespace (netns.py)")
    with open("/proc/sys/net/ipv4/ip_forward", "w") as f:
        f.write("1")
    subprocess.run(["ip", "route", "replace", SERVICE_CIDR, "dev", BRIDGE], check=True)
    restore(rules(()))
    for table, parent, chain in (
        ("nat", "PREROUTING", CHAIN),
        ("nat", "OUTPUT", CHAIN),
        ("nat", "POSTROUTING", MASQ),
        ("filter", "OUTPUT", REJECT),
        ("filter", "FORWARD", REJECT),
    ):
        probe = ["iptables", "-w", "-t", table, "-C", parent, "-j", chain]
        if subprocess.run(probe, capture_output=True).returncode != 0:
            subprocess.run(["iptables", "-w", "-t", table, "-I", parent, "-j", chain], check=True)


def restore(text: str) -> None:
    existing = subprocess.run(
        ["iptables-save", "-t", "nat"], capture_output=True, text=True, check=True
    ).stdout
    argv = ["iptables-restore", "-w", "--noflush"]
    subprocess.run(argv, input=text, text=True, capture_output=True, check=True)
    for chain in stale_chains(existing, text):  # emptied by nothing: no longer referenced, so deletable
        subprocess.run(["iptables", "-w", "-t", "nat", "-F", chain], check=True)
        subprocess.run(["iptables", "-w", "-t", "nat", "-X", chain], check=True)


class _Dns(asyncio.DatagramProtocol):
    def __init__(self, lookup: Callable[[str], list[str] | None]) -> None:
        self.lookup = lookup
        self.transport: asyncio.DatagramTransport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def datagram_received(self, data: bytes, addr) -> None:
        reply = answer(data, self.lookup)
        if reply is not None and self.transport is not None:
            self.transport.sendto(reply, addr)


async def amain(a: argparse.Namespace) -> None:
    hook()
    async with await KubeClient.connect(a.kubeconfig, user_agent="routerfleet-service-proxy") as api:
        svc = Services(api)
        loop = asyncio.get_running_loop()
        transport, _ = await loop.create_datagram_endpoint(
            lambda: _Dns(svc.lookup), local_addr=(a.dns_ip, a.dns_port)
        )
        stop = asyncio.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        tasks = [asyncio.create_task(w.run()) for w in svc.watched.values()]
        tasks.append(asyncio.create_task(svc.apply_changes()))
        log.info("serving DNS on %s:%d; ClusterIPs routed", a.dns_ip, a.dns_port)
        stopping = asyncio.create_task(stop.wait())
        try:
            # A task that ends on its own has failed: exit, so the cluster's check_alive sees it.
            done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
            for t in done:
                if t is not stopping:
                    raise RuntimeError(f"a services task ended: {t.exception() or t.result()!r}")
        finally:
            stopping.cancel()
            for t in tasks:
                t.cancel()
            transport.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m e2e.cluster.services", description=__doc__.split("\n")[0])
    ap.add_argument(
        "--kubeconfig", required=True, help="a kubeconfig allowed to read Services and EndpointSlices"
    )
    ap.add_argument("--dns-ip", default=DNS_IP)
    ap.add_argument("--dns-port", type=int, default=DNS_PORT)
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(amain(a))
    return 0


if __name__ == "__main__":
    sys.exit(main())
