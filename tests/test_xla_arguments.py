"""How the worker hands arguments to an "xla" executable (pathways/worker/xla.py): an array
whose buffers are already in the executable's device order goes as it is, one with the same
blocks on its devices in another order is relabelled, one with other blocks is moved; the
results are the same either way. In a process with four CPU devices."""

import json
import subprocess
import sys
import textwrap

SCRIPT = textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from jax._src.sharding_impls import GSPMDSharding
    from pathways.protocol.messages import Analysis
    from pathways.worker.xla import Metadata, XlaExecutable

    devices = jax.devices()
    mesh, backwards = Mesh(np.array(devices), ("x",)), Mesh(np.array(devices[::-1]), ("x",))
    whole = NamedSharding(mesh, PartitionSpec())
    compiled = jax.jit(lambda a: a * 2, in_shardings=whole, out_shardings=whole).lower(
        jax.ShapeDtypeStruct((8,), np.float32)).compile()
    metadata = Metadata((), (), (("float32", (8,)),), (), (), (), (), (), "", "double", Analysis())
    exe = XlaExecutable(compiled._executable.xla_executable, [((8,), np.float32)],
                        [GSPMDSharding(tuple(devices), whole._to_xla_hlo_sharding(1))], [whole], [whole], metadata)
    value = np.arange(8, dtype=np.float32)
    out = {}
    for name, sharding in [("same order", whole), ("other order", NamedSharding(backwards, PartitionSpec())),
                           ("other blocks", NamedSharding(mesh, PartitionSpec("x")))]:
        x = jax.device_put(value, sharding)
        given = exe._as_expected(0, x)
        out[name] = {"as is": given is x, "how": exe._equivalent[(0, x.sharding)],
                     "devices": [d.id for d in given.sharding._device_assignment],
                     "result": np.asarray(exe(x)[0]).tolist()}
    print(json.dumps({"cases": out, "order": [d.id for d in devices]}))
""")


def test_arguments_go_as_they_are_relabelled_or_moved_and_compute_the_same():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    cases, order = got["cases"], got["order"]
    assert cases["same order"]["as is"] and cases["same order"]["how"] == "as is"
    assert not cases["other order"]["as is"] and cases["other order"]["how"] == "relabelled"
    assert not cases["other blocks"]["as is"] and cases["other blocks"]["how"] == "moved"
    for case in cases.values():
        assert case["devices"] == order  # what the executable is given is in its own device order
        assert case["result"] == [2.0 * i for i in range(8)]


CHECK_SCRIPT = textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_platforms", "cpu")
    jax.config.update("jax_num_cpu_devices", 4)
    jax.config.update("jax_enable_x64", True)
    import numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec
    from jax._src.sharding_impls import GSPMDSharding
    from pathways.protocol.messages import Analysis
    from pathways.worker.xla import Metadata, XlaExecutable

    devices = jax.devices()
    mesh = Mesh(np.array(devices), ("x",))
    rows = NamedSharding(mesh, PartitionSpec("x"))
    gspmd = GSPMDSharding(tuple(devices), rows._to_xla_hlo_sharding(1))
    compiled = jax.jit(lambda a, b: a * 2 + b, in_shardings=(rows, rows), out_shardings=rows,
                       donate_argnums=(1,)).lower(jax.ShapeDtypeStruct((8,), np.int64),
                                                  jax.ShapeDtypeStruct((8,), np.int64)).compile()
    metadata = Metadata((), (), (("int64", (8,)),), (), (), (), (), (1,), "", "axpy", Analysis())
    exe = XlaExecutable(compiled._executable.xla_executable, [((8,), np.dtype(np.int64))] * 2, [gspmd, gspmd],
                        [rows, rows], [rows], metadata)
    put = lambda value: jax.device_put(value, rows)
    refused = {}
    a = put(np.arange(8, dtype=np.int64))
    for name, args in [("int32 for int64", (put(np.arange(8, dtype=np.int32)), put(np.ones(8, np.int64)))),
                       ("float64 of the same size", (a, put(np.ones(8, np.float64)))),
                       ("another shape", (a, put(np.ones(16, np.int64)))),
                       ("donated and given again", (a, a))]:
        try:
            exe(*args)
        except ValueError as e:
            refused[name] = str(e)
    good = exe(a, put(np.full(8, 2**40, np.int64)))
    print(json.dumps({"refused": refused, "good": np.asarray(good[0]).tolist()}))
""")


def test_arguments_an_executable_of_several_devices_cannot_take_are_refused_and_the_process_goes_on():
    """XLA's CPU client kills the process (SIGSEGV) when a run of an executable of several
    devices is given a buffer of another dtype or shape, or a donated buffer twice; a buffer
    of the same size in another dtype runs on reinterpreted bits. The worker refuses each
    before it reaches XLA, naming the parameter, and the next run computes."""
    done = subprocess.run([sys.executable, "-c", CHECK_SCRIPT], capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    refused = got["refused"]
    assert refused["int32 for int64"] == "axpy's parameter 0 is int64[8], but it was given a int32[8] array"
    assert refused["float64 of the same size"].endswith("given a float64[8] array")
    assert refused["another shape"].endswith("given a int64[16] array")
    assert "parameter 1 is donated" in refused["donated and given again"]
    assert got["good"] == [2 * i + 2**40 for i in range(8)]
