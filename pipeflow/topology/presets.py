"""Named hardware presets: ``topology=<name>`` in the configs resolves here.

Figures are datasheet numbers (dense 16-bit FLOP/s, HBM size and bandwidth, link rates per
direction, bytes/s); latencies (s) are typical NCCL/gloo point-to-point figures, end to end
for one hop (each of a hop's two port resources carries half). Every preset parameter is a
config key (``topology.nic_bandwidth=12.5e9``)."""

from __future__ import annotations

import dataclasses
import inspect
import json
import math
from typing import Callable, Mapping
from pathlib import Path

from .topology import Device, Topology, TopologyBuilder

GiB = 2**30
MiB = 2**20

# What torch's math libraries keep per process for a training step (Device.workspace_bytes):
# a cuBLAS workspace for each of the two threads that run products (the rank's own and
# autograd's device thread), 32 MiB each on Hopper by torch's default
# (CUBLAS_WORKSPACE_CONFIG unset; 4096 KiB x 2 + 16 KiB x 8 on older GPUs), and 1 MiB the
# first product with a bias keeps. Measured on an H100 (torch 2.11,
# `python -m benchmarks.gpu_workspace`): 32 + 1 after the first forward's products, 32
# more at the first backward, 65 MiB in all; pipelined ranks there held 65.0 MiB beside
# what their step allocates (docs/runtime.md, the GPU table).
_HOPPER_WORKSPACE = 2 * 32 * MiB + 1 * MiB
_AMPERE_WORKSPACE = 2 * (8 * MiB + 128 * 1024) + 1 * MiB  # torch's default, not measured here

PROFILES = Path(__file__).parent / "profiles"  # the device profiles the presets ship

# Dense FLOP/s at the 16-bit training dtype, memory and memory bandwidth, from the vendors' datasheets.
DEVICES: dict[str, Device] = {
    # NVIDIA A100 80GB SXM: 312 TFLOPS bf16 dense (156 TF32), 80 GB HBM2e at 2,039 GB/s
    "a100-80g": Device("a100-80g", 312e12, 80 * GiB, 2.039e12, fp32_flops=156e12, workspace_bytes=_AMPERE_WORKSPACE),
    # NVIDIA A100 80GB PCIe: same tensor cores, 1,935 GB/s HBM2e
    "a100-80g-pcie": Device("a100-80g-pcie", 312e12, 80 * GiB, 1.935e12, fp32_flops=156e12,
                            workspace_bytes=_AMPERE_WORKSPACE),
    # NVIDIA V100 32GB SXM2: 125 TFLOPS fp16 tensor (15.7 fp32, no TF32), 900 GB/s HBM2
    "v100-32g": Device("v100-32g", 125e12, 32 * GiB, 900e9, fp32_flops=15.7e12, workspace_bytes=_AMPERE_WORKSPACE),
    # NVIDIA H100 80GB SXM: 989 TFLOPS bf16 dense (495 TF32), 3.35 TB/s HBM3
    "h100-80g": Device("h100-80g", 989e12, 80 * GiB, 3.35e12, fp32_flops=495e12, workspace_bytes=_HOPPER_WORKSPACE),
    # NVIDIA H200 SXM: the H100's 989 TFLOPS bf16 dense (495 TF32), 141 GB HBM3e at 4.8 TB/s;
    # its operators priced as measured on one (profiles/h200.json: the sweep of 2026-12-04)
    "h200": Device("h200", 989e12, 141e9, 4.8e12, fp32_flops=495e12, workspace_bytes=_HOPPER_WORKSPACE,
                   profile=str(PROFILES / "h200.json")),
    # one CPU rank of a laptop/workstation: a few cores of AVX2 FMA; a share of DDR bandwidth
    "cpu": Device("cpu", 1e11, 8 * GiB, 2e10),
}


# ---------------------------------------------------------------- validation


def _number(key: str, value, minimum: float = 0.0, strict: bool = True) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    ok = ok and (value > minimum if strict else value >= minimum)
    if not ok:
        rel = ">" if strict else ">="
        raise ValueError(f"topology.{key}={value!r}: must be a number {rel} {minimum}")
    return float(value)


def _count(key: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"topology.{key}={value!r}: must be a whole number >= {minimum}")
    return value


