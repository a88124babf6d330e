"""torch.compile for the small elementwise ops (norm, rotary, activation, sampler), switched on by the runner.

The ops are module-level functions wrapped in a `compilable` switch rather than decorated with torch.compile, so
that CPU runs and `enforce_eager=True` keep plain eager code, and one compiled function serves every layer.
"""
import functools
import logging

import torch

logger = logging.getLogger(__name__)
_switches = []


class _Switch:
    """Calls the compiled function when compiling is on. If torch.compile fails on it (an inductor bug of the
    installed torch for some shape, say), the function falls back to eager for good, with a warning naming it:
    the ops are small, so a missed fusion costs microseconds, while a crash would cost the run."""

    def __init__(self, fn):
        self.fn = self.active = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        if self.active is self.fn:
            return self.fn(*args, **kwargs)
        try:
            return self.active(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 -- the eager call below re-raises any error that is not the compiler's
            logger.warning("torch.compile failed on %s (%s: %s); running it eagerly",
                           self.fn.__qualname__, type(e).__name__, str(e).splitlines()[0] if str(e) else "")
            self.active = self.fn
            return self.fn(*args, **kwargs)


def compilable(fn):
    switch = _Switch(fn)
    _switches.append(switch)
    return switch


def set_compile(enabled: bool):
    for switch in _switches:
        switch.active = torch.compile(switch.fn, dynamic=True) if enabled else switch.fn
