"""Step cost against bare training, with every configuration's fit running in turns.

``overhead.py`` runs one fit after another and divides each configuration's step by bare's in
the same round. Where the host is shared, its speed changes between fits a few seconds apart:
on the launch-bound stand-in, on a shared 2-core host, the rounds ranged 0.59x-2.3x, and the
p10 step of bare alone 4.9-9.5 ms from one fit to the next.
No ratio of such fits can test a 1.15x target.

Here every configuration trains at the same time, in its own process, and the processes take
turns: a baton (one semaphore per process, passed around a ring at ``on_train_batch_start``) lets
one process run ``--turn`` steps while the others block. Each step's *process CPU time* is
recorded; blocking costs none. So every configuration's steps run within ``N x turn`` steps of
every other's, under the same speed of the host, and their ratio holds where the fits' does not.

What a turn changes: its first step runs after another process's steps, with colder caches
than any step of a fit alone, and how cold depends on which process ran before (in one ring of
seven, six callbacks that do nothing read 0.96x bare, in a ring of five 1.05x). So the first step of
each turn is dropped: what is kept followed a step of its own process, as in a fit alone, and
who follows whom is drawn anew each round. A process's own steps, hooks and the logging step
(one in ``log_every_n_steps``, 50, the last of its turn at the default ``--turn 5``) are
measured; the fit's set-up and epoch end are not.

Usage (the launch-bound stand-in, one thread per process, 3 rounds of 300 timed steps)::

    PYTHONPATH=$PWD .venv/bin/python benchmarks/paired.py
    PYTHONPATH=$PWD .venv/bin/python benchmarks/paired.py --only =GradFlowCallback floor --save
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import pytorch_lightning as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
# A process of the ring spawned for another checkout (``--compare``) imports lightning_hooks
# from there: a spawned process gets its parent's sys.path, which PYTHONPATH cannot change.
if os.environ.get(_CHECKOUT := "PAIRED_CHECKOUT"):
    sys.path.insert(0, os.environ[_CHECKOUT])

import overhead

import lightning_hooks

DEFAULT = ["=GradFlowCallback", "=all, defaults", "floor: one gradient read"]


class Baton(pl.Callback):
    """First in the list: waits for this process's turn before every ``turn``-th step, passes the
    turn on after it, and records the process CPU time at each step start."""

    def __init__(self, mine: Any, after: Any, turn: int) -> None:
        self.mine, self.after, self.turn = mine, after, turn
        self.cpu: list[float] = []
        self._steps = 0

    def on_train_batch_start(self, *args: Any) -> None:
        if self._steps % self.turn == 0:
            if self._steps:
                self.after.release()
            self.mine.acquire()
        self._steps += 1
        self.cpu.append(time.process_time())

    def on_train_end(self, *args: Any) -> None:
        self.after.release()  # the ring's next process runs its last turn


def _worker(
    label: str, model: str, steps: int, turn: int, every: int, mine: Any, after: Any, out: Any
) -> None:
    torch.set_num_threads(1)
    pl.seed_everything(0, verbose=False)
    name = label.split(" @ ", maxsplit=1)[0]  # "name @ tag": the same one, another checkout
    config = next(c for c in overhead.configs() if c.name == name)
    baton = Baton(mine, after, turn)
    try:
        overhead.fit(model, [baton, *config.make()], steps + 1, log_every_n_steps=every)
    except BaseException as error:  # the parent ends the ring
        out.put((label, f"{type(error).__name__}: {error}"))
        raise
    source = str(Path(lightning_hooks.__file__).parents[1])
    out.put((label, ([b - a for a, b in zip(baton.cpu, baton.cpu[1:], strict=False)], source)))


def _next_result(out: Any, procs: list[Any]) -> tuple[str, Any]:
    """The next process's result; a process that died without one (killed, out of memory) ends
    the round instead of leaving the ring waiting for ever."""
    while True:
        try:
            got: tuple[str, Any] = out.get(timeout=5)
        except queue.Empty:
            dead = [p for p in procs if p.exitcode not in (None, 0)]
            if dead:
                for proc in procs:
                    proc.terminate()
                died = f"paired.py: a fit's process died (exit {dead[0].exitcode})"
                raise RuntimeError(died) from None
            continue
        return got


def paired_round(
    names: list[str],
    model: str,
    steps: int,
    turn: int,
    checkouts: dict[str, str],
    every: int = 50,
) -> dict[str, list[float]]:
    """One fit per configuration, all in turns; each one's CPU time per step. A label
    ``"name @ tag"`` imports ``lightning_hooks`` from ``checkouts[tag]``."""
    ctx = mp.get_context("spawn")
    batons = [ctx.Semaphore(1 if i == 0 else 0) for i in range(len(names))]
    out = ctx.Queue()
    procs = [
        ctx.Process(
            target=_worker,
            args=(name, model, steps, turn, every, batons[i], batons[(i + 1) % len(names)], out),
        )
        for i, name in enumerate(names)
    ]
    try:
        for name, proc in zip(names, procs, strict=True):
            tag = name.split(" @ ")[1] if " @ " in name else None
            os.environ[_CHECKOUT] = checkouts.get(tag, "")  # read by the spawned process
            proc.start()
    finally:
        os.environ.pop(_CHECKOUT, None)
    steps_of: dict[str, list[float]] = {}
    for _ in procs:
        name, got = _next_result(out, procs)
        if isinstance(got, str):  # a fit failed: the ring cannot go round without it
            for proc in procs:
                proc.terminate()
            raise RuntimeError(f"paired.py: the fit of {name!r} failed: {got}")
        steps, source = got
        tag = name.split(" @ ")[1] if " @ " in name else None
        want = checkouts.get(tag) or str(Path(__file__).resolve().parents[1])
        if tag is not None and source != want:  # never time one checkout under another's name
            raise RuntimeError(f"paired.py: {name!r} imported lightning_hooks from {source}")
        steps_of[name] = steps
    for proc in procs:
        proc.join()
    return steps_of


def own_steps(steps: list[float], warmup: int, turn: int) -> list[float]:
    """The steps after ``warmup`` that followed a step of the same process: the first of each
    turn ran after another process's steps, with its caches cold, which a fit alone never
    sees (a logging step, one in 50, ends a turn of 5 and stays in)."""
    return [s for i, s in enumerate(steps) if i >= warmup and i % turn]


def summarize(rounds: list[dict[str, list[float]]], warmup: int, turn: int) -> dict[str, Any]:
    """Per configuration: the mean step (logging steps in it) and the median (quiet) step of
    :func:`own_steps`, against bare's in the same round; the median, min and max over the
    rounds."""
    rows: dict[str, Any] = {}
    for name in rounds[0]:
        means, medians, ms = [], [], []
        for r in rounds:
            mine, bare = own_steps(r[name], warmup, turn), own_steps(r["bare"], warmup, turn)
            means.append(statistics.fmean(mine) / statistics.fmean(bare))
            medians.append(statistics.median(mine) / statistics.median(bare))
            ms.append(statistics.fmean(mine) * 1e3)
        rows[name] = {
            "step_ms": statistics.median(ms),
            "mean": {"median": statistics.median(means), "min": min(means), "max": max(means)},
            "quiet": {
                "median": statistics.median(medians),
                "min": min(medians),
                "max": max(medians),
            },
            "rounds": {"mean": means, "quiet": medians},
        }
    return rows


def markdown(rows: dict[str, Any], env: dict[str, Any]) -> str:
    lines = [
        f"Paired fits in turns (`benchmarks/paired.py`): model {env['model']}, {env['rounds']} "
        f"rounds of {env['steps']} steps ({env['warmup']} dropped), turns of {env['turn']} steps "
        "(the first of each dropped), "
        f"log_every_n_steps {env.get('log_every_n_steps', 50)}, "
        f"torch {env['torch']}, one thread per process, process CPU time per step.",
        "",
        "| configuration | step | mean step / bare (min-max) | quiet step / bare (min-max) |",
        "| --- | --- | --- | --- |",
    ]
    for name, row in rows.items():
        m, q = row["mean"], row["quiet"]
        mean = f"{m['median']:.3f}x ({m['min']:.3f}-{m['max']:.3f})"
        quiet = f"{q['median']:.3f}x ({q['min']:.3f}-{q['max']:.3f})"
        lines.append(f"| {name} | {row['step_ms']:.2f} ms | {mean} | {quiet} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="launch", choices=list(overhead.MODELS))
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--turn", type=int, default=5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--log-every",
        type=int,
        default=50,
        help="the Trainer's log_every_n_steps (1: every step is a logging step, the mean its cost)",
    )
    parser.add_argument("--only", nargs="*", default=DEFAULT, help="as overhead.py's --only")
    parser.add_argument(
        "--compare",
        nargs="*",
        default=[],
        metavar="CHECKOUT",
        help="other checkouts (git worktree add /tmp/old REV): each configuration but bare runs "
        "from each too, in the same ring, as 'name @ old'",
    )
    parser.add_argument("--save", action="store_true")
    parser.add_argument("--out", default=str(overhead.RESULTS / "paired"))
    args = parser.parse_args(argv)
    names = [
        c.name
        for c in overhead.configs()
        if c.name == "bare" or any(overhead._matches(o, c.name) for o in args.only)
    ]
    checkouts = {Path(c).name: str(Path(c).resolve()) for c in args.compare}
    names += [f"{n} @ {tag}" for tag in checkouts for n in names if n != "bare"]
    rounds = []
    for r in range(args.rounds):
        order = random.Random(r).sample(names, len(names))  # who follows whom: new each round
        rounds.append(
            paired_round(order, args.model, args.steps, args.turn, checkouts, args.log_every)
        )
    rows = summarize(rounds, args.warmup, args.turn)
    rows = {name: rows[name] for name in names}  # in the order asked, not the rings'
    env = {
        "model": args.model,
        "rounds": args.rounds,
        "steps": args.steps,
        "warmup": args.warmup,
        "turn": args.turn,
        "log_every_n_steps": args.log_every,
        "torch": torch.__version__,
        "lightning": pl.__version__,
        "compare": checkouts,
        "command": " ".join(["python", "benchmarks/paired.py", *sys.argv[1:]]),
    }
    text = markdown(rows, env)
    print(text)
    if args.save:
        out = Path(args.out)
        out.with_suffix(".json").write_text(json.dumps({"env": env, "rows": rows}, indent=2) + "\n")
        out.with_suffix(".md").write_text(text)


if __name__ == "__main__":
    main()
