"""The operator sweep: what a device's operators cost, measured here (torch imported lazily).

Products, attention, norms and elementwise ops, cross-entropy, AdamW and the host's cost
per launch, each section under its share of one wall-clock budget; the file is rewritten
after each section, in the format of ``benchmarks/measurements/h200-2026-12-04/ops.json``
(docs/simulation.md, "Measuring a device"). ``python -m pipeflow.measure_device`` runs it."""

from __future__ import annotations

import functools
import json
import math
import os
import platform
import statistics
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

from ..faults import WriteFailed
from ..formats.files import write_aside
from .elementwise_kernels import ELEMENTWISE

KIND = "pipeflow-op-sweep"
VERSION = 1

GEMM_SHAPES = {  # (k, n) of x[m, k] @ W[n, k]^T: the GPU's grid
    "gpt_medium qkv": (1024, 3072), "gpt_medium proj": (1024, 1024), "gpt_medium fc1": (1024, 4096),
    "gpt_medium fc2": (4096, 1024), "gpt lm_head 50304": (1024, 50304), "gpt lm_head 50257": (1024, 50257),
    "gpt_1.5b qkv": (1600, 4800), "gpt_1.5b proj": (1600, 1600), "gpt_1.5b fc1": (1600, 6400),
    "gpt_1.5b fc2": (6400, 1600), "gpt_1.5b lm_head": (1600, 50304),
    "llama1b q/o": (2048, 2048), "llama1b k/v": (2048, 512), "llama1b gate/up": (2048, 5632),
    "llama1b down": (5632, 2048),
}
CPU_GEMM_SHAPES = {  # the models a CPU trains: widths 128 (gpt_tiny, llama_tiny) to 1024 (gpt_medium)
    "gpt_tiny qkv": (128, 384), "gpt_tiny fc1": (128, 512), "gpt_tiny fc2": (512, 128),
    "gpt_tiny lm_head 256": (128, 256), "llama_tiny gate/up": (128, 344), "llama_tiny down": (344, 128),
    "gpt_small qkv": (768, 2304), "gpt_small proj": (768, 768), "gpt_small fc1": (768, 3072),
    "gpt_small fc2": (3072, 768), "gpt_medium proj": (1024, 1024),
}


@dataclass(frozen=True)
class Grid:
    """The sizes one device's sweep measures, section by section."""

    launch_calls: int
    gemm_ms: list[int]
    gemm_shapes: dict[str, tuple[int, int]]
    fp32_shapes: list[tuple[int, int, int]]  # (m, k, n) at 'highest' and 'high' precision
    sdpa: list[tuple[int, int, int, int, bool]]  # (b, h, s, d, causal)
    elementwise_sizes: list[int]  # bytes of one input
    ce_tokens: list[int]
    ce_vocabs: tuple[int, ...]
    adamw: list[tuple[int, int]]  # (parameters, tensors)
    hidden: int = 1024  # the elementwise inputs' last dimension
    # the elementwise calls cycle through inputs of this many bytes in all: past the caches
    cold_bytes: int = 128 << 20
    sdpa_dtypes: tuple[str, ...] = ("bfloat16",)  # attention's dtypes (a CPU trains in fp32 by default)
    samples: int = 5  # timed samples of each measurement (after two warm-up calls and one to size them)


