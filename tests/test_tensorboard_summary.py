"""The scalars' ``Summary`` encoded by hand (``logging/tensorboard.py``) is protobuf's own."""

from __future__ import annotations

import random
import struct

import numpy as np
from tensorboard.compat.proto.summary_pb2 import Summary

from lightning_hooks.internals.tensorboard import scalar_summary


def _protobufs(metrics: dict[str, float]) -> bytes:
    values = [Summary.Value(tag=t, simple_value=float(v)) for t, v in metrics.items()]
    return Summary(value=values).SerializeToString()  # type: ignore[no-any-return]


def test_random_tags_and_values_encode_as_protobuf_does() -> None:
    rng = random.Random(0)
    specials = [0.0, -0.0, 1e-45, -3.4e38, 3.5e38, -1e300, float("inf"), -float("inf"), 1, True]
    for _ in range(50):
        metrics: dict[str, float] = {}
        for _ in range(rng.randrange(0, 40)):
            length = rng.choice([1, 5, 60, 127, 128, 200, 20_000])  # 1-, 2- and 3-byte lengths
            tag = "".join(rng.choice("ab/_.0é😀") for _ in range(length))
            metrics[tag] = rng.choice([rng.gauss(0, 1e3), rng.choice(specials)])
        assert scalar_summary(metrics).SerializeToString() == _protobufs(metrics)


def test_values_are_float32_and_nan_stays_nan() -> None:
    summary = scalar_summary({"a": 0.1, "b": float("nan"), "c": np.float64(2.5), "d": 7})
    got = [(v.tag, v.simple_value) for v in summary.value]
    assert got[0] == ("a", struct.unpack("<f", struct.pack("<f", 0.1))[0])
    assert got[1][0] == "b" and got[1][1] != got[1][1]
    assert got[2:] == [("c", 2.5), ("d", 7.0)]
