"""The concurrent-branch model: its stage graph (chains, interaction edges, head join,
boundaries before interaction depths), chained stages equal to the whole model (output
and gradients by name), split-independent init, co-attention wiring, loss scaling."""

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from pipeflow.models.cbm import (
    build_cbm_model,
    build_cbm_stage,
    cbm_loss,
    cbm_shape,
    cbm_stage_graph,
    message_shape,
    normalizer,
    source_input,
    split_head_output,
)

CONF = Path(__file__).resolve().parent.parent / "conf"
TINY = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "cbm_tiny.yaml"))
# two interactions, one at consecutive depths, branches of different depth and width
DEEP = copy.deepcopy(TINY)
DEEP["vision"].update(n_layer=5, n_embd=48, n_head=3)
DEEP["text"].update(n_layer=4, seq_len=12)
DEEP["interaction_layers"] = [3, 4]
SEED = 7


def _batch(cfg, b=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    v, t = cfg["vision"], cfg["text"]
    labels = torch.randint(0, t["vocab_size"], (b, t["seq_len"]), generator=g)
    labels[torch.rand(labels.shape, generator=g) > 0.3] = -100
    return {
        "image": torch.rand(b, v["channels"], v["image_size"], v["image_size"], generator=g),
        "input_ids": torch.randint(0, t["vocab_size"], (b, t["seq_len"]), generator=g),
        "mlm_labels": labels,
        "itm_label": torch.randint(0, 2, (b,), generator=g).float(),
    }


def _run_stages(cfg, vs, ts, batch, seed=SEED):
    """Chain the stage modules in topological order, each fed a dict of its preds' outputs."""
    graph, specs = cbm_stage_graph(cfg, vs, ts)
    stages = [build_cbm_stage(cfg, specs, s, seed) for s in range(graph.num_stages)]
    outs = {}
    for s in graph.topological_order():
        x = source_input(specs[s], batch) if specs[s].is_source else {p: outs[p] for p in graph.preds[s]}
        outs[s] = stages[s](x)
    return graph, specs, stages, outs


def test_tiny_graph_shape():
    graph, specs = cbm_stage_graph(TINY, 2, 2)
    # interaction at depth 2: both branches cut after block 1 (depth 1)
    assert [(s.branch, s.lo, s.hi) for s in specs] == [
        ("vision", 0, 1), ("vision", 1, 4), ("text", 0, 1), ("text", 1, 3), ("head", -1, -1),
    ]
    assert set(graph.edges) == {(0, 1), (2, 3), (2, 1), (0, 3), (1, 4), (3, 4)}
    assert graph.branch == ("vision", "vision", "text", "text", "head")
    assert graph.sources == (0, 2) and graph.sinks == (4,)
    assert sorted(graph.preds[1]) == [0, 2] and sorted(graph.preds[4]) == [1, 3]


@pytest.mark.parametrize("vs,ts", [(3, 3), (4, 3), (5, 4), (3, 4)])
def test_boundaries_before_every_interaction_depth(vs, ts):
    graph, specs = cbm_stage_graph(DEEP, vs, ts)
    assert graph.num_stages == vs + ts + 1
    assert [s.branch for s in specs] == ["vision"] * vs + ["text"] * ts + ["head"]
    assert [s.stage for s in specs] == list(range(vs + ts + 1))
    for branch, n_layer in (("vision", 5), ("text", 4)):
        ranges = [(s.lo, s.hi) for s in specs if s.branch == branch]
        assert ranges[0][0] == 0 and ranges[-1][1] == n_layer
        assert all(a[1] == b[0] and a[0] < a[1] for a, b in zip(ranges, ranges[1:]))
        starts = {lo for lo, _ in ranges}
        assert {2, 3} <= starts  # blocks 2 and 3 compute the interaction depths 3 and 4
    # each interacting stage is fed by the partner stage that ends at exactly depth lo
    for s in specs[:-1]:
        if s.lo + 1 in (3, 4):
            partner = specs[s.partner_pred]
            assert partner.branch != s.branch and partner.hi == s.lo
            assert (partner.stage, s.stage) in graph.edges
        else:
            assert s.partner_pred is None
    order = graph.topological_order()
    assert all(order.index(a) < order.index(b) for a, b in graph.edges)
    assert len(set(graph.edges)) == len(graph.edges)


def test_remaining_layers_spread_evenly():
    large = OmegaConf.to_container(OmegaConf.load(CONF / "model" / "cbm_large.yaml"))
    for n, size in ((4, 6), (8, 3)):
        _, specs = cbm_stage_graph(large, n, n)
        assert all(s.hi - s.lo == size for s in specs[:-1])


def test_stage_counts_that_cannot_fit_interactions_fail():
    with pytest.raises(ValueError, match="pipeline.stages"):
        cbm_stage_graph(DEEP, 2, 3)  # two interaction cuts need three vision stages
    with pytest.raises(ValueError, match="pipeline.stages"):
        cbm_stage_graph(DEEP, 3, 5)  # more text stages than text layers


@pytest.mark.parametrize("depths", [[1], [5], [2, 2], [0]])
def test_bad_interaction_depths_fail(depths):
    cfg = copy.deepcopy(DEEP)
    cfg["interaction_layers"] = depths
    with pytest.raises(ValueError, match="model.interaction_layers"):
        cbm_shape(cfg)


def test_wrong_family_fails():
    with pytest.raises(ValueError, match="model.family"):
        cbm_shape({**TINY, "family": "gpt"})


@pytest.mark.parametrize("cfg,vs,ts", [(TINY, 2, 2), (TINY, 4, 3), (TINY, 3, 2), (DEEP, 3, 3), (DEEP, 5, 4)])
def test_chained_stages_equal_whole_model(cfg, vs, ts):
    batch = _batch(cfg)
    model = build_cbm_model(cfg, SEED)
    ref = model(batch["image"], batch["input_ids"])
    norm = normalizer(batch)
    cbm_loss(ref, batch, norm).backward()

    graph, specs, stages, outs = _run_stages(cfg, vs, ts, batch)
    out = outs[graph.sinks[0]]
    assert out.shape == ref.shape == message_shape(cfg, specs[-1], 4)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    cbm_loss(out, batch, norm).backward()

    ref_grads = {n: p.grad for n, p in model.named_parameters()}
    seen = set()
    for stage in stages:
        for name, p in stage.named_parameters():
            assert name not in seen  # every parameter lives on exactly one stage
            seen.add(name)
            torch.testing.assert_close(p.grad, ref_grads[name], rtol=1e-5, atol=1e-7)
    assert seen == set(ref_grads)
    for s, spec in enumerate(specs[:-1]):
        assert outs[s].shape == message_shape(cfg, spec, 4)


def test_init_is_split_independent_and_named_globally():
    whole = dict(build_cbm_model(DEEP, SEED).named_parameters())
    _, specs = cbm_stage_graph(DEEP, 5, 4)
    for s in range(len(specs)):
        for name, p in build_cbm_stage(DEEP, specs, s, SEED).named_parameters():
            assert torch.equal(p, whole[name]), name
    assert {"vision.patch_embed.weight", "vision.pos_embed", "text.tok_embed.weight", "head.mlm.weight"} <= set(whole)
    assert any(n.startswith("vision.blocks.2.cross_attn.") for n in whole)  # depth 3 interacts
    assert not any(n.startswith("vision.blocks.1.cross_attn.") for n in whole)
    other = dict(build_cbm_model(DEEP, SEED + 1).named_parameters())
    assert not torch.equal(whole["vision.blocks.0.attn.in_proj_weight"], other["vision.blocks.0.attn.in_proj_weight"])


def test_branches_interact_only_through_previous_depth():
    batch = _batch(TINY)
    changed = dict(batch, input_ids=(batch["input_ids"] + 1) % 256)
    _, _, _, a = _run_stages(TINY, 2, 2, batch)
    _, _, _, b = _run_stages(TINY, 2, 2, changed)
    torch.testing.assert_close(a[0], b[0])  # vision depth 1 sees no text
    assert not torch.allclose(a[1], b[1])  # vision block 2 cross-attends to text depth 1


def test_loss_is_itm_bce_plus_mlm_ce_and_microbatches_add_up():
    batch = _batch(TINY, b=6)
    out = build_cbm_model(TINY, SEED)(batch["image"], batch["input_ids"])
    norm = normalizer(batch)
    itm, mlm = split_head_output(out, TINY["text"]["seq_len"])
    expected = F.binary_cross_entropy_with_logits(itm, batch["itm_label"]) + F.cross_entropy(
        mlm.reshape(-1, mlm.size(-1)), batch["mlm_labels"].reshape(-1), ignore_index=-100
    )
    full = cbm_loss(out, batch, norm)
    torch.testing.assert_close(full, expected)
    parts = sum(cbm_loss(out[i : i + 2], batch, norm, slice(i, i + 2)) for i in range(0, 6, 2))
    torch.testing.assert_close(parts, full)


def test_source_stage_rejects_a_dict():
    _, specs = cbm_stage_graph(TINY, 2, 2)
    stage = build_cbm_stage(TINY, specs, 0, SEED)
    with pytest.raises(TypeError, match="source"):
        stage({0: torch.zeros(1)})


@pytest.mark.parametrize("cfg,vs,ts", [(TINY, 4, 3), (DEEP, 5, 4)])
def test_one_predecessor_stages_take_the_tensor_itself(cfg, vs, ts):
    """The runtime hands a stage with a single predecessor that tensor, not a dict (a
    stage past the last interaction reads only its chain): same output as the dict."""
    batch = _batch(cfg)
    graph, specs, stages, outs = _run_stages(cfg, vs, ts, batch)
    single = [s for s in range(graph.num_stages) if len(graph.preds[s]) == 1]
    assert single  # these splits have such stages
    for s in single:
        (pred,) = graph.preds[s]
        torch.testing.assert_close(stages[s](outs[pred]), outs[s], rtol=0, atol=0)


@pytest.mark.parametrize("cfg,vs,ts", [(TINY, 2, 2), (DEEP, 3, 3)])
def test_the_cost_counts_each_stages_parameters(cfg, vs, ts):
    """The branched cost's parameters (and so its weights, gradients and optimizer state
    in the simulator's memory) are the built stage's, to the parameter: the embeddings,
    the interaction blocks' cross-attention of another width, the head's norms and MLPs."""
    from pipeflow.planning.branched_cost import BranchedAnalyticCost

    graph, specs = cbm_stage_graph(cfg, vs, ts)
    cost = BranchedAnalyticCost(cfg, [(s.branch, s.lo, s.hi) for s in specs], microbatch_size=2, dtype_bytes=4)
    for s in range(graph.num_stages):
        n = sum(p.numel() for p in build_cbm_stage(cfg, specs, s, SEED).parameters())
        assert cost._params(s) == n, specs[s]
        assert cost.state_bytes(s) == {"parameters": 4.0 * n, "gradients": 4.0 * n, "optimizer_state": 8.0 * n,
                                       "casts": 0.0}
        # at 16 bits, a cast of every parameter but the embedding tables and the norms
        tables = sum(p.numel() for name, p in build_cbm_stage(cfg, specs, s, SEED).named_parameters()
                     if "embed" in name and "patch" not in name or "ln" in name)
        half = BranchedAnalyticCost(cfg, [(t.branch, t.lo, t.hi) for t in specs], microbatch_size=2, dtype_bytes=2)
        assert half.state_bytes(s)["casts"] == 2.0 * (n - tables), specs[s]
