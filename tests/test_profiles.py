"""Profiles of the workers: a worker's Profile method over real gRPC against hostile
callers, and ``jax.profiler`` around a proxied training step (and pathwaysutils' own
profile request) writing every worker's XLA trace beside the client's."""

import os

import pytest

import pathways as pw
from pathways.errors import AccessDeniedError
from pathways.ifrt import profiling
from pathways.ifrt import types as t
from pathways.protocol import messages as m
from pathways.protocol import operator
from pathways.worker.core import WorkerCore
from tests.conftest import wait_until
from tests.ifrt_helpers import run_jax
from tests.test_worker_core import served as worker_served

CREDENTIAL = b"7" * m.CREDENTIAL_BYTES  # session 7's
OTHER = b"8" * m.CREDENTIAL_BYTES  # session 8's


@pytest.fixture
def served(tmp_path):
    """A worker core allowed ``tmp_path`` for files, behind a real gRPC server in this
    process; its Profile stub."""
    core = WorkerCore(lambda msg: None, wait_timeout=5.0, checkpoint_dir=str(tmp_path))
    with worker_served(core, {7: CREDENTIAL, 8: OTHER}) as stub:
        yield core, stub("Profile")


def call(stub, session, credential, start, path, run="run1"):
    request = m.ProfileRequest(session, credential, start, path, run)
    return operator.answer(operator.PROFILED_REPLY, stub(m.pack(request.encode()), timeout=60.0))


def test_a_worker_profiles_its_process_for_one_session_at_a_time_and_writes_where_allowed(served, tmp_path):
    import jax
    import jax.numpy as jnp

    core, stub = served
    with pytest.raises(pw.RemoteError, match="takes no profile for session 7: start one first"):
        call(stub, 7, CREDENTIAL, False, "p")
    with pytest.raises(AccessDeniedError, match="only under"):
        call(stub, 7, CREDENTIAL, True, "/etc/profiles")
    with pytest.raises(AccessDeniedError, match="not that session's"):
        call(stub, 7, OTHER, True, "p")
    assert call(stub, 7, CREDENTIAL, True, "gs://bucket/p").files == ()
    with pytest.raises(pw.RemoteError, match="taking a profile already, for session 7"):
        call(stub, 8, OTHER, True, "q")  # one at a time per process
    with pytest.raises(pw.RemoteError, match="takes no profile for session 8"):
        call(stub, 8, OTHER, False, "q")  # nor may another session stop it
    jax.jit(lambda x: jnp.tanh(x @ x).sum())(jnp.ones((8, 8))).block_until_ready()
    files = call(stub, 7, CREDENTIAL, False, "gs://bucket/p", run="../my run").files
    assert {os.path.dirname(f) for f in files} == {"plugins/profile/my_run"}, files
    assert any(f.endswith(".xplane.pb") and os.path.basename(f).startswith("worker-") for f in files), files
    assert all((tmp_path / "bucket" / "p" / f).is_file() for f in files)
    assert not [n for n in os.listdir(tmp_path / "bucket" / "p") if n.endswith(".partial")], "no scratch is left"
    call(stub, 8, OTHER, True, "q")  # the process's profiler is free again
    core.on_batch(m.encode_batch([m.DropSession(8, ())]))  # a session that goes stops its profile
    call(stub, 7, CREDENTIAL, True, "p")
    call(stub, 7, CREDENTIAL, False, "p")


def test_profile_requests_parse_and_malformed_ones_are_refused_saying_why():
    program = profiling.profile_program({"traceLocation": "gs://b/p", "maxNumHosts": 2,
                                         "xprofTraceOptions": {"traceSessionName": "s1"}})
    assert (program.location, program.run, program.max_hosts, program.result) == ("gs://b/p", "s1", 2, True)
    assert profiling.profile_program({"traceLocation": "d", "traceSessionName": "s2"}).run == "s2"
    for bad in ([], {}, {"traceLocation": 3}, {"traceLocation": "d", "maxNumHosts": -1},
                {"traceLocation": "d", "xprofTraceOptions": "x"}):
        with pytest.raises(t.IfrtError):
            profiling.profile_program(bad)


