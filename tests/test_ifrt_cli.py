"""Wiring of the IFRT proxy front end: `controller --ifrt-bind`, `up --ifrt-port`,
`pw.local_cluster(ifrt=True)`, the jax_plugins entry point, and `pathways run`.

Scripts run in subprocesses with no pathways import: JAX finds the ``proxy`` backend
through the entry point pyproject.toml declares, written as an installed distribution's
record on their PYTHONPATH.
"""

import inspect
import json
import os
import re
import selectors
import signal
import socket
import subprocess
import sys
import textwrap
import time
import tomllib
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from ifrt_helpers import silent_streams
import pathways as pw
from pathways import config
from pathways.__main__ import main
from pathways.cluster import Island, LocalCluster, status, stop_processes
from pathways.defaults import ADDRESS_LINE, IFRT_LINE
from pathways.ifrt import launch, plugin
from pathways.proto.xla.python.ifrt_proxy.common import grpc_ifrt_service_pb2 as grpc_pb
from pathways.wire.addresses import split_host_port
from tests.conftest import connected_to, pids_alive, read_line, wait_until

ROOT = Path(__file__).resolve().parent.parent
START = 240  # seconds: a cluster starting on a busy machine



def children(pid):
    """The pids of ``pid``'s children and, where one is the process template of a local
    cluster (pathways/template.py), the processes it forked too (scripts run by `pathways run`
    get this function as well, to report the processes of their cluster)."""
    import os
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                template = b"pathways.template" in f.read()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(entry))
            if template:
                found += children(int(entry))
    return found


@pytest.fixture(scope="module")
def entry_point(tmp_path_factory):
    """A folder holding the distribution record that installing the package writes: the
    jax_plugins entry points of pyproject.toml."""
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["jax_plugins"]
    folder = tmp_path_factory.mktemp("entry_point")
    dist = folder / "pathways-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pathways\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text("[jax_plugins]\n" + "".join(f"{k} = {v}\n" for k, v in declared.items()))
    return folder


def proxy_env(target, entry_point=None, **extra):
    """The environment of a user's script under the proxy at ``target``: pathways importable
    (as if installed) and, with ``entry_point``, advertised to JAX; nothing else of ours."""
    paths = [str(entry_point)] if entry_point else []
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PATHWAYS_", "IFRT_PROXY_", "JAX_"))}
    env.update({"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": target,
                "PYTHONPATH": os.pathsep.join([*paths, str(ROOT)]), **extra})
    return env


def run_script(code, env, timeout=START, cwd=None):
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          env=env, timeout=timeout, cwd=cwd)


# ---- the plugin ---------------------------------------------------------------------------

def test_the_run_shim_advertises_what_pyproject_declares():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["entry-points"]["jax_plugins"]
    name, _, module = launch.ENTRY_POINT.partition(" = ")
    assert declared == {name: module} == {"pathways": "pathways.ifrt.plugin"}


def test_proxy_is_requested_only_when_named_among_the_platforms():
    assert plugin.requested("proxy") and plugin.requested("cpu, proxy") and plugin.requested("proxy,cpu")
    assert not plugin.requested(None) and not plugin.requested("") and not plugin.requested("cpu")
    assert not plugin.requested("proxyish,cpu")


def test_token_slice_and_weight_become_initialization_data():
    assert plugin.initialization_data({}) == {}
    assert plugin.initialization_data({"PATHWAYS_TOKEN": " t0k ", "PATHWAYS_SLICE": "cpu:2@1",
                                       "PATHWAYS_WEIGHT": "2"}) == \
        {"pathways_token": b"t0k", "pathways_slice": b"cpu:2@1", "pathways_weight": b"2"}
    assert plugin.initialization_data({"PATHWAYS_SLICE": ""}) == {}


def test_a_bad_connection_timeout_names_the_variable():
    name = config.PROXY_CONNECTION_TIMEOUT.name
    assert plugin.connection_timeout({}) is None and plugin.connection_timeout({name: "7"}) == 7
    for bad in ("0", "-3", "soon"):
        with pytest.raises(ValueError, match=f"{name}='{bad}': give a positive whole number"):
            plugin.connection_timeout({name: bad})


