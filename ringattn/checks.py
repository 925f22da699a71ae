"""Checks of the scalar arguments the public entry points share.

Each check raises before any work, naming the argument with the expected
and the actual value: TypeError for a value of the wrong kind, ValueError
for one out of range.  Arrays are checked by the C core (``_C``), the same
code for the local and the ring entry points.
"""

import math
import operator

import numpy as np

__all__ = ["flag", "int_or_none", "ulysses_degree", "timeout",
           "callable_or_none", "dict_or_none", "scale_or_none",
           "window_sides", "C_INT_MAX", "WINDOW_UNBOUNDED_FROM"]

C_INT_MAX = 2**31 - 1
# A window side from here on reaches every position (positions stay inside
# +-2^60): unbounded, as the C core and the XLA handlers read it.
WINDOW_UNBOUNDED_FROM = 2**61


def _show(value):
    """A short repr of `value` for an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def flag(value, name):
    """`value` as a bool: a bool, a NumPy bool, or an integer 0 or 1.

    Anything else (a string such as ``"false"``, None, a float, 2) is a
    TypeError rather than read as truthy.
    """
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    if not isinstance(value, float):
        try:
            as_int = operator.index(value)
        except TypeError:
            as_int = None
        if as_int in (0, 1):
            return bool(as_int)
    raise TypeError(f"{name}: expected a bool, got {type(value).__name__} "
                    f"{_show(value)}")


def int_or_none(value, name, minimum, maximum=None):
    """None, or `value` as a Python int in [minimum, maximum]."""
    if value is None:
        return None
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name}: expected an int or None, got {value!r}")
    try:
        as_int = operator.index(value)
    except TypeError:
        raise TypeError(f"{name}: expected an int or None, got "
                        f"{type(value).__name__} {_show(value)}") from None
    if as_int < minimum or (maximum is not None and as_int > maximum):
        bound = f">= {minimum}" if maximum is None else \
            f"in [{minimum}, {maximum}]"
        raise ValueError(f"{name}: expected an int {bound}, got {as_int}")
    return as_int


def ulysses_degree(value):
    """`ulysses` as a Python int u >= 1; None is 1 (the plain ring), as
    everywhere ``ulysses`` is taken.  TypeError for a non-integer (a bool,
    a float, a string), ValueError for u < 1.  Whether u divides the world
    size and the heads is checked where those are known."""
    return int_or_none(value, "ulysses", 1) or 1


def scale_or_none(value):
    """None, or `value` as a finite float (what the C core takes: a real
    number, anything with __float__).  TypeError naming `scale` for a
    string, a complex or a traced JAX value; ValueError for inf / NaN."""
    if value is None:
        return None
    try:
        if isinstance(value, (str, bytes, bytearray)):
            raise TypeError
        scale = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"scale: expected a float or None, got "
                        f"{type(value).__name__} {_show(value)}") from None
    if not math.isfinite(scale):
        raise ValueError(f"scale: expected a finite number, got {_show(value)}")
    return scale


def window_sides(window):
    """window=None or (left, right) -> None, or (left, right) with each side
    a Python int >= 0 or None (unbounded; so is a side of 2**61 or more,
    which reaches every position).  Sides go through operator.index, as the
    C core's checks take them (NumPy and JAX integer scalars included); None
    when neither side is bounded.  TypeError / ValueError naming `window`:
    a side that is not an int (a traced JAX value: a window is static), a
    negative side, a window that is not a pair."""
    if window is None:
        return None
    if not isinstance(window, (tuple, list)) or len(window) != 2:
        raise TypeError(f"window: expected (left, right) with ints >= 0 or "
                        f"None, or None, got {type(window).__name__} "
                        f"{_show(window)}")
    sides = []
    for name, side in zip(("left", "right"), window):
        if side is None:
            sides.append(None)
            continue
        if isinstance(side, (bool, np.bool_)):
            raise TypeError(f"window: expected (left, right) with ints >= 0 "
                            f"or None, got bool {name} in {_show(window)}")
        try:
            side = operator.index(side)
        except TypeError:
            raise TypeError(f"window: expected (left, right) with ints >= 0 "
                            f"or None (static values, not traced ones), got "
                            f"{type(side).__name__} {name}") from None
        if side < 0:
            raise ValueError(f"window: expected {name} >= 0 or None, got "
                             f"{side}")
        sides.append(None if side >= WINDOW_UNBOUNDED_FROM else side)
    return None if sides == [None, None] else tuple(sides)


def timeout(value, name="timeout"):
    """None, or `value` as a positive finite number of seconds (float)."""
    if value is None:
        return None
    if isinstance(value, (bool, str, bytes)) or \
            isinstance(value, np.bool_):
        raise TypeError(f"{name}: expected a number of seconds or None, got "
                        f"{type(value).__name__} {_show(value)}")
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name}: expected a number of seconds or None, got "
                        f"{type(value).__name__}") from None
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"{name}: expected a positive, finite number of "
                         f"seconds, got {_show(value)}")
    return seconds


def callable_or_none(value, name):
    if value is not None and not callable(value):
        raise TypeError(f"{name}: expected a callable or None, got "
                        f"{type(value).__name__}")
    return value


def dict_or_none(value, name):
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"{name}: expected a dict (filled in place) or None, "
                        f"got {type(value).__name__}")
    return value
