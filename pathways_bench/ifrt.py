"""``python -m pathways bench ifrt``: unmodified JAX through the IFRT proxy front end next to
pathways' native op-by-op path, a bare gRPC stream, a raw TCP copy and local JAX.

A local cluster of two islands with the IFRT front end: one host of four devices, and two
hosts of two devices each (an island of two hosts: its executables span both). Helper
processes (this file run as a script) run the same plain JAX code, started once and kept
for the whole run: two under ``JAX_PLATFORMS=proxy`` against the cluster, one on each island
(``PATHWAYS_SLICE=cpu:4@ISLAND``), and one on local CPU JAX with four devices. They take a
command per line on stdin and answer with the seconds it took:

- small ``jit`` calls (``x + 1`` on 16 int32, each output fed to the next call): pipelined
  (N calls, then one block on the last), blocking (a block after every call) and read (an
  ``np.asarray`` of each call's 64-byte output, as a loop reads its loss); next to
  them the same function as a ``pw.jit`` on a one-device slice of the same island, called
  op by op from this process ("PW-O");
- ``jax.device_put`` of a host buffer, and ``np.asarray`` of a device array made before the
  timing (a fresh one per run: JAX keeps an array's host copy), of 1 KiB to 64 MiB; next to
  them ``pw.device_put`` and ``to_numpy`` of the native client on the same host, the same
  bytes through a bare gRPC stream in the proxy's message size (a client-streaming call for
  puts, a server-streaming one for reads) and through one TCP stream, each between two
  helper processes on loopback (pathways_bench.transfer's baselines);
- one optax (adam) step of a 4-layer MLP, data parallel over a mesh of the four devices
  (the batch, from the host every step, split over them; the parameters replicated), steps
  submitted back to back and the last loss waited for: on local JAX and through the proxy
  on each island. Every helper starts from the same parameters and batches, and their
  losses are compared.

Each round runs every case of a kind in turn, so that machine noise hits them alike.
"""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any, Callable, Sequence

from pathways import config
from pathways_bench import report

MiB = 1 << 20
SIZES = (1024, MiB, 16 * MiB, 64 * MiB)
TINY_SIZES = (1024, MiB)
MODES = ("pipelined", "blocking", "read")
CALLERS = ("proxy", "local", "native")
MOVERS = ("proxy", "local", "native", "grpc", "raw")
DIRECTIONS = ("device_put", "np.asarray")
GRPC_CALLS = {"device_put": "put", "np.asarray": "get"}  # the bare gRPC stream's call for each direction
DEVICES = 4
# The cluster's islands in order, (hosts, devices per host): the training runs on each
# through the proxy; calls and transfers on the first.
ISLANDS = {"1x4": (1, 4), "2x2": (2, 2)}
TRAINERS = ("local", *(f"proxy {name}" for name in ISLANDS))
# calls per sample: a few tenths of a second each on 2 cores
CALLS = {"proxy": 200, "local": 4000, "native": 100}
TINY_CALLS = {"proxy": 10, "local": 10, "native": 5}
TRAIN = {"layers": 4, "width": 256, "batch": 128, "lr": 1e-3}
TRAIN_STEPS, TINY_TRAIN_STEPS = 20, 2
TARGET_NATIVE = 0.8  # pipelined calls through the proxy, as a fraction of PW-O's rate
TARGET_GRPC = 0.8  # 64 MiB through the proxy, as a fraction of the bare gRPC stream's rate
TARGET_TRAIN = {"proxy 1x4": 1.5, "proxy 2x2": 3.0}  # a step's time, at most this times local JAX's
_SAMPLE_BYTES = 64 * MiB
_MAX_RUNS = 20
_TIMEOUT = 300.0  # the longest one command of a helper, or its start, may take
_IDLE_TIMEOUT = 900.0  # the longest a helper waits for its next command
_GRACE_SECONDS = 3.0
_VECTOR = 16

