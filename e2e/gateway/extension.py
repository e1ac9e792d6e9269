"""The Gateway API Inference Extension's own files, as the tests use them: the module pinned in
``extension/go.mod`` (e2e/gomod.py)."""

from __future__ import annotations

from pathlib import Path

from e2e import gomod

MODULE = "sigs.k8s.io/gateway-api-inference-extension"
HERE = Path(__file__).with_name("extension")


def module_dir() -> Path:
    return gomod.module_dir(MODULE, HERE)


def crd(name: str) -> Path:
    """One of the extension's CRDs, e.g. ``inference.networking.x-k8s.io_inferenceobjectives.yaml``."""
    path = module_dir() / "config" / "crd" / "bases" / name
    if not path.is_file():
        raise FileNotFoundError(path)
    return path
