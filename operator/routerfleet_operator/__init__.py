"""RouterFleet operator: the RouterFleet resource, rendered into a seed-gated router Deployment.

A functional core: ``spec`` parses and validates a RouterFleet, ``render`` turns it into the manifests
to apply (pure functions of the spec), and ``rollout.decide`` turns (fleet, pods, verdicts, status)
into actions and the next status. The kopf shell that reads the cluster and applies them is separate.

The package lives under ``operator/`` in the source tree but is never importable as ``operator`` (that
would shadow the standard library): it is ``routerfleet_operator``.
"""

__version__ = "0.1.0"
