"""GPipe pipeline-parallel training on real clusters, checked against plain JAX in this
process."""

import dataclasses

import numpy as np
import pytest

import pathways as pw
from pathways_bench import gpipe
from tests.conftest import connected, running_cluster

SMALL = gpipe.Config(stages=4, microbatches=2, batch=16, width=8, hidden=16)
STEPS = 3


@pytest.fixture(scope="module")
def islands():
    """Two islands of two one-device hosts each (each island one jax.distributed group)."""
    yield from running_cluster(pw.Island(hosts=2, devices_per_host=1), pw.Island(hosts=2, devices_per_host=1))


@pytest.fixture
def client(islands):
    yield from connected(islands)


def train_and_check(cfg, slices):
    pipeline = gpipe.Pipeline(cfg, slices)
    batches = gpipe.make_batches(cfg, STEPS)
    params, losses = pipeline.train(gpipe.init_params(cfg), batches)
    for stage, (p, s) in enumerate(zip(params, slices)):
        assert all(isinstance(a, pw.Array) and a.sharding.mesh.slice is s for a in p.values()), (
            f"stage {stage}'s parameters should stay on its slice between steps")
    got = [float(loss.to_numpy(timeout=60)) for loss in losses]
    want = gpipe.reference_train(cfg, batches)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)
    assert got[-1] < got[0], f"training did not reduce the loss: {got}"


def test_pipeline_on_one_island_matches_plain_jax(client):
    cfg = dataclasses.replace(SMALL, stages=3)
    slices = gpipe.stage_slices(cfg.stages, islands=[0] * cfg.stages)
    assert {s.island for s in slices} == {0}
    assert len({w for s in slices for w in s.workers}) == 2, "the stages should use both hosts of island 0"
    train_and_check(cfg, slices)


def test_pipeline_across_two_islands_matches_plain_jax(client):
    slices = gpipe.stage_slices(SMALL.stages, islands=[0, 0, 1, 1])
    assert [s.island for s in slices] == [0, 0, 1, 1]
    assert all(len(s.workers) == 1 for s in slices)
    assert len({s.workers[0] for s in slices}) == 4, "every stage should have a host of its own"
    train_and_check(SMALL, slices)



def test_the_example_defines_its_model_and_matches_plain_jax():
    import os
    import re
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    example = os.path.join(root, "examples", "pipeline.py")
    with open(example) as f:
        source = f.read()
    assert not re.search(r"^(from|import) pathways\.bench", source, re.M), "a reader must see the model in the example"
    assert "def stage_forward" in source
    done = subprocess.run([sys.executable, example, "--steps", "3"], capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    assert "one step: a program of 32 compiled-function calls" in done.stdout
    steps = re.findall(r"^\s+\d+\s+(\S+)\s+(\S+)$", done.stdout, re.M)
    assert len(steps) == 3 and all(a == b for a, b in steps), done.stdout
    assert float(steps[-1][0]) < float(steps[0][0]), "training reduces the loss"
