"""A chaos run in the suite: clients keep a mixed workload going for a minute while
workers are SIGKILLed at random and the local supervisor restarts them (pathways_bench/chaos.py;
``bench elastic`` runs it longer)."""

import pytest

from pathways_bench import chaos

pytestmark = pytest.mark.soak


@pytest.mark.timeout(600)  # its own bounds: a minute of chaos, then results, healing and drops each bounded
def test_a_minute_of_random_worker_kills_loses_only_what_it_must_and_heals():
    result = chaos.run(duration=60.0, kill_every=7.0, clients=3, seed=1)
    assert result.kills >= 5 and result.restarts >= result.kills, result
    assert result.failures == [], "every result is right or WorkerLostError, and none hangs"
    assert result.correct > 0 and result.lost > 0, result
    assert result.healed_after is not None, "every island is healthy once the kills stop"
    assert result.leaked == {}, "the workers hold no array once the sessions closed"
    assert result.memory_grew < chaos.MEMORY_SLACK_BYTES, result.controller_rss
    assert result.worker_rss[1] < result.worker_rss[0] + chaos.MEMORY_SLACK_BYTES * 3, result.worker_rss
