"""``jax.profiler`` in a program on the ``proxy`` backend also profiles the cluster's workers.

Installed by the plugin when it makes the proxy client (plugin.py): ``jax.profiler.start_trace``
(and so ``jax.profiler.trace``) first has every worker of the session start XLA's profiler,
through the same profile request pathwaysutils sends (a PluginProgram, ifrt/profiling.py),
and ``stop_trace`` has them write their traces into the same directory and run as the
program's own trace, so TensorBoard and xprof show the client and every host together. The
directory must lie under the workers' checkpoint directory (the cluster's
``--checkpoint-dir``), where the workers may write; the client's own trace is written as
JAX writes it. Where pathwaysutils has patched ``jax.profiler`` already, its patch does the
same and this one stands aside; where pathwaysutils patches it later, wrapping this one, this
one leaves the workers to it.
"""

from __future__ import annotations

import datetime
import json
import sys
import threading
from typing import Any, Iterator, Optional

_lock = threading.Lock()
_running: Optional[Any] = None  # the compiled profile request between start and stop


def install() -> None:
    """Wrap jax.profiler's start_trace, stop_trace and trace, unless someone (pathwaysutils)
    has. JAX's ``trace`` calls the start and stop of its own module, and in later releases
    neither, so the three are replaced there and in ``jax.profiler`` alike."""
    import contextlib

    import jax
    from jax._src import profiler as jax_profiler  # whose functions jax.profiler re-exports

    start, stop = jax_profiler.start_trace, jax_profiler.stop_trace
    if jax.profiler.start_trace is not start or jax.profiler.stop_trace is not stop:
        return

    def start_trace(log_dir: Any, create_perfetto_link: bool = False, create_perfetto_trace: bool = False,
                    profiler_options: Any = None) -> Any:
        global _running
        if _pathwaysutils_profiling():  # its patch started the workers, and calls this for the client
            return start(log_dir, create_perfetto_link, create_perfetto_trace, profiler_options)
        options = profiler_options if profiler_options is not None else jax.profiler.ProfileOptions()
        if not options.session_id:  # the run the client's trace and the workers' share
            options.session_id = datetime.datetime.now().strftime("%Y_%m_%d_%H_%M_%S")
        with _lock:
            if _running is not None:
                raise RuntimeError("a trace is being taken already: stop it first (jax.profiler.stop_trace)")
            executable = _compile({"traceLocation": str(log_dir), "maxNumHosts": 0,
                                   "traceSessionName": options.session_id})
            _execute(executable)
            _running = executable
        try:
            return start(log_dir, create_perfetto_link, create_perfetto_trace, options)
        except BaseException:
            with _lock:
                _running = None
            try:
                _execute(executable)  # the workers stop too
            except Exception:  # noqa: BLE001 - the client's own failure is the one to raise
                pass
            raise

    def stop_trace() -> Any:
        global _running
        try:
            with _lock:
                executable, _running = _running, None
                if executable is not None:
                    _execute(executable)
        finally:
            result = stop()
        return result

    @contextlib.contextmanager
    def trace(log_dir: Any, create_perfetto_link: bool = False, create_perfetto_trace: bool = False,
              profiler_options: Any = None) -> Iterator[Any]:
        session = start_trace(log_dir, create_perfetto_link, create_perfetto_trace, profiler_options)
        try:
            yield session
        finally:
            stop_trace()

    for name, function in (("start_trace", start_trace), ("stop_trace", stop_trace), ("trace", trace)):
        function.__doc__ = getattr(jax_profiler, name).__doc__
        setattr(jax_profiler, name, function)
        setattr(jax.profiler, name, function)


def _pathwaysutils_profiling() -> bool:
    """Whether pathwaysutils' own patch has the workers profiling: imported after this one
    was installed, it wraps it, and calls it for the client's own trace."""
    state = getattr(sys.modules.get("pathwaysutils.profiling"), "_profile_state", None)
    return getattr(state, "executable", None) is not None


def _compile(request: dict) -> Any:
    import jax
    from jax.extend import ifrt_programs

    programs = ifrt_programs.ifrt_programs
    client = jax.local_devices()[0].client
    return client.compile_ifrt_program(programs.make_plugin_program(json.dumps({"profileRequest": request})),
                                       programs.make_plugin_compile_options())


def _execute(executable: Any) -> None:
    """Run the profile request once (a start, then a stop), waiting for the workers."""
    executable.execute_sharded([], with_tokens=True).consume_token().block_until_ready()
