"""How the report's numbers and column names read, on the page and the console (the CSV
files keep raw names and full precision): :data:`COLUMNS` names each column in words with
its unit; :func:`cell` rounds a value by what it is, bytes in binary units
(:func:`human_bytes`), never in exponent notation."""

from __future__ import annotations

from typing import Any

__all__ = ["COLUMNS", "header", "cell", "human_bytes", "significant", "percent"]

MIB = 2**20
_BYTE_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")

# column -> (words for a header, the kind of value: how it is rounded)
COLUMNS: dict[str, tuple[str, str]] = {
    "run": ("run folder", "text"),
    "label": ("configuration", "text"),
    "kind": ("kind", "text"),
    "status": ("status", "text"),
    "note": ("note", "text"),
    "schedule": ("schedule", "text"),
    "seed": ("seed", "id"),
    "stages": ("stages", "count"),
    "data_parallel": ("data parallel", "count"),
    "microbatches": ("microbatches", "count"),
    "steps": ("steps", "count"),
    "steps_planned": ("steps planned", "count"),
    "samples": ("samples", "count"),
    "updates": ("updates", "count"),
    "final_loss": ("final loss", "loss"),
    "best_loss": ("best loss", "loss"),
    "final_val_loss": ("final val. loss", "loss"),
    "best_val_loss": ("best val. loss", "loss"),
    "target_loss": ("target loss", "loss"),
    "steps_to_target": ("steps to target", "count"),
    "samples_to_target": ("samples to target", "count"),
    "time_to_target_s": ("time to target (s)", "time"),
    "tokens_per_s": ("tokens/s", "rate"),
    "step_time_s": ("step time (s)", "time"),
    "bubble": ("bubble", "fraction"),
    "peak_memory_mib": ("peak memory", "mib"),
    "peak_saved_mib": ("peak saved activations", "mib"),
    "max_staleness": ("max staleness (updates)", "count"),
    "max_mismatch": ("max version mismatch", "count"),
    "sim_step_time": ("simulated step time (s)", "time"),
    "sim_bubble": ("simulated bubble", "fraction"),
    "sim_peak_activation_mib": ("simulated peak activations", "mib"),
    "sim_cost": ("cost model", "text"),
    "sim_topology": ("topology", "text"),
    "sim_unpaired": ("no simulation paired", "text"),
    "sim_over_measured": ("simulated / measured", "ratio"),
    "sim_error": ("simulated vs measured", "signed"),
    "sim_tolerance": ("target", "tolerance"),
    "sim_flag": ("fidelity", "text"),
    "sim_run": ("simulated run", "text"),
    # configurations.csv
    "runs": ("runs", "count"),
    "finished": ("finished", "count"),
    "final_loss_mean": ("final loss", "loss"),
    "final_loss_std": ("final loss std. dev.", "loss"),
    "best_loss_mean": ("best loss", "loss"),
    "time_to_target_s_mean": ("time to target (s)", "time"),
    "samples_to_target_mean": ("samples to target", "count"),
    "tokens_per_s_mean": ("tokens/s", "rate"),
    "bubble_mean": ("bubble", "fraction"),
    "step_time_s_mean": ("step time (s)", "time"),
    "peak_memory_mib_max": ("peak memory (largest)", "mib"),
}


def header(column: str) -> str:
    """The column's name in words, with its unit."""
    return COLUMNS.get(column, (column.replace("_", " "), ""))[0]


def significant(value: float, digits: int = 3) -> str:
    """``value`` to ``digits`` significant digits, trailing zeros kept (0.140, 1.04,
    13.5); from 10**digits up, a whole number grouped by thousands (1,355)."""
    if value == 0:
        return "0"
    if abs(value) >= 10**digits:
        return f"{value:,.0f}"
    text = f"{value:#.{digits}g}"
    if "e" in text:  # below 1e-4: exponent notation is the readable form
        return f"{value:.{digits}g}"
    return text.rstrip(".")


def human_bytes(count: float | None, trim: bool = False) -> str:
    """A byte count in the largest binary unit below it, 3 significant digits (3604480 ->
    "3.44 MiB"); ``trim``: trailing zeros dropped ("5 MiB")."""
    if count is None:
        return ""
    value, unit = float(count), 0
    while abs(value) >= 1024 and unit < len(_BYTE_UNITS) - 1:
        value /= 1024
        unit += 1
    if unit == 0:
        return f"{value:,.0f} B"
    number = significant(value, 3)
    if trim and "." in number:
        number = number.rstrip("0").rstrip(".")
    return f"{number} {_BYTE_UNITS[unit]}"


def percent(fraction: float, sign: bool = True) -> str:
    """A fraction as a percentage to one decimal, ".0" left out: -0.23 -> "-23%",
    0.104 -> "+10.4%"."""
    text = f"{100 * fraction:{'+' if sign else ''}.1f}".removesuffix(".0")
    if text == "-0":  # a deviation that rounds to nothing is not negative
        text = "+0" if sign else "0"
    return text + "%"


def cell(value: Any, column: str) -> str:
    """``value`` of ``column`` as a person reads it; None is empty."""
    if value is None or value == "":
        return ""
    kind = COLUMNS.get(column, ("", ""))[1]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if kind == "time":
        return significant(value, 3)
    if kind == "loss":
        return significant(value, 4)
    if kind in ("count", "rate"):
        return f"{value:,.0f}"
    if kind == "id":
        return str(value)
    if kind == "fraction":  # one decimal always, so a column's numbers line up
        return f"{100 * value:.1f}%"
    if kind == "signed":
        return percent(value)
    if kind == "tolerance":
        return "±" + percent(value, sign=False)
    if kind == "mib":
        return human_bytes(value * MIB)
    if kind == "ratio":
        return significant(value, 3) + "×"
    return significant(value, 4) if isinstance(value, float) else str(value)
