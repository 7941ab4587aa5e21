"""The way from ``pipeflow-train``'s main to a rank's first forward, call by call.

    python -m benchmarks.call_path                 # the default run (gpt_tiny, 1F1B, 2 ranks)
    python -m benchmarks.call_path schedule=zb_h1  # any train overrides

Runs ``pipeflow-train`` for two steps with a hook in every process (a ``sitecustomize``
on the ``PYTHONPATH``) that writes pipeflow's frames on the stack twice: in the app,
where it starts the first rank; in each rank, where it calls its first model module.
Prints both paths and their total: the calls a reader follows from the command line to
the model's first forward (docs/style.md quotes it).

    python -m benchmarks.call_path --breadth       # every distinct function on the way

``--breadth`` counts the other dimension: every distinct pipeflow function that runs
(a profiler hook in each process; functions and methods, not class bodies,
comprehensions or lambdas) in the app until it starts the first rank, and in a
rank from its entry until its first model module; the app's and the rank's together are
the functions a reader meets between the command line and the first forward
(docs/architecture.md quotes it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

HOOK = '''
import os, traceback
OUT = os.environ["PIPEFLOW_CALL_PATH"]
state = {"forward": False, "start": False, "hooked": False}

def frames():
    out = []
    for f in traceback.extract_stack()[:-2]:
        if "/pipeflow/" in f.filename and "site-packages" not in f.filename:
            out.append(f.filename.split("/pipeflow/")[-1] + ":" + f.name)
        elif f.filename.endswith("pipeflow-train"):
            out.append("pipeflow-train")
    return out

def hook():
    import multiprocessing.process as mp
    import torch
    call, start = torch.nn.Module.__call__, mp.BaseProcess.start

    def first_forward(self, *a, **k):
        if not state["forward"] and type(self).__module__.startswith("pipeflow.models"):
            state["forward"] = True
            with open(OUT + ".rank%d" % os.getpid(), "w") as f:
                f.write("\\n".join(frames()))
        return call(self, *a, **k)

    def first_start(self):
        if not state["start"]:
            state["start"] = True
            with open(OUT + ".app", "w") as f:
                f.write("\\n".join(frames()))
        return start(self)

    torch.nn.Module.__call__ = first_forward
    mp.BaseProcess.start = first_start

import builtins
_import = builtins.__import__

def watching(name, *a, **k):
    m = _import(name, *a, **k)
    if name == "torch" and not state["hooked"] and hasattr(getattr(m, "nn", None), "Module"):
        state["hooked"] = True
        hook()
    return m

builtins.__import__ = watching
'''


BREADTH = '''
import os, sys
OUT = os.environ["PIPEFLOW_CALL_PATH"]
seen = set()
state = {"rank": False}

def write(suffix):
    with open(OUT + suffix, "w") as f:
        f.write("\\n".join(sorted(seen)))

def profile(frame, event, arg):
    if event != "call":
        return
    code = frame.f_code
    path = code.co_filename
    if "/pipeflow/" not in path or "site-packages" in path or "/benchmarks/" in path:
        return
    # functions only: a class body or a module runs as a code object without
    # CO_OPTIMIZED, and comprehensions, generators and lambdas are named "<...>"
    if not code.co_flags & 1 or code.co_name.startswith("<"):
        return
    name = code.co_qualname
    if name == "_rank_entry" and not state["rank"]:
        state["rank"] = True  # a forked rank: count from its entry
        seen.clear()
    seen.add(path.split("/pipeflow/")[-1] + ":" + name)

def hook():
    import multiprocessing.process as mp
    import torch
    call, start = torch.nn.Module.__call__, mp.BaseProcess.start
    done = {"app": False}

    def first_forward(self, *a, **k):
        if state["rank"] and type(self).__module__.startswith("pipeflow.models"):
            sys.setprofile(None)
            write(".rank%d" % os.getpid())
            state["rank"] = False
            torch.nn.Module.__call__ = call
        return call(self, *a, **k)

    def first_start(self):
        if not done["app"] and not state["rank"]:
            done["app"] = True
            write(".app")
        return start(self)

    torch.nn.Module.__call__ = first_forward
    mp.BaseProcess.start = first_start

import builtins
_import = builtins.__import__
hooked = {"done": False}

def watching(name, *a, **k):
    m = _import(name, *a, **k)
    if name == "torch" and not hooked["done"] and hasattr(getattr(m, "nn", None), "Module"):
        hooked["done"] = True
        hook()
    return m

builtins.__import__ = watching
sys.setprofile(profile)
'''


def _run_train(hook: str, tmp: str, overrides: list[str]) -> None:
    (Path(tmp) / "sitecustomize.py").write_text(hook)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([tmp, str(ROOT)]),
           "PIPEFLOW_CALL_PATH": str(Path(tmp) / "path")}
    train = Path(sys.executable).with_name("pipeflow-train")
    subprocess.run([str(train), "trainer.steps=2", "trainer.val_every=0", "logger=none",
                    f"hydra.run.dir={tmp}/run", *overrides], env=env, check=True, capture_output=True)


def breadth(overrides: list[str]) -> tuple[set[str], set[str]]:
    """(the distinct pipeflow functions the app runs before it starts the first rank,
    those the first rank runs from its entry to its first model module)."""
    with tempfile.TemporaryDirectory(prefix="pipeflow-call-path-") as tmp:
        _run_train(BREADTH, tmp, overrides)
        app = set((Path(tmp) / "path.app").read_text().splitlines())
        rank = set(sorted(Path(tmp).glob("path.rank*"))[0].read_text().splitlines())
    return app, rank


def call_path(overrides: list[str]) -> tuple[list[str], list[str]]:
    """(the app's frames where it starts the first rank, the first rank's frames where it
    calls its first model module)."""
    with tempfile.TemporaryDirectory(prefix="pipeflow-call-path-") as tmp:
        _run_train(HOOK, tmp, overrides)
        app = (Path(tmp) / "path.app").read_text().splitlines()
        rank = sorted(Path(tmp).glob("path.rank*"))[0].read_text().splitlines()
    return app, rank


def _print_breadth(overrides: list[str], show: bool) -> None:
    app, rank = breadth(overrides)
    both = app | rank
    print(f"distinct pipeflow functions: app {len(app)}, rank {len(rank)}, together {len(both)}")
    if show:
        print("\n".join(f"  {f}" for f in sorted(both)))


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    if "--breadth" in args or "--breadth-list" in args:
        _print_breadth([a for a in args if not a.startswith("--breadth")], "--breadth-list" in args)
        return
    app, rank = call_path(args)
    calls = [f for f in app if f != "pipeflow-train"]  # (the console script's module is no call)
    print(f"in the app, to the first rank's start ({len(calls)} calls):")
    print("\n".join(f"  {f}" for f in calls))
    print(f"in the rank, to its first model module ({len(rank)} calls):")
    print("\n".join(f"  {f}" for f in rank))
    print(f"total: {len(calls) + len(rank)} calls")


if __name__ == "__main__":
    main()