TITLE = "Unmodified JAX through the IFRT proxy: calls, transfers and training next to their baselines"
PAPER = ""
PAPER_RESULT = ""
ROUNDS = 5

ABOUT = f"""
The same plain JAX code runs in helper processes: two under `JAX_PLATFORMS=proxy` against a
local cluster with the IFRT front end, one on each of its islands (1 host x 4 devices, and
2 hosts x 2 devices, whose executables span both hosts), and one on local CPU JAX with 4
devices. Small `jit` calls (`x + 1` on {_VECTOR} int32, each output fed to the next call) are
timed pipelined (all calls, then one block on the last), blocking (a block after each) and
read (an `np.asarray` of each call's output) through the proxy, next to the same function as a `pw.jit` on a one-device slice of the
same island, called op by op from the native client ("PW-O"), and to local JAX.
`jax.device_put` of a host buffer and `np.asarray` of a device array (a fresh one per run)
are timed at 1 KiB to 64 MiB next to the native client's `pw.device_put` and `to_numpy` on
the same host ("PW native"), to the same bytes through a bare gRPC stream between two
processes on loopback in the proxy's message size (1 MiB; grpcio on raw bytes, a
client-streaming call for puts and a server-streaming one for reads, the receiver keeping
no byte), and to one TCP stream (`sendall`, `recv_into`, a one-byte ack). One optax adam
step of a {TRAIN['layers']}-layer MLP (width {TRAIN['width']}, batch {TRAIN['batch']} from the
host every step), data parallel over a `Mesh` of the 4 devices (the batch split over them,
the parameters replicated), steps back to back and the last loss waited for, on local JAX
and through the proxy on each island. Targets: pipelined calls through the proxy >=
{TARGET_NATIVE:g}x PW-O's rate; 64 MiB `device_put` and `np.asarray` through the proxy >=
{TARGET_GRPC:g}x the bare gRPC stream's rate; a training step through the proxy on 1 host x
4 devices <= {TARGET_TRAIN['proxy 1x4']:g}x local JAX's time, on 2 hosts x 2 devices <=
{TARGET_TRAIN['proxy 2x2']:g}x.
"""


