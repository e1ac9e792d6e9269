"""Command-line flags declared once: each a ``Flag`` naming the config field it sets, its kind (type,
unit, bounds) and its help; a parser derives the argparse option, its default and its help line from
that declaration. Bad values are argparse errors: one line naming the flag."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar


def _integer(text: str, lo: int | None) -> int:
    what = {None: "an integer", 0: "a non-negative integer", 1: "a positive integer"}.get(
        lo, f"an integer >= {lo}"
    )
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
    if lo is not None and v < lo:
        raise argparse.ArgumentTypeError(f"expected {what}, got {v}")
    return v


@dataclass(frozen=True, slots=True)
class Count:
    """An integer within ``lo..hi`` (None: unbounded), the config's value as it is."""

    metavar: ClassVar[str] = "N"
    lo: int | None = 1
    hi: int | None = None

    def parse(self, text: str) -> int:
        v = _integer(text, self.lo)
        if self.hi is not None and v > self.hi:
            raise argparse.ArgumentTypeError(f"expected {self.lo}..{self.hi}, got {v}")
        return v

    def to_config(self, v: Any) -> Any:
        return v

    def from_config(self, v: Any) -> Any:
        return v

    def show(self, default: Any) -> str:
        v = self.from_config(default)
        return f"{v:g}" if isinstance(v, float) else str(v)

    def add(self, group: Any, flag: Flag, default: Any) -> None:
        group.add_argument(
            flag.name,
            dest=flag.dest,
            type=self.parse,
            default=self.from_config(default),
            metavar=flag.metavar or self.metavar,
            help=flag.describe(self.show(default)),
        )


PORT = Count(1, 65535)


@dataclass(frozen=True, slots=True)
class Bytes(Count):
    """A size in bytes (the help shows whole MiB as such)."""

    metavar: ClassVar[str] = "BYTES"

    def show(self, default: Any) -> str:
        return f"{default >> 20} MiB" if default >= 1 << 20 and default % (1 << 20) == 0 else str(default)


@dataclass(frozen=True, slots=True)
class Ms(Count):
    """A duration: integer milliseconds within ``lo..hi`` on the command line, seconds in the config."""

    metavar: ClassVar[str] = "MS"

    def to_config(self, v: Any) -> float:
        return v / 1000

    def from_config(self, v: Any) -> int:
        return round(v * 1000)


@dataclass(frozen=True, slots=True)
class Real:
    """A finite number: at least ``lo``, or above it when ``strict``; at most ``hi``, if given."""

    metavar: ClassVar[str] = "X"
    lo: float = 0.0
    strict: bool = False
    hi: float | None = None

    def parse(self, text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(v) or v < self.lo or (self.strict and v == self.lo):
            raise argparse.ArgumentTypeError(
                f"expected {'>' if self.strict else '>='} {self.lo:g}, got {text}"
            )
        if self.hi is not None and v > self.hi:
            raise argparse.ArgumentTypeError(f"expected {self.lo:g}..{self.hi:g}, got {text}")
        return v

    def add(self, group: Any, flag: Flag, default: Any) -> None:
        group.add_argument(
            flag.name,
            dest=flag.dest,
            type=self.parse,
            default=default,
            metavar=flag.metavar or self.metavar,
            help=flag.describe(f"{default:g}"),
        )

    def to_config(self, v: Any) -> Any:
        return v


@dataclass(frozen=True, slots=True)
class Seconds(Real):
    """A duration in seconds, as the config holds it."""

    metavar: ClassVar[str] = "SECONDS"


@dataclass(frozen=True, slots=True)
class Text:
    """A string as given; ``parse`` (raising ValueError) vets it; ``many``: repeatable, a tuple (``unique``:
    repeats dropped); ``choices``: one of them."""

    parse: Callable[[str], Any] | None = None
    many: bool = False
    unique: bool = False
    choices: tuple | None = None

    def add(self, group: Any, flag: Flag, default: Any) -> None:
        # argparse would name the value after dest (a config path): name it after the flag instead
        metavar = flag.metavar or (None if self.choices else flag.name.lstrip("-").replace("-", "_").upper())
        kw: dict[str, Any] = {"dest": flag.dest, "metavar": metavar, "choices": self.choices}
        if self.parse is not None:
            kw["type"] = vetted(self.parse)
        if self.many:
            kw.update(action="append", default=[])
        else:
            kw["default"] = default
        group.add_argument(flag.name, help=flag.describe(None if self.many else default), **kw)

    def to_config(self, v: Any) -> Any:
        if not self.many:
            return v
        return tuple(dict.fromkeys(v)) if self.unique else tuple(v)


@dataclass(frozen=True, slots=True)
class Switch:
    """On or off: ``--X/--no-X`` (``negatable``), else a flag that turns the default over (``--X`` for a
    default off, ``--no-X`` for one on)."""

    negatable: bool = True

    def add(self, group: Any, flag: Flag, default: Any) -> None:
        if self.negatable:
            group.add_argument(
                flag.name,
                dest=flag.dest,
                action=argparse.BooleanOptionalAction,
                default=default,
                help=flag.describe("on" if default else "off"),
            )
        else:
            action = "store_false" if default else "store_true"
            group.add_argument(flag.name, dest=flag.dest, action=action, help=flag.help)

    def to_config(self, v: Any) -> Any:
        return v


def vetted(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """An argparse type from a parser that raises ValueError: argparse then names the flag."""

    def vet(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    vet.__name__ = getattr(parse, "__name__", "value")
    return vet


@dataclass(frozen=True, slots=True)
class Flag:
    name: str  # "--connect-timeout-ms"
    path: str  # the RouterConfig field it sets; "server.idle_timeout_s": a nested config's
    kind: Count | Real | Text | Switch
    help: str
    metavar: str | None = None
    default_text: str | None = None  # how the help names a default its value cannot say
    zero: str | None = None  # what 0 means, where it means something else than none

    @property
    def dest(self) -> str:
        return self.path.replace(".", "__")

    def describe(self, shown: Any) -> str:
        """The help line: what it does, then its default (and what 0 means, if anything)."""
        shown = self.default_text if self.default_text is not None else shown
        notes = [f"default {shown}"] if shown not in (None, "") else []
        if self.zero is not None:
            notes.append(f"0: {self.zero}")
        return f"{self.help} ({'; '.join(notes)})" if notes else self.help
