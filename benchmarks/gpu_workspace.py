"""What torch's math libraries keep on a GPU after a step's first products (their
workspaces), which the simulator counts per device (``Device.workspace_bytes``): the
bytes the allocator still holds after each kind of product, its output freed. Needs a
CUDA device:

    python -m benchmarks.gpu_workspace
"""

from __future__ import annotations

import os
import sys

import torch
import torch.nn.functional as F


def _kept(device: torch.device, fn) -> int:
    """Bytes still allocated after ``fn`` ran and its result was dropped."""
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    out = fn()
    del out
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device) - before


def main() -> int:
    if not torch.cuda.is_available():
        print("gpu_workspace: needs a CUDA device", file=sys.stderr)
        return 1
    d = torch.device("cuda")
    print("env CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
          "TORCH_CUBLASLT_WORKSPACE_SIZE", os.environ.get("TORCH_CUBLASLT_WORKSPACE_SIZE"))
    x = torch.randn(256, 256, device=d)
    w = torch.randn(256, 256, device=d, requires_grad=True)
    bias = torch.randn(256, device=d, requires_grad=True)

    def autocast_backward():
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = F.linear(x, w, bias)
        y.float().sum().backward()

    def qkv(dtype):
        return (torch.randn(4, 4, 128, 64, device=d, dtype=dtype),) * 3

    steps = [
        ("fp32 mm", lambda: x @ x),
        ("fp32 addmm (linear+bias)", lambda: F.linear(x, w, bias)),
        ("fp32 linear backward", lambda: F.linear(x, w, bias).sum().backward()),  # autograd's own thread
        ("bf16 mm", lambda: x.bfloat16() @ x.bfloat16()),
        ("bf16 linear+bias", lambda: F.linear(x.bfloat16(), w.bfloat16(), bias.bfloat16())),
        ("bf16 autocast linear backward", autocast_backward),
        ("bmm fp32", lambda: torch.bmm(x[None].expand(4, -1, -1), x[None].expand(4, -1, -1))),
        ("sdpa bf16", lambda: F.scaled_dot_product_attention(*qkv(torch.bfloat16), is_causal=True)),
        ("sdpa fp32", lambda: F.scaled_dot_product_attention(*qkv(torch.float32), is_causal=True)),
    ]
    total = 0
    for name, fn in steps:
        kept = _kept(d, fn)
        total += kept
        print(f"{name:34s} kept {kept / 2**20:8.3f} MiB  (total {total / 2**20:.3f})")
    grads = sum(t.grad.numel() * t.grad.element_size() for t in (w, bias) if t.grad is not None)
    print(f"kept in all, less the two gradients: {(total - grads) / 2**20:.3f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
