"""A minimal client of the Kubernetes REST API: exactly the calls the operator makes, on the
standard library (urllib, json, ssl).

Reads: list DataPlanes and Deployments of a namespace (polling; no watches), get a Lease.
Writes: create a Deployment, merge-patch it, set its replicas through the `deployments/scale`
subresource, delete it, and merge-patch a DataPlane's `status` subresource; create a Lease and
merge-patch it with its resourceVersion as a precondition (leader election); create a core/v1
Event and merge-patch its count. Every request has a timeout and sends
fieldManager=batchplane-operator on writes. Failures raise `KubernetesError`, whose message
names the verb, the resource (kind/namespace/name[/subresource]) and the HTTP status with the
API's own reason and message.

Configuration (`KubeConfig`): in a pod, `in_cluster_config()` reads the ServiceAccount's token
and CA from /var/run/secrets/kubernetes.io/serviceaccount and the API's address from
KUBERNETES_SERVICE_HOST/PORT; elsewhere (tests) an explicit API URL, optionally with a token
and a CA file. The token file is read again every minute, since the kubelet rotates it.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import pathlib
import socket
import ssl
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping
from typing import Any

from batchplane.operator.dataplane import GROUP, PLURAL, VERSION

log = logging.getLogger(__name__)

#: Where Kubernetes mounts a pod's ServiceAccount credentials.
SERVICE_ACCOUNT_DIR = pathlib.Path("/var/run/secrets/kubernetes.io/serviceaccount")
#: The field manager recorded on what the operator writes.
FIELD_MANAGER = "batchplane-operator"
#: Seconds a read token is used before the file is read again.
TOKEN_REFRESH_S = 60.0

_DATAPLANES = f"/apis/{GROUP}/{VERSION}/namespaces/{{ns}}/{PLURAL}"
_DEPLOYMENTS = "/apis/apps/v1/namespaces/{ns}/deployments"
_LEASES = "/apis/coordination.k8s.io/v1/namespaces/{ns}/leases"
_EVENTS = "/api/v1/namespaces/{ns}/events"


class KubernetesError(RuntimeError):
    """An API request failed.

    Args:
        verb: What was asked, e.g. "PATCH".
        resource: What it was asked of, e.g. "deployments training/x-loader-text/scale".
        status: The HTTP status; None when no answer came (unreachable, timeout).
        problem: The API's reason and message, or what went wrong.
    """

    def __init__(self, verb: str, resource: str, status: int | None, problem: str) -> None:
        self.verb = verb
        self.resource = resource
        self.status = status
        self.problem = problem
        code = f"HTTP {status}" if status is not None else "no answer"
        super().__init__(f"{verb} {resource}: {code}: {problem}")


@dataclasses.dataclass(frozen=True)
class KubeConfig:
    """Where the API is and how to authenticate."""

    #: The API's base URL, e.g. "https://10.96.0.1:443" or "http://127.0.0.1:8001".
    api_url: str
    #: A file holding a bearer token; None: no Authorization header.
    token_file: pathlib.Path | None = None
    #: A CA bundle to verify the API's certificate; None: the system's.
    ca_file: pathlib.Path | None = None
    #: Deadline of one request, in seconds.
    timeout_s: float = 10.0


def in_cluster_config(env: Mapping[str, str], *, timeout_s: float = 10.0, directory: pathlib.Path = SERVICE_ACCOUNT_DIR) -> KubeConfig:
    """The configuration of a pod with a mounted ServiceAccount token.

    Args:
        env: The environment (KUBERNETES_SERVICE_HOST, KUBERNETES_SERVICE_PORT).
        timeout_s: Deadline of one request.
        directory: Where the token and CA are mounted.
    Raises:
        KubernetesError: not in a pod (no KUBERNETES_SERVICE_HOST or no token).
    """
    host, port = env.get("KUBERNETES_SERVICE_HOST"), env.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        raise KubernetesError("CONFIG", "in-cluster", None, "KUBERNETES_SERVICE_HOST is not set: not in a pod; pass --kube-api URL")
    token = directory / "token"
    if not token.is_file():
        raise KubernetesError("CONFIG", "in-cluster", None, f"no ServiceAccount token at {token}; pass --kube-api and --token-file")
    ca = directory / "ca.crt"
    host = f"[{host}]" if ":" in host else host
    return KubeConfig(f"https://{host}:{port}", token, ca if ca.is_file() else None, timeout_s)


def in_cluster_namespace(directory: pathlib.Path = SERVICE_ACCOUNT_DIR) -> str | None:
    """The pod's namespace from its ServiceAccount mount; None outside a pod."""
    try:
        return (directory / "namespace").read_text().strip() or None
    except OSError:
        return None


