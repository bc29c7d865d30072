"""The base of every option object callers pass (masks, block sizes)."""

from __future__ import annotations

import dataclasses


class Immutable:
    """Base of the values callers pass as options (masks, block sizes): dataclasses with
    `unsafe_hash=True` that refuse assignment once constructed, since they key caches.

    Not `frozen=True`: torch.compile's Dynamo (torch 2.9) cannot hand frozen dataclass instances
    to the torch side's nonstrict_trace region. `__post_init__` normalises with object.__setattr__.
    """

    def __setattr__(self, name, value):
        if name in self.__dict__:
            raise dataclasses.FrozenInstanceError(f"cannot assign to {name!r}: {type(self).__name__} is immutable.")
        object.__setattr__(self, name, value)

    def __delattr__(self, name):
        raise dataclasses.FrozenInstanceError(f"cannot delete {name!r}: {type(self).__name__} is immutable.")
