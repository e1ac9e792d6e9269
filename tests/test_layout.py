"""What the layout promises, checked on the sources: the router imports neither the fake engine nor
the operator, and its planes' imports point the way the design says."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def imported(package: str) -> dict[str, set[str]]:
    """module file -> the absolute top-level packages and router planes it imports."""
    out: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        rel = path.relative_to(ROOT)
        depth = len(rel.parts) - 1  # a module in router_runtime/proxy/ is at depth 2
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module is not None:
                if node.level:  # resolve ``..kv.index`` against the module's package
                    base = rel.parts[: depth - node.level + 1]
                    names.add(".".join((*base, node.module)))
                else:
                    names.add(node.module)
        out[str(rel)] = names
    return out


def test_the_router_imports_no_fake_engine_and_no_operator():
    for module, names in imported("router_runtime").items():
        bad = {n for n in names if n.split(".")[0] in ("routerfleet_fake_engine", "routerfleet_operator")}
        assert not bad, f"{module} imports {bad}"


def test_the_scheduling_and_fleet_planes_do_not_import_the_proxy():
    # The scheduler is called by any front door, and the fleet's load view feeds it: neither may depend
    # on the proxy (a type named only for annotations is allowed: TYPE_CHECKING imports are not run).
    for plane in ("router_runtime/scheduling", "router_runtime/fleet"):
        for module, names in imported(plane).items():
            source = (ROOT / module).read_text()
            bad = {n for n in names if n.startswith("router_runtime.proxy")}
            bad = {n for n in bad if f"    from ..proxy.{n.rsplit('.', 1)[-1]} import" not in source}
            assert not bad, f"{module} imports {bad}"
