"""Durations and sizes as people write them (`30s`, `10m`, `44h`, `54d`; `140GB`, `1TB`) and back.

Decimal size units (1 GB = 10^9 bytes, as storage vendors and bandwidth figures use); binary ones
(GiB) are accepted too. A month is 730 hours (8760 h / 12). Every refusal is one ConfigError line
that names the value and shows valid examples.
"""

from __future__ import annotations

import math
import re
from typing import Callable

from ..errors import ConfigError

MONTH_S = 730 * 3600.0
DAY_S = 86400.0

DURATION_UNITS: dict[str, float] = {
    "ms": 1e-3,
    "s": 1.0, "sec": 1.0, "secs": 1.0, "second": 1.0, "seconds": 1.0,
    "m": 60.0, "min": 60.0, "mins": 60.0, "minute": 60.0, "minutes": 60.0,
    "h": 3600.0, "hr": 3600.0, "hrs": 3600.0, "hour": 3600.0, "hours": 3600.0,
    "d": DAY_S, "day": DAY_S, "days": DAY_S,
    "w": 7 * DAY_S, "week": 7 * DAY_S, "weeks": 7 * DAY_S,
    "mo": MONTH_S, "month": MONTH_S, "months": MONTH_S,
    "y": 8760 * 3600.0, "year": 8760 * 3600.0, "years": 8760 * 3600.0,
}

SIZE_UNITS: dict[str, float] = {
    "b": 1.0,
    "kb": 1e3, "mb": 1e6, "gb": 1e9, "tb": 1e12, "pb": 1e15,
    "kib": 2.0**10, "mib": 2.0**20, "gib": 2.0**30, "tib": 2.0**40, "pib": 2.0**50,
}

_NUMBER_UNIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def _split(text: str, what: str, examples: str) -> tuple[float, str]:
    match = _NUMBER_UNIT.match(str(text))
    if match is None:
        if str(text).strip().startswith("-"):
            raise ConfigError(f"{what} {text!r} is negative; give a positive value like {examples}")
        raise ConfigError(f"{what} {text!r} is not a number with a unit; write it like {examples}")
    value = float(match.group(1))
    if not math.isfinite(value):
        raise ConfigError(f"{what} {text!r} is not finite; write it like {examples}")
    return value, match.group(2).lower()


def parse_duration(text: str | float | int, *, what: str = "duration", allow_zero: bool = False) -> float:
    """`30s`, `10m`, `1.5h`, `54d`, `2w`, `1mo` (730 h) → seconds. A bare number means seconds."""
    return _parse_quantity(text, what=what, allow_zero=allow_zero, units=DURATION_UNITS, bare_unit="s",
                           examples="30s, 10m, 44h, 54d", valid="ms, s, m, h, d, w, mo, y")


def parse_size(text: str | float | int, *, what: str = "size", allow_zero: bool = False) -> float:
    """`140GB`, `1TB`, `512MiB` → bytes (decimal units unless the unit says `iB`). A bare number is bytes."""
    return _parse_quantity(text, what=what, allow_zero=allow_zero, units=SIZE_UNITS, bare_unit="b",
                           examples="140GB, 1TB, 512MiB", normalise=_size_unit,
                           valid="B, KB, MB, GB, TB, PB (decimal) or KiB, MiB, GiB, TiB (binary)")


def _size_unit(unit: str) -> str:
    if unit.endswith("ytes"):
        return unit[:-4] if len(unit) > 5 else "b"  # "bytes" → b, "gbytes" → gb
    return unit


def _parse_quantity(text: str | float | int, *, what: str, allow_zero: bool, units: dict[str, float],
                    bare_unit: str, examples: str, valid: str,
                    normalise: Callable[[str], str] | None = None) -> float:
    """One number with an optional unit from `units` → that number in base units, finite and >= 0."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), bare_unit
    else:
        value, unit = _split(str(text), what, examples)
    unit = unit or bare_unit
    if normalise is not None:
        unit = normalise(unit)
    if unit not in units:
        raise ConfigError(f"{what} {text!r}: unknown unit {unit!r}; valid: {valid}, e.g. {examples}")
    result = value * units[unit]
    if not math.isfinite(result):  # NaN given as a number, or a finite value that overflows with its unit
        raise ConfigError(f"{what} {text!r} is not a finite value; write it like {examples}")
    _check_sign(result, text, what, allow_zero, examples)
    return result


def _check_sign(value: float, text: object, what: str, allow_zero: bool, examples: str) -> None:
    if value < 0:
        raise ConfigError(f"{what} {text!r} is negative; give a positive value like {examples}")
    if value == 0 and not allow_zero:
        raise ConfigError(f"{what} {text!r} must be greater than zero (e.g. {examples})")


def format_duration(seconds: float | None) -> str:
    """Seconds → a short human string: `850ms`, `42.0s`, `12.5min`, `3.20h`, `54.0d`."""
    if seconds is None or (isinstance(seconds, float) and not math.isfinite(seconds)):
        return "—" if seconds is None else ("∞" if seconds > 0 else "-∞")
    sign = "-" if seconds < 0 else ""
    s = abs(seconds)
    if 0 < s < 1e-3:
        return f"{sign}{s * 1e6:.0f}µs"
    if s < 1:
        return f"{sign}{s * 1000:.0f}ms"
    if s < 120:
        return f"{sign}{s:.1f}s"
    if s < 2 * 3600:
        return f"{sign}{s / 60:.1f}min"
    if s < 3 * DAY_S:
        return f"{sign}{s / 3600:.2f}h"
    return f"{sign}{s / DAY_S:.1f}d"


def format_size(n_bytes: float | None) -> str:
    """Bytes → decimal units: `140.0GB`, `2.38TB`."""
    if n_bytes is None:
        return "—"
    value = float(n_bytes)
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(value) < 1000 or unit == "PB":
            return f"{value:.0f}{unit}" if unit == "B" else f"{value:.3g}{unit}"
        value /= 1000
    return f"{value:.3g}PB"  # pragma: no cover - loop always returns


def format_usd(amount: float | None) -> str:
    if amount is None:
        return "—"
    if abs(amount) >= 1e6:
        return f"${amount / 1e6:,.2f}M"
    return f"${amount:,.0f}" if abs(amount) >= 100 else f"${amount:,.2f}"


def format_pct(fraction: float | None) -> str:
    return "—" if fraction is None else f"{fraction * 100:.2f}%"
