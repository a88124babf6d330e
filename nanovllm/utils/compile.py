"""torch.compile for the small elementwise ops (norm, rotary, activation, sampler), switched on by the runner.

The ops are module-level functions wrapped in a `compilable` switch rather than decorated with torch.compile, so
that CPU runs and `enforce_eager=True` keep plain eager code, and one compiled function serves every layer.
"""
import functools

import torch

_switches = []


class _Switch:
    def __init__(self, fn):
        self.fn = self.active = fn
        functools.update_wrapper(self, fn)

    def __call__(self, *args, **kwargs):
        return self.active(*args, **kwargs)


def compilable(fn):
    switch = _Switch(fn)
    _switches.append(switch)
    return switch


def set_compile(enabled: bool):
    for switch in _switches:
        switch.active = torch.compile(switch.fn, dynamic=True) if enabled else switch.fn