PROBE = """
    import os, jax
    from jax._src import xla_bridge
    try:
        jax.devices()
        print("devices", jax.default_backend())
    except RuntimeError as e:
        print("error", e)
    # jax >= 0.12 registers a proxy backend of its own; the question is whether it is ours
    factory = getattr(xla_bridge._backend_factories.get("proxy"), "factory", None)
    print("proxy registered", getattr(factory, "__module__", "").startswith("pathways."))
    print("insecure", os.environ.get("IFRT_PROXY_USE_INSECURE_GRPC_CREDENTIALS"))
"""

# What JAX does first when it makes its backends: run every plugin's initialize(). (Making
# them would try jax >= 0.12's own proxy client, which waits minutes for an absent server.)
REGISTRATION_PROBE = """
    from jax._src import xla_bridge
    xla_bridge.discover_pjrt_plugins()
    factory = getattr(xla_bridge._backend_factories.get("proxy"), "factory", None)
    print("proxy registered", getattr(factory, "__module__", "").startswith("pathways."))
"""


def test_the_entry_point_registers_proxy_only_when_asked(entry_point):
    env = proxy_env("grpc://127.0.0.1:1", entry_point, JAX_PLATFORMS="cpu")
    out = run_script(PROBE, env, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "devices cpu" in out.stdout and "proxy registered False" in out.stdout and "insecure None" in out.stdout


def test_plain_grpc_targets_get_insecure_credentials_and_others_do_not(entry_point):
    # nothing listens there: the client's own refusal says the backend was registered and tried
    env = proxy_env("grpc://127.0.0.1:1", entry_point, PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS="1")
    out = run_script(PROBE, env, timeout=120)
    assert "proxy registered True" in out.stdout and "insecure true" in out.stdout, out.stdout + out.stderr
    assert "Unable to establish connection to ifrt_proxy server" in out.stdout
    env = proxy_env("127.0.0.1:1", entry_point, PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS="1")
    out = run_script(PROBE, env, timeout=120)
    assert "proxy registered True" in out.stdout and "insecure None" in out.stdout, out.stdout + out.stderr


def test_without_the_entry_point_jax_knows_no_proxy_backend(tmp_path):
    # A record of the package with no entry points, first on the path, hides those of an
    # installed copy (Python reads one record per distribution name: the first it finds; the
    # script's working folder comes first of all, and a source tree may hold a build's record).
    dist = tmp_path / "pathways-0.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: pathways\nVersion: 0.1.0\n")
    out = run_script(REGISTRATION_PROBE, proxy_env("grpc://127.0.0.1:1", tmp_path), timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert "proxy registered False" in out.stdout, out.stdout + out.stderr


class _CapturingServer:
    """A GrpcIfrtService that answers GetVersion, records the session metadata the client
    sends, and refuses the session: enough to see what the plugin puts on the wire."""

    def __init__(self):
        self.metadata = []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        service = grpc_pb.DESCRIPTOR.services_by_name["GrpcIfrtService"].full_name
        handlers = {
            "GetVersion": grpc.unary_unary_rpc_method_handler(
                self.get_version, grpc_pb.GrpcGetVersionRequest.FromString,
                grpc_pb.GrpcGetVersionResponse.SerializeToString),
            "IfrtSession": grpc.stream_stream_rpc_method_handler(self.session, lambda b: b, lambda b: b),
        }
        self.server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(service, handlers)])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def get_version(self, request, context):
        reply = grpc_pb.GrpcGetVersionResponse()
        reply.version.CopyFrom(request.max_version)
        return reply

    def session(self, requests, context):
        for key, value in context.invocation_metadata():
            if key == "ifrt-proxy-grpc-ifrt-session-metadata-bin":
                self.metadata.append(grpc_pb.GrpcIfrtSessionMetadata.FromString(value))
        context.abort(grpc.StatusCode.PERMISSION_DENIED, "captured")