def _runs(nbytes: int) -> int:
    return max(2, min(_MAX_RUNS, _SAMPLE_BYTES // max(nbytes, 1)))


def measure(rounds: int, tiny: bool, progress: report.Progress) -> dict[str, Any]:
    import pathways as pw
    from pathways.ifrt.server import LOOKUP_CHUNK
    from pathways_bench.transfer import LOOPBACK, Pair

    sizes = TINY_SIZES if tiny else SIZES
    calls = TINY_CALLS if tiny else CALLS
    steps = TINY_TRAIN_STEPS if tiny else TRAIN_STEPS
    progress.expect(2 + rounds * (len(MODES) + 2 * len(sizes) + 1))
    with contextlib.ExitStack() as stack:
        progress.step("starting a cluster of two islands with the IFRT front end, and the helpers")
        islands = [pw.Island(hosts=h, devices_per_host=d) for h, d in ISLANDS.values()]
        cluster = stack.enter_context(pw.local_cluster(islands=islands, ifrt=True))
        helpers = {"local": _Helper("local", {"JAX_PLATFORMS": "cpu", "JAX_NUM_CPU_DEVICES": str(DEVICES)})}
        for island, name in enumerate(ISLANDS):
            helpers[f"proxy {name}"] = _Helper(f"proxy {name}", {
                "JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": cluster.ifrt_address,
                config.SLICE.name: f"cpu:{DEVICES}@{island}"})
        for h in helpers.values():
            stack.callback(h.close)
        # JAX's client stores host buffers in 1 MiB messages, and the server answers lookups
        # in LOOKUP_CHUNK ones: the gRPC baseline moves the same messages
        grpc = {}
        for d, call in GRPC_CALLS.items():
            grpc[d] = Pair(["grpc-receive", str(LOOKUP_CHUNK), LOOPBACK], ["grpc-send", call, str(LOOKUP_CHUNK)])
            stack.callback(grpc[d].close)
        raw = Pair(["raw-receive", str(max(sizes)), LOOPBACK], ["raw-send", str(max(sizes))])
        stack.callback(raw.close)
        for name, h in helpers.items():  # the proxy on the second island only trains
            devices = h.wait_ready(max(sizes) if name in ("local", "proxy 1x4") else 0)
            if devices != DEVICES:
                raise RuntimeError(f"{h.what} has {devices} JAX devices; the benchmark runs on {DEVICES}")
        movers = {"proxy": helpers["proxy 1x4"], "local": helpers["local"]}
        native = _native(pw)
        progress.step("warming up: compiling, one of every transfer")
        jit_cases = _jit_cases(movers, native, calls)
        put_cases = {d: _transfer_cases(movers, native, grpc[d], raw, d, max(sizes)) for d in DIRECTIONS}
        train_cases = {name: _train_case(helpers[name]) for name in TRAINERS}
        for case in jit_cases.values():
            case()
        for cases in put_cases.values():
            for n in sizes:
                for case in cases.values():
                    case(n, 1)
        losses = {name: case(1)[1] for name, case in train_cases.items()}
        jit = {(mode, who): [] for mode in MODES for who in CALLERS}
        moved = {(d, n, who): [] for d in DIRECTIONS for n in sizes for who in MOVERS}
        trained: dict[str, list[float]] = {name: [] for name in train_cases}
        load = []  # the machine is shared: how busy it was says how far the figures carry
        for r in range(rounds):
            load.append(os.getloadavg()[0])
            for mode in MODES:
                progress.step(f"jit {mode} (round {r + 1}/{rounds})")
                for who in CALLERS:
                    jit[mode, who].append(jit_cases[mode, who]())
            for d in DIRECTIONS:
                for n in sizes:
                    progress.step(f"{d} {_size(n)} (round {r + 1}/{rounds})")
                    for who, case in put_cases[d].items():
                        moved[d, n, who].append(n / case(n, _runs(n)))
            progress.step(f"training (round {r + 1}/{rounds})")
            for name, case in train_cases.items():
                seconds, ls = case(steps)
                trained[name].append(seconds)
                losses[name] = losses[name] + ls
    return {**_report(jit, moved, trained, losses, sizes, calls, steps), "load": report.stats(load)}


class _Helper:
    """This file run as a script with ``env`` added to the environment (``name`` in errors):
    plain JAX taking a command per line (see :func:`_serve`), answering with one line of JSON."""

    def __init__(self, name: str, env: dict[str, str]) -> None:
        from pathways.cluster import child_log_env

        package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        path = os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))
        drop = ("JAX_PLATFORMS", "JAX_BACKEND_TARGET", "XLA_FLAGS", "JAX_NUM_CPU_DEVICES", config.SLICE.name)
        # child_log_env: its C++ logs follow --log-level as `pathways run`'s script's do, so that
        # the proxy client's harmless warnings (plain credentials, a stack trace at exit) stay off
        full = {**{k: v for k, v in os.environ.items() if k not in drop}, "PYTHONPATH": path,
                **child_log_env(), **env}
        self.what = f"the JAX helper ({name})"
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "serve"], env=full,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def wait_ready(self, capacity: int) -> int:
        """Its JAX devices, once it is set up (see :func:`_setup`)."""
        return self.ask("setup", capacity)

    def ask(self, *command: Any) -> Any:
        self.proc.stdin.write(" ".join(map(str, command)) + "\n")
        self.proc.stdin.flush()
        answer = json.loads(report.read_line(self.proc, _TIMEOUT, self.what))
        if "error" in answer:
            raise RuntimeError(f"{self.what}: {command[0]} failed: {answer['error']}")
        return answer["result"]

    def close(self) -> None:
        # it exits when its stdin closes
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(_GRACE_SECONDS + 10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(_GRACE_SECONDS)
        self.proc.stdout.close()


def _native(pw: Any) -> Any:
    """``x + 1`` as a ``pw.jit`` on a one-device slice of the default session's first island,
    where the proxy's calls and transfers run."""
    target = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=0)
    return target, pw.jit(lambda x: x + 1, mesh=target.mesh(("d",)))


