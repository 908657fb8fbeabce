"""Quantities as people write and read them, in plain Python (no torch): byte sizes as
settings give them ("4GiB", "512MiB") and as the command shows them, and the positive
numbers the command's options take. The settings objects that check them (`EngineConfig`,
the server's) and the command's parsers load without the engine."""

import argparse


def parse_bytes(budget: int | str, what: str = "kv_budget") -> int:
    """4096, "4GiB", "512MiB", "1.5GB" -> bytes; `what` names the setting in errors."""
    if isinstance(budget, int) and not isinstance(budget, bool):
        value = budget
    elif isinstance(budget, str):
        units = {"gib": 1 << 30, "mib": 1 << 20, "kib": 1 << 10, "gb": 10**9, "mb": 10**6,
                 "kb": 10**3, "b": 1}
        text = budget.strip().lower().replace(" ", "")
        unit = next((u for u in units if text.endswith(u)), "b")
        try:
            value = int(float(text[: len(text) - len(unit)] if text.endswith(unit) else text)
                        * units[unit])
        except (ValueError, OverflowError):  # "lots", "inf", "nan"
            raise ValueError(f"{what} {budget!r}: not a size like 4GiB or 512MiB") from None
    else:
        raise ValueError(f"{what} must be a byte count or a size like '4GiB', got {budget!r}")
    if value <= 0:
        raise ValueError(f"{what} must be positive, got {budget!r}")
    return value


def format_bytes(n: float) -> str:
    """1536 -> '1.50 KiB'."""
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:,.2f} {unit}"
    return f"{n:,.0f} B"


def positive_int(text: str) -> int:
    """An argparse type: a count that must be above 0."""
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def positive_float(text: str) -> float:
    """An argparse type: a number that must be above 0."""
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value