def test_token_and_slice_reach_the_server_as_session_initialization_data(entry_point):
    capture = _CapturingServer()
    try:
        env = proxy_env(f"grpc://127.0.0.1:{capture.port}", entry_point, PATHWAYS_TOKEN="s3cret",
                        PATHWAYS_SLICE="cpu:2", PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS="5")
        out = run_script(PROBE, env, timeout=120)
        assert capture.metadata, out.stdout + out.stderr
        attributes = capture.metadata[0].initialization_data.attributes
        assert attributes["pathways_token"].string_value == b"s3cret"
        assert attributes["pathways_slice"].string_value == b"cpu:2"
    finally:
        capture.server.stop(0)


# ---- the controller and `up` ----------------------------------------------------------------

def _listening(address):
    host, port = split_host_port(address.removeprefix("grpc://"))
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def test_controller_with_ifrt_bind_prints_both_addresses_and_stops_both():
    proc = subprocess.Popen([sys.executable, "-m", "pathways", "controller", "--ifrt-bind", "127.0.0.1:0"],
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        # one write holds both lines: the second is in the reader's buffer already
        first, second = read_line(proc, START).split(), proc.stdout.readline().split()
        assert first[0] == ADDRESS_LINE and second[0] == IFRT_LINE
        assert re.fullmatch(r"grpc://127\.0\.0\.1:\d+", second[1]), second
        assert second[1] != first[1] and _listening(second[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        assert not _listening(second[1]) and not _listening(first[1])
    finally:
        stop_processes([proc])


def test_ifrt_bind_beyond_loopback_without_a_token_is_refused_before_anything_listens():
    env = {k: v for k, v in os.environ.items() if k != "PATHWAYS_TOKEN"}
    out = subprocess.run([sys.executable, "-m", "pathways", "controller", "--ifrt-bind", "0.0.0.0:0"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and ADDRESS_LINE not in out.stdout
    assert "--ifrt-bind" in out.stderr and "beyond loopback, without a token" in out.stderr
    assert "--token-file" in out.stderr and "PATHWAYS_TOKEN" in out.stderr


def test_up_with_ifrt_port_serves_the_proxy_and_stops_every_process(entry_point):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "pathways", "up", "--islands", "1x2", "--ifrt-port", str(port)],
                            stdout=subprocess.PIPE, text=True)
    try:
        first = read_line(proc, START)
        assert first.startswith("pathways cluster up at grpc://")
        line = proc.stdout.readline()  # printed in the same write
        target = f"grpc://127.0.0.1:{port}"
        assert f"IFRT proxy at {target}" in line and f"JAX_BACKEND_TARGET={target}" in line
        pids = children(proc.pid)
        assert len(pids) == 3, "the process template, the controller and one worker"
        out = run_script("import jax, numpy as np; print(len(jax.devices()), jax.process_count(), "
                         "np.asarray(jax.device_put(np.ones(8, np.float32))).sum())", proxy_env(target, entry_point))
        assert out.returncode == 0 and out.stdout.split() == ["2", "1", "8.0"], out.stderr
        # the status counts the array bytes the front end moved: the put's and the read's 32
        controller = re.search(r"grpc://\S+?(?=;|$)", first).group(0)
        shown = subprocess.run([sys.executable, "-m", "pathways", "status", "--address", controller],
                               capture_output=True, text=True, timeout=60)
        assert "IFRT front end: array bytes 32 from clients, 32 to them; 32 to workers, 32 from them" in shown.stdout, \
            shown.stdout + shown.stderr
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
        wait_until(lambda: not pids_alive(pids), 10, "the cluster's processes to exit")
    finally:
        stop_processes([proc])


# ---- pw.local_cluster(ifrt=True) ------------------------------------------------------------

@pytest.fixture(scope="module")
def ifrt_cluster():
    with pw.local_cluster(islands=[pw.Island(1, 2)], ifrt=True) as c:
        pids = list(c.pids)
        yield c
    assert pids_alive(pids) == [], "the local cluster left processes behind"
    assert not _listening(c.ifrt_address)


JIT = """
    import jax, jax.numpy as jnp, numpy as np
    x = jnp.arange(6.0).reshape(2, 3)
    y = jax.jit(lambda a: (a * 2 + 1).sum(axis=0))(x)
    print(len(jax.devices()), jax.devices()[0].platform, np.asarray(y).tolist())
"""


def test_local_cluster_serves_unmodified_jax_through_the_entry_point(ifrt_cluster, entry_point):
    assert re.fullmatch(r"grpc://127\.0\.0\.1:\d+", ifrt_cluster.ifrt_address)
    out = run_script(JIT, proxy_env(ifrt_cluster.ifrt_address, entry_point))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "2 cpu [8.0, 12.0, 16.0]"


def test_pathwaysutils_initialize_works_with_the_entry_point_installed(ifrt_cluster, entry_point):
    # pathwaysutils registers its own factory first; the plugin's, with plain-gRPC credentials, wins
    out = run_script("import pathwaysutils; pathwaysutils.initialize()\n" + textwrap.dedent(JIT),
                     proxy_env(ifrt_cluster.ifrt_address, entry_point))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "2 cpu [8.0, 12.0, 16.0]"


# ---- `pathways run` ----------------------------------------------------------------------

def run_cli(*args, timeout=START + 120, **extra_env):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "IFRT_PROXY_", "PATHWAYS_TRACE"))}
    env["PYTHONPATH"] = str(ROOT)  # from the source tree, not installed: `run` supplies the entry point
    env.update(extra_env)
    return subprocess.run([sys.executable, "-m", "pathways", "run", *args], capture_output=True, text=True,
                          timeout=timeout, env=env)


