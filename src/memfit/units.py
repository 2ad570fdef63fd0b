"""Byte sizes as people write them ("24GiB", "80GB", 1234) and as memfit prints them; step times as it prints them."""
from __future__ import annotations

import math
import re

from memfit.errors import ConfigError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,  # bare letters follow nvidia-smi / torch (binary)
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | float | str) -> int:
    """Return a size in bytes. Decimal (GB) and binary (GiB) units are kept distinct on purpose:
    GPU vendors quote decimal GB for some cards and binary for others, and 7% matters here."""
    if isinstance(value, bool):
        raise ConfigError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"a size cannot be negative: {value!r}")
        return int(value)
    m = _SIZE.match(str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"malformed size {value!r}: use bytes or a unit, e.g. 24GiB, 80GB, 512MiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def fmt_bytes(n: float) -> str:
    """Binary units, three significant figures: what torch.cuda.memory_summary and nvidia-smi use. Never an
    exponent: from 1000 of a unit on, the next unit is used (0.977 GiB), and past EiB digits are grouped."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    if round(n) < 1000:
        return f"{sign}{n:.0f} B"
    for unit in ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        n /= 1024
        if round(n) < 1000 or unit == "EiB":
            return f"{sign}{fmt_number(n)} {unit}"


def fmt_number(x: float, digits: int = 3) -> str:
    """`digits` significant figures as `g` gives them, but never an exponent and with thousands grouped:
    262,000 and 0.0000123 where `g` prints 2.62e+05 and 1.23e-05. Rates such as samples/s print through this."""
    if not math.isfinite(x) or x == 0:
        return f"{x:g}"
    decimals = digits - 1 - math.floor(math.log10(abs(x)))
    x = round(x, decimals)
    if x and digits - 1 - math.floor(math.log10(abs(x))) < decimals:  # rounding carried: 999.7 -> 1,000
        decimals -= 1
    text = f"{x:,.{max(decimals, 0)}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text


def fmt_seconds(seconds: float, largest: float | None = None) -> str:
    """Three significant figures, whole units never rounded away, in the unit of `largest` (default: `seconds`
    itself): seconds from 1 s on, milliseconds below. The step times of one output pass the same `largest`, so
    a reader never compares "8744.1 ms" with "34.6 s"."""
    in_seconds = (seconds if largest is None else largest) >= 0.9995  # 999.96 ms reads "1 s", not "1,000 ms"
    value, unit = (seconds, "s") if in_seconds else (seconds * 1e3, "ms")
    return f"{fmt_number(value, max(3, len(str(int(abs(value))))))} {unit}"
