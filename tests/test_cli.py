"""The command line: its commands and their help, status of a running cluster, and the
Figure 2 demo on an embedded one and against a cluster that refuses it."""

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import pathways as pw
from pathways.cli import COMMANDS, main, parser
from pathways.controller.scheduler import DEFAULT_WINDOW, SOLO_FACTOR
from pathways.wire.security import Security
from pathways_bench.suite import EXPERIMENTS
from tests.inprocess import InProcessController


def run(*args, timeout=120, env=None):
    return subprocess.run([sys.executable, "-m", "pathways", *args], capture_output=True, text=True, timeout=timeout,
                          env=env)


def test_status_shows_islands_hosts_slices_clients_queues_and_work_in_flight(cluster, session):
    s = pw.make_virtual_device_set().add_slice(cpu_devices=4)

    def slow(x):  # about a fifth of a second of work
        return jax.lax.fori_loop(0, 1000, lambda i, y: jnp.tanh(y @ y), x)

    step = pw.jit(slow, mesh=s.mesh("x"))
    x = np.eye(128, dtype=np.float32)
    step(x).block_until_ready(timeout=60)
    solo = DEFAULT_WINDOW * SOLO_FACTOR  # what one client alone may have in flight
    outs = [step(x) for _ in range(solo + 32)]
    out = run("status", "--address", cluster.address)
    assert out.returncode == 0, out.stderr
    assert "2 worker(s)" in out.stdout and f"policy fair, window {DEFAULT_WINDOW} run(s) per island" in out.stdout
    island = re.search(r"island 0: healthy, 2 host\(s\), 8 device\(s\), (\d+) run\(s\) queued, (\d+) in flight",
                       out.stdout)
    assert island, out.stdout
    assert int(island[2]) == solo and int(island[1]) > 0, "as much in flight as one client may have, the rest queued"
    assert out.stdout.count("4 cpu device(s)") == 2
    assert re.search(rf"client session {session.id}: weight 1, 1 slice\(s\), \d+ array\(s\), \d+ run\(s\) "
                     r"queued, \d+ in flight", out.stdout), out.stdout
    outs[-1].block_until_ready(timeout=120)


def test_status_without_an_address_says_how_to_give_one(monkeypatch):
    monkeypatch.delenv("PATHWAYS_ADDRESS", raising=False)
    out = run("status")
    assert out.returncode == 2 and "PATHWAYS_ADDRESS" in out.stderr


