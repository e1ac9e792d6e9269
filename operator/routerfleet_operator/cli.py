"""routerfleet-operator: for now, the offline half.

    routerfleet-operator render -f fleet.yaml [--token T] [--namespace NS]
        print the manifests a RouterFleet renders to (YAML, one document each): a dry run
    routerfleet-operator validate -f fleet.yaml
        the operator's own checks (the CRD's CEL rules run at the API server); exit 1 if invalid

The controller itself (kopf handlers, server-side apply) is not in this version.
"""

from __future__ import annotations

import argparse
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


def main(argv: list[str] | None = None) -> int:
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
    a = ap.parse_args(argv)

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
    manifests = render_all(fleet, a.token, operator=OperatorRef(namespace=a.operator_namespace))
    yaml.safe_dump_all(manifests, sys.stdout, sort_keys=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
