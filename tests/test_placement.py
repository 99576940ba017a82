from collections import Counter

import pytest

from pathways.controller.islands import Islands
from pathways.controller.placement import ResourceManager
from pathways.errors import PlacementError


def manager(*hosts, names=None):
    """A resource manager over ``hosts`` ((island, devices) each; worker i is the i-th),
    every island assembled; ``names``: island id -> its name (default: the id)."""
    sizes = Counter(island for island, _ in hosts)
    islands = Islands()
    rm = ResourceManager(islands)
    for worker, (island, n) in enumerate(hosts):
        _, _, rank, _ = islands.join(worker, (names or {}).get(island, str(island)), sizes[island], None, "h:1")
        rm.add_host(worker, island, "cpu", n, 1 << 30, rank=rank)
    return rm


def test_slices_spread_over_hosts_and_devices():
    rm = manager((0, 2), (0, 2))
    a = rm.place(2, "cpu")
    b = rm.place(2, "cpu")
    assert {a.workers, b.workers} == {(0,), (1,)}
    c = rm.place(1, "cpu")
    d = rm.place(1, "cpu")
    assert (c.workers, c.devices) != (d.workers, d.devices)
    assert [sum(h.load) for h in rm.hosts.values()] == [3, 3]


def test_sharing_when_the_cluster_is_smaller_than_the_requests():
    rm = manager((0, 2))
    slices = [rm.place(2, "cpu") for _ in range(3)]
    assert all(s.devices == ((0, 0), (0, 1)) for s in slices)
    assert rm.hosts[0].load == [3, 3]


def test_exclusive_slices_get_dedicated_devices():
    rm = manager((0, 4))
    ex = rm.place(2, "cpu", exclusive=True)
    shared = [rm.place(2, "cpu") for _ in range(2)]
    assert all(set(s.devices).isdisjoint(ex.devices) for s in shared)
    with pytest.raises(PlacementError, match="held exclusively"):
        rm.place(3, "cpu")
    rm.release(ex.slice_id)
    assert rm.place(3, "cpu").devices


def test_island_and_kind_constraints():
    rm = manager((0, 2), (1, 4))
    assert rm.place(2, "cpu", island=1).workers == (1,)
    with pytest.raises(PlacementError, match="in island 0"):
        rm.place(3, "cpu", island=0)
    with pytest.raises(PlacementError, match="host 0 \\(island 0\\): 2 cpu, host 1 \\(island 1\\): 4 cpu"):
        rm.place(1, "tpu")


def test_an_island_id_the_cluster_lacks_is_told_with_the_ids_it_has():
    rm = manager((0, 2), (1, 1), names={0: "a", 1: "b"})
    with pytest.raises(PlacementError, match=r"there is no island 5; the cluster's islands are island 'a' "
                                             r"\(id 0\), island 'b' \(id 1\)") as info:
        rm.place(1, "cpu", island=5)
    assert "add_slice(island=ID)" in str(info.value) and "cannot place" not in str(info.value)


def test_mesh_shape_must_match_the_device_count():
    rm = manager((0, 4))
    assert rm.place(4, "cpu", mesh_shape=(2, 2)).mesh_shape == (2, 2)
    with pytest.raises(PlacementError, match="make their product equal"):
        rm.place(4, "cpu", mesh_shape=(3, 2))
    with pytest.raises(PlacementError, match="at least one device"):
        rm.place(0, "cpu")


def test_release_owner_returns_the_devices():
    rm = manager((0, 2))
    rm.place(2, "cpu", owner=7)
    rm.place(1, "cpu", owner=8)
    rm.release_owner(7)
    assert rm.hosts[0].load == [1, 0] and len(rm.slices) == 1


def test_no_hosts_says_so():
    with pytest.raises(PlacementError, match="no worker hosts"):
        ResourceManager(Islands()).place(1, "cpu")


def test_a_slice_larger_than_a_host_spans_hosts_of_one_island():
    rm = manager((0, 2), (0, 2), (0, 2), (1, 4))
    s = rm.place(4, "cpu", island=0)
    assert len(s.workers) == 2 and s.island == 0
    ranks = [rank for rank, _ in s.devices]
    assert ranks == sorted(ranks) and len(set(ranks)) == 2, "hosts in rank order, two devices each"
    wide = rm.place(6, "cpu")
    assert wide.island == 0 and len(wide.workers) == 3
    with pytest.raises(PlacementError, match="evenly"):
        rm.place(5, "cpu", island=0)  # 5 devices do not split evenly over hosts of 2


def test_unhealthy_islands_get_no_new_slices():
    rm = manager((0, 2), (1, 2))
    rm.islands.lose(0, "worker 0 was lost")
    assert rm.lose_island(0) == {0}
    assert all(rm.place(1, "cpu").island == 1 for _ in range(3))
    with pytest.raises(PlacementError, match="unhealthy"):
        rm.place(1, "cpu", island=0)


