"""The runtime across machines: the controller, three workers (island a of two hosts, island
b of one) and the clients each in a network namespace of its own (tests/netns.py: own
address, own loopback, a bridge between them), started with exactly the commands of
docs/deploy.md's "By hand" block. Through them: the Figure 2 program, a psum over the
two-host island, 64 MiB between the islands, `pathways status`, refusals of clients without
the token or with a wrong one, isolation between clients, the same with TLS, and on that TLS
deployment hosts and a controller that are lost (a link set down, a SIGKILL) and a host that is
slow, not lost (a SIGSTOP).
Skipped, saying why, where namespaces cannot be made (not root, no `ip`)."""

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pathways.wire.certs import make_certificates
from tests.conftest import read_line, wait_until
from tests.netns import Network, netns_available  # noqa: F401 (a fixture)

pytestmark = pytest.mark.usefixtures("netns_available")

ROOT = Path(__file__).resolve().parents[1]
HOSTS = ["ctl", "w1", "w2", "w3", "client", "other"]
CLIENT = [sys.executable, str(ROOT / "tests" / "netns_client.py")]
FIGURE2 = "[3. 5.] [2. 4.]"
START_SECONDS = 240  # the client part of the block waits up to 120 s for the islands; jax starts slowly on 2 cores


def recipe(section: str) -> tuple[str, dict[str, str]]:
    """The first bash block of docs/deploy.md's ``section``: its settings, and its parts by
    their ``# on ...`` line."""
    text = (ROOT / "docs" / "deploy.md").read_text()
    block = re.search(rf"## {section}\n.*?```bash\n(.*?)```", text, re.S).group(1)
    settings, *parts = re.split(r"\n(?=# on )", block)
    return settings, {p.splitlines()[0]: "\n".join(p.splitlines()[1:]) for p in parts}


def _part(parts: dict[str, str], *words: str) -> str:
    (title,) = [t for t in parts if all(w in t for w in words)]
    return parts[title]


