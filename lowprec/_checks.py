"""Input validation shared by the references: every failure is a ``ValueError`` that names the
argument, what was expected and what was given."""

import operator

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


def as_int(name: str, value) -> int:
    """``value`` as a Python int: an int or any integer scalar with ``__index__`` (numpy's
    ``np.int64``, a 0-d integer tensor); a bool, a float or a string is refused."""
    if isinstance(value, bool) or isinstance(value, torch.Tensor) and value.dtype == torch.bool:
        raise ValueError(f"{name}: expected an integer, got {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"{name}: expected an integer, got {value!r}") from None


def check_positive_int(name: str, value, minimum: int = 1) -> int:
    """``value`` (an integer, numpy's included) as an int ``>= minimum``."""
    try:
        number = as_int(name, value)
    except ValueError:
        number = None
    if number is None or number < minimum:
        raise ValueError(f"{name}: expected an integer >= {minimum}, got {value!r}")
    return number


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[first, last) byte addresses ``t`` can touch, from its strides (any layout)."""
    low = high = t.data_ptr()
    for size, stride in zip(t.shape, t.stride(), strict=True):
        reach = (size - 1) * stride * t.element_size()
        low, high = (low + reach, high) if reach < 0 else (low, high + reach)
    return low, high + t.element_size()


def bytes_overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether the byte ranges two tensors span overlap (any strides; meta tensors have no
    bytes; tensors on two devices never share bytes). Interleaved views that touch disjoint
    bytes inside one span count as overlapping, which errs on the side of refusing. The
    kernels' wrappers refuse an output that overlaps an input they read after writing it
    (cute_kernels._compile.check_apart, emulation's check_out_apart)."""
    if not a.numel() or not b.numel() or a.device != b.device or a.device.type == "meta":
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    return a0 < b1 and b0 < a1


def check_device(name: str, t: torch.Tensor, device: torch.device | None = None,
                 where: str = "") -> None:
    """``t`` holds data (not a meta tensor) and, if ``device`` is given, lives there; ``where``
    says whose device that is ("the cache's")."""
    if t.device.type == "meta":
        raise ValueError(f"{name}: expected a tensor with data (cpu or cuda), got a meta tensor")
    if device is not None and t.device != torch.device(device):
        whose = f" ({where})" if where else ""
        raise ValueError(f"{name}: expected device {torch.device(device)}{whose}, got {t.device}")


def check_same_device(tensors: dict) -> None:
    """Every tensor of ``tensors`` (name -> tensor or None, the first one the reference) holds
    data and lives on the first one's device; the message names both."""
    ref_name, ref = None, None
    for name, t in tensors.items():
        if t is None:
            continue
        if ref is None:
            check_device(name, t)
            ref_name, ref = name, t
        else:
            check_device(name, t, ref.device, f"{ref_name}'s")


def check_inputs_apart(inputs: dict, held: dict) -> None:
    """ValueError naming both tensors if an input (name -> tensor or None) shares bytes with a
    tensor the callee holds and writes (name -> tensor): an input read after that write would
    see the new bytes."""
    for name, t in inputs.items():
        if t is None:
            continue
        for held_name, h in held.items():
            if h is not None and bytes_overlap(t, h):
                raise ValueError(f"{name}: expected memory apart from {held_name}, got a tensor "
                                 f"that shares bytes with it (pass a copy: {name}.clone())")
