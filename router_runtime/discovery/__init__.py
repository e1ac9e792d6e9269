"""Worker (engine) discovery: a static list, or Kubernetes EndpointSlices."""
