"""Topology: routes, the resources they occupy (what the simulator's contention model
relies on), the ring all-reduce formula, sub-topologies, presets and their errors."""

import json
import math

import pytest

from pipeflow.topology import Device, Topology, build_topology, get_topology, list_presets
from pipeflow.topology.presets import PRESETS, preset_params


def names(topo, route):
    return [topo.resource_names[r] for r in route.resources]


def shared(topo, a, b):
    return set(topo.route(*a).resources) & set(topo.route(*b).resources)


# ------------------------------------------------------------------ routes


def test_route_to_self_is_free():
    topo = get_topology("dgx_a100_8")
    r = topo.route(3, 3)
    assert r.resources == () and math.isinf(r.bandwidth) and r.latency == 0
    assert topo.transfer_time(3, 3, 1e9) == 0


def test_nvswitch_route_uses_sender_egress_and_receiver_ingress():
    topo = get_topology("dgx_a100_8")
    r = topo.route(0, 5)
    assert names(topo, r) == ["nvlink-out[0]", "nvlink-in[5]"]
    assert r.bandwidth == preset_params("dgx_a100_8")["nvlink_bandwidth"]
    assert topo.transfer_time(0, 5, 6e9) == pytest.approx(r.latency + 6e9 / r.bandwidth)
    # ports, not pairs: one GPU sending to two peers shares its egress;
    # two disjoint pairs share nothing
    assert shared(topo, (0, 1), (0, 2))
    assert not shared(topo, (0, 1), (2, 3))
    # and two senders into one receiver share its ingress
    assert shared(topo, (1, 0), (2, 0))


def test_two_node_routes_same_node_vs_cross_node():
    topo = get_topology("two_node_ib")
    assert topo.num_devices == 16 and topo.num_nodes == 2
    assert {d.node for d in topo.devices[:8]} == {0} and {d.node for d in topo.devices[8:]} == {1}
    inside, across = topo.route(1, 2), topo.route(1, 9)
    assert all(n.startswith("nvlink") for n in names(topo, inside))
    assert names(topo, across) == ["ib-out[1]", "ib-in[9]"]
    assert across.bandwidth < inside.bandwidth
    assert topo.transfer_time(1, 9, 1e8) > topo.transfer_time(1, 2, 1e8)
    # one NIC per GPU: two GPUs crossing at once do not contend
    assert not shared(topo, (0, 8), (1, 9))
    # routes are symmetric in bandwidth but use the opposite directed resources
    assert topo.route(9, 1).bandwidth == across.bandwidth
    assert not set(topo.route(9, 1).resources) & set(across.resources)


def test_heterogeneous_gpus_of_a_node_share_the_uplink():
    topo = get_topology("heterogeneous")
    a100, v100 = topo.devices[0], topo.devices[4]
    assert (a100.name, a100.node) == ("a100-80g", 0) and (v100.name, v100.node) == ("v100-32g", 1)
    assert a100.peak_flops > v100.peak_flops and a100.memory_bytes > v100.memory_bytes
    up = shared(topo, (0, 4), (1, 5))
    assert {topo.resource_names[r] for r in up} == {"eth-out[node0]", "eth-in[node1]"}
    assert topo.route(0, 4).bandwidth == preset_params("heterogeneous")["eth_bandwidth"]
    # inside a node the GPUs do not touch the Ethernet NIC
    assert not shared(topo, (0, 1), (0, 4))
    # V100 NVLink is slower than A100 NVLink
    assert topo.route(4, 5).bandwidth < topo.route(0, 1).bandwidth


def test_pcie_cross_switch_goes_through_the_shared_uplink():
    topo = get_topology("pcie_8")
    p = preset_params("pcie_8")
    near, far = topo.route(0, 3), topo.route(0, 5)
    assert near.bandwidth == p["pcie_bandwidth"]
    assert far.bandwidth == min(p["pcie_bandwidth"], p["uplink_bandwidth"])
    assert far.latency == pytest.approx(sum(topo.resource_latency[r] for r in far.resources))
    assert far.latency > near.latency
    # every GPU under switch 0 talking to switch 1 shares one uplink per direction
    assert shared(topo, (0, 4), (3, 7))
    assert not shared(topo, (0, 4), (4, 0))  # opposite directions are separate resources
    assert not shared(topo, (0, 1), (2, 3))


# --------------------------------------------------------------- all-reduce


@pytest.mark.parametrize(
    "name,ring", [("dgx_a100_8", [0, 1, 2, 3]), ("two_node_ib", [0, 8, 3, 11]), ("pcie_8", list(range(8)))]
)
def test_allreduce_is_the_ring_formula(name, ring):
    topo = get_topology(name)
    nbytes = 3e8
    n = len(ring)
    hops = [topo.route(ring[i], ring[(i + 1) % n]) for i in range(n)]
    bw = min(h.bandwidth for h in hops)
    lat = max(h.latency for h in hops)
    expected = 2 * (n - 1) / n * nbytes / bw + 2 * (n - 1) * lat
    assert topo.allreduce_time(ring, nbytes) == pytest.approx(expected)


def test_allreduce_trivial_cases():
    topo = get_topology("dgx_a100_8")
    assert topo.allreduce_time([], 1e9) == 0
    assert topo.allreduce_time([5], 1e9) == 0
    assert topo.allreduce_time([0, 1], 0) == 0
    with pytest.raises(ValueError, match="devices 0..7"):
        topo.allreduce_time([0, 8], 1e6)


