"""Seeing inside the Transformer: attention heatmaps, head-pattern metrics, the paper's plots, HTML.

matplotlib is imported only inside the plotting functions (Agg backend), so importing this package
costs nothing.
"""

from aiayn.visualise.metrics import (PatternAccumulator, head_pattern_metrics, label_head,
                                     write_metrics)

__all__ = ["PatternAccumulator", "head_pattern_metrics", "label_head", "write_metrics"]