def _script(tmp_path, body):
    path = tmp_path / "script.py"
    path.write_text(inspect.getsource(children) + textwrap.dedent(body))
    return str(path)


def test_run_passes_the_script_exit_code_through_and_stops_the_cluster(tmp_path):
    script = _script(tmp_path, """
        import os, sys
        import jax
        print("devices", len(jax.devices()), "args", sys.argv[1:])
        print("cluster", *children(os.getppid()))
        sys.exit(3)
    """)
    out = run_cli("--islands", "1", "--devices-per-host", "3", script, "a", "--b")
    assert out.returncode == 3, out.stderr
    assert "devices 3 args ['a', '--b']" in out.stdout
    pids = [int(p) for p in re.search(r"cluster (.*)", out.stdout)[1].split()]
    assert len(pids) == 4, out.stdout  # the process template, the controller, the worker and the script itself
    assert pids_alive(pids) == []


def test_run_stops_the_cluster_when_the_script_crashes(tmp_path):
    script = _script(tmp_path, """
        import os
        print("cluster", *children(os.getppid()), flush=True)
        raise RuntimeError("the script failed")
    """)
    out = run_cli("--islands", "1x1", script)
    assert out.returncode == 1 and "RuntimeError: the script failed" in out.stderr
    pids = [int(p) for p in re.search(r"cluster (.*)", out.stdout)[1].split()]
    assert pids_alive(pids) == []


def test_run_on_interrupt_stops_the_script_and_the_cluster(tmp_path):
    script = _script(tmp_path, """
        import os, time
        import jax
        jax.devices()
        print("cluster", *children(os.getppid()), flush=True)
        time.sleep(120)
    """)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_", "IFRT_PROXY_"))}
    # PYTHONFAULTHANDLER: should `run` not exit, SIGABRT has it print where each thread is
    with open(tmp_path / "stderr", "w+") as stderr:
        proc = subprocess.Popen([sys.executable, "-m", "pathways", "run", "--islands", "1x1", script],
                                stdout=subprocess.PIPE, stderr=stderr, text=True,
                                env={**env, "PYTHONPATH": str(ROOT), "PYTHONFAULTHANDLER": "1"})
        try:
            pids = [int(p) for p in read_line(proc, START).split()[1:]]
            proc.send_signal(signal.SIGINT)  # to `run` alone: it passes the interrupt on
            try:
                code = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGABRT)
                proc.wait(timeout=30)
                stderr.seek(0)
                pytest.fail(f"`pathways run` still ran 60 s after the interrupt; its stderr:\n{stderr.read()}")
            assert code == 128 + signal.SIGINT
            wait_until(lambda: not pids_alive(pids), 10, "the script and the cluster to exit")
        finally:
            stop_processes([proc])


