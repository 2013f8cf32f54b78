"""Memory really held by an object: the storages of every tensor reachable from it, each counted once.

`nbytes()` of a cache sums what its regions *should* hold; `held_bytes` measures what is really kept alive,
including storages that a view silently pins (a 4-token slice of a prompt's K/V keeps the whole prompt's
storage). Tests, docs and benchmarks compare the two.
"""

from __future__ import annotations

import dataclasses
import types

import torch

_SKIP = (type, types.ModuleType, torch.nn.Module, types.BuiltinFunctionType, str, bytes, int, float, bool, complex,
         type(None), torch.dtype, torch.device, torch.Generator)


def _children(obj: object) -> list[object]:
    """The objects `obj` refers to that may lead to tensors."""
    if isinstance(obj, dict):
        return [*obj.keys(), *obj.values()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return list(obj)
    if isinstance(obj, types.MethodType):
        return [obj.__self__, obj.__func__]
    if isinstance(obj, types.FunctionType):  # closures (e.g. a RoPE `post` capturing positions); not globals
        return [c.cell_contents for c in obj.__closure__ or () if c.cell_contents is not None] + \
            list(obj.__defaults__ or ())
    out: list[object] = []
    if dataclasses.is_dataclass(obj):
        out += [getattr(obj, f.name, None) for f in dataclasses.fields(obj)]
    d = getattr(obj, "__dict__", None)
    if isinstance(d, dict):
        out += list(d.values())
    for cls in type(obj).__mro__:
        for s in getattr(cls, "__slots__", ()):
            if isinstance(s, str) and hasattr(obj, s):
                out.append(getattr(obj, s))
    return out


def reachable_storages(obj: object) -> dict[tuple[str, int], int]:
    """{(device, data_ptr): nbytes} of the unique tensor storages reachable from `obj` (attributes, dicts,
    lists, tuples, dataclasses, bound methods and closures; module globals are not followed). Wrapper tensor
    subclasses (`__tensor_flatten__`, e.g. quanto's packed tensors) count through their inner tensors."""
    seen: set[int] = set()
    found: dict[tuple[str, int], int] = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if id(o) in seen or isinstance(o, _SKIP):
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            flatten = getattr(o, "__tensor_flatten__", None)
            if flatten is not None:  # a wrapper subclass (quanto, HQQ): its data lives in its inner tensors
                names, _ = flatten()
                stack.extend(getattr(o, n) for n in names)
            else:
                s = o.untyped_storage()
                if s.nbytes():
                    found[(str(o.device), s.data_ptr())] = s.nbytes()
            stack.extend(_children(o))  # attributes attached to a tensor (a past handed to attention)
            continue
        stack.extend(_children(o))
    return found


def held_bytes(obj: object) -> int:
    """Sum of `untyped_storage().nbytes()` over the unique storages of every tensor reachable from `obj`."""
    return sum(reachable_storages(obj).values())
