"""A real Kubernetes control plane for tests; see cluster.py, netns.py and `python -m e2e.cluster -h`."""

from .binaries import kube_bin_dir
from .cluster import ADVERTISE_ADDRESS, SERVICE_CIDR, Cluster, ClusterError, Ports
from .netns import POD_CIDR, in_private_netns, reexec_in_netns, unshare_command
from .pki import PKI

__all__ = [
    "ADVERTISE_ADDRESS",
    "PKI",
    "POD_CIDR",
    "SERVICE_CIDR",
    "Cluster",
    "ClusterError",
    "Ports",
    "in_private_netns",
    "kube_bin_dir",
    "reexec_in_netns",
    "unshare_command",
]
