import json

import pytest

from pathways.planner import Device, Link, PlanError, Topology, UnknownLinkError


def three():
    return [Device("a", 100, 1e9), Device("b", 200, 2e9, "gpu"), Device("c", 300, 3e9)]


@pytest.mark.parametrize("devices, links, default, match", [
    ([Device("a", 1, 1.0), Device("a", 1, 1.0)], {}, None, "'a' appears twice"),
    ([Device("a", 0, 1.0)], {}, None, "'a' memory_bytes must be positive"),
    ([Device("a", 1.5, 1.0)], {}, None, "'a' memory_bytes must be an integer"),
    ([Device("a", 1, 0.0)], {}, None, "'a' flops must be positive"),
    ([Device("a", 1, float("inf"))], {}, None, "'a' flops must be finite"),
    ([Device("", 1, 1.0)], {}, None, r"devices\[0\].id must be a non-empty string"),
    ([Device("a", 1, 1.0)], {("a", "z"): Link(0.0, 1.0)}, None, "unknown device 'z'"),
    ([Device("a", 1, 1.0), Device("b", 1, 1.0)], {("a", "b"): Link(-1.0, 1.0)}, None,
     "'a' -> 'b'.latency must not be negative"),
    ([Device("a", 1, 1.0), Device("b", 1, 1.0)], {("a", "b"): Link(0.0, 0.0)}, None,
     "'a' -> 'b'.bandwidth must be positive"),
    ([Device("a", 1, 1.0)], {}, Link(0.0, -5.0), "default_link.bandwidth must be positive"),
])
def test_construction_rejects_invalid_input_naming_it(devices, links, default, match):
    with pytest.raises(ValueError, match=match):
        Topology(devices, links, default)


def test_link_lookup_prefers_the_pair_then_its_reverse_then_the_default():
    ab, ba, default = Link(1.0, 10.0), Link(2.0, 20.0), Link(3.0, 30.0)
    topo = Topology(three(), {("a", "b"): ab, ("b", "a"): ba, ("b", "c"): Link(4.0, 40.0)}, default)
    assert topo.link("a", "b") == ab
    assert topo.link("b", "a") == ba
    assert topo.link("c", "b") == Link(4.0, 40.0)  # only (b, c) given: serves both directions
    assert topo.link("a", "c") == default


def test_missing_link_without_default_is_a_key_error_naming_both_devices():
    topo = Topology(three(), {("a", "b"): Link(0.0, 1.0)})
    with pytest.raises(KeyError) as info:
        topo.link("a", "c")
    assert isinstance(info.value, UnknownLinkError) and isinstance(info.value, PlanError)
    assert "'a' and 'c'" in str(info.value) and "default_link" in str(info.value)


def test_transfer_time_is_latency_plus_bytes_over_bandwidth_and_free_on_one_device():
    topo = Topology(three(), {("a", "b"): Link(0.5, 100.0)})
    assert topo.transfer_time("a", "b", 300) == pytest.approx(3.5)
    assert topo.transfer_time("b", "a", 0) == pytest.approx(0.5)
    assert topo.transfer_time("c", "c", 10**9) == 0.0
    with pytest.raises(PlanError, match="unknown device 'z'"):
        topo.transfer_time("z", "z", 1)


def test_device_lookup_names_the_unknown_id_and_the_known_ones():
    topo = Topology(three())
    assert topo.device("b").kind == "gpu"
    with pytest.raises(PlanError, match=r"unknown device 'q'; known devices: \['a', 'b', 'c'\]"):
        topo.device("q")


def test_dict_form_round_trips_through_json():
    topo = Topology(three(), {("a", "b"): Link(1e-6, 1e9), ("c", "a"): Link(2e-6, 5e8)}, Link(1e-4, 1e8))
    again = Topology.from_dict(json.loads(json.dumps(topo.to_dict())))
    assert again == topo
    assert again.link("a", "c") == Link(2e-6, 5e8)
    plain = Topology(three())
    assert "default_link" not in plain.to_dict()
    assert Topology.from_dict(plain.to_dict()) == plain


@pytest.mark.parametrize("data, match", [
    ([], "must be a JSON object"),
    ({}, "topology has no 'devices'"),
    ({"devices": [{"id": "a", "memory_bytes": 1}]}, r"devices\[0\] has no 'flops'"),
    ({"devices": [{"id": "a", "memory_bytes": "1", "flops": 1.0}]}, r"devices\[0\].memory_bytes must be int"),
    ({"devices": [{"id": "a", "memory_bytes": 1, "flops": 1.0}], "links": [{"src": "a", "dst": "a"}]},
     r"links\[0\] has no 'latency'"),
    ({"devices": [{"id": "a", "memory_bytes": 1, "flops": 1.0}],
      "links": [{"src": "a", "dst": "b", "latency": 0, "bandwidth": 1}]}, "unknown device 'b'"),
])
def test_from_dict_names_the_missing_or_wrong_field(data, match):
    with pytest.raises(PlanError, match=match):
        Topology.from_dict(data)


def status(**override):
    workers = [{"worker": 0, "devices": 2, "kind": "cpu", "flops": 4e10, "memory_bytes": 8 << 30, "island": 0},
               {"worker": 1, "devices": 1, "kind": "cpu", "flops": 2e10, "memory_bytes": 4 << 30, "island": 1}]
    links = [{"src": 0, "dst": 1, "latency": 1e-4, "bandwidth": 1e9},
             {"src": 1, "dst": 0, "latency": 2e-4, "bandwidth": 5e8}]
    out = {"workers": workers, "links": links}
    out.update(override)
    return out


def test_from_status_makes_one_device_per_worker_with_measured_links():
    topo = Topology.from_status(status())
    assert topo.devices == (Device("0", 8 << 30, 4e10, "cpu"), Device("1", 4 << 30, 2e10, "cpu"))
    assert topo.link("0", "1") == Link(1e-4, 1e9)
    assert topo.link("1", "0") == Link(2e-4, 5e8)


@pytest.mark.parametrize("flops", [None, 0])
def test_from_status_refuses_a_worker_whose_flops_are_not_measured_yet(flops):
    st = status()
    if flops is None:
        del st["workers"][1]["flops"]
    else:
        st["workers"][1]["flops"] = flops
    with pytest.raises(PlanError, match=r"worker 1 has no measured flops.*status --measure"):
        Topology.from_status(st)


def test_from_status_rejects_a_dict_that_is_not_a_status():
    with pytest.raises(PlanError, match="no 'workers' list"):
        Topology.from_status({"islands": []})
    with pytest.raises(PlanError, match=r"status\['links'\]\[0\].src must be int"):
        Topology.from_status(status(links=[{"src": "0", "dst": 1, "latency": 0.0, "bandwidth": 1.0}]))
