"""Step programs: the uncaptured steps of one binding, bound once and then run as thunks.

On the CPU no CUDA graph records a step's kernels, yet all the Python a step runs besides its
work (argument lists, checks, views of the arena, pure views) is the same at every call of one
signature. A :class:`StepProgram` does it once: built at a binding's second call (the first runs
as usual), it runs every step once, binding each (a kernel's ``bind(outs, *inputs, **attrs)``,
see :mod:`tgraph.kernels.cpu_backend.common`; any other kernel with its arguments) and running
pure views only then. A later call copies its inputs into the program's own and runs the thunks.

Inputs passed as the very same tensor at both calls, and inputs the network writes in place (KV
caches), are read where they are (held); a later call passing another tensor for one of them
makes the engine build the program again. A step whose results are neither its planned buffers
nor its inputs (a kernel returning a new tensor) cannot be bound: its binding keeps running
uncaptured.
"""
from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from tgraph.engine.plan import LaunchPlan

__all__ = ["StepProgram", "build_program"]


@dataclass(eq=False)
class StepProgram:
    """One binding's steps as thunks, and what they read.

    Attributes:
        arenas: the arena set the bound buffers are views of.
        inputs: the program's inputs by name: its own tensors, or the caller's for ``held``.
        held: the inputs read in place (by identity).
        thunks: one per step that is not a pure view, in order.
        slots: every value of the plan as bound (the outputs are read from here).
    """

    arenas: Any
    inputs: dict[str, torch.Tensor]
    held: frozenset[str]
    thunks: list[Callable[[], Any]]
    slots: list[Any]

    def __post_init__(self) -> None:
        self._copied = [(name, t) for name, t in self.inputs.items() if name not in self.held]

    def load(self, tensors: Mapping[str, torch.Tensor]) -> bool:
        """Copy a call's inputs into the program's own; ``False``, copying nothing, when a held
        input is another tensor than the one the program reads."""
        inputs = self.inputs
        for name in self.held:
            if tensors[name] is not inputs[name]:
                return False
        for name, own in self._copied:
            own.copy_(tensors[name])
        return True

    def run(self) -> None:
        for thunk in self.thunks:
            thunk()


def _is_stable(results: tuple[Any, ...], outs: list[torch.Tensor | None],
               args: list[Any]) -> bool:
    """Whether every result is one of the step's planned buffers or inputs, which are the same
    objects at every call of the binding."""
    for r in results:
        if not any(r is t for t in outs if t is not None) and not any(r is a for a in args):
            return False
    return True


def build_program(plan: LaunchPlan, attrs: Mapping[int, dict[str, Any]],
                  buffers: list[list[torch.Tensor | None]], slots: list[Any], arenas: Any,
                  inputs: dict[str, torch.Tensor], held: frozenset[str]) -> StepProgram | None:
    """Run every step of ``plan`` once, binding it.

    Args:
        plan: the launch plan (its kernels write into ``buffers``).
        attrs: the binding's step attributes with their symbols resolved (by step index).
        buffers: the binding's buffer views, per step.
        slots: the initial slots, holding ``inputs``, the weights and the constants; filled.
        arenas: the arena set ``buffers`` are views of.
        inputs: the inputs in ``slots``, by name.
        held: the names of the inputs the program reads in place.
    Returns:
        the program, or ``None`` when a step cannot be bound (every step ran either way).
    """
    thunks: list[Callable[[], Any]] = []
    stable = True
    for i, step in enumerate(plan.steps):
        args = [None if s is None else slots[s] for s in step.in_slots]
        step_attrs = attrs.get(i, step.attrs)
        if step.into:
            bind = getattr(step.kernel, "bind", None)
            thunk = bind(buffers[i], *args, **step_attrs) if bind is not None \
                else functools.partial(step.kernel, buffers[i], *args, **step_attrs)
            result = thunk()
            thunks.append(thunk)
        else:  # a pure view: the same view of the same memory at every call
            result = step.kernel(*args, **step_attrs)
        results = (result,) if len(step.out_slots) == 1 else tuple(result)
        if step.into and stable:
            stable = _is_stable(results, buffers[i], args)
        for s, r in zip(step.out_slots, results):
            slots[s] = r
    if not stable:
        return None
    return StepProgram(arenas, inputs, held, thunks, slots)
