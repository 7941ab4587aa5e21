"""Every file pipeflow writes is whole or not there (issue 76): a write that fails (a full
disk, simulated by a write that raises ENOSPC part way) leaves the file as it was, no
temporary file beside it, and one sentence naming the file; a line log is cut back to its
last whole line; a folder built aside replaces its target only whole."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeflow.faults import Fault, WriteFailed, said
from pipeflow.formats.files import Lines, check_file, check_folder, folder_aside, write_aside


def _full_after(monkeypatch, allowed: int) -> None:
    """os.write takes ``allowed`` bytes more, then the disk is full (ENOSPC)."""
    real = os.write
    left = [allowed]

    def write(fd, data):
        if left[0] <= 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        n = real(fd, bytes(data[:left[0]]))
        left[0] -= n
        return n

    monkeypatch.setattr(os, "write", write)


def test_a_write_that_fails_part_way_leaves_the_file_as_it_was(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text('{"old": 1}\n')

    def half(f):
        f.write(b'{"new": ')
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with pytest.raises(WriteFailed) as err:
        write_aside(path, half)
    assert str(err.value) == f"could not write {path}: No space left on device"
    assert isinstance(err.value, OSError) and err.value.errno == errno.ENOSPC
    assert path.read_text() == '{"old": 1}\n'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["summary.json"]  # nothing left aside
    write_aside(path, '{"new": 2}\n')
    assert json.loads(path.read_text()) == {"new": 2}
    with pytest.raises(WriteFailed, match="is a directory|Is a directory"):
        write_aside(tmp_path, "x")


def test_a_line_log_keeps_only_whole_lines_on_a_full_disk(tmp_path, monkeypatch):
    log = Lines(tmp_path / "metrics.jsonl")
    log.append('{"step": 1}')
    _full_after(monkeypatch, 5)  # the next line gets 5 of its bytes on disk, then ENOSPC
    with pytest.raises(WriteFailed, match=r"metrics\.jsonl: No space left on device$"):
        log.append('{"step": 2, "loss": 1.5}')
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'  # cut back, not cut short
    log.append('{"step": 2}')
    log.close()
    assert (tmp_path / "metrics.jsonl").read_text().splitlines() == ['{"step": 1}', '{"step": 2}']


def test_a_folder_built_aside_replaces_its_target_only_whole(tmp_path):
    out = tmp_path / "hf"
    out.mkdir()
    (out / "config.json").write_text("old")
    with pytest.raises(WriteFailed, match=f"could not write {out}: No space left on device"):
        with folder_aside(out) as aside:
            (aside / "config.json").write_text("new")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert [p.name for p in tmp_path.iterdir()] == ["hf"] and (out / "config.json").read_text() == "old"
    with folder_aside(out) as aside:
        (aside / "config.json").write_text("new")
    assert (out / "config.json").read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["hf"]


def test_folders_and_files_that_cannot_be_written_are_named_before_any_work(tmp_path):
    (tmp_path / "file").write_text("")
    assert check_folder(tmp_path / "file" / "out") == f"{tmp_path / 'file'} is a file, not a folder"
    assert check_file(tmp_path) == f"{tmp_path} is a folder, not a file"
    assert check_folder("/proc/pipeflow-x").startswith("cannot write there (")
    assert check_folder(tmp_path / "new" / "deeper") is None and not (tmp_path / "new").exists()  # made, then removed
    assert check_file(tmp_path / "p.json") is None


def test_a_fault_is_its_sentence_and_a_bug_keeps_its_class():
    assert said(WriteFailed("/x/metrics.jsonl", OSError(errno.ENOSPC, "No space left on device"))) == \
        "could not write /x/metrics.jsonl: No space left on device"
    assert said(KeyError("ranks")) == "KeyError: 'ranks'"
    from pipeflow.config import ConfigError
    from pipeflow.runtime.checkpoint import CheckpointError

    assert issubclass(ConfigError, Fault) and issubclass(CheckpointError, Fault)


def test_the_metrics_sink_says_which_file_and_keeps_whole_lines(tmp_path, monkeypatch):
    from pipeflow.tracking.sink import MetricsSink, read_metrics

    sink = MetricsSink(str(tmp_path), {}, {"name": "none"})
    sink.log(1, {"loss": 2.5})
    _full_after(monkeypatch, 3)
    with pytest.raises(WriteFailed) as err:
        sink.log(2, {"loss": 2.25})
    monkeypatch.undo()
    assert str(err.value) == f"could not write {tmp_path / 'metrics.jsonl'}: No space left on device"
    sink.close(exit_code=1)
    assert read_metrics(tmp_path) == [{"step": 1, "loss": 2.5}]
    assert (tmp_path / "metrics.jsonl").read_text().endswith("\n")


@pytest.mark.slow
def test_an_app_that_cannot_write_its_config_says_so_in_one_line_and_leaves_no_folder(tmp_path):
    """Hydra's own writing of .hydra/ ended in its traceback and a folder left behind; the
    apps write it themselves (here .hydra cannot be made: a file stands in its place)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / ".hydra").write_text("")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("HYDRA_", "WANDB_"))}
    proc = subprocess.run([sys.executable, "-m", "pipeflow.simulate", f"hydra.run.dir={run}"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert proc.stderr.strip() == f"could not write {run / '.hydra'}: File exists", proc.stderr
    ok = tmp_path / "ok"
    proc = subprocess.run([sys.executable, "-m", "pipeflow.simulate", f"hydra.run.dir={ok}", "draw=false"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in (ok / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    from omegaconf import OmegaConf

    assert OmegaConf.load(ok / ".hydra" / "overrides.yaml") == ["draw=false"]
    assert OmegaConf.load(ok / ".hydra" / "config.yaml").pipeline.stages == 4
