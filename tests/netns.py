"""Tests across hosts with their own network addresses: the package's network namespaces
(pathways_bench.netns, shared with the benchmarks), and a fixture that skips a test, saying
why, where they cannot be made (not root, no `ip`, no namespaces in this container).

    from tests.netns import Network, netns_available  # noqa: F401 (a fixture)

    pytestmark = pytest.mark.usefixtures("netns_available")

    def test_x():
        with Network(["ctl", "w1", "client"]) as net:
            worker = net.popen("w1", [sys.executable, ...], env={"PATHWAYS_LOG_LEVEL": "info"})
            out = net.run("client", [sys.executable, "-c", ...], timeout=60)
            net.link_down("w1")
"""

import pytest

from pathways_bench.netns import GRACE, SUBNET, Network, NetnsError, sweep, unavailable

__all__ = ["GRACE", "SUBNET", "Network", "NetnsError", "netns_available", "sweep", "unavailable"]


@pytest.fixture(scope="session")
def netns_available() -> None:
    """Skips the test, with the reason, unless this process can make network namespaces."""
    reason = unavailable()
    if reason:
        pytest.skip(f"needs Linux network namespaces: {reason}")
