"""Error metrics of the experiments.

``rel_err(y_hat, y, dims)`` is the relative error in the 2-norm over ``dims``, one number per
index of the remaining (leading) dims:

    rel_err = ||y_hat - y||_2 / ||y||_2          norms over ``dims``

The default ``dims=(-2, -1)`` takes the simulator's output ``[batch, nheads, dv]`` to one number
per batch row (per seed, in the experiments): the error of the whole layer output of that
sequence at that step. It is computed in FP64 whatever the inputs' dtype. Where ``||y|| = 0``
the result is 0 if ``y_hat`` equals ``y`` there and ``inf`` otherwise.
"""

import torch

from lowprec._checks import check_float

__all__ = ["rel_err"]


def rel_err(y_hat: torch.Tensor, y: torch.Tensor, dims=(-2, -1)) -> torch.Tensor:
    """Relative 2-norm error of ``y_hat`` against ``y`` over ``dims`` (see module docstring)."""
    check_float("y_hat", y_hat)
    check_float("y", y)
    if y_hat.shape != y.shape:
        raise ValueError(f"y_hat: expected the shape of y {list(y.shape)}, got {list(y_hat.shape)}")
    dims = (dims,) if isinstance(dims, int) else tuple(dims)
    ndim = y.dim()
    if not dims or any(isinstance(d, bool) or not isinstance(d, int) or not -ndim <= d < ndim
                       for d in dims):
        raise ValueError(f"dims: expected non-empty dims of a {ndim}-d tensor, got {dims}")
    if len({d % ndim for d in dims}) != len(dims):
        raise ValueError(f"dims: expected distinct dims of a {ndim}-d tensor, got {dims}")
    y = y.to(torch.float64)
    diff = torch.linalg.vector_norm(y_hat.to(torch.float64) - y, dim=dims)
    ref = torch.linalg.vector_norm(y, dim=dims)
    safe = torch.where(ref > 0, ref, torch.ones_like(ref))
    # 0 only where y_hat equals y exactly: a NaN output (diff NaN) is not an exact one
    zero_ref = torch.where(diff == 0, torch.zeros_like(diff), torch.full_like(diff, float("inf")))
    return torch.where(ref > 0, diff / safe, zero_ref)