def test_demo_prints_the_figure2_result_on_an_embedded_cluster():
    # a CA in the environment is for clusters at an address: the embedded one uses no TLS
    out = run("demo", env={**os.environ, "PATHWAYS_TLS_CA": "/nonexistent/ca.pem"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[3. 5.] [2. 4.]"


def test_the_example_script_runs_as_a_user_would():
    example = Path(__file__).resolve().parent.parent / "examples" / "figure2.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[3. 5.] [2. 4.]"


def _commands() -> dict[str, argparse.ArgumentParser]:
    """Every command's parser, by name; ``plan``'s subcommands as ``plan pipeline`` and ``plan dag``."""
    found = {}
    for parsers in (a for a in parser()._actions if isinstance(a, argparse._SubParsersAction)):
        for name, command in parsers.choices.items():
            found[name] = command
            for sub in (a for a in command._actions if isinstance(a, argparse._SubParsersAction)):
                found.update({f"{name} {n}": p for n, p in sub.choices.items()})
    return found


def test_the_script_and_python_m_run_the_same_main():
    from pathways.__main__ import main as script_main  # pyproject: pathways = "pathways.__main__:main"
    assert script_main is main


def test_every_command_is_registered_with_a_module_that_parses_and_runs_it():
    commands = _commands()
    assert set(COMMANDS) <= set(commands)
    for name in COMMANDS:
        args = commands[name].parse_args(_minimal_args(name))
        assert callable(args.run) and args.parser is commands[name]


def _minimal_args(name: str) -> list[str]:
    return {"worker": ["--controller", "grpc://127.0.0.1:1"], "run": ["script.py"], "bench": ["dispatch"],
            "spmd": ["2", "script.py"], "plan": ["dag", "file.json"], "trace": ["file.json"]}.get(name, [])


def test_every_argument_of_every_command_says_what_it_is_for():
    top = parser()
    unexplained = [f"pathways {a.option_strings[0]}" for a in top._actions if a.option_strings and not a.help]
    for name, command in _commands().items():
        # a choice of subcommands is explained by each subcommand's own help
        unexplained += [f"pathways {name} {a.option_strings[0] if a.option_strings else a.dest}"
                        for a in command._actions
                        if not a.help and not isinstance(a, argparse._SubParsersAction)]
    assert not unexplained, f"arguments without help: {unexplained}"


def test_every_command_describes_itself_and_every_option_with_a_default_names_it():
    """``pathways CMD --help`` starts with what the command does, and an option whose default
    is a fixed value says which (a default taken from the environment says so in words)."""
    undescribed, silent = [], []
    for name, command in _commands().items():
        if not command.description:
            undescribed.append(name)
        for a in command._actions:
            fixed = isinstance(a.default, (int, float)) and not isinstance(a.default, bool)
            if a.option_strings and fixed and "default" not in (a.help or ""):
                silent.append(f"pathways {name} {a.option_strings[0]}")
    assert not undescribed, f"commands whose --help does not say what they do: {undescribed}"
    assert not silent, f"options whose help does not give their default: {silent}"


def test_pathways_help_lists_each_command_with_the_first_line_of_its_modules_docstring():
    listed = {a.dest: a.help for a in next(a for a in parser()._actions
                                           if isinstance(a, argparse._SubParsersAction))._choices_actions}
    for name in COMMANDS:
        doc = importlib.import_module(f"pathways.cli.{name}").__doc__
        assert doc.startswith(f"``pathways {name}``: "), f"pathways/cli/{name}.py's docstring names its command first"
        assert listed[name] and "``" not in listed[name] and listed[name] in " ".join(doc.split()), name


def test_usage_names_the_pathways_command(capsys):
    for argv in (["plan", "--help"], ["plan", "pipeline", "--help"], ["status", "--help"], ["bench", "--help"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: pathways {' '.join(argv[:-1])} "), out
        assert "python -m" not in out


def test_bench_lists_the_benchmarks_and_refuses_an_unknown_one(capsys):
    assert main(["bench", "--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in EXPERIMENTS)
    assert main(["bench", "nonesuch"]) == 2
    assert "invalid choice: 'nonesuch'" in capsys.readouterr().err


def test_the_token_file_of_a_client_command_is_the_token_it_presents(capsys):
    for name in ("status", "demo"):
        assert main([name, "--help"]) == 0
        text = " ".join(capsys.readouterr().out.split())
        assert "the cluster's shared token, which this process presents to it" in text
        assert "listen" not in text
    assert main(["controller", "--help"]) == 0
    assert "required to listen beyond loopback" in " ".join(capsys.readouterr().out.split())


def test_log_level_is_checked_and_given_to_child_processes(monkeypatch, capsys):
    monkeypatch.setenv("PATHWAYS_LOG_LEVEL", "error")
    assert main(["--log-level", "loud", "trace", "nowhere.json"]) == 2
    assert "invalid choice: 'loud'" in capsys.readouterr().err
    assert main(["--log-level", "INFO", "trace", "nowhere.json"]) == 2  # the file is missing: trace's own error
    assert os.environ["PATHWAYS_LOG_LEVEL"] == "info"


def test_demo_refused_by_the_cluster_says_so_in_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("PATHWAYS_TOKEN", raising=False)
    wrong = tmp_path / "token"
    wrong.write_text("not-the-token\n")
    controller = InProcessController(Security(token="the-token"))
    try:
        code = main(["demo", "--address", controller.address, "--token-file", str(wrong)])
    finally:
        controller.close()
    err = capsys.readouterr().err
    assert code == 1
    assert err.startswith("error: ") and err.count("\n") == 1 and "Traceback" not in err, err
    assert "token" in err

