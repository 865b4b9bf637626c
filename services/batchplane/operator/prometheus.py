"""A small client of Prometheus's HTTP API (/api/v1/query, /api/v1/query_range): what the
operator reads each interval, the sources' sampling weights and the job's sample rates.

Standard library only (urllib); every request has a timeout. Failures raise `PrometheusError`,
whose message names the server's URL and the query. Reads only; never writes to Prometheus.

The metrics it reads are the planner's (see `batchplane.planner.metrics`):
batchplane_planner_mixture_weight_ratio{source}, batchplane_planner_samples_total{source} and
batchplane_planner_steps_planned_total, and the loaders' batchplane_loader_samples_sent_total
{source}. A job is selected by a label Prometheus attaches at scrape time (`job_label`, by
default Prometheus's own `job`, the scrape job's name): the metrics carry no job label of their
own.
"""

from __future__ import annotations

import json
import logging
import math
import socket
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping

log = logging.getLogger(__name__)

#: A series' labels, sorted by name: (("job", "test"), ("source", "a")).
Labels = tuple[tuple[str, str], ...]


class PrometheusError(RuntimeError):
    """A query failed: unreachable server, timeout, HTTP error, an error answer or one that is
    not what the API documents.

    Args:
        url: The endpoint asked, e.g. "http://127.0.0.1:9090/api/v1/query".
        query: The PromQL query.
        problem: What went wrong.
    """

    def __init__(self, url: str, query: str, problem: str) -> None:
        self.url = url
        self.query = query
        self.problem = problem
        super().__init__(f"Prometheus at {url}, query {query!r}: {problem}")


