"""Print, per per-step callback, a logged value of the uninterrupted fit and of the fit resumed
from its mid-epoch (step 2 of 4) checkpoint; run from the repository root:

    PYTHONPATH=$PWD:$PWD/tests python tests/resume_values.py

The same fits as ``test_every_per_step_callback_resumes_mid_epoch_with_the_same_values``.
"""

from __future__ import annotations

import tempfile
import warnings
from pathlib import Path

from pytorch_lightning.callbacks import ModelCheckpoint
from test_resume import _PER_STEP, _at, _fit_with

SHOWN = {
    "activations/": "activations/mean/net.2",
    "dead_relu/": "dead_relu/zero_fraction/net.3",
    "saturation/": "saturation/saturated_fraction/net.1",
}


def main() -> None:
    warnings.filterwarnings("ignore")
    for prefix, make in _PER_STEP.items():
        root = Path(tempfile.mkdtemp())
        whole = _fit_with(root / "whole", make)
        ckpt = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)
        _fit_with(root / "first", make, callbacks=[ckpt], enable_checkpointing=True)
        path = next((root / "ckpt").glob("*step=2.ckpt"))
        again = ModelCheckpoint(dirpath=root / "ckpt", every_n_train_steps=2, save_top_k=-1)
        resumed = _fit_with(
            root / "second", make, callbacks=[again], enable_checkpointing=True, ckpt_path=path
        )
        if prefix == "layer_time/":
            for name, probe in (("uninterrupted", whole), ("resumed", resumed)):
                r = probe.results[0]
                print(f"layer_time steps/calls {name}: {r.steps} / {r.calls.tolist()}")
            continue
        tag = SHOWN[prefix]
        got, want = _at(root / "second", 4)[tag], _at(root / "whole", 4)[tag]
        print(f"{tag}: uninterrupted {want:.6f}, resumed {got:.6f}")


if __name__ == "__main__":
    main()
