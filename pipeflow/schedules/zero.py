"""Owner-based optimizer sharding (ZeRO-style, as in AMDP): which device holds a stage's
optimizer state when the stage is replicated.

Each stage's optimizer state (fp32 gradients, master weights and moments) lives on one
owner device among the devices that hold a replica of the stage; the other replicas
send their gradients to the owner and receive the updated parameters. Owners are
spread so that every device owns as few stages as possible:

    for stage 0, 1, ..., S-1: among the devices holding a replica of the stage, the
    device that owns the fewest stages so far; ties go to the lowest device id.

For AMDP with d devices every device ends up owning exactly one stage of its mirror
group (so its optimizer memory drops from d/2 stages to one, i.e. to 2/d).
"""

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
