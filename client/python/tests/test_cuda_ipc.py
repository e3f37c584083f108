"""CUDA tensors through the torch layer: by IPC with a CUDA daemon on this
node, inline otherwise. Needs a GPU (skipped without one)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from mhc_client import Client, eager
from mhc_client.shm import cuda_ipc_handle
from mhc_client.torch import MhcLayer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def test_ipc_handle_accounts_for_offsets():
    base = torch.zeros(1024, device="cuda")
    view = base[100:200]
    whole, part = cuda_ipc_handle(base), cuda_ipc_handle(view)
    assert whole.handle == part.handle and len(part.handle) == 64
    assert part.offset - whole.offset == 100 * 4
    assert part.region_bytes >= part.offset + 100 * 4


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_on_cuda_tensors(client: Client, dtype):
    torch.manual_seed(0)
    sub = nn.Linear(16, 16).to(device="cuda", dtype=dtype)
    # IEEE projection so fp32 holds its 1e-4 bound on a CUDA daemon too.
    layer = MhcLayer(client, 16, n=4, sublayer=sub, seed=1,
                     matmul_precision="ieee").cuda()
    try:
        x = torch.randn(6, 4, 16, device="cuda", dtype=dtype, requires_grad=True)
        out = layer(x.to(dtype))
        assert out.device.type == "cuda" and out.dtype == dtype
        out.float().square().sum().backward()
        params = {k: getattr(layer, k).detach().double().cpu().requires_grad_()
                  for k in layer.param_names}
        sub64 = nn.Linear(16, 16).double()
        sub64.load_state_dict({k: v.double().cpu() for k, v in sub.state_dict().items()})
        x64 = x.detach().double().cpu().requires_grad_()
        ref = eager.layer(x64, params, layer.spec, sub64)
        ref.square().sum().backward()
        tol = 1e-4 if dtype == torch.float32 else 5e-2
        def rel(a: torch.Tensor, b: torch.Tensor) -> float:
            a = a.detach().double().cpu()
            return float((a - b.detach()).abs().max() / b.detach().abs().max())

        assert rel(out, ref) <= tol
        assert rel(x.grad, x64.grad) <= tol
        assert rel(layer.phi.grad, params["phi"].grad) <= max(tol, 1e-3)
        uses_ipc = client.is_local and client.server_info().has_cuda
        assert (client.session is not None) == uses_ipc
    finally:
        layer.close()
