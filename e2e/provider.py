"""Where the end-to-end tests get their cluster: one small interface, two providers.

    provider = get_provider()          # $ROUTERFLEET_E2E_PROVIDER: "local" (default) or "kind"
    kubeconfig = provider.up()         # a cluster with one schedulable node, ready for pods
    provider.load_image(tag)           # make an image built here usable by the cluster's pods
    provider.container_log(ns, pod, c) # a container's output (None: ask the API server)
    provider.down(keep=False)

local: the real control plane of e2e/cluster plus the process node agent, in a private network
namespace; pods are processes (images are ignored), pod IPs 10.244.x.y are reachable from the tests.
kind: `kind create cluster`, `docker build`, `kind load docker-image`; pod IPs are not reachable from
the tests. kind and docker are not installed on the machines this project's CI runs on, so the kind
provider is written against kind's documented CLI and has not been run.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from e2e.entrypoints import entrypoints

ROOT = Path(__file__).resolve().parents[1]
ENV = "ROUTERFLEET_E2E_PROVIDER"
# Set by `python -m e2e.cluster run`: the work dir of a cluster that is already up (reused, not stopped).
WORKDIR_ENV = "ROUTERFLEET_E2E_WORKDIR"
IMAGE = "routerfleet:e2e"
NODE = "node-1"


class ProviderError(RuntimeError):
    pass


class Provider:
    name = "base"
    reaches_pod_ips = False  # can the test process connect to pod IPs directly?
    image = IMAGE  # what pod specs should name as their image

    def up(self) -> Path:
        raise NotImplementedError

    def down(self, keep: bool = False) -> None:
        raise NotImplementedError

    def build_image(self, tag: str = IMAGE) -> None:
        """Build the project's image (Dockerfile at the repository root) as `tag`."""

    def load_image(self, tag: str = IMAGE) -> None:
        """Make `tag` available to the cluster's nodes without a registry."""

    def container_log(self, namespace: str, pod: str, container: str) -> str | None:
        """The container's output, or None when the API server's pods/log serves it."""
        return None

    def describe(self) -> str:
        return self.name


def enter_private_netns() -> None:
    """Move this process (its main thread, and every process and thread it starts from now on) into a
    fresh network namespace with `lo` up and the node's bridge, like `e2e.cluster.netns` does by
    re-exec. Root only: unprivileged, a user namespace is needed, which a threaded process cannot enter.
    """
    from e2e.cluster.netns import ENV_MARKER, SETUP_COMMANDS

    if os.geteuid() != 0:
        raise ProviderError(
            "the local e2e cluster needs a private network namespace; as non-root start the tests with "
            "`python -m e2e.cluster pytest [PYTEST ARGS]` (user + network namespace)"
        )
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    if libc.unshare(0x40000000) != 0:  # CLONE_NEWNET
        raise ProviderError(f"unshare(CLONE_NEWNET): {os.strerror(ctypes.get_errno())}")
    for cmd in SETUP_COMMANDS:
        subprocess.run(cmd, check=True)
    os.environ[ENV_MARKER] = str(os.stat("/proc/self/ns/net").st_ino)


class LocalProvider(Provider):
    """The control plane of e2e/cluster and the process node agent as NODE, in a private netns."""

    name = "local"
    reaches_pod_ips = True

    def __init__(self, node: str = NODE):
        self.node = node
        self.cluster = None
        self.work_dir: Path | None = None
        self._owned = False

    def up(self) -> Path:
        from e2e.cluster import Cluster, in_private_netns, kube_bin_dir

        if os.environ.get(WORKDIR_ENV) and in_private_netns():  # `python -m e2e.cluster run --node-agent`
            self.work_dir = Path(os.environ[WORKDIR_ENV])
            return self.work_dir / "admin.kubeconfig"
        bin_dir = kube_bin_dir()  # may build, which needs the network: before entering the netns
        if not in_private_netns():
            enter_private_netns()
        self.work_dir = Path(tempfile.mkdtemp(prefix="routerfleet-e2e-"))
        self._owned = True
        self.cluster = Cluster(bin_dir, self.work_dir)
        self.cluster.start()
        self.cluster.start_node_agent(self.node, entrypoints())
        return self.cluster.kubeconfig

    def check_alive(self) -> None:
        if self.cluster is not None:
            self.cluster.check_alive()

    def down(self, keep: bool = False) -> None:
        if self.cluster is not None:
            self.cluster.stop()
            self.cluster = None
        if self._owned and self.work_dir and not keep:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def container_log(self, namespace: str, pod: str, container: str) -> str | None:
        assert self.work_dir is not None
        logs = sorted((self.work_dir / "pods").glob(f"{namespace}_{pod}_*/{container}.log"))
        return "".join(p.read_text(errors="replace") for p in logs) if logs else ""

    def describe(self) -> str:
        return f"local (work dir {self.work_dir}: logs/ has the components', pods/ the containers' output)"


