"""The sandbox's public key infrastructure, made fresh at every start with ``cryptography``.

One cluster CA signs the API server's serving certificate and every client certificate
(admin, controller-manager, scheduler, each node agent); a separate front-proxy CA signs the
API server's proxy client (the aggregation layer's, which quiets the controllers' complaints);
a service-account key pair signs and verifies ServiceAccount tokens; the operator's webhook
gets a serving certificate that the API server verifies with the cluster CA (the ``caBundle``);
and a CA of its own, the webhook-client CA, signs the one client certificate that the API
server presents to webhooks, which the operator's webhook requires: nothing else, a kubelet's or
an admin's certificate included, can post it an admission review.
Nothing here reaches beyond loopback: every serving certificate names 127.0.0.1 and localhost.

Called by :mod:`memops_sandbox.controlplane`, which writes the files into ``DIR/pki``.
"""

from __future__ import annotations

import dataclasses
import datetime
import ipaddress
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

# The names a pod would use for the API server; the serving certificate carries them all.
APISERVER_NAMES = (
    "localhost",
    "kubernetes",
    "kubernetes.default",
    "kubernetes.default.svc",
    "kubernetes.default.svc.cluster.local",
)
LOOPBACK = ipaddress.IPv4Address("127.0.0.1")
# A sandbox lives for hours; a week leaves room for a laptop that sleeps, and no more.
VALIDITY = datetime.timedelta(days=7)

PrivateKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@dataclasses.dataclass(frozen=True)
class KeyPair:
    """A certificate and its private key, in PEM."""

    cert: bytes
    key: bytes

    def write(self, directory: Path, name: str) -> tuple[Path, Path]:
        """Write ``name.crt`` and ``name.key`` (mode 0600) and return their paths."""
        directory.mkdir(parents=True, exist_ok=True)
        cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
        cert_path.write_bytes(self.cert)
        key_path.touch(mode=0o600)
        key_path.write_bytes(self.key)
        return cert_path, key_path


@dataclasses.dataclass(frozen=True)
class Authority:
    """A CA that can sign: its certificate object and key, kept in memory for the run."""

    name: str
    certificate: x509.Certificate
    private_key: PrivateKey

    @property
    def pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def key_pair(self) -> KeyPair:
        return KeyPair(cert=self.pem, key=_key_pem(self.private_key))


def _key_pem(key: PrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )


def _now() -> datetime.datetime:
    # A minute back, so that a clock a little behind in another process accepts it at once.
    return datetime.datetime.now(datetime.UTC) - datetime.timedelta(minutes=1)


def _builder(
    subject: x509.Name, issuer: x509.Name, key: ec.EllipticCurvePrivateKey, *, ca: bool
) -> x509.CertificateBuilder:
    """What every certificate here has: names, key, serial, validity, and whether it signs others."""
    usage = x509.KeyUsage(
        digital_signature=True,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=ca,
        crl_sign=ca,
        encipher_only=False,
        decipher_only=False,
    )
    return (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(issuer)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(_now())
        .not_valid_after(_now() + VALIDITY)
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        .add_extension(usage, critical=True)
    )


def authority(common_name: str) -> Authority:
    """A self-signed CA."""
    key = ec.generate_private_key(ec.SECP256R1())
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])
    certificate = (
        _builder(subject, subject, key, ca=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return Authority(name=common_name, certificate=certificate, private_key=key)


def issue(
    ca: Authority,
    common_name: str,
    *,
    organizations: tuple[str, ...] = (),
    dns_names: tuple[str, ...] = (),
    ip_addresses: tuple[ipaddress.IPv4Address, ...] = (),
    server: bool = False,
    client: bool = False,
) -> KeyPair:
    """A leaf certificate signed by ``ca``.

    For a client certificate the API server takes the user from the CN and the groups from the
    O attributes (``system:masters`` for an admin, ``system:nodes`` for a node).
    """
    key = ec.generate_private_key(ec.SECP256R1())
    attributes = [x509.NameAttribute(NameOID.ORGANIZATION_NAME, org) for org in organizations]
    attributes.append(x509.NameAttribute(NameOID.COMMON_NAME, common_name))
    usages = ([ExtendedKeyUsageOID.SERVER_AUTH] if server else []) + (
        [ExtendedKeyUsageOID.CLIENT_AUTH] if client else []
    )
    builder = (
        _builder(x509.Name(attributes), ca.certificate.subject, key, ca=False)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca.certificate.public_key()),  # type: ignore[arg-type]
            critical=False,
        )
    )
    if dns_names or ip_addresses:
        names: list[x509.GeneralName] = [x509.DNSName(name) for name in dns_names]
        names += [x509.IPAddress(address) for address in ip_addresses]
        builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
    certificate = builder.sign(ca.private_key, hashes.SHA256())
    return KeyPair(cert=certificate.public_bytes(serialization.Encoding.PEM), key=_key_pem(key))


