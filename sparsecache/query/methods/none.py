"""`none`: the chunks' decoded K/V as they are, only the question prefilled after them."""

from . import register
from .base import Decoded


class NoRecompute(Decoded):
    name = "none"
    summary = "decoded KV as is, only the question prefilled"


register(NoRecompute())
