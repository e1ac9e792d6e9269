"""A private network namespace for one test run, wired like a one-node cluster's host.

Everything of a run outside the pods (etcd, the control plane, the node agent, the tests) lives in one
netns with `lo` up and a bridge, `rf0`, holding the node's address 10.244.0.1/16 and the API server's
advertise address. Each pod gets a netns of its own from the node agent, joined to the bridge by a
veth pair (see node_agent.PodNetwork): pods get real, non-loopback IPs that EndpointSlice validation
accepts, their own loopback and ports (two pods may both listen on 0.0.0.0:8080), nothing leaves the
run's namespace, and parallel runs never clash on ports.
"""

from __future__ import annotations

import os
import shlex
import shutil
import sys

POD_CIDR = "10.244.0.0/16"
BRIDGE = "rf0"
NODE_IP = "10.244.0.1"  # the node's InternalIP and the pods' gateway, on the bridge
# The API server's advertise address (the `kubernetes` Service's endpoint, which pods reach it at):
# on the bridge too, kept out of the range pods get.
ADVERTISE_ADDRESS = "10.244.255.254"
# A bridge without an address of its own takes the lowest MAC among its ports and changes it as veths
# come and go (pods learn the node's address once and keep it until their neighbour entry ages out);
# Docker and the CNI bridge plugin pin it, and so does this. Locally administered: no real NIC has it.
BRIDGE_MAC = "02:52:46:00:00:01"
ENV_MARKER = "ROUTERFLEET_NETNS"  # holds the inode of the netns that was set up

# The run's network, as commands run inside the fresh netns: loopback, and the bridge with the node's
# addresses (a bridge without ports yet has no carrier; its addresses are local all the same).
SETUP_COMMANDS = (
    ("ip", "link", "set", "lo", "up"),
    ("ip", "link", "add", BRIDGE, "type", "bridge"),
    ("ip", "link", "set", BRIDGE, "address", BRIDGE_MAC),
    ("ip", "addr", "add", f"{NODE_IP}/16", "dev", BRIDGE),
    ("ip", "addr", "add", f"{ADVERTISE_ADDRESS}/32", "dev", BRIDGE),
    ("ip", "link", "set", BRIDGE, "up"),
)

_SETUP = (
    "set -e; "
    + "; ".join(shlex.join(c) for c in SETUP_COMMANDS)
    + '; export {env}="$(stat -L -c %i /proc/self/ns/net)"; exec "$@"'
)


def _netns_inode() -> str:
    return str(os.stat("/proc/self/ns/net").st_ino)


def in_private_netns() -> bool:
    """True when this process runs in the namespace that `unshare_command` prepared."""
    return os.environ.get(ENV_MARKER) == _netns_inode()


def unshare_command(argv: list[str]) -> list[str]:
    """`argv` wrapped so it runs in a fresh netns with lo up and the node's bridge (SETUP_COMMANDS).

    As root: `unshare --net`; otherwise `unshare --user --map-root-user --net`.
    """
    for tool in ("unshare", "ip", "stat"):
        if shutil.which(tool) is None:
            raise RuntimeError(f"'{tool}' not found on PATH (util-linux / iproute2 / coreutils)")
    ns = ["--net"] if os.geteuid() == 0 else ["--user", "--map-root-user", "--net"]
    script = _SETUP.format(env=ENV_MARKER)
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
