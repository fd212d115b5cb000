"""The core without Lightning: ``GradFlowTracker`` and ``HookRegistry`` in a plain PyTorch loop.

Run: ``python examples/plain_loop.py``. No Trainer, no LightningModule: the core
(``lightning_hooks.core``) itself imports torch and numpy only.
"""

import torch
from torch import nn

from lightning_hooks import GradFlowTracker, HookRegistry


def main() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1)
    )
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    x = torch.randn(512, 16)
    y = x.sum(1, keepdim=True)
    zeros = torch.zeros(2)  # zero ReLU outputs per ReLU, summed on the device
    total = torch.zeros(2)

    def count_zeros(index: int):  # a forward hook that only writes into device tensors
        def hook(module: nn.Module, args: object, output: torch.Tensor) -> None:
            zeros[index] += (output == 0).sum()
            total[index] += output.numel()

        return hook

    with GradFlowTracker(model, [optimizer]) as tracker, HookRegistry(model) as hooks:
        for index, (_, relu) in enumerate(hooks.modules(types=nn.ReLU)):
            hooks.forward_hook(relu, count_zeros(index))
        for epoch in range(3):
            for batch in torch.randperm(512).split(32):
                optimizer.zero_grad()
                nn.functional.mse_loss(model(x[batch]), y[batch]).backward()
                tracker.observe(optimizer)  # just before the step: the gradient it applies
                optimizer.step()
            stats = tracker.result()  # one device-to-host copy per epoch
            tracker.reset()
            norms = ", ".join(
                f"{layer}={norm:.3g}"
                for layer, norm in zip(stats.layers, stats.column("grad_norm"), strict=True)
            )
            ratio = stats.column("update_ratio")[-1]
            zero = (zeros / total).tolist()
            print(f"epoch {epoch}: grad norm {norms}; update ratio {ratio:.2e}; zero ReLU {zero}")
            zeros.zero_()
            total.zero_()
    assert not any(m._forward_hooks for m in model.modules()), "every hook removed on exit"


if __name__ == "__main__":
    main()
