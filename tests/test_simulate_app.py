"""The pipeflow-simulate app: config groups compose, the run writes its files, and bad
configs stop before any work with one sentence that names the key.

Most tests compose the config in-process and call ``run_simulation`` (no Hydra global
state); a few run the real console script, as a user would, from a directory that is
not the repository.
"""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from pipeflow.config import CONF_DIR, SCHEMAS, ConfigError, compose, prepare_simulation, prepare_training
from pipeflow.schedules.export import to_torch_csv
from pipeflow.schedules.ir import parse_orders
from pipeflow.schedules.registry import build_schedule
from pipeflow.schedules.validate import ScheduleError
from pipeflow.sim import engine as sim_engine
from pipeflow.sim import gantt
from pipeflow.formats import trace as trace_module
from pipeflow.formats.timeline import Event, Timeline
from pipeflow.simulate import format_report, run_simulation

REPO = CONF_DIR.parent
# Textbook costs (F = 1, B = 2, messages of 0 bytes) on links without latency, and no
# picture: fast, and the closed forms hold exactly.
UNIT = ["cost=unit", "draw=false"]


def simulate(tmp_path: Path, *overrides: str) -> dict:
    return run_simulation(compose("simulate", overrides), tmp_path)


def options(group: str) -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / group).glob("*.yaml"))


# --------------------------------------------------------------------------- in process


@pytest.mark.parametrize("p,m", [(2, 4), (4, 8), (4, 3), (3, 1)])
@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
def test_unit_cost_bubble_matches_closed_form(tmp_path, schedule, p, m):
    s = simulate(tmp_path, f"schedule={schedule}", f"pipeline.stages={p}", f"pipeline.microbatches={m}", *UNIT)
    assert s["schedule"] == schedule and s["stages"] == p and s["microbatches"] == m
    assert s["bubble_ratio"] == pytest.approx((p - 1) / (m + p - 1))
    # F = 1, B = 2 per stage, no message time: (m + p - 1) slots of F + B
    assert s["makespan"] == pytest.approx(3 * (m + p - 1))
    assert s["placement"] == [list(range(p))]
    assert [d["device"] for d in s["per_device"]] == list(range(p))
    for d in s["per_device"]:
        assert d["busy"] == pytest.approx(3 * m)
        assert d["idle"] == pytest.approx(s["makespan"] - 3 * m)


def test_summary_and_timeline_files(tmp_path):
    s = simulate(
        tmp_path, "schedule=1f1b", "pipeline.stages=4", "pipeline.microbatches=6", "cost=unit"
    )
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk == json.loads(json.dumps(s))
    for key in ("schedule", "stages", "microbatches", "virtual_stages", "segments", "makespan", "bubble_ratio",
                "placement", "per_device", "topology", "cost", "model"):
        assert key in on_disk, key
    for d in on_disk["per_device"]:
        for key in ("device", "busy", "idle", "peak_activation_bytes", "peak_live_microbatches"):
            assert key in d, key
    # 1F1B keeps at most p - r microbatches alive on stage r
    assert [d["peak_live_microbatches"] for d in on_disk["per_device"]] == [4, 3, 2, 1]
    assert on_disk["topology"]["name"] == "local_cpu" and on_disk["cost"]["name"] == "unit"

    trace = json.loads((tmp_path / "timeline.json").read_text())
    timeline = Timeline.from_chrome_trace(trace)
    computed = [e for e in timeline.select(stream="compute") if e.kind in "FB"]
    assert len(computed) == 2 * 6 * 4  # one F and one B per microbatch and stage
    assert max(e.end for e in timeline) == pytest.approx(s["makespan"])

    png = tmp_path / "timeline.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "schedule.csv").exists()


def test_draw_false_skips_the_picture(tmp_path):
    simulate(tmp_path, *UNIT)
    assert (tmp_path / "summary.json").exists() and not (tmp_path / "timeline.png").exists()


def test_export_torch_csv(tmp_path):
    s = simulate(tmp_path, "schedule=zb_h1", "pipeline.stages=4", "pipeline.microbatches=8", "export=torch_csv", *UNIT)
    assert "schedule.csv" in s["files"]
    text = (tmp_path / "schedule.csv").read_text()
    expected = build_schedule("zb_h1", 4, 8)
    assert text == to_torch_csv(expected)
    assert parse_orders(csv.reader(text.splitlines())) == expected.compute_orders()


