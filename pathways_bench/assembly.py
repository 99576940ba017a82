"""``python -m pathways bench assembly``: how long an island of two hosts takes to assemble
from cold processes, on this machine's loopback and across network namespaces.

- *Loopback*: ``pw.local_cluster`` of one island of two hosts (one CPU device each), from
  the call until the controller's status shows the island healthy (*assembled*: both hosts
  registered), and until a psum over both hosts first returns (*serving*: the hosts formed
  their jax.distributed group and built their cores, and the psum compiled and ran). Each
  round runs in a new process, so that its cluster's process template starts cold; then
  *warm*: a second cluster in the same process, whose processes the running template forks.
- *Namespaces*: docs/deploy.md's "By hand" commands, each host in a network namespace of its
  own (pathways_bench/netns.py; needs root): ``pathways controller`` and two ``pathways
  worker`` of island ``a``, all started at once, and a client in a fourth namespace (started
  and warm before them) that polls the controller's status and then runs the psum.

Each also gives the CPU seconds that the controller and workers (with their keepers and, on
loopback, the process template) spent until serving: on a machine of few cores the
processes of a start compete for them.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Iterable, Optional

from pathways import config
from pathways_bench import netns, report

TITLE = "Island assembly: from cold processes to an island of two hosts serving"
PAPER = ""
PAPER_RESULT = ""
ROUNDS = 5
TARGETS = {"loopback": 3.0, "netns": 5.0}  # seconds from start to assembled
_TIMEOUT = 120.0
_POLL = 0.02
_HOSTS = ["ctl", "w1", "w2", "client"]
_PORT = 50051

ABOUT = """
**Loopback**: `pw.local_cluster(islands=[pw.Island(hosts=2)])` (one CPU device per host),
timed from the call: *assembled* when the controller's status shows the island healthy (both
hosts registered and took their ranks), *serving* when a `pw.pmap` psum over both hosts
first returns (the hosts formed their jax.distributed group and built their cores, and the
psum compiled and ran). The client process has imported JAX before it starts. Each round
runs in a new client process, so that the cluster's process template, which imports JAX
and forks the controller and the workers, starts cold. *Warm*: a second cluster of the same
shape in that process, right after, whose processes the running template forks.

**Namespaces**: docs/deploy.md's "By hand" commands, each host in a network namespace of
its own joined by a bridge (`pathways_bench/netns.py`; needs root): `pathways controller
--bind 0.0.0.0:PORT --token-file F --worker-token-file W` and, on two more hosts, `pathways
worker --controller ADDRESS --island a --island-hosts 2 --token-file F --worker-token-file
W`, all three started at once. A client
in a fourth namespace, started and warm before them, polls the controller's status every
20 ms from that moment, then runs the same psum.

