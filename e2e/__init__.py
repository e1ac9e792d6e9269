"""End-to-end test infrastructure: a real Kubernetes control plane built from source (e2e/kube)
and run as local processes in a private network namespace (e2e/cluster)."""
