"""The cluster's status as the controller sees it: islands (assembling, healthy, lost or healing),
workers with their measured figures, links, sessions and totals. A pure function of the
core's parts."""

from __future__ import annotations

from typing import Any

from pathways.controller.islands import Health


def status(core: Any) -> dict[str, Any]:
    """``core`` is a ControllerCore (not imported: the core imports this module)."""
    rm, scheduler, workers = core.rm, core.scheduler, core.membership.workers
    islands = core.islands.by_id
    return {
        "policy": scheduler.policy,
        "window": scheduler.window,
        # per island: "state" is its health (islands.py): "assembling", "healthy", "lost" or
        # "healing", and "healthy" whether it runs and (unless "retiring") takes slices; "hosts"
        # joined of "expected_hosts", "assembling" until all have joined (first assembly or
        # healing); "lost": which host was lost and how, from the loss until the island heals;
        # "retiring": an operator's `pathways retire` drains it (it takes no new slices)
        "islands": [{"island": i, "name": isl.name, "state": isl.health.value, "healthy": isl.healthy,
                     "lost": isl.lost_by, "healing": isl.health is Health.HEALING,
                     "assembling": isl.assembling, "hosts": len(isl.members), "expected_hosts": isl.hosts,
                     "retiring": isl.retiring,
                     # what brings it back, in words (islands.Islands.recovery); None while healthy
                     "recovery": core.islands.recovery(isl) if isl.recovering else None,
                     "devices": sum(w.info.devices for w in workers.values() if w.island == i),
                     "queued": scheduler.queued(i), "inflight": scheduler.inflight(i)}
                    for i, isl in sorted(islands.items())],
        "workers": [_worker(w, rm.hosts.get(w.worker)) for w in workers.values()],
        "links": [{"src": src, "dst": dst, "latency": latency, "bandwidth": bandwidth}
                  for (src, dst), (latency, bandwidth) in sorted(core.membership.links.items())],
        # "nodes": over every program the session defined (a fused program defines fewer);
        # "state": "active", or where its suspend or resume stands ("draining", "offloading",
        # "suspended", "resuming"), with what it moved off the devices
        "sessions": [{"session": sid, "slices": len(s.slices), "arrays": len(s.handles.live),
                      "programs": len(s.programs.graphs),
                      "nodes": sum(len(g.nodes) for g in s.programs.graphs.values()),
                      **_suspension(s.suspension),
                      **scheduler.session_stats(sid)} for sid, s in core.sessions.items()],
        "slices": len(rm.slices),
        "arrays": sum(len(s.handles.live) for s in core.sessions.values()),
    }


def _suspension(sus: Any) -> dict[str, Any]:
    if sus is None:
        return {"state": "active"}
    return {"state": sus.state, "suspended_arrays": sus.arrays, "suspended_bytes": sus.nbytes,
            "suspended_to": sus.path or "host memory"}


def _worker(conn: Any, host: Any) -> dict[str, Any]:
    info = conn.info
    return {"worker": conn.worker, "address": info.address, "data_address": info.data_address,
            "island": conn.island, "island_name": info.island, "rank": conn.rank, "kind": info.kind,
            "devices": info.devices,
            "pid": info.pid, "host": info.host,
            "memory_bytes": host.memory_bytes if host is not None else info.memory_bytes,
            # measured FLOP/s (None until measured) and slices per device
            "flops": (host.flops or None) if host is not None else None,
            "load": list(host.load) if host is not None else [],
            # seconds it has been silent past the heartbeat timeout while its host still
            # acknowledges (starved, busy or stopped: slow, not lost); None while it answers
            "slow": conn.silent}