# ---- through the IFRT proxy, on two hosts -----------------------------------------------------

SCRIPT = """
import glob, json, os
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

mesh = Mesh(np.array(jax.devices()).reshape(2, 2), ("a", "b"))
w = jax.device_put(np.ones((64, 64), np.float32), NamedSharding(mesh, P(None, "b")))
x = jax.device_put(np.ones((32, 64), np.float32), NamedSharding(mesh, P("a")))

@jax.jit
def train_step(w, x):
    return w - 0.1 * jax.grad(lambda w: jnp.tanh(x @ w).sum())(w)

with jax.profiler.trace(TRACE_DIR):
    for _ in range(3):
        w = train_step(w, x)
    w.block_until_ready()

# pathwaysutils' own request, as its patch sends it (to a gs:// location on Cloud)
from pathwaysutils import profiling
options = jax.profiler.ProfileOptions()
options.session_id = "pathwaysutils_run"
profiling._start_pathways_trace_from_profile_request(profiling._create_profile_request(
    os.path.join(TRACE_DIR, "pw"), options, max_num_hosts=1))
# then, as its patch does, JAX's start_trace for the client's own trace: here the one that
# profiles the workers too, which leaves them to pathwaysutils
jax.profiler.start_trace(os.path.join(TRACE_DIR, "client"), profiler_options=options)
train_step(w, x).block_until_ready()
with profiling._profile_state.lock:
    profiling._profile_state.call_profile_executable()
    profiling._profile_state.reset()
jax.profiler.stop_trace()
files = sorted(os.path.relpath(f, TRACE_DIR) for f in glob.glob(os.path.join(TRACE_DIR, "**", "*.xplane.pb"),
                                                                 recursive=True))
print("RESULT " + json.dumps({"files": files}))
"""


def test_jax_profiler_around_a_proxied_step_writes_every_workers_xla_trace_beside_the_clients(tmp_path):
    root = tmp_path / "files"
    root.mkdir()
    trace_dir = root / "trace"
    pathwaysutils_run = trace_dir / "pw" / "plugins" / "profile" / "pathwaysutils_run"
    with pw.local_cluster(hosts=2, devices_per_host=2, ifrt=True, checkpoint_dir=str(root)) as cluster:
        result = run_jax(cluster.ifrt_address.removeprefix("grpc://"),
                         SCRIPT.replace("TRACE_DIR", repr(str(trace_dir))))
        # pathwaysutils' stop does not wait for the workers to write their traces
        wait_until(lambda: pathwaysutils_run.is_dir() and any(n.endswith(".xplane.pb")
                                                               for n in os.listdir(pathwaysutils_run)),
                   timeout=60, what="the worker to write pathwaysutils' trace")
    runs = {}
    for f in result["files"]:
        runs.setdefault(os.path.dirname(f), []).append(os.path.basename(f))
    # jax.profiler.trace: the client's own trace and each worker's, in one run
    (run, names), = [(r, n) for r, n in runs.items() if r.startswith("plugins")]
    workers = sorted(n for n in names if n.startswith("worker-"))
    assert [n.split(".")[0] for n in workers] == ["worker-0", "worker-1"] and len(names) == 3, runs
    for name in workers:  # each host ran the sharded step: its XLA program and operations are in its trace
        raw = (trace_dir / run / name).read_bytes()
        assert b"jit_train_step" in raw and (b"fusion" in raw or b"dot" in raw), name
    # pathwaysutils' request, under the run it named, from one host as it asked, the client's
    # own trace where it asked for it
    client = runs["client/plugins/profile/pathwaysutils_run"]
    assert len(client) == 1 and not client[0].startswith("worker-"), runs  # the workers were asked once
    assert len({n.split(".")[0] for n in os.listdir(pathwaysutils_run)}) == 1, os.listdir(pathwaysutils_run)