class KindProvider(Provider):
    """A kind cluster (https://kind.sigs.k8s.io/docs/user/quick-start/). Settings from the environment:
    ROUTERFLEET_KIND_CLUSTER (name, default routerfleet-e2e; an existing cluster of that name is reused
    and kept), ROUTERFLEET_KIND_NODE_IMAGE (--image), ROUTERFLEET_KIND_CONFIG (--config),
    ROUTERFLEET_E2E_BASE_IMAGE (the Dockerfile's BASE_IMAGE build argument), ROUTERFLEET_E2E_IMAGE
    (the image tag; default routerfleet:e2e; `kind load` needs a tag other than :latest, or pods must
    say imagePullPolicy: IfNotPresent)."""

    name = "kind"

    def __init__(self):
        self.cluster_name = os.environ.get("ROUTERFLEET_KIND_CLUSTER", "routerfleet-e2e")
        self.image = os.environ.get("ROUTERFLEET_E2E_IMAGE", IMAGE)
        self.work_dir = Path(tempfile.mkdtemp(prefix="routerfleet-kind-"))
        self.kubeconfig = self.work_dir / "kubeconfig"
        self._created = False

    def _run(self, *cmd: str, capture: bool = False) -> str:
        if shutil.which(cmd[0]) is None:
            raise ProviderError(f"the kind provider needs '{cmd[0]}' on PATH")
        r = subprocess.run(cmd, stdout=subprocess.PIPE if capture else None, text=True)
        if r.returncode != 0:
            raise ProviderError(f"{' '.join(cmd)} exited with {r.returncode}")
        return r.stdout or ""

    def up(self) -> Path:
        existing = self._run("kind", "get", "clusters", capture=True).split()
        if self.cluster_name in existing:
            kc = self._run("kind", "get", "kubeconfig", "--name", self.cluster_name, capture=True)
            self.kubeconfig.write_text(kc)
        else:
            cmd = ["kind", "create", "cluster", "--name", self.cluster_name]
            cmd += ["--kubeconfig", str(self.kubeconfig), "--wait", "180s"]
            if img := os.environ.get("ROUTERFLEET_KIND_NODE_IMAGE"):
                cmd += ["--image", img]
            if cfg := os.environ.get("ROUTERFLEET_KIND_CONFIG"):
                cmd += ["--config", cfg]
            self._run(*cmd)
            self._created = True
        self.build_image(self.image)
        self.load_image(self.image)
        return self.kubeconfig

    def build_image(self, tag: str = IMAGE) -> None:
        cmd = ["docker", "build", "-t", tag, "-f", str(ROOT / "Dockerfile")]
        if base := os.environ.get("ROUTERFLEET_E2E_BASE_IMAGE"):
            cmd += ["--build-arg", f"BASE_IMAGE={base}"]
        self._run(*cmd, str(ROOT))

    def load_image(self, tag: str = IMAGE) -> None:
        self._run("kind", "load", "docker-image", tag, "--name", self.cluster_name)

    def down(self, keep: bool = False) -> None:
        if self._created and not keep:
            with contextlib.suppress(ProviderError):
                self._run(
                    "kind",
                    "delete",
                    "cluster",
                    "--name",
                    self.cluster_name,
                    "--kubeconfig",
                    str(self.kubeconfig),
                )
        if not keep:
            shutil.rmtree(self.work_dir, ignore_errors=True)

    def describe(self) -> str:
        return f"kind cluster {self.cluster_name!r} (kubeconfig {self.kubeconfig})"


PROVIDERS = {"local": LocalProvider, "kind": KindProvider}


def get_provider(name: str | None = None) -> Provider:
    name = name or os.environ.get(ENV) or "local"
    if name not in PROVIDERS:
        raise ProviderError(f"{ENV}={name!r}: choose one of {', '.join(PROVIDERS)}")
    return PROVIDERS[name]()
