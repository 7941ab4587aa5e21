"""What torch's math libraries keep on a GPU after a step's first products (their workspaces),
which the simulator counts per device (``Device.workspace_bytes``). Needs a CUDA device:

    python -m benchmarks.gpu_workspace
"""
import os
import torch

d = torch.device("cuda")
print("env CUBLAS_WORKSPACE_CONFIG", os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
      "TORCH_CUBLASLT_WORKSPACE_SIZE", os.environ.get("TORCH_CUBLASLT_WORKSPACE_SIZE"))


def alloc():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


x = torch.randn(256, 256, device=d)
w = torch.randn(256, 256, device=d, requires_grad=True)
bias = torch.randn(256, device=d, requires_grad=True)
base = alloc()
steps = [
    ("fp32 mm", lambda: x @ x),
    ("fp32 addmm (linear+bias)", lambda: torch.nn.functional.linear(x, w, bias)),
    ("fp32 linear backward", lambda: torch.nn.functional.linear(x, w, bias).sum().backward()),
    ("bf16 mm", lambda: x.bfloat16() @ x.bfloat16()),
    ("bf16 linear+bias", lambda: torch.nn.functional.linear(x.bfloat16(), w.bfloat16(), bias.bfloat16())),
    ("bf16 autocast linear backward", lambda: _ac()),
    ("bmm fp32", lambda: torch.bmm(x[None].expand(4, -1, -1), x[None].expand(4, -1, -1))),
    ("sdpa bf16", lambda: torch.nn.functional.scaled_dot_product_attention(*(torch.randn(4, 4, 128, 64, device=d, dtype=torch.bfloat16),) * 3, is_causal=True)),
    ("sdpa fp32", lambda: torch.nn.functional.scaled_dot_product_attention(*(torch.randn(4, 4, 128, 64, device=d),) * 3, is_causal=True)),
]


def _ac():
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y = torch.nn.functional.linear(x, w, bias)
    y.float().sum().backward()


for name, f in steps:
    before = alloc()
    out = f()
    del out
    after = alloc()
    print(f"{name:34s} kept {(after - before) / 2**20:8.3f} MiB  (total over base {(after - base) / 2**20:.3f})")
w.grad = None
bias.grad = None
print("final over base MiB", (alloc() - base) / 2**20, "max", torch.cuda.max_memory_allocated() / 2**20)
