"""Byte sizes as settings give them ("4GiB", "512MiB"), in plain Python: the settings
objects that check them (`EngineConfig`, the server's) load without torch."""


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
