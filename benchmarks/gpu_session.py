"""One lent GPU's session in one call: pipeflow's CUDA tests, single-GPU training steps
beside the simulator's prediction of each, and an operator sweep for a device-time
profile. Each part runs under its own share of a wall-clock budget, records its error
instead of stopping the others, and writes its JSON file as it goes:

    python3 benchmarks/gpu_session.py OUT [--budget-s 520]     # on the GPU, from the repo root
    python3 benchmarks/gpu_session.py OUT --cpu-smoke           # every part at tiny sizes on CPU

OUT receives (a flat folder, each file small):
- ``cuda_tests.json``: ``pytest -m cuda tests/test_cuda.py`` (return code, summary line, output);
- ``steps.json``: ``python -m pipeflow.train`` at one stage on the GPU for five configs (median
  step time after the first two steps, peak memory, tokens/s, the command) and
  ``pipeflow.simulate.run_simulation``'s makespan for each on an H100-like single GPU;
- ``ops.json``: bf16/fp32 matrix products, causal SDPA, norms and elementwise bandwidth,
  cross-entropy, AdamW (fused / foreach / single tensor), launch and graph-replay costs
  (``pipeflow.topology.op_sweep``, as ``python -m pipeflow.measure_device`` runs it);
- ``session.json``: device, versions, date, commit, and each part's status and seconds.

``--tree-hash`` prints the hash of the files this session runs (pipeflow/, conf/, tests/,
this script), which ``session.json`` records too: compare it with a checkout's to know
which commit ran where no git is.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import importlib.util
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve()
PARTS = [  # (name, file, nominal share of the budget in seconds, least seconds worth starting)
    ("cuda_tests", "cuda_tests.json", 200, 30),
    ("steps", "steps.json", 215, 30),  # five runs, each a few seconds of steps and a final checkpoint (GBs)
    ("ops", "ops.json", 105, 15),
]
RESERVE_S = 4  # kept back for session.json
TAIL = 4000


# ---------------------------------------------------------------- small helpers


def now_iso() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def write_json(path: Path, data) -> None:
    """Write atomically (a file cut short by a kill never replaces a whole one)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, default=str))
    os.replace(tmp, path)