def test_allreduce_ring_crossing_a_shared_uplink_twice_is_slower():
    topo = get_topology("heterogeneous")
    nbytes = 1e9
    good = topo.allreduce_time([0, 1, 4, 5], nbytes)  # crosses each direction once
    bad = topo.allreduce_time([0, 4, 1, 5], nbytes)  # crosses node0 -> node1 twice
    assert bad > good
    eth = preset_params("heterogeneous")["eth_bandwidth"]
    lat = topo.route(0, 4).latency
    assert bad == pytest.approx(2 * 3 / 4 * nbytes / (eth / 2) + 2 * 3 * lat)


# ------------------------------------------------------------ sub-topology


def test_first_keeps_routes_and_drops_unused_resources():
    full = get_topology("two_node_ib")
    sub = full.first(4)
    assert sub.num_devices == 4 and sub.devices == full.devices[:4]
    assert not any(n.startswith("ib") for n in sub.resource_names)
    for s in range(4):
        for t in range(4):
            assert sub.route(s, t).bandwidth == full.route(s, t).bandwidth
            assert sub.route(s, t).latency == pytest.approx(full.route(s, t).latency)
            assert names(sub, sub.route(s, t)) == names(full, full.route(s, t))
    assert full.first(16) is full


@pytest.mark.parametrize("n", [0, 17, -1])
def test_first_rejects_sizes_outside_the_topology(n):
    with pytest.raises(ValueError, match="has 16 devices"):
        get_topology("two_node_ib").first(n)


def test_to_dict_is_json_and_counts_every_resource():
    topo = get_topology("heterogeneous")
    d = json.loads(json.dumps(topo.to_dict()))
    assert d["name"] == "heterogeneous" and d["num_devices"] == 8 == len(d["devices"])
    assert sum(link["count"] for link in d["links"]) == len(topo.resource_names)
    assert {link["kind"] for link in d["links"]} >= {"eth-out", "eth-in", "nvlink"}


def test_topology_requires_a_path_for_every_pair():
    dev = Device("cpu", 1e9, 1e9)
    with pytest.raises(ValueError, match="no path from device 1 to device 0"):
        Topology("t", [dev, dev], ["l"], [1e9], [0.0], {(0, 1): [0]})
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Topology("t", [dev, dev], ["l"], [0.0], [0.0], {(0, 1): [0], (1, 0): [0]})


# ------------------------------------------------------------------ presets


def test_list_presets_reports_natural_sizes():
    sizes = list_presets()
    assert set(sizes) == set(PRESETS)
    for name, n in sizes.items():
        assert get_topology(name).num_devices == n


def test_get_topology_cuts_and_sizes():
    assert get_topology("dgx_a100_8", 4).num_devices == 4
    assert get_topology("local_cpu", 5).num_devices == 5
    big = get_topology("cluster", nodes=8)
    assert big.num_devices == 64 and big.num_nodes == 8
    assert names(big, big.route(7, 63)) == ["ib-out[7]", "ib-in[63]"]


def test_overrides_change_the_links():
    slow = get_topology("two_node_ib", nic_bandwidth=12.5e9)
    assert slow.route(0, 8).bandwidth == 12.5e9
    shared_nic = get_topology("cluster", nics_per_node=1)
    assert shared(shared_nic, (0, 8), (1, 9))  # now GPUs of a node share one NIC


def test_unknown_topology_lists_allowed_values():
    with pytest.raises(ValueError, match=r"topology.name=foo: unknown topology; allowed values: .*dgx_a100_8"):
        get_topology("foo")


def test_too_small_topology_suggests_a_bigger_one():
    with pytest.raises(ValueError) as e:
        get_topology("dgx_a100_8", 16, needed_for="pipeline.stages=16")
    msg = str(e.value)
    assert "has 8 devices but the schedule needs 16 (pipeline.stages=16)" in msg
    assert "topology=cluster topology.nodes=2" in msg
    # the suggestion really is big enough
    assert get_topology("cluster", 16, nodes=2).num_devices == 16


def test_unknown_and_invalid_overrides_name_the_key():
    with pytest.raises(ValueError, match=r"topology.nodes: .*allowed keys: nvlink_bandwidth, nvlink_latency"):
        get_topology("dgx_a100_8", nodes=2)
    with pytest.raises(ValueError, match=r"topology.nic_bandwidth=-1"):
        get_topology("cluster", nic_bandwidth=-1)
    with pytest.raises(ValueError, match=r"topology.device='tpu'.*allowed values"):
        get_topology("cluster", device="tpu")
    with pytest.raises(ValueError, match=r"topology.num_devices=0"):
        get_topology("local_cpu", 0)


def test_build_topology_from_config():
    topo = build_topology({"name": "cluster", "nodes": 4, "nic_bandwidth": None}, num_devices=24)
    assert topo.num_devices == 24 and topo.route(0, 8).bandwidth == preset_params("cluster")["nic_bandwidth"]
    assert build_topology({"name": "local_cpu", "num_devices": None}, num_devices=3).num_devices == 3
    with pytest.raises(ValueError, match="topology.num_devices=2"):
        build_topology({"name": "local_cpu", "num_devices": 2}, num_devices=4)
