"""The controller's state machine without processes: sequential dispatch releases each node
only once the nodes it reads from have reported finishing. (Pure logic; the runtime tests
in test_dataflow.py run the same programs on a real cluster.)"""

from pathways.controller.core import ControllerCore, WorkerConn
from pathways.handles import first_handle
from pathways.ir import Layout
from pathways.wire import codec


class Box(list):
    def put(self, message):
        self.append(message)


def _of(box, kind):
    return [m for m in box if m["t"] == kind]


def test_sequential_runs_release_each_node_after_its_predecessors_finish():
    core = ControllerCore()
    workers = [WorkerConn(Box()) for _ in range(3)]
    for i, conn in enumerate(workers):
        core.on_worker_batch(conn, codec.pack_batch([{
            "t": "register", "address": f"grpc://127.0.0.1:{i + 1}", "data_address": f"tcp://127.0.0.1:{i + 1}",
            "kind": "cpu", "devices": 1, "island": i,
            "rank": 0, "pid": 1, "host": "h", "memory_bytes": 1 << 30}]))
    sid, client = 1, Box()
    core.session_opened(sid, client)
    core.on_session_batch(sid, codec.pack_batch(
        [{"t": "hello", "v": codec.PROTOCOL_VERSION, "weight": 1}]
        + [{"t": "slice", "req": i, "kind": "cpu", "count": 1, "mesh_shape": None, "island": i, "exclusive": False}
           for i in range(3)]))
    slices = {m["req"]: m for m in _of(client, "slice")}
    layouts = [Layout(tuple(slices[i]["workers"]), ((0, 0),), (1,), ("x",), ()) for i in range(3)]
    ids = iter(range(first_handle(sid) + 1, first_handle(sid) + 1000))
    fns = [next(ids) for _ in range(3)]
    program, data, base = next(ids), next(ids), next(ids)
    chain = {"nvalues": 4, "inputs": [0], "nodes": [[fns[i], [i], [i + 1]] for i in range(3)], "outputs": [3],
             "types": [["float32", [2]]] * 4}
    core.on_session_batch(sid, codec.pack_batch(
        [{"t": "fn", "id": fns[i], "slice": slices[i]["slice"], "name": f"f{i}", "blob": b"artifact",
          "ins": [layouts[i].to_wire()], "outs": [layouts[i].to_wire()]} for i in range(3)]
        + [{"t": "program", "id": program, "graph": chain, "dispatch": "sequential"},
           {"t": "put", "handle": data, "layout": layouts[0].to_wire()},
           {"t": "run", "program": program, "base": base, "inputs": [[0, data]]}]))
    assert not _of(client, "error"), client
    assert [slices[i]["workers"] for i in range(3)] == [[c.worker] for c in workers]
    w0, w1, w2 = workers
    run_id = _of(w0.outbox, "run")[0]["id"]
    assert all(_of(c.outbox, "run") for c in (w0, w1, w2)), "the whole run is sent at once, gated"
    assert not any(_of(c.outbox, "go") for c in (w0, w1, w2))

    def step(conn, node):
        core.on_worker_batch(conn, codec.pack_batch([{"t": "step", "run": run_id, "node": node}]))

    step(w0, 0)
    # node 1 reads node 0's output: its sender (w0) and runner (w1) are released, w2 is not
    assert [m["nodes"] for m in _of(w0.outbox, "go")] == [[1]]
    assert [m["nodes"] for m in _of(w1.outbox, "go")] == [[1]]
    assert not _of(w2.outbox, "go")
    step(w2, 1)  # a report from a worker that does not run node 1 changes nothing
    assert not _of(w2.outbox, "go")
    step(w1, 1)
    assert [m["nodes"] for m in _of(w1.outbox, "go")] == [[1], [2]]
    assert [m["nodes"] for m in _of(w2.outbox, "go")] == [[2]]
