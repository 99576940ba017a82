"""The process template (pathways/template.py): what a forked process becomes (its command,
environment, stdout, title and exit status), a keeper forking its worker, and which clusters
share a template. Local clusters start every process through it: the cluster tests cover
the rest."""

import json
import os
import signal
import sys
from pathlib import Path

import pytest

from pathways import keeper
from pathways.errors import ConnectError
from pathways.template import Template, template_for

ROOT = str(Path(__file__).resolve().parent.parent)
PRELOAD = ("xml.dom.minidom",)  # a module the target does not import: found there only if forked


def environment(**extra):
    return {"PATH": os.environ.get("PATH", ""), "PYTHONPATH": ROOT, **extra}


@pytest.fixture(scope="module")
def template():
    t = Template(PRELOAD, environment(TEMPLATE_OWNER_ONLY="1"))
    yield t
    t.close()
    assert t.process.returncode is not None


def run(template, argv, env):
    """Spawn ``argv`` and return (what it printed, its exit status)."""
    read, write = os.pipe()
    try:
        pid = template.spawn(argv, env, write)
    finally:
        os.close(write)
    with os.fdopen(read) as out:
        printed = out.read()
    return pid, printed, template.exit_code(pid, timeout=30)


def target(*args):
    return [sys.executable, "-m", "tests.template_target", *map(str, args)]


def test_a_forked_process_becomes_its_command_with_its_own_environment_and_exit_status(template):
    pid, printed, code = run(template, target(3, "--flag"), environment(TEMPLATE_TEST_MARK="forked"))
    seen = json.loads(printed)
    assert code == 3
    assert seen["argv"] == ["3", "--flag"] and seen["title"] == " ".join(target(3, "--flag"))
    assert seen["mark"] == "forked" and seen["owner_only"] is None  # its environment, not the template's
    assert seen["preloaded"] and seen["parent"] == template.process.pid
    assert seen["cwd"] == os.getcwd()


def test_a_process_ended_by_a_signal_reports_it_as_popen_does(template):
    _, _, code = run(template, target(-signal.SIGKILL), environment())
    assert code == -signal.SIGKILL


def test_a_keeper_forks_its_worker_from_its_own_image_and_passes_its_status_on(template):
    keeper_pid, printed, code = run(template, keeper.command(0.0, target(5)), environment())
    seen = json.loads(printed)
    assert code == 5, "the keeper exits with its worker's status"
    assert seen["parent"] == keeper_pid and seen["preloaded"] and seen["argv"] == ["5"]


def test_a_command_it_cannot_run_exits_with_1_saying_why_on_its_owners_stderr(template, capfd):
    _, _, code = run(template, [sys.executable, "script.py"], environment())
    assert code == 1
    assert "runs `python -m MODULE ...` or a worker's keeper" in capfd.readouterr().err


def test_clusters_share_a_template_unless_what_is_read_at_import_differs():
    first = template_for(PRELOAD, environment(PATHWAYS_TOKEN="a"))
    try:
        assert template_for(PRELOAD, environment(PATHWAYS_TOKEN="b")) is first
        other = template_for(PRELOAD, environment(JAX_ENABLE_X64="1"))
        assert other is not first
        other.close()
        with pytest.raises(ConnectError, match="template exited"):
            other.spawn(target(0), environment(), 1)
        assert template_for(PRELOAD, environment(JAX_ENABLE_X64="1")) is not other, "a dead one is replaced"
    finally:
        for t in {first, template_for(PRELOAD, environment(JAX_ENABLE_X64="1"))}:
            t.close()


def test_a_template_whose_imports_fail_says_so():
    with pytest.raises(ConnectError, match="did not start: ModuleNotFoundError"):
        Template(("no_such_module_here",), environment())


def test_a_template_imports_its_owners_package_whatever_the_working_directory_holds(tmp_path, monkeypatch):
    # a script run from a checkout imports the installed package while its directory holds
    # another copy: the template must import the owner's, not the directory's
    (tmp_path / "pathways").mkdir()
    (tmp_path / "pathways" / "__init__.py").write_text("raise ImportError('the working directory's copy')\n")
    monkeypatch.chdir(tmp_path)
    template = Template(PRELOAD, environment())
    try:
        _, printed, code = run(template, keeper.command(0.0, target(0)), environment())
    finally:
        template.close()
    assert code == 0 and json.loads(printed)["cwd"] == str(tmp_path)


def _exits_with_7() -> int:
    """A child of this process that exits with status 7 (spawned: a fork of the test process,
    which runs JAX's threads, is unsafe)."""
    return os.posix_spawn("/bin/sh", ["/bin/sh", "-c", "exit 7"], os.environ)


def test_a_stop_signal_handled_while_the_keeper_reaps_its_worker_does_not_fail(monkeypatch):
    # The keeper's SIGTERM handler polls and signals its worker. Python runs a handler between
    # bytecodes: possibly just after a poll's waitpid reaped the worker, before that poll
    # records the exit status. The handler's own poll then finds no child to wait for.
    from pathways import template

    pid = _exits_with_7()
    child = template.ForkedChild(pid, ["worker"])
    reap = os.waitpid
    handled = []

    def waitpid_then_handle_a_signal(wanted, options):
        result = reap(wanted, options)
        if result[0] and not handled:  # the worker is reaped; its status not yet recorded
            handled.append(True)
            child.send_signal(signal.SIGTERM)  # what keeper.main's stop handler does
        return result

    monkeypatch.setattr(template.os, "waitpid", waitpid_then_handle_a_signal)
    assert child.wait(timeout=10) == 7
    assert handled and child.poll() == 7
    child.send_signal(signal.SIGTERM)  # once it has exited, a signal for it is dropped


def test_a_stop_signal_handled_just_before_the_keeper_waits_on_its_worker_does_not_fail(monkeypatch):
    # The handler may run just before the keeper's wait selects on the worker's pidfd, after
    # the worker exited: its poll reaps the worker. The wait's select then must still find
    # a pidfd to wait on (a closed one fails with EBADF, and its number may by then be another
    # descriptor's).
    from pathways import template

    pid = _exits_with_7()
    child = template.ForkedChild(pid, ["worker"])
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # it has exited; not reaped yet
    select = template.select.select
    handled = []

    def handle_a_signal_then_select(readable, writable, errors, timeout):
        if not handled:
            handled.append(True)
            child.send_signal(signal.SIGTERM)  # what keeper.main's stop handler does: it polls first
        return select(readable, writable, errors, timeout)

    monkeypatch.setattr(template.select, "select", handle_a_signal_then_select)
    assert child.wait(timeout=10) == 7
    assert handled and child.poll() == 7
