"""The rank's watchdog samples where the main thread sits without holding its frame:
a frame that outlives its call keeps the call's locals (a step's tensors) alive, and
frees them on the watchdog's thread, where torch's profiler records no free."""

from __future__ import annotations

import threading
import traceback
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
        assert any(f.name == "_sits_still" and f.filename.endswith("test_watch.py") for f in stack), stack
        assert isinstance(stack, traceback.StackSummary) and all(f.locals is None for f in stack)  # no frame
    finally:
        done.set()
        thread.join(5)


def test_paused_waits_for_a_sample_under_way_and_takes_none_after():
    """A memory-profiled step runs paused(): a sample that holds the main thread's frame
    when the pause begins is waited for, and no sample is taken inside it."""
    board = watch.Board([0.0], [7.0], [0], [b"\0"] * watch.WHERE)
    taken = []

    class Counting(watch.Sampler):
        def sample(self, now):
            taken.append(now)
            return super().sample(now)

    watch.install(board, 0)
    watch.arm()
    try:
        sampler = Counting()
        watch.look(0, sampler, beat=False)
        assert len(taken) == 1
        with watch.paused():
            watch.look(0, sampler, beat=False)
            assert len(taken) == 1 and board.stuck[0] == 0.0  # none taken, counted as moving
        with watch._sampling:  # a sample under way: paused() waits for it
            entered = []
            t = threading.Thread(target=lambda: entered.append(watch.paused().__enter__()))
            t.start()
            t.join(0.2)
            assert t.is_alive() and not entered
        t.join(5)
        assert entered == [None]  # in once the sample let go
    finally:
        watch._armed.clear()
        watch.install(None, 0)
