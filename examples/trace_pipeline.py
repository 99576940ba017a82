"""The timeline of one step of a 16-stage pipeline, as ``bench pipeline`` builds it.

Sixteen one-host islands on a local cluster; a program chains ``x + 1`` across them, one
stage per host, dispatched in parallel. After a warm-up (compiles, first transfers), one
run is recorded with ``pw.trace`` on the client, the controller and every worker, and
written as Chrome trace-event JSON (open it at ui.perfetto.dev), plus a Gantt chart.

    python examples/trace_pipeline.py OUT.json [--png OUT.png] [--stages 16]
"""

import argparse

import numpy as np

import pathways as pw
from pathways.timeline_view import gantt, load, summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out", help="the timeline file to write (Chrome trace-event JSON)")
    parser.add_argument("--png", help="also draw it as a Gantt chart here")
    parser.add_argument("--stages", type=int, default=16, help="pipeline stages, one host each")
    args = parser.parse_args()

    islands = [pw.Island(hosts=1, devices_per_host=1)] * args.stages
    with pw.local_cluster(islands=islands, start_timeout=300.0):
        vds = pw.make_virtual_device_set()
        stages = [vds.add_slice(cpu_devices=1, island=i) for i in range(args.stages)]
        fns = [pw.jit(lambda x: x + 1.0, mesh=s.mesh("d")) for s in stages]

        @pw.program
        def step(x):
            for f in fns:
                x = f(x)
            return x

        x = pw.device_put(np.float32(0), stages[0].devices)
        for _ in range(3):  # warm up: compile everywhere, open the data-plane connections
            x = step(x)
        np.asarray(x)
        with pw.trace(args.out):
            y = step(x)
            value = float(np.asarray(y))
    assert value == 4 * args.stages, value
    spans = load(args.out)
    print(summary(spans))
    if args.png:
        gantt(spans, args.png, f"one step of a {args.stages}-stage pipeline (parallel dispatch)")
        print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
