"""pipeflow's 1F1B against PyTorch's own: the same 2-stage GPT, the same global batch,
the same gradients.

PyTorch runs our ``GPTStage`` modules, wrapped in ``torch.distributed.pipelining``'s
``PipelineStage``, with its ``Schedule1F1B``, in two real processes over gloo; pipeflow
runs its own 1F1B through the launcher and dumps every rank's gradients after the
first iteration's gradient sync (before clipping). Both use step 1's batch of the
same corpus, so every parameter's raw gradient must agree to fp32 round-off.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from pipeflow.config import compose, prepare_training
from pipeflow.runtime.launch import TrainJob, free_port, launch, rank_context

pytestmark = pytest.mark.slow  # starts ranks or subprocesses: make test-fast leaves it out

# tests/test_runtime.py's small model with 4 layers: 2 per stage
OVERRIDES = [
    "model.n_layer=4",
    "model.n_embd=64",
    "model.n_head=4",
    "model.seq_len=64",
    "pipeline.stages=2",
    "pipeline.microbatches=4",
    "pipeline.microbatch_size=2",
    "schedule=1f1b",
    "partition=uniform",
    "trainer.steps=1",
    "trainer.val_every=0",
    "trainer.val_batches=1",
    "trainer.timeline_step=null",
    "runtime.dump_grads=true",
    "logger=none",
]
STEP = 1  # pipeflow's first iteration is step 1, and its batch is train_batch(1, m * mbs)
TIMEOUT_S = 60


def _torch_rank(rank: int, world: int, port: int, cfg: dict, layers: list[int], batch, out: str) -> None:
    """One rank of torch's Schedule1F1B; writes {param name: grad} to ``out``/rank<r>.pt."""
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B

    from pipeflow.models.gpt import build_stage, lm_loss

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S))
    try:
        module = build_stage(cfg["model"], layers, rank, int(cfg["seed"]))
        stage = PipelineStage(module, stage_index=rank, num_stages=world, device=torch.device("cpu"))
        m = int(cfg["pipeline"]["microbatches"])
        tokens_per_microbatch = int(cfg["pipeline"]["microbatch_size"]) * int(cfg["model"]["seq_len"])

        # pipeflow scores microbatch k with sum(CE_k) / (m * mbs * T): the microbatch
        # losses add up to the global batch's mean. torch's schedule instead divides the
        # accumulated gradients by n_microbatches at the end (scale_grads=True, meant
        # for a loss_fn that averages over its microbatch). So torch's loss_fn is the
        # per-microbatch mean, sum(CE_k) / (mbs * T), and the 1/m comes from torch.
        # Both factors are powers of two here, so the two scalings agree exactly.
        def loss_fn(logits, targets):
            return lm_loss(logits, targets, tokens_per_microbatch)

        schedule = Schedule1F1B(stage, n_microbatches=m, loss_fn=loss_fn, scale_grads=True)
        inputs, targets = batch
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets)
        grads = {name: p.grad.detach().clone() for name, p in module.named_parameters() if p.grad is not None}
        torch.save(grads, Path(out) / f"rank{rank}.pt")
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_torch(cfg: dict, layers: list[int], batch, out: Path) -> dict[str, torch.Tensor]:
    """Both ranks as real processes; a rank that fails or hangs fails the test."""
    # forked from a server that has torch and the models imported already (the
    # launcher's own server), so a rank starts in a fraction of a second
    ctx = rank_context()
    port = free_port()
    procs = [ctx.Process(target=_torch_rank, args=(r, 2, port, cfg, layers, batch, str(out))) for r in range(2)]
    for p in procs:
        p.start()
    try:
        for p in procs:
            p.join(TIMEOUT_S + 30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    assert [p.exitcode for p in procs] == [0, 0], "a torch pipelining rank failed; see its traceback above"
    grads: dict[str, torch.Tensor] = {}
    for r in range(2):
        grads.update(torch.load(out / f"rank{r}.pt"))
    return grads


def _tie(grads: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """File the LM head's copy of the tied embedding under the embedding's name, summed
    with it: the tied weight's gradient is the sum of both uses."""
    out = dict(grads)
    head = out.pop("lm_head.weight")
    out["wte.weight"] = out["wte.weight"] + head
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    cfg = compose("train", OVERRIDES)
    inputs = prepare_training(cfg)
    plain = inputs.plan.record

    # pipeflow: its own launcher, its own 1F1B
    pf_dir = tmp_path_factory.mktemp("pipeflow")
    launch(TrainJob(inputs.plan, str(pf_dir)))
    pf: dict[str, torch.Tensor] = {}
    for f in sorted((pf_dir / "grads").glob("rank*.pt")):
        for key, g in torch.load(f).items():
            pipe, name = key.split(":", 1)
            assert pipe == "0"
            pf[name] = g

    # torch: the same stages (same split, same seed-derived weights), the same batch
    from pipeflow.data.text import build_text_data
    from pipeflow.planning.partitioners import partition_layers

    layers = partition_layers(plain["partition"]["name"], inputs.spec, 2)
    m, mbs = plain["pipeline"]["microbatches"], plain["pipeline"]["microbatch_size"]
    data = build_text_data(plain["data"], inputs.spec.seq_len, int(plain["seed"]))
    batch = data.train_batch(STEP, m * mbs)
    th_dir = tmp_path_factory.mktemp("torch")
    th = _run_torch(plain, list(layers), batch, th_dir)
    return pf, th


def test_torch_schedule1f1b_gives_pipeflow_1f1b_gradients(runs):
    pf, th = runs
    # pipeflow already summed the tied copies (each copy holds the sum); torch did not
    assert set(pf) == set(th)
    torch.testing.assert_close(pf["wte.weight"], pf["lm_head.weight"], rtol=0, atol=0)
    pf_t = dict(pf)
    pf_t.pop("lm_head.weight")
    th_t = _tie(th)
    assert set(pf_t) == set(th_t) and len(pf_t) > 10
    for name, g in th_t.items():
        scale = float(g.abs().max())
        assert scale > 0, f"{name}: torch produced an all-zero gradient"
        torch.testing.assert_close(pf_t[name], g, rtol=1e-5, atol=1e-6 * scale, msg=name)
    # a mis-scaled loss (1/m too much or too little) would be off by a factor of 4:
    # the check above is that tight, and the gradients are not trivially small
    assert float(th_t["h.0.attn.c_attn.weight"].abs().max()) > 1e-4


def test_the_stages_hold_what_the_split_says(runs):
    pf, th = runs
    # stage 0: the embeddings and blocks 0-1; stage 1: blocks 2-3, ln_f and the head copy
    assert {"wte.weight", "wpe.weight", "h.1.mlp.c_fc.weight", "h.3.mlp.c_fc.weight", "ln_f.weight"} <= set(th)
    assert "h.4.mlp.c_fc.weight" not in th
