"""The rank's watchdog samples where the main thread sits without holding its frame:
a frame that outlives its call keeps the call's locals (a step's tensors) alive, and
frees them on the watchdog's thread, where torch's profiler records no free."""

from __future__ import annotations

import threading
import weakref

from pipeflow.runtime import watch


class _Big:
    """Stands for a tensor a call holds in a local."""


def _sits_still(ready: threading.Event, go: threading.Event) -> weakref.ref:
    big = _Big()
    ready.set()
    go.wait(30)  # (line the sampler finds the main thread on)
    return weakref.ref(big)


def test_the_watchdog_names_where_the_main_thread_sits_and_keeps_none_of_its_locals():
    """The watchdog samples the main thread twice while it sits in one call (the second
    sample says since when, and where), and holds what it sampled while the call returns:
    the call's local dies with the call (with sys._current_frames() the sample was the
    frame, which kept it alive until the watchdog let go)."""
    sampler, ready, go, sampled = watch.Sampler(), threading.Event(), threading.Event(), []

    def watchdog() -> None:
        ready.wait(30)
        first = sampler.sample(1.0)
        sampled.append((first, sampler.sample(2.0)))
        go.set()
        done.wait(30)  # held, as a watchdog descheduled between its sample and its next

    done = threading.Event()
    thread = threading.Thread(target=watchdog, daemon=True)
    thread.start()
    local = _sits_still(ready, go)
    try:
        assert local() is None  # the call's local died with it, while the watchdog held its sample
        (since0, _), (since, stack) = sampled[0]
        assert since0 == 0.0 and since == 1.0  # not moved between the samples: sat since the first
        place = watch.describe(stack)
        assert place.startswith("wait (threading.py:"), place
        assert any(name == "_sits_still" and file.endswith("test_watch.py") for file, _, name in stack), stack
    finally:
        done.set()
        thread.join(5)


def test_a_traceback_of_every_thread_is_read_for_one_thread():
    text = ('Thread 0x00007f00000000aa (most recent call first):\n'
            '  File "/x/pipeflow/runtime/worker.py", line 12 in train\n\n'
            'Current thread 0x00007f00000000bb (most recent call first):\n'
            '  File "/usr/lib/python3.11/threading.py", line 320 in wait\n'
            '  File "/x/pipeflow/runtime/executor.py", line 7 in run\n')
    assert watch.thread_stack(text, 0x7f00000000bb) == [("/usr/lib/python3.11/threading.py", 320, "wait"),
                                                       ("/x/pipeflow/runtime/executor.py", 7, "run")]
    assert watch.describe(watch.thread_stack(text, 0x7f00000000bb)) == "wait (threading.py:320) from runtime/executor.py:7 in run"
    assert watch.thread_stack(text, 0x1) == []
