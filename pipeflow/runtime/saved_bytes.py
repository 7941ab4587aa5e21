"""How many bytes of activations a rank keeps for backward, measured on any device: every
forward runs under saved-tensor hooks that count each saved storage once, from its save
until its last holder is freed (parameters and buffers excluded). Seq1F1B's keys and
values (:meth:`SavedBytes.hold`) and the zero-bubble split's operands held from I until W
(:meth:`SavedBytes.keep`) go through the same count."""

from __future__ import annotations

import torch

from . import memory_profile
from .memory_profile import tag


class _Held:
    """What autograd stores instead of a saved tensor: the tensor, and a release on free."""

    __slots__ = ("meter", "ptr", "tensor")

    def __init__(self, meter: "SavedBytes", ptr: int, tensor: torch.Tensor):
        self.meter, self.ptr, self.tensor = meter, ptr, tensor

    def __del__(self):
        self.meter._release(self.ptr)


class SavedBytes:
    def __init__(self, exclude: set[int] | None = None):
        self.exclude = set(exclude or ())  # storages never counted (parameters, buffers)
        self.live: dict[int, list[int]] = {}  # storage -> [holders, bytes]
        self.current = 0
        self.peak = 0
        self.kv_current = 0
        self.kv_peak = 0
        self.residual_current = 0  # I-to-W residuals held by hand (Kept)
        self.residual_peak = 0
        self.step_peak = 0

    def reset_step(self) -> None:
        self.step_peak = self.current

    def _acquire(self, t: torch.Tensor, category: str = "activations") -> int | None:
        if t.layout != torch.strided or t.device.type == "meta":
            return None
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in self.exclude or ptr == 0:
            return None
        entry = self.live.get(ptr)
        if entry is None:
            tag(t, category)
            nbytes = storage.nbytes()
            self.live[ptr] = [1, nbytes]
            self.current += nbytes
            self.peak = max(self.peak, self.current)
            self.step_peak = max(self.step_peak, self.current)
        else:
            entry[0] += 1
        return ptr

    def _release(self, ptr: int) -> None:
        entry = self.live.get(ptr)
        if entry is None:
            return
        entry[0] -= 1
        if entry[0] == 0:
            del self.live[ptr]
            self.current -= entry[1]

    # ---- autograd's saved tensors ------------------------------------------------------
    def pack(self, t):
        if not isinstance(t, torch.Tensor):
            return t
        ptr = self._acquire(t, "casts" if memory_profile._active and memory_profile.is_weight_cast(t) else "activations")
        # Hold a detached alias, never ``t`` itself: a saved tensor may be an output of
        # the very node that saves it, and a strong reference from the saved slot to
        # ``t`` (whose grad_fn is that node) is a reference cycle. Autograd avoids it
        # without hooks; with them, a graph kept after its backward (zero-bubble I
        # retains it for W) then lives until Python's cyclic collector finds it:
        # measured, every forward and I of a ZB-H1 run 40% slower. Autograd gives the
        # unpacked data its grad_fn back itself.
        return t if ptr is None else _Held(self, ptr, t.detach())

    @staticmethod
    def unpack(obj):
        return obj.tensor if isinstance(obj, _Held) else obj

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    # ---- a K/V cache entry -------------------------------------------------------------
    def hold(self, t: torch.Tensor) -> "KVHold":
        """Count ``t`` while the returned handle lives (drop it to release)."""
        return KVHold(self, t)

    # ---- what the zero-bubble split holds from I until W -------------------------------
    def keep(self, t: torch.Tensor) -> "Kept":
        """Count ``t``, a tensor held by hand from I until its W (a planned product's
        operand, the gradient arriving at it), while the returned handle lives. A storage
        autograd still saves counts once; its own peak is ``residual_peak``."""
        return Kept(self, t)


class Kept:
    __slots__ = ("meter", "ptr", "tensor", "nbytes")
    _current, _peak = "residual_current", "residual_peak"
    _tag = "residuals"  # its category in runtime.memory=profile

    def __init__(self, meter: SavedBytes, t: torch.Tensor):
        self.meter, self.tensor = meter, t
        self.nbytes = t.numel() * t.element_size()
        self.ptr = meter._acquire(t, self._tag)
        tag(t, self._tag)  # runtime.memory=profile: held for this, even where autograd saved it first
        if self.ptr is not None:
            now = getattr(meter, self._current) + self.nbytes
            setattr(meter, self._current, now)
            setattr(meter, self._peak, max(getattr(meter, self._peak), now))

    def __del__(self):
        if self.ptr is not None:
            self.meter._release(self.ptr)
            setattr(self.meter, self._current, getattr(self.meter, self._current) - self.nbytes)


class KVHold(Kept):
    """A Seq1F1B segment's keys and values (or their gradients), held for later segments."""

    __slots__ = ()
    _current, _peak = "kv_current", "kv_peak"
    _tag = "kv"
