"""One call in a forked child, with a deadline: what a test of code that may loop under a
process-shared lock needs (a thread could not be stopped; the child is killed)."""

import os
import resource
import signal
import time
import traceback


def in_child(
    run, deadline_s: float, memory_bytes: int = 512 << 20, here_under_mutation=False
) -> str:
    """What ``run()`` (returning a str) returned in a forked child, ``"child: Error: ...``
    with its traceback if it raised, or ``"killed"`` when the child outlived
    ``deadline_s`` (then SIGKILLed). The child's address space is capped at its size at
    the fork plus ``memory_bytes``, so a list grown without bound fails there, not on
    the host. ``here_under_mutation``: under tests/mutate.py, ``run()`` in this process (for
    a call that behaves alike in any process of the same user)."""
    if here_under_mutation and os.environ.get("ECOFFLOAD_MUTATION") == "1":  # mutmut: here,
        # where its record of which tests call which function sees the call (a forked child
        # hides it, so no mutant of the functions called there was run against the test);
        # mutmut's own time limit stands for the deadline
        try:
            return run()
        except Exception as e:  # as the child would report it
            return f"child: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        os.close(read)
        try:
            with open("/proc/self/status") as f:
                vm = next(int(line.split()[1]) for line in f if line.startswith("VmSize:"))
            resource.setrlimit(resource.RLIMIT_AS, (vm * 1024 + memory_bytes,) * 2)
            report = run()
        except BaseException as e:  # noqa: BLE001 - reported to the parent
            report = f"child: {type(e).__name__}: {e}\n{traceback.format_exc()[-3000:]}"
        os.write(write, report.encode()[:60000])
        os._exit(0)
    os.close(write)
    stop = time.monotonic() + deadline_s
    while not os.waitpid(pid, os.WNOHANG)[0]:
        if time.monotonic() >= stop:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(read)
            return "killed"
        time.sleep(0.005)
    with os.fdopen(read, "rb") as f:
        return f.read().decode()