def _cuda_grid() -> Grid:
    """Today's H200 grid: about 16k tokens an attention call, up to 1 GB elementwise inputs."""
    heads = [(16, 64), (25, 64), (32, 64), (32, 128), (8, 128)]
    sdpa = [(max(1, 16384 // s), h, s, d, True) for s in (512, 1024, 2048, 4096, 8192) for h, d in heads]
    sdpa += [(16384 // s, 16, s, 64, False) for s in (512, 1024)]  # BERT: not causal
    return Grid(
        launch_calls=2000, gemm_ms=[512, 1024, 2048, 4096, 8192, 16384, 32768], gemm_shapes=GEMM_SHAPES,
        fp32_shapes=[(8192, 1024, 1024), (8192, 1024, 4096), (8192, 4096, 1024), (8192, 1600, 6400),
                     (4096, 2048, 5632), (8192, 1024, 50304)],
        sdpa=sdpa, elementwise_sizes=[2**20, 2**22, 2**24, 2**26, 2**28, 2**30], ce_tokens=[1024, 4096, 8192, 16384],
        ce_vocabs=(32000, 50257, 50304),
        adamw=[(10**6, 4), (10**6, 64), (10**7, 16), (10**7, 256), (10**8, 64), (10**8, 512), (4 * 10**8, 256)])


def _cpu_grid() -> Grid:
    """A grid two CPU cores measure in one to two minutes: products at 128..2048 tokens,
    attention over 128..1024 tokens, inputs of 16 KB..64 MB."""
    heads = [(4, 32), (12, 64)]  # gpt_tiny's and gpt_small's heads
    sdpa = [(max(1, 2048 // s), h, s, d, True) for s in (128, 256, 512, 1024) for h, d in heads]
    sdpa += [(2048 // s, 12, s, 64, False) for s in (128, 512)]  # BERT: not causal
    return Grid(
        launch_calls=2000, gemm_ms=[128, 256, 512, 1024, 2048], gemm_shapes=CPU_GEMM_SHAPES,
        fp32_shapes=[(1024, 768, 768), (1024, 768, 3072), (1024, 3072, 768), (1024, 1024, 4096),
                     (256, 768, 50257)],
        sdpa=sdpa, elementwise_sizes=[2**14, 2**16, 2**18, 2**20, 2**22, 2**24, 2**26], ce_tokens=[128, 512, 1024],
        ce_vocabs=(256, 8192, 50257),
        adamw=[(10**5, 4), (10**6, 16), (10**6, 64), (10**7, 64), (2 * 10**7, 128)],
        samples=3,  # a CPU's large calls take tens of milliseconds each, one at a time
        sdpa_dtypes=("float32", "bfloat16"))


def _smoke_grid() -> Grid:
    """The tiny sizes tests run in seconds on any device."""
    return Grid(
        launch_calls=50, gemm_ms=[64, 128],
        gemm_shapes={name: (max(16, k // 32), max(16, n // 32)) for name, (k, n) in GEMM_SHAPES.items()},
        fp32_shapes=[(64, 32, 64)], sdpa=[(1, 2, s, d, True) for s in (64, 128) for d in (16, 32)],
        elementwise_sizes=[2**18, 2**20], ce_tokens=[64], ce_vocabs=(32000, 50257, 50304),
        adamw=[(10**4, 4), (10**5, 16)], cold_bytes=4 << 20)


def grid_for(device: str, smoke: bool) -> Grid:
    """The sizes a sweep of ``device`` measures (``smoke``: the tiny ones)."""
    if smoke:
        return _smoke_grid()
    return _cuda_grid() if device == "cuda" else _cpu_grid()


def write_json(path: Path, data) -> None:
    """Write whole, aside and moved into place (a file cut short by a kill or a full disk
    never replaces a whole one); WriteFailed names the file."""
    write_aside(path, json.dumps(data, indent=1, default=str))


def host_facts(torch) -> dict:
    """The host's processor, core count and torch's threads."""
    processor = platform.processor()
    try:
        names = [ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                 if ln.startswith("model name")]
        processor = names[0] if names else processor
    except OSError:
        pass
    return {"processor": processor or platform.machine(), "machine": platform.machine(),
            "system": platform.system(), "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads()}


def cpu_isa(torch) -> str | None:
    """The instruction set torch's CPU kernels use (AVX2, AVX512, ...), where torch says."""
    ask = getattr(getattr(torch.backends, "cpu", None), "get_cpu_capability", None)
    return ask() if ask else None


class Sweep:
    """The sweep's file, written after every section; each section stops at its own deadline."""

    def __init__(self, path: Path, budget_s: float, device: str = "cuda", smoke: bool = False,
                 say: Callable[[str], None] = print):
        import torch

        self.torch = torch
        self.smoke = smoke
        self.dev = device
        self.grid = grid_for(device, smoke)
        self.path = Path(path)
        self.say = say
        self.t0 = time.monotonic()
        self.budget = budget_s
        self.doc = {"kind": KIND, "version": VERSION, "status": "running", "budget_s": budget_s, "device": self.dev,
                    "torch": torch.__version__,
                    "timing": "median over samples of (CUDA-event time of `inner` back-to-back calls) / inner, "
                              "after warm-up calls; perf_counter on CPU",
                    "host": host_facts(torch), "cpu_isa": cpu_isa(torch), "sections": {}}
        if device == "cuda":
            p = torch.cuda.get_device_properties(0)
            self.doc.update(gpu=p.name, sms=p.multi_processor_count, memory_bytes=p.total_memory,
                            cuda=torch.version.cuda)

    def sync(self):
        """Wait for the device's queued work (a CPU's is done when called)."""
        if self.dev == "cuda":
            self.torch.cuda.synchronize()

    def save(self):
        """Write the document as it stands."""
        write_json(self.path, self.doc)

    def time(self, fn, warm: int = 2, samples: int = 7, min_sample_s: float = 3e-4, max_inner: int = 200) -> dict:
        """Median seconds per call of ``fn``."""
        torch = self.torch
        for _ in range(warm):
            fn()
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        est = time.perf_counter() - t
        inner = max(1, min(max_inner, math.ceil(min_sample_s / max(est, 1e-7))))
        times = []
        for _ in range(samples):
            if self.dev == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                for _ in range(inner):
                    fn()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) / 1e3 / inner)
            else:
                t = time.perf_counter()
                for _ in range(inner):
                    fn()
                times.append((time.perf_counter() - t) / inner)
        return {"s": statistics.median(times), "min_s": min(times), "max_s": max(times), "inner": inner,
                "samples": samples}

    def section(self, name: str, share_end: float, body) -> dict:
        """Run ``body(rows, deadline)``; its rows are kept however it ends."""
        deadline = self.t0 + self.budget * share_end
        rows: list = []
        sec = {"status": "running", "rows": rows}
        self.doc["sections"][name] = sec
        t = time.monotonic()
        if deadline - t < 1:
            sec.update(status="skipped", why="no time left in the sweep")
        else:
            try:
                done = body(rows, deadline)
                sec["status"] = "ok" if done is not False else "truncated (deadline)"
            except WriteFailed:
                raise  # the file cannot be written: measuring on would be lost
            except Exception:  # noqa: BLE001 - a section's error is recorded, the others still run
                sec.update(status="error", error=traceback.format_exc()[-3000:])
        sec["seconds"] = round(time.monotonic() - t, 2)
        if self.dev == "cuda":
            self.torch.cuda.empty_cache()
        self.save()
        self.say(f"{name}: {sec['status']} ({len(rows)} rows, {sec['seconds']} s)")
        return sec

    def randn(self, *shape, dtype=None, grad=False):
        """A normal random tensor on the device, bf16 unless ``dtype`` says."""
        torch = self.torch
        return torch.randn(*shape, device=self.dev, dtype=dtype or torch.bfloat16, requires_grad=grad)


def ops_launch(sw: Sweep, rows: list, deadline: float):
    """The host's cost per launch: a tiny elementwise op in a loop, with and without a sync
    each call; a tiny Linear's forward and backward; CUDA graph replays of 0, 1 and 100 kernels."""
    torch = sw.torch
    n = sw.grid.launch_calls
    x, y = sw.randn(16), sw.randn(16)

    def loop(fn, calls, sync_each):
        fn()
        sw.sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
            if sync_each:
                sw.sync()
        sw.sync()
        return (time.perf_counter() - t) / calls

    add = lambda: torch.add(x, 1.0, out=y)  # noqa: E731
    for rep in range(3):
        rows.append({"op": "add_out_tiny", "rep": rep, "calls": n, "s_per_call_async": loop(add, n, False),
                     "s_per_call_synced": loop(add, n // 4, True)})
    rows.append({"op": "add_out_tiny", "events": sw.time(add)})
    lin = torch.nn.Linear(64, 64, device=sw.dev)
    xi = torch.randn(8, 64, device=sw.dev)
    rows.append({"op": "linear64_fwd_bwd_fp32", "s_per_call_async": loop(lambda: lin(xi).sum().backward(), n // 4, False)})
    with torch.autocast(sw.dev, dtype=torch.bfloat16):
        rows.append({"op": "linear64_fwd_bwd_autocast_bf16",
                     "s_per_call_async": loop(lambda: lin(xi).sum().backward(), n // 4, False)})
    sw.save()
    if sw.dev != "cuda":
        rows.append({"op": "cuda_graph", "skipped": "cpu"})
        return True
    for kernels in (0, 1, 100):
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for _ in range(3):
                    add()
            torch.cuda.current_stream().wait_stream(s)
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(kernels):
                    torch.add(x, 1.0, out=y)
            rows.append({"op": f"cuda_graph_replay_{kernels}_kernels", "s_per_replay_async": loop(g.replay, n // 4, False),
                         "s_per_replay_synced": loop(g.replay, n // 8, True), "events": sw.time(g.replay)})
        except Exception as e:  # noqa: BLE001 - a graph the driver refuses is a row, not the section's end
            rows.append({"op": f"cuda_graph_replay_{kernels}_kernels", "error": repr(e)[:500]})
    return True


def products(sw: Sweep, rows: list, deadline: float, dtype: str):
    """Products over tokens m in ``dtype`` ("bf16", "fp32"): forward x @ W^T, input gradient
    g @ W, weight gradient g^T @ x."""
    torch = sw.torch
    dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]
    for m in sw.grid.gemm_ms:
        for name, (k, n) in sw.grid.gemm_shapes.items():
            if time.monotonic() > deadline:
                return False
            x, w, g = sw.randn(m, k, dtype=dt), sw.randn(n, k, dtype=dt), sw.randn(m, n, dtype=dt)
            flop = 2 * m * k * n
            row = {"shape": name, "m": m, "k": k, "n": n, "dtype": dtype, "flop": flop}
            for prod, fn in (("fwd", lambda: x @ w.t()), ("dgrad", lambda: g @ w), ("wgrad", lambda: g.t() @ x)):
                t = sw.time(fn, samples=sw.grid.samples)
                row[f"{prod}_s"], row[f"{prod}_tflops"] = t["s"], flop / t["s"] / 1e12
            rows.append(row)
            del x, w, g
        sw.save()
    return True


def ops_gemm(sw: Sweep, rows: list, deadline: float):
    """bf16 products over the grid's tokens and shapes."""
    return products(sw, rows, deadline, "bf16")


def ops_gemm_fp32_grid(sw: Sweep, rows: list, deadline: float):
    """The same products in fp32 at torch's precision as it stands ('highest' unless set):
    what a CPU run, fp32 by default, multiplies."""
    return products(sw, rows, deadline, "fp32")


def ops_fp32_gemm(sw: Sweep, rows: list, deadline: float):
    """fp32 products, true fp32 ('highest') and TF32 ('high')."""
    torch = sw.torch
    before = torch.get_float32_matmul_precision()
    try:
        for prec in ("highest", "high"):
            torch.set_float32_matmul_precision(prec)
            for m, k, n in sw.grid.fp32_shapes:
                if time.monotonic() > deadline:
                    return False
                x, w = sw.randn(m, k, dtype=torch.float32), sw.randn(n, k, dtype=torch.float32)
                t = sw.time(lambda: x @ w.t(), samples=sw.grid.samples)
                rows.append({"m": m, "k": k, "n": n, "precision": prec, "s": t["s"], "tflops": 2 * m * k * n / t["s"] / 1e12})
    finally:
        torch.set_float32_matmul_precision(before)
    return True


def ops_sdpa(sw: Sweep, rows: list, deadline: float):
    """F.scaled_dot_product_attention in the grid's dtypes (a GPU's bf16; a CPU's fp32 and
    bf16), forward and forward+backward; each row names its dtype."""
    torch = sw.torch
    import torch.nn.functional as F

    for (b, h, s, d, causal), dtype in ((shape, dt) for dt in sw.grid.sdpa_dtypes for shape in sw.grid.sdpa):
        if time.monotonic() > deadline:
            return False
        q, k, v = (sw.randn(b, h, s, d, dtype=getattr(torch, dtype), grad=True) for _ in range(3))
        go = sw.randn(b, h, s, d, dtype=getattr(torch, dtype))
        fwd = sw.time(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal), samples=sw.grid.samples)

        def fb():
            o = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
            torch.autograd.backward(o, go)

        both = sw.time(fb, samples=sw.grid.samples)
        flop = 4 * b * h * s * s * d * (0.5 if causal else 1.0)  # forward; the backward is about 2.5x
        rows.append({"b": b, "h": h, "s": s, "d": d, "causal": causal, "dtype": dtype, "fwd_s": fwd["s"],
                     "fwd_bwd_s": both["s"],
                     "fwd_flop": flop, "fwd_tflops": flop / fwd["s"] / 1e12, "fwd_bwd_tflops": 3.5 * flop / both["s"] / 1e12})
        del q, k, v, go
        sw.save()
    return True


def ops_elementwise(sw: Sweep, rows: list, deadline: float):
    """The elementwise kernels (:data:`~pipeflow.topology.elementwise_kernels.ELEMENTWISE`: norms,
    activations, adds and copies) over the grid's input sizes (hidden 1024), bf16 and fp32,
    forward and forward+backward: time and the fewest bytes each must move. Each call reads
    cold inputs, cycling through a pool of ``cold_bytes``, as a model's operators read
    activations written long before (docs/simulation.md)."""
    torch = sw.torch
    import torch.nn.functional as F

    H = sw.grid.hidden
    for dtype in (torch.bfloat16, torch.float32):
        e = torch.tensor([], dtype=dtype).element_size()
        for size in sw.grid.elementwise_sizes:
            rows_n = max(1, size // (H * e))
            nb = rows_n * H * e
            pool = [(sw.randn(rows_n, H, dtype=dtype, grad=True), sw.randn(rows_n, H, dtype=dtype, grad=True))
                    for _ in range(max(2, math.ceil(sw.grid.cold_bytes / (2 * nb))))]
            gy = sw.randn(rows_n, H, dtype=dtype)
            ln = torch.nn.LayerNorm(H, device=sw.dev, dtype=dtype)
            wr = torch.ones(H, device=sw.dev, dtype=dtype, requires_grad=True)
            weights = (*ln.parameters(), wr)
            turn = [0]

            def pair():
                turn[0] = (turn[0] + 1) % len(pool)
                return pool[turn[0]]

            def one(fn):
                return lambda: fn(*pair())

            kit = SimpleNamespace(torch=torch, F=F, ln=ln, wr=wr)
            for name, kernel in ELEMENTWISE.items():
                if time.monotonic() > deadline:
                    return False
                fn = functools.partial(kernel.call, kit)
                fwd_bytes = kernel.fwd_inputs * nb
                fb_bytes = None if kernel.fwd_bwd_inputs is None else kernel.fwd_bwd_inputs * nb
                t = sw.time(one(fn), samples=sw.grid.samples)
                row = {"op": name, "dtype": str(dtype).split(".")[-1], "rows": rows_n, "hidden": H, "input_bytes": nb,
                       "pool": len(pool), "fwd_s": t["s"], "fwd_bytes": fwd_bytes, "fwd_GBps": fwd_bytes / t["s"] / 1e9}
                if fb_bytes is not None:
                    # the inputs' gradients returned, not accumulated into .grad: a model's
                    # activation gradients are made and dropped (accumulating into each of the
                    # pool's cold .grad buffers allocated them fresh: page faults each call)
                    t2 = sw.time(one(lambda x, y, fn=fn: torch.autograd.grad(fn(x, y), (x, y, *weights), gy,
                                                                              allow_unused=True)),
                                 samples=sw.grid.samples)
                    row.update(fwd_bwd_s=t2["s"], fwd_bwd_bytes=fb_bytes, fwd_bwd_GBps=fb_bytes / t2["s"] / 1e9)
                rows.append(row)
            del pool, gy
            sw.save()
    return True


def ops_cross_entropy(sw: Sweep, rows: list, deadline: float):
    """The runtime's loss ``sw.loss`` forward and forward+backward over (tokens, vocab) logits,
    fp32 and bf16."""
    torch = sw.torch
    cross_entropy_sum = sw.loss

    for t_ in sw.grid.ce_tokens:
        for vocab in sw.grid.ce_vocabs:
            for dtype in (torch.float32, torch.bfloat16):
                if time.monotonic() > deadline:
                    return False
                logits = sw.randn(t_, vocab, dtype=dtype, grad=True)
                tgt = torch.randint(0, vocab, (t_,), device=sw.dev)
                f = sw.time(lambda: cross_entropy_sum(logits, tgt), samples=sw.grid.samples)
                fb = sw.time(lambda: cross_entropy_sum(logits, tgt).backward(), samples=sw.grid.samples)
                nb = t_ * vocab * logits.element_size()
                rows.append({"tokens": t_, "vocab": vocab, "dtype": str(dtype).split(".")[-1], "logit_bytes": nb,
                             "fwd_s": f["s"], "fwd_bwd_s": fb["s"]})
                logits.grad = None
                del logits
            sw.save()
    return True


def ops_adamw(sw: Sweep, rows: list, deadline: float):
    """torch.optim.AdamW.step over N fp32 parameters in a given number of tensors:
    fused, foreach (torch's default on CUDA) and single-tensor."""
    torch = sw.torch
    for n, count in sw.grid.adamw:
        per = max(1, n // count)
        params = [torch.nn.Parameter(torch.randn(per, device=sw.dev)) for _ in range(count)]
        for p in params:
            p.grad = torch.randn_like(p)
        for impl, kw in (("fused", {"fused": True}), ("foreach", {"foreach": True}), ("single", {"foreach": False})):
            if time.monotonic() > deadline:
                return False
            try:
                opt = torch.optim.AdamW(params, lr=1e-4, **kw)
                t = sw.time(opt.step, warm=2, samples=sw.grid.samples, max_inner=20)
                rows.append({"params": per * count, "tensors": count, "impl": impl, "s": t["s"],
                             "bytes_min": per * count * 4 * 7})  # read p, g, m, v; write p, m, v
                del opt
            except Exception as e:  # noqa: BLE001 - an implementation this torch lacks is a row
                rows.append({"params": per * count, "tensors": count, "impl": impl, "error": repr(e)[:400]})
        del params
        sw.save()
    return True


def ops_grad_norm(sw: Sweep, rows: list, deadline: float):
    """The clip's gradient norm as the runtime takes it (each fp32 gradient's squared sum in
    float64, added up), then each gradient scaled."""
    torch = sw.torch
    for n, count in sw.grid.adamw:
        per = max(1024, n // count // 1024 * 1024)
        grads = [torch.randn(per, device=sw.dev) for _ in range(count)]

        def norm():
            total = torch.zeros((), dtype=torch.float64, device=sw.dev)
            for g in grads:
                rows_ = g.view(-1, 1024)
                total += torch.bmm(rows_.unsqueeze(1), rows_.unsqueeze(2)).double().sum() / 1  # (/ copies)
            return total

        if time.monotonic() > deadline:
            return False
        t = sw.time(norm, warm=2, samples=sw.grid.samples, max_inner=20)
        scale = sw.time(lambda: [g.mul_(1.0) for g in grads], warm=1, samples=sw.grid.samples, max_inner=20)
        rows.append({"params": per * count, "tensors": count, "s": t["s"], "scale_s": scale["s"]})
        del grads
        sw.save()
    return True


SECTIONS = [  # name, the sweep's share of the budget by which it must end, body: a GPU's sweep
    ("launch", 0.06, ops_launch),
    ("gemm_bf16", 0.32, ops_gemm),
    ("sdpa_bf16", 0.48, ops_sdpa),
    ("elementwise", 0.66, ops_elementwise),
    ("cross_entropy", 0.76, ops_cross_entropy),
    ("adamw", 0.88, ops_adamw),
    ("grad_norm", 0.92, ops_grad_norm),
    ("gemm_fp32", 1.0, ops_fp32_gemm),
]
CPU_SECTIONS = [  # a CPU's: its products in fp32 too, the runs it prices being fp32 by default; the
    # shares follow what each section took on two cores (elementwise's 64 MB inputs the most)
    ("launch", 0.06, ops_launch),
    ("gemm_bf16", 0.18, ops_gemm),
    ("gemm_fp32_grid", 0.31, ops_gemm_fp32_grid),
    ("sdpa_bf16", 0.41, ops_sdpa),
    ("elementwise", 0.74, ops_elementwise),
    ("cross_entropy", 0.85, ops_cross_entropy),
    ("adamw", 0.91, ops_adamw),
    ("grad_norm", 0.94, ops_grad_norm),
    ("gemm_fp32", 0.98, ops_fp32_gemm),
]


def sections_for(device: str) -> list:
    """The sections a sweep of ``device`` runs, in order, each with its share's end."""
    return SECTIONS if device == "cuda" else CPU_SECTIONS


def sweep(path: Path, budget_s: float, device: str, smoke: bool = False, say: Callable[[str], None] = print,
          threads: int | None = None, extra: tuple = (), loss: Callable | None = None) -> dict:
    """Measure ``device``'s operators within ``budget_s`` seconds into ``path`` at ``threads``
    intra-op threads (None: torch's setting); return the document. ``extra``: more sections,
    (name, share's end, body(rows, deadline)); ``loss(logits, targets)``: the summed
    cross-entropy the runs use (None: torch's)."""
    import torch

    before = torch.get_num_threads()
    if threads:
        torch.set_num_threads(threads)
    try:
        sw = Sweep(path, budget_s, device, smoke, say)
        sw.loss = loss or (lambda logits, targets: torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        sw.save()
        for name, share_end, body in sections_for(device):
            sw.section(name, share_end, lambda rows, deadline, body=body: body(sw, rows, deadline))
        for name, share_end, body in extra:
            sw.section(name, share_end, body)
    finally:
        torch.set_num_threads(before)
    statuses = [s["status"] for s in sw.doc["sections"].values()]
    sw.doc["status"] = "ok" if all(s == "ok" for s in statuses) else "partial"
    sw.doc["seconds"] = round(time.monotonic() - sw.t0, 1)
    sw.save()
    return sw.doc