@pytest.mark.parametrize(
    "overrides,placement",
    [
        (["schedule=gpipe"], [[0, 1, 2, 3]]),
        (["schedule=1f1b"], [[0, 1, 2, 3]]),
        (["schedule=zb_h1"], [[0, 1, 2, 3]]),
        (["schedule=interleaved_1f1b", "pipeline.virtual_stages=2", "model=gpt_small"], [[0, 1, 2, 3, 0, 1, 2, 3]]),
        (["schedule=chimera"], [[0, 1, 2, 3], [3, 2, 1, 0]]),
    ],
    ids=lambda v: v[0] if isinstance(v[0], str) else None,
)
def test_every_schedule_config_runs(tmp_path, overrides, placement):
    s = simulate(tmp_path, *overrides, "pipeline.stages=4", "pipeline.microbatches=8", *UNIT)
    assert s["schedule"] == overrides[0].split("=")[1]
    assert s["placement"] == placement
    assert 0 <= s["bubble_ratio"] < 1 and s["makespan"] > 0


def test_every_schedule_has_a_config_file():
    from pipeflow.schedules.registry import schedule_names

    import pipeflow.config  # noqa: F401 - registers schedule=planned, which runs a plan, not a generator

    assert set(options("schedule")) == set(schedule_names())


@pytest.mark.parametrize("topology", options("topology"))
def test_every_topology_config_runs_with_analytic_cost(tmp_path, topology):
    s = simulate(tmp_path, f"topology={topology}", "model=gpt_small", "cost=analytic", "draw=false")
    assert s["topology"]["name"] == topology
    assert s["topology"]["num_devices"] == 4  # cut to what the schedule uses
    assert s["makespan"] > 0 and len(s["per_device"]) == 4


@pytest.mark.parametrize("model", options("model"))
def test_every_model_config_composes(model):
    cfg = compose("simulate", [f"model={model}"])
    if model == "hf_causal":  # the family's entry point: any decoder, from the config.json it is given
        with pytest.raises(ConfigError, match=r"^model\.config: model\.family=hf_causal needs a config\.json"):
            prepare_simulation(cfg)
        return
    # a family name (gpt, bert, cbm) selects that family's tiny preset
    assert cfg.model.name == (f"{model}_tiny" if model in ("gpt", "bert", "cbm") else model)
    prepare_simulation(cfg)  # an hf_causal preset's shape keys come from its HF config here
    if cfg.model.family != "cbm":
        assert cfg.model.n_embd % cfg.model.n_head == 0


def test_model_sizes_from_the_papers():
    m = compose("simulate", ["model=gpt_1.5b"]).model
    assert (m.n_layer, m.n_head, m.n_embd, m.seq_len) == (48, 25, 1600, 1024)
    m = compose("simulate", ["model=gpt_7b"]).model
    assert (m.n_layer, m.n_embd, m.n_inner, m.vocab_size) == (32, 4096, 16384, 50304)
    m = compose("simulate", ["model=bert_1b"]).model
    assert (m.family, m.n_layer, m.n_head, m.n_embd) == ("bert", 32, 32, 1600)


@pytest.mark.parametrize("group", ["topology", "cost"])
def test_yaml_values_match_the_code_defaults(group):
    """The YAML files spell the defaults out for users; the schemas take them from the
    presets' and cost models' own signatures. They must agree."""
    for option in options(group):
        schema = SCHEMAS[f"schema/{group}/{option}"]
        defaults = {f.name: f.default for f in dataclasses.fields(schema)}
        composed = OmegaConf.to_container(compose("simulate", [f"{group}={option}"])[group])
        assert composed == pytest.approx(defaults), option


# ------------------------------------------------------------------- outputs at scale
BIG = ["pipeline.stages=4", "pipeline.microbatches=400", "cost=unit"]  # 801 boxes on a row of ~1230 pixels


def _simulated_timeline(*overrides: str) -> Timeline:
    inputs = prepare_simulation(compose("simulate", overrides))
    return sim_engine.simulate(inputs.schedule, inputs.cost, inputs.topology, record=True).timeline


