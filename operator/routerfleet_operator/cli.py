"""routerfleet-operator: the RouterFleet controller, and its offline dry runs.

routerfleet-operator run [--namespace NS]... [--peering NAME --priority N] [--liveness URL]
                         [--metrics-port PORT [--metrics-addr ADDR]]
    the controller (kopf, in-process): every namespace by default, or only the ones named; with
    --metrics-port, its Prometheus metrics at :PORT/metrics (metrics.py)
routerfleet-operator render -f fleet.yaml [--token T] [--namespace NS]
    print the manifests a RouterFleet renders to (YAML, one document each): a dry run
routerfleet-operator validate -f fleet.yaml
    the operator's own checks (the CRD's CEL rules run at the API server); exit 1 if invalid
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from pathlib import Path

import yaml

from .render import OperatorRef, render_all, revision_of
from .spec import Fleet, SpecError, validate


def _load(path: str, namespace: str | None) -> Fleet:
    text = sys.stdin.read() if path == "-" else Path(path).read_text()
    obj = yaml.safe_load(text)
    if namespace:
        obj.setdefault("metadata", {})["namespace"] = namespace
    obj.setdefault("metadata", {}).setdefault("uid", "00000000-0000-0000-0000-000000000000")
    return Fleet.parse(obj)


def _run(a: argparse.Namespace) -> int:
    import kopf

    from .handlers import connect

    if a.metrics_port is not None:
        from prometheus_client import start_http_server

        start_http_server(a.metrics_port, addr=a.metrics_addr)  # the default registry: METRICS
    kopf.configure(verbose=a.verbose)
    if a.peering is not None:
        from .peering import PeeringMissing, wait_for_peering

        async def wait() -> None:
            async with await connect() as kube:
                await wait_for_peering(kube, a.peering, a.namespace)

        try:
            asyncio.run(wait())
        except PeeringMissing as exc:
            print(f"routerfleet-operator: {exc}", file=sys.stderr)
            return 1
    kopf.run(
        clusterwide=not a.namespace,
        namespaces=a.namespace,
        standalone=a.peering is None,
        peering_name=a.peering,
        priority=a.priority,
        liveness_endpoint=a.liveness,
        memo=kopf.Memo(operator=OperatorRef(namespace=a.operator_namespace)),
    )
    return 0


def parser() -> argparse.ArgumentParser:
    """The CLI's parser (the chart's test parses the command its Deployment renders with it)."""
    ap = argparse.ArgumentParser(
        prog="routerfleet-operator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("render", help="print the manifests a RouterFleet renders to")
    r.add_argument("-f", "--file", required=True, help="a RouterFleet manifest (- for stdin)")
    r.add_argument("--token", default="dry-run-token", help="the fleet token to put in the Secret")
    r.add_argument("--namespace", help="override metadata.namespace")
    r.add_argument("--operator-namespace", default=OperatorRef().namespace)
    v = sub.add_parser("validate", help="the operator's checks of a RouterFleet")
    v.add_argument("-f", "--file", required=True)
    o = sub.add_parser("run", help="run the controller (kopf)")
    o.add_argument("-n", "--namespace", action="append", default=[], help="watch only NS (repeatable)")
    o.add_argument(
        "--peering",
        metavar="NAME",
        help="kopf peering object (a ClusterKopfPeering, or a KopfPeering per watched namespace) to "
        "coordinate replicas; without it the operator runs standalone",
    )
    o.add_argument("--priority", type=int, default=0, help="peering priority: give each replica its own")
    o.add_argument(
        "--liveness", metavar="URL", help="kopf's liveness endpoint, e.g. http://0.0.0.0:8080/healthz"
    )
    o.add_argument(
        "--operator-namespace",
        default=os.environ.get("POD_NAMESPACE") or OperatorRef().namespace,
        help="where the operator runs (the fleets' NetworkPolicy admits it to the internal port)",
    )
    o.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve the operator's Prometheus metrics at :PORT/metrics (default: off)",
    )
    o.add_argument("--metrics-addr", default="0.0.0.0", help="the metrics listener's address")
    o.add_argument("-v", "--verbose", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    a = parser().parse_args(argv)
    if a.cmd == "run":
        return _run(a)

    try:
        fleet = _load(a.file, getattr(a, "namespace", None))
    except (SpecError, OSError, yaml.YAMLError) as exc:
        print(f"routerfleet-operator: {exc}", file=sys.stderr)
        return 1
    problems = validate(fleet)
    if a.cmd == "validate" or problems:
        for p in problems:
            print(f"invalid: {p}", file=sys.stderr)
        if not problems:
            print(f"{fleet.namespace}/{fleet.name}: valid (revision {revision_of(fleet)})")
        return 1 if problems else 0
    if not a.token:
        print("routerfleet-operator: --token: must not be empty", file=sys.stderr)
        return 2
    manifests = render_all(fleet, a.token, operator=OperatorRef(namespace=a.operator_namespace))
    yaml.safe_dump_all(manifests, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
