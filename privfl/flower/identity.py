"""The organisations' identities for secure aggregation against an active server on Flower.

The malicious-server variant (``SecureAggregation(malicious=True)``) needs what no server may choose:

- each organisation's **identity key** (Ed25519), drawn on its own machine and never shared
  (:func:`write_identity` writes it, readable by its owner only, and returns the public half);
- the **federation file**, agreed out of band by the organisations (by e-mail, a signed contract, a repository they
  all trust): every organisation's public key by partition id, the threat model the secure-aggregation guarantee
  was computed for (dropout, corruption, survivor floor, bits), and the privacy terms every run must meet
  (:data:`PINNED`: the noise placement, the privacy unit, whether noise must come from the OS CSPRNG, the largest
  epsilon and delta of one run, and the node's total epsilon and delta over all its runs). :func:`write_federation`
  writes it.

Each SuperNode is started with both paths in its node config (``identity-key='...' federation='...'``). Its
ClientApp reads them there, never from the run config (which the ServerApp's side writes): it signs with its key,
accepts only signatures of the registered keys, derives degree, threshold and floor from the agreed threat model and
refuses, before it reads a record or charges anything, a run weaker than the file: secure aggregation off, other
secure-aggregation settings, the semi-honest variant (no downgrade), another placement or unit, seeded noise where
the file asks for the CSPRNG's, an epsilon or delta above the file's, or one that would take the node's runs together
past the file's totals (each run id admitted once, for its whole budget, in ``<ledger-path>.node-budget``). The
ServerApp gets the public keys in ``RunSpec.identities`` to check the signatures it forwards; a server that lies
there only stops its own rounds.

:func:`make_identities` does all of it in one folder, for a local deployment or a test (a real deployment runs
:func:`write_identity` on each organisation's machine).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping

from privfl.errors import ConfigurationError

#: node-config keys of a SuperNode: its private identity key file and the federation file
IDENTITY_KEY, FEDERATION_KEY = "identity-key", "federation"
#: the threat-model fields the federation file pins (``privfl.privacy.secure.SecureAggregation``'s)
AGREED = ("bits", "dropout", "min_survivors", "malicious", "corruption")
#: the privacy terms the federation file pins (:func:`write_federation`): a run must use this placement and unit, the
#: CSPRNG's noise where ``secure_noise`` is true, an epsilon and delta at most these, and the node's runs together at
#: most ``epsilon_total`` and ``delta_total`` (basic composition over run ids)
PINNED = ("placement", "unit", "secure_noise", "epsilon", "delta", "epsilon_total", "delta_total")
#: the placements a federation file may pin: under central placement the server adds the noise, and the file is for
#: a server no organisation trusts
PINNED_PLACEMENTS = ("distributed", "local")


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


def check_pinned_terms(terms: Mapping) -> dict:
    """The privacy terms of a federation file (:data:`PINNED`), checked: a pinned placement of
    :data:`PINNED_PLACEMENTS`, a unit ``"client"`` or ``"example"``, ``secure_noise`` a bool, ``0 < epsilon <=
    epsilon_total`` finite and ``0 < delta <= delta_total < 1``. Returns them as plain values."""
    try:
        out = {k: terms[k] for k in PINNED}
    except KeyError as exc:
        raise ConfigurationError(f"the federation file's privacy terms lack {exc}; give all of {list(PINNED)}") from None
    if out["placement"] not in PINNED_PLACEMENTS:
        raise ConfigurationError(f"the federation file pins placement {out['placement']!r}; it may pin "
                                 f"{list(PINNED_PLACEMENTS)} (under central placement the server adds the noise, and "
                                 "the file is for a server no organisation trusts)")
    if out["unit"] not in ("client", "example"):
        raise ConfigurationError(f"the federation file's unit must be 'client' or 'example', got {out['unit']!r}")
    if not isinstance(out["secure_noise"], bool):
        raise ConfigurationError(f"the federation file's secure_noise must be true or false, got "
                                 f"{out['secure_noise']!r}")
    for name in ("epsilon", "delta", "epsilon_total", "delta_total"):
        value = out[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ConfigurationError(f"the federation file's {name} must be a finite number > 0, got {value!r}")
        out[name] = float(value)
    if out["epsilon"] > out["epsilon_total"] or not out["delta"] <= out["delta_total"] < 1:
        raise ConfigurationError(f"the federation file's caps must satisfy epsilon <= epsilon_total and delta <= "
                                 f"delta_total < 1, got {out}")
    return out


def write_federation(path: str, public_keys: Mapping[int, str], secure, *, epsilon: float, delta: float,
                     epsilon_total: float, delta_total: float, placement: str = "distributed", unit: str = "client",
                     secure_noise: bool = True) -> None:
    """Write the federation file: ``public_keys`` (partition id -> public key hex), ``secure``'s threat model (a
    ``privfl.privacy.secure.SecureAggregation`` with ``malicious=True``) and the privacy terms every run must meet
    (:data:`PINNED`): ``placement`` (``"distributed"`` or ``"local"``) and ``unit`` exactly, noise from the OS
    CSPRNG when ``secure_noise``, at most ``epsilon`` and ``delta`` a run, at most ``epsilon_total`` and
    ``delta_total`` over all the runs a SuperNode takes part in."""
    from privfl.privacy.secure import SecureAggregation

    if not isinstance(secure, SecureAggregation) or not secure.malicious:
        raise ConfigurationError("the federation file pins the malicious-server variant: give "
                                 "SecureAggregation(malicious=True, ...)")
    keys = {str(int(p)): str(k) for p, k in sorted(public_keys.items())}
    if sorted(int(p) for p in keys) != list(range(len(keys))):
        raise ConfigurationError(f"public keys must be given for partitions 0..{len(keys) - 1}, got {sorted(keys)}")
    privacy = check_pinned_terms({"placement": placement, "unit": unit, "secure_noise": secure_noise,
                                  "epsilon": epsilon, "delta": delta, "epsilon_total": epsilon_total,
                                  "delta_total": delta_total})
    with open(path, "w") as f:
        json.dump({"identities": keys, "secure": {k: getattr(secure, k) for k in AGREED}, "privacy": privacy}, f,
                  indent=1, sort_keys=True)


def read_federation(path: str) -> tuple[dict[int, bytes], dict, dict]:
    """(partition id -> raw public key, the agreed secure-aggregation settings, the pinned privacy terms) of a
    federation file. A file written before the privacy terms were pinned is refused, saying what to add."""
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
    privacy = d.get("privacy")
    missing = [k for k in PINNED if not isinstance(privacy, dict) or k not in privacy]
    if missing:
        raise ConfigurationError(f"the federation file {path!r} pins the keys and the threat model but not the privacy "
                                 f"terms {missing} (a file of an earlier privfl): without them the server's run config "
                                 "would decide the placement, the noise and the budget. The organisations agree on "
                                 "them and write the file again: write_federation(path, keys, secure, epsilon=..., "
                                 "delta=..., epsilon_total=..., delta_total=..., placement=..., unit=..., "
                                 "secure_noise=True)")
    try:
        terms = check_pinned_terms(privacy)
    except ConfigurationError as exc:
        raise ConfigurationError(f"{path}: {exc}") from None
    return keys, agreed, terms


def make_identities(directory: str, n_clients: int, secure, **terms) -> tuple[list[str], str, tuple]:
    """Every organisation's identity key (``org<k>.key``) and the federation file (``federation.json``, pinning
    ``terms``: :func:`write_federation`'s keywords) in one folder: (key paths, federation path, the public keys for
    ``RunSpec.identities``). For a local deployment or a test; in a real one each organisation draws its own key."""
    os.makedirs(directory, exist_ok=True)
    paths = [os.path.join(directory, f"org{k}.key") for k in range(n_clients)]
    public = {k: write_identity(p) for k, p in enumerate(paths)}
    federation = os.path.join(directory, "federation.json")
    write_federation(federation, public, secure, **terms)
    return paths, federation, tuple(sorted(public.items()))


__all__ = ["AGREED", "FEDERATION_KEY", "IDENTITY_KEY", "PINNED", "PINNED_PLACEMENTS", "check_pinned_terms",
           "load_identity", "make_identities", "read_federation", "write_federation", "write_identity"]
