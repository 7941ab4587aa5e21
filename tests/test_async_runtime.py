"""Asynchronous schedules on real CPU ranks: weight versions that behave as the policy
says, staleness from the runtime's own records, and AMDP's degenerate window against the
synchronous single-device reference.

What the runtime records (staleness.json) must equal what the schedule implies
(pipeflow.schedules.versions, which the simulator reports): the runtime counts its real
updates, so a version mix-up in the executor shows up as a difference here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import pipeline_runs
from pipeflow.runtime.async_executor import ReplicaVersions, weight_version
from pipeflow.schedules.ir import WeightPolicy
from pipeflow.schedules.versions import weight_versions

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

SMALL = [*pipeline_runs.GPT_SMALL, "trainer.timeline_step=null"]
TIED = pipeline_runs.GPT_TIED


def train(run_dir: Path, *overrides: str) -> dict:
    return pipeline_runs.train(run_dir, [*SMALL, *overrides], tied=TIED)


# ---- the version mechanism, on one module ------------------------------------------------
def _input_grad(policy: WeightPolicy) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 3, bias=False)
    vers = ReplicaVersions([lin.weight], policy)
    x = torch.randn(2, 4, requires_grad=True)
    old = lin.weight.detach().clone()
    with weight_version(vers, 0):
        vers.refs[0] += 1
        y = lin(x)
    vers.before_update()
    with torch.no_grad():
        lin.weight.add_(1.0)  # an in-place update between the forward and the backward
    vers.after_update()
    y.sum().backward()  # must not raise autograd's in-place error
    return x.grad, old, lin.weight.detach()


def test_stash_backward_uses_the_forward_version():
    grad, old, new = _input_grad(WeightPolicy.STASH)
    assert torch.allclose(grad, old.sum(0).expand(2, 4))
    assert not torch.allclose(grad, new.sum(0).expand(2, 4))


@pytest.mark.parametrize("policy", [WeightPolicy.NONE, WeightPolicy.BOUNDED])
def test_unstashed_backward_sees_the_new_weights(policy):
    grad, old, new = _input_grad(policy)
    assert torch.allclose(grad, new.sum(0).expand(2, 4))
    assert not torch.allclose(grad, old.sum(0).expand(2, 4))


def test_stashed_version_is_a_copy_and_is_freed():
    lin = torch.nn.Linear(4, 3)
    vers = ReplicaVersions(list(lin.parameters()), WeightPolicy.STASH)
    vers.refs[0] += 1
    vers.before_update()
    assert vers.stash[0][0].data_ptr() != lin.weight.data_ptr()
    with torch.no_grad():
        lin.weight.add_(1.0)
    vers.after_update()
    assert not torch.equal(vers.stash[0][0], lin.weight)
    vers.release(0)
    assert vers.stash == {} and vers.peak_versions == 2


# ---- real runs ---------------------------------------------------------------------------
def _records(run_dir: Path) -> list[dict]:
    return json.loads((run_dir / "staleness.json").read_text())


def _expected(schedule_name: str, run: dict, steps: int, windows: int, m: int) -> list[dict]:
    """The schedule's own version accounting over the run's chunks."""
    sched = run["schedule"]
    ups = len(set(sched.update_of_microbatch)) // sched.windows
    from pipeflow.schedules.registry import build_schedule

    out = []
    for first in range(1, steps + 1, windows):
        n = min(windows, steps - first + 1)
        chunk = build_schedule(schedule_name, sched.num_stages, m, windows=n,
                               **{k: v for k, v in sched.meta.items() if k in ("stash",)})
        for r in weight_versions(chunk, base_update=(first - 1) * ups):
            d = r.as_dict()
            d["microbatch"] += (first - 1) * m
            out.append(d)
    key = lambda r: (r["microbatch"], r["pipe"], r["stage"])  # noqa: E731
    return sorted(out, key=key)


@pytest.mark.parametrize("name,extra", [
    ("pipedream", ["schedule.stash=true"]),
    ("pipedream", ["schedule.stash=false"]),
    ("pipedream_2bw", []),
])
def test_runtime_versions_match_the_schedule(name, extra, tmp_path):
    run = train(tmp_path, f"schedule={name}", "pipeline.stages=4", "trainer.steps=6", "schedule.windows=4", *extra)
    got = sorted(_records(tmp_path), key=lambda r: (r["microbatch"], r["pipe"], r["stage"]))
    want = _expected(name, run, steps=6, windows=4, m=4)
    assert len(got) == 6 * 4 * 4
    assert got == want
    s = run["summary"]
    if name == "pipedream" and "schedule.stash=true" in extra:
        assert all(r["forward"] == r["backward"] for r in got)
        assert s["max_staleness"] == 3  # stage 0 of 4: p - i - 1
        assert s["peak_weight_versions"] == [4, 3, 2, 1]  # stage i keeps p - i versions
    elif name == "pipedream":
        assert s["max_mismatch"] == 3
    else:
        assert {r["staleness"] for r in got if r["update"] >= 1} == {1}
        assert max(s["peak_weight_versions"]) == 2
    assert all(x == x for x in run["losses"])  # finite


def test_amdp_staleness_from_the_runtime(tmp_path):
    run = train(tmp_path, "schedule=amdp", "pipeline.stages=4", "pipeline.microbatches=8", "trainer.steps=6",
                "schedule.windows=6")
    recs = _records(tmp_path)
    assert len(recs) == 6 * 8 * 4
    assert max(r["mismatch"] for r in recs) <= 1
    mism = [r for r in recs if r["mismatch"]]
    assert all(r["microbatch"] % 8 < 4 and r["update"] >= 1 for r in mism)  # first d minibatches of a window
    want = _expected("amdp", run, steps=6, windows=6, m=8)
    assert sorted(recs, key=lambda r: (r["microbatch"], r["pipe"], r["stage"])) == want
    assert run["summary"]["max_mismatch"] <= 1


@pytest.mark.parametrize("name,extra", [("1f1b", []), ("chimera", ["pipeline.stages=4"])])
def test_sync_schedule_reports_zero_staleness(name, extra, tmp_path):
    """A synchronous run reports its schedule's version accounting: every forward,
    backward and update of an iteration on one version (Chimera's replicas included)."""
    run = train(tmp_path, f"schedule={name}", "pipeline.stages=2", "trainer.steps=2", *extra)
    s = run["summary"]
    assert s["weight_policy"] == "sync"
    assert (s["max_staleness"], s["mean_staleness"], s["max_mismatch"], s["mean_mismatch"]) == (0, 0.0, 0, 0.0)
    assert not (tmp_path / "staleness.json").exists()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("ref"), "pipeline.stages=1", "trainer.steps=1", "runtime.dump_grads=true")


