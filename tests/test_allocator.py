"""The malloc thresholds a process that moves array bytes in 1 MiB messages keeps
(wire/allocator.py): freed message buffers are reused, not unmapped and faulted in again."""

import subprocess
import sys
import textwrap

# 10 rounds of 32 messages of 1 MiB alive at once then freed, on a thread and on the main
# thread (glibc gives threads arenas of their own): the page faults they took
_MESSAGES = textwrap.dedent("""
    import resource, sys, threading
    from pathways.wire import allocator
    if sys.argv[1] == "keep":
        assert allocator.keep_message_memory()

    def rounds(faults):
        def messages():
            held = [bytes(bytearray(1 << 20)) for _ in range(32)]
            del held
        messages()  # the first round maps what the next ones may reuse
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for _ in range(10):
            messages()
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

    faults = []
    thread = threading.Thread(target=rounds, args=(faults,))
    thread.start()
    thread.join()
    rounds(faults)
    print(*faults)
""")


def _faults(mode):
    out = subprocess.run([sys.executable, "-c", _MESSAGES, mode], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [int(n) for n in out.stdout.split()]


def test_kept_message_memory_is_reused_instead_of_faulted_in_again():
    default, kept = _faults("default"), _faults("keep")
    pages = 10 * 32 * (1 << 20) // 4096  # one round's messages, in pages, times the rounds
    assert all(n > pages // 4 for n in default), f"glibc's defaults map each round again: {default} faults"
    assert all(n < pages // 100 for n in kept), f"kept memory is reused: {kept} faults"
