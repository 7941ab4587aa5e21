"""Which device's code paths run: CUDA's where a tensor is on a GPU, and on CPU the ones
named here (``attention``, ``staging``, ``memory``, ``reads``: :data:`PATHS`) where
``runtime.cuda_paths`` or :func:`cuda_paths` asks, so CI runs their arithmetic
(docs/runtime.md, "CUDA's code paths on CPU"). Torch-free: a device is anything with a
``type`` or its name."""

from __future__ import annotations

import contextlib

PATHS = ("attention", "staging", "memory", "reads")

_emulated: frozenset = frozenset()


def check(paths) -> tuple[str, ...]:
    """``runtime.cuda_paths`` as a tuple of names (``all``: every one), or ValueError
    naming the key and the allowed values."""
    if paths is None:
        return ()
    names = [paths] if isinstance(paths, str) else list(paths)
    if "all" in names:
        return PATHS
    bad = [n for n in names if n not in PATHS]
    if bad:
        raise ValueError(f"runtime.cuda_paths={bad[0]}: allowed values: {', '.join(PATHS)}, all")
    return tuple(n for n in PATHS if n in names)


def emulate(paths) -> None:
    """Take CUDA's ``paths`` on CPU from now on, in this process (a rank at its start)."""
    global _emulated
    _emulated = frozenset(check(paths))


@contextlib.contextmanager
def cuda_paths(*paths: str):
    """Take CUDA's ``paths`` (all where none is named) on CPU inside the block."""
    global _emulated
    was = _emulated
    _emulated = frozenset(check(paths or "all"))
    try:
        yield
    finally:
        _emulated = was


def cuda_path(name: str, device) -> bool:
    """The CUDA branch ``name`` runs for ``device``: it is a GPU, or CUDA's path is emulated here."""
    kind = device if isinstance(device, str) else getattr(device, "type", None)
    return kind == "cuda" or name in _emulated


def emulated() -> tuple[str, ...]:
    """The paths taken on CPU as CUDA takes them, here and now."""
    return tuple(n for n in PATHS if n in _emulated)
