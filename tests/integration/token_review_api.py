"""A stand-in for the Kubernetes API's parts the operator's certificate issuer asks (no API
server can run on the test machines): TokenReview (authentication.k8s.io/v1 tokenreviews), which
answers for the tokens registered here as the API server answers for projected ServiceAccount
tokens — the ServiceAccount, the pod's name and uid in user.extra, the audiences the token is
for — and GET of the pods registered here; an empty DataPlane list for the operator's loop.
Served on 127.0.0.1 by a thread; `stop()` shuts it down. Every request is recorded."""

from __future__ import annotations

import dataclasses
import http.server
import json
import re
import threading
from typing import Any

from batchplane.core.issuance import POD_NAME_EXTRA, POD_UID_EXTRA


@dataclasses.dataclass
class PodToken:
    """A projected token: made for `pod` (and its uid) of ServiceAccount `account`."""

    pod: str
    uid: str
    account: str
    namespace: str
    audiences: tuple[str, ...] = ("batchplane",)


class TokenReviewApi:
    def __init__(self) -> None:
        self.tokens: dict[str, PodToken] = {}
        self.pods: dict[tuple[str, str], dict[str, Any]] = {}
        self.requests: list[tuple[str, str]] = []
        api = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                api.requests.append(("GET", self.path))
                pod = re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/?]+)", self.path)
                if pod is not None and (pod.group(1), pod.group(2)) in api.pods:
                    return self._answer(200, api.pods[(pod.group(1), pod.group(2))])
                if re.fullmatch(r"/apis/batchplane\.dev/v1alpha1/namespaces/[^/]+/dataplanes", self.path):
                    return self._answer(200, {"items": []})
                self._answer(404, {"kind": "Status", "reason": "NotFound", "message": f"{self.path} not found"})

            def do_POST(self) -> None:
                api.requests.append(("POST", self.path))
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
                if self.path != "/apis/authentication.k8s.io/v1/tokenreviews":
                    return self._answer(404, {"kind": "Status", "reason": "NotFound"})
                spec = body.get("spec", {})
                self._answer(201, {**body, "status": api.review(spec.get("token", ""), spec.get("audiences") or [])})

            def _answer(self, code: int, obj: dict) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def review(self, token: str, audiences: list[str]) -> dict[str, Any]:
        """What the API server says of `token` for `audiences`."""
        known = self.tokens.get(token)
        if known is None:
            return {"authenticated": False, "error": "invalid bearer token"}
        granted = [a for a in audiences if a in known.audiences]
        if audiences and not granted:
            return {"authenticated": False, "error": "token audiences are invalid"}
        return {
            "authenticated": True,
            "audiences": granted or list(known.audiences),
            "user": {
                "username": f"system:serviceaccount:{known.namespace}:{known.account}",
                "uid": "sa-uid",
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{known.namespace}"],
                "extra": {POD_NAME_EXTRA: [known.pod], POD_UID_EXTRA: [known.uid]},
            },
        }

    def add_pod(self, token: str, pod: dict[str, Any], *, audiences: tuple[str, ...] = ("batchplane",)) -> None:
        """Registers `pod` and a projected token made for it."""
        meta, spec = pod["metadata"], pod["spec"]
        self.pods[(meta["namespace"], meta["name"])] = pod
        self.tokens[token] = PodToken(meta["name"], meta["uid"], spec["serviceAccountName"], meta["namespace"], audiences)

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
