"""Structure figures for the refactor issue's notes: per plane, the longest function and class; the
private-attribute reaches across modules; run from the repository root: python .ci/structure.py"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOTS = (
    Path("router_runtime"),
    Path("routerfleet_fake_engine"),
    Path("routerfleet_kube"),
    Path("operator/routerfleet_operator"),
)


def plane(path: Path) -> str:
    for root in ROOTS:
        if path.is_relative_to(root):
            rest = path.relative_to(root).parts
            return f"{root.name}/{rest[0]}" if len(rest) > 1 else f"{root.name}/(top)"
    return str(path)


def main() -> None:
    longest_fn: dict[str, tuple[int, str]] = defaultdict(lambda: (0, ""))
    longest_cls: dict[str, tuple[int, str]] = defaultdict(lambda: (0, ""))
    reaches = 0
    where: dict[str, int] = defaultdict(int)
    for root in ROOTS:
        for path in sorted(root.rglob("*.py")):
            tree = ast.parse(path.read_text(), str(path))
            defined = {
                n.attr
                for n in ast.walk(tree)
                if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
            } | {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}
            p = plane(path)
            for n in ast.walk(tree):
                if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef):
                    size = n.end_lineno - n.lineno + 1
                    if size > longest_fn[p][0]:
                        longest_fn[p] = (size, f"{path.name}:{n.name}")
                elif isinstance(n, ast.ClassDef):
                    size = n.end_lineno - n.lineno + 1
                    if size > longest_cls[p][0]:
                        longest_cls[p] = (size, f"{path.name}:{n.name}")
                elif (
                    isinstance(n, ast.Attribute)
                    and n.attr.startswith("_")
                    and not n.attr.startswith("__")
                    and not (isinstance(n.value, ast.Name) and n.value.id in ("self", "cls"))
                    and n.attr not in defined
                ):
                    reaches += 1
                    where[p] += 1
    print("| plane | longest function (lines) | longest class (lines) |")
    print("|---|---|---|")
    for p in sorted(longest_fn.keys() | longest_cls.keys()):
        f, c = longest_fn[p], longest_cls[p]
        print(f"| {p} | {f[1]} ({f[0]}) | {c[1] or '-'} ({c[0]}) |")
    print(f"\nprivate-attribute reaches across modules: {reaches}", file=sys.stdout)
    print(", ".join(f"{p} {n}" for p, n in sorted(where.items(), key=lambda x: -x[1])))


if __name__ == "__main__":
    main()
