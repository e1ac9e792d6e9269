"""Snapshot columns as Python arrays, for tests that read or corrupt them (the core holds them)."""

from __future__ import annotations

from array import array

from router_runtime.kv.snapshot import Columns

NAMES = ("parent", "key", "ncar", "worker", "tiers", "hash")  # Columns.le()'s order
_TYPECODES = "qQHIBQ"


def arrays(columns) -> dict[str, array]:
    """``Columns`` or ``VettedColumns`` as arrays by name (the core's bytes are little-endian, as is
    every machine these tests run on)."""
    out = {}
    for name, code, raw in zip(NAMES, _TYPECODES, columns.le(), strict=True):
        out[name] = array(code)
        out[name].frombytes(raw)
    return out


def edited(columns: Columns, name: str, i: int, value: int) -> Columns:
    """The columns with one value of one column set, as a hostile or buggy producer would."""
    a = arrays(columns)
    a[name][i] = value
    return Columns.from_le(*(a[n].tobytes() for n in NAMES))
