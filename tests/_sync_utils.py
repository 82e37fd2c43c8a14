# SPDX-License-Identifier: Apache-2.0
"""Counting what would synchronize with a GPU, on a CPU-only machine.

:class:`HostSyncCounter` is a ``TorchFunctionMode`` that sees every torch call of
the code it wraps and records, by the Python file that made the call:

* **device -> host reads** (each one a stream synchronization on CUDA):
  ``tolist``, ``item``, ``cpu``, ``numpy``, ``bool()`` / ``int()`` /
  ``float()`` of a tensor, ``nonzero``, ``masked_select``, ``unique``, indexing
  with a boolean mask or with a 0-dim integer tensor (``x[i]``: PyTorch reads
  ``i`` with ``item()`` to select), ``repeat_interleave`` with tensor repeats and no
  ``output_size``, ``torch.equal``;
* **pageable host -> device copies** (blocking on CUDA): a torch tensor made from
  Python data with an explicit ``device=``, and ``.to(...)`` / ``copy_`` of a host
  tensor that is not pinned, or without ``non_blocking=True``.

On CPU every tensor lives on the CPU, so the counter keeps its own map of which
tensors would be host tensors on a GPU machine: vLLM's host buffers
(``CpuGpuBuffer.cpu`` / ``.np`` and the input batch's ``*_cpu`` tensors, by
storage), tensors created without a ``device=`` argument, and whatever is computed
from host tensors only. Every other tensor counts as a device tensor (a
conservative rule: it can only over-count).
"""

from __future__ import annotations

import collections
import sys
import weakref

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

_READS = {
    torch.Tensor.tolist,
    torch.Tensor.item,
    torch.Tensor.cpu,
    torch.Tensor.numpy,
    torch.Tensor.__bool__,
    torch.Tensor.__int__,
    torch.Tensor.__float__,
    torch.Tensor.__index__,
    torch.Tensor.nonzero,
    torch.nonzero,
    torch.Tensor.masked_select,
    torch.masked_select,
    torch.Tensor.unique,
    torch.unique,
    torch.equal,
    torch.Tensor.equal,
}
_CREATORS = {
    torch.tensor,
    torch.as_tensor,
    torch.asarray,
}
_FACTORIES = {
    torch.zeros,
    torch.ones,
    torch.empty,
    torch.full,
    torch.arange,
    torch.zeros_like,
    torch.ones_like,
    torch.empty_like,
    torch.full_like,
    torch.randn,
    torch.rand,
    torch.from_numpy,
}


def _names_device(device) -> bool:
    """Whether a ``device=`` argument names the device: an explicit ``"cpu"``
    string names the host (vLLM's host buffers); a ``torch.device`` is the
    runner's device (the CPU on this machine, a GPU elsewhere)."""
    return device is not None and not (isinstance(device, str) and device == "cpu")


def _tensors(args, kwargs):
    flat, _ = tree_flatten((args, kwargs))
    return [x for x in flat if isinstance(x, torch.Tensor)]


def _index_reads(index, is_host) -> bool:
    """Whether indexing with ``index`` reads a device tensor on the host: a
    boolean mask (its output shape depends on the data), or a 0-dim integer
    tensor, which PyTorch turns into a Python int (``item()``) to select."""
    items = index if isinstance(index, tuple) else (index,)
    return any(
        isinstance(i, torch.Tensor)
        and (
            i.dtype == torch.bool
            or (i.dim() == 0 and not i.is_floating_point() and not is_host(i))
        )
        for i in items
    )


