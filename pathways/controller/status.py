"""The cluster's status as the controller sees it: islands (assembling, healthy, lost or healing),
workers with their measured figures, links, sessions and totals, and the array bytes the
front end beside the controller moved, if one serves. A pure function of the
core's parts, giving the typed record the Status method and ``pw.cluster.status`` send
(protocol/operator.py says what each field means)."""

from __future__ import annotations

from typing import Any

from pathways.protocol.messages import (ACTIVE, ClusterStatus, Health, IslandStatus, LinkStatus, SessionStatus,
                                        WorkerStatus)


def status(core: Any) -> ClusterStatus:
    """``core`` is a ControllerCore (not imported: the core imports this module)."""
    rm, scheduler, workers = core.rm, core.scheduler, core.membership.workers
    islands = [IslandStatus(i, isl.name, isl.health.value, isl.healthy, isl.lost_by, isl.health is Health.HEALING,
                            isl.assembling, len(isl.members), isl.hosts, isl.retiring,
                            core.islands.recovery(isl) if isl.recovering else None,
                            sum(w.info.devices for w in workers.values() if w.island == i),
                            scheduler.queued(i), scheduler.inflight(i))
               for i, isl in sorted(core.islands.by_id.items())]
    links = [LinkStatus(src, dst, latency, bandwidth)
             for (src, dst), (latency, bandwidth) in sorted(core.membership.links.items())]
    sessions = [SessionStatus(sid, len(s.slices), len(s.handles.live), len(s.programs.graphs),
                              sum(len(g.nodes) for g in s.programs.graphs.values()),
                              **_suspension(s.suspension), **scheduler.session_stats(sid))
                for sid, s in core.sessions.items()]
    return ClusterStatus(scheduler.policy, scheduler.window, tuple(islands),
                         tuple(_worker(w, rm.hosts.get(w.worker)) for w in workers.values()), tuple(links),
                         tuple(sessions), len(rm.slices), sum(len(s.handles.live) for s in core.sessions.values()),
                         core.front_end_traffic() if core.front_end_traffic is not None else None)


def _suspension(sus: Any) -> dict[str, Any]:
    if sus is None:
        return {"state": ACTIVE}
    return {"state": sus.state, "suspended_arrays": sus.arrays, "suspended_bytes": sus.nbytes,
            "suspended_to": sus.path or "host memory"}


def _worker(conn: Any, host: Any) -> WorkerStatus:
    info = conn.info
    return WorkerStatus(conn.worker, info.address, info.data_address, conn.island, info.island, conn.rank, info.kind,
                        info.devices, info.pid, info.host,
                        host.memory_bytes if host is not None else info.memory_bytes,
                        (host.flops or None) if host is not None else None,
                        tuple(host.load) if host is not None else (), conn.silent)
