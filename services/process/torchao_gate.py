"""torchao only where kernels.precision = "fp8" needs it.

transformers imports torchao whenever it is installed (its quantizers, on the first model load),
and torchao's import prints "Failed to load ...torchao/_C_mxfp8...so" and torch `_pytree`
warnings: every eval, regenerate, export and target would print them for a package they never
use. hide() marks torchao absent for this process (None in sys.modules: transformers' check finds
no spec, an import raises ImportError); the FP8 drafter imports it through quiet_import().
"""

from __future__ import annotations

import contextlib
import logging
import sys


def hide() -> None:
    """Keep torchao out of this process (before transformers loads a model); no-op if already imported."""
    sys.modules.setdefault("torchao", None)


@contextlib.contextmanager
def quiet_import():
    """Around `import torchao...` (FP8 training): allowed again here, its load warnings kept to errors
    (the kernels it fails to load are not the ones the tensorwise recipe uses)."""
    if sys.modules.get("torchao", False) is None:
        del sys.modules["torchao"]
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
