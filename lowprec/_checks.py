"""Input validation shared by the references: every failure is a ``ValueError`` that names the
argument, what was expected and what was given."""

import torch


def check_tensor(name: str, t) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: expected a torch.Tensor, got {type(t).__name__}")


def check_float(name: str, t, dtype: torch.dtype | None = None) -> None:
    """``t`` is a floating-point tensor, of ``dtype`` if given."""
    check_tensor(name, t)
    if not t.dtype.is_floating_point:
        raise ValueError(f"{name}: expected a floating-point dtype, got {t.dtype}")
    if dtype is not None and t.dtype != dtype:
        raise ValueError(f"{name}: expected dtype {dtype} (the state's), got {t.dtype}")


def check_shape(name: str, t: torch.Tensor, shape: tuple) -> None:
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{name}: expected shape {list(shape)}, got {list(t.shape)}")


def check_ndim(name: str, t, ndim: int, layout: str) -> None:
    """``t`` is a tensor of ``ndim`` dims; ``layout`` names them for the message."""
    check_tensor(name, t)
    if t.dim() != ndim:
        raise ValueError(f"{name}: expected shape {layout}, got {list(t.shape)}")


def check_count(name: str, count, batch: int, low: int, high: int) -> None:
    """``count`` is an int32 or int64 tensor ``[batch]`` with values in ``[low, high]`` (the
    smaller integer dtypes cannot index a gather, and uint8's count - 1 wraps)."""
    check_tensor(name, count)
    if count.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"{name}: expected dtype torch.int32 or torch.int64, got {count.dtype}")
    check_shape(name, count, (batch,))
    if batch and (int(count.min()) < low or int(count.max()) > high):
        raise ValueError(f"{name}: expected values in [{low}, {high}], got {count.tolist()}")


def repeated(values) -> list:
    """The values that occur more than once in ``values``, each once, in first-seen order (a
    list item given twice is refused by the command lines: it would be timed or drawn twice)."""
    values = list(values)
    return list(dict.fromkeys(v for v in values if values.count(v) > 1))


def check_positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")


def bytes_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors' bytes overlap (meta tensors have none; tensors on two
    devices never share bytes). The kernels' wrappers refuse an output that overlaps an input
    they read after writing it (cute_kernels._compile.check_apart, emulation's
    check_out_apart)."""
    if not a.numel() or not b.numel() or a.device != b.device or a.device.type == "meta":
        return False
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 < b0 + b.numel() * b.element_size() and b0 < a0 + a.numel() * a.element_size()
