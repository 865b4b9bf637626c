"""Transport security of a process: mutual TLS between the parts from a mounted certificate
folder, local credentials on the constructor's socket, optional bearer tokens per role, and the
identity of each caller for core.authz.

Certificates rotate without restarts. A server's credentials are dynamic: gRPC asks for the
current certificate on every handshake, and gets a new one once the files changed. A Python
channel cannot reload its credentials, so `ReloadingChannel` builds a new channel when the files
change and sends every later call through it (calls in flight finish on the old one).

The certificate folder holds `ca.crt`, `tls.crt` and `tls.key`, the keys of a cert-manager or
`kubernetes.io/tls` Secret. Mount it as a folder: a Secret mounted with subPath never changes.
"""

from __future__ import annotations

import dataclasses
import hmac
import logging
import pathlib
import re
import ssl
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

import grpc

from batchplane.core.errors import ConfigError, Unauthenticated
from batchplane.core.identity import CERTIFIED_ROLES, TRAINER, VERIFIER_SUFFIX, Identity, identity_of_names, server_name, token_verifier

log = logging.getLogger(__name__)

CA_FILE, CERT_FILE, KEY_FILE = "ca.crt", "tls.crt", "tls.key"
#: How often a server handshake or a channel call looks at the certificate files' stamps.
RELOAD_CHECK_S = 1.0
#: The metadata key of a bearer token.
TOKEN_KEY = "authorization"

TLS_OFF_WARNING = (
    "network.tls is off: the parts talk plaintext and authenticate nobody; any process that "
    "reaches their ports can read training data, register as a loader, ask for any rank's "
    "batches and stall the job. Use it only on a network nothing else can reach."
)