def say(msg: str) -> None:
    print(f"[gpu_session {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def child_env() -> dict:
    """The environment for subprocesses: the repo root importable, output unbuffered."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(ROOT) not in paths and "." not in paths:
        paths.append(str(ROOT))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env["HYDRA_FULL_ERROR"] = "1"
    env.pop("WANDB_MODE", None)
    return env


def run_proc(cmd: list[str], timeout_s: float, cwd: Path = ROOT, interrupt_first: bool = False) -> dict:
    """Run ``cmd`` in its own process group with its output in a file; past ``timeout_s``
    interrupt it (SIGINT, so pytest still prints its summary) and then kill its group."""
    t0 = time.monotonic()
    with tempfile.TemporaryFile("w+", errors="replace") as log:
        proc = subprocess.Popen(cmd, cwd=cwd, env=child_env(), stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=max(1.0, timeout_s))
        except subprocess.TimeoutExpired:
            timed_out = True
            if interrupt_first:
                _signal(proc, signal.SIGINT, group=False)
                try:
                    proc.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    pass
            if proc.poll() is None:
                _signal(proc, signal.SIGTERM, group=True)
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    _signal(proc, signal.SIGKILL, group=True)
                    proc.wait()
        _signal(proc, signal.SIGKILL, group=True)  # what it left behind (rank processes) in its group
        log.seek(0)
        out = log.read()
    return {"cmd": cmd, "rc": proc.returncode, "timed_out": timed_out, "seconds": round(time.monotonic() - t0, 2),
            "output": out}


def _signal(proc: subprocess.Popen, sig: int, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)  # the group this script started (start_new_session): its id is proc.pid
        else:
            proc.send_signal(sig)
    except (ProcessLookupError, PermissionError):
        pass


def tree_hash() -> str:
    """sha256 over the files the session runs: pipeflow/**.py, conf/**.yaml, tests/*.py, this script."""
    h = hashlib.sha256()
    files = [*sorted((ROOT / "pipeflow").rglob("*.py")), *sorted((ROOT / "conf").rglob("*.yaml")),
             *sorted((ROOT / "tests").glob("*.py")), SCRIPT]
    for f in files:
        h.update(str(f.relative_to(ROOT)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()


def git_commit() -> str | None:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        return r.stdout.strip() or None if r.returncode == 0 else None
    except Exception:  # noqa: BLE001 - no git there
        return None


def versions() -> dict:
    from importlib import metadata

    names = ["torch", "transformers", "datasets", "hydra-core", "omegaconf", "antlr4-python3-runtime",
             "huggingface-hub", "pyarrow", "fsspec", "pandas", "numpy", "dill", "multiprocess", "xxhash",
             "tokenizers", "safetensors", "scikit-learn", "matplotlib", "pytest", "pytest-timeout", "wandb"]
    out = {}
    for n in names:
        try:
            out[n] = metadata.version(n)
        except metadata.PackageNotFoundError:
            out[n] = None
    return out


def env_facts(smoke: bool) -> dict:
    """What ran where: versions, the GPU as nvidia-smi names it, whether pipeflow's train
    path imports (a subprocess, so this process holds no CUDA context)."""
    facts = {"python": sys.version.split()[0], "executable": sys.executable, "cwd": os.getcwd(),
             "pythonpath": os.environ.get("PYTHONPATH"), "versions": versions()}
    if shutil.which("nvidia-smi"):
        try:
            r = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,"
                                "clocks.max.sm,power.limit,temperature.gpu", "--format=csv"],
                               capture_output=True, text=True, timeout=30)
            facts["nvidia_smi"] = (r.stdout + r.stderr).strip()
        except Exception as e:  # noqa: BLE001
            facts["nvidia_smi"] = f"error: {e!r}"
    probe = ("import json, torch, datasets, hydra, omegaconf, transformers, pipeflow.train, pipeflow.simulate; "
             "print(json.dumps({'torch': torch.__version__, 'cuda': torch.version.cuda, "
             "'cuda_available': torch.cuda.is_available(), 'datasets_from': datasets.__file__, "
             "'device': torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu', "
             "'hydra_from': hydra.__file__, 'transformers': transformers.__version__}))")
    r = run_proc([sys.executable, "-c", probe], timeout_s=90)
    facts["import_probe"] = {"rc": r["rc"], "seconds": r["seconds"], "output": r["output"][-3000:]}
    try:
        facts.update(json.loads(r["output"].strip().splitlines()[-1]))
    except (ValueError, IndexError):
        pass
    return facts


# ---------------------------------------------------------------- part A: the CUDA tests

SUMMARY_RE = re.compile(r"\b\d+ (passed|failed|skipped|errors?|deselected|xfailed|xpassed)\b|no tests ran")


def part_cuda_tests(out: Path, budget_s: float, smoke: bool) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-x", "tests/test_cuda.py", "-p", "no:cacheprovider",
           "-rfEsp", "--durations=20"]
    notes = []
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd[6:6] = ["--timeout=180"]
    else:
        notes.append("pytest-timeout missing: no per-test timeout")
    if importlib.util.find_spec("sklearn") is None:  # data=image_text's default digits come from scikit-learn
        cmd += ["-k", "not cbm"]
        notes.append("scikit-learn missing: the cbm cases deselected")
    rec = {"status": "running", "budget_s": round(budget_s, 1), "notes": notes, "cmd": " ".join(cmd)}
    write_json(out / "cuda_tests.json", rec)
    r = run_proc(cmd, timeout_s=budget_s - 20, interrupt_first=True)
    text = r["output"]
    lines = [ln.strip("= ").strip() for ln in text.splitlines() if SUMMARY_RE.search(ln)]
    rec.update(status="timed_out" if r["timed_out"] else ("passed" if r["rc"] == 0 else "failed"), rc=r["rc"],
               seconds=r["seconds"], summary=lines[-1] if lines else None, output_tail=text[-TAIL:],
               output=text[-200_000:])
    write_json(out / "cuda_tests.json", rec)
    for ln in [ln for ln in text.splitlines() if ln.startswith(("FAILED", "ERROR"))][:15]:
        say(f"cuda_tests: {ln[:300]}")
    return {"status": rec["status"], "summary": rec["summary"]}


# ---------------------------------------------------------------- part B: training steps

LLAMA_1B = ["model.hf.hidden_size=2048", "model.hf.intermediate_size=5632", "model.hf.num_hidden_layers=16",
            "model.hf.num_attention_heads=32", "model.hf.num_key_value_heads=8",
            "model.hf.max_position_embeddings=2048", "model.seq_len=2048"]
STEP_CONFIGS = [  # name, model overrides, microbatch size, microbatches
    ("gpt_medium_mbs8", ["model=gpt_medium"], 8, 4),
    ("gpt_medium_mbs8_recompute_full", ["model=gpt_medium", "model.recompute=full"], 8, 4),
    ("gpt_1.5b_mbs4", ["model=gpt_1.5b"], 4, 2),
    ("llama_1b_2k_mbs2", ["model=llama_tiny", *LLAMA_1B], 2, 4),
    ("gpt_medium_mbs1", ["model=gpt_medium"], 1, 4),
]
TINY = {  # --cpu-smoke: the same presets at a size two CPU cores train in seconds
    "gpt": ["model.n_layer=2", "model.n_embd=64", "model.n_head=4", "model.seq_len=64"],
    "llama": ["model.hf.hidden_size=64", "model.hf.intermediate_size=128", "model.hf.num_hidden_layers=2",
              "model.hf.num_attention_heads=4", "model.hf.num_key_value_heads=2",
              "model.hf.max_position_embeddings=128", "model.seq_len=64"],
}
SIM_TOPOLOGY = ["topology=cluster", "topology.nodes=1", "topology.gpus_per_node=1", "topology.device=h100-80g"]


def step_config(model: list[str], mbs: int, m: int, smoke: bool) -> list[str]:
    """The model, precision and pipeline overrides the train run and its simulation share."""
    if smoke:
        kept = [o for o in model if not o.startswith("model.hf.") and not o.startswith("model.seq_len")]
        model = kept + TINY["llama" if "model=llama_tiny" in model else "gpt"]
        mbs, m = 2, 2
    return [*model, "precision=bf16", "pipeline.stages=1", f"pipeline.microbatch_size={mbs}",
            f"pipeline.microbatches={m}"]


def _median_after(rows: list[dict], key: str, skip: int = 2):
    vals = [r[key] for r in rows if key in r]
    vals = vals[skip:] if len(vals) > skip else vals
    return statistics.median(vals) if vals else None


def measure_steps(shared: list[str], run_dir: Path, timeout_s: float, smoke: bool) -> dict:
    """One ``python -m pipeflow.train`` run; its step times and memory from the run folder."""
    steps = 4 if smoke else 8
    train = [*shared, f"runtime.device={'cpu' if smoke else 'cuda'}", "logger=none", f"trainer.steps={steps}",
             "trainer.val_every=0", "trainer.timeline_step=null", f"hydra.run.dir={run_dir}"]
    cmd = [sys.executable, "-m", "pipeflow.train", *train]
    r = run_proc(cmd, timeout_s=timeout_s)
    rec = {"cmd": " ".join(cmd), "rc": r["rc"], "timed_out": r["timed_out"], "wall_s": r["seconds"]}
    metrics = run_dir / "metrics.jsonl"
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines() if ln.strip()] if metrics.exists() else []
    summary = json.loads((run_dir / "summary.json").read_text()) if (run_dir / "summary.json").exists() else {}
    rec.update(
        status="ok" if r["rc"] == 0 and rows else "failed",
        step_times=[round(x["step_time"], 5) for x in rows if "step_time" in x],
        median_step_time_after_2=_median_after(rows, "step_time"),
        median_tokens_per_s_after_2=_median_after(rows, "tokens_per_s"),
        losses=[round(x["loss"], 4) for x in rows if "loss" in x],
        summary={k: summary.get(k) for k in ("status", "precision", "attention", "recompute", "mean_step_time",
                                             "mean_tokens_per_s", "peak_memory_bytes", "peak_saved_bytes",
                                             "train_time", "wall_time", "final_loss", "layers_per_stage")},
        peak_memory_bytes=summary.get("peak_memory_bytes"),
        output_tail=r["output"][-(6000 if rec["rc"] else 2500):],
    )
    return rec


def simulate(shared: list[str]) -> dict:
    """pipeflow-simulate's prediction of the same config on one H100-like GPU (the H200's
    dense bf16 peak is the H100 SXM's)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pipeflow.config import compose
    from pipeflow.simulate import run_simulation

    over = [*shared, *SIM_TOPOLOGY, "draw=false"]
    with tempfile.TemporaryDirectory(prefix="pf_sim_") as d:
        s = run_simulation(compose("simulate", over), d)
    keep = ("model_state_bytes", "peak_activation_bytes", "peak_memory_bytes", "memory_bytes", "memory_peak_action")
    return {"overrides": over, "makespan": s.get("makespan"),
            "peak_memory_bytes": [d.get("peak_memory_bytes") for d in s.get("per_device", [])],
            "per_device_memory": [{k: d.get(k) for k in keep} for d in s.get("per_device", [])],
            "summary": {k: v for k, v in s.items() if not isinstance(v, (list, dict))}}


def scratch_root() -> str | None:
    """Where the runs' folders go: memory (/dev/shm) when it has room for a 1.5B model's
    final checkpoint (about 19 GB, removed after each run), else the temp folder."""
    try:
        if shutil.disk_usage("/dev/shm").free > 48 * 2**30:
            return "/dev/shm"
    except OSError:
        pass
    return None


def part_steps(out: Path, budget_s: float, smoke: bool) -> dict:
    t0 = time.monotonic()
    deadline = t0 + budget_s
    runs: dict[str, dict] = {}
    doc = {"status": "running", "budget_s": round(budget_s, 1), "device": "cpu" if smoke else "cuda",
           "note": "median_step_time_after_2: the median of steps 3..N; ratio_measured_over_simulated: that over "
                   "the simulated makespan",
           "reference_2026_11_28": {"gpt_medium_mbs8": {"measured_median_step_s": 0.319, "simulated_makespan_s": 0.154,
                                                        "transformers": "5.24.0", "torch": "2.11.0+cu130"}},
           "runs": runs}
    write_json(out / "steps.json", doc)
    work = Path(tempfile.mkdtemp(prefix="pf_steps_", dir=scratch_root()))
    doc["scratch"] = str(work)
    try:
        for name, model, mbs, m in STEP_CONFIGS:
            shared = step_config(model, mbs, m, smoke)
            left = deadline - time.monotonic() - 8  # the simulations after the runs take seconds
            if left < 25:
                runs[name] = {"status": "skipped", "why": f"{left:.0f} s left of the part's budget"}
                continue
            run_dir = work / name
            try:
                runs[name] = measure_steps(shared, run_dir, min(left, 150.0), smoke)
            except Exception:  # noqa: BLE001
                runs[name] = {"status": "error", "error": traceback.format_exc()[-3000:]}
            shutil.rmtree(run_dir, ignore_errors=True)  # the final checkpoint: GBs at 1.5B parameters
            r = runs[name]
            say(f"steps {name}: {r.get('status')} median step {r.get('median_step_time_after_2')} s, "
                f"peak {r.get('peak_memory_bytes')}, wall {r.get('wall_s')} s")
            write_json(out / "steps.json", doc)
        for name, model, mbs, m in STEP_CONFIGS:  # CPU work: cheap, and done for skipped runs too
            if deadline - time.monotonic() < 3:
                runs[name]["simulated"] = {"status": "skipped", "why": "no budget left"}
                continue
            try:
                sim = simulate(step_config(model, mbs, m, smoke))
                runs[name]["simulated"] = sim
                meas = runs[name].get("median_step_time_after_2")
                if meas and sim["makespan"]:
                    runs[name]["ratio_measured_over_simulated"] = meas / sim["makespan"]
            except Exception:  # noqa: BLE001
                runs[name]["simulated"] = {"status": "error", "error": traceback.format_exc()[-3000:]}
        write_json(out / "steps.json", doc)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    ok = sum(r.get("status") == "ok" for r in runs.values())
    doc["status"] = "ok" if ok == len(STEP_CONFIGS) else ("partial" if ok else "failed")
    doc["seconds"] = round(time.monotonic() - t0, 1)
    write_json(out / "steps.json", doc)
    return {"status": doc["status"], "ok_runs": ok,
            "ratios": {k: r.get("ratio_measured_over_simulated") for k, r in runs.items()}}


# ---------------------------------------------------------------- part C: the operator sweep (a child process)


def part_ops(out: Path, budget_s: float, smoke: bool) -> dict:
    """The sweep in a child process, so a crash or a hang in a kernel loses only this part."""
    cmd = [sys.executable, str(SCRIPT), str(out), "--ops-child", "--ops-budget-s", f"{budget_s - 12:.0f}",
           *(["--cpu-smoke"] if smoke else [])]
    r = run_proc(cmd, timeout_s=budget_s)
    print(r["output"][-3000:].rstrip(), flush=True)  # its progress lines
    sweep = {}
    if (out / "ops.json").exists():
        sweep = json.loads((out / "ops.json").read_text())
    status = sweep.get("status", "missing")
    if r["rc"] != 0 or r["timed_out"]:
        status = f"child rc={r['rc']}{' timed out' if r['timed_out'] else ''} (ops.json: {status})"
    return {"status": status, "child_seconds": r["seconds"], "child_output_tail": r["output"][-2500:],
            "sections": {k: v.get("status") for k, v in sweep.get("sections", {}).items() if isinstance(v, dict)}}


def ops_child(out: Path, budget_s: float, smoke: bool) -> int:
    """The sweep itself (pipeflow.topology.op_sweep) into OUT/ops.json: the GPU's, or with
    --cpu-smoke the CPU's at tiny sizes."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from pipeflow.topology.op_sweep import sweep

    sweep(out / "ops.json", budget_s, "cpu" if smoke else "cuda", smoke=smoke, say=lambda line: say(f"ops {line}"))
    return 0


# ---------------------------------------------------------------- the session


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?", help="the folder the JSON files go to")
    ap.add_argument("--budget-s", type=float, default=520.0, help="wall-clock seconds for all parts together")
    ap.add_argument("--cpu-smoke", action="store_true", help="every part at tiny sizes on CPU")
    ap.add_argument("--parts", default="cuda_tests,steps,ops", help="which parts, in order (comma-separated)")
    ap.add_argument("--commit", default=None, help="the commit to record where the tree has no git")
    ap.add_argument("--tree-hash", action="store_true", help="print the tree hash and exit")
    ap.add_argument("--ops-child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--ops-budget-s", type=float, default=100.0, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.tree_hash:
        print(tree_hash())
        return 0
    if not args.out:
        ap.error("the output folder is required")
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    if args.ops_child:
        return ops_child(out, args.ops_budget_s, args.cpu_smoke)

    t0 = time.monotonic()
    wanted = [p for p in args.parts.split(",") if p]
    parts = [p for p in PARTS if p[0] in wanted]
    session = {"started": now_iso(), "mode": "cpu-smoke" if args.cpu_smoke else "gpu", "budget_s": args.budget_s,
               "commit": args.commit or git_commit(), "tree_sha256": None, "parts": {}}
    try:
        session["tree_sha256"] = tree_hash()
    except Exception as e:  # noqa: BLE001
        session["tree_sha256"] = f"error: {e!r}"
    write_json(out / "session.json", session)
    say(f"start: budget {args.budget_s:.0f} s, parts {[p[0] for p in parts]}, out {out}")
    try:
        session["env"] = env_facts(args.cpu_smoke)
    except Exception:  # noqa: BLE001
        session["env"] = {"error": traceback.format_exc()[-2000:]}
    session["device"], session["torch"] = session["env"].get("device"), session["env"].get("torch")
    probe = session["env"].get("import_probe", {})
    say(f"env: import probe rc={probe.get('rc')} {probe.get('output', '')[-300:].strip()}")
    write_json(out / "session.json", session)

    runners = {"cuda_tests": part_cuda_tests, "steps": part_steps, "ops": part_ops}
    for i, (name, _file, nominal, least) in enumerate(parts):
        left = args.budget_s - (time.monotonic() - t0) - RESERVE_S
        later = sum(p[2] for p in parts[i + 1:])
        budget = left if not later else left * nominal / (nominal + later)
        rec = {"budget_s": round(budget, 1)}
        session["parts"][name] = rec
        if budget < least:
            rec.update(status="skipped", why=f"{budget:.0f} s of the budget for it, under its least {least} s")
            say(f"part {name}: skipped ({rec['why']})")
            write_json(out / "session.json", session)
            continue
        say(f"part {name}: start, {budget:.0f} s")
        ts = time.monotonic()
        try:
            rec.update(runners[name](out, budget, args.cpu_smoke))
        except Exception:  # noqa: BLE001
            rec.update(status="error", error=traceback.format_exc()[-3000:])
        rec["seconds"] = round(time.monotonic() - ts, 1)
        say(f"part {name}: {rec.get('status')} in {rec['seconds']} s "
            f"{json.dumps({k: v for k, v in rec.items() if k in ('summary', 'ratios', 'ok_runs', 'sections')}, default=str)}")
        write_json(out / "session.json", session)

    session.update(finished=now_iso(), seconds=round(time.monotonic() - t0, 1))
    write_json(out / "session.json", session)
    say(f"done in {session['seconds']} s: " + ", ".join(f"{k}={v.get('status')}" for k, v in session["parts"].items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