class KubernetesClient:
    """The operator's calls to the Kubernetes API; thread-safe.

    Args:
        config: Where the API is and how to authenticate.
    Raises:
        ValueError: an API URL that is not http(s).
    """

    def __init__(self, config: KubeConfig) -> None:
        parsed = urllib.parse.urlsplit(config.api_url)
        if parsed.scheme not in ("http", "https") or not parsed.netloc:
            raise ValueError(f"kube api url: must be http(s)://host[:port], got {config.api_url!r}")
        self.config = config
        self.base = config.api_url.rstrip("/")
        self._ssl = ssl.create_default_context(cafile=str(config.ca_file) if config.ca_file else None) if parsed.scheme == "https" else None
        self._token: tuple[str, float] | None = None
        self._lock = threading.Lock()

    # ---- DataPlanes ---------------------------------------------------------------------------

    def list_dataplanes(self, namespace: str) -> list[dict[str, Any]]:
        """Every DataPlane of `namespace`."""
        path = _DATAPLANES.format(ns=_quote(namespace))
        return self._request("GET", path, f"{PLURAL} {namespace}/*")["items"]

    def patch_dataplane_status(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patches the status subresource of DataPlane `name` with `patch` ({"status": ...})."""
        path = f"{_DATAPLANES.format(ns=_quote(namespace))}/{_quote(name)}/status"
        return self._request("PATCH", path, f"{PLURAL} {namespace}/{name}/status", body=patch, merge=True)

    # ---- Deployments -----------------------------------------------------------------------------

    def list_deployments(self, namespace: str, label_selector: str) -> list[dict[str, Any]]:
        """Deployments of `namespace` that match `label_selector` ("k=v,k2=v2")."""
        path = f"{_DEPLOYMENTS.format(ns=_quote(namespace))}?{urllib.parse.urlencode({'labelSelector': label_selector})}"
        return self._request("GET", path, f"deployments {namespace}/* ({label_selector})")["items"]

    def create_deployment(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Creates a Deployment; an existing one of the same name raises (HTTP 409)."""
        name = body.get("metadata", {}).get("name", "?")
        path = f"{_DEPLOYMENTS.format(ns=_quote(namespace))}?fieldManager={FIELD_MANAGER}"
        return self._request("POST", path, f"deployments {namespace}/{name}", body=body)

    def patch_deployment(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patches Deployment `name`."""
        path = f"{_DEPLOYMENTS.format(ns=_quote(namespace))}/{_quote(name)}?fieldManager={FIELD_MANAGER}"
        return self._request("PATCH", path, f"deployments {namespace}/{name}", body=patch, merge=True)

    def scale_deployment(self, namespace: str, name: str, replicas: int) -> dict[str, Any]:
        """Sets Deployment `name`'s replicas through its scale subresource."""
        path = f"{_DEPLOYMENTS.format(ns=_quote(namespace))}/{_quote(name)}/scale?fieldManager={FIELD_MANAGER}"
        return self._request("PATCH", path, f"deployments {namespace}/{name}/scale", body={"spec": {"replicas": int(replicas)}}, merge=True)

    def delete_deployment(self, namespace: str, name: str) -> dict[str, Any]:
        """Deletes Deployment `name`; its pods go with it (background propagation)."""
        path = f"{_DEPLOYMENTS.format(ns=_quote(namespace))}/{_quote(name)}?propagationPolicy=Background"
        return self._request("DELETE", path, f"deployments {namespace}/{name}")

    # ---- Leases (leader election) -----------------------------------------------------------------

    def get_lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Lease `name`, or None when there is none (HTTP 404)."""
        return self._get_or_none(f"{_LEASES.format(ns=_quote(namespace))}/{_quote(name)}", f"leases {namespace}/{name}")

    def create_lease(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Creates a Lease; one that exists already raises (HTTP 409: another candidate was first)."""
        name = body.get("metadata", {}).get("name", "?")
        path = f"{_LEASES.format(ns=_quote(namespace))}?fieldManager={FIELD_MANAGER}"
        return self._request("POST", path, f"leases {namespace}/{name}", body=body)

    def update_lease(self, namespace: str, name: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patches Lease `name` with `body`, whose metadata.resourceVersion is the version
        read: the API server refuses the write (HTTP 409 Conflict) when the Lease changed since."""
        path = f"{_LEASES.format(ns=_quote(namespace))}/{_quote(name)}?fieldManager={FIELD_MANAGER}"
        return self._request("PATCH", path, f"leases {namespace}/{name}", body=body, merge=True)

    # ---- Events -----------------------------------------------------------------------------------

    def create_event(self, namespace: str, body: Mapping[str, Any]) -> dict[str, Any]:
        """Creates a core/v1 Event."""
        name = body.get("metadata", {}).get("name", "?")
        path = f"{_EVENTS.format(ns=_quote(namespace))}?fieldManager={FIELD_MANAGER}"
        return self._request("POST", path, f"events {namespace}/{name}", body=body)

    def patch_event(self, namespace: str, name: str, patch: Mapping[str, Any]) -> dict[str, Any]:
        """Merge-patches Event `name` (a repeat's count and lastTimestamp); HTTP 404 when it expired."""
        path = f"{_EVENTS.format(ns=_quote(namespace))}/{_quote(name)}?fieldManager={FIELD_MANAGER}"
        return self._request("PATCH", path, f"events {namespace}/{name}", body=patch, merge=True)

    # ---- the issuer (tls.mode issued) ------------------------------------------------------------

    def review_token(self, token: str, audience: str) -> dict[str, Any]:
        """The status of a TokenReview of `token` for `audience` (authentication.k8s.io/v1)."""
        body = {"apiVersion": "authentication.k8s.io/v1", "kind": "TokenReview", "spec": {"token": token, "audiences": [audience]}}
        answer = self._request("POST", "/apis/authentication.k8s.io/v1/tokenreviews", "tokenreviews", body=body)
        status = answer.get("status")
        return status if isinstance(status, dict) else {}

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """Pod `name`, or None when there is none (HTTP 404)."""
        return self._get_or_none(f"/api/v1/namespaces/{_quote(namespace)}/pods/{_quote(name)}", f"pods {namespace}/{name}")

    # ---- plumbing -------------------------------------------------------------------------------

    def _request(
        self, verb: str, path: str, resource: str, *, body: Mapping[str, Any] | None = None, merge: bool = False
    ) -> dict[str, Any]:
        headers = {"Accept": "application/json", "User-Agent": FIELD_MANAGER}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/merge-patch+json" if merge else "application/json"
        token = self._bearer(verb, resource)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        request = urllib.request.Request(self.base + path, data=data, headers=headers, method=verb)
        try:
            with urllib.request.urlopen(request, timeout=self.config.timeout_s, context=self._ssl) as response:
                raw = response.read()
        except urllib.error.HTTPError as exc:
            raise KubernetesError(verb, resource, exc.code, _api_problem(exc)) from None
        except urllib.error.URLError as exc:
            if isinstance(exc.reason, (TimeoutError, socket.timeout)):
                raise KubernetesError(verb, resource, None, f"no answer within {self.config.timeout_s:g} s from {self.base}") from None
            raise KubernetesError(verb, resource, None, f"cannot connect to {self.base}: {exc.reason}") from None
        except (TimeoutError, socket.timeout):
            raise KubernetesError(verb, resource, None, f"no answer within {self.config.timeout_s:g} s from {self.base}") from None
        except OSError as exc:
            raise KubernetesError(verb, resource, None, f"connection to {self.base} failed: {exc}") from None
        try:
            answer = json.loads(raw) if raw else {}
        except ValueError:
            raise KubernetesError(verb, resource, 200, f"answer is not JSON: {raw[:200]!r}") from None
        if not isinstance(answer, dict):
            raise KubernetesError(verb, resource, 200, f"answer is not a JSON object: {raw[:200]!r}")
        return answer

    def _get_or_none(self, path: str, resource: str) -> dict[str, Any] | None:
        try:
            return self._request("GET", path, resource)
        except KubernetesError as exc:
            if exc.status == 404:
                return None
            raise

    def _bearer(self, verb: str, resource: str) -> str | None:
        if self.config.token_file is None:
            return None
        with self._lock:
            now = time.monotonic()
            if self._token is None or now - self._token[1] >= TOKEN_REFRESH_S:
                try:
                    self._token = (self.config.token_file.read_text().strip(), now)
                except OSError as exc:
                    raise KubernetesError(verb, resource, None, f"cannot read the token file {self.config.token_file}: {exc}") from None
            return self._token[0]


def _api_problem(exc: urllib.error.HTTPError) -> str:
    """The API's Status reason and message, or the HTTP reason."""
    try:
        answer = json.loads(exc.read())
        reason, message = answer.get("reason"), answer.get("message")
        if reason or message:
            return f"{reason or exc.reason}: {message or ''}".rstrip(": ")
    except (OSError, ValueError, AttributeError):
        pass
    return str(exc.reason)


def _quote(segment: str) -> str:
    return urllib.parse.quote(segment, safe="")
