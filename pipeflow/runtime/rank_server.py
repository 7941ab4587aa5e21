"""The fork server the ranks are forked from, started as soon as a config passes its checks
so its imports overlap the app's. Torch-free; the server never touches CUDA, so forking
is safe."""

from __future__ import annotations

import multiprocessing as mp

# the runtime, and the Agg figure rank 0 draws the measured timeline with (imported in each
# rank 0 it cost 0.8 s a launch: a test session's hundreds of short runs)
PRELOAD = ["pipeflow.runtime.worker", "matplotlib.figure", "matplotlib.backends.backend_agg"]


def rank_context():
    """The multiprocessing context the launcher starts its ranks with: the fork server
    where the platform has one, else spawn."""
    if "forkserver" in mp.get_all_start_methods():
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload(PRELOAD)
        return ctx
    return mp.get_context("spawn")


def start_rank_server() -> None:
    """Start the fork server now, without waiting for its imports (the first rank's start
    waits for them). It ends with this process; a second call does nothing."""
    if "forkserver" not in mp.get_all_start_methods():
        return
    rank_context()
    from multiprocessing import forkserver

    forkserver.ensure_running()