@dataclasses.dataclass(frozen=True)
class CertificateFolder:
    """A folder holding ca.crt, tls.crt and tls.key (PEM)."""

    path: pathlib.Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(CA certificates, certificate chain, private key).

        Raises:
            ConfigError: a file missing, unreadable or not PEM (naming it).
        """
        return tuple(self._read(name) for name in (CA_FILE, CERT_FILE, KEY_FILE))  # type: ignore[return-value]

    def _read(self, name: str) -> bytes:
        path = self.path / name
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise ConfigError("--tls-dir", f"cannot read {path}: {exc.strerror or exc}", str(self.path)) from None
        if b"-----BEGIN " not in data:
            raise ConfigError("--tls-dir", f"{path} is not PEM", str(self.path))
        return data

    def stamp(self) -> tuple:
        """Changes whenever a file is replaced or rewritten (Kubernetes swaps a symlink)."""
        return files_stamp(self.path, (CA_FILE, CERT_FILE, KEY_FILE))


def files_stamp(folder: pathlib.Path, names: tuple[str, ...]) -> tuple:
    """Changes whenever one of the files is replaced or rewritten; () while one is missing."""
    stamps = []
    for name in names:
        try:
            st = (folder / name).stat()
        except OSError:
            return ()
        stamps.append((st.st_ino, st.st_mtime_ns, st.st_size))
    return tuple(stamps)


class _Reloader:
    """Reads a certificate folder again when its stamp changed, at most once a RELOAD_CHECK_S."""

    def __init__(self, folder: CertificateFolder, on_reload: Callable[[], None]) -> None:
        self.folder = folder
        self._on_reload = on_reload
        self._lock = threading.Lock()
        self._checked = time.monotonic()
        self._stamp = folder.stamp()
        self.material = folder.read()

    def changed(self) -> bool:
        """True (once) when the files changed and were read again; a half-written or broken
        folder keeps the material read last (logged)."""
        now = time.monotonic()
        if now - self._checked < RELOAD_CHECK_S:
            return False
        with self._lock:
            self._checked = now
            stamp = self.folder.stamp()
            if not stamp or stamp == self._stamp:
                return False
            try:
                material = self.folder.read()
            except ConfigError as exc:
                log.warning("certificates changed but cannot be read (keeping the previous ones): %s", exc)
                return False
            self._stamp, self.material = stamp, material
        log.info("certificates in %s changed: using the new ones", self.folder.path)
        self._on_reload()
        return True


def read_token(path: pathlib.Path, field: str) -> str:
    """A bearer token from a file (surrounding whitespace dropped).

    Raises:
        ConfigError: unreadable or empty (a process never starts without the token it was given).
    """
    try:
        token = path.read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(field, f"cannot read token file {path}: {exc}", str(path)) from None
    if not token:
        raise ConfigError(field, f"token file {path} is empty", str(path))
    return token


def read_role_verifiers(folder: pathlib.Path) -> dict[str, bytes]:
    """Each role's token verifier from a folder with a file per role: `<role>.sha256`, the hex
    SHA-256 of the role's token (the server then never holds another role's token), else
    `<role>`, the token itself (hashed as it is read; only the digest is kept).

    Raises:
        ConfigError: the folder unreadable, holding no role's file, or a verifier that is not a
            SHA-256 in hex.
    """
    if not folder.is_dir():
        raise ConfigError("--auth-tokens", "must be a folder with one token (or token verifier) file per role", str(folder))
    verifiers = {}
    for role in CERTIFIED_ROLES:
        digest = folder / f"{role}{VERIFIER_SUFFIX}"
        if digest.exists():
            text = read_token(digest, "--auth-tokens")
            if not re.fullmatch(r"[0-9a-fA-F]{64}", text):
                raise ConfigError("--auth-tokens", f"{digest} must hold a SHA-256 in hex (64 hex digits)", str(digest))
            verifiers[role] = bytes.fromhex(text)
        elif (folder / role).exists():
            verifiers[role] = token_verifier(read_token(folder / role, "--auth-tokens"))
    if not verifiers:
        names = ", ".join(f"{r} or {r}{VERIFIER_SUFFIX}" for r in CERTIFIED_ROLES)
        raise ConfigError("--auth-tokens", f"holds none of the role files ({names})", str(folder))
    return verifiers


class Security:
    """The transport security of one process.

    Args:
        certificates: The process's certificate folder; None: TLS off (plaintext, no checks).
        token: The bearer token this process sends with its calls, if any.
        role_tokens: Role -> token this process's server accepts (only their digests are kept).
        role_verifiers: Role -> the SHA-256 of the token it accepts (`read_role_verifiers`).
            Neither: certificates alone name the caller.
        on_reload: Called after a rotated certificate was read (a metric).
    """

    def __init__(
        self,
        certificates: CertificateFolder | None,
        *,
        token: str | None = None,
        role_tokens: Mapping[str, str] | None = None,
        role_verifiers: Mapping[str, bytes] | None = None,
        on_reload: Callable[[], None] = lambda: None,
    ) -> None:
        self.certificates = certificates
        self.token = token
        self.role_verifiers = {**{role: token_verifier(t) for role, t in (role_tokens or {}).items()}, **(role_verifiers or {})}
        self._on_reload = on_reload
        if certificates is not None:
            certificates.read()  # fail at start on a missing or broken file

    @property
    def enabled(self) -> bool:
        return self.certificates is not None

    # ---- servers ------------------------------------------------------------------------

    def add_port(self, server: grpc.Server, address: str) -> int:
        """Binds `address` with mutual TLS (plaintext when off); returns the bound port."""
        if self.certificates is None:
            return server.add_insecure_port(address)
        reloader = _Reloader(self.certificates, self._on_reload)

        def configuration(material: tuple[bytes, bytes, bytes]) -> Any:
            ca, cert, key = material
            return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

        def fetch() -> Any:  # every handshake; None keeps the current configuration
            return configuration(reloader.material) if reloader.changed() else None

        credentials = grpc.dynamic_ssl_server_credentials(configuration(reloader.material), fetch, require_client_authentication=True)
        return server.add_secure_port(address, credentials)

    def add_local_port(self, server: grpc.Server, address: str) -> int:
        """Binds the trainer's side of a constructor: local credentials (a Unix socket, or
        loopback TCP only) when TLS is on, plaintext when off."""
        if self.certificates is None:
            return server.add_insecure_port(address)
        kind = grpc.LocalConnectionType.UDS if address.startswith("unix:") else grpc.LocalConnectionType.LOCAL_TCP
        return server.add_secure_port(address, grpc.local_server_credentials(kind))

    def identify(self, context: grpc.ServicerContext) -> Identity | None:
        """The caller of an RPC; None when TLS is off (every call allowed).

        Raises:
            Unauthenticated: no certificate naming a role and no valid token; a token and a
                certificate naming different roles.
        """
        if self.certificates is None:
            return None
        auth = context.auth_context()
        kind = (auth.get("transport_security_type") or [b""])[0]
        if kind == b"local":
            return Identity(TRAINER)
        names = [n.decode("utf-8", "replace") for n in auth.get("x509_subject_alternative_name", [])]
        try:
            certified = identity_of_names(names)
        except Exception as exc:  # noqa: BLE001 - a malformed name is the caller's problem
            raise Unauthenticated(f"the client certificate's identity is not usable: {exc}") from None
        if self.role_verifiers:
            role = self._role_of_token(context)
            if certified is not None and certified.role != role:
                raise Unauthenticated(f"the token is a {role}'s but the certificate names {certified}")
            return certified or Identity(role)
        if certified is None:
            raise Unauthenticated("the client certificate names no batchplane:// identity")
        return certified

    def _role_of_token(self, context: grpc.ServicerContext) -> str:
        sent = ""
        for key, value in context.invocation_metadata():
            if key == TOKEN_KEY and isinstance(value, str) and value.startswith("Bearer "):
                sent = value[len("Bearer ") :]
        digest = token_verifier(sent)
        matches = [role for role, verifier in self.role_verifiers.items() if hmac.compare_digest(verifier, digest)]
        if not sent or not matches:
            raise Unauthenticated("no valid bearer token")
        return matches[0]

    # ---- channels -----------------------------------------------------------------------

    def channel(self, address: str, *, peer: str, options: list[tuple[str, Any]] | None = None) -> grpc.Channel:
        """A channel to a part of role `peer` ("planner", "loader"), checked to be one (its
        certificate names `<peer>.batchplane`), carrying this process's certificate and token."""
        options = list(options or [])
        if self.certificates is None:
            return grpc.insecure_channel(address, options=options)
        return ReloadingChannel(lambda material: self._open(address, peer, options, material), self.certificates, self._on_reload)

    def _open(self, address: str, peer: str, options: list[tuple[str, Any]], material: tuple[bytes, bytes, bytes]) -> grpc.Channel:
        ca, cert, key = material
        credentials = grpc.ssl_channel_credentials(root_certificates=ca, private_key=key, certificate_chain=cert)
        if self.token:
            credentials = grpc.composite_channel_credentials(credentials, grpc.access_token_call_credentials(self.token))
        return grpc.secure_channel(address, credentials, options=[*options, ("grpc.ssl_target_name_override", server_name(peer))])


