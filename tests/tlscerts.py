"""Certificates made at test time (the `cryptography` package): a CA, a server certificate for 127.0.0.1 and
localhost signed by it, and a client certificate signed by it, each written as PEM into a directory."""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Certs:
    ca: Path  # the CA certificate: clients verify the server with it, the server verifies clients (mutual TLS)
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    other_ca: Path  # a CA that signed neither: a client trusting only it must refuse the server


def make_certs(directory: Path) -> Certs:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.timezone.utc)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    def key_pem(key) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    def ca(cn: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(cn)).issuer_name(name(cn)).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
            .sign(key, hashes.SHA256())
        )  # fmt: skip
        return key, cert

    def leaf(cn: str, ca_key, ca_cert, usage, sans=None):
        key = ec.generate_private_key(ec.SECP256R1())
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(cn)).issuer_name(ca_cert.subject).public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage([usage]), critical=False)
            .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        )  # fmt: skip
        if sans:
            builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
        return key, builder.sign(ca_key, hashes.SHA256())

    ca_key, ca_cert = ca("fusedserve test CA")
    _, other_cert = ca("another CA")
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    server_key, server_cert = leaf("127.0.0.1", ca_key, ca_cert, ExtendedKeyUsageOID.SERVER_AUTH, sans)
    client_key, client_cert = leaf("a test client", ca_key, ca_cert, ExtendedKeyUsageOID.CLIENT_AUTH)
    directory.mkdir(parents=True, exist_ok=True)
    out = Certs(
        *(directory / n for n in ("ca.pem", "server.pem", "server.key", "client.pem", "client.key", "other.pem"))
    )
    pem = serialization.Encoding.PEM
    out.ca.write_bytes(ca_cert.public_bytes(pem))
    out.other_ca.write_bytes(other_cert.public_bytes(pem))
    out.server_cert.write_bytes(server_cert.public_bytes(pem))
    out.server_key.write_bytes(key_pem(server_key))
    out.client_cert.write_bytes(client_cert.public_bytes(pem))
    out.client_key.write_bytes(key_pem(client_key))
    out.server_key.chmod(0o600)
    out.client_key.chmod(0o600)
    return out
