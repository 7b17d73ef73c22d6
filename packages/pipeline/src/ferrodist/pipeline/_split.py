"""``split_sequential``: cut a ``Sequential`` into consecutive stages."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from ferrodist.core import InvalidArgument

__all__ = ["split_sequential"]


def split_sequential(
    model: Any, n_stages: int, *, by: str = "parameters", cuts: Sequence[int] | None = None
) -> list[Any]:
    """Cut ``model`` (a ``ferrodist.nn.Sequential`` or a ``torch.nn.Sequential``) into
    ``n_stages`` consecutive ``Sequential``s that share its layers (no copies).

    Args:
        by: "parameters" (balance the parameter counts: each cut goes where the running
            count is nearest to an equal share) or "layers" (equal numbers of layers).
        cuts: the indices where stages 1.. start (``n_stages - 1`` increasing indices);
            overrides ``by``.

    Raises:
        InvalidArgument: fewer layers than stages, bad cut points, or an unknown ``by``.
    """
    layers = list(model)
    n = len(layers)
    if isinstance(n_stages, bool) or not isinstance(n_stages, int) or not 1 <= n_stages <= n:
        raise InvalidArgument(
            f"split_sequential: n_stages must be in 1..{n} (the model has {n} layers), not {n_stages!r}"
        )
    if cuts is not None:
        cuts = list(cuts)
        if len(cuts) != n_stages - 1 or any(not 0 < c < n for c in cuts) or cuts != sorted(set(cuts)):
            raise InvalidArgument(
                f"split_sequential: cuts must be {n_stages - 1} increasing indices in 1..{n - 1}, not {cuts}"
            )
    elif by == "layers":
        cuts = [round(k * n / n_stages) for k in range(1, n_stages)]
    elif by == "parameters":
        cuts = _balanced(layers, n_stages)
    else:
        raise InvalidArgument(f"split_sequential: by must be 'parameters' or 'layers', not {by!r}")
    bounds = [0, *cuts, n]
    make = _maker(model)
    return [make(layers[bounds[k] : bounds[k + 1]]) for k in range(n_stages)]


def _size(layer: Any) -> int:
    """Parameter count: torch tensors have numel(), the kit's Parameters a numpy .data."""
    return sum(int(p.numel()) if hasattr(p, "numel") else int(p.data.size) for p in layer.parameters())


def _balanced(layers: list[Any], n_stages: int) -> list[int]:
    """Cut points that balance parameter counts; every stage keeps at least one layer."""
    sizes = [_size(layer) for layer in layers]
    total, n = sum(sizes), len(layers)
    cuts: list[int] = []
    running = 0
    for i, size in enumerate(sizes[:-1]):
        running += size
        k = len(cuts) + 1  # the cut being placed starts stage k
        if k >= n_stages:
            break
        target = total * k / n_stages
        later = sizes[i + 1] if i + 1 < n else 0
        room = n - (i + 1)  # layers left for stages k..n_stages-1
        if room == n_stages - k or abs(running - target) <= abs(running + later - target):
            cuts.append(i + 1)
    while len(cuts) < n_stages - 1:  # parameter-free tails: fill the last stages one layer each
        cuts.append(cuts[-1] + 1 if cuts else 1)
    return cuts


def _maker(model: Any) -> Any:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return lambda layers: torch.nn.Sequential(*layers)
    return lambda layers: type(model)(*layers)
