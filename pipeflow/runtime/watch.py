"""What the launcher and its ranks share to tell a rank that works from one that waits
forever: a board of small shared arrays, written by each rank's watchdog thread.
``beats`` (when each rank last beat), ``stuck`` (since when its main thread has sat in one
call, sampled every ``SAMPLE`` seconds), ``where`` (that call and its pipeflow line) and
``acks`` (the rank heard a stop). Every live rank stuck for ``runtime.hang_timeout_s`` is
a job nobody can move (docs/training.md on failures)."""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import traceback
from dataclasses import dataclass

WHERE = 240  # bytes of each rank's place on the board
SAMPLE = 0.1  # seconds between samples of the main thread (beats go on every BEAT)


@dataclass
class Board:
    beats: object
    stuck: object
    acks: object
    where: object

    @classmethod
    def make(cls, ctx, world: int) -> "Board":
        return cls(ctx.Array("d", world, lock=False), ctx.Array("d", world, lock=False),
                   ctx.Array("b", world, lock=False), ctx.Array("c", world * WHERE, lock=False))

    def place(self, rank: int) -> str:
        raw = bytes(self.where[rank * WHERE:(rank + 1) * WHERE])
        return raw.split(b"\0", 1)[0].decode(errors="replace")

    def _set_place(self, rank: int, text: str) -> None:
        data = text.encode()[:WHERE - 1]
        self.where[rank * WHERE:rank * WHERE + len(data) + 1] = data + b"\0"


# ---------------------------------------------------------------- in a rank
_board: list[Board] = []  # this rank's board (set by its entry)
_rank: list[int] = []
_armed: list[bool] = []  # training has begun: from here a long call is looked at


def install(board: Board | None, rank: int) -> None:
    _board[:] = [board] if board is not None else []
    _rank[:] = [rank]


def arm() -> None:
    """Training begins: from now on the watchdog reports a main thread that sits still
    (start-up's long calls, a tokenizer's batch or W&B's start, are not looked at)."""
    _armed[:] = [True]


_paused: list[bool] = []  # inside paused(): a long call that is no hang (writing a checkpoint)


_sampling = threading.Lock()  # held by the watchdog while it holds a frame of the main thread


@contextlib.contextmanager
def paused():
    """A block whose one long call is work, not waiting (torch.save to a slow disk), or whose
    frames must not be held (a memory-profiled step): the rank counts as moving and the
    watchdog takes no frame of the main thread (a sample under way is waited for)."""
    _paused.append(True)
    with _sampling:
        pass
    try:
        yield
    finally:
        _paused.pop()


def heard_stop() -> None:
    """The rank's signal handler ran: it can stop by itself."""
    if _board:
        _board[0].acks[_rank[0]] = 1


def describe(stack: traceback.StackSummary) -> str:
    """Where a thread sits, from its calls (outermost first, as ``traceback.extract_stack``
    gives them): its innermost call, and the pipeflow line that made it."""
    top = stack[-1]
    ours = next((f for f in reversed(stack) if "/pipeflow/" in f.filename), None)
    text = f"{top.name} ({top.filename.rsplit('/', 1)[-1]}:{top.lineno})"
    if ours is not None and ours is not top:
        text += f" from {ours.filename.split('/pipeflow/', 1)[1]}:{ours.lineno} in {ours.name}"
    return text


class Sampler:
    """The main thread's position, sample by sample; ``since``: when it last moved. A sample
    holds the main thread's frame only while it reads the position, and returns the calls."""

    def __init__(self) -> None:
        self.main = threading.main_thread().ident
        self.key = None
        self.since = time.monotonic()

    def sample(self, now: float):
        """(the monotonic time since which the main thread has not moved, its calls: a
        ``traceback.StackSummary``, which holds no frame) or (0.0, None) where it moved
        since the last sample."""
        # a frame kept past its call keeps the call's tensors alive and frees them on this
        # thread, unseen by the memory profiler; faulthandler.dump_traceback, which makes no
        # frame, reads other threads' states unlocked (SIGSEGV in tensor-parallel Seq1F1B)
        frame = sys._current_frames().get(self.main)
        if frame is None:
            return 0.0, None
        key = (id(frame), id(frame.f_code), frame.f_lasti)
        moved = key != self.key
        calls = None if moved else traceback.extract_stack(frame)
        del frame
        if moved:
            self.key, self.since = key, now
            return 0.0, None
        return self.since, calls


def look(rank: int, sampler: Sampler, beat: bool) -> None:
    """One look of the rank's watchdog at its main thread, and a beat on the board."""
    if not _board:
        return
    board, now = _board[0], time.monotonic()
    if beat:
        board.beats[rank] = now
    if not _armed or _paused:
        board.stuck[rank] = 0.0
        return
    with _sampling:
        if _paused:  # (paused while this sample waited)
            board.stuck[rank] = 0.0
            return
        since, stack = sampler.sample(now)
    if since and not board.stuck[rank]:
        board._set_place(rank, describe(stack))
    board.stuck[rank] = since


def stuck_job(board: Board, live: list[int], after: float) -> tuple[int, str] | None:
    """(the rank that sat still first, the sentence) where every live rank has sat in
    one call for more than ``after`` seconds; else None."""
    now = time.monotonic()
    since = {r: board.stuck[r] for r in live}
    if not live or not all(s and now - s > after for s in since.values()):
        return None
    first = min(live, key=lambda r: since[r])
    # ranks that sat still within one sample of the first: which of them began it, the
    # samples cannot tell (in a deadlock each waits for another), so all are named
    tied = [r for r in live if since[r] - since[first] <= SAMPLE]
    who = (f"rank {first} sat still first" if len(tied) == 1 else
           f"ranks {', '.join(map(str, tied))} sat still within {SAMPLE:g} s of each other")
    places = "; ".join(f"rank {r} for {now - since[r]:.0f} s in {board.place(r)}" for r in live)
    return first, (f"the job stopped moving: every rank has sat in one call for over {after:g} s "
                   f"(runtime.hang_timeout_s), each waiting on the others (a collective or a receive that no "
                   f"rank completes), and {who}: {places}")