def test_an_island_being_retired_gets_no_new_slices_until_the_operator_gives_up():
    rm = manager((0, 2), (1, 2))
    rm.islands.set_retiring(0, True)
    assert rm.islands.healthy(0) and not rm.islands.takes_slices(0), "it still runs what it has"
    assert all(rm.place(1, "cpu").island == 1 for _ in range(3))
    with pytest.raises(PlacementError, match="host 0 \\(island 0, being retired\\)"):
        rm.place(1, "cpu", island=0)
    rm.islands.set_retiring(0, False)
    assert rm.place(1, "cpu", island=0).island == 0


def test_measured_speed_breaks_ties_between_equally_loaded_hosts():
    rm = manager((0, 1), (0, 1), (0, 1), (0, 2))
    for worker, flops in {0: 1e9, 1: 5e9, 2: 2e9, 3: 8e9}.items():  # host 3: 4e9 per device
        rm.set_flops(worker, flops)
    order = [rm.place(1, "cpu").workers[0] for _ in range(5)]
    assert order == [1, 3, 2, 0, 3], "the fastest device first, but an idle host before a loaded one"
    assert rm.place(1, "cpu").workers == (1,), "all equally loaded again: the fastest"


def test_speeds_within_the_tolerance_count_as_equal_and_unmeasured_hosts_come_last():
    rm = manager((0, 1), (0, 1), (0, 1))
    rm.set_flops(1, 1.0e9)
    rm.set_flops(2, 1.1e9)  # within 25% of host 1: noise, not a reason to prefer it
    assert [rm.place(1, "cpu").workers[0] for _ in range(3)] == [1, 2, 0]


def test_a_slice_over_several_hosts_prefers_the_hosts_with_the_fastest_links():
    rm = manager((0, 1), (0, 1), (0, 1), (0, 1))
    assert rm.place(2, "cpu", owner=1).workers == (0, 1), "unmeasured: the lowest ranks, as before"
    rm.release_owner(1)
    for a in range(4):
        for b in range(4):
            if a != b:
                rm.set_latency(a, b, 1e-3)
    rm.set_latency(1, 3, 2e-5)
    rm.set_latency(3, 1, 3e-5)
    assert rm.place(2, "cpu").workers == (1, 3)
    assert rm.place(2, "cpu").workers == (0, 2), "load first: the idle hosts, however slow their link"
    rm.set_latency(0, 2, None)  # an unmeasured link counts as slower than any measured one
    rm.release_owner(0)
    assert rm.place(2, "cpu").workers == (1, 3)


def test_an_equally_loaded_island_with_faster_hosts_or_links_is_preferred():
    rm = manager((0, 1), (0, 1), (1, 1), (1, 1))
    for worker in (2, 3):
        rm.set_flops(worker, 4e9)
    for worker in (0, 1):
        rm.set_flops(worker, 1e9)
    assert rm.place(2, "cpu", owner=1).island == 1
    rm.release_owner(1)
    for worker in range(4):
        rm.set_flops(worker, 1e9)
    rm.set_latency(0, 1, 1e-5)
    rm.set_latency(1, 0, 1e-5)
    rm.set_latency(2, 3, 1e-3)
    rm.set_latency(3, 2, 1e-3)
    assert rm.place(2, "cpu").island == 0
    assert rm.lose_island(0) == {0, 1} and set(rm.latency) == {(2, 3), (3, 2)}


def test_a_slice_that_does_not_fit_names_islands_by_name_and_says_what_fits():
    rm = manager((0, 4), (0, 4), (1, 2), names={0: "a"})
    with pytest.raises(PlacementError) as info:
        rm.place(16, "cpu")
    message = str(info.value)
    assert "host 0 (island 'a' (id 0)): 4 cpu" in message and "host 2 (island 1): 2 cpu" in message
    assert "island 'a' (id 0): up to 4 on one host, or 8 over 2 hosts (4 each); island 1: up to 2 on one host" in message
    assert "python -m pathways status" in message and "--island NAME" in message
    assert "local_cluster" not in message, "the controller cannot know that its cluster is local"
    rm.place(3, "cpu", exclusive=True)
    # host 0 has 1 device left, so 2 hosts take 1 each: no more than host 1 alone
    with pytest.raises(PlacementError, match="island 'a' \\(id 0\\): up to 4 on one host; island 1"):
        rm.place(16, "cpu", exclusive=True)
    rm.lose_island(1)
    rm.islands.lose(1, "host 2 was lost")
    with pytest.raises(PlacementError, match="island 1 lost a host and are unhealthy"):
        rm.place(1, "cpu", island=1)