def _jit_cases(helpers: dict[str, _Helper], native: Any, calls: dict[str, int]) -> dict[tuple[str, str], Callable[[], float]]:
    """Calls per second of each mode, by (mode, who): who one of CALLERS, ``helpers`` those
    that are helpers."""
    import numpy as np

    import pathways as pw

    target, fn = native

    def on_helper(who: str, mode: str) -> Callable[[], float]:
        return lambda: calls[who] / helpers[who].ask("jit", mode, calls[who])

    def natively(mode: str) -> Callable[[], float]:
        def run() -> float:
            n = calls["native"]
            x = pw.device_put(np.zeros(_VECTOR, np.int32), target.devices)
            start = time.perf_counter()
            for _ in range(n):
                x = fn(x)
                if mode == "blocking":
                    x.block_until_ready(timeout=_TIMEOUT)
                elif mode == "read":
                    np.asarray(x)
            value = np.asarray(x)
            elapsed = time.perf_counter() - start
            if not np.all(value == n):
                raise AssertionError(f"pathways computed {value}, expected {n} everywhere")
            return n / elapsed
        return run

    cases = {}
    for mode in MODES:
        cases[mode, "proxy"] = on_helper("proxy", mode)
        cases[mode, "local"] = on_helper("local", mode)
        cases[mode, "native"] = natively(mode)
    return cases


