"""Hardware topology: devices, directed link resources and named presets (torch-free)."""

from .presets import DEVICES, PRESETS, build_topology, describe_presets, get_topology, list_presets
from .topology import Device, Route, Topology, TopologyBuilder

__all__ = [
    "DEVICES",
    "PRESETS",
    "Device",
    "Route",
    "Topology",
    "TopologyBuilder",
    "build_topology",
    "describe_presets",
    "get_topology",
    "list_presets",
]