def test_timeline_file_loads_back_equal_to_the_simulation(tmp_path):
    over = ["schedule=zb_h1", "pipeline.stages=4", "pipeline.microbatches=6", "cost=unit", "draw=false"]
    s = simulate(tmp_path, *over)
    assert s["files"] == ["summary.json", "timeline.json"]
    expected = _simulated_timeline(*over)
    back = Timeline.load(tmp_path / "timeline.json")
    assert back.events == expected.events and back.meta == expected.meta and back.time_unit == "units"


def test_timeline_over_the_threshold_is_gzipped(tmp_path, monkeypatch):
    over = ["pipeline.stages=4", "pipeline.microbatches=16", "cost=unit", "draw=false"]
    monkeypatch.setattr(trace_module, "COMPRESS_ABOVE", 10_000)  # this run's trace is ~40 kB
    s = simulate(tmp_path, *over)
    assert s["files"] == ["summary.json", "timeline.json.gz"]
    assert json.loads((tmp_path / "summary.json").read_text())["files"] == s["files"]
    assert not (tmp_path / "timeline.json").exists()
    assert (tmp_path / "timeline.json.gz").read_bytes()[:2] == b"\x1f\x8b"
    back = Timeline.load(tmp_path / "timeline.json")  # the plain name finds the gzipped file
    expected = _simulated_timeline(*over)
    assert back.events == expected.events and back.meta == expected.meta


def test_unreadable_picture_is_skipped_and_drawn_when_forced(tmp_path):
    notes: list[str] = []
    forced = run_simulation(compose("simulate", [*BIG, "draw=true"]), tmp_path, notes)
    assert "timeline.png" in forced["files"] and (tmp_path / "timeline.png").exists() and notes == []

    s = run_simulation(compose("simulate", BIG), tmp_path, notes)  # draw=auto, the default
    assert "timeline.png" not in s["files"]
    assert not (tmp_path / "timeline.png").exists(), "the forced run's picture is not this run's"
    (note,) = notes
    assert note.startswith("timeline.png not drawn: 801 boxes on device") and "draw=true" in note
    assert gantt.unreadable(_simulated_timeline(*BIG)) in note

    small: list[str] = []
    s = run_simulation(compose("simulate", ["cost=unit"]), tmp_path / "small", small)
    assert "timeline.png" in s["files"] and small == []  # the default run's picture can be read


def test_unreadable_counts_rows_too():
    events = [Event(d, f"{d}F0", "F", 0, 0, 0, 0, 0.0, 1.0) for d in range(2000)]
    assert "device rows" in gantt.unreadable(Timeline(events, 2000))
    assert gantt.unreadable(Timeline(events[:8], 8)) is None


def test_schedule_is_checked_once_and_bad_ones_still_named(tmp_path, monkeypatch):
    import pipeflow.simulate as app

    real = app.prepare_simulation
    # the validator's dry run is not repeated on a schedule the simulator ran to the end
    monkeypatch.setattr(app, "validate", lambda schedule: pytest.fail("validated twice"))
    simulate(tmp_path / "ok", "cost=unit", "draw=false")
    monkeypatch.undo()

    def broken(change):
        def prepare(cfg):
            inputs = real(cfg)
            change(inputs.schedule.orders)
            return inputs
        return prepare

    def swap_first_two(orders):  # the last device runs a backward before its forward
        orders[-1][0], orders[-1][1] = orders[-1][1], orders[-1][0]

    # the validator's sentence, as a config error naming where the schedule came from
    monkeypatch.setattr(app, "prepare_simulation", broken(swap_first_two))
    with pytest.raises(ConfigError, match=r"^schedule=1f1b: deadlocks after 9 of 68 actions: device 0 at 0B0"):
        simulate(tmp_path / "deadlock", "cost=unit")
    monkeypatch.setattr(app, "prepare_simulation", broken(lambda orders: orders[0].pop()))
    with pytest.raises(ConfigError, match=r"^schedule=1f1b: missing optimizer steps: 0S@0"):
        simulate(tmp_path / "missing", "cost=unit")
    assert not (tmp_path / "deadlock").exists() and not (tmp_path / "missing").exists()



