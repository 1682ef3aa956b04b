"""The organisations' identities for secure aggregation against an active server on Flower.

The malicious-server variant (``SecureAggregation(malicious=True)``) needs what no server may choose:

- each organisation's **identity key** (Ed25519), drawn on its own machine and never shared
  (:func:`write_identity` writes it, readable by its owner only, and returns the public half);
- the **federation file**, agreed out of band by the organisations (by e-mail, a signed contract, a repository they
  all trust): every organisation's public key by partition id, and the threat model the secure-aggregation
  guarantee was computed for (dropout, corruption, survivor floor, bits). :func:`write_federation` writes it.

Each SuperNode is started with both paths in its node config (``identity-key='...' federation='...'``). Its
ClientApp reads them there, never from the run config (which the ServerApp's side writes): it signs with its key,
accepts only signatures of the registered keys, derives degree, threshold and floor from the agreed threat model and
refuses a run whose secure-aggregation settings differ from it, or a semi-honest run while it holds a key (no
downgrade). The ServerApp gets the public keys in ``RunSpec.identities`` to check the signatures it forwards; a
server that lies there only stops its own rounds.

:func:`make_identities` does all of it in one folder, for a local deployment or a test (a real deployment runs
:func:`write_identity` on each organisation's machine).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping

from privfl.errors import ConfigurationError

#: node-config keys of a SuperNode: its private identity key file and the federation file
IDENTITY_KEY, FEDERATION_KEY = "identity-key", "federation"
#: the threat-model fields the federation file pins (``privfl.privacy.secure.SecureAggregation``'s)
AGREED = ("bits", "dropout", "min_survivors", "malicious", "corruption")


def node_key_digest(key) -> str:
    """The SHA-256 (hex) of a SuperNode authentication public key in DER SubjectPublicKeyInfo form: what
    ``RunSpec.node_keys`` pairs with an organisation's partition id. ``key``: the organisation's public key file
    (OpenSSH, as ``ssh-keygen`` and ``flwr supernode register`` use it, or PEM), or its bytes or text."""
    import hashlib

    from cryptography.hazmat.primitives import serialization

    data = key
    if isinstance(key, str) and not key.lstrip().startswith(("-----BEGIN", "ecdsa-", "ssh-")):
        with open(key, "rb") as f:
            data = f.read()
    if isinstance(data, str):
        data = data.encode("ascii")
    try:
        if data.lstrip().startswith(b"-----BEGIN"):
            public = serialization.load_pem_public_key(data)
        else:
            public = serialization.load_ssh_public_key(data.strip())
    except (ValueError, TypeError) as exc:
        raise ConfigurationError(f"not a SuperNode public key (OpenSSH or PEM): {exc}") from None
    der = public.public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return hashlib.sha256(der).hexdigest()


def write_identity(path: str) -> str:
    """Draw a fresh Ed25519 identity key, write its 32 private bytes (hex) to ``path`` (mode 0600, never
    overwritten) and return the public key (hex) to put in the federation file."""
    from privfl.secure_agg import generate_identity, identity_public_bytes
    from cryptography.hazmat.primitives import serialization

    key = generate_identity()
    raw = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                            serialization.NoEncryption())
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        raise ConfigurationError(f"{path} exists; an identity key is drawn once, never overwritten") from None
    with os.fdopen(fd, "w") as f:
        f.write(raw.hex() + "\n")
    return identity_public_bytes(key).hex()


def load_identity(path: str):
    """The Ed25519 private key written by :func:`write_identity`."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    try:
        with open(path) as f:
            raw = bytes.fromhex(f.read().strip())
        return Ed25519PrivateKey.from_private_bytes(raw)
    except (OSError, ValueError) as exc:
        raise ConfigurationError(f"the node config's {IDENTITY_KEY} {path!r} is not a privfl identity key ({exc}); "
                                 "write one with privfl.flower.identity.write_identity") from None


def write_federation(path: str, public_keys: Mapping[int, str], secure) -> None:
    """Write the federation file: ``public_keys`` (partition id -> public key hex) and ``secure``'s threat model (a
    ``privfl.privacy.secure.SecureAggregation`` with ``malicious=True``)."""
    from privfl.privacy.secure import SecureAggregation

    if not isinstance(secure, SecureAggregation) or not secure.malicious:
        raise ConfigurationError("the federation file pins the malicious-server variant: give "
                                 "SecureAggregation(malicious=True, ...)")
    keys = {str(int(p)): str(k) for p, k in sorted(public_keys.items())}
    if sorted(int(p) for p in keys) != list(range(len(keys))):
        raise ConfigurationError(f"public keys must be given for partitions 0..{len(keys) - 1}, got {sorted(keys)}")
    with open(path, "w") as f:
        json.dump({"identities": keys, "secure": {k: getattr(secure, k) for k in AGREED}}, f, indent=1,
                  sort_keys=True)


def read_federation(path: str) -> tuple[dict[int, bytes], dict]:
    """(partition id -> raw public key, the agreed secure-aggregation settings) of a federation file."""
    try:
        with open(path) as f:
            d = json.load(f)
        keys = {int(p): bytes.fromhex(k) for p, k in d["identities"].items()}
        agreed = {k: d["secure"][k] for k in AGREED}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ConfigurationError(f"the node config's {FEDERATION_KEY} {path!r} is not a privfl federation file "
                                 f"({exc}); write one with privfl.flower.identity.write_federation") from None
    if sorted(keys) != list(range(len(keys))) or any(len(k) != 32 for k in keys.values()):
        raise ConfigurationError(f"{path}: identities must give a 32-byte public key for partitions 0..n-1")
    return keys, agreed


def make_identities(directory: str, n_clients: int, secure) -> tuple[list[str], str, tuple]:
    """Every organisation's identity key (``org<k>.key``) and the federation file (``federation.json``) in one
    folder: (key paths, federation path, the public keys for ``RunSpec.identities``). For a local deployment or a
    test; in a real one each organisation draws its own key."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"org{k}.key") for k in range(n_clients)]
    public = {k: write_identity(p) for k, p in enumerate(paths)}
    federation = os.path.join(directory, "federation.json")
    write_federation(federation, public, secure)
    return paths, federation, tuple(sorted(public.items()))


__all__ = ["AGREED", "FEDERATION_KEY", "IDENTITY_KEY", "load_identity", "make_identities", "read_federation",
           "write_federation", "write_identity"]
