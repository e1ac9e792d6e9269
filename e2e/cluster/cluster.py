"""A real Kubernetes control plane as local processes: etcd, kube-apiserver, kube-controller-manager,
kube-scheduler. No node agent: pods stay Pending until something plays the kubelet.

Run it inside the private netns from `netns.py` (fixed ports; the node's bridge holds the API server's
advertise address, which pods reach it at).

    with Cluster(bin_dir, work_dir) as c:      # start() ... stop()
        os.environ["KUBECONFIG"] = str(c.kubeconfig)

Logs: <work_dir>/logs/<component>.log. PKI: <work_dir>/pki/. Kubeconfigs: <work_dir>/*.kubeconfig.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import json
import os
import signal
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from .netns import ADVERTISE_ADDRESS
from .pki import PKI, CertPair

SERVICE_CIDR = "10.96.0.0/16"
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"

CONTROLLERS = (
    "deployment-controller",
    "replicaset-controller",
    "endpointslice-controller",
    "garbage-collector-controller",
    "namespace-controller",
    "serviceaccount-controller",
    "serviceaccount-token-controller",
    "root-ca-certificate-publisher-controller",
    "clusterrole-aggregation-controller",
    "node-lifecycle-controller",
    "taint-eviction-controller",
    "pod-garbage-collector-controller",
    "disruption-controller",
    "job-controller",  # Helm charts run hooks as Jobs (Envoy Gateway's certgen)
    "ttl-after-finished-controller",
)

COMPONENTS = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler")


class ClusterError(RuntimeError):
    pass


def _pdeathsig() -> None:  # runs in the child before exec: die with the parent
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _kubeconfig(path: Path, server: str, ca: Path, user: str, pair: CertPair) -> Path:
    """Self-contained kubeconfig (certs embedded); JSON is valid YAML."""

    def b64(p: Path) -> str:
        return base64.b64encode(p.read_bytes()).decode()

    cfg = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [{"name": "e2e", "cluster": {"server": server, "certificate-authority-data": b64(ca)}}],
        "users": [
            {
                "name": user,
                "user": {"client-certificate-data": b64(pair.cert), "client-key-data": b64(pair.key)},
            }
        ],
        "contexts": [{"name": "e2e", "context": {"cluster": "e2e", "user": user, "namespace": "default"}}],
        "current-context": "e2e",
    }
    path.write_text(json.dumps(cfg, indent=2))
    path.chmod(0o600)
    return path


@dataclass
class Ports:
    etcd_client: int = 2379
    etcd_peer: int = 2380
    apiserver: int = 6443


@dataclass
class Cluster:
    bin_dir: Path
    work_dir: Path
    ports: Ports = field(default_factory=Ports)
    controllers: tuple[str, ...] = CONTROLLERS
    verbosity: int = 1
    start_timeout: float = 180.0

    def __post_init__(self) -> None:
        self.bin_dir = Path(self.bin_dir)
        self.work_dir = Path(self.work_dir).resolve()
        self.logs = self.work_dir / "logs"
        self.server = f"https://127.0.0.1:{self.ports.apiserver}"
        self.kubeconfig = self.work_dir / "admin.kubeconfig"
        self.pki: PKI | None = None
        self.procs: dict[str, subprocess.Popen] = {}
        self._log_files: list = []

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        missing = [c for c in (*COMPONENTS, "kubectl") if not (self.bin_dir / c).is_file()]
        if missing:
            raise ClusterError(f"{self.bin_dir} lacks {', '.join(missing)} (run e2e/kube/build.sh)")
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        try:
            self._write_pki()
            self._start_etcd()
            self._start_apiserver()
            self._start_controller_manager()
            self._start_scheduler()
            self._wait_default_serviceaccount()
        except BaseException:
            self.stop()
            raise

    def stop(self, grace: float = 10.0) -> None:
        """SIGTERM in reverse start order, SIGKILL whatever is left after `grace` seconds."""
        for name in reversed(list(self.procs)):
            p = self.procs[name]
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
                try:
                    p.wait(grace)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
        self.procs.clear()
        for f in self._log_files:
            f.close()
        self._log_files.clear()

    def check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                raise ClusterError(
                    f"{name} exited with {p.returncode}; last lines of {self.logs / (name + '.log')}:\n"
                    + _tail(self.logs / f"{name}.log")
                )

    # ---------------------------------------------------------------- helpers for callers

    def issue_client(self, name: str, cn: str, orgs: tuple[str, ...] = ()) -> Path:
        """A kubeconfig for identity CN=`cn`, O=`orgs` (e.g. a node: system:node:n1 / system:nodes)."""
        assert self.pki is not None
        pair = self.pki.issue(name, cn, orgs)
        return _kubeconfig(self.work_dir / f"{name}.kubeconfig", self.server, self.pki.ca_cert, cn, pair)

    def start_node_agent(self, node: str = "node-1", entrypoints: Mapping[str, str] = {}) -> subprocess.Popen:
        """Run e2e.cluster.node_agent as `node` (CN=system:node:<node>, O=system:nodes), and the node's
        Services (e2e.cluster.services as system:kube-proxy: ClusterIPs and the cluster DNS); both are
        stopped first by stop() and watched by check_alive(). Logs: <work_dir>/logs/node-agent.log and
        services.log."""
        proxier = self.issue_client("kube-proxy", "system:kube-proxy")
        self._spawn(
            "services",
            ["--kubeconfig", str(proxier)],
            argv0=[sys.executable, "-m", "e2e.cluster.services"],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )
        kubeconfig = self.issue_client(node, f"system:node:{node}", ("system:nodes",))
        return self._spawn(
            "node-agent",
            [
                *("--kubeconfig", str(kubeconfig), "--node", node, "--workdir", str(self.work_dir)),
                *(a for repo, binary in entrypoints.items() for a in ("--entrypoint", f"{repo}={binary}")),
            ],
            argv0=[sys.executable, "-m", "e2e.cluster.node_agent"],
            env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
        )

    def stop_apiserver(self) -> None:
        """Stop the API server (SIGTERM, as a control-plane upgrade would); ``start_apiserver`` brings it
        back. Its clients see refused connections meanwhile."""
        p = self.procs["kube-apiserver"]
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()

    def start_apiserver(self) -> None:
        """Start the API server again (``wait_apiserver`` waits for /readyz). Call it from a thread that
        outlives the cluster (the main one): a component dies with the thread that spawned it
        (PDEATHSIG)."""
        self._start_apiserver(wait=False)

    def kubectl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        return subprocess.run(
            [str(self.bin_dir / "kubectl"), "--kubeconfig", str(self.kubeconfig), *args],
            capture_output=True,
            text=True,
            check=check,
        )

    # ---------------------------------------------------------------- internals

    def _write_pki(self) -> None:
        pki = self.pki = PKI(self.work_dir / "pki")
        self._serving = pki.issue(
            "apiserver",
            "kube-apiserver",
            server=True,
            client=False,
            dns=(
                "localhost",
                "kubernetes",
                "kubernetes.default",
                "kubernetes.default.svc",
                "kubernetes.default.svc.cluster.local",
            ),
            ips=("127.0.0.1", SERVICE_IP, ADVERTISE_ADDRESS),
        )
        admin = pki.issue("admin", "e2e-admin", ("system:masters",))
        _kubeconfig(self.kubeconfig, self.server, pki.ca_cert, "e2e-admin", admin)
        self._kcm_kubeconfig = self.issue_client("kube-controller-manager", "system:kube-controller-manager")
        self._sched_kubeconfig = self.issue_client("kube-scheduler", "system:kube-scheduler")
        self._ssl = ssl.create_default_context(cafile=str(pki.ca_cert))
        self._ssl.load_cert_chain(str(admin.cert), str(admin.key))

    def _spawn(
        self, name: str, args: list[str], argv0: list[str] | None = None, env: dict[str, str] | None = None
    ) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "ab")  # noqa: SIM115 (closed in stop())
        self._log_files.append(log)
        log.write(f"# {' '.join([name, *args])}\n".encode())
        log.flush()
        p = subprocess.Popen(
            [*(argv0 or [str(self.bin_dir / name)]), *args],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.work_dir,
            start_new_session=True,
            preexec_fn=_pdeathsig,
            env=env,
        )
        self.procs[name] = p
        return p

    def _wait(self, what: str, probe, timeout: float | None = None) -> None:
        timeout = timeout or self.start_timeout
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                if probe():
                    return
            except (OSError, urllib.error.URLError, ValueError) as e:
                last = e
            time.sleep(0.25)
        raise ClusterError(f"timed out after {timeout:.0f}s waiting for {what} ({last})")

    def _get(self, url: str, ctx: ssl.SSLContext | None = None) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(url, timeout=5, context=ctx) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    def _start_etcd(self) -> None:
        c, p = self.ports.etcd_client, self.ports.etcd_peer
        self._spawn(
            "etcd",
            [
                "--name=e2e",
                f"--data-dir={self.work_dir / 'etcd'}",
                f"--listen-client-urls=http://127.0.0.1:{c}",
                f"--advertise-client-urls=http://127.0.0.1:{c}",
                f"--listen-peer-urls=http://127.0.0.1:{p}",
                f"--initial-advertise-peer-urls=http://127.0.0.1:{p}",
                f"--initial-cluster=e2e=http://127.0.0.1:{p}",
                "--unsafe-no-fsync=true",
                "--auto-compaction-retention=1",
                "--log-level=warn",
            ],
        )
        self._wait(
            "etcd /health",
            lambda: json.loads(self._get(f"http://127.0.0.1:{c}/health")[1]).get("health") == "true",
        )

    def _start_apiserver(self, wait: bool = True) -> None:
        pki = self.pki
        assert pki is not None
        self._spawn(
            "kube-apiserver",
            [
                f"--etcd-servers=http://127.0.0.1:{self.ports.etcd_client}",
                "--bind-address=0.0.0.0",  # the run's private netns: loopback, and the pods' bridge
                f"--secure-port={self.ports.apiserver}",
                f"--advertise-address={ADVERTISE_ADDRESS}",
                f"--cert-dir={self.work_dir / 'apiserver-certs'}",
                f"--tls-cert-file={self._serving.cert}",
                f"--tls-private-key-file={self._serving.key}",
                f"--client-ca-file={pki.ca_cert}",
                f"--service-account-issuer={SA_ISSUER}",
                f"--service-account-key-file={pki.sa_pub}",
                f"--service-account-signing-key-file={pki.sa_key}",
                f"--service-cluster-ip-range={SERVICE_CIDR}",
                "--authorization-mode=Node,RBAC",
                "--enable-admission-plugins=NodeRestriction",  # on top of the default set
                "--endpoint-reconciler-type=none",
                "--allow-privileged=true",
                "--enable-priority-and-fairness=false",
                "--profiling=false",
                f"--v={self.verbosity}",
            ],
        )
        if wait:
            self.wait_apiserver()

    def wait_apiserver(self) -> None:
        self._wait("kube-apiserver /readyz", lambda: self._get(f"{self.server}/readyz", self._ssl)[0] == 200)

    def _start_controller_manager(self) -> None:
        pki = self.pki
        assert pki is not None
        self._spawn(
            "kube-controller-manager",
            [
                f"--kubeconfig={self._kcm_kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                "--use-service-account-credentials=true",
                f"--root-ca-file={pki.ca_cert}",
                f"--service-account-private-key-file={pki.sa_key}",
                f"--controllers={','.join(self.controllers)}",
                "--node-monitor-period=5s",
                "--node-monitor-grace-period=40s",
                "--profiling=false",
                f"--v={self.verbosity}",
            ],
        )

    def _start_scheduler(self) -> None:
        self._spawn(
            "kube-scheduler",
            [
                f"--kubeconfig={self._sched_kubeconfig}",
                "--leader-elect=false",
                "--secure-port=0",
                f"--v={self.verbosity}",
            ],
        )

    def _wait_default_serviceaccount(self) -> None:
        url = f"{self.server}/api/v1/namespaces/default/serviceaccounts/default"
        self._wait(
            "the default ServiceAccount (kube-controller-manager up)",
            lambda: self._get(url, self._ssl)[0] == 200,
        )
