"""The project's one Kubernetes API client, shared by the router's discovery, the operator and the e2e
node agent: ``client.py`` (requests, watches, objects by kind, ``ApiError``) and ``credentials.py``
(the kubernetes client's loaders: kubeconfig, exec plugins, in-cluster tokens)."""

from .client import APPLY, MERGE, STRATEGIC, ApiError, KubeClient, path, watch_events
from .credentials import default_namespace, load_configuration

__all__ = [
    "APPLY",
    "MERGE",
    "STRATEGIC",
    "ApiError",
    "KubeClient",
    "default_namespace",
    "load_configuration",
    "path",
    "watch_events",
]
