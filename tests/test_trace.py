"""Timelines (``pw.trace``, ``PATHWAYS_TRACE``, ``pathways trace``) on a real local cluster:
two one-host islands, so that a program's value crosses the data plane."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import pathways as pw
from pathways.errors import AccessDeniedError, WireError
from pathways.protocol import messages as m, operator
from pathways.protocol.handles import first_handle
from pathways.client.timeline import Recording
from pathways.timeline import MAX_EVENTS, Clock, Process, Recorder, chrome_trace, function_label, now
from pathways.timeline_view import Span, functions, summary
from pathways.wire import rpc
from tests.conftest import connected, running_cluster

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def cluster():
    yield from running_cluster(pw.Island(hosts=1, devices_per_host=1), pw.Island(hosts=1, devices_per_host=1))


@pytest.fixture(scope="module")
def session(cluster):
    yield from connected(cluster)


@pytest.fixture(scope="module")
def program(session):
    """``x -> (x + 1) * 2``: the first node on island 0, the second on island 1."""
    vds = pw.make_virtual_device_set()
    a, b = vds.add_slice(cpu_devices=1, island=0), vds.add_slice(cpu_devices=1, island=1)
    assert a.workers != b.workers
    inc = pw.jit(lambda x: x + 1.0, mesh=a.mesh("d"))
    dbl = pw.jit(lambda x: x * 2.0, mesh=b.mesh("d"))

    @pw.program
    def chain(x):
        return dbl(inc(x))

    assert float(np.asarray(chain(np.float32(1)))) == 4.0  # traced and compiled before any timeline
    return chain, (a, b)


def _load(path):
    data = json.loads(Path(path).read_text())
    names = {e["pid"]: e["args"]["name"] for e in data["traceEvents"] if e.get("name") == "process_name"}
    spans = [{**e, "process": names[e["pid"]]} for e in data["traceEvents"] if e["ph"] == "X"]
    return data, names, spans


def _runs(spans, kind, name):
    """run -> the first span called ``name`` of it on each process of ``kind``."""
    out = {}
    for s in spans:
        if s["process"].startswith(kind) and s["name"] == name and "run" in s["args"]:
            out.setdefault(s["args"]["run"], {}).setdefault(s["process"], s)
    return out


def test_every_run_appears_on_every_process_in_causal_order(program, tmp_path):
    chain, (a, b) = program
    path = tmp_path / "run.json"
    with pw.trace(str(path)):
        y = np.float32(1)
        for _ in range(3):
            y = chain(y)
        assert float(np.asarray(y)) == 22.0
    data, names, spans = _load(path)
    kinds = sorted(n.split()[0] for n in names.values())
    assert kinds == ["client", "controller", "worker", "worker"], names
    workers = [n for n in names.values() if n.startswith("worker")]
    # rows named as the cluster names the workers: id, island, host rank (not their addresses)
    assert sorted(w.split(" (pid")[0] for w in workers) == sorted(
        f"worker {w}, island {s.island} host 0" for s in (a, b) for w in s.workers), workers
    submits = _runs(spans, "client", "submit")
    assert len(submits) == 3
    dispatches = _runs(spans, "controller", "dispatch")
    executes = _runs(spans, "worker", "execute")
    fetch = next(s for s in spans if s["process"].startswith("client") and s["name"] == "fetch")
    error = data["otherData"]["clock_error_us"]
    for run, on_client in submits.items():
        submit = next(iter(on_client.values()))
        assert set(dispatches.get(run, {})) == {n for n in names.values() if n.startswith("controller")}, run
        assert set(executes.get(run, {})) == set(workers), f"run {run} did not execute on every worker"
        dispatch = next(iter(dispatches[run].values()))
        tol = error[dispatch["process"]]  # the client's own clock has no error
        assert submit["ts"] <= dispatch["ts"] + dispatch["dur"] + tol
        for worker, execute in executes[run].items():
            both = tol + error[worker]
            assert dispatch["ts"] <= execute["ts"] + execute["dur"] + both
            assert execute["ts"] <= fetch["ts"] + fetch["dur"] + error[worker]
    for step in ("receive", "wait for inputs", "send", "receive data", "done"):
        assert any(s["name"] == step for s in spans if s["process"].startswith("worker")), step
    assert any(e["ph"] == "f" for e in data["traceEvents"]), "no flow from a run's submission to a worker"


def test_untraced_runs_record_nothing(session, program, tmp_path):
    chain, _ = program
    for _ in range(3):
        y = chain(np.float32(1))
    np.asarray(y)
    path = tmp_path / "one.json"
    with session.trace(str(path)):
        np.asarray(chain(np.float32(5)))
    np.asarray(chain(np.float32(1)))  # after the block: untraced again
    _, _, spans = _load(path)
    runs = {s["args"]["run"] for s in spans if "run" in s["args"]}
    assert len(runs) == 1, f"spans of {len(runs)} runs, expected only the traced one: {sorted(runs)}"
    assert not session.traced


def test_pathways_trace_records_a_whole_process(cluster, tmp_path):
    path = tmp_path / "process.json"
    script = ("import numpy as np, pathways as pw, sys\n"
              "pw.connect(sys.argv[1])\n"
              "s = pw.make_virtual_device_set().add_slice(cpu_devices=1, island=0)\n"
              "f = pw.jit(lambda x: x - 1.0, mesh=s.mesh('d'))\n"
              "print(float(np.asarray(f(np.float32(3)))))\n")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PATHWAYS_TRACE": str(path)}
    out = subprocess.run([sys.executable, "-c", script, cluster.address], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "2.0"
    _, names, spans = _load(path)
    assert {s["name"] for s in spans if s["process"].startswith("client")} >= {"put", "submit", "fetch"}
    assert any(s["name"] == "execute" for s in spans if s["process"].startswith("worker"))


def test_cli_draws_the_timeline(program, tmp_path):
    chain, _ = program
    path, png = tmp_path / "run.json", tmp_path / "run.png"
    with pw.trace(str(path)):
        np.asarray(chain(np.float32(0)))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-m", "pathways", "trace", str(path), "--png", str(png)], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "execute" in out.stdout and "dispatch" in out.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (tmp_path / "bad.json").write_text("{\"not\": 1}")
    bad = subprocess.run([sys.executable, "-m", "pathways", "trace", str(tmp_path / "bad.json")], env=env,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "no traceEvents list" in bad.stderr


def test_hostile_collect_requests_are_refused_and_servers_keep_serving(session, program):
    chain, (a, _) = program
    ask = rpc.method(session._stubs(a.addresses[0]).channel, rpc.WORKER_SERVICE, "Timeline", "unary_unary")
    oversized = m.pack(["timeline", session.id, session._stubs(a.addresses[0]).credential, MAX_EVENTS + 1])
    with pytest.raises(WireError, match="max_events"):
        operator.answer(operator.TIMELINE_REPLY, ask(oversized, timeout=30))
    with pytest.raises(WireError, match="the worker refused a timeline request"):
        operator.answer(operator.TIMELINE_REPLY, ask(b"\xc1garbage", timeout=30))
    stranger = m.pack(m.TimelineFetch(session.id, b"x" * m.CREDENTIAL_BYTES, 10).encode())
    with pytest.raises(AccessDeniedError, match="credential"):
        operator.answer(operator.TIMELINE_REPLY, ask(stranger, timeout=30))
    with pytest.raises(WireError, match="max_events"):
        session.request(lambda req: m.CollectTimeline(req, MAX_EVENTS + 1))
    assert float(np.asarray(chain(np.float32(1)))) == 4.0  # both still serve
    mine = m.pack(m.TimelineFetch(session.id, session._stubs(a.addresses[0]).credential, 10).encode())
    assert operator.answer(operator.TIMELINE_REPLY, ask(mine, timeout=30)).pid > 0


# ---- the recorder and the file format, without processes --------------------------------

def test_recorder_is_bounded_and_hands_each_session_its_own():
    rec = Recorder(limit=4)
    one, two = first_handle(1) + 7, first_handle(2) + 7
    for i in range(6):
        rec.span(f"s{i}", now(), one if i % 2 else two)
    assert rec.dropped == 2
    mine, dropped = rec.take(1, limit=10)
    assert [e[0] for e in mine] == ["s3", "s5"] and dropped == 2
    assert [e[0] for e in rec.take(2, limit=1)[0]] == ["s2"]
    assert [e[0] for e in rec.take(2, limit=10)[0]] == ["s4"]


def test_clock_keeps_the_exchange_with_the_shortest_round_trip():
    clock = Clock()
    clock.sample(0, 1_000_500, 1_000)  # offset 1_000_000, error 500
    clock.sample(10_000, 1_010_000, 10_100)  # offset 999_950, error 50: better
    clock.sample(20_000, 5_000_000, 40_000)  # error 10_000: ignored
    assert (clock.offset, clock.error) == (999_950, 50)
    assert clock.local(1_010_000) == 10_050


def test_chrome_trace_has_names_events_and_flows():
    run = first_handle(1) + 3
    client = Process("client (pid 1)", 1, [("submit", "MainThread", 1_000, 500, run, "")])
    clock = Clock()
    clock.sample(0, 100_000, 0)
    controller = Process("controller (pid 2)", 2, [("dispatch", "MainThread", 102_000, 300, run, ""),
                                                   ("queue", "queued runs", 101_500, 400, run, "")], clock)
    worker = Process("worker w (pid 3)", 3, [("receive", "reader", 103_000, 100, run, "")], clock)
    trace = chrome_trace([client, controller, worker])
    json.dumps(trace)
    complete = {e["name"]: e for e in trace["traceEvents"] if e["ph"] == "X"}
    assert complete["dispatch"]["ts"] == 1.0 and complete["receive"]["ts"] == 2.0  # aligned, us from the first
    assert [e["ph"] for e in trace["traceEvents"] if e["name"] == "queue"] == ["b", "e"]
    assert [e["ph"] for e in trace["traceEvents"] if e.get("cat") == "run"] == ["s", "t", "f"]
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"} == {
        "client (pid 1)", "controller (pid 2)", "worker w (pid 3)"}


def test_compiled_modules_are_named_by_the_function_jitted():
    assert [function_label(n) for n in ("jit_train_step", "pmap_f", "jit__where", "jit_", "main")] == [
        "train_step", "f", "_where", "jit_", "main"]


def test_computations_and_compiles_are_summarized_per_function():
    spans = [Span("worker 0, island 0 host 0 (pid 3)", "executor", "execute", t, 10.0, "0x1", "step")
             for t in (0.0, 20.0)] + [Span("client IFRT proxy (pid 1)", "wait", "compile", 0.0, 500.0, "", "step"),
                                      Span("controller (pid 2)", "MainThread", "dispatch", 5.0, 1.0, "0x1", "1 worker")]
    assert [s.label for s in spans] == ["execute step", "execute step", "compile", "dispatch"]
    assert functions(spans) == [("compile", "step", 1, 500.0, 500.0), ("execute", "step", 2, 20.0, 10.0)]
    text = summary(spans)
    assert "1 worker" not in text and text.splitlines()[-1].split() == ["execute", "step", "2", "0.020", "10.0"]


def test_a_recording_keeps_the_newest_spans_of_each_process():
    recording = Recording("unused.json")
    for start in range(0, 2 * MAX_EVENTS, MAX_EVENTS // 2):
        events = [("execute", "t", start + i, 1, 1, "") for i in range(MAX_EVENTS // 2)]
        recording.add([Process("worker 0 (pid 3)", 3, events, dropped=5)])
    kept = recording.processes["worker 0 (pid 3)"]
    assert len(kept.events) == MAX_EVENTS and kept.events[0][2] == MAX_EVENTS
    assert kept.dropped == 5 + MAX_EVENTS
