"""Owner-based optimizer sharding (ZeRO-style, as in AMDP): each replicated stage's optimizer
state lives on one owner among the devices holding a replica; the others send it their
gradients and receive the updated parameters. Stage by stage, the owner is the device
holding a replica that owns the fewest stages so far (ties: the lowest id)."""

from __future__ import annotations

from .ir import Placement


def zero_owners(placement: Placement) -> dict[int, int]:
    """Stage -> the device that owns its optimizer state (see the module docstring)."""
    owned = [0] * placement.num_devices
    owners: dict[int, int] = {}
    for stage in range(placement.num_stages):
        holders = sorted({dev for _, dev in placement.replicas(stage)})
        dev = min(holders, key=lambda d: (owned[d], d))
        owners[stage] = dev
        owned[dev] += 1
    return owners