def test_the_fast_completeness_verdict_agrees_with_the_walk_by_action():
    """check_complete confirms a good schedule by set arithmetic and walks a bad one
    action by action: every schedule here passes both ways, and each damage the walk
    names is also refused by the fast verdict (so it reaches the walk)."""
    from pipeflow.schedules.ir import Action, Kind
    from pipeflow.schedules.validate import _check_complete_by_action, _complete

    good = [build_schedule(n, 4, 8) for n in ("gpipe", "1f1b", "zb_h1", "chimera", "amdp")]
    good += [build_schedule("interleaved_1f1b", 2, 4, 2), build_schedule("seq1f1b", 2, 4, 1, 3),
             build_schedule("1f1b", 2, 4, data_parallel=2)]
    for sched in good:
        assert _complete(sched), sched.name
        _check_complete_by_action(sched)  # does not raise

    def damaged(change):
        sched = build_schedule("1f1b", 2, 4)
        orders = [list(o) for o in sched.orders]
        change(orders)
        return dataclasses.replace(sched, orders=orders)

    damages = [
        lambda o: o[0].pop(0),  # an F missing
        lambda o: o[0].append(o[0][0]),  # an F twice
        lambda o: o[1].append(o[0][0]),  # on the wrong device
        lambda o: o[0].append(Action(Kind.F, 0, 9, 0, 0)),  # a microbatch out of range
        lambda o: o[1].append(Action(Kind.I, 1, 0, 0, 0)),  # B and I for one microbatch
        lambda o: o[0].remove(next(a for a in o[0] if a.kind == Kind.STEP)),  # a step missing
    ]
    for change in damages:
        bad = damaged(change)
        assert not _complete(bad)
        with pytest.raises(ScheduleError):
            _check_complete_by_action(bad)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (["schedule=chimera", "pipeline.stages=3"], "pipeline.stages=3"),
        (["schedule.name=foo"], "schedule.name=foo"),
        (["schedule=1f1b", "pipeline.virtual_stages=2"], "pipeline.virtual_stages=2"),
        (["pipeline.stages=8"], "pipeline.stages=8"),  # gpt_tiny has 4 layers
        (["schedule=interleaved_1f1b", "pipeline.virtual_stages=2"], "pipeline.stages=4"),  # 8 stages > 4 layers
        (["pipeline.microbatch_size=0"], "pipeline.microbatch_size=0"),
        (["topology=dgx_a100_8", "model=gpt_medium", "pipeline.stages=16"], "pipeline.stages=16"),
        (["topology=cluster", "topology.nodes=0"], "topology.nodes=0"),
        (["cost.name=foo"], "cost.name=foo"),
        (["cost=unit", "cost.weight=5"], "cost.weight=5"),
        (["schedule=chimera", "export=torch_csv"], "export=torch_csv"),
        (["export=csv"], "export=csv"),
        (["draw=sometimes"], "draw=sometimes"),
    ],
)
def test_bad_configs_fail_first_with_one_sentence(tmp_path, overrides, key):
    with pytest.raises(ConfigError) as info:
        simulate(tmp_path, *overrides)
    msg = str(info.value)
    assert key in msg
    assert "\n" not in msg
    assert not any(tmp_path.iterdir()), "nothing may be written for a bad config"


def test_allowed_values_are_listed():
    with pytest.raises(ConfigError, match=r"allowed values: gpipe, 1f1b, interleaved_1f1b, zb_h1, chimera"):
        prepare_simulation(compose("simulate", ["schedule.name=foo"]))


@pytest.mark.parametrize("override", ["pipeline.stage=4", "cost.forwards=2", "topology.node=3", "draws=false"])
def test_misspelt_keys_fail_at_composition(override):
    with pytest.raises(ConfigCompositionException):
        compose("simulate", [override])


