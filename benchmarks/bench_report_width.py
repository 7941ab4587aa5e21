"""Does pipeflow-compare's report.html fit a 1400 px wide window?

Builds a report over many configurations, measured and simulated side by side, opens it
in headless Chromium at 1400 x 1000 px and reads, after the page has loaded, the width
of the document (``document.documentElement.scrollWidth``) against the width of the
viewport it has to fit (``clientWidth``: the window less a vertical scrollbar). The page
scrolls horizontally when the first is the larger. It also saves a screenshot of the
whole page and reports the pixel size of every figure.

The runs are written here by default, as the apps write them (config.json, metrics.jsonl,
summary.json; Hydra-style folder names): 6 schedules x 2 microbatch counts, 2 seeds
each, one crashed run, and a simulation of every configuration whose step time is a
sixth of the measured one (a cost model of another machine). ``--runs`` takes real run
or multirun folders instead.

    .venv/bin/python -m benchmarks.bench_report_width
    .venv/bin/python -m benchmarks.bench_report_width --runs outputs/multirun/train/... outputs/multirun/simulate/...
    .venv/bin/python -m benchmarks.bench_report_width --width 1024 --out /tmp/report_width

It needs Chromium (Debian: apt-get install chromium; or --chromium PATH). It reports, it
does not fail.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import subprocess
import sys
import tempfile
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pipeflow.compare.cli import CompareConfig, compare  # noqa: E402

SCHEDULES = ("gpipe", "1f1b", "zb_h1", "chimera", "pipedream", "amdp")
ASYNC = ("pipedream", "amdp")
MICROBATCHES = (4, 8)
SEEDS = (1, 2)
GAP = 6.0  # measured step time / simulated
STEPS = 20
_MEASURE = ("<script>window.addEventListener('load', function () {var d = document.documentElement; "
            "document.body.setAttribute('data-measure', JSON.stringify({scrollWidth: d.scrollWidth, "
            "clientWidth: d.clientWidth, innerWidth: window.innerWidth, scrollHeight: d.scrollHeight}));});"
            "</script>")


def _write(path: Path, name: str, data) -> None:
    path.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(r) + "\n" for r in data) if isinstance(data, list) else json.dumps(data)
    (path / name).write_text(text)


def write_runs(root: Path, schedules=SCHEDULES, microbatches=MICROBATCHES, seeds=SEEDS, gap: float = GAP,
               crashed: bool = True) -> list[Path]:
    """Training and simulation folders of ``schedules`` x ``microbatches`` (x ``seeds``
    for training) under ``root``/train and ``root``/simulate; returns those two."""
    job = 0
    for schedule in schedules:
        for m in microbatches:
            # schedules a few percent apart, the asynchronous ones slower per step
            step_time = 0.05 * m * (1.25 if schedule in ASYNC else 1.0) * (1 + 0.04 * (len(schedule) % 4))
            for seed in seeds:
                name = (f"{job}_logger=none,pipeline.microbatches={m},schedule={schedule},seed={seed},"
                        f"trainer.steps={STEPS}")
                job += 1
                config = {"schedule": {"name": schedule}, "seed": seed, "model": {"name": "gpt_tiny"},
                          "pipeline": {"stages": 2, "microbatches": m, "microbatch_size": 4},
                          "trainer": {"steps": STEPS}, "logger": {"name": "none"}}
                updates = m if schedule == "pipedream" else 1
                rows = [{"step": s, "loss": 5.3 - 0.02 * s * (1 + seed / 10) - 0.001 * m, "step_time": step_time,
                         "train_time": s * step_time, "samples": s * m * 4, "updates": s * updates,
                         "tokens_per_s": m * 4 * 128 / step_time, "bubble": 0.1 + 0.3 / m,
                         "max_staleness": 1 if schedule in ASYNC else 0}
                        for s in range(1, STEPS + 1)]
                run = root / "train" / name
                _write(run, "config.json", config)
                _write(run, "metrics.jsonl", rows)
                _write(run, "summary.json", {
                    "kind": "measured", "schedule": schedule, "stages": 2, "microbatches": m, "microbatch_size": 4,
                    "world_size": 2, "mean_step_time": step_time, "mean_tokens_per_s": m * 4 * 128 / step_time,
                    "measured_bubble_ratio": 0.1 + 0.3 / m, "peak_memory_bytes": [533_340_160 + m * 2**20, 496_125_952],
                    "peak_saved_bytes": [3_604_480 * m, 1_802_240 * m], "max_staleness": 1 if schedule in ASYNC else 0,
                    "max_mismatch": 1 if schedule == "amdp" else 0})
            sim = root / "simulate" / (f"{job}_pipeline.microbatch_size=4,pipeline.microbatches={m},"
                                       f"pipeline.stages=2,schedule={schedule}")
            _write(sim, "summary.json", {
                "kind": "simulated", "schedule": schedule, "stages": 2, "microbatches": m, "virtual_stages": 1,
                "segments": 1, "microbatch_size": 4, "num_devices": 2, "makespan": step_time / gap,
                "bubble_ratio": 0.05 + 0.2 / m, "peak_activation_bytes": 14_286_848.0,
                "per_device": [{"device": 0, "peak_activation_bytes": 14_286_848.0 * m / 4},
                               {"device": 1, "peak_activation_bytes": 7_864_320.0 * m / 4}],
                "model": {"name": "gpt_tiny"}, "cost": {"name": "analytic"}, "topology": {"name": "local_cpu"}})
            job += 1
    if crashed:
        run = root / "train" / f"{job}_logger=none,runtime.fail_at_step=4,schedule=chimera,trainer.steps={STEPS}"
        _write(run, "config.json", {"schedule": {"name": "chimera"}, "seed": 1, "model": {"name": "gpt_tiny"},
                                    "pipeline": {"stages": 2, "microbatches": 4, "microbatch_size": 4},
                                    "trainer": {"steps": STEPS}, "logger": {"name": "none"},
                                    "runtime": {"fail_at_step": 4}})
        _write(run, "metrics.jsonl", [{"step": s, "loss": 5.3 - 0.02 * s, "step_time": 0.2} for s in (1, 2, 3)])
        _write(run, "failure.json", {"rank": 1, "error": "RuntimeError: injected failure on rank 1 at step 4"})
    return [root / "train", root / "simulate"]


def find_chromium(given: str | None = None) -> str | None:
    """The Chromium to use: ``given``, else the first of chromium, chromium-browser,
    google-chrome on the PATH."""
    if given:
        return given if Path(given).exists() else shutil.which(given)
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def _chromium(binary: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory() as profile:
        return subprocess.run([binary, "--headless", "--disable-gpu", "--no-sandbox", "--no-first-run",
                               f"--user-data-dir={profile}", "--virtual-time-budget=5000", *args],
                              capture_output=True, text=True, timeout=timeout)


def measure(page: Path, binary: str, width: int = 1400, height: int = 1000) -> dict:
    """The page's scrollWidth, clientWidth, innerWidth and scrollHeight in a ``width`` x
    ``height`` window, read by a script added to a copy of the page once it has loaded."""
    with tempfile.TemporaryDirectory() as tmp:
        probe = Path(tmp) / "probe.html"
        probe.write_text(page.read_text(encoding="utf-8").replace("</body>", _MEASURE + "</body>"), encoding="utf-8")
        proc = _chromium(binary, f"--window-size={width},{height}", "--dump-dom", probe.as_uri())
    found = re.search(r'data-measure="([^"]*)"', proc.stdout)
    if not found:
        raise RuntimeError(f"chromium gave no measurement (exit {proc.returncode}): {proc.stderr[-500:]}")
    import html

    return json.loads(html.unescape(found.group(1)))


def screenshot(page: Path, png: Path, binary: str, width: int = 1400, height: int = 1000) -> Path:
    """A screenshot of the page in a ``width`` px window tall enough for all of it."""
    _chromium(binary, "--hide-scrollbars", f"--window-size={width},{min(height, 16000)}", f"--screenshot={png}",
              page.as_uri())
    return png


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    return struct.unpack(">II", head[16:24])


def table_columns(page: Path) -> list[int]:
    """The number of header cells of each table on the page."""
    text = page.read_text(encoding="utf-8")
    return [head.count("<th") for head in re.findall(r"<thead>(.*?)</thead>", text, re.S)]


def run(paths: list[Path], out: Path, binary: str, width: int) -> dict:
    runs, table, report = compare([str(p) for p in paths], CompareConfig(out=str(out)))
    numbers = measure(report.html, binary, width)
    shot = screenshot(report.html, out / f"report_{width}px.png", binary, width, numbers["scrollHeight"])
    return {
        "runs": len(runs),
        "configurations": len({(r["kind"], r["label"]) for r in table}),
        "columns": table_columns(report.html),
        "figures": {name: png_size(path) for name, path in report.figures.items()},
        **numbers,
        "scrolls": numbers["scrollWidth"] > numbers["clientWidth"],
        "screenshot": str(shot),
        "report": str(report.html),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", nargs="*", help="run or multirun folders (default: written here)")
    parser.add_argument("--width", type=int, default=1400, help="window width in px (default 1400)")
    parser.add_argument("--out", help="where the report and the screenshot go (default: a temporary folder)")
    parser.add_argument("--chromium", help="the Chromium binary (default: chromium on the PATH)")
    parser.add_argument("--json", help="also write the result here")
    args = parser.parse_args(argv)
    binary = find_chromium(args.chromium)
    if binary is None:
        print("no Chromium found (Debian: apt-get install chromium; or --chromium PATH): nothing measured")
        return 0
    out = Path(args.out or tempfile.mkdtemp(prefix="report_width_"))
    paths = [Path(p) for p in args.runs] if args.runs else write_runs(out / "runs")
    result = run(paths, out / "report", binary, args.width)
    print(f"report.html over {result['runs']} runs ({result['configurations']} configurations), "
          f"{args.width} px window, {Path(binary).name}")
    rows = [("document scrollWidth (px)", result["scrollWidth"]), ("viewport clientWidth (px)", result["clientWidth"]),
            ("window innerWidth (px)", result["innerWidth"]), ("page height (px)", result["scrollHeight"]),
            ("scrolls horizontally", "yes" if result["scrolls"] else "no"),
            ("columns per table", ", ".join(map(str, result["columns"])))]
    rows += [(f"{name}.png (px)", f"{w} x {h}") for name, (w, h) in result["figures"].items()]
    rows += [("screenshot", result["screenshot"])]
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"  {key.ljust(width)}  {value}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
