"""GPipe pipeline-parallel training on pathways, checked against plain JAX.

A 4-stage MLP, one stage per single-device slice, trained with 4 microbatches per step. Each
training step is one ``@pw.program`` (forward of every microbatch through every stage, loss,
backward in reverse stage order with gradient accumulation, SGD on every stage); the
parameters it returns stay on the cluster and feed the next step. Only the losses are
fetched, at the end, and compared with the same training run in this process with JAX.

    python examples/pipeline.py               # embedded cluster: one island, 2 hosts x 2 devices
    python examples/pipeline.py --islands 2   # two islands of 2 one-device hosts, 2 stages each
"""

import argparse

import numpy as np

import pathways as pw
from pathways.bench import gpipe


def train(cfg: gpipe.Config, slices: list[pw.Slice], steps: int) -> None:
    for stage, s in enumerate(slices):
        print(f"stage {stage}: island {s.island}, host(s) {s.workers}")
    pipeline = gpipe.Pipeline(cfg, slices)
    print(f"one step: a program of {pipeline.nodes()} compiled-function calls")
    batches = gpipe.make_batches(cfg, steps)
    _, losses = pipeline.train(gpipe.init_params(cfg), batches)
    pathways_losses = [float(loss.to_numpy()) for loss in losses]
    jax_losses = gpipe.reference_train(cfg, batches)

    print(f"{'step':>4} {'pathways':>10} {'plain JAX':>10}")
    for step, (a, b) in enumerate(zip(pathways_losses, jax_losses)):
        print(f"{step:4d} {a:10.6f} {b:10.6f}")
    diff = float(np.max(np.abs(np.subtract(pathways_losses, jax_losses))))
    print(f"max abs difference: {diff:.3g}")
    assert diff <= 1e-5, "the pipeline's losses differ from plain JAX's"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--islands", type=int, choices=[1, 2], default=1)
    parser.add_argument("--steps", type=int, default=8)
    args = parser.parse_args()
    cfg = gpipe.Config(stages=4, microbatches=4)
    if args.islands == 2:
        with pw.local_cluster(islands=[pw.Island(hosts=2, devices_per_host=1),
                                       pw.Island(hosts=2, devices_per_host=1)]):
            train(cfg, gpipe.stage_slices(cfg.stages, islands=[0, 0, 1, 1]), args.steps)
    else:  # the first pw.* call starts the embedded cluster
        train(cfg, gpipe.stage_slices(cfg.stages), args.steps)


if __name__ == "__main__":
    main()
