"""pytest's settings for the whole checkout: ``--doctest-modules`` imports every module of the
package, and the Triton kernels of ``AlarmRules(quiet_read="triton")`` need Triton, which
PyTorch's CPU wheels do not ship."""

import importlib.util

collect_ignore = (
    [] if importlib.util.find_spec("triton") else ["lightning_hooks/core/ops/_pointer_kernels.py"]
)