def service_account_keys() -> KeyPair:
    """The key pair that signs ServiceAccount tokens: ``cert`` holds the public key (PEM), which
    is what ``--service-account-key-file`` accepts; ``key`` the private key."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    public = key.public_key().public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    return KeyPair(cert=public, key=_key_pem(key))


WEBHOOK_CLIENT = "kube-apiserver-webhook-client"
"""The CN of the API server's client certificate for webhooks (``apiserver-webhook-client``),
which the operator pins (``memops run --webhook-client-name``)."""


def node_user(node: str) -> str:
    """The user a node's client certificate names, which the Node authorizer and the
    NodeRestriction admission plugin tie to the Node of that name."""
    return f"system:node:{node}"


@dataclasses.dataclass(frozen=True)
class ClusterPki:
    """Everything the control plane and its clients need, as paths in ``directory``."""

    directory: Path
    ca: Authority

    def path(self, name: str, suffix: str = "crt") -> Path:
        return self.directory / f"{name}.{suffix}"

    def client(self, name: str, common_name: str, organizations: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """Issue and write a client certificate signed by the cluster CA."""
        pair = issue(self.ca, common_name, organizations=organizations, client=True)
        return pair.write(self.directory, name)

    def serving(self, name: str, *dns_names: str) -> tuple[Path, Path]:
        """Issue and write a serving certificate for 127.0.0.1 (and ``dns_names``)."""
        pair = issue(
            self.ca,
            dns_names[0] if dns_names else "127.0.0.1",
            dns_names=dns_names,
            ip_addresses=(LOOPBACK,),
            server=True,
        )
        return pair.write(self.directory, name)

    def kubelet_serving(self, node: str, address: str) -> tuple[Path, Path]:
        """Issue and write the serving certificate of ``node``'s kubelet, for its name and
        ``address``, as the cluster's signer issues one to a kubelet with ``serverTLSBootstrap``."""
        pair = issue(
            self.ca,
            node_user(node),
            organizations=("system:nodes",),
            dns_names=(node,),
            ip_addresses=(ipaddress.IPv4Address(address),),
            server=True,
        )
        return pair.write(self.directory, f"kubelet-{node}-serving")


def make_pki(directory: Path, addresses: tuple[str, ...] = ()) -> ClusterPki:
    """The CAs, the API server's serving and proxy-client certificates, the service-account
    keys, and the client certificates of admin, controller-manager and scheduler.

    Files: ``ca``, ``apiserver``, ``front-proxy-ca``, ``front-proxy-client``, ``sa`` (``sa.crt``
    is the public key), ``admin``, ``controller-manager``, ``scheduler``, ``webhook-client-ca``
    and ``apiserver-webhook-client`` (:data:`WEBHOOK_CLIENT`) (``.crt`` and ``.key``).
    """
    ca = authority("memops-sandbox-ca")
    ca.key_pair().write(directory, "ca")
    # ``addresses``: where else pods reach the API server (its advertised address, the
    # ``kubernetes`` Service's ClusterIP), on real Nodes.
    ips = (LOOPBACK, *(ipaddress.IPv4Address(address) for address in addresses))
    issue(ca, "kube-apiserver", dns_names=APISERVER_NAMES, ip_addresses=ips, server=True).write(directory, "apiserver")
    # The API server's client certificate for the kubelet API (logs, exec, port-forward): the
    # kubelets authorize it with a SubjectAccessReview, which system:masters passes.
    issue(ca, "kube-apiserver-kubelet-client", organizations=("system:masters",), client=True).write(
        directory, "apiserver-kubelet-client"
    )
    front_proxy = authority("memops-sandbox-front-proxy-ca")
    front_proxy.key_pair().write(directory, "front-proxy-ca")
    issue(front_proxy, "front-proxy-client", client=True).write(directory, "front-proxy-client")
    service_account_keys().write(directory, "sa")
    webhook_clients = authority("memops-sandbox-webhook-client-ca")
    webhook_clients.key_pair().write(directory, "webhook-client-ca")
    issue(webhook_clients, WEBHOOK_CLIENT, client=True).write(directory, "apiserver-webhook-client")
    pki = ClusterPki(directory=directory, ca=ca)
    pki.client("admin", "kubernetes-admin", ("system:masters",))
    pki.client("controller-manager", "system:kube-controller-manager")
    pki.client("scheduler", "system:kube-scheduler")
    return pki