def _device(key: str, name, profile: str | None = None) -> Device:
    """The preset device ``name``, priced by the operator sweep ``profile`` where given
    (``python -m pipeflow.measure_device --out FILE``); ValueError where the sweep was
    measured on the other kind of device (a CPU's for a GPU, or the reverse)."""
    if name not in DEVICES:
        raise ValueError(f"topology.{key}={name!r}: unknown device; allowed values: {', '.join(DEVICES)}")
    path = _profile_path(profile)
    if path:
        _check_kind(profile, path, name, f"topology.{key}={name} is {'a CPU' if name == 'cpu' else 'a GPU'}")
    return dataclasses.replace(DEVICES[name], profile=path) if path else DEVICES[name]


def _profile_path(profile) -> str:
    """topology.device_profile as an absolute path ("" for none), refused where no file is."""
    if profile is None or profile == "":
        return ""
    if not isinstance(profile, str) or not Path(profile).is_file():
        raise ValueError(f"topology.device_profile={profile!r}: no such file; make one on the machine with "
                         f"python -m pipeflow.measure_device --out FILE, or leave it null")
    return str(Path(profile).resolve())


_MEASURED: dict[tuple, tuple[str, str] | None] = {}


def measured_on(path: str | Path) -> tuple[str, str] | None:
    """What the sweep in ``path`` was measured on: ("cpu", the processor) or ("gpu", the GPU's
    name); None where the file does not say."""
    p = Path(path)
    try:
        stat = p.stat()
        key = (str(p.resolve()), stat.st_mtime_ns, stat.st_size)
        if key not in _MEASURED:
            doc = json.loads(p.read_text())
            device = doc.get("device") if isinstance(doc, dict) else None
            if device == "cpu":
                _MEASURED[key] = ("cpu", str((doc.get("host") or {}).get("processor") or "a CPU"))
            else:
                _MEASURED[key] = ("gpu", str(doc.get("gpu") or "a GPU")) if device == "cuda" else None
        return _MEASURED[key]
    except (OSError, ValueError, AttributeError):
        return None


def _check_kind(profile: str, path: str, device: str, named: str) -> None:
    """ValueError, naming both, where a profile measured on a CPU prices a GPU preset or the
    reverse (``named``: "topology.device=h200 is a GPU")."""
    measured = measured_on(path)
    kind = "cpu" if device == "cpu" else "gpu"
    if measured is None or measured[0] == kind:
        return
    other = "python -m pipeflow.measure_device --device cuda --out FILE on the GPU" if kind == "gpu" else \
        "python -m pipeflow.measure_device --device cpu --threads 1 --out FILE"
    raise ValueError(f"topology.device_profile={profile}: measured on {'a CPU' if measured[0] == 'cpu' else 'a GPU'} "
                     f"({measured[1]}), and {named}: a profile prices "
                     f"the kind of device it was measured on; give one measured there ({other}), or leave "
                     f"topology.device_profile null")


def profile_note(devices) -> str | None:
    """The line that says a GPU profile prices another GPU preset (an H100's sweep for an
    A100), or None where each device's profile is its own."""
    for dev in devices:
        if not dev.profile or dev.name == "cpu":
            continue
        measured = measured_on(dev.profile)
        model = dev.name.split("-")[0]  # a100, h100, h200, v100
        if measured is not None and measured[0] == "gpu" and model not in measured[1].lower().replace(" ", ""):
            return (f"topology.device_profile={dev.profile} was measured on {measured[1]} and prices "
                    f"topology.device={dev.name}'s operators; its memory and links stay {dev.name}'s")
    return None


# ------------------------------------------------------------- wiring recipes