@pytest.mark.parametrize("zero", ["false", "true"])
def test_amdp_degenerate_window_matches_the_synchronous_reference(zero, reference, tmp_path):
    """One pipeline (d = 2), the whole step one window and one chunk: no staleness, so the
    accumulated gradient is the synchronous one."""
    run = train(tmp_path, "schedule=amdp", "pipeline.stages=2", "schedule.windows=1", f"schedule.zero={zero}",
                "trainer.steps=1", "runtime.dump_grads=true")
    assert run["summary"]["max_staleness"] == 0
    pipeline_runs.assert_same_grads(run["grads"], reference["grads"])
    assert run["losses"][0] == pytest.approx(reference["losses"][0], rel=1e-5)


def test_amdp_zero_sharding_changes_memory_not_the_math(tmp_path):
    """Owner-based sharding: the owner steps with the reduced gradient and broadcasts;
    the losses are those of every replica stepping itself."""
    common = ("schedule=amdp", "pipeline.stages=4", "trainer.steps=4", "schedule.windows=4")
    plain = train(tmp_path / "plain", *common, "schedule.zero=false")
    zero = train(tmp_path / "zero", *common, "schedule.zero=true")
    assert zero["losses"] == pytest.approx(plain["losses"], rel=1e-5)
    assert plain["losses"][-1] < plain["losses"][0]


@pytest.mark.parametrize("name,extra", [("pipedream_2bw", []), ("amdp", ["schedule.zero=true"])])
def test_asynchronous_resume_continues_exactly(name, extra, tmp_path):
    """Issue 16, item 6. Chunks of schedule.windows=8 steps lie on a fixed grid, so
    checkpoints (save_every=2) change no loss; a 3-step run ends inside a chunk, and
    resumed to 6 steps it restarts that chunk and replays steps 1-3 unlogged: its steps
    4-6 are the uninterrupted run's, weight versions included (2BW computes on the
    previous version)."""
    common = (f"schedule={name}", "pipeline.stages=4", *extra)
    full = train(tmp_path / "full", *common, "trainer.steps=6", "trainer.save_every=2")
    short = train(tmp_path / "short", *common, "trainer.steps=3")
    assert short["losses"] == pytest.approx(full["losses"][:3], rel=1e-6)  # checkpoints at 2 changed nothing
    resumed = train(tmp_path / "resumed", *common, "trainer.steps=6", f"resume={tmp_path / 'short'}")
    assert resumed["losses"] == pytest.approx(full["losses"][3:], rel=1e-6)
    assert resumed["summary"]["resumed_from"] == 3
    late = [r for r in _records(tmp_path / "full") if r["microbatch"] >= 3 * 4]
    assert sorted(_records(tmp_path / "resumed"), key=str) == sorted(late, key=str)