def test_run_trains_the_example_mlp_with_a_decreasing_loss():
    out = run_cli("--islands", "1x1", str(ROOT / "examples" / "train_mlp.py"), "--steps", "100", "--every", "25")
    assert out.returncode == 0, out.stderr
    losses = [float(x) for x in re.findall(r"loss ([0-9.]+)", out.stdout)]
    assert len(losses) == 5, out.stdout
    # the proxy client's C++ warnings (plain credentials, its session cancelled at exit) stay off
    assert "insecure client credentials" not in out.stderr and "Stack trace" not in out.stderr, out.stderr
    assert all(a > b for a, b in zip(losses, losses[1:])), losses


def test_run_with_pathways_trace_names_each_proxy_run_and_compile_by_its_function(tmp_path):
    path = tmp_path / "run.json"
    out = run_cli("--islands", "1x1", str(ROOT / "examples" / "train_mlp.py"), "--steps", "3", "--every", "1",
                  PATHWAYS_TRACE=str(path))
    assert out.returncode == 0, out.stderr
    events = json.loads(path.read_text())["traceEvents"]
    names = {e["pid"]: e["args"]["name"] for e in events if e.get("name") == "process_name"}
    # rows by what the cluster calls each process, not by network address
    assert sorted(n.split(" (pid")[0] for n in names.values()) == [
        "client IFRT proxy", "controller", "worker 0, island 0 host 0"], names
    spans = [(names[e["pid"]].split()[0], e["name"], e["args"].get("detail"), e["args"].get("run"))
             for e in events if e["ph"] == "X"]
    # the script's `step` (the module jit_step): compiled once, then 3 runs, each submitted,
    # dispatched and executed under that name
    assert [d for _, n, d, _ in spans if n == "compile"].count("step") == 1, spans
    runs = {r for p, n, d, r in spans if p == "client" and n == "submit" and d == "step"}
    assert len(runs) == 3, spans
    assert runs == {r for p, n, d, r in spans if p == "worker" and n == "execute" and d == "step"}
    assert runs <= {r for p, n, _, r in spans if p == "controller" and n == "dispatch"}
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    summary = subprocess.run([sys.executable, "-m", "pathways", "trace", str(path)], capture_output=True, text=True,
                             timeout=120, env=env)
    assert summary.returncode == 0, summary.stderr
    assert re.search(r"^execute +step +3 ", summary.stdout, re.MULTILINE), summary.stdout
    assert re.search(r"^compile +step +1 ", summary.stdout, re.MULTILINE), summary.stdout


def test_run_with_pathways_trace_writes_the_timeline_when_the_script_exits_with_a_run_in_flight(tmp_path):
    # the script's last run is still computing as it exits, so the server's session collects
    # (waiting for that run on the worker) while `run` stops the cluster: it must finish first
    script = _script(tmp_path, """
        import jax, jax.numpy as jnp
        def slow(a):
            for _ in range(30):
                a = jnp.tanh(a @ a)
            return a
        jax.jit(slow)(jnp.ones((1500, 1500)))
    """)
    path = tmp_path / "run.json"
    out = run_cli("--islands", "1x1", script, PATHWAYS_TRACE=str(path))
    assert out.returncode == 0, out.stderr
    assert path.exists(), out.stderr
    events = json.loads(path.read_text())["traceEvents"]
    assert any(e["ph"] == "X" and e["name"] == "execute" and e["args"].get("detail") == "slow" for e in events)


