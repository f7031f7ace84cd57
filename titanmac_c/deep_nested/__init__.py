"""titanmac_c.DeepNestedOptimizer, TitanMAC's optimizer with its step run by the C core. The
optimizer (optimizer.py) composes the parts of a step: the statistics and control op
(control.py), CMS mode (cms.py, cms_state.py, surrogate.py), the meta-learning (meta.py), the
CUDA-graph mode (graph.py) and the checkpoints (checkpoint.py), over the networks it shares with
the reference (nets.py)."""

from .optimizer import DeepNestedOptimizer

__all__ = ["DeepNestedOptimizer"]