class HostSyncCounter(TorchFunctionMode):
    """Records device->host reads and pageable host->device copies by caller.

    Args:
        host_tensors: tensors that are host tensors on a GPU machine (their
            storages count as host memory).
        pinned: tensors allocated pinned on a GPU machine (their storages).
    """

    def __init__(self, host_tensors=(), pinned=()) -> None:
        super().__init__()
        self._host_storages = {t.untyped_storage().data_ptr() for t in host_tensors}
        self._pinned_storages = {t.untyped_storage().data_ptr() for t in pinned}
        self._host: dict[int, weakref.ref] = {}
        # Copies to the device: device tensors even where (on this machine) the
        # copy returned its host source itself.
        self._device: dict[int, weakref.ref] = {}
        self.reads: collections.Counter = collections.Counter()
        self.copies: collections.Counter = collections.Counter()

    # -- which tensors are host tensors ------------------------------------ #

    def is_host(self, t: torch.Tensor) -> bool:
        ref = self._device.get(id(t))
        if ref is not None and ref() is t:
            return False
        ref = self._host.get(id(t))
        if ref is not None and ref() is t:
            return True
        try:
            return t.untyped_storage().data_ptr() in self._host_storages
        except (RuntimeError, NotImplementedError):
            return False

    def _mark_host(self, out) -> None:
        for t in _tensors((out,), {}):
            self._host[id(t)] = weakref.ref(t)
            if len(self._host) > 200_000:
                self._host = {k: r for k, r in self._host.items() if r() is not None}

    def _is_pinned(self, t: torch.Tensor) -> bool:
        try:
            return t.untyped_storage().data_ptr() in self._pinned_storages
        except (RuntimeError, NotImplementedError):
            return False

    # -- the mode ------------------------------------------------------------ #

    @staticmethod
    def _caller() -> str:
        frame = sys._getframe(2)
        return f"{frame.f_code.co_filename}:{frame.f_lineno}"

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        inputs = _tensors(args, kwargs)
        device_inputs = [t for t in inputs if not self.is_host(t)]
        to_device = False
        if func in _READS and device_inputs:
            self.reads[self._caller()] += 1
        elif func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__):
            if (
                device_inputs
                and len(args) > 1
                and _index_reads(args[1], self.is_host)
            ):
                self.reads[self._caller()] += 1
        elif func in (torch.repeat_interleave, torch.Tensor.repeat_interleave):
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if (
                isinstance(repeats, torch.Tensor)
                and not self.is_host(repeats)
                and kwargs.get("output_size") is None
            ):
                self.reads[self._caller()] += 1
        elif func in _CREATORS and _names_device(kwargs.get("device")):
            data = args[0] if args else kwargs.get("data")
            if not isinstance(data, torch.Tensor) or self.is_host(data):
                self.copies[self._caller()] += 1
        elif func in (torch.Tensor.to, torch.Tensor.cuda) and inputs:
            src = args[0]
            targets = [a for a in args[1:] if isinstance(a, (torch.device, str))]
            targets += [kwargs["device"]] if "device" in kwargs else []
            to_device = func is torch.Tensor.cuda or any(
                _names_device(a) for a in targets
            )
            # (On this machine the runner's device is the CPU: a copy to any
            # device is a copy to the GPU there.)
            if to_device and self.is_host(src):
                if not (kwargs.get("non_blocking") and self._is_pinned(src)):
                    self.copies[self._caller()] += 1
        elif func is torch.Tensor.copy_ and len(args) > 1:
            dst, src = args[0], args[1]
            if self.is_host(src) and not self.is_host(dst):
                if not (
                    (kwargs.get("non_blocking") or (len(args) > 2 and args[2]))
                    and self._is_pinned(src)
                ):
                    self.copies[self._caller()] += 1
        out = func(*args, **kwargs)
        if to_device and out is args[0]:
            # A copy to the device is a new tensor on a GPU machine; here the
            # runner's device is the CPU and ``to`` returned its source.
            out = out.clone()
        if func in _CREATORS or func in _FACTORIES:
            if not _names_device(kwargs.get("device")) and not device_inputs:
                self._mark_host(out)
                if "pin_memory" in kwargs:
                    # Pinned on a GPU machine (callers pass
                    # is_pin_memory_available(), False here).
                    self._pinned_storages.add(out.untyped_storage().data_ptr())
        elif func in (torch.Tensor.to, torch.Tensor.cuda):
            if to_device:
                for t in _tensors((out,), {}):
                    self._device[id(t)] = weakref.ref(t)
                    self._host.pop(id(t), None)
            elif not device_inputs:
                self._mark_host(out)  # a dtype change on the host
        elif (
            func in (torch.Tensor.cpu, torch.Tensor.numpy)
            or inputs
            and not device_inputs
        ):
            self._mark_host(out)
        return out

    def __enter__(self):
        # torch.from_numpy bypasses torch functions modes: its tensors are host
        # tensors.
        self._from_numpy = torch.from_numpy
        counter = self

        def from_numpy(array):
            out = counter._from_numpy(array)
            counter._mark_host(out)
            return out

        torch.from_numpy = from_numpy
        return super().__enter__()

    def __exit__(self, *exc):
        torch.from_numpy = self._from_numpy
        return super().__exit__(*exc)

    # -- reports --------------------------------------------------------------- #

    def by_package(self, counter: collections.Counter, needle: str) -> int:
        return sum(n for where, n in counter.items() if needle in where)