def test_bench_ifrt_keeps_the_proxy_clients_warnings_off_the_terminal(ifrt_cluster, capfd, monkeypatch):
    # `bench ifrt` runs a plain JAX helper under the proxy, whose stderr is the terminal's
    from pathways_bench import ifrt as bench_ifrt

    monkeypatch.delenv("PATHWAYS_LOG_LEVEL", raising=False)  # the default level, as a user has it
    helper = bench_ifrt._Helper("proxy", {"JAX_PLATFORMS": "proxy", "JAX_BACKEND_TARGET": ifrt_cluster.ifrt_address})
    try:
        assert helper.wait_ready(4096) == 2  # the cluster's devices: the training's mesh is all of them
        assert helper.ask("jit", "blocking", 2) > 0
    finally:
        helper.close()
    assert helper.proc.returncode == 0
    err = capfd.readouterr().err
    assert "insecure client credentials" not in err and "Stack trace" not in err, err


def test_run_names_a_missing_script(capsys, monkeypatch):
    # in this process: refused before any cluster starts (main sets the children's log level
    # in the environment, which monkeypatch restores)
    monkeypatch.setenv("PATHWAYS_LOG_LEVEL", os.environ.get("PATHWAYS_LOG_LEVEL", "error"))
    assert main(["run", "no_such_script.py"]) == 2
    assert "no such script: 'no_such_script.py'" in capsys.readouterr().err


# ---- a cluster with a token and TLS ---------------------------------------------------------

TOKEN = "ifrt-test-token"


@pytest.fixture(scope="module")
def guarded_cluster(tmp_path_factory):
    """One host of two devices, with a token and TLS (its data plane too), its controller
    serving the IFRT proxy."""
    from pathways.wire.certs import make_certificates
    from pathways.wire.security import Security

    tls = make_certificates(str(tmp_path_factory.mktemp("tls")))
    security = Security(token=TOKEN, tls_cert=tls.cert, tls_key=tls.key, tls_ca=tls.ca, data_plane_tls=True)
    cluster = LocalCluster([Island(1, 2)], security=security, ifrt_port=0).start()
    try:
        yield cluster
    finally:
        cluster.stop()
    assert pids_alive(cluster.pids) == [], "the local cluster left processes behind"


def test_with_token_and_tls_the_proxy_port_is_plain_grpc_and_takes_the_token(guarded_cluster, entry_point):
    out = run_script(JIT, proxy_env(guarded_cluster.ifrt_address, entry_point, PATHWAYS_TOKEN=TOKEN))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "2 cpu [8.0, 12.0, 16.0]"
    # the refusal answers the client's first request (init) with the advice; the client
    # retries for its connection timeout, then raises the last answer
    out = run_script(JIT, proxy_env(guarded_cluster.ifrt_address, entry_point, PATHWAYS_TOKEN="another-token",
                                    PATHWAYS_PROXY_CONNECTION_TIMEOUT_SECS="5"))
    assert out.returncode != 0 and "Unable to initialize backend 'proxy'" in out.stderr
    assert "requires the cluster's shared token" in out.stderr and "PATHWAYS_TOKEN" in out.stderr, out.stderr


def test_with_a_tls_data_plane_large_arrays_reach_their_worker_and_round_trip(guarded_cluster, entry_point):
    # the front end streams an array one worker holds whole to that worker's data listener,
    # here over TLS, greeted with the token and the controller's ticket
    script = """
        import jax, numpy as np
        x = np.random.default_rng(0).standard_normal((768, 1024)).astype(np.float32)  # 3 MiB
        print(all(np.array_equal(np.asarray(jax.device_put(x + i, d)), x + i) for i, d in enumerate(jax.devices())))
    """
    out = run_script(script, proxy_env(guarded_cluster.ifrt_address, entry_point, PATHWAYS_TOKEN=TOKEN))
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "True"
    data_port = int(status(guarded_cluster.address, security=guarded_cluster.security)["workers"][0][
        "data_address"].rsplit(":", 1)[1])
    assert connected_to(guarded_cluster.pids[0], data_port), "the front end put on the worker's data listener"


