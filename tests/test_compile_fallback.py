"""A function that torch.compile cannot compile falls back to eager once, with a warning naming it."""
import logging

import torch

from nanovllm.utils import compile as compile_utils


def test_compile_failure_falls_back_to_eager(caplog):
    calls = []

    @compile_utils.compilable
    def double(x):
        calls.append(x.shape)
        return x * 2

    def broken_compiled(*args, **kwargs):
        raise RuntimeError("inductor: list indices must be integers")

    try:
        double.active = broken_compiled
        with caplog.at_level(logging.WARNING, logger=compile_utils.__name__):
            out = double(torch.ones(3))
        assert torch.equal(out, torch.full((3,), 2.0))
        assert double.active is double.fn  # eager from now on
        assert "double" in caplog.text and "RuntimeError" in caplog.text
        assert double(torch.ones(2)).tolist() == [2.0, 2.0]
        assert calls == [torch.Size([3]), torch.Size([2])]
    finally:
        compile_utils._switches.remove(double)


def test_eager_errors_still_raise():
    @compile_utils.compilable
    def bad(x):
        return x @ x  # [1, 2] @ [1, 2]: a shape error of the caller, not of the compiler

    try:
        bad.active = lambda x: (_ for _ in ()).throw(RuntimeError("compile failed"))
        try:
            bad(torch.ones(1, 2))
        except RuntimeError as e:
            assert "compile failed" not in str(e)
        else:
            raise AssertionError("the eager error was swallowed")
    finally:
        compile_utils._switches.remove(bad)