def _transfer_cases(helpers: dict[str, _Helper], native: Any, grpc: Any, raw: Any, direction: str,
                    capacity: int) -> dict[str, Callable[[int, int], float]]:
    """Seconds per run of moving ``n`` bytes, ``runs`` times, by who (MOVERS): ``helpers`` the
    proxy's and local JAX's, ``grpc`` the pair streaming in ``direction``'s gRPC call."""
    import numpy as np

    import pathways as pw

    command = "put" if direction == "device_put" else "get"
    target = native[0]
    buffer = np.ones(capacity // 4, np.float32)  # written now: no page faults are timed

    def put(n: int, runs: int) -> float:
        start = time.perf_counter()
        for _ in range(runs):
            pw.device_put(buffer[:n // 4], target.devices).block_until_ready(timeout=_TIMEOUT)
        return (time.perf_counter() - start) / runs

    def get(n: int, runs: int) -> float:
        arrays = [pw.device_put(buffer[:n // 4], target.devices) for _ in range(runs)]
        for a in arrays:
            a.block_until_ready(timeout=_TIMEOUT)
        start = time.perf_counter()
        for a in arrays:
            value = a.to_numpy(timeout=_TIMEOUT)
        elapsed = time.perf_counter() - start
        if value[-1] != 1.0:
            raise AssertionError(f"a {n}-byte read of pathways ended with {value[-1]}, not 1.0")
        return elapsed / runs

    return {"proxy": lambda n, runs: helpers["proxy"].ask(command, n, runs),
            "local": lambda n, runs: helpers["local"].ask(command, n, runs),
            "native": put if command == "put" else get,
            "grpc": grpc.seconds,
            "raw": raw.seconds}


def _train_case(helper: _Helper) -> Callable[[int], tuple[float, list[float]]]:
    def run(steps: int) -> tuple[float, list[float]]:
        answer = helper.ask("train", steps)
        return answer["seconds"], answer["losses"]
    return run


def _report(jit: dict, moved: dict, trained: dict, losses: dict, sizes: Sequence[int], calls: dict,
            steps: int) -> dict[str, Any]:
    n = min(len(v) for v in losses.values())
    return {
        "sizes": list(sizes), "calls": calls, "steps": steps, "train": TRAIN, "islands": ISLANDS,
        "jit": {mode: {who: report.stats(jit[mode, who]) for who in CALLERS} for mode in MODES},
        "transfers": {d: {str(n): {who: report.stats(moved[d, n, who]) for who in MOVERS}
                          for n in sizes} for d in DIRECTIONS},
        "train_seconds": {who: report.stats(v) for who, v in trained.items()},
        "losses": {"steps": n, "first": losses["local"][0], "last": losses["local"][n - 1],
                   "max_difference": {who: max(abs(a - b) for a, b in zip(losses[who][:n], losses["local"][:n]))
                                      for who in TRAINERS if who != "local"}},
    }


# ---- the report -----------------------------------------------------------------------


def tables(data: dict) -> list[report.Table]:
    jit = data["jit"]
    rows = [[mode, *(report.rate(jit[mode][w]) for w in CALLERS),
             report.times(report.ratio(jit[mode]["proxy"], jit[mode]["native"])),
             report.times(report.ratio(jit[mode]["proxy"], jit[mode]["local"]))] for mode in MODES]
    out = [report.Table(f"small jit calls per second (x + 1 on {_VECTOR} int32), median (min-max) of the rounds",
                        ["calls", "proxy", "local JAX", "PW-O", "proxy/PW-O", "proxy/local"], rows)]
    rows = []
    for d in DIRECTIONS:
        for n in data["sizes"]:
            r = data["transfers"][d][str(n)]
            rows.append([d, _size(n), *(report.rate(_mb(r[w]), 1) for w in MOVERS),
                         report.times(report.ratio(r["proxy"], r["grpc"])),
                         report.times(report.ratio(r["proxy"], r["raw"]))])
    out.append(report.Table("MB/s (10^6 bytes), median (min-max) of the rounds",
                            ["operation", "size", "proxy", "local JAX", "PW native", "bare gRPC", "raw TCP",
                             "proxy/gRPC", "proxy/raw"], rows))
    t = data["train_seconds"]
    out.append(report.Table(
        f"one optax step of a {data['train']['layers']}-layer MLP (width {data['train']['width']}, batch "
        f"{data['train']['batch']}) data parallel over {DEVICES} devices, ms per step, median (min-max) of the rounds",
        ["where", "ms per step", "time/local JAX"],
        [[_where(who, data["islands"]), report.rate(_ms(t[who]), 2), report.times(report.ratio(t[who], t["local"]))]
         for who in TRAINERS]))
    return out


def summary(data: dict) -> list[str]:
    jit = data["jit"]
    lines = report.unjudged(data) + [
        f"the machine's load average {data['load']['median']:.1f} (median of the rounds' starts)"]
    x = report.ratio(jit["pipelined"]["proxy"], jit["pipelined"]["native"])
    verdict = report.verdict(data, x >= TARGET_NATIVE, f"**missed** by {TARGET_NATIVE - x:.2f}x")
    lines.append(f"jit pipelined: the proxy makes {x:.2f}x the calls per second of pathways' native op-by-op path "
                 f"(target >= {TARGET_NATIVE:g}x): {verdict}; "
                 f"{report.ratio(jit['pipelined']['proxy'], jit['pipelined']['local']):.3f}x local JAX's")
    blocking = jit["blocking"]
    lines.append(f"jit blocking: the proxy makes {report.ratio(blocking['proxy'], blocking['native']):.2f}x pathways' "
                 f"native op-by-op path's calls per second, "
                 f"{report.ratio(blocking['proxy'], blocking['local']):.3f}x local JAX's")
    read = jit["read"]
    lines.append(f"jit read (a call, then np.asarray of its 64-byte output): {1e3 / read['proxy']['median']:.2f} ms "
                 f"through the proxy, {report.ratio(read['proxy'], read['native']):.2f}x pathways' native op-by-op "
                 f"path's calls per second")
    smallest, largest = str(min(data["sizes"])), str(max(data["sizes"]))
    lines.append(f"fixed cost of a {_size(int(smallest))} transfer through the proxy: " + ", ".join(
        f"{d} {1e3 * int(smallest) / data['transfers'][d][smallest]['proxy']['median']:.2f} ms" for d in DIRECTIONS)
        + " (bare gRPC: " + ", ".join(
        f"{1e3 * int(smallest) / data['transfers'][d][smallest]['grpc']['median']:.2f} ms" for d in DIRECTIONS) + ")")
    for d in DIRECTIONS:
        r = data["transfers"][d][largest]
        x = report.ratio(r["proxy"], r["grpc"])
        verdict = report.verdict(data, x >= TARGET_GRPC, f"**missed** by {TARGET_GRPC - x:.2f}x")
        lines.append(f"{d} of {_size(int(largest))}: {x:.2f}x the bare gRPC stream's rate "
                     f"(target >= {TARGET_GRPC:g}x): {verdict}; {report.ratio(r['proxy'], r['raw']):.2f}x raw TCP's, "
                     f"{report.ratio(r['proxy'], r['native']):.2f}x pathways' native client's")
    t, ls = data["train_seconds"], data["losses"]
    for who, target in TARGET_TRAIN.items():
        x = report.ratio(t[who], t["local"])
        verdict = report.verdict(data, x <= target, f"**missed** by {x - target:.2f}x")
        lines.append(f"training through the proxy on {_island(who, data['islands'])}: a step "
                     f"takes {x:.2f}x local JAX's time on {DEVICES} devices (target <= {target:g}x): {verdict}; over "
                     f"{ls['steps']} steps (loss {ls['first']:.4f} to {ls['last']:.4f}) its losses differ from local "
                     f"JAX's by at most {ls['max_difference'][who]:.2g}")
    return lines


def notes(data: dict) -> str:
    return """
Every proxy operation is a request on the client's gRPC stream to the front end in the
controller process, which turns it into requests of the native pathways session it opened
for the client (reaching the controller in its own process, without a gRPC hop): a `jit` call becomes a run the controller schedules and the worker executes,
a blocking call adds the client's wait for the result's ready future, so a proxy call costs
the native op-by-op path's work plus the front end's. The front end's runs ask the
controller to say when their outputs are computed, with the bytes of those of 4 KiB or less
that one worker holds whole, so that waiting for a call's output, or reading a small one,
asks no worker (the native op-by-op path asks its worker for both). A `device_put` crosses two processes
before it reaches the worker: the client's host-buffer store reaches the front end in 1 MiB
messages, and each is sent on to the worker as it arrives, on the worker's data listener
(raw TCP, as workers send each other arrays; arrays over 1 MiB that one worker holds whole);
smaller ones go there too, once whole. An `np.asarray` is answered at once,
and the worker's reply is forwarded to the client's `HostBufferLookup` as it arrives, in
1 MiB messages (each a copy into the message). The bare gRPC stream moves the same messages
between two processes and nothing else: it is what one gRPC hop costs, where the proxy makes
that hop and the data plane's, and the receiver keeps no byte, where the proxy's receivers
write every byte into an array. On local CPU JAX,
`np.asarray` returns a view of the device buffer without copying, so its rate is that of a
Python call, not of a transfer. A training step through the proxy is a `jit` call whose
batch is put from the host first, split in four (one host buffer per device), and on two
hosts one executable that runs on both. All of it shares the same 2 cores.
"""


def plot(data: dict, path: str) -> None:
    sizes = data["sizes"]
    series = []
    for d in DIRECTIONS:
        for who, label in (("proxy", "proxy"), ("native", "PW native"), ("grpc", "bare gRPC")):
            series.append((f"{d}, {label}", [n / MiB for n in sizes],
                           [data["transfers"][d][str(n)][who]["median"] / 1e6 for n in sizes]))
    series.append(("raw TCP, loopback", [n / MiB for n in sizes],
                   [data["transfers"]["device_put"][str(n)]["raw"]["median"] / 1e6 for n in sizes]))
    report.plot_lines(path, "Host transfers through the IFRT proxy", "array size (MiB)", "MB/s", series,
                      logx=True, logy=True)


def _where(who: str, islands: dict[str, list[int]]) -> str:
    """Where a trainer (one of TRAINERS) runs, in words."""
    return f"local JAX, {DEVICES} CPU devices" if who == "local" else f"proxy, {_island(who, islands)}"


def _island(who: str, islands: dict[str, list[int]]) -> str:
    """The island of a trainer through the proxy, in words."""
    hosts, devices = islands[who.removeprefix("proxy ")]
    return f"{hosts} host{'s' if hosts > 1 else ''} x {devices} devices"


def _mb(rate: dict[str, float]) -> dict[str, float]:
    return {k: v / 1e6 if k in ("median", "min", "max") else v for k, v in rate.items()}


def _ms(seconds: dict[str, float]) -> dict[str, float]:
    return {k: v * 1e3 if k in ("median", "min", "max") else v for k, v in seconds.items()}


def _size(n: int) -> str:
    return f"{n / MiB:g} MiB" if n >= MiB else f"{n / 1024:g} KiB"


# ---- the helper (this file run as a script) --------------------------------------------


def _serve() -> None:
    """Plain JAX answering commands on stdin, one line of JSON each (``{"result": ...}`` or
    ``{"error": ...}``): ``setup CAPACITY`` (its devices), ``jit MODE CALLS`` (seconds), ``put SIZE RUNS``
    and ``get SIZE RUNS`` (seconds per run), ``train STEPS`` (seconds per step and losses)."""
    if "proxy" in os.environ.get("JAX_PLATFORMS", "").split(","):
        from pathways.ifrt import plugin

        plugin.initialize()
    state: dict[str, Any] = {}
    commands = {"setup": _setup, "jit": _jit, "put": _put, "get": _get, "train": _train}
    with selectors.DefaultSelector() as sel:
        sel.register(sys.stdin, selectors.EVENT_READ)
        while sel.select(_IDLE_TIMEOUT) and (line := sys.stdin.readline()):
            name, *args = line.split() or [""]
            try:
                if name not in commands:
                    raise ValueError(f"unknown command {name!r}; the commands are {', '.join(commands)}")
                answer = {"result": commands[name](state, *args)}
            except Exception as e:  # noqa: BLE001 - reported to the benchmark, which stops
                answer = {"error": f"{type(e).__name__}: {e}"}
            print(json.dumps(answer), flush=True)


def _setup(state: dict, capacity: str) -> int:
    import jax
    import numpy as np

    state["buffer"] = np.ones(int(capacity) // 4, np.float32)  # written now: no page faults are timed
    state["step"] = jax.jit(lambda x: x + 1)
    state["step"](np.zeros(_VECTOR, np.int32)).block_until_ready()
    state["train"] = _make_train(jax, np)
    return len(jax.devices())


def _jit(state: dict, mode: str, calls: str) -> float:
    import jax
    import numpy as np

    n, step = int(calls), state["step"]
    x = jax.device_put(np.zeros(_VECTOR, np.int32))
    x.block_until_ready()
    start = time.perf_counter()
    for _ in range(n):
        x = step(x)
        if mode == "blocking":
            x.block_until_ready()
        elif mode == "read":
            np.asarray(x)
    x.block_until_ready()
    elapsed = time.perf_counter() - start
    if not np.all(np.asarray(x) == n):
        raise AssertionError(f"computed {np.asarray(x)}, expected {n} everywhere")
    return elapsed


def _put(state: dict, size: str, runs: str) -> float:
    import jax

    host = state["buffer"][:int(size) // 4]
    start = time.perf_counter()
    for _ in range(int(runs)):
        jax.device_put(host).block_until_ready()
    return (time.perf_counter() - start) / int(runs)


def _get(state: dict, size: str, runs: str) -> float:
    import jax
    import numpy as np

    n = int(size) // 4
    # fresh arrays: JAX keeps the host copy of an array it fetched once
    arrays = [jax.device_put(state["buffer"][:n]) for _ in range(int(runs))]
    jax.block_until_ready(arrays)
    start = time.perf_counter()
    for a in arrays:
        value = np.asarray(a)
    elapsed = time.perf_counter() - start
    if value[-1] != 1.0:
        raise AssertionError(f"a {size}-byte read ended with {value[-1]}, not 1.0")
    return elapsed / int(runs)


def _make_train(jax: Any, np: Any) -> dict[str, Any]:
    """The MLP, its adam state and step, from fixed seeds: the same in every helper. Data
    parallel over all the devices: the batch split over them, the rest replicated."""
    try:
        import optax
    except ImportError:
        raise ImportError('the training benchmark needs optax: pip install "pathways[bench]" (or optax)') from None
    from jax.sharding import Mesh, NamedSharding, PartitionSpec

    rs = np.random.RandomState(0)
    width, sizes = TRAIN["width"], [TRAIN["width"]] * (TRAIN["layers"] + 1)
    params = [{"w": (rs.standard_normal((m, k)) / np.sqrt(m)).astype(np.float32), "b": np.zeros(k, np.float32)}
              for m, k in zip(sizes[:-1], sizes[1:])]
    batches = [(rs.standard_normal((TRAIN["batch"], width)).astype(np.float32),
                rs.standard_normal((TRAIN["batch"], width)).astype(np.float32)) for _ in range(8)]
    opt = optax.adam(TRAIN["lr"])

    def loss(p, x, y):
        for layer in p[:-1]:
            x = jax.nn.relu(x @ layer["w"] + layer["b"])
        return ((x @ p[-1]["w"] + p[-1]["b"] - y) ** 2).mean()

    def step(p, s, x, y):
        value, grads = jax.value_and_grad(loss)(p, x, y)
        updates, s = opt.update(grads, s, p)
        return optax.apply_updates(p, updates), s, value

    mesh = Mesh(np.array(jax.devices()), ("data",))
    replicated, split = NamedSharding(mesh, PartitionSpec()), NamedSharding(mesh, PartitionSpec("data"))
    params = jax.device_put(params, replicated)
    return {"params": params, "opt": jax.device_put(opt.init(params), replicated), "done": 0, "batches": batches,
            "step": jax.jit(step, in_shardings=(replicated, replicated, split, split),
                            out_shardings=(replicated, replicated, replicated))}


def _train(state: dict, steps: str) -> dict[str, Any]:
    import numpy as np

    t = state["train"]
    losses = []
    start = time.perf_counter()
    for _ in range(int(steps)):
        x, y = t["batches"][t["done"] % len(t["batches"])]
        t["params"], t["opt"], value = t["step"](t["params"], t["opt"], x, y)
        t["done"] += 1
        losses.append(value)
    losses[-1].block_until_ready()
    elapsed = time.perf_counter() - start
    return {"seconds": elapsed / int(steps), "losses": [float(np.asarray(v)) for v in losses]}


if __name__ == "__main__":
    # The benchmark ends the helper by closing its stdin, also after a Ctrl-C that reached
    # the whole process group.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if sys.argv[1:] != ["serve"]:
        sys.exit(f"usage: {sys.argv[0]} serve (a helper of `python -m pathways bench ifrt`)")
    _serve()