class ReloadingChannel(grpc.Channel):
    """A channel that builds itself again when its certificate folder changes.

    Stubs hold multicallables; each one looks up the current channel on every call, so a stub
    made once keeps working across rotations. Calls in flight finish on the channel they began
    on; replaced channels are closed with this one.
    """

    def __init__(
        self, open_channel: Callable[[tuple[bytes, bytes, bytes]], grpc.Channel], folder: CertificateFolder, on_reload: Callable[[], None]
    ) -> None:
        self._open = open_channel
        self._reloader = _Reloader(folder, on_reload)
        self._lock = threading.Lock()
        self._channel = open_channel(self._reloader.material)
        self._generation = 0
        self._replaced: list[grpc.Channel] = []

    def current(self) -> tuple[grpc.Channel, int]:
        if self._reloader.changed():
            with self._lock:
                self._replaced.append(self._channel)
                self._channel = self._open(self._reloader.material)
                self._generation += 1
        return self._channel, self._generation

    def _multicallable(self, kind: str, method: str, *args: Any, **kwargs: Any) -> _MultiCallable:
        return _MultiCallable(self, lambda channel: getattr(channel, kind)(method, *args, **kwargs))

    def unary_unary(self, method, *args, **kwargs):  # noqa: ANN001, ANN201 - grpc.Channel's signature
        return self._multicallable("unary_unary", method, *args, **kwargs)

    def unary_stream(self, method, *args, **kwargs):  # noqa: ANN001, ANN201
        return self._multicallable("unary_stream", method, *args, **kwargs)

    def stream_unary(self, method, *args, **kwargs):  # noqa: ANN001, ANN201
        return self._multicallable("stream_unary", method, *args, **kwargs)

    def stream_stream(self, method, *args, **kwargs):  # noqa: ANN001, ANN201
        return self._multicallable("stream_stream", method, *args, **kwargs)

    def subscribe(self, callback, try_to_connect=False):  # noqa: ANN001, ANN201
        self.current()[0].subscribe(callback, try_to_connect)

    def unsubscribe(self, callback):  # noqa: ANN001, ANN201
        self.current()[0].unsubscribe(callback)

    def close(self) -> None:
        with self._lock:
            for channel in (*self._replaced, self._channel):
                channel.close()
            self._replaced.clear()

    def __enter__(self) -> ReloadingChannel:
        return self

    def __exit__(self, *exc: object) -> bool:
        self.close()
        return False


