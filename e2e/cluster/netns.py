"""A private network namespace for one test run.

Everything of a run (etcd, the control plane, the node agent, the pods, the tests) lives in one
netns with `lo` up and `ip route add local 10.244.0.0/16 dev lo`, so every 10.244.x.y is a local
address: pods get real, non-loopback IPs that EndpointSlice validation accepts, nothing leaves the
namespace, and parallel runs never clash on ports.
"""

from __future__ import annotations

import os
import shutil
import sys

POD_CIDR = "10.244.0.0/16"
ENV_MARKER = "ROUTERFLEET_NETNS"  # holds the inode of the netns that was set up

_SETUP = (
    "set -e; ip link set lo up; ip route add local {cidr} dev lo; "
    'export {env}="$(stat -L -c %i /proc/self/ns/net)"; exec "$@"'
)


def _netns_inode() -> str:
    return str(os.stat("/proc/self/ns/net").st_ino)


def in_private_netns() -> bool:
    """True when this process runs in the namespace that `unshare_command` prepared."""
    return os.environ.get(ENV_MARKER) == _netns_inode()


def unshare_command(argv: list[str]) -> list[str]:
    """`argv` wrapped so it runs in a fresh netns with lo up and the pod range routed locally.

    As root: `unshare --net`; otherwise `unshare --user --map-root-user --net`.
    """
    for tool in ("unshare", "ip", "stat"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"'{tool}' not found on PATH (util-linux / iproute2 / coreutils)")
    ns = ["--net"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--net"]
    script = _SETUP.format(cidr=POD_CIDR, env=ENV_MARKER)
    return ["unshare", *ns, "--", "sh", "-c", script, "routerfleet-netns", *argv]


def reexec_in_netns(argv: list[str] | None = None) -> None:
    """Replace this process with itself (or `argv`) inside a private netns; no-op if already in one.

    Default `argv` is the current Python command line (`sys.orig_argv`), so a `python -m ...`
    entry point can call this first thing.
    """
    if in_private_netns():
        return
    argv = argv if argv is not None else [sys.executable, *sys.orig_argv[1:]]
    cmd = unshare_command(argv)
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvp(cmd[0], cmd)
