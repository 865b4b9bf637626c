"""When a journal producer attempts a manifest commit: the commit-cadence policies of BatchWeave
§5.2 and §7.1, one registry (`POLICIES`) that configuration, the producer and the benchmark read.

Pure: no I/O, no threads, no clocks. Times are inputs (the fragile window a driver measured);
randomness is an injected source of uniform numbers in [0, 1).

A policy answers two questions: how many built, uncommitted steps to accumulate before an
attempt (`min_steps`), and how long to wait after the end of the last attempt (`gap_s`). A
driver attempts when both are met (`is_due`), and reports every attempt's outcome
(`on_attempt`), success or conflict, with the fragile window it measured (from the read that
confirmed the current manifest version the newest to the end of the conditional put; a driver
does its CPU work before that read) and the producer count it read from the committed state.
A driver that drains its last steps (the paper's finalization phase) ignores `min_steps` and
honours `gap_s`.

The policies (`POLICIES`):

- naive: attempt as soon as one step is built; no gap ("commit every TGB").
- fixed10, fixed100: attempt once 10 (100) steps are built since the last successful commit;
  a conflict is retried at once after the rebase. The paper's "commit every 10 or 100 TGBs"
  counts steps, not seconds, so these count steps.
- incr: like fixed, starting at 10 steps, one step more after each conflict (never less).
- aimd: an interval in steps, starting at 10: one step less after a success (the commit rate
  increases additively), doubled after a conflict (the rate decreases multiplicatively), within
  [1, 10,000]. The paper words it "increase the interval by a fixed addend on success, halve it
  on conflict"; taken literally on the interval, that reacts to conflicts by committing more
  often, which raises the conflict rate it reacts to, so this follows the TCP law it cites
  (Jacobson 1988) on the commit rate.
- dac: Decentralized Adaptive Commit, a gap in seconds from the paper's Equations 2-10:
  the other N - 1 producers start attempts as Poisson processes of rate 1 / (g + W) each, so an
  attempt conflicts with probability P(g) = 1 - exp(-(N - 1) W / (g + W)) (Eq. 2), and a cycle
  spends the duty D(g) = W / (g + W) of its time on manifest I/O (Eq. 3). With a conflict
  budget eps_c and a duty budget eps_d, the feasible gaps are {g >= 0: P(g) <= eps_c,
  D(g) <= eps_d} (Eq. 4); both fall as g grows, so the smallest feasible gap (Eq. 5, 9) is
  g* = max(0, g_c, g_d) with g_c = (N - 1) W / -ln(1 - eps_c) - W (Eq. 7) and
  g_d = W (1 - eps_d) / eps_d (Eq. 8). W is an exponential moving average of measured fragile
  windows (Eq. 6) plus `window_deviations` (default 1) of their exponentially weighted standard
  deviations, N the producer count read from the committed state after each attempt. The margin
  is ours: P falls as 1 / g, so a gap computed from a noisy average W meets eps_c on average W
  but not on average P (Jensen), and windows are heavy-tailed on a loaded machine while each
  producer sees few attempts. So is the deferral after catching up (below). The
  gap used is g* (1 + xi) with xi uniform in [0, delta] (Eq. 10): the jitter only lengthens the
  gap, so the jittered gap stays feasible (both budgets hold for every g >= g*). After a
  conflict xi is uniform in [0, delta_conflict] instead (default 1, a whole cycle): producers
  that started together (a job's launch, a burst of correlated commits) conflict with each other
  and would otherwise stay within delta g* of each other for many cycles, against Eq. 2's
  independent starts; spreading the retry over a whole cycle desynchronizes them at once.
  An attempt that caught up (its final probe found a version committed while it prepared:
  `on_caught_up`) is deferred without a put: every producer that was preparing when that
  version landed caught up on it too, and putting at once they would race each other for the
  next version. The deferral is Eq. 9's gap for those contenders, about
  (N - 1) P / (g* + P + W) others for a read and preparation of P seconds (at least one),
  spread as after a conflict: short when preparing takes a small part of a cycle, g* when it
  takes most. On this machine, 32 producer processes on 2 cores (`batchplane bench journal
  --stores local --policies dac`), the paper's DAC let 8.2 % of puts conflict under a 5 %
  budget (91.8 % success); the margin alone 6.8 %, a deferral by a whole cycle's gap alone
  4.8 %, both 0.7 % (99.3 %, 151 puts; 97.4 %, 234 puts in another run). With the deferral for
  the contenders, 2.8 % over two runs (97.2 %, 492 puts), where P was 15 s at the median
  (reading and applying the versions of the cycle, on a manifest of about 250,000 steps, under
  a load of 20), so about 12 producers contended and the deferral was 0.6 g*; and 0 of 47 puts
  conflicted at 64 producers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from batchplane.core.errors import ConfigError

#: A source of uniform random numbers in [0, 1), e.g. `random.Random(seed).random`.
RandomSource = Callable[[], float]


class CommitPolicy(Protocol):
    """When to attempt a commit (see the module docstring)."""

    name: str

    def min_steps(self) -> int:
        """Built, uncommitted steps to hold before an attempt (>= 1)."""
        ...

    def gap_s(self) -> float:
        """Seconds to wait after the end of the last attempt before the next one (>= 0)."""
        ...

    def on_attempt(self, *, success: bool, fragile_window_s: float, producers: int) -> None:
        """Takes in the outcome of an attempt.

        Args:
            success: Whether its conditional put won.
            fragile_window_s: Seconds from the read that confirmed the current version the newest
                to the end of the put.
            producers: The producer count read from the committed state (>= 1, self included).
        """
        ...

    def on_caught_up(self, *, producers: int, prepare_s: float) -> bool:
        """Takes in an attempt whose final probe found a version another producer committed
        while it prepared. True: put nothing now and wait the gap this sets (the attempt is
        deferred); False: prepare again on the newer version and put.

        Args:
            producers: The producer count read from the committed state (>= 1, self included).
            prepare_s: Seconds from the read of the version it prepared on to the final probe
                (the read, the rebase and the encoding), in which that version landed.
        """
        ...


def is_due(policy: CommitPolicy, *, pending_steps: int, since_attempt_s: float) -> bool:
    """Whether a producer should attempt a commit now.

    Args:
        policy: The producer's policy.
        pending_steps: Built steps not yet committed.
        since_attempt_s: Seconds since the end of its last attempt (math.inf before the first).

    Returns:
        True when it holds at least `min_steps` steps and the gap has passed.
    """
    return pending_steps >= max(1, policy.min_steps()) and since_attempt_s >= policy.gap_s()


class NaivePolicy:
    """Attempt as soon as one step is built, without a gap."""

    name = "naive"

    def min_steps(self) -> int:
        return 1

    def gap_s(self) -> float:
        return 0.0

    def on_attempt(self, *, success: bool, fragile_window_s: float, producers: int) -> None:
        pass

    def on_caught_up(self, *, producers: int, prepare_s: float) -> bool:
        return False


class FixedPolicy:
    """Attempt once `every` steps are built since the last successful commit.

    Args:
        every: Steps per commit (>= 1).
    """

    def __init__(self, every: int) -> None:
        _check_int("policy.every", every, low=1)
        self.every = every
        self.name = f"fixed{every}"

    def min_steps(self) -> int:
        return self.every

    def gap_s(self) -> float:
        return 0.0

    def on_attempt(self, *, success: bool, fragile_window_s: float, producers: int) -> None:
        pass

    def on_caught_up(self, *, producers: int, prepare_s: float) -> bool:
        return False


class IncrPolicy:
    """Attempt once `interval` steps are built; `interval` starts at `start` and grows by
    `increment` after each conflict.

    Args:
        start: The first interval in steps (>= 1).
        increment: Steps added per conflict (>= 1).
    """

    name = "incr"

    def __init__(self, start: int = 10, increment: int = 1) -> None:
        _check_int("policy.start", start, low=1)
        _check_int("policy.increment", increment, low=1)
        self.interval = start
        self.increment = increment

    def min_steps(self) -> int:
        return self.interval

    def gap_s(self) -> float:
        return 0.0

    def on_attempt(self, *, success: bool, fragile_window_s: float, producers: int) -> None:
        if not success:
            self.interval += self.increment

    def on_caught_up(self, *, producers: int, prepare_s: float) -> bool:
        return False


class AimdPolicy:
    """An interval in steps: `decrement` less after a success, doubled after a conflict, within
    [1, `max_interval`] (see the module docstring for the reading of the paper).

    Args:
        start: The first interval in steps.
        decrement: Steps removed per success (>= 1).
        max_interval: The largest interval in steps.
    """

    name = "aimd"

    def __init__(self, start: int = 10, decrement: int = 1, max_interval: int = 10_000) -> None:
        _check_int("policy.max_interval", max_interval, low=1)
        _check_int("policy.start", start, low=1, high=max_interval)
        _check_int("policy.decrement", decrement, low=1)
        self.interval = start
        self.decrement = decrement
        self.max_interval = max_interval

    def min_steps(self) -> int:
        return self.interval

    def gap_s(self) -> float:
        return 0.0

    def on_attempt(self, *, success: bool, fragile_window_s: float, producers: int) -> None:
        if success:
            self.interval = max(1, self.interval - self.decrement)
        else:
            self.interval = min(self.max_interval, self.interval * 2)

    def on_caught_up(self, *, producers: int, prepare_s: float) -> bool:
        return False


@dataclass(frozen=True)
class DacSettings:
    """Decentralized Adaptive Commit's budgets and filters.

    Attributes:
        conflict_budget: eps_c, the largest acceptable probability that an attempt conflicts,
            in (0, 1).
        duty_budget: eps_d, the largest fraction of a producer's time spent on manifest I/O,
            in (0, 1].
        ema_alpha: Weight of the newest fragile window in its moving average, in (0, 1].
        window_deviations: The window the gap is computed from is the moving average plus this
            many moving standard deviations of the measured windows, >= 0 (0: the average alone,
            the paper's Eq. 6). The conflict probability falls as 1 / g, so with a noisy
            estimate of W (a few attempts per producer, heavy-tailed windows on a loaded machine)
            the average gap meets the budget while the average conflict rate exceeds it
            (Jensen's inequality); the margin keeps the realized rate within the budget.
        jitter: delta, the largest relative lengthening of the gap, >= 0.
        conflict_jitter: delta_conflict, the largest relative lengthening of the gap after a
            conflict, >= 0.
        max_gap_s: A ceiling on the gap in seconds (a safety net: budgets are no longer met
            above it), > 0.
    """

    conflict_budget: float = 0.05
    duty_budget: float = 0.25
    ema_alpha: float = 0.2
    window_deviations: float = 1.0
    jitter: float = 0.2
    conflict_jitter: float = 1.0
    max_gap_s: float = 300.0

    def check(self) -> None:
        """Raises ConfigError naming a field out of range."""
        _check_open("dac.conflict_budget", self.conflict_budget, 0.0, 1.0)
        _check_open("dac.duty_budget", self.duty_budget, 0.0, 1.0, high_ok=True)
        _check_open("dac.ema_alpha", self.ema_alpha, 0.0, 1.0, high_ok=True)
        for field in ("window_deviations", "jitter", "conflict_jitter"):
            value = getattr(self, field)
            if not (math.isfinite(value) and value >= 0):
                raise ConfigError(f"dac.{field}", "must be a finite number >= 0", value)
        if not (self.max_gap_s > 0 and math.isfinite(self.max_gap_s)):
            raise ConfigError("dac.max_gap_s", "must be a finite number > 0", self.max_gap_s)


def conflict_probability(gap_s: float, fragile_window_s: float, producers: int) -> float:
    """Eq. 2: the probability that another producer's attempt lands in this attempt's fragile
    window, the others starting attempts as Poisson processes of rate 1 / (gap + window) each.

    Args:
        gap_s: The post-attempt gap g (>= 0).
        fragile_window_s: The fragile window W (>= 0).
        producers: N, self included (>= 1).

    Returns:
        1 - exp(-(N - 1) W / (g + W)); 0 when g + W is 0.
    """
    cycle = gap_s + fragile_window_s
    if cycle <= 0:
        return 0.0
    return -math.expm1(-(producers - 1) * fragile_window_s / cycle)


def duty(gap_s: float, fragile_window_s: float) -> float:
    """Eq. 3: the fraction W / (g + W) of an attempt cycle spent on manifest I/O (0 when both
    are 0)."""
    cycle = gap_s + fragile_window_s
    return fragile_window_s / cycle if cycle > 0 else 0.0


def conflict_gap_s(fragile_window_s: float, producers: float, conflict_budget: float) -> float:
    """Eq. 7: the least gap with conflict_probability <= conflict_budget (may be negative:
    every gap >= 0 then meets it): (N - 1) W / -ln(1 - eps_c) - W."""
    return (producers - 1) * fragile_window_s / -math.log1p(-conflict_budget) - fragile_window_s


def duty_gap_s(fragile_window_s: float, duty_budget: float) -> float:
    """Eq. 8: the least gap with duty <= duty_budget: W (1 - eps_d) / eps_d."""
    return fragile_window_s * (1.0 - duty_budget) / duty_budget


def smallest_feasible_gap_s(fragile_window_s: float, producers: float, *, conflict_budget: float, duty_budget: float) -> float:
    """Eq. 9: the smallest gap >= 0 that meets both budgets.

    Args:
        fragile_window_s: W (>= 0).
        producers: N, self included (>= 1; an expected count may be fractional).
        conflict_budget: eps_c in (0, 1).
        duty_budget: eps_d in (0, 1].

    Returns:
        max(0, Eq. 7, Eq. 8).
    """
    return max(0.0, conflict_gap_s(fragile_window_s, producers, conflict_budget), duty_gap_s(fragile_window_s, duty_budget))


class DacPolicy:
    """Decentralized Adaptive Commit (see the module docstring).

    Args:
        settings: Budgets and filters.
        random: Uniform numbers in [0, 1) for the jitter; give each producer its own source.

    Raises:
        ConfigError: A setting out of range.
    """

    name = "dac"

    def __init__(self, settings: DacSettings = DacSettings(), *, random: RandomSource) -> None:
        settings.check()
        self.settings = settings
        self._random = random
        self._window_s: float | None = None
        self._window_var = 0.0
        self._producers = 1
        self._optimal_s = 0.0
        self._gap_s = 0.0

    @property
    def fragile_window_s(self) -> float | None:
        """The moving average of the fragile window (Eq. 6), None before the first attempt."""
        return self._window_s

    @property
    def window_estimate_s(self) -> float | None:
        """The window the gap is computed from: the moving average plus `window_deviations`
        moving standard deviations (None before the first attempt)."""
        if self._window_s is None:
            return None
        return self._window_s + self.settings.window_deviations * math.sqrt(self._window_var)

    @property
    def optimal_gap_s(self) -> float:
        """g*, the smallest feasible gap before jitter (Eq. 9), capped at max_gap_s."""
        return self._optimal_s

    def min_steps(self) -> int:
        return 1

    def gap_s(self) -> float:
        return self._gap_s

    def on_attempt(self, *, success: bool, fragile_window_s: float, producers: int) -> None:
        s = self.settings
        window = max(0.0, fragile_window_s)
        if self._window_s is None:
            self._window_s = window
        else:  # the exponentially weighted mean and variance (West 1979)
            diff = window - self._window_s
            self._window_s += s.ema_alpha * diff
            self._window_var = (1.0 - s.ema_alpha) * (self._window_var + s.ema_alpha * diff * diff)
        self._set_gap(producers, spread=not success)

    def on_caught_up(self, *, producers: int, prepare_s: float) -> bool:
        """Defers the attempt by Eq. 9's gap for the producers it would race, spread as after a
        conflict: every producer that was preparing when a version landed caught up on that same
        version, and putting at once they would race each other for the next one, against
        Eq. 2's independent starts. Each of the other N - 1 spends prepare_s of its cycle
        g* + prepare_s + W preparing, so about (N - 1) prepare_s / (g* + prepare_s + W) others
        (at least one) caught up with it; the gap is g* for them and this producer (short
        while preparing takes a small part of a cycle, g* itself when it takes most). Before
        the first attempt (no window measured) nothing is deferred."""
        if self._window_s is None:
            return False
        s = self.settings
        window = self.window_estimate_s
        assert window is not None
        prepare = max(0.0, prepare_s)
        cycle = self._optimal_s + prepare + window
        others = max(1.0, (max(1, producers) - 1) * prepare / cycle) if cycle > 0 else 1.0
        optimal = smallest_feasible_gap_s(window, 1 + others, conflict_budget=s.conflict_budget, duty_budget=s.duty_budget)
        self._gap_s = self._jittered(optimal, spread=True)
        return True

    def _set_gap(self, producers: int, *, spread: bool) -> None:
        """Sets g* from the window estimate and `producers` (Eq. 9), and the gap g* (1 + xi)
        (Eq. 10), xi up to `conflict_jitter` when `spread`, else up to `jitter`."""
        s = self.settings
        self._producers = max(1, producers)
        estimate = self.window_estimate_s
        assert estimate is not None
        optimal = smallest_feasible_gap_s(estimate, self._producers, conflict_budget=s.conflict_budget, duty_budget=s.duty_budget)
        self._optimal_s = min(optimal, s.max_gap_s)
        self._gap_s = self._jittered(self._optimal_s, spread=spread)

    def _jittered(self, optimal_s: float, *, spread: bool) -> float:
        """Eq. 10: optimal_s (1 + xi), xi up to `conflict_jitter` when `spread`, else up to
        `jitter`, capped at max_gap_s."""
        s = self.settings
        xi = (s.conflict_jitter if spread else s.jitter) * min(max(self._random(), 0.0), 1.0)
        return min(optimal_s * (1.0 + xi), s.max_gap_s)


def make_policy(name: str, *, random: RandomSource | None = None, dac: DacSettings = DacSettings()) -> CommitPolicy:
    """A fresh policy by registry name.

    Args:
        name: One of `POLICIES`.
        random: The jitter source (required for "dac").
        dac: DAC's settings.

    Returns:
        The policy (each producer needs its own: policies keep state).

    Raises:
        ConfigError: An unknown name, a "dac" without a random source, or a bad setting.
    """
    factory = POLICIES.get(name)
    if factory is None:
        raise ConfigError("journal.commit_policy", f"must be one of {sorted(POLICIES)}", name)
    if name == "dac":
        if random is None:
            raise ConfigError("journal.commit_policy", "dac needs a random source for its jitter", name)
        return DacPolicy(dac, random=random)
    return factory()


#: Every commit policy by name; `make_policy` builds one.
POLICIES: Mapping[str, Callable[[], CommitPolicy]] = {
    "naive": NaivePolicy,
    "fixed10": lambda: FixedPolicy(10),
    "fixed100": lambda: FixedPolicy(100),
    "incr": IncrPolicy,
    "aimd": AimdPolicy,
    "dac": lambda: DacPolicy(random=lambda: 0.0),
}


def _check_int(field: str, value: int, *, low: int, high: int | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ConfigError(field, f"must be an integer {bound}", value)


def _check_open(field: str, value: float, low: float, high: float, *, high_ok: bool = False) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and low < value and (value <= high if high_ok else value < high)
    if not ok:
        raise ConfigError(field, f"must be a number in ({low}, {high}{']' if high_ok else ')'}", value)