class PrometheusReader:
    """Reads batchplane's metrics from one Prometheus server.

    Args:
        url: The server's base URL, e.g. "http://prometheus.monitoring:9090" (a path prefix such
            as "/prometheus" is kept).
        timeout_s: Deadline of one HTTP request, in seconds.
        job_label: The label that tells jobs apart (Prometheus's scrape `job` by default).
    Raises:
        ValueError: a URL that is not http(s), or a timeout that is not > 0.
    """

    def __init__(self, url: str, timeout_s: float = 5.0, *, job_label: str = "job") -> None:
        parsed = urllib.parse.urlsplit(url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"prometheus url: must be http(s)://host[:port][/prefix], got {url!r}")
        if not (timeout_s > 0 and math.isfinite(timeout_s)):
            raise ValueError(f"prometheus timeout_s: must be > 0, got {timeout_s!r}")
        self.url = url.rstrip("/")
        self.timeout_s = float(timeout_s)
        self.job_label = job_label

    # ---- the raw API -------------------------------------------------------------------------

    def instant(self, query: str, *, at: float | None = None) -> dict[Labels, float]:
        """Evaluates `query` at one instant.

        Args:
            query: PromQL.
            at: Unix time to evaluate at; None: now.
        Returns:
            Value per series, keyed by its sorted labels (a scalar result is keyed by ()).
        Raises:
            PrometheusError: see the class.
        """
        params = {"query": query}
        if at is not None:
            params["time"] = f"{at:.3f}"
        url, data = self._call("query", params)
        kind, result = data.get("resultType"), data.get("result")
        try:
            if kind == "vector":
                return {_labels(item["metric"]): _value(item["value"][1]) for item in result}
            if kind == "scalar":
                return {(): _value(result[1])}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PrometheusError(url, query, f"malformed {kind} result: {exc!r}") from exc
        raise PrometheusError(url, query, f"expected a vector or scalar result, got resultType {kind!r}")

    def range(self, query: str, *, start: float, end: float, step_s: float) -> dict[Labels, list[tuple[float, float]]]:
        """Evaluates `query` over [start, end] every `step_s` seconds.

        Args:
            query: PromQL.
            start: Unix time of the first point.
            end: Unix time of the last point.
            step_s: Seconds between points, > 0.
        Returns:
            (unix time, value) points per series, keyed by its sorted labels.
        Raises:
            PrometheusError: see the class.
        """
        params = {"query": query, "start": f"{start:.3f}", "end": f"{end:.3f}", "step": f"{step_s:g}"}
        url, data = self._call("query_range", params)
        kind, result = data.get("resultType"), data.get("result")
        if kind != "matrix":
            raise PrometheusError(url, query, f"expected a matrix result, got resultType {kind!r}")
        try:
            return {_labels(item["metric"]): [(float(t), _value(v)) for t, v in item["values"]] for item in result}
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise PrometheusError(url, query, f"malformed matrix result: {exc!r}") from exc

    # ---- batchplane's metrics -----------------------------------------------------------------

    def mixture_weights(self, job: str | None = None) -> dict[str, float]:
        """Each source's sampling weight at the planner's latest planned step (its share of the
        samples, 0..1), from batchplane_planner_mixture_weight_ratio.

        Args:
            job: Value of `job_label` to select; None: every job the server scrapes (a source
                name in two jobs is then ambiguous and raises).
        Raises:
            PrometheusError: see the class, or two series for one source.
        """
        query = f"batchplane_planner_mixture_weight_ratio{self._selector(job)}"
        return self._by_source(query, self.instant(query))

    def sample_rate(self, window_s: float = 30.0, job: str | None = None) -> dict[str, float]:
        """Samples per second the planner planned of each source over the last `window_s`
        seconds (rate of batchplane_planner_samples_total): what the trainers consume.

        Args:
            window_s: The rate's window in seconds; at least two scrape intervals.
            job: As in `mixture_weights`.
        Raises:
            PrometheusError: see the class.
        """
        query = f"sum by (source) (rate(batchplane_planner_samples_total{self._selector(job)}[{_duration(window_s)}]))"
        return self._by_source(query, self.instant(query))

    def loader_sample_rate(self, window_s: float = 30.0, job: str | None = None) -> dict[str, float]:
        """Samples per second the loaders sent of each source over the last `window_s` seconds
        (rate of batchplane_loader_samples_sent_total, summed over the loaders).

        Args:
            window_s: The rate's window in seconds.
            job: As in `mixture_weights`.
        Raises:
            PrometheusError: see the class.
        """
        query = f"sum by (source) (rate(batchplane_loader_samples_sent_total{self._selector(job)}[{_duration(window_s)}]))"
        return self._by_source(query, self.instant(query))

    def step_rate(self, window_s: float = 30.0, job: str | None = None) -> float | None:
        """Steps per second the planner planned over the last `window_s` seconds; None before
        the planner has been scraped twice in the window.

        Raises:
            PrometheusError: see the class.
        """
        query = f"sum(rate(batchplane_planner_steps_planned_total{self._selector(job)}[{_duration(window_s)}]))"
        values = self.instant(query)
        return next(iter(values.values())) if values else None

    def steps_planned(self, job: str | None = None) -> float | None:
        """Steps the planner has planned since it started; None before its first scrape.

        Raises:
            PrometheusError: see the class.
        """
        query = f"sum(batchplane_planner_steps_planned_total{self._selector(job)})"
        values = self.instant(query)
        return next(iter(values.values())) if values else None

    # ---- plumbing -------------------------------------------------------------------------------

    def _selector(self, job: str | None) -> str:
        return "" if job is None else f'{{{self.job_label}="{_escape(job)}"}}'

    def _by_source(self, query: str, values: Mapping[Labels, float]) -> dict[str, float]:
        out: dict[str, float] = {}
        for labels, value in values.items():
            source = dict(labels).get("source")
            if source is None:
                continue
            if source in out:
                raise PrometheusError(
                    f"{self.url}/api/v1/query", query, f"two series for source {source!r}; select one job (job_label {self.job_label!r})"
                )
            out[source] = value
        return out

    def _call(self, endpoint: str, params: Mapping[str, str]) -> tuple[str, dict]:
        """POSTs `params` to /api/v1/<endpoint>; returns (the URL, the answer's `data`)."""
        url = f"{self.url}/api/v1/{endpoint}"
        query = params["query"]
        request = urllib.request.Request(
            url,
            data=urllib.parse.urlencode(params).encode(),
            headers={"Content-Type": "application/x-www-form-urlencoded", "Accept": "application/json"},
            method="POST",
        )
        try:
            with urllib.request.urlopen(request, timeout=self.timeout_s) as response:
                body = response.read()
        except urllib.error.HTTPError as exc:
            # Prometheus answers a bad query with 400 and a JSON body naming the problem.
            raise PrometheusError(url, query, f"HTTP {exc.code}: {_error_text(exc)}") from exc
        except urllib.error.URLError as exc:
            reason = exc.reason
            if isinstance(reason, (TimeoutError, socket.timeout)):
                raise PrometheusError(url, query, f"no answer within {self.timeout_s:g} s") from exc
            raise PrometheusError(url, query, f"cannot connect: {reason}") from exc
        except (TimeoutError, socket.timeout) as exc:
            raise PrometheusError(url, query, f"no answer within {self.timeout_s:g} s") from exc
        except OSError as exc:
            raise PrometheusError(url, query, f"connection failed: {exc}") from exc
        try:
            answer = json.loads(body)
        except ValueError as exc:
            raise PrometheusError(url, query, f"answer is not JSON: {body[:200]!r}") from exc
        if not isinstance(answer, dict) or answer.get("status") != "success":
            problem = answer.get("error", answer) if isinstance(answer, dict) else answer
            raise PrometheusError(url, query, f"status {answer.get('status') if isinstance(answer, dict) else None!r}: {problem}")
        for warning in answer.get("warnings", ()):
            log.warning("Prometheus at %s, query %r: %s", url, query, warning)
        data = answer.get("data")
        if not isinstance(data, dict):
            raise PrometheusError(url, query, f"answer has no data object: {str(answer)[:200]}")
        return url, data


def _labels(metric: Mapping[str, str]) -> Labels:
    return tuple(sorted(metric.items()))


def _value(text: str) -> float:
    return float(text)  # Prometheus sends numbers as strings, "NaN" and "+Inf" included


def _duration(seconds: float) -> str:
    """A PromQL duration: whole milliseconds (Prometheus accepts "1500ms")."""
    if not (seconds > 0 and math.isfinite(seconds)):
        raise ValueError(f"window_s: must be > 0, got {seconds!r}")
    return f"{max(round(seconds * 1000), 1)}ms"


def _escape(value: str) -> str:
    """A label value inside double quotes in PromQL."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _error_text(exc: urllib.error.HTTPError) -> str:
    try:
        body = exc.read()
        answer = json.loads(body)
        return f"{answer.get('errorType', 'error')}: {answer.get('error', body[:200])}"
    except (OSError, ValueError, AttributeError):
        return str(exc.reason)
