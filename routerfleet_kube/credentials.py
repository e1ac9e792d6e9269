"""Where the API server is and who we are to it: the kubernetes client's own loaders, so kubeconfig
exec plugins, token files, client certificates and in-cluster token rotation work as they do for
kubectl; nothing here speaks HTTP."""

from __future__ import annotations

import contextlib
import os
import ssl

SA_NAMESPACE_FILE = "/var/run/secrets/kubernetes.io/serviceaccount/namespace"


def load_configuration(kubeconfig: str | None = None, context: str | None = None):
    """A ``kubernetes.client.Configuration``: the ``kubeconfig`` file if given, else $KUBECONFIG, else
    the in-cluster service account, else ~/.kube/config (controller-runtime's order). Raises
    ``kubernetes.config.ConfigException`` when none is usable. Reads files and may run an exec plugin:
    call it off the event loop."""
    from kubernetes import client, config

    cfg = client.Configuration()
    path = kubeconfig or os.environ.get("KUBECONFIG")
    if path:
        config.load_kube_config(
            config_file=path, context=context, client_configuration=cfg, persist_config=False
        )
    elif os.environ.get("KUBERNETES_SERVICE_HOST"):
        config.load_incluster_config(client_configuration=cfg)
    else:
        config.load_kube_config(context=context, client_configuration=cfg, persist_config=False)
    return cfg


def default_namespace(kubeconfig: str | None = None, context: str | None = None) -> str:
    """The namespace to use when none is given: $POD_NAMESPACE, else the service account's (in a pod),
    else the kubeconfig context's (``context``, or the current one), else "default"."""
    if ns := os.environ.get("POD_NAMESPACE", "").strip():
        return ns
    with contextlib.suppress(OSError), open(SA_NAMESPACE_FILE) as f:
        if ns := f.read().strip():
            return ns
    with contextlib.suppress(Exception):  # no kubeconfig: fine, "default"
        from kubernetes import config

        contexts, active = config.list_kube_config_contexts(kubeconfig or os.environ.get("KUBECONFIG"))
        chosen = next((c for c in contexts if c.get("name") == context), None) if context else active
        if ns := ((chosen or {}).get("context") or {}).get("namespace"):
            return ns
    return "default"


def ssl_context(cfg) -> ssl.SSLContext | None:
    """The TLS context ``cfg`` asks for (its CA, its client certificate, or no verification when the
    kubeconfig says insecure-skip-tls-verify); None for a plain-HTTP server."""
    if not cfg.host.startswith("https"):
        return None
    ctx = ssl.create_default_context(cafile=cfg.ssl_ca_cert or None)
    if cfg.cert_file:
        ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
    if not cfg.verify_ssl:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


def authorization(cfg) -> str | None:
    """The Authorization header's value ("Bearer <token>", or "Basic ..." for a kubeconfig user and
    password), None with client certificates alone. Runs the configuration's refresh hook, which may
    re-read a rotated token file or run an exec plugin: call it off the event loop."""
    return cfg.get_api_key_with_prefix("BearerToken", "authorization") or None
