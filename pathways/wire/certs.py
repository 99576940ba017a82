"""Throwaway TLS certificates: a certificate authority and one server certificate it signs,
for tests and benchmarks on this machine (``bench transfer`` measures data-plane TLS with
them). Real clusters use certificates from their own authority.

Needs the ``cryptography`` package (in the ``test`` extra), imported only when called.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from dataclasses import dataclass
from typing import Sequence


@dataclass(frozen=True)
class CertificateFiles:
    """PEM files: ``ca`` (the authority's certificate: ``--tls-ca``), ``cert`` and ``key``
    (``--tls-cert``, ``--tls-key``)."""

    ca: str
    cert: str
    key: str


def make_certificates(directory: str, hosts: Sequence[str] = ("127.0.0.1", "localhost"),
                      days: int = 2) -> CertificateFiles:
    """Write a new authority and a certificate for ``hosts`` (IP addresses and names: the
    addresses clients and peers dial) into ``directory``; valid for ``days`` days."""
    try:
        from cryptography import x509
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
    except ImportError:
        raise ImportError('making TLS certificates needs the cryptography package: pip install "pathways[tls]" '
                          "(or cryptography)") from None

    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=days)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca = (x509.CertificateBuilder().subject_name(name("pathways test CA")).issuer_name(name("pathways test CA"))
          .public_key(ca_key.public_key()).serial_number(x509.random_serial_number())
          .not_valid_before(start).not_valid_after(end)
          .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
          .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                       content_commitment=False, key_encipherment=False, data_encipherment=False,
                                       key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
          .sign(ca_key, hashes.SHA256()))

    def alt_name(host: str) -> x509.GeneralName:
        try:
            return x509.IPAddress(ipaddress.ip_address(host))
        except ValueError:
            return x509.DNSName(host)

    key = ec.generate_private_key(ec.SECP256R1())
    cert = (x509.CertificateBuilder().subject_name(name(hosts[0])).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(start).not_valid_after(end)
            .add_extension(x509.SubjectAlternativeName([alt_name(h) for h in hosts]), critical=False)
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
            .sign(ca_key, hashes.SHA256()))

    files = CertificateFiles(os.path.join(directory, "ca.pem"), os.path.join(directory, "cert.pem"),
                             os.path.join(directory, "key.pem"))
    with open(files.ca, "wb") as f:
        f.write(ca.public_bytes(serialization.Encoding.PEM))
    with open(files.cert, "wb") as f:
        f.write(cert.public_bytes(serialization.Encoding.PEM))
    with open(os.open(files.key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "wb") as f:
        f.write(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.NoEncryption()))
    return files