class Deployment:
    """The By hand block run in ``net``: each part in the namespace of its machine. ``tls``:
    certificate files, whose flags are added to the controller's and workers' commands (and
    the workers' data plane over TLS too); ``extra``: more flags for both."""

    def __init__(self, net: Network, tmp: Path, tls=None, extra: str = "") -> None:
        self.net, self.tls = net, tls
        self.address = f"grpc://{net.addr('ctl')}:50051"
        self.token_file = tmp / "token"
        self.env = {"CONTROLLER_HOST": net.addr("ctl"), "PORT": "50051", "TOKEN_FILE": str(self.token_file),
                    "WORKER_TOKEN_FILE": str(tmp / "worker-token"), "PATHWAYS_WORKER_TOKEN": "",
                    "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
                    "PATHWAYS_TOKEN": "", "PATHWAYS_TLS_CA": ""}
        self.flags = {"controller": extra, "worker": extra}
        if tls is not None:
            self.flags = {"controller": f"{extra} --tls-cert {tls.cert} --tls-key {tls.key} --tls-ca {tls.ca}",
                          "worker": f"{extra} --tls-cert {tls.cert} --tls-key {tls.key} --tls-ca {tls.ca} "
                                    "--data-plane-tls"}
        self.settings, self.parts = recipe("By hand")
        self.procs: dict[str, subprocess.Popen] = {}

    def _script(self, part: str) -> str:
        part = re.sub(r"^(python -m pathways (controller|worker) .*)$", lambda m: m[1] + self.flags[m[2]], part,
                      flags=re.M)
        return f"set -e\n{self.settings}\n{part}"

    def start(self) -> str:
        """Run every part; returns what the client part printed (demo and status)."""
        done = self.net.run("ctl", ["bash", "-c", self._script(_part(self.parts, "controller", "once"))],
                            timeout=30, env=self.env, text=True)
        assert done.returncode == 0, done.stderr
        (controller,) = [p for t, p in self.parts.items() if t.strip() == "# on the controller machine"]
        self.procs["ctl"] = self.net.popen("ctl", ["bash", "-c", self._script(controller)], env=self.env)
        self.start_island_a()
        self.procs["w3"] = self.net.popen("w3", ["bash", "-c", self._script(_part(self.parts, "island b"))],
                                          env=self.env)
        return self.client_part()

    def start_island_a(self) -> None:
        for host in ("w1", "w2"):
            self.procs[host] = self.net.popen(host, ["bash", "-c", self._script(_part(self.parts, "island a"))],
                                              env=self.env)

    def client_env(self) -> dict:
        return {**self.env, "PATHWAYS_TOKEN": self.token_file.read_text().strip(),
                "PATHWAYS_TLS_CA": self.tls.ca if self.tls else ""}

    def client_part(self) -> str:
        done = self.net.run("client", ["bash", "-c", self._script(_part(self.parts, "client machine"))],
                            timeout=START_SECONDS, text=True,
                            env={**self.env, "PATHWAYS_TLS_CA": self.tls.ca if self.tls else ""})
        assert done.returncode == 0, f"the client part failed:\n{done.stdout}\n{done.stderr[-3000:]}"
        return done.stdout

    def client(self, scenario: str, *args: str, host: str = "client", env: dict | None = None,
               timeout: float = 180) -> dict:
        done = self.net.run(host, [*CLIENT, scenario, self.address, *args], timeout=timeout, text=True,
                            env=env if env is not None else self.client_env())
        assert done.returncode == 0, f"{scenario} failed:\n{done.stdout}\n{done.stderr[-3000:]}"
        return json.loads(done.stdout.strip().splitlines()[-1])

    def spawn(self, scenario: str, *args: str, host: str = "client") -> subprocess.Popen:
        return self.net.popen(host, [*CLIENT, scenario, self.address, *args], env=self.client_env(),
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def pid_of(self, host: str, command: str) -> int:
        """The pid of the ``python -m pathways COMMAND`` process in ``host``'s namespace."""
        pids = subprocess.run(["ip", "netns", "pids", self.net.namespace(host)], capture_output=True,
                              text=True, check=True).stdout.split()
        for pid in pids:
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except FileNotFoundError:
                continue
            keeper = any(a.endswith(b"keeper.py") for a in argv)  # a worker's keeper runs it as its child
            if b"pathways" in argv and command.encode() in argv and argv[0] != b"bash" and not keeper:
                return int(pid)
        raise AssertionError(f"no `pathways {command}` process in {host}'s namespace")



def _check_by_hand_output(out: str, net: Network) -> None:
    assert FIGURE2 in out, out
    assert re.search(r"island a \(id \d+\): healthy, 2 host\(s\)", out), out
    assert re.search(r"island b \(id \d+\): healthy, 1 host\(s\)", out), out
    for host in ("w1", "w2", "w3"):
        assert f"grpc://{net.addr(host)}:" in out, f"{host}'s advertised address is not in status:\n{out}"
    assert "127.0.0.1" not in out, out


@pytest.fixture(scope="module")
def deployed(tmp_path_factory):
    with Network(HOSTS) as net:
        d = Deployment(net, tmp_path_factory.mktemp("deploy"))
        d.by_hand_output = d.start()
        yield d


def test_the_by_hand_commands_run_figure2_and_status_across_namespaces(deployed):
    _check_by_hand_output(deployed.by_hand_output, deployed.net)


def test_a_psum_over_the_two_host_island_and_64_mib_between_islands(deployed):
    assert deployed.client("psum") == {"psum": [7.0, 7.0]}
    moved = deployed.client("transfer")
    assert moved["equal"], moved


def test_clients_without_the_token_or_with_a_wrong_one_are_refused_within_5_s(deployed):
    env = deployed.client_env()
    for token in ("", "not-the-token"):
        got = deployed.client("refused", env={**env, "PATHWAYS_TOKEN": token})
        assert got["kind"] == "AuthenticationError", got
        assert "token" in got["message"] and "--token-file" in got["message"], got
        assert env["PATHWAYS_TOKEN"] not in got["message"]
        assert got["seconds"] < 5.0, got
        status = deployed.net.run("client", [sys.executable, "-m", "pathways", "status", "--address",
                                             deployed.address], timeout=30, text=True,
                                    env={**env, "PATHWAYS_TOKEN": token})
        assert status.returncode == 1 and "token" in status.stderr, status.stderr


def test_a_client_in_another_namespace_cannot_read_overwrite_or_delete_anothers_array(deployed):
    owner = deployed.spawn("owner")
    try:
        held = json.loads(read_line(owner, 120))
        tried = deployed.client("thief", str(held["handle"]), json.dumps(held["addresses"]), host="other")
        assert tried["read"] == "AccessDeniedError", tried
        assert tried["overwrite"] == "AccessDeniedError", tried
        owner.stdin.write("go\n")
        owner.stdin.flush()
        assert json.loads(read_line(owner, 60)) == {"value": [0.0, 1.0, 2.0, 3.0]}, "the owner's array changed"
    finally:
        owner.kill()
        owner.wait()


@pytest.fixture(scope="module")
def tls_deployed(tmp_path_factory):
    """The By hand block with TLS on the control and data planes, and a heartbeat timeout of
    5 s (the default is 10): a host cut off is lost once it was silent for 5 s and its kernel
    acknowledged nothing for 5 s (about 1.4 timeouts from the cut, within 10 s); a frozen one
    is slow, not lost. The TLS test reads from it; the lost-hosts test, after it, cuts and
    freezes its hosts and kills its controller."""
    tmp = tmp_path_factory.mktemp("tls")
    with Network(HOSTS) as net:
        tls = make_certificates(str(tmp), [net.addr(h) for h in HOSTS])
        d = Deployment(net, tmp, tls=tls, extra=" --heartbeat-timeout 5")
        d.by_hand_output = d.start()
        yield d


def test_the_same_programs_with_tls_on_the_control_and_data_planes(tls_deployed):
    d = tls_deployed
    _check_by_hand_output(d.by_hand_output, d.net)
    assert d.client("psum") == {"psum": [7.0, 7.0]}
    assert d.client("transfer")["equal"]
    without_ca = d.client("refused", env={**d.client_env(), "PATHWAYS_TLS_CA": ""})
    assert without_ca["kind"] in ("ConnectError", "AuthenticationError"), without_ca
    assert "TLS" in without_ca["message"] and without_ca["seconds"] < 5.0, without_ca


def _lost(d: Deployment, cut, host: str, limit: float) -> dict:
    """Warm up a client on both islands, ``cut()`` a host of island a, and return the
    client's report: the island a run's failure, the seconds from the cut to it, and island
    b's results after."""
    client = d.spawn("host_lost")
    try:
        assert read_line(client, 180).strip() == "ready"
        cut()
        cut_at = time.monotonic()
        client.stdin.write("go\n")
        client.stdin.flush()
        report = json.loads(read_line(client, 60))
        report["since_cut"] = time.monotonic() - cut_at
    finally:
        client.kill()
        client.wait()
    failure = report["failure"]
    assert failure is not None and failure["kind"] == "WorkerLostError", report
    assert d.net.addr(host) in failure["message"] and "stopped answering" in failure["message"], failure
    assert report["since_cut"] < limit, report
    assert report["other_island"] == [[4.0, 5.0]] * 3, "island b stopped serving"
    return report


def test_lost_hosts_fail_their_island_within_10_s_while_the_other_keeps_serving_and_a_lost_controller_too(
        tls_deployed):
    d, net = tls_deployed, tls_deployed.net
    # the link of island a's second host goes down
    _lost(d, lambda: net.link_down("w2"), "w2", 10.0)
    status = net.run("client", [sys.executable, "-m", "pathways", "status", "--address", d.address],
                     timeout=30, text=True, env=d.client_env())
    assert re.search(r"island a \(id \d+\): UNHEALTHY \(worker \d+ on host .* at grpc://"
                     + re.escape(net.addr("w2")), status.stdout), status.stdout

    # island a heals on its own: its other host restarted in place and joined it again, and
    # the cut host, which gave the silent controller up, attaches again once it is back
    net.link_up("w2")
    wait_until(lambda: re.search(r"island a \(id \d+\): healthy", net.run(
        "client", [sys.executable, "-m", "pathways", "status", "--address", d.address], timeout=30, text=True,
        env=d.client_env()).stdout), timeout=90, what="island a to heal")
    assert FIGURE2 in d.client_part()

    # a host of the new island a is frozen past the heartbeat timeout: slow, not lost (its kernel
    # still acknowledges), so island a stays healthy and status says so; continued, it serves again
    frozen = d.pid_of("w2", "worker")
    os.kill(frozen, signal.SIGSTOP)
    try:
        def slow_status():
            out = net.run("client", [sys.executable, "-m", "pathways", "status", "--address", d.address],
                          timeout=30, text=True, env=d.client_env()).stdout
            return re.search(rf"pid {frozen} .*; SLOW \(sent nothing for", out) and out
        out = wait_until(slow_status, timeout=30, what="the frozen host to show as slow")
        assert re.search(r"island a \(id \d+\): healthy", out), out
    finally:
        os.kill(frozen, signal.SIGCONT)
    assert d.client("psum") == {"psum": [7.0, 7.0]}
    assert d.pid_of("w2", "worker") == frozen, "the frozen host was kept, not restarted"

    # the controller is killed while a client waits for results
    client = d.spawn("controller_lost")
    try:
        assert read_line(client, 180).strip() == "ready"
        os.kill(d.pid_of("ctl", "controller"), signal.SIGKILL)
        killed_at = time.monotonic()
        client.stdin.write("go\n")
        client.stdin.flush()
        report = json.loads(read_line(client, 30))
        waited = time.monotonic() - killed_at
    finally:
        client.kill()
        client.wait()
    assert report["failure"] is not None and report["failure"]["kind"] == "ControllerLostError", report
    assert waited < 10.0, report


def test_the_two_machine_recipe_runs_in_the_hosts_the_netns_script_makes(tmp_path):
    """docs/deploy.md's "Two machines" on one machine, as it says: `python -m
    pathways_bench.netns one two` makes the hosts, each part runs in a shell it printed, and
    its Ctrl-C ends what runs in them and deletes them."""
    # unbuffered: each read_line takes one line, leaving the next for the next select
    script = subprocess.Popen([sys.executable, "-m", "pathways_bench.netns", "one", "two"], stdout=subprocess.PIPE,
                              bufsize=0, env={**os.environ, "PYTHONPATH": str(ROOT)})
    hosts, procs = {}, []
    try:
        while not (line := read_line(script, 60).decode()).startswith("ready"):
            name, address, *shell = line.split()
            hosts[name] = address, shell
        assert set(hosts) == {"one", "two"} and all(shell[:3] == ["ip", "netns", "exec"] for _, shell in hosts.values())
        settings, parts = recipe("Two machines")
        env = {"PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT),
               "HOME": str(tmp_path), "ONE": hosts["one"][0]}  # the recipe's defaults otherwise

        def shell(host: str, *words: str) -> list[str]:
            return [*hosts[host][1], "-c", f"set -e\n{settings}\n{_part(parts, *words)}"]

        made = subprocess.run(shell("one", "one, once"), env=env, timeout=30, capture_output=True, text=True)
        assert made.returncode == 0, made.stderr
        for host, words in (("one", ("the controller",)), ("one", ("second shell",)), ("two", ("other host",))):
            procs.append(subprocess.Popen(shell(host, *words), env=env, stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL))
        done = subprocess.run(shell("one", "third shell"), env=env, timeout=START_SECONDS, capture_output=True,
                              text=True)
        assert done.returncode == 0, f"the program's part failed:\n{done.stdout}\n{done.stderr[-3000:]}"
        assert FIGURE2 in done.stdout, done.stdout
        assert all(f"//{address}:" in done.stdout for address, _ in hosts.values()), \
            f"status shows a host of the island on each machine:\n{done.stdout}"
    finally:
        script.send_signal(signal.SIGINT)
        code = script.wait(timeout=60)
    assert code == 0
    for proc in procs:  # ended by the script, with the hosts they ran in
        proc.wait(timeout=30)
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert not any(shell[3] in namespaces for _, shell in hosts.values()), namespaces
