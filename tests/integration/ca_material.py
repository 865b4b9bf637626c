"""Certificate authorities as a cluster holds them, for tests of the issuer: an intermediate CA
signed by a root, as cert-manager issues the chart's `<name>-issuer-ca` or a company PKI hands
one out."""

from __future__ import annotations

import datetime

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from batchplane.core.localca import LocalCA, pem_key


def intermediate(root: LocalCA, name: str, *, days: int = 30) -> tuple[bytes, bytes]:
    """(certificate, key), PEM, of a CA named `name` that `root` signed."""
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
        .issuer_name(root.cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(root.key, hashes.SHA256())
    )
    return cert.public_bytes(serialization.Encoding.PEM), pem_key(key)
