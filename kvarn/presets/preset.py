"""`Preset`: a method (the key and value quantizers it builds) paired with a `CachePolicy`, and its record.

The method is stated by its builders (head_dim -> quantizer) and recorded by what they build: each quantizer's
`describe()` plus the builder parameters (`params`). `to_dict(head_dim)` is that record with the policy's; a saved
cache keeps it, and `differences` names every field in which a record and a preset disagree.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvarn.quant.base import TileQuantizer
from kvarn.quant.cache_policy import CachePolicy, ValueWindow

QuantizerFactory = Callable[[int], TileQuantizer]  # head_dim -> quantizer
POLICY_FIELDS = frozenset(f.name for f in dataclasses.fields(CachePolicy)) - {"version"}
# the record's fields that make the method; description and notes document it and are not compared
CHECKED = ("version", "family", "k_bits", "v_bits", "key", "value", "key_high", "key_mid", "promote", "params",
           "policy")


def _plain(x: object) -> Any:
    """JSON-plain copy (tuples -> lists, dtypes and other objects -> str): what a record holds after a save."""
    return json.loads(json.dumps(x, default=str))


@dataclass(frozen=True)
class Preset:
    """A method and its cache policy.

    key, value    builders head_dim -> `TileQuantizer` (None for both: no quantization)
    key_high      budget presets: the key quantizer of the layers promoted online (`kvarn.cache.allocation`)
    promote       the share of the quantized layers whose keys get `key_high` (rounded down per model)
    key_mid       budget presets: a key quantizer between `key` and `key_high`; the key bits that rounding the
                  `key_high` layers down leaves unspent go to as many further layers at `key_mid` as they pay for
                  (`mid_layers`), so a model with few quantized layers still spends its budget
    policy        how the cache holds K/V around them (`kvarn.quant.cache_policy`); its fields read through too:
                  `preset.tile`, `.sink`, `.value_window`, `.fp_layers`, `.key_pre_rope`
    params        the builder's parameters, JSON-plain (recorded with the method)
    notes         provenance (paper, what is left out); not part of the method
    version       of this named config: bumped when a registered name starts to build something else, so a cache
                  saved under the old meaning is refused
    """

    name: str
    description: str
    key: QuantizerFactory | None
    value: QuantizerFactory | None
    policy: CachePolicy = field(default_factory=CachePolicy)
    family: str = "kvarn"
    key_high: QuantizerFactory | None = None
    promote: float = 0.0
    key_mid: QuantizerFactory | None = None
    k_bits: float = 16
    v_bits: float = 16
    params: Mapping[str, object] = field(default_factory=dict)
    notes: Mapping[str, str] = field(default_factory=dict)
    version: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.policy, CachePolicy):
            raise TypeError(f"preset {self.name!r}: policy must be a CachePolicy, got {type(self.policy).__name__}")
        if (self.key is None) != (self.value is None):
            raise ValueError(f"preset {self.name!r}: give both a key and a value quantizer, or neither")
        if not 0.0 <= self.promote <= 1.0:
            raise ValueError(f"preset {self.name!r}: promote must lie in [0, 1], got {self.promote!r}")
        if self.promote > 0 and self.key_high is None:
            raise ValueError(f"preset {self.name!r}: promote needs key_high, the quantizer of the promoted keys")
        if self.key_high is not None and self.key is None:
            raise ValueError(f"preset {self.name!r}: key_high needs a key quantizer to promote from")
        if self.key_mid is not None and self.key_high is None:
            raise ValueError(f"preset {self.name!r}: key_mid spends what key_high's rounding leaves; give key_high")

    # -- the policy's fields, read through (callers predate the split) ------------------------------------------
    @property
    def tile(self) -> int:
        return self.policy.tile

    @property
    def sink(self) -> int:
        return self.policy.sink

    @property
    def value_window(self) -> ValueWindow:
        return self.policy.value_window

    @property
    def fp_layers(self) -> tuple[int, int]:
        return self.policy.fp_layers

    @property
    def key_pre_rope(self) -> bool:
        return self.policy.key_pre_rope

    def replace(self, **changes: Any) -> Preset:
        """A copy with `changes`; policy fields (tile, sink, value_window, fp_layers, key_pre_rope) go to the policy."""
        pol = {k: changes.pop(k) for k in list(changes) if k in POLICY_FIELDS}
        if pol:
            changes["policy"] = dataclasses.replace(changes.get("policy", self.policy), **pol)
        return dataclasses.replace(self, **changes)

    # -- the method ---------------------------------------------------------------------------------------------
    @property
    def quantized(self) -> bool:
        return self.key is not None

    def quantizers(self, head_dim: int) -> tuple[TileQuantizer, TileQuantizer]:
        if self.key is None or self.value is None:
            raise ValueError(f"preset {self.name!r} does not quantize")
        return self.key(head_dim), self.value(head_dim)

    def promoted_layers(self, quantized_layers: int) -> int:
        """How many of `quantized_layers` layers get `key_high` keys: floor(promote x n), so the budget holds."""
        return int(self.promote * quantized_layers + 1e-9) if self.key_high is not None else 0

    def mid_layers(self, quantized_layers: int, head_dim: int = 128) -> int:
        """How many further layers get `key_mid` keys: the key bits per element that `promote` x n layers at
        `key_high` would add, less those of the `promoted_layers` rounded down, over what one `key_mid` layer adds
        (key bits from stored bytes at `head_dim`; for codes that share their scales the ratio is the code bits')."""
        if self.key_mid is None or self.key is None or self.key_high is None:
            return 0
        n, n_high = quantized_layers, self.promoted_layers(quantized_layers)
        low = self.key(head_dim).bits_per_element(head_dim)
        up_high = self.key_high(head_dim).bits_per_element(head_dim) - low
        up_mid = self.key_mid(head_dim).bits_per_element(head_dim) - low
        return min(int((self.promote * n - n_high) * up_high / up_mid + 1e-9), n - n_high)

    def key_splits(self, quantized_layers: int, head_dim: int = 128) -> tuple[tuple[int, int], ...]:
        """Every (h, m) with h layers at `key_high` and m at `key_mid` whose added key bits stay within what `promote`
        x n layers at `key_high` add (the budget; key bits from stored bytes at `head_dim`): the splits a budget
        preset with `params["pick"] == "best"` chooses among per request (`kvarn.cache.allocation.best_split`)."""
        n = quantized_layers
        if self.key is None or self.key_high is None:
            return ((0, 0),)
        low = self.key(head_dim).bits_per_element(head_dim)
        up_high = self.key_high(head_dim).bits_per_element(head_dim) - low
        up_mid = 0.0 if self.key_mid is None else self.key_mid(head_dim).bits_per_element(head_dim) - low
        budget = self.promote * n * up_high * (1 + 1e-9)
        return tuple((h, m) for h in range(n + 1) for m in range(n + 1 - h if up_mid > 0 else 1)
                     if h * up_high + m * up_mid <= budget)

    @property
    def picks_best(self) -> bool:
        """Whether the split between `key_high` and `key_mid` layers is chosen per request (`key_splits`)."""
        return self.params.get("pick") == "best"

    def bits_per_element(self, head_dim: int, num_layers: int | None = None) -> float:
        """Bits per cached K/V element of the quantized region, measured from stored bytes.

        Budget presets count their promoted keys: at the `promote` share, or with `num_layers` at the layers a model
        of that many quantized layers promotes (`key_high` and `key_mid`). With `num_layers`, full-precision layers
        (`fp_layers`) are averaged in at 16 bits.
        """
        if not self.quantized:
            return 16.0
        kq, vq = self.quantizers(head_dim)
        kb = kq.bits_per_element(head_dim)
        if self.key_high is not None:
            n_q = None if num_layers is None else num_layers - min(num_layers, sum(self.fp_layers))
            up_high = self.key_high(head_dim).bits_per_element(head_dim) - kb
            if not n_q:
                kb += self.promote * up_high
            else:
                up_mid = 0.0 if self.key_mid is None else self.key_mid(head_dim).bits_per_element(head_dim) - kb
                splits = (self.key_splits(n_q, head_dim) if self.picks_best else
                          ((self.promoted_layers(n_q), self.mid_layers(n_q, head_dim)),))
                kb += max(h * up_high + m * up_mid for h, m in splits) / n_q  # pick "best": the most it may spend
        b = (kb + vq.bits_per_element(head_dim)) / 2
        if num_layers is not None and any(self.fp_layers):
            n_fp = min(num_layers, sum(self.fp_layers))
            b = (b * (num_layers - n_fp) + 16.0 * n_fp) / num_layers
        return b

    # -- the record ---------------------------------------------------------------------------------------------
    def to_dict(self, head_dim: int) -> dict[str, Any]:
        """The preset as JSON-plain data at `head_dim`: name, version, family and bits, each quantizer's
        `describe()` (None without quantization), the builder `params`, the policy's `to_dict()`, and the
        description and notes."""
        kq, vq = self.quantizers(head_dim) if self.quantized else (None, None)
        # budget presets only (records of other presets stay as they were saved before budgets existed)
        budget = {} if self.key_high is None else {"key_high": dict(self.key_high(head_dim).describe()),
                                                   "promote": self.promote}
        if self.key_mid is not None:
            budget["key_mid"] = dict(self.key_mid(head_dim).describe())
        return _plain({"name": self.name, "version": self.version, "family": self.family, "k_bits": self.k_bits,
                       "v_bits": self.v_bits, "key": None if kq is None else dict(kq.describe()),
                       "value": None if vq is None else dict(vq.describe()), **budget, "params": dict(self.params),
                       "policy": self.policy.to_dict(), "description": self.description, "notes": dict(self.notes)})

    def differences(self, record: Mapping[str, Any], head_dim: int) -> list[tuple[str, object, object]]:
        """Every (field, recorded, this preset's) in which `record` (a `to_dict` at `head_dim`) differs from this
        preset in the method or the policy, fields dotted (`key.bits`, `policy.sink`); [] when they agree."""
        now = self.to_dict(head_dim)
        return [d for k in CHECKED for d in _diff(k, record.get(k), now.get(k))]


def _diff(path: str, a: object, b: object) -> Iterator[tuple[str, object, object]]:
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        for k in [*b, *(k for k in a if k not in b)]:
            yield from _diff(f"{path}.{k}", a.get(k), b.get(k))
    elif a != b:
        yield path, a, b
