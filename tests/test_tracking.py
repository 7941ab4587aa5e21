"""The metrics sink and the progress bar: what a run leaves on disk, with and without W&B.

W&B runs offline against a throw-away home directory (config, cache, data dirs and
netrc all under tmp_path), so nothing touches the real one and no network is needed.
The offline run file (``run-*.wandb``) is read back record by record to check that
what the sink logged is what W&B stored.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest

from pipeflow.formats.timeline import Event, Timeline
from pipeflow.tracking import MetricsSink, Progress, flat_scalars, read_metrics, resolve_wandb_mode
from pipeflow.tracking.sink import wandb_credentials

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

PNG = b"\x89PNG\r\n\x1a\n"
NO_WANDB = {"name": "none"}


def wandb_logger(**kw) -> dict:
    cfg = {"name": "wandb", "project": "pipeflow-tests", "mode": "offline", "group": None, "tags": [],
           "run_name": None, "entity": None}
    cfg.update(kw)
    return cfg


def timeline(n_devices: int = 2) -> Timeline:
    events = []
    t = 0.0
    for mb in range(2):
        for d in range(n_devices):
            events.append(Event(d, f"{d}F{mb}", "F", d, mb, 0, 0, t + d * 0.01, t + d * 0.01 + 0.01))
        t += 0.02
    return Timeline(events, n_devices, time_unit="s", source="measured", meta={"schedule": "1f1b", "step": 3})


def wandb_records(path: Path) -> list:
    """The records of a W&B run file: a 7-byte header, then the LevelDB log format
    (32 KiB blocks of records with a 7-byte header: crc32, length, type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        pending += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # FULL or LAST: the record is complete
            record = pb.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def of_type(records: list, kind: str) -> list:
    return [getattr(r, kind) for r in records if r.WhichOneof("record_type") == kind]


def offline_run_file(run_dir: Path) -> Path:
    found = list(run_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(found) == 1, found
    return found[0]


# ------------------------------------------------------------------------- local files


def test_no_logger_writes_metrics_lines_and_summary(tmp_path):
    sink = MetricsSink(str(tmp_path), {"seed": 1}, NO_WANDB)
    sink.log(1, {"loss": 5.5, "lr": 1e-4})
    sink.log(2, {"loss": 5.0, "lr": 2e-4, "val_loss": 5.1})
    sink.finish({"final_loss": 5.0, "steps": 2, "per_stage": [1, 2]})

    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "loss": 5.5, "lr": 1e-4},
        {"step": 2, "loss": 5.0, "lr": 2e-4, "val_loss": 5.1},
    ]
    assert (tmp_path / "summary.json").read_text().startswith('{\n  "final_loss"')  # indent 2
    assert json.loads((tmp_path / "summary.json").read_text()) == {"final_loss": 5.0, "steps": 2, "per_stage": [1, 2]}
    assert not (tmp_path / "wandb").exists()


def test_lines_reach_the_file_before_finish(tmp_path):
    """A run that crashes keeps every step it logged."""
    sink = MetricsSink(str(tmp_path), {}, NO_WANDB)
    sink.log(1, {"loss": 1.0})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 1.0}]
    sink.finish({})


def test_metrics_file_is_appended_to(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    with MetricsSink(str(tmp_path), {}, NO_WANDB) as sink:
        sink.log(2, {"loss": 2.0})
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2]


def test_resume_drops_the_steps_that_run_again(tmp_path):
    rows = [{"step": s, "loss": 10.0 - s} for s in range(1, 7)]
    # the last line was cut short by the crash
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 7, "lo')
    sink = MetricsSink(str(tmp_path), {}, NO_WANDB, resume_step=4)
    sink.log(5, {"loss": 0.5})
    sink.finish({})
    assert read_metrics(tmp_path) == rows[:4] + [{"step": 5, "loss": 0.5}]


def test_scalars_of_other_types_are_written_as_numbers(tmp_path):
    np = pytest.importorskip("numpy")
    sink = MetricsSink(str(tmp_path), {}, NO_WANDB)
    sink.log(1, {"loss": np.float32(2.5), "tokens": np.int64(7)})
    sink.finish({"losses": np.array([1.0, 2.0]), "dir": tmp_path})
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.5, "tokens": 7}]
    assert json.loads((tmp_path / "summary.json").read_text()) == {"losses": [1.0, 2.0], "dir": str(tmp_path)}


def test_log_timeline_writes_the_trace_and_the_picture(tmp_path):
    sink = MetricsSink(str(tmp_path), {}, NO_WANDB)
    tl = timeline()
    sink.log_timeline(tl, step=3)
    sink.finish({})
    back = Timeline.load(tmp_path / "timeline.json")
    assert back.source == "measured" and back.events == tl.events
    assert (tmp_path / "timeline.png").read_bytes()[:8] == PNG


