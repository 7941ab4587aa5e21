"""A run is resolved once (pipeflow.config.resolved): one preparation asks for the
schedule's spec, the model's shape, the topology and the tensor degree once each, and
validates (dry-runs) each schedule of the run plan once; a rank builds its stages from
the plan's shape and pairs its messages by the plan's order, deriving none of them.
In process, no rank is started."""

from __future__ import annotations

import sys
from collections import Counter

import pytest
import torch

from pipeflow.config import compose, prepare_training
from pipeflow.planning.transformer import TransformerSpec, total_params
from pipeflow.schedules.lowering import check_pair_order, lower

COUNTED = ("pipeflow.config.assembly:schedule_spec", "pipeflow.config.assembly:run_topology",
           "pipeflow.config.tensor_degree:tensor_degree", "pipeflow.schedules.validate:dry_run")


@pytest.fixture
def calls(monkeypatch) -> Counter:
    """Counts of the derivations in COUNTED and of TransformerSpec.from_config, wherever
    a module imported them by name."""
    seen: Counter = Counter()

    def counting(name, fn):
        def wrapper(*args, **kwargs):
            seen[name] += 1
            return fn(*args, **kwargs)
        return wrapper

    for where in COUNTED:
        module, name = where.split(":")
        original = getattr(sys.modules[module], name)
        for mod in [m for m in list(sys.modules.values()) if getattr(m, "__name__", "").startswith("pipeflow")]:
            if getattr(mod, name, None) is original:
                monkeypatch.setattr(mod, name, counting(name, original))
    read = counting("from_config", TransformerSpec.from_config)
    monkeypatch.setattr(TransformerSpec, "from_config", staticmethod(read))
    return seen


@pytest.mark.parametrize("over", [[], ["pipeline.tensor_parallel=2"], ["schedule=pipedream"]],
                         ids=["default", "tensor_parallel", "asynchronous"])
def test_one_preparation_resolves_each_fact_once(calls, over):
    cfg = compose("train", [*over, "logger=none"])
    calls.clear()
    plan = prepare_training(cfg).plan
    validated = 1 + (plan.eval_lowered is not None) + len(plan.chunk_lowered)  # each schedule of the plan once
    assert dict(calls) == {"schedule_spec": 1, "from_config": 1, "run_topology": 1, "tensor_degree": 1,
                           "dry_run": validated}
    assert plan.tensor_parallel == (2 if over == ["pipeline.tensor_parallel=2"] else 1)
    assert plan.topology.num_devices == plan.schedule.num_devices


def test_a_ranks_stages_are_built_from_the_plan(calls):
    """The plan's shape builds the stages: the whole model's parameters, nothing derived."""
    plan = prepare_training(compose("train", ["logger=none"])).plan
    calls.clear()
    adapter = plan.adapter.build(torch.device("cpu"))
    stages = [adapter.build_stage(s) for s in range(plan.schedule.num_stages)]
    assert not calls
    assert adapter.spec is plan.spec
    tied = sum(p.numel() for p in stages[-1].tied_parameters())  # (the last stage's copy of the embedding)
    assert sum(p.numel() for st in stages for p in st.parameters()) - tied == total_params(plan.spec)


def test_the_plan_pairs_every_ranks_messages_once():
    """The receives in each sender's order, checked once in preparation for the job."""
    plan = prepare_training(compose("train", ["schedule=seq1f1b_interleaved", "pipeline.virtual_stages=2",
                                              "pipeline.segments=4", "logger=none"])).plan
    lowered = plan.lowered
    check_pair_order(lowered.paired)
    assert lowered.per_device == lower(plan.schedule)
    assert [sorted(map(str, d)) for d in lowered.paired] == [sorted(map(str, d)) for d in lowered.per_device]
    assert lowered.paired != lowered.per_device  # (interleaved segments: some receives move up)