*CPU s*: what the controller, the workers, their keepers and (cold loopback) the process
template spent until serving (user and system, from /proc): on 2 cores, the processes of a
start compete for them.
"""


def _island_healthy(status: dict, name: str) -> bool:
    return any(i["name"] == name and i["healthy"] and not i["assembling"] for i in status["islands"])


def _wait_assembled(address: str, name: str, deadline: float) -> float:
    """Poll the controller at ``address`` (which may not be up yet) until island ``name`` is
    healthy; returns when (monotonic)."""
    from pathways.cluster import status
    from pathways.errors import ConnectError

    while True:
        try:
            if _island_healthy(status(address, timeout=max(0.1, deadline - time.monotonic())), name):
                return time.monotonic()
        except ConnectError:
            pass  # not listening yet
        if time.monotonic() > deadline:
            raise TimeoutError(f"island {name!r} did not assemble within {_TIMEOUT:g} s")
        time.sleep(_POLL)


def _serve_psum(devices_of: Callable[[], Any]) -> None:
    """A psum over the two hosts of the slice ``devices_of()`` gives, run once and checked."""
    import jax
    import numpy as np

    import pathways as pw

    total = pw.pmap(lambda x: jax.lax.psum(x, "i"), devices=devices_of())
    got = np.asarray(total(np.ones(2, np.float32)))
    if not np.array_equal(got, [2.0, 2.0]):
        raise RuntimeError(f"the psum over the island gave {got}, not [2. 2.]")


def _cpu_seconds(roots: Iterable[int]) -> float:
    """User and system CPU seconds of the processes ``roots`` and their descendants alive now."""
    parents: dict[int, int] = {}
    times: dict[int, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue  # gone meanwhile
        parents[int(entry)] = int(fields[1])
        times[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    wanted = set(roots)
    grew = True
    while grew:
        more = {pid for pid, parent in parents.items() if parent in wanted} - wanted
        wanted |= more
        grew = bool(more)
    return sum(times.get(pid, 0.0) for pid in wanted)


def _loopback_round() -> dict[str, dict[str, float]]:
    """A cold loopback round and a warm one, in a new process (this file run with
    ``--loopback``)."""
    done = subprocess.run([sys.executable, os.path.abspath(__file__), "--loopback"], capture_output=True, text=True,
                          timeout=2 * _TIMEOUT + 60,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, [_package_root(), os.environ.get("PYTHONPATH")]))})
    if done.returncode != 0:
        raise RuntimeError(f"the loopback round failed: {done.stderr[-2000:]}")
    return json.loads(done.stdout.splitlines()[-1])


def _loopback_client() -> None:
    """Time a cluster whose process template starts with it, then a second one that the
    running template forks; prints both as JSON."""
    import pathways as pw
    from pathways.template import template_pids

    pw.P  # noqa: B018 - imports JAX and the client now, before the clock starts
    rounds = {}
    for case in ("loopback", "warm"):
        began = time.monotonic()
        with pw.local_cluster(islands=[pw.Island(hosts=2)]) as c:
            assembled = _wait_assembled(c.address, "0", began + _TIMEOUT)
            _serve_psum(lambda: pw.make_virtual_device_set().add_slice(cpu_devices=2).devices)
            served = time.monotonic()
            # cold: the template started with this cluster, and forked all of it
            cpu = _cpu_seconds(template_pids() if case == "loopback" else c.pids)
        rounds[case] = {"assembled": assembled - began, "serving": served - began, "cpu": cpu}
    print(json.dumps(rounds), flush=True)


def _client(address: str) -> None:
    """The client in its namespace (this file run as a script): warm up, say ``ready``, and
    once told ``go`` time the island's assembly and first psum; prints them as JSON."""
    import pathways as pw

    pw.P  # noqa: B018 - imports JAX and the client now, before the clock starts
    print("ready", flush=True)
    sys.stdin.readline()
    began = time.monotonic()
    assembled = _wait_assembled(address, "a", began + _TIMEOUT)
    session = pw.connect(address)
    try:
        _serve_psum(lambda: pw.make_virtual_device_set().add_slice(cpu_devices=2).devices)
    finally:
        session.close()
    print(json.dumps({"assembled": assembled - began, "serving": time.monotonic() - began}), flush=True)


