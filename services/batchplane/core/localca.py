"""A throwaway certificate authority for a job on one machine: `batchplane up` makes one and
issues every process a certificate naming its identity, so the tested path is the production
path (mutual TLS, one identity per part). Its key lives in the launcher's memory only: the
services run as the same user, so any file would be theirs to read, and a service running
compromised user code (a transform, a hook) could mint any identity with it. Each service gets
its own leaf. Tests mint certificates of any identity from the launcher's CA.

A certificate folder is written the way Kubernetes writes a mounted Secret: the files live in a
fresh sub-folder and `..data` is a symlink swapped atomically, with ca.crt, tls.crt and tls.key
linking through it. A reader never sees a new certificate with an old key.
"""

from __future__ import annotations

import datetime
import os
import pathlib
import time

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from batchplane.core.errors import ConfigError
from batchplane.core.identity import Identity, server_name
from batchplane.core.tls import CA_FILE, CERT_FILE, KEY_FILE

#: How long the local CA and the certificates it issues are valid.
CA_DAYS = 365
LEAF_DAYS = 30
#: Clock skew allowed between processes.
_SKEW = datetime.timedelta(minutes=5)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.timezone.utc)


def pem_key(key: ec.EllipticCurvePrivateKey) -> bytes:
    """A private key as PEM (PKCS #8, unencrypted): what a certificate folder's tls.key holds."""
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())


class LocalCA:
    """A CA whose key lies in memory, or in `folder` (ca.key readable by its owner only).

    Args:
        folder: Where ca.crt and ca.key are kept (made when missing or expiring within a day);
            None: the key is never written (`batchplane up`'s CA).
        name: The CA's common name (the job's name).
    """

    key: ec.EllipticCurvePrivateKey
    #: The CA's certificate file as read (`load`: it may hold the CAs above it too).
    file: bytes

    def __init__(self, folder: pathlib.Path | None, *, name: str = "batchplane") -> None:
        self.folder = folder
        if folder is not None:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            cert_path, key_path = folder / CA_FILE, folder / "ca.key"
            if cert_path.exists() and key_path.exists():
                self.cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
                key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
                if isinstance(key, ec.EllipticCurvePrivateKey) and self.cert.not_valid_after_utc - _now() > datetime.timedelta(days=1):
                    self.key, self.file = key, self.pem
                    return
        self.key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, f"{name} local CA")])
        self.cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(self.key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - _SKEW)
            .not_valid_after(_now() + datetime.timedelta(days=CA_DAYS))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    key_cert_sign=True,
                    crl_sign=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .sign(self.key, hashes.SHA256())
        )
        self.file = self.pem
        if folder is not None:
            _write_private(folder / "ca.key", pem_key(self.key))
            (folder / CA_FILE).write_bytes(self.pem)

    @classmethod
    def load(cls, folder: pathlib.Path) -> LocalCA:
        """The CA whose ca.crt and ca.key lie in `folder` (e.g. a mounted Secret), never made anew.

        Raises:
            ConfigError: a file is missing or not a CA certificate and its EC key.
        """
        ca = cls.__new__(cls)
        ca.folder = folder
        try:
            ca.file = (folder / CA_FILE).read_bytes()
            ca.cert = x509.load_pem_x509_certificates(ca.file)[0]
            key = serialization.load_pem_private_key((folder / "ca.key").read_bytes(), password=None)
        except (OSError, ValueError) as exc:
            raise ConfigError(str(folder), f"must hold the CA's {CA_FILE} and ca.key (PEM): {exc}", None) from None
        if not isinstance(key, ec.EllipticCurvePrivateKey) or key.public_key() != ca.cert.public_key():
            raise ConfigError(str(folder / "ca.key"), f"must be the EC key of {CA_FILE}", None)
        ca.key = key
        return ca

    @property
    def pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    @property
    def chain(self) -> bytes:
        """What follows a certificate it signed in a certificate file, so peers that trust only
        the root can verify it: nothing when this CA is a root; its file (itself, and the CAs
        above it that the file holds) when it is an intermediate, e.g. a CA certificate that
        cert-manager issues and renews from the cluster's own issuer."""
        return b"" if self.cert.issuer == self.cert.subject else self.file

    def issue(self, identity: Identity, folder: pathlib.Path, *, days: int = LEAF_DAYS) -> pathlib.Path:
        """Writes a certificate folder (ca.crt, tls.crt, tls.key) for `identity`, replacing
        what is there atomically; returns `folder`."""
        key = ec.generate_private_key(ec.SECP256R1())
        cert = self.sign(identity, key.public_key(), lifetime=datetime.timedelta(days=days))
        write_certificate_folder(folder, ca=self.pem, cert=cert, key=pem_key(key))
        return folder

    def sign(self, identity: Identity, public_key: ec.EllipticCurvePublicKey, *, lifetime: datetime.timedelta) -> bytes:
        """A certificate (PEM) of `public_key` for `identity`, valid for `lifetime`. It serves and
        authenticates: its names are the identity's URI and `<role>.batchplane`."""
        names: list[x509.GeneralName] = [x509.UniformResourceIdentifier(identity.uri())]
        if identity.role != "trainer":
            names.insert(0, x509.DNSName(server_name(identity.role)))
        cert = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, identity.uri()[:64])]))
            .issuer_name(self.cert.subject)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(_now() - _SKEW)
            .not_valid_after(min(_now() + lifetime, self.cert.not_valid_after_utc))
            .add_extension(x509.SubjectAlternativeName(names), critical=False)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        return cert.public_bytes(serialization.Encoding.PEM)


def write_certificate_folder(folder: pathlib.Path, *, ca: bytes, cert: bytes, key: bytes) -> None:
    """Writes the three files as Kubernetes writes a Secret volume: into a new `..<stamp>`
    folder, then `..data` swapped to it by one rename; the previous version is removed."""
    folder.mkdir(parents=True, exist_ok=True, mode=0o700)
    version = folder / f"..{time.time_ns()}"
    version.mkdir(mode=0o700)
    (version / CA_FILE).write_bytes(ca)
    (version / CERT_FILE).write_bytes(cert)
    _write_private(version / KEY_FILE, key)
    data = folder / "..data"
    previous = os.readlink(data) if data.is_symlink() else None
    swap = folder / "..data_tmp"
    swap.unlink(missing_ok=True)
    swap.symlink_to(version.name)
    os.replace(swap, data)
    for name in (CA_FILE, CERT_FILE, KEY_FILE):
        link = folder / name
        if not link.is_symlink():
            link.unlink(missing_ok=True)
            link.symlink_to(f"..data/{name}")
    if previous is not None and previous != version.name:
        for old in (folder / previous).iterdir():
            old.unlink()
        (folder / previous).rmdir()


def _write_private(path: pathlib.Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