def test_report_table():
    s = {
        "schedule": "1f1b", "stages": 2, "microbatches": 4, "virtual_stages": 1, "segments": 1,
        "model": {"name": "gpt_tiny"}, "topology": {"name": "local_cpu"}, "cost": {"name": "unit"},
        "makespan": 15.0, "bubble_ratio": 0.2,
        "per_device": [
            {"device": d, "busy": 12.0, "idle": 3.0, "peak_activation_bytes": 2.0 - d, "peak_live_microbatches": 2 - d}
            for d in range(2)
        ],
    }
    lines = format_report(s).splitlines()
    assert "bubble ratio  0.2000" in lines
    header = next(i for i, line in enumerate(lines) if line.split()[:1] == ["device"])
    assert len(lines) == header + 3
    assert lines[header + 2].split() == ["1", "12", "3", "1", "1"]


# ------------------------------------------------------------------------ as a user would


def _cli() -> list[str]:
    script = Path(sys.executable).with_name("pipeflow-simulate")
    return [str(script)] if script.exists() else [sys.executable, "-m", "pipeflow.simulate"]


def _run(args: list[str], cwd: Path, cli: list[str] | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("HYDRA_")}
    return subprocess.run(
        (cli or _cli()) + args, cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.slow  # a subprocess or a large search
def test_console_script_from_another_directory(tmp_path):
    run_dir = tmp_path / "run"
    proc = _run(["cost=unit", "export=torch_csv", f"hydra.run.dir={run_dir}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "bubble ratio" in proc.stdout and "peak live mb" in proc.stdout
    summary = json.loads((run_dir / "summary.json").read_text())
    p, m = summary["stages"], summary["microbatches"]
    assert (p, m) == (4, 8)  # the embedded defaults
    assert summary["bubble_ratio"] == pytest.approx((p - 1) / (m + p - 1))
    for name in ("timeline.json", "timeline.png", "schedule.csv"):
        assert (run_dir / name).exists(), name


@pytest.mark.slow  # a subprocess or a large search
def test_module_entry_point_reports_a_bad_config_in_one_line(tmp_path):
    proc = _run(["schedule=chimera", "pipeline.stages=3", f"hydra.run.dir={tmp_path / 'run'}"], cwd=tmp_path,
                cli=[sys.executable, "-m", "pipeflow.simulate"])
    assert proc.returncode != 0
    err = proc.stderr.strip()
    assert "pipeline.stages=3" in err and "chimera" in err
    assert len(err.splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "run" / "summary.json").exists()


@pytest.mark.slow  # a subprocess or a large search
def test_multirun_writes_one_summary_per_job(tmp_path):
    sweep = tmp_path / "multi"
    proc = _run(["-m", "schedule=gpipe,1f1b", *UNIT, f"hydra.sweep.dir={sweep}"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    summaries = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/summary.json"))]
    assert sorted(s["schedule"] for s in summaries) == ["1f1b", "gpipe"]


@pytest.mark.slow  # a subprocess or a large search
def test_sweep_config_file(tmp_path):
    sweep = tmp_path / "multi"
    proc = _run(
        # logger=none: the sweep's own W&B logging is covered in test_sweeps; here it would
        # upload runs for a developer who is logged in
        ["-m", "--config-dir", str(REPO / "sweeps"), "--config-name", "simulate_schedules", *UNIT,
         "logger=none", f"hydra.sweep.dir={sweep}"],
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stderr
    runs = {(s["schedule"], s["microbatches"]) for s in
            (json.loads(p.read_text()) for p in sweep.glob("*/summary.json"))}
    assert runs == {(name, m) for name in ("gpipe", "1f1b", "zb_h1", "zb_h2", "chimera") for m in (4, 8, 16)}


def test_recomputation_makes_a_long_sequence_fit(tmp_path):
    """Issue 18: gpt_7b at 32k tokens on 8 A100s with eager attention. Seq1F1B in 8
    segments is out of memory without recomputation (the saved score terms) and fits with
    selective or full recomputation; whole sequences do not fit even with full
    recomputation, because a backward rebuilds one layer's 32k x 32k scores on top of what
    the forwards saved. The summary says so per device, and the console names the fullest
    device and what to try next."""
    base = ["model=gpt_7b", "model.seq_len=32768", "model.n_positions=32768", "pipeline.stages=8",
            "pipeline.microbatches=16", "topology=dgx_a100_8", "draw=false", "model.attention=eager"]
    seq = [*base, "schedule=seq1f1b", "pipeline.segments=8"]
    runs = {r: simulate(tmp_path / r, *seq, f"model.recompute={r}") for r in ("none", "selective", "full")}
    assert runs["none"]["fits"] is False and runs["none"]["out_of_memory_devices"] == list(range(8))
    for r in ("selective", "full"):
        assert runs[r]["fits"] is True and runs[r]["out_of_memory_devices"] == [], r
        for d in runs[r]["per_device"]:
            assert d["model_state_bytes"] > 0
            # the peak of the sum over time: at least the whole-run state beside the most
            # activations, at most every category's own peak together
            at, own = d["memory_at_peak"], d["memory_category_peaks"]
            assert d["peak_memory_bytes"] == pytest.approx(sum(at.values()))
            assert d["peak_memory_bytes"] >= at["parameters"] + at["optimizer_state"] + d["peak_activation_bytes"]
            assert d["peak_memory_bytes"] <= sum(own.values()) + 1
            assert d["peak_memory_bytes"] <= d["memory_bytes"]
    assert runs["full"]["makespan"] > runs["selective"]["makespan"] > runs["none"]["makespan"]  # the reruns
    assert "OUT OF MEMORY on 8 of 8 devices" in format_report(runs["none"])
    assert "; most of it activations " in format_report(runs["none"])  # the fullest device's largest category
    assert "model.attention=sdpa keeps no score" in format_report(runs["none"])
    assert "memory        fits: at most" in format_report(runs["full"])
    assert runs["full"]["data_parallel"] == 1
    whole = simulate(tmp_path / "whole", *base, "model.recompute=full")
    assert whole["fits"] is False and "schedule=seq1f1b pipeline.segments=N" in format_report(whole)
    assert simulate(tmp_path / "unit", "cost=unit", "draw=false")["fits"] is None  # unit costs have no bytes


def test_fused_attention_trains_long_sequences_without_recomputation(tmp_path):
    """Issue 30: with the fused kernel (the default) no score is kept or rebuilt. gpt_7b at
    32k on 8 A100s: 1F1B on whole sequences still runs out of memory without
    recomputation and fits with full recomputation; Seq1F1B in 8 segments fits without
    any, and is the faster of the two (no forward runs twice)."""
    base = ["model=gpt_7b", "model.seq_len=32768", "model.n_positions=32768", "pipeline.stages=8",
            "pipeline.microbatches=16", "topology=dgx_a100_8", "draw=false"]
    plain = simulate(tmp_path / "plain", *base)
    assert plain["model"]["attention"] == "sdpa" and plain["fits"] is False
    full = simulate(tmp_path / "full", *base, "model.recompute=full")
    seq = simulate(tmp_path / "seq", *base, "schedule=seq1f1b", "pipeline.segments=8")
    assert full["fits"] is True and seq["fits"] is True
    assert seq["makespan"] < full["makespan"]
    eager = simulate(tmp_path / "eager", *base, "schedule=seq1f1b", "pipeline.segments=8", "model.attention=eager")
    assert eager["fits"] is False
    assert eager["peak_activation_bytes"] > 3 * seq["peak_activation_bytes"]  # the scores


def test_the_simulated_costs_follow_the_precision(tmp_path):
    """Issue 18: precision=fp32 prices 4-byte elements (twice the message and activation
    bytes of bf16) at the devices' fp32 rate (an A100's TF32 tensor cores: half its bf16
    peak); bf16 and fp16 price 2-byte elements at the 16-bit peak."""
    base = ["model=gpt_1.5b", "topology=dgx_a100_8", "pipeline.stages=4", "draw=false"]
    bf16, fp16, fp32 = (simulate(tmp_path / p, *base, f"precision={p}") for p in ("bf16", "fp16", "fp32"))
    assert (bf16["cost"]["dtype_bytes"], fp32["cost"]["dtype_bytes"]) == (2, 4)
    assert fp32["p2p_bytes"] == 2 * bf16["p2p_bytes"] and fp16["makespan"] == bf16["makespan"]
    assert fp32["peak_activation_bytes"] > bf16["peak_activation_bytes"]
    assert fp32["makespan"] > 1.9 * bf16["makespan"]  # half the FLOP/s, and twice the bytes to send
    # an explicit cost.dtype_bytes stands
    assert simulate(tmp_path / "explicit", *base, "precision=fp32", "cost.dtype_bytes=2")["cost"]["dtype_bytes"] == 2
    with pytest.raises(ConfigError, match=r"^precision=fp8: unknown precision; allowed values: auto, fp32, bf16, fp16"):
        simulate(tmp_path / "bad", *base, "precision=fp8")
    # one key and one default for every app: auto is what the topology's devices train in
    auto = simulate(tmp_path / "auto", *base)
    assert (auto["precision"], auto["run_key"]["precision"], auto["makespan"]) == ("bf16", "bf16", bf16["makespan"])
    cpu = simulate(tmp_path / "cpu", "draw=false")  # local_cpu, as pipeflow-train's ranks run: fp32
    assert (cpu["precision"], cpu["cost"]["dtype_bytes"]) == ("fp32", 4)
    train = compose("train", ["logger=none"])
    assert prepare_training(train).config.precision == "fp32"


def test_a_gpu_keeps_its_math_libraries_workspaces_through_the_step(tmp_path):
    """The device preset's workspace bytes (cuBLAS's per product thread: 32 MiB each on
    Hopper, measured on an H100; torch's smaller default below it) sit in every device's
    temporaries at its peak, whatever else the step holds; CPU ranks keep none."""
    from pipeflow.topology.presets import DEVICES

    base = ["model=gpt_tiny", "schedule=1f1b", "pipeline.stages=2", "draw=false", "topology=cluster",
            "topology.nodes=1"]
    runs = {dev: simulate(tmp_path / dev, *base, f"topology.device={dev}") for dev in ("h100-80g", "a100-80g")}
    hopper, ampere = DEVICES["h100-80g"].workspace_bytes, DEVICES["a100-80g"].workspace_bytes
    assert hopper == 65 * 2**20 and ampere == (2 * (8 * 2**20 + 2**17) + 2**20) and DEVICES["cpu"].workspace_bytes == 0
    for h, a in zip(runs["h100-80g"]["per_device"], runs["a100-80g"]["per_device"]):
        assert h["peak_memory_bytes"] - a["peak_memory_bytes"] == hopper - ampere
        assert h["memory_at_peak"]["temporaries"] - a["memory_at_peak"]["temporaries"] == hopper - ampere
        assert a["memory_at_peak"]["temporaries"] >= ampere


@pytest.mark.parametrize("model,topology,precision,repeat", [
    ("llama_tiny", "h100-80g", "fp32", True),  # grouped-query, fused, fp32, on a GPU: K/V repeated
    ("llama_tiny", "h100-80g", "bf16", False),  # the 16-bit kernel takes the groups itself
    ("llama_tiny", "cpu", "fp32", False),  # so does the CPU kernel
    ("gpt_tiny", "h100-80g", "fp32", False),  # as many key/value heads as query heads
])
def test_fp32_grouped_query_attention_on_a_gpu_keeps_its_keys_repeated(model, topology, precision, repeat):
    """torch's fp32 CUDA attention kernel takes no key/value groups: the runtime hands it
    K and V repeated to every query head (measured on an H100: llama_tiny at 2k tokens,
    441 MiB a rank, where the math fallback held 2157), and the model keeps those copies."""
    from pipeflow.config import prepare_simulation as prepare
    from pipeflow.planning.operators import Shape
    from pipeflow.planning.saved_tensors import block_saved

    cfg = compose("simulate", [f"model={model}", "schedule=1f1b", "pipeline.stages=2", "topology=cluster",
                               "topology.nodes=1", f"topology.device={topology}", f"precision={precision}"])
    spec = prepare(cfg).spec
    assert spec.kv_repeat is repeat
    c = 4 if precision == "fp32" else 2
    plain = dataclasses.replace(spec, kv_repeat=False)
    # one sequence, one token attending over one key: the attention keeps K and V a key
    extra = block_saved(Shape(spec, 1, 1, 1, c))[0] - block_saved(Shape(plain, 1, 1, 1, c))[0]
    assert extra == (2 * (spec.n_head - spec.kv_heads) * spec.head_dim * c if repeat else 0)
