#!/usr/bin/env python3
"""Trains a tiny model with mHC residuals through mhcd, next to an eager twin.

The model: a linear embedding expanded into n residual streams, a few
blocks whose residual connections are mHC layers (pre and post run in the
daemon; each block's FFN runs here), the streams averaged, and a linear
readout, trained for 50 steps of Adam on a synthetic regression task. The
same model built from mhc_client.eager (plain PyTorch, same initial
weights, same data) trains alongside, and the two loss curves must agree.

    python3 train_tiny.py --address unix:/run/mhcd.sock [--device cuda]

Prints one line per 10 steps and exits non-zero if the loss did not fall
or the curves diverged beyond --tolerance.
"""

from __future__ import annotations

import argparse
import sys
from typing import Dict, List, Tuple

import torch
from torch import nn

from mhc_client import Client, eager
from mhc_client.torch import MhcLayer


def ffn(hidden: int) -> nn.Module:
    return nn.Sequential(nn.Linear(hidden, 2 * hidden), nn.Tanh(),
                         nn.Linear(2 * hidden, hidden))


class DaemonModel(nn.Module):
    """Blocks whose mHC pre/post run in the daemon."""

    def __init__(self, client: Client, inputs: int, hidden: int, n: int,
                 blocks: int, seed: int) -> None:
        super().__init__()
        self.n = n
        self.embed = nn.Linear(inputs, hidden)
        self.blocks = nn.ModuleList(
            MhcLayer(client, hidden, n=n, sublayer=ffn(hidden), seed=seed + i,
                     matmul_precision="ieee")
            for i in range(blocks))
        self.readout = nn.Linear(hidden, 1)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        e = self.embed(inputs)
        x = e[:, None, :].expand(-1, self.n, -1).contiguous()
        for block in self.blocks:
            x = block(x)
        return self.readout(x.mean(dim=1))

    def close(self) -> None:
        for block in self.blocks:
            block.close()


class EagerModel(nn.Module):
    """The same model in plain PyTorch (mhc_client.eager)."""

    def __init__(self, twin: DaemonModel) -> None:
        super().__init__()
        self.n = twin.n
        self.embed = _copy(twin.embed)
        self.readout = _copy(twin.readout)
        self.specs = [b.spec for b in twin.blocks]
        self.ffns = nn.ModuleList(_copy(b.sublayer) for b in twin.blocks)
        self.mhc = nn.ModuleList(
            nn.ParameterDict({k: nn.Parameter(getattr(b, k).detach().clone())
                              for k in b.param_names})
            for b in twin.blocks)

    def forward(self, inputs: torch.Tensor) -> torch.Tensor:
        e = self.embed(inputs)
        x = e[:, None, :].expand(-1, self.n, -1)
        for spec, params, f in zip(self.specs, self.mhc, self.ffns):
            x = eager.layer(x, dict(params), spec, f)
        return self.readout(x.mean(dim=1))


def _copy(module: nn.Module) -> nn.Module:
    import copy
    return copy.deepcopy(module)


def synthetic_data(inputs: int, samples: int, seed: int
                   ) -> Tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(samples, inputs, generator=g)
    w = torch.randn(inputs, 1, generator=g)
    y = torch.tanh(0.5 * (x @ w))
    return x, y


def train(client: Client, steps: int = 50, device: str = "cpu",
          inputs: int = 8, hidden: int = 32, n: int = 4, blocks: int = 3,
          batch: int = 64, lr: float = 1e-2, seed: int = 0
          ) -> Dict[str, List[float]]:
    """Trains both models on the same batches; returns both loss curves."""
    torch.manual_seed(seed)
    model = DaemonModel(client, inputs, hidden, n, blocks, seed)
    try:
        twin = EagerModel(model)
        model.to(device)
        twin.to(device)
        data, target = synthetic_data(inputs, 1024, seed)
        data, target = data.to(device), target.to(device)
        opts = [torch.optim.Adam(m.parameters(), lr=lr) for m in (model, twin)]
        curves: Dict[str, List[float]] = {"mhcd": [], "eager": []}
        g = torch.Generator().manual_seed(seed + 1)
        for _ in range(steps):
            idx = torch.randint(0, data.shape[0], (batch,), generator=g).to(device)
            for key, m, opt in zip(("mhcd", "eager"), (model, twin), opts):
                opt.zero_grad()
                loss = nn.functional.mse_loss(m(data[idx]), target[idx])
                loss.backward()
                opt.step()
                curves[key].append(loss.item())
        return curves
    finally:
        model.close()


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--address", required=True, help="mhcd address")
    parser.add_argument("--device", default="cpu", help="torch device")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--tolerance", type=float, default=1e-3,
                        help="largest relative loss difference per step")
    args = parser.parse_args(argv)
    with Client(args.address) as client:
        curves = train(client, steps=args.steps, device=args.device)
    worst = 0.0
    for step, (a, b) in enumerate(zip(curves["mhcd"], curves["eager"])):
        worst = max(worst, abs(a - b) / max(abs(b), 1e-12))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss mhcd {a:.6f}  eager {b:.6f}")
    first = sum(curves["mhcd"][:5]) / 5
    last = sum(curves["mhcd"][-10:]) / 10
    print(f"loss (first 5 / last 10 steps) {first:.4f} -> {last:.4f}; "
          f"largest relative gap to eager "
          f"{worst:.2e}")
    ok = last < 0.5 * first and worst <= args.tolerance
    print("train_tiny: OK" if ok else "train_tiny: FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
