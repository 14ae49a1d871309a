"""`a3`: recompute the tokens the question attends to most at an early layer (A³, Eq. 3)."""

from . import register
from .base import AttentionScorer


class A3(AttentionScorer):
    name = "a3"
    summary = "recompute the --recompute-ratio tokens the question attends to most at layer 1 (A3)"


register(A3())