class _MultiCallable:
    """A multicallable bound to whichever channel is current when it is called."""

    def __init__(self, owner: ReloadingChannel, make: Callable[[grpc.Channel], Any]) -> None:
        self._owner = owner
        self._make = make
        self._made: tuple[int, Any] = (-1, None)

    def _target(self) -> Any:
        channel, generation = self._owner.current()
        made_generation, made = self._made
        if made_generation != generation:
            made = self._make(channel)
            self._made = (generation, made)
        return made

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._target()(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:  # with_call, future
        return getattr(self._target(), name)


def process_security(
    *,
    tls: bool,
    tls_dir: pathlib.Path | None,
    token_file: pathlib.Path | None,
    auth_tokens: pathlib.Path | None,
    on_reload: Callable[[], None] = lambda: None,
) -> Security:
    """A process's security from the job's `network.tls` and its flags.

    Raises:
        ConfigError: TLS on without --tls-dir, or a certificate or token file that cannot be read.
    """
    token = read_token(token_file, "--token-file") if token_file is not None else None
    verifiers = read_role_verifiers(auth_tokens) if auth_tokens is not None else None
    if not tls:
        log.warning(TLS_OFF_WARNING)
        return Security(None, token=token, role_verifiers=verifiers)
    if tls_dir is None:
        raise ConfigError(
            "network.tls",
            f"is on, so every part needs --tls-dir (a folder with {CA_FILE}, {CERT_FILE}, {KEY_FILE}); "
            "set network.tls: off only on a network nothing else can reach",
            True,
        )
    return Security(CertificateFolder(tls_dir), token=token, role_verifiers=verifiers, on_reload=on_reload)


def metrics_tls(folder: pathlib.Path) -> ssl.SSLContext:
    """A server context for the metrics endpoint (`core.metrics.start_metrics_server`) from a
    certificate folder (tls.crt, tls.key).

    Raises:
        ConfigError: the folder's certificate or key cannot be loaded.
    """
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(folder / CERT_FILE, folder / KEY_FILE)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError("--metrics-tls-dir", f"cannot load {folder / CERT_FILE} and {folder / KEY_FILE}: {exc}", str(folder)) from None
    return context
