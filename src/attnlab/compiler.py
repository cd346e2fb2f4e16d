"""Marks for torch.compile that cost nothing at import.

`torch.compiler.assume_constant_result` imports dynamo (2-3 s of a process's start on a CPU) to set
one attribute on the function. attnlab marks functions at import in modules that every command
loads, also those that compile nothing (`attnlab sample` without --compile), so it sets that
attribute itself where dynamo is not loaded yet;
tests/test_compile.py checks that the mark is torch's own. (Training loads dynamo anyway: torch's
optimisers import it, and train/distributed.py before any process group.)"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import TypeVar

Function = TypeVar("Function", bound=Callable)


def assume_constant_result(function: Function) -> Function:
    """torch.compiler.assume_constant_result(function), without importing dynamo: a traced call of
    `function` is run once while tracing and its result kept as a constant of the graph."""
    if "torch._dynamo" in sys.modules:
        import torch

        return torch.compiler.assume_constant_result(function)
    function._dynamo_marked_constant = True  # what torch._dynamo.assume_constant_result sets
    return function