def _netns_round(directory: str) -> dict[str, float]:
    token_file, worker_token_file = os.path.join(directory, "token"), os.path.join(directory, "worker-token")
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [_package_root(), os.environ.get("PYTHONPATH")])),
           config.TOKEN.name: open(token_file).read().strip(), config.LOG_LEVEL.name: "warning",
           "TF_CPP_MIN_LOG_LEVEL": "2"}
    with netns.Network(_HOSTS) as net:
        address = f"grpc://{net.addr('ctl')}:{_PORT}"
        client = net.popen("client", [sys.executable, os.path.abspath(__file__), address], env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        if report.read_line(client, _TIMEOUT, "the assembly client") != "ready":
            raise RuntimeError("the assembly client did not start")
        client.stdin.write("go\n")
        client.stdin.flush()
        py = [sys.executable, "-m", "pathways"]
        tokens = ["--token-file", token_file, "--worker-token-file", worker_token_file]
        servers = [net.popen("ctl", [*py, "controller", "--bind", f"0.0.0.0:{_PORT}", *tokens],
                             env=env, stdout=subprocess.DEVNULL)]
        servers += [net.popen(host, [*py, "worker", "--controller", address, "--island", "a", "--island-hosts", "2",
                                     *tokens], env=env, stdout=subprocess.DEVNULL)
                    for host in ("w1", "w2")]
        times = json.loads(report.read_line(client, _TIMEOUT, "the assembly client"))
        times["cpu"] = _cpu_seconds(p.pid for p in servers)
    return times


def _package_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict:
    skipped: Optional[str] = netns.unavailable()
    progress.expect(rounds * (1 if skipped else 2))
    samples: dict[str, list[dict[str, float]]] = {"loopback": [], "warm": [], "netns": []}
    load: list[float] = []
    with tempfile.TemporaryDirectory(prefix="pathways-assembly-") as directory:
        for name in ("token", "worker-token"):
            with open(os.open(os.path.join(directory, name), os.O_WRONLY | os.O_CREAT, 0o600), "w") as f:
                f.write(secrets.token_urlsafe(32))
        for i in range(rounds):  # the two cases alternate, so that they share the machine's moods
            load.append(os.getloadavg()[0])
            for case, times in _loopback_round().items():
                samples[case].append(times)
            progress.step(f"loopback round {i + 1}: {samples['loopback'][-1]['assembled']:.1f} s "
                          f"(warm {samples['warm'][-1]['assembled']:.1f} s)")
            if not skipped:
                samples["netns"].append(_netns_round(directory))
                progress.step(f"namespaces round {i + 1}: {samples['netns'][-1]['assembled']:.1f} s")
    data: dict[str, Any] = {"load": report.stats(load)}
    for case, rows in samples.items():
        data[case] = ({"skipped": skipped} if not rows else
                      {key: report.stats([r[key] for r in rows]) for key in ("assembled", "serving", "cpu")})
    return data


def _s(s: dict) -> str:
    return f"{s['median']:.2f} ({s['min']:.2f}-{s['max']:.2f})"


_CASES = {"loopback": "loopback: pw.local_cluster", "warm": "loopback: a second pw.local_cluster (template warm)",
          "netns": "network namespaces: the By hand commands"}


def tables(data: dict) -> list:
    rows = [[label, _s(data[case]["assembled"]), _s(data[case]["serving"]), _s(data[case]["cpu"]), _target(case)]
            if "skipped" not in data[case] else [label, "skipped", "-", "-", _target(case)]
            for case, label in _CASES.items() if case in data]
    return [report.Table("Seconds from start to an island of 2 hosts assembled and serving, median (min-max); "
                         f"the machine's load average {data['load']['median']:.1f} (median of the rounds' starts)",
                         ["case", "assembled s", "serving s", "CPU s", "target s (assembled)"], rows)]


def _target(case: str) -> str:
    return f"{TARGETS[case]:g}" if case in TARGETS else "-"


def summary(data: dict) -> list[str]:
    lines = report.unjudged(data)
    for case, label in _CASES.items():
        if case not in data:
            continue
        if "skipped" in data[case]:
            lines.append(f"{label}: skipped ({data[case]['skipped']})")
            continue
        got, target = data[case]["assembled"]["median"], TARGETS.get(case)
        judged = "" if target is None else (
            f" (target {target:g} s: " + report.verdict(data, got <= target, f"missed by {got - target:.2f} s") + ")")
        lines.append(f"{label}: assembled in {got:.2f} s{judged}, serving a psum at "
                     f"{data[case]['serving']['median']:.2f} s")
    return lines


def notes(data: dict) -> str:
    return """
Where the time goes. On loopback, the cluster's process template imports Python's, the
package's and JAX's modules once (about 2 s of CPU here), then forks the controller, the
keepers and the workers, which start JAX's backend and the island's jax.distributed group;
a second cluster of the same program reuses the template. Across namespaces each process
imports what it runs: a worker imports JAX (about 1.1 s of CPU) while it attaches and waits
for its rank; the controller, the keepers and the command line import no JAX. On 2 cores shared with the client and other work, the start is
CPU-bound: the CPU seconds are a better guide than the wall-clock figures, which follow the
machine's load.
"""


def plot(data: dict, path: str) -> None:
    cases = [c for c in _CASES if c in data and "skipped" not in data[c]]
    report.plot_bars(path, "Island of 2 hosts: start to assembled and serving", "seconds", cases,
                     {key: [data[c][key]["median"] for c in cases] for key in ("assembled", "serving")})


if __name__ == "__main__":
    if sys.argv[1] == "--loopback":
        _loopback_client()
    else:
        _client(sys.argv[1])