# A JAX program that waits for a line on stdin before it first reaches the server
# (its first array opens its session), then prints its result.
JIT_ON_CUE = """
    import json, sys
    import jax, jax.numpy as jnp, numpy as np
    print("ready", flush=True)
    sys.stdin.readline()
    y = jax.jit(lambda a: (a * 2 + 1).sum(axis=0))(jnp.arange(6.0).reshape(2, 3))
    print(json.dumps({"y": np.asarray(y).tolist()}), flush=True)
"""


def _threads(pid):
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("Threads:")).split()[1])


def test_streams_without_the_token_leave_the_controller_serving_a_client_with_it(guarded_cluster, entry_point):
    """70 IFRT session streams opened without the token, sending nothing, each opened again
    a second after it ends, at the controller's IFRT front end. None is given a session, nor
    a thread beyond a few for seconds (MAX_REFUSED_STREAMS are kept REFUSED_SECONDS to say
    why, the rest end at once), so a JAX program with the token, started meanwhile, runs its
    jit within seconds, and the controller's threads grow by the server's pool at most."""
    from pathways.ifrt.server import MAX_REFUSED_STREAMS, POOL_THREADS

    controller = guarded_cluster.pids[0]

    def sessions():
        return len(status(guarded_cluster.address, security=guarded_cluster.security)["sessions"])

    client = subprocess.Popen([sys.executable, "-c", textwrap.dedent(JIT_ON_CUE)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env=proxy_env(guarded_cluster.ifrt_address, entry_point, PATHWAYS_TOKEN=TOKEN))
    try:
        assert read_line(client, timeout=START).strip() == "ready", client.stderr.read()[-3000:]
        threads, open_sessions = _threads(controller), sessions()
        peak = threads
        with silent_streams(guarded_cluster.ifrt_address.removeprefix("grpc://"), 70, reopen_after=1.0) as (_, ended):
            wait_until(lambda: len(ended) >= 70 - MAX_REFUSED_STREAMS, 10,
                       "the streams beyond the few kept to end at once")
            assert set(ended[:70 - MAX_REFUSED_STREAMS]) == {grpc.StatusCode.UNAUTHENTICATED}
            assert sessions() == open_sessions, "a caller without the token was given a session"
            client.stdin.write("\n")
            client.stdin.flush()
            with selectors.DefaultSelector() as sel:
                sel.register(client.stdout, selectors.EVENT_READ)
                deadline = time.monotonic() + 30
                while not sel.select(0.1):
                    peak = max(peak, _threads(controller))
                    assert time.monotonic() < deadline, "the program with the token was not served within 30 s"
            served = client.stdout.readline()
        assert served.startswith("{"), client.stderr.read()[-3000:]
        assert json.loads(served)["y"] == [8.0, 12.0, 16.0]
        # the server's pool (64 threads, some there before), the kept streams' timers, and
        # the honest session's reader and pool
        assert peak - threads <= 64 + MAX_REFUSED_STREAMS + 1 + POOL_THREADS, (threads, peak)
    finally:
        stop_processes([client])


def test_ifrt_bind_with_a_certificate_but_no_ca_is_refused(tmp_path):
    from pathways.wire.certs import make_certificates

    tls = make_certificates(str(tmp_path))
    out = subprocess.run([sys.executable, "-m", "pathways", "controller", "--ifrt-bind", "127.0.0.1:0",
                          "--tls-cert", tls.cert, "--tls-key", tls.key], capture_output=True, text=True,
                         timeout=120, env={k: v for k, v in os.environ.items() if k != "PATHWAYS_TLS_CA"})
    assert out.returncode != 0 and ADDRESS_LINE not in out.stdout
    assert "--ifrt-bind with --tls-cert needs --tls-ca" in out.stderr