def _switched_nodes(
    name: str,
    nodes: list[tuple[Device, int, str, float, float, bool]],
    nic_kind: str,
    nic_bandwidth: float,
    nic_latency: float,
    nics_per_node: list[int],
) -> Topology:
    """Nodes of GPUs with a fast fabric inside and NICs between nodes.

    ``nodes``: (device, count, link kind, per-GPU bandwidth per direction, hop latency, mesh)
    per node. ``mesh=False`` is a switch (one egress and one ingress port per GPU);
    ``mesh=True`` an all-to-all NVLink mesh (the GPU's links split among its peers). Between
    nodes a transfer leaves by the source GPU's NIC and enters by the destination's (fewer
    NICs than GPUs: the GPUs share them)."""
    devices: list[Device] = []
    node_gpus: list[list[int]] = []
    for n, (dev, count, *_rest) in enumerate(nodes):
        node_gpus.append(list(range(len(devices), len(devices) + count)))
        on_node = dataclasses.replace(dev, node=n)
        devices.extend([on_node] * count)
    b = TopologyBuilder(name, devices)
    one_nic_per_gpu = all(k == len(g) for k, g in zip(nics_per_node, node_gpus))

    nic_of: dict[int, tuple[int, int]] = {}  # gpu -> (egress, ingress) NIC resources
    if len(nodes) > 1:
        for n, gpus in enumerate(node_gpus):
            k = nics_per_node[n]
            ports = []
            for i in range(k):
                label = str(gpus[i]) if one_nic_per_gpu else (f"node{n}" if k == 1 else f"node{n}.{i}")
                ports.append(
                    (
                        b.resource(f"{nic_kind}-out[{label}]", nic_bandwidth, nic_latency / 2),
                        b.resource(f"{nic_kind}-in[{label}]", nic_bandwidth, nic_latency / 2),
                    )
                )
            for j, g in enumerate(gpus):
                nic_of[g] = ports[j * k // len(gpus)]

    for n, (dev, count, kind, bw, lat, mesh) in enumerate(nodes):
        gpus = node_gpus[n]
        if mesh:
            peers = max(1, count - 1)
            for s in gpus:
                for t in gpus:
                    if s != t:
                        b.path(s, t, [b.resource(f"{kind}[{s}->{t}]", bw / peers, lat)])
        else:
            out = {g: b.resource(f"{kind}-out[{g}]", bw, lat / 2) for g in gpus}
            inn = {g: b.resource(f"{kind}-in[{g}]", bw, lat / 2) for g in gpus}
            for s in gpus:
                for t in gpus:
                    if s != t:
                        b.path(s, t, [out[s], inn[t]])
    for s in range(len(devices)):
        for t in range(len(devices)):
            if devices[s].node != devices[t].node:
                b.path(s, t, [nic_of[s][0], nic_of[t][1]])
    return b.build()


# ------------------------------------------------------------------- presets


def local_cpu(
    num_devices: int = 2,
    bandwidth: float = 5e9,
    latency: float = 30e-6,
    peak_flops: float = 1e11,
    memory_bytes: float = 8 * GiB,
    memory_bandwidth: float = 2e10,
    cores: int | None = None,
    contention: float = 1.0,
    message_host: float = 0.0,
    collective_bandwidth: float | None = None,
    device_profile: str | None = None,
) -> Topology:
    """N CPU ranks on one host, gloo over shared memory / loopback.

    ``cores``: the host's cores the ranks share (None: a core each); ``contention``: each
    rank's speed when every core is busy; ``message_host``: the host seconds a message costs
    its sender and receiver; ``collective_bandwidth``: the most bytes/s an all-reduce reaches
    (None: the loopback's). ``pipeflow.runtime.calibration_run`` measures these.
    ``device_profile``: an operator sweep of this CPU (``python -m pipeflow.measure_device
    --device cpu --threads 1 --out FILE``) that prices actions under ``cost=analytic``."""
    n = _count("num_devices", num_devices)
    bw = _number("bandwidth", bandwidth)
    lat = _number("latency", latency, strict=False)
    profile = _profile_path(device_profile)
    if profile:
        _check_kind(device_profile, profile, "cpu", "topology=local_cpu's ranks are CPUs")
    dev = Device(
        "cpu",
        _number("peak_flops", peak_flops),
        _number("memory_bytes", memory_bytes),
        _number("memory_bandwidth", memory_bandwidth, strict=False),
        profile=profile,
    )
    b = TopologyBuilder("local_cpu", [dev] * n)
    out = [b.resource(f"loopback-out[{i}]", bw, lat / 2) for i in range(n)]
    inn = [b.resource(f"loopback-in[{i}]", bw, lat / 2) for i in range(n)]
    for s in range(n):
        for t in range(n):
            if s != t:
                b.path(s, t, [out[s], inn[t]])
    if cores is not None:
        cores = _count("cores", cores)
    return b.build(cores=cores, contention=_number("contention", contention),
                   message_host=_number("message_host", message_host, strict=False),
                   collective_bandwidth=None if collective_bandwidth is None
                   else _number("collective_bandwidth", collective_bandwidth))


def cluster(
    nodes: int = 2,
    gpus_per_node: int = 8,
    device: str = "a100-80g",
    nvlink_bandwidth: float = 300e9,
    nvlink_latency: float = 5e-6,
    nic_bandwidth: float = 25e9,
    nic_latency: float = 10e-6,
    nics_per_node: int | None = None,
    device_profile: str | None = None,
) -> Topology:
    """``nodes`` DGX-A100-like nodes: NVSwitch inside (300 GB/s), HDR InfiniBand between (25 GB/s).

    ``nics_per_node`` < ``gpus_per_node`` makes GPUs share NICs. ``device_profile``: an
    operator sweep measured on the GPU (``python -m pipeflow.measure_device --out FILE``)
    that prices each operator in place of peak FLOP/s at ``cost.efficiency``."""
    return _cluster(
        "cluster",
        nodes,
        gpus_per_node,
        device,
        nvlink_bandwidth,
        nvlink_latency,
        nic_bandwidth,
        nic_latency,
        nics_per_node,
        device_profile,
    )


def _cluster(
    name: str,
    nodes: int,
    gpus_per_node: int,
    device: str,
    nvlink_bandwidth: float,
    nvlink_latency: float,
    nic_bandwidth: float,
    nic_latency: float,
    nics_per_node: int | None = None,
    device_profile: str | None = None,
) -> Topology:
    """The cluster recipe under a preset's own name (dgx_a100_8, two_node_ib reuse it)."""
    nodes = _count("nodes", nodes)
    gpn = _count("gpus_per_node", gpus_per_node)
    nics = gpn if nics_per_node is None else _count("nics_per_node", nics_per_node)
    if nics > gpn:
        raise ValueError(
            f"topology.nics_per_node={nics}: at most one NIC per GPU is modelled (topology.gpus_per_node={gpn})"
        )
    dev = _device("device", device, device_profile)
    bw = _number("nvlink_bandwidth", nvlink_bandwidth)
    lat = _number("nvlink_latency", nvlink_latency, strict=False)
    return _switched_nodes(
        name,
        [(dev, gpn, "nvlink", bw, lat, False)] * nodes,
        "ib",
        _number("nic_bandwidth", nic_bandwidth),
        _number("nic_latency", nic_latency, strict=False),
        [nics] * nodes,
    )


def dgx_a100_8(nvlink_bandwidth: float = 300e9, nvlink_latency: float = 5e-6) -> Topology:
    """One DGX A100: 8 x A100-80GB SXM on NVSwitch (300 GB/s per direction per GPU)."""
    return _cluster("dgx_a100_8", 1, 8, "a100-80g", nvlink_bandwidth, nvlink_latency, 25e9, 10e-6)


def two_node_ib(
    nvlink_bandwidth: float = 300e9,
    nvlink_latency: float = 5e-6,
    nic_bandwidth: float = 25e9,
    nic_latency: float = 10e-6,
) -> Topology:
    """Two DGX A100 nodes, one 200 Gb/s HDR InfiniBand NIC per GPU between them."""
    return _cluster("two_node_ib", 2, 8, "a100-80g", nvlink_bandwidth, nvlink_latency, nic_bandwidth, nic_latency)


def pcie_8(
    switches: int = 2,
    gpus_per_switch: int = 4,
    device: str = "a100-80g-pcie",
    pcie_bandwidth: float = 25e9,
    pcie_latency: float = 10e-6,
    uplink_bandwidth: float = 12e9,
    uplink_latency: float = 10e-6,
) -> Topology:
    """8 PCIe GPUs behind two PCIe Gen4 switches of 4, no NVLink.

    Gen4 x16: about 25 GB/s per direction per GPU in practice; across switches traffic climbs
    through the host at about half that, one shared uplink per switch and direction."""
    return _pcie_box("pcie_8", switches, gpus_per_switch, device, pcie_bandwidth, pcie_latency, uplink_bandwidth,
                     uplink_latency)


def _pcie_box(name: str, switches, gpus_per_switch, device, pcie_bandwidth, pcie_latency, uplink_bandwidth,
              uplink_latency, bridge: tuple[float, float] | None = None) -> Topology:
    """GPUs behind PCIe switches, one shared uplink per switch; ``bridge``: (bandwidth,
    latency) of an NVLink bridge joining each pair of neighbouring GPUs (0-1, 2-3, ...)."""
    sw = _count("switches", switches)
    gps = _count("gpus_per_switch", gpus_per_switch)
    if bridge is not None and gps % 2:
        raise ValueError(f"gpus_per_switch={gps}: NVLink bridges join pairs, so it must be even")
    dev = _device("device", device)
    bw = _number("pcie_bandwidth", pcie_bandwidth)
    lat = _number("pcie_latency", pcie_latency, strict=False)
    ubw = _number("uplink_bandwidth", uplink_bandwidth)
    ulat = _number("uplink_latency", uplink_latency, strict=False)
    n = sw * gps
    b = TopologyBuilder(name, [dev] * n)
    pair = [b.resource(f"nvlink-bridge[{g}->{g ^ 1}]", *bridge) for g in range(n)] if bridge else []
    out = [b.resource(f"pcie-out[{g}]", bw, lat / 2) for g in range(n)]
    inn = [b.resource(f"pcie-in[{g}]", bw, lat / 2) for g in range(n)]
    up_out = [b.resource(f"pcie-uplink-out[sw{k}]", ubw, ulat / 2) for k in range(sw)]
    up_in = [b.resource(f"pcie-uplink-in[sw{k}]", ubw, ulat / 2) for k in range(sw)]
    for s in range(n):
        for t in range(n):
            if s == t:
                continue
            if pair and t == s ^ 1:
                b.path(s, t, [pair[s]])
            elif s // gps == t // gps:
                b.path(s, t, [out[s], inn[t]])
            else:
                b.path(s, t, [out[s], up_out[s // gps], up_in[t // gps], inn[t]])
    return b.build()


def pcie_nvlink_pairs(
    switches: int = 2,
    gpus_per_switch: int = 4,
    device: str = "a100-80g-pcie",
    nvlink_bandwidth: float = 112.5e9,
    nvlink_latency: float = 5e-6,
    pcie_bandwidth: float = 25e9,
    pcie_latency: float = 10e-6,
    uplink_bandwidth: float = 12e9,
    uplink_latency: float = 10e-6,
) -> Topology:
    """``pcie_8`` with an NVLink bridge on each pair of neighbouring GPUs (0-1, 2-3, ...).

    An A100 PCIe bridge: 3 links, 112.5 GB/s per direction, between its two GPUs only."""
    bridge = (_number("nvlink_bandwidth", nvlink_bandwidth), _number("nvlink_latency", nvlink_latency, strict=False))
    return _pcie_box("pcie_nvlink_pairs", switches, gpus_per_switch, device, pcie_bandwidth, pcie_latency,
                     uplink_bandwidth, uplink_latency, bridge)


def heterogeneous(
    a100s: int = 4,
    v100s: int = 4,
    a100_nvlink_bandwidth: float = 300e9,
    v100_nvlink_bandwidth: float = 150e9,
    nvlink_latency: float = 5e-6,
    eth_bandwidth: float = 12.5e9,
    eth_latency: float = 30e-6,
) -> Topology:
    """Two unlike nodes: node 0 = A100-80GB, node 1 = V100-32GB, over 100 Gb/s Ethernet.

    Each node is a direct NVLink mesh (A100 300 GB/s, V100 150 GB/s per direction, split among
    the peers); each node has one 12.5 GB/s NIC all its GPUs share."""
    na = _count("a100s", a100s)
    nv = _count("v100s", v100s)
    lat = _number("nvlink_latency", nvlink_latency, strict=False)
    return _switched_nodes(
        "heterogeneous",
        [
            (DEVICES["a100-80g"], na, "nvlink", _number("a100_nvlink_bandwidth", a100_nvlink_bandwidth), lat, True),
            (DEVICES["v100-32g"], nv, "nvlink", _number("v100_nvlink_bandwidth", v100_nvlink_bandwidth), lat, True),
        ],
        "eth",
        _number("eth_bandwidth", eth_bandwidth),
        _number("eth_latency", eth_latency, strict=False),
        [1, 1],
    )


PRESETS: dict[str, Callable[..., Topology]] = {
    "local_cpu": local_cpu,
    "dgx_a100_8": dgx_a100_8,
    "pcie_8": pcie_8,
    "pcie_nvlink_pairs": pcie_nvlink_pairs,
    "two_node_ib": two_node_ib,
    "cluster": cluster,
    "heterogeneous": heterogeneous,
}

# presets whose size is a parameter rather than fixed by the hardware
_SIZED_BY_NUM_DEVICES = {"local_cpu"}


def preset_params(name: str) -> dict[str, object]:
    """The keyword parameters of a preset and their defaults (the allowed overrides)."""
    return {p.name: p.default for p in inspect.signature(PRESETS[name]).parameters.values()}


def list_presets() -> dict[str, int]:
    """Preset name -> natural number of devices, for help text."""
    return {name: fn().num_devices for name, fn in PRESETS.items()}


def describe_presets() -> str:
    lines = []
    for name, size in list_presets().items():
        doc = (inspect.getdoc(PRESETS[name]) or "").splitlines()[0]
        lines.append(f"{name:<14} {size:>3} devices  {doc}")
    return "\n".join(lines)


def _suggest(name: str, needed: int, overrides: Mapping) -> str:
    if name == "pcie_8":
        gps = overrides.get("gpus_per_switch", 4)
        return f"topology=pcie_8 topology.switches={-(-needed // gps)}"
    gpn = overrides.get("gpus_per_node", 8) if name == "cluster" else 8
    extra = f" topology.gpus_per_node={gpn}" if gpn != 8 else ""
    return f"topology=cluster topology.nodes={-(-needed // gpn)}{extra}"


def get_topology(name: str, num_devices: int | None = None, needed_for: str = "", **overrides) -> Topology:
    """The preset ``name`` with ``overrides`` applied, cut to ``num_devices`` devices (None:
    its natural size). ValueError where more are asked than it has, suggesting a bigger preset
    and saying why (``needed_for``: "pipeline.stages=16")."""
    if name not in PRESETS:
        raise ValueError(f"topology.name={name}: unknown topology; allowed values: {', '.join(PRESETS)}")
    allowed = preset_params(name)
    if name in _SIZED_BY_NUM_DEVICES:
        allowed.pop("num_devices")
    unknown = sorted(set(overrides) - set(allowed))
    if unknown:
        raise ValueError(
            f"topology.{unknown[0]}: unknown parameter for topology '{name}'; "
            f"allowed keys: {', '.join(allowed) or '(none)'}"
        )
    if num_devices is not None:
        _count("num_devices", num_devices)
    if name in _SIZED_BY_NUM_DEVICES:
        if num_devices is not None:
            overrides = {**overrides, "num_devices": num_devices}
        return PRESETS[name](**overrides)
    topo = PRESETS[name](**overrides)
    if num_devices is None or num_devices == topo.num_devices:
        return topo
    if num_devices > topo.num_devices:
        why = f" ({needed_for})" if needed_for else ""
        raise ValueError(
            f"topology '{name}' has {topo.num_devices} devices but the schedule needs {num_devices}{why}; "
            f"pick a larger topology, e.g. {_suggest(name, num_devices, overrides)}"
        )
    return topo.first(num_devices)


def build_topology(cfg: Mapping, num_devices: int | None = None, needed_for: str = "") -> Topology:
    """The ``topology`` config group (``name`` plus preset parameters; null keeps a default) as a
    Topology of exactly ``num_devices``; a ``num_devices`` key fixes the size, which must hold them."""
    params = {k: v for k, v in dict(cfg).items() if v is not None}
    if "name" not in params:
        raise ValueError(f"topology.name is missing; allowed values: {', '.join(PRESETS)}")
    name = params.pop("name")
    size = params.pop("num_devices", None)
    if size is None:
        return get_topology(name, num_devices, needed_for, **params)
    topo = get_topology(name, size, **params)
    if num_devices is None or num_devices == topo.num_devices:
        return topo
    if num_devices > topo.num_devices:
        why = f" ({needed_for})" if needed_for else ""
        raise ValueError(
            f"topology.num_devices={size}: the schedule needs {num_devices} devices{why}; "
            f"set topology.num_devices={num_devices} or leave it unset"
        )
    return topo.first(num_devices)
