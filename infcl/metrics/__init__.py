"""Evaluation metrics computed on the tiles: :func:`retrieval_metrics` (R@k, mean and median rank)."""

from .retrieval import retrieval_metrics

__all__ = ["retrieval_metrics"]
