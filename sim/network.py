"""Network model: per-link latency distributions, bandwidth, loss, duplication, reordering, partitions
and clogging (spec/simulator.md §3). Pure bookkeeping on a virtual clock; the kernel asks `plan()` when
each message would arrive.

A message of `n` bytes on a directed link starts transmitting when the link is free (serialization delay
``n / bandwidth_bps`` queues behind earlier messages on that link), then takes one latency draw to arrive.
Without reordering a link delivers in order (like one TCP stream); with probability `reorder` a message
gets an extra uniform delay of up to `reorder_s` and may overtake. A clogged link holds everything until
it unclogs; a partitioned link drops messages (the kernel also disconnects crossing links, modelling a
keep-alive timeout, and reconnects them on heal).
"""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

DISTRIBUTIONS = ("constant", "uniform", "normal", "lognormal", "exponential")


@attrs.frozen(kw_only=True)
class Latency:
    """A latency distribution in seconds. `dist` one of DISTRIBUTIONS.

    constant: `median_s`; uniform: [`low_s`, `high_s`]; normal: `median_s` ± `sigma_s` (clipped at
    `low_s`); lognormal: median `median_s`, shape `sigma`; exponential: `low_s` + mean `median_s`.
    """

    dist: str = "constant"
    median_s: float = 0.005
    low_s: float = 0.0
    high_s: float = 0.0
    sigma: float = 0.5
    sigma_s: float = 0.0

    def __attrs_post_init__(self) -> None:
        if self.dist not in DISTRIBUTIONS:
            raise ValueError(f"unknown latency distribution {self.dist!r}; known: {DISTRIBUTIONS}")

    def draw(self, rng: random.Random) -> float:
        match self.dist:
            case "constant":
                return self.median_s
            case "uniform":
                return rng.uniform(self.low_s, self.high_s)
            case "normal":
                return max(self.low_s, rng.gauss(self.median_s, self.sigma_s))
            case "lognormal":
                return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))
            case _:
                return self.low_s + rng.expovariate(1.0 / self.median_s)


@attrs.frozen(kw_only=True)
class LinkSpec:
    """Behaviour of every directed link of one class. Bandwidth in bytes per second (0: unlimited)."""

    latency: Latency = Latency()
    bandwidth_bps: float = 0.0
    loss: float = 0.0
    duplicate: float = 0.0
    reorder: float = 0.0
    reorder_s: float = 0.05

    @classmethod
    def from_dict(cls, d: Mapping[str, Any], base: LinkSpec | None = None) -> LinkSpec:
        base = base or cls()
        d = dict(d)
        latency = base.latency
        if "latency" in d:
            lat = d.pop("latency")
            latency = Latency(**lat) if isinstance(lat, Mapping) else Latency(median_s=float(lat))
        d.pop("between", None)
        unknown = set(d) - {"bandwidth_bps", "loss", "duplicate", "reorder", "reorder_s"}
        if unknown:
            raise ValueError(f"unknown link settings {sorted(unknown)}")
        return attrs.evolve(base, latency=latency, **{k: float(v) for k, v in d.items()})


class Network:
    """Delivery planning for every directed link; `spec_of(src, dst)` picks each link's class."""

    def __init__(self, default: LinkSpec, overrides: Iterable[tuple[frozenset[str], LinkSpec]] = (),
                 *, rng: random.Random, roles_of: Mapping[str, str]) -> None:
        self.default = default
        self.overrides = list(overrides)
        self.rng = rng
        self.roles_of = roles_of  # node name -> its role (for link classes)
        self.busy_until: dict[tuple[str, str], float] = {}
        self.last_arrival: dict[tuple[str, str], float] = {}
        self.blocked: set[tuple[str, str]] = set()  # partitioned directed links
        self.clogged_until: dict[tuple[str, str], float] = {}
        self.bytes: Counter[tuple[str, str]] = Counter()
        self.messages = 0
        self.dropped = 0
        self.duplicated = 0
        self._spec_cache: dict[tuple[str, str], LinkSpec] = {}

    def spec_of(self, src: str, dst: str) -> LinkSpec:
        key = (self.roles_of[src], self.roles_of[dst])
        spec = self._spec_cache.get(key)
        if spec is None:
            spec = self.default
            pair = frozenset(key)
            for roles, override in self.overrides:
                if roles == pair:
                    spec = override
            self._spec_cache[key] = spec
        return spec

    def plan(self, src: str, dst: str, size: int, now: float) -> list[float]:
        """Arrival times of one message (empty when lost; two when duplicated)."""
        link = (src, dst)
        self.messages += 1
        self.bytes[link] += size
        if link in self.blocked:
            self.dropped += 1
            return []
        spec = self.spec_of(src, dst)
        rng = self.rng
        if spec.loss and rng.random() < spec.loss:
            self.dropped += 1
            return []
        start = max(now, self.busy_until.get(link, now), self.clogged_until.get(link, now))
        if spec.bandwidth_bps:
            start += size / spec.bandwidth_bps
            self.busy_until[link] = start
        arrivals = [start + spec.latency.draw(rng)]
        if spec.duplicate and rng.random() < spec.duplicate:
            self.duplicated += 1
            arrivals.append(start + spec.latency.draw(rng))
        out = []
        for t in arrivals:
            if spec.reorder and rng.random() < spec.reorder:
                t += rng.uniform(0.0, spec.reorder_s)  # may overtake or be overtaken
            else:
                t = max(t, self.last_arrival.get(link, t))  # in order, like one stream
                self.last_arrival[link] = t
            out.append(t)
        return out

    # --- faults -----------------------------------------------------------------------------------

    def block(self, src: str, dst: str) -> None:
        self.blocked.add((src, dst))

    def unblock(self, src: str, dst: str) -> None:
        self.blocked.discard((src, dst))

    def clog(self, src: str, dst: str, until: float) -> None:
        self.clogged_until[(src, dst)] = max(until, self.clogged_until.get((src, dst), until))
