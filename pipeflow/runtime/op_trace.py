"""A run's own operators, timed by torch's profiler over its last steps
(``runtime.trace_steps=N``): each rank's seconds per step in each operator class of
:data:`pipeflow.planning.operators.CLASSES` (self time, on the device it ran on),
written to ``op_trace.json``; ``python -m pipeflow.fold_trace`` compares them with a
device profile (docs/runtime.md, "Operator trace")."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from ..planning.operators import CLASSES

SYNC_SCOPE = "pipeflow::sync"  # the executor's step synchronisation (clip norm, loss all-reduce)

PRODUCTS = {"aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmv", "aten::mv",
            "aten::_addmm_activation", "aten::addbmm"}
LOSS_OPS = {"aten::_log_softmax", "aten::log_softmax", "aten::nll_loss_forward", "aten::nll_loss_backward",
            "aten::_log_softmax_backward_data", "aten::nll_loss_nd", "aten::nll_loss", "aten::cross_entropy_loss"}
# the scopes the loss's operators run in: torch's cross-entropy, pipeflow's chunked one
# (pipeflow.models.loss: its forward's record_function, its backward's autograd node)
LOSS_SCOPES = {"aten::cross_entropy_loss", "pipeflow::cross_entropy"}
LOSS_BACKWARD = "ChunkedCrossEntropyBackward"
# operators that move no data of their own: their self time is the dispatcher's
HOST_OPS = {"aten::t", "aten::transpose", "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided",
            "aten::expand", "aten::permute", "aten::unsqueeze", "aten::squeeze", "aten::select", "aten::slice",
            "aten::detach", "aten::detach_", "aten::empty", "aten::empty_strided", "aten::empty_like",
            "aten::linear", "aten::matmul", "aten::resolve_conj", "aten::resolve_neg", "aten::alias",
            "aten::_unsafe_view", "aten::split", "aten::split_with_sizes", "aten::chunk", "aten::narrow",
            "aten::unbind", "aten::result_type", "aten::lift_fresh", "aten::contiguous", "aten::numpy_T",
            "aten::scaled_dot_product_attention", "aten::dropout", "aten::flatten", "aten::unflatten",
            "aten::view_as", "aten::reshape_as", "aten::_has_compatible_shallow_copy_type", "aten::is_nonzero",
            "aten::item", "aten::_local_scalar_dense", "aten::set_", "aten::resize_", "aten::to"}
COMM = ("gloo", "c10d::", "nccl", "record_param_comms")
POSTS = ("c10d::send", "c10d::recv_", "c10d::recvAnysource_")  # posting one message: the call's own time


def classify(name: str, scopes: tuple[str, ...] = ()) -> str | None:
    """The operator class of the profiler event ``name`` inside ``scopes`` (the names of
    the events around it, innermost first); ``"comm"`` for a message or collective;
    None for an event that is not an operator (a scope of pipeflow's or torch's own)."""
    if any(c in name for c in COMM):
        return "comm"
    if any(s.startswith("Optimizer.") or s == SYNC_SCOPE for s in scopes) or name.startswith("aten::_foreach"):
        return "optimizer"
    if not name.startswith("aten::"):
        # the autograd engine's nodes (AddmmBackward0, ...) hold its own work
        return "host" if name.endswith(("Backward0", "Backward1")) or "autograd::engine" in name else None
    if name in LOSS_OPS or any(s in LOSS_SCOPES or s.startswith(LOSS_BACKWARD) for s in scopes):
        return "loss"
    if "attention" in name or "scaled_dot_product" in name:
        return "host" if name == "aten::scaled_dot_product_attention" else "attention"
    if "layer_norm" in name or "rms_norm" in name:
        return "norm"
    if name in PRODUCTS:
        return "product"
    if name in HOST_OPS:
        return "host"
    return "pointwise"


@dataclass
class OpTrace:
    """One rank's traced steps: seconds by class (and ``comm``), summed over ``steps``."""

    device: str = "cpu"
    steps: int = 0
    seconds: dict = field(default_factory=dict)
    ops: dict = field(default_factory=dict)  # the heaviest operators' names per class: seconds
    posts: int = 0  # messages posted (sends and receives), and the seconds spent posting them
    post_seconds: float = 0.0

    def add(self, prof, steps: int) -> None:
        on_device = self.device == "cuda"
        for ev in prof.events():
            scopes, p = [], ev.cpu_parent
            while p is not None:
                scopes.append(p.name)
                p = p.cpu_parent
            cls = classify(ev.name, tuple(scopes))
            if cls is None:
                continue
            us = ev.self_device_time_total if on_device and cls != "host" else ev.self_cpu_time_total
            if us <= 0:
                continue
            self.seconds[cls] = self.seconds.get(cls, 0.0) + us * 1e-6
            if ev.name in POSTS:
                self.posts += 1
                self.post_seconds += ev.self_cpu_time_total * 1e-6
            per = self.ops.setdefault(cls, {})
            per[ev.name] = per.get(ev.name, 0.0) + us * 1e-6
        self.steps += steps

    def as_dict(self) -> dict:
        n = max(1, self.steps)
        return {
            "device": self.device,
            "steps": self.steps,
            "per_step": {c: self.seconds.get(c, 0.0) / n for c in (*CLASSES, "comm")},
            # the host's seconds per message posted (a profile's message_host), over posts_per_step
            "posts_per_step": self.posts / n,
            "post_s": self.post_seconds / self.posts if self.posts else None,
            "top_ops": {c: dict(sorted(((k, v / n) for k, v in ops.items()), key=lambda kv: -kv[1])[:8])
                        for c, ops in self.ops.items()},
        }


@contextlib.contextmanager
def traced(trace: OpTrace | None, steps: int):
    """Run the block under torch's profiler and add its operators to ``trace`` (nothing
    when ``trace`` is None)."""
    if trace is None:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if trace.device == "cuda" else [])
    with profile(activities=acts) as prof:
        yield
        if trace.device == "cuda":
            torch.cuda.synchronize()
    trace.add(prof, steps)
