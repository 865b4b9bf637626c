"""Which replica of a loader group reads and serves each window of a source. Pure; no I/O.

A loader group (loader index g, serving the sources `job.loader_sources(g)`) runs as one or more
replicas. Each replica opens all the group's sources but reads only the windows routed to it, so
more replicas add read and transform capacity. Windows are numbered over epochs,
n = epoch * windows_per_epoch + index (`window_of`). A route (from_window, replicas) sends window
n >= from_window to replicas[n % len(replicas)], until a later route starts.

The planner changes a source's routes when replicas join or leave, starting at a window no
replica has been asked about yet (`Routing.switch`). So each window has one owner for its whole
life: its samples are read once and served once, and I1 holds across any number of joins and
leaves. A sample's identity (source, seq) and every plan are independent of the routes (I4);
routes only say where a constructor fetches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from batchplane.core.order import SampleOrder


@dataclasses.dataclass(frozen=True)
class Route:
    """Windows from `from_window` on go round-robin to `replicas` (sorted replica ids)."""

    from_window: int
    replicas: tuple[str, ...]

    def __post_init__(self) -> None:
        if self.from_window < 0:
            raise ValueError(f"from_window must be >= 0, got {self.from_window}")
        if not self.replicas or len(set(self.replicas)) != len(self.replicas):
            raise ValueError(f"a route needs distinct replicas, got {self.replicas}")
        object.__setattr__(self, "replicas", tuple(sorted(self.replicas)))


@dataclasses.dataclass(frozen=True)
class Routing:
    """A source's routes, by increasing `from_window`, the first from window 0."""

    routes: tuple[Route, ...]

    def __post_init__(self) -> None:
        starts = [r.from_window for r in self.routes]
        if not starts or starts[0] != 0 or starts != sorted(set(starts)):
            raise ValueError(f"routes must start at window 0 and increase, got {starts}")

    @classmethod
    def of(cls, replicas: Sequence[str]) -> Routing:
        """Every window routed over `replicas`."""
        return cls((Route(0, tuple(replicas)),))

    def route(self, window: int) -> Route:
        """The route that counts for `window`."""
        for r in reversed(self.routes):
            if r.from_window <= window:
                return r
        raise ValueError(f"window must be >= 0, got {window}")

    def owner(self, window: int) -> str:
        """The replica that reads and serves `window`."""
        r = self.route(window)
        return r.replicas[window % len(r.replicas)]

    def switch(self, from_window: int, replicas: Sequence[str]) -> Routing:
        """These routes with windows from `from_window` on routed over `replicas` instead.

        Raises:
            ValueError: `replicas` empty or repeated.
        """
        new = Route(from_window, tuple(replicas))
        kept = tuple(r for r in self.routes if r.from_window < from_window)
        if kept and kept[-1].replicas == new.replicas:
            return Routing(kept)
        return Routing((*kept, new))


def last_owned(routing: Routing, replica: str, before: int) -> int | None:
    """The last window below `before` that `replica` owns under `routing`; None if none.

    A replica leaving its group serves the windows it owns below the planner's frontier and
    no others. The last of them bounds what it must wait for: its routes, learnt from the
    planner's requests, are current up to that window, but may miss a switch after it (a
    replica that joined and was asked for the windows from there on).
    """
    ends = [r.from_window for r in routing.routes[1:]] + [before]
    for route, end in zip(reversed(routing.routes), reversed(ends)):
        stop = min(end, before)  # the route covers windows [from_window, stop)
        if stop <= route.from_window or replica not in route.replicas:
            continue
        n, i = len(route.replicas), route.replicas.index(replica)
        window = stop - 1 - (stop - 1 - i) % n  # the last one below stop that is i modulo n
        if window >= route.from_window:
            return window
    return None


@dataclasses.dataclass(frozen=True)
class WindowSpan:
    """Window `number` of a source holds stream positions [start, end)."""

    number: int
    start: int
    end: int


def window_of(order: SampleOrder, seq: int) -> WindowSpan:
    """The window holding stream position `seq` (of any epoch)."""
    epoch, position = divmod(seq, order.num_rows)
    window = order.window_at(epoch, position)
    first = epoch * order.num_rows + window.start
    return WindowSpan(epoch * len(order.windows(epoch)) + window.index, first, first + window.size)


def window_span(order: SampleOrder, number: int) -> WindowSpan:
    """Window `number` (numbered over epochs) and the stream positions it holds."""
    per_epoch = len(order.windows(0))
    epoch, index = divmod(number, per_epoch)
    window = order.windows(epoch)[index]
    first = epoch * order.num_rows + window.start
    return WindowSpan(number, first, first + window.size)