def test_flat_scalars():
    nested = {"loss": 1.5, "ok": True, "name": "1f1b", "val": {"loss": 2.0, "n": 3}, "list": [1, 2], "none": None}
    assert flat_scalars(nested) == {"loss": 1.5, "ok": True, "name": "1f1b", "val/loss": 2.0, "val/n": 3}


# --------------------------------------------------------------------------------- W&B


def test_wandb_offline_run_lands_in_the_run_dir_with_what_was_logged(wandb_home, tmp_path):
    run_dir = tmp_path / "run"
    config = {"schedule": {"name": "gpipe"}, "seed": 7}
    logger = wandb_logger(group="sweep-1", tags=["schedule=gpipe", "trainer.steps=2"], run_name="0_schedule=gpipe")
    sink = MetricsSink(str(run_dir), config, logger)
    assert sink.wandb_mode == "offline"
    sink.log(1, {"loss": 5.25, "lr": 0.001})
    sink.log_timeline(timeline(), step=2)
    sink.log(2, {"loss": 4.5, "lr": 0.002, "val_loss": 4.75})
    sink.finish({"final_loss": 4.5, "val": {"loss": 4.75}, "per_device": [1, 2]})

    assert len(read_metrics(run_dir)) == 2 and (run_dir / "summary.json").exists()
    records = wandb_records(offline_run_file(run_dir))
    run = of_type(records, "run")[0]
    assert (run.project, run.run_group, run.display_name) == ("pipeflow-tests", "sweep-1", "0_schedule=gpipe")
    assert list(run.tags) == ["schedule=gpipe", "trainer.steps=2"]
    config_items = {item.key: json.loads(item.value_json) for c in of_type(records, "config") for item in c.update}
    config_items.update({item.key: json.loads(item.value_json) for item in run.config.update})
    assert config_items["schedule"] == {"name": "gpipe"} and config_items["seed"] == 7

    rows = {}
    for h in of_type(records, "history"):
        row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in h.item}
        rows.setdefault(row["_step"], {}).update(row)
    assert rows[1]["loss"] == 5.25 and rows[1]["lr"] == 0.001
    assert rows[2]["loss"] == 4.5 and rows[2]["val_loss"] == 4.75
    assert rows[2]["timeline/_type"] == "image-file"
    assert rows[2]["timeline/caption"] == "1f1b: 2 devices, step 2, measured"
    assert list(run_dir.glob("wandb/offline-run-*/files/media/images/timeline_*.png"))

    summary = {}
    for s in of_type(records, "summary"):
        summary.update({(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in s.update})
    assert summary["final_loss"] == 4.5 and summary["val/loss"] == 4.75
    assert "per_device" not in summary

    exits = of_type(records, "exit")
    assert exits and exits[-1].exit_code == 0
    assert "WANDB_SERVICE" not in os.environ  # the sink stopped the service it started, after its flush


def test_wandb_disabled_writes_no_wandb_files(wandb_home, tmp_path):
    sink = MetricsSink(str(tmp_path / "run"), {}, wandb_logger(mode="disabled"))
    sink.log(1, {"loss": 1.0})
    sink.finish({"final_loss": 1.0})
    assert sink.wandb_run is None
    assert read_metrics(tmp_path / "run") == [{"step": 1, "loss": 1.0}]
    assert not (tmp_path / "run" / "wandb").exists()


def test_a_failed_run_is_marked_failed_in_wandb(wandb_home, tmp_path):
    run_dir = tmp_path / "run"
    with pytest.raises(RuntimeError):
        with MetricsSink(str(run_dir), {}, wandb_logger()) as sink:
            sink.log(1, {"loss": 1.0})
            raise RuntimeError("rank 1 died")
    assert of_type(wandb_records(offline_run_file(run_dir)), "exit")[-1].exit_code == 1


def test_auto_mode_without_credentials_is_offline(wandb_home):
    assert wandb_credentials()[0] is False
    assert resolve_wandb_mode("auto") == "offline"
    assert "WANDB_SERVICE" not in os.environ  # the check leaves no wandb service for child processes


def test_auto_mode_with_an_api_key_is_online(wandb_home, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", "0123456789" * 4)  # well-formed; never verified, no network
    assert resolve_wandb_mode("auto") == "online"


def test_auto_mode_with_a_netrc_entry_is_online(wandb_home):
    netrc = wandb_home / ".netrc"
    netrc.write_text(f"machine api.wandb.ai\n  login user\n  password {'a' * 40}\n")
    netrc.chmod(0o600)
    assert resolve_wandb_mode("auto") == "online"


def test_auto_mode_falls_back_to_offline_when_the_server_is_out_of_reach(wandb_home, monkeypatch, tmp_path, capsys):
    import wandb

    monkeypatch.setenv("WANDB_API_KEY", "0123456789" * 4)
    real_init, modes = wandb.init, []

    def init(*args, mode, **kwargs):  # what wandb.init raises after init_timeout without network
        modes.append(mode)
        if mode == "online":
            raise wandb.errors.CommError("Timed out while retrying: no such host")
        return real_init(*args, mode=mode, **kwargs)

    monkeypatch.setattr(wandb, "init", init)
    sink = MetricsSink(str(tmp_path / "run"), {}, wandb_logger(mode="auto"))
    sink.log(1, {"loss": 1.0})
    sink.finish({})
    assert modes == ["online", "offline"] and sink.wandb_mode == "offline"
    assert offline_run_file(tmp_path / "run").exists()
    assert "W&B could not start online (Timed out while retrying: no such host)" in capsys.readouterr().err

    modes.clear()  # an explicit online mode is a promise the run cannot keep: it fails
    with pytest.raises(wandb.errors.CommError):
        MetricsSink(str(tmp_path / "run2"), {}, wandb_logger(mode="online"))
    assert modes == ["online"]


@pytest.mark.parametrize("env,mode", [("offline", "offline"), ("disabled", "disabled"), ("dryrun", "offline")])
def test_wandb_mode_env_decides_auto(wandb_home, monkeypatch, env, mode):
    monkeypatch.setenv("WANDB_API_KEY", "0123456789" * 4)
    monkeypatch.setenv("WANDB_MODE", env)
    assert resolve_wandb_mode("auto") == mode


def test_an_explicit_mode_wins_over_the_environment(wandb_home, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "online")
    assert resolve_wandb_mode("offline") == "offline"
    assert resolve_wandb_mode("disabled") == "disabled"


# ---------------------------------------------------------------------------- progress


def test_without_a_terminal_progress_prints_a_plain_line_at_the_first_and_last_step(capsys, tmp_path):
    """Issue 16, item 7: `make run > log` shows the run is alive, without a redrawn bar."""
    bar = Progress(10, enabled=False, every=1e9, log=tmp_path / "train.log")
    for step in range(1, 11):
        bar.update(step, 5.0 - step / 10, 1000.0 * step)
    bar.close()
    bar.close()
    out, err = capsys.readouterr()
    lines = err.splitlines()
    assert out == ""
    assert [line.split()[1] for line in lines] == ["1/10", "10/10"]
    assert "loss 4.0000" in lines[1] and "10,000 tok/s" in lines[1]
    logged = (tmp_path / "train.log").read_text().splitlines()
    assert len(logged) == 2 and logged[0].startswith("[") and logged[1].endswith(lines[1])


def test_without_a_terminal_progress_prints_a_line_when_the_interval_has_passed(capsys):
    bar = Progress(100, enabled=False, every=0.0)  # every update is due
    for step in range(1, 4):
        bar.update(step, 3.0, 100.0)
    assert [line.split()[1] for line in capsys.readouterr().err.splitlines()] == ["1/100", "2/100", "3/100"]


def test_progress_is_off_when_stderr_is_not_a_terminal(capsys):
    assert Progress(10).enabled is False  # pytest captures stderr, which is no TTY


def test_enabled_progress_shows_step_loss_and_throughput(capsys):
    bar = Progress(10, initial=2, enabled=True)
    bar.update(3, 4.25, 12345.0)
    bar.update(4, 3.5, 23456.0)
    bar.close()
    err = capsys.readouterr().err
    assert "4/10" in err
    assert "loss 3.5000" in err and "23,456 tok/s" in err


# ----------------------------------------------------------------- through the real app
# (the session sweep's W&B group is tested in test_compare.py, beside the other tests that
# read that sweep: one worker runs it once)


def test_an_asynchronous_run_reaches_wandb_with_every_step(wandb_home, tmp_path):
    """An asynchronous chunk measures its timeline before its rows are logged; W&B
    drops a row logged at a step below one it has seen, so the timeline must follow
    the chunk's rows, not precede them."""
    import pipeline_runs

    run_dir = tmp_path / "run"
    overrides = [o for o in pipeline_runs.GPT_SMALL if o != "logger=none"]
    pipeline_runs.train(run_dir, [*overrides, "schedule=pipedream", "trainer.steps=4", "trainer.timeline_step=3",
                                  "logger=wandb", "logger.project=pipeflow-tests"])
    rows = {}
    for h in of_type(wandb_records(offline_run_file(run_dir)), "history"):
        row = {(i.key or "/".join(i.nested_key)): json.loads(i.value_json) for i in h.item}
        rows.setdefault(row["_step"], {}).update(row)
    assert sorted(rows) == [1, 2, 3, 4]
    assert all("loss" in rows[s] and "updates" in rows[s] for s in rows)
    assert rows[4]["timeline/_type"] == "image-file"  # logged at the chunk's last step
