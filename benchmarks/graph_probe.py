"""Would a CUDA graph make the every-step gradient check's device part cheaper?

On a quiet step the every-step check's device work is the norm pass: ``torch._foreach_norm`` over
the gradients, its ``stack``, and one non-blocking copy of the norms into pinned host memory
(``HostCopy.post``), then an event. Could it run as one CUDA graph? A graph reads
fixed addresses, so it also needs the gradients where they were when it was captured: under
Lightning's default ``zero_grad(set_to_none=True)`` each backward allocates them anew.

For each model this measures, on the model's own gradients:

- the host time of one call, eager and as a graph replay (median of 20 batches of 50 calls,
  the device synchronized between batches and outside the timing), the replay with the
  address check a graph would need each step (``data_ptr`` of every gradient), and the
  pointer-table kernels of ``AlarmRules(quiet_read="triton")`` (``PointerNorms``, its norms
  checked against eager's) with their copy to the host, and the default grouped read
  (``GroupedNorms``: small gradients of one shape stacked, the rest by ``_foreach_norm``);
- the device time of one call each way (CUDA events over 200 calls);
- how many of 30 real steps (SGD, ``zero_grad()`` at its default) left every gradient at the
  address of the step before, as a graph would need.

Needs CUDA; run from the repository root on the lent machine::

    PYTHONPATH=$PWD python3 benchmarks/graph_probe.py --models launch transformer resnet50 gpt2
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).parent), str(Path(__file__).parents[1] / "tests")]

import overhead  # noqa: E402

from lightning_hooks.core.ops.grouped_norms import GroupedNorms  # noqa: E402
from lightning_hooks.core.ops.pointer_norms import PointerNorms  # noqa: E402


def _host_us(call: Callable[[], object], batches: int = 20, per: int = 50) -> float:
    """Median host time of one ``call`` (us), the device drained between batches."""
    times = []
    for _ in range(batches):
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(per):
            call()
        times.append((time.perf_counter() - started) / per)
    torch.cuda.synchronize()
    return statistics.median(times) * 1e6


def _device_us(call: Callable[[], object], calls: int = 200) -> float:
    """Device time of one ``call`` (us), from two CUDA events around ``calls`` calls."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / calls


def _stable_steps(name: str, steps: int = 30) -> int:
    """Of ``steps`` real steps, how many left every gradient at the previous step's address."""
    model = overhead.make_model(name, 1).cuda()
    x, y = (t[: model.batch].cuda() for t in model.data.tensors)
    optimizer = model.configure_optimizers()
    before: list[int] = []
    stable = 0
    for _ in range(steps + 1):
        optimizer.zero_grad()  # set_to_none=True, as Lightning's default
        with torch.autocast("cuda", torch.bfloat16, enabled=name in overhead.LARGE):
            loss = model.training_step((x, y), 0)
        loss.backward()
        ptrs = [p.grad.data_ptr() for p in model.parameters() if p.grad is not None]
        stable += bool(before) and ptrs == before
        before = ptrs
        optimizer.step()
    return stable


def probe(name: str) -> dict[str, float]:
    """The measures above for one of ``overhead.py``'s models."""
    torch.manual_seed(0)
    net = overhead.make_model(name, 1).net.cuda()
    grads = [torch.randn_like(p) for p in net.parameters()]
    host = torch.zeros(len(grads), pin_memory=True)
    event = torch.cuda.Event()  # type: ignore[no-untyped-call]

    def eager() -> None:
        host.copy_(torch.stack(torch._foreach_norm(grads)), non_blocking=True)
        event.record()

    side = torch.cuda.Stream()  # type: ignore[no-untyped-call]
    side.wait_stream(torch.cuda.current_stream())  # type: ignore[no-untyped-call]
    with torch.cuda.stream(side):  # type: ignore[no-untyped-call]
        for _ in range(3):
            eager()
    torch.cuda.current_stream().wait_stream(side)  # type: ignore[no-untyped-call]
    graph = torch.cuda.CUDAGraph()  # type: ignore[no-untyped-call]
    with torch.cuda.graph(graph):  # type: ignore[no-untyped-call]
        host.copy_(torch.stack(torch._foreach_norm(grads)), non_blocking=True)
    captured = [g.data_ptr() for g in grads]

    def replay() -> None:
        graph.replay()  # type: ignore[no-untyped-call]
        event.record()

    def checked() -> None:
        if [g.data_ptr() for g in grads] == captured:
            replay()

    pointers = PointerNorms(list(net.parameters()))

    def table() -> None:
        host.copy_(pointers(grads), non_blocking=True)  # type: ignore[arg-type]
        event.record()

    grouped_read = GroupedNorms(list(net.parameters()))

    def grouped() -> None:
        host.copy_(grouped_read(grads), non_blocking=True)
        event.record()

    eager()
    torch.cuda.synchronize()
    want = host.clone()
    grouped()
    torch.cuda.synchronize()
    torch.testing.assert_close(host, want, rtol=1e-5, atol=0)
    replay()
    torch.cuda.synchronize()
    assert torch.equal(host, want), "the graph's norms differ from eager's"
    table()
    torch.cuda.synchronize()
    torch.testing.assert_close(host, want, rtol=1e-5, atol=0)
    return {
        "tensors": len(grads),
        "eager_host_us": _host_us(eager),
        "graph_host_us": _host_us(replay),
        "checked_host_us": _host_us(checked),
        "table_host_us": _host_us(table),
        "grouped_host_us": _host_us(grouped),
        "groups": len(grouped_read.groups),
        "eager_device_us": _device_us(eager),
        "graph_device_us": _device_us(replay),
        "table_device_us": _device_us(table),
        "grouped_device_us": _device_us(grouped),
        "stable_steps": _stable_steps(name),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--models", nargs="+", default=["launch"], choices=[*overhead.MODELS, *overhead.LARGE]
    )
    args = parser.parse_args(argv)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}")
    print(
        "| model | gradients | host: eager | host: graph | host: graph + address check "
        "| host: pointer table | host: grouped (stacks) | device: eager | device: graph "
        "| device: pointer table | device: grouped | steps with every gradient where it was |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for name in args.models:
        r = probe(name)
        print(
            f"| {name} | {r['tensors']:.0f} | {r['eager_host_us']:.1f} us "
            f"| {r['graph_host_us']:.1f} us | {r['checked_host_us']:.1f} us "
            f"| {r['table_host_us']:.1f} us "
            f"| {r['grouped_host_us']:.1f} us ({r['groups']:.0f}) "
            f"| {r['eager_device_us']:.1f} us | {r['graph_device_us']:.1f} us "
            f"| {r['table_device_us']:.1f} us | {r['grouped_device_us']:.1f} us "
            f"| {r['stable_steps']:.0f} of 30 |"
        )


if __name__ == "__main__":
    main()
