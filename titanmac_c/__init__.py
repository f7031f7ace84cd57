"""titanmac_c: the inside of a PyTorch optimizer step (norm statistics, global-norm clipping, AdamW)
as a few fused passes in a C extension, with drop-ins for the torch API.

    from titanmac_c import AdamW, DeepNestedOptimizer, clip_grad_norm_, get_total_norm

The compiled extension is required: there is no pure-Python fallback, so a broken build fails at
import instead of silently running slow (or different) code.
"""

import re as _re

# torch first: its OpenMP runtime (libgomp, loaded for the whole process) is then the one the
# extension's OpenMP calls bind to, so that one thread pool serves both (docs/architecture.md)
import torch as _torch

# pyproject requires torch >= 2.10, which pip cannot enforce on a torch installed otherwise (conda,
# --no-deps): older ones lack APIs the package uses and would fail in the middle of a step
_TORCH_RELEASE = tuple(map(int, _re.match(r"(\d+)\.(\d+)", _torch.__version__).groups()))
if _TORCH_RELEASE < (2, 10):
    raise ImportError(f"titanmac_c needs torch >= 2.10; this is torch {_torch.__version__}")

try:
    from . import _C
except ImportError as exc:  # pragma: no cover - only reached with a broken install
    raise ImportError(
        "titanmac_c: the compiled extension titanmac_c._C could not be loaded "
        f"({exc}). Build it with `pip install .` from the source tree (a C compiler is needed; "
        "set TITANMAC_WITH_CUDA=1 to require the CUDA backend). Importing titanmac_c from the "
        "source directory without building picks up the sources instead of the installed package."
    ) from exc

from .deep_nested import DeepNestedOptimizer
from .functional import clip_grad_norm_, get_total_norm, group_norms
from .optim import AdamW

Error = _C.Error

__version__ = "0.3.0"


def cuda_available() -> bool:
    """True when this build has the CUDA backend and torch sees a GPU. Makes no CUDA call itself."""
    return _C.cuda_compiled() and _torch.cuda.is_available()


def cpu_isa() -> str:
    """The CPU instruction set whose loops are in use: "generic", "avx2" or "avx512"."""
    return _C.cpu_isa()


__all__ = [
    "AdamW",
    "DeepNestedOptimizer",
    "Error",
    "clip_grad_norm_",
    "cpu_isa",
    "cuda_available",
    "get_total_norm",
    "group_norms",
]
