"""Per-layer K/V tensors ⇄ coding signals (L consecutive layers of one token concatenated)."""

from __future__ import annotations

import torch

from ..errors import ConfigError


def check_grouping(n_layers: int, layers_per_signal: int) -> None:
    if layers_per_signal < 1 or n_layers % layers_per_signal:
        raise ConfigError(
            f"--layers-per-signal {layers_per_signal} must divide the model's {n_layers} layers"
        )


def to_signals(kv: torch.Tensor, layers_per_signal: int) -> torch.Tensor:
    """[n_layers, T, m] → [n_layers / L, T, L·m]: one signal per token and layer group."""
    n_layers, T, m = kv.shape
    check_grouping(n_layers, layers_per_signal)
    g = kv.view(n_layers // layers_per_signal, layers_per_signal, T, m)  # (G, L, T, m)
    return g.permute(0, 2, 1, 3).reshape(-1, T, layers_per_signal * m)  # (G, T, L·m)


def from_signals(signals: torch.Tensor, layers_per_signal: int) -> torch.Tensor:
    """[G, T, L·m] → [G·L, T, m], the inverse of `to_signals`."""
    G, T, Lm = signals.shape
    m = Lm // layers_per_signal
    g = signals.view(G, T, layers_per_signal, m).permute(0, 2, 1, 3)  # (G, L, T, m)
    return g.reshape(G * layers_per_signal, T, m)
