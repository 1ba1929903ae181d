"""Trust by provenance: a digest the user pins, or an ed25519 signature by a key the user pins.

The manifest digest (sha256 over the manifest, which holds every file's sha256) proves that a
bundle is the one it claims to be *internally*; anyone who edits a file can recompute it. So the
runtime only trusts a bundle beyond self-consistency when the user says which one:

  --expect-digest sha256:<hex>      (or a reference carrying it: hf://org/repo@<commit>#sha256=<hex>)
  --verify-signature KEY.pub        an ed25519 public key (PEM or OpenSSH); the bundle's
                                    manifest.sig must sign its digest with the matching private key

manifest.sig (JSON, next to manifest.json, not covered by the digest it signs):
  {"format": "eagle3-bundle-signature/v1", "digest": "sha256:<hex>", "key_id": "<16 hex>", "signature": "<base64>"}
The signed message is b"eagle3-bundle-signature/v1\\n" + the digest string.
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from .manifest import BundleError

SIGNATURE = "manifest.sig"
FORMAT = "eagle3-bundle-signature/v1"
_PIN = re.compile(r"(?:sha256[:=])?([0-9a-fA-F]{64})")


class TrustError(BundleError):
    """A bundle that is not the one the user pinned; the message says which pin failed."""


@dataclass(frozen=True)
class Pins:
    """What the user pinned for one bundle (nothing pinned: only self-consistency is checked)."""

    digest: str | None = None  # 64 hex digits
    public_key: Path | None = None

    @property
    def any(self) -> bool:
        return self.digest is not None or self.public_key is not None


def parse_digest(text: str) -> str:
    m = _PIN.fullmatch(text.strip())
    if m is None:
        raise TrustError(f"{text!r} is not a bundle digest; expected sha256:<64 hex digits> "
                         "(eagle3-build inspect BUNDLE prints it)")
    return m.group(1).lower()


def split_pin(ref: str) -> tuple[str, str | None]:
    """'hf://org/repo@rev#sha256=<hex>' -> ('hf://org/repo@rev', '<hex>'), pip's URL-hash form."""
    base, _, frag = ref.rpartition("#")
    if not base or not frag.startswith("sha256"):
        return ref, None  # no pin (a '#' elsewhere is part of the path)
    return base, parse_digest(frag)


def pins(ref: str, expect_digest: str | None = None, public_key: str | os.PathLike | None = None
         ) -> tuple[str, Pins]:
    """The reference without its pin, and every pin from it and the flags (they must agree)."""
    base, in_ref = split_pin(str(ref))
    flag = parse_digest(expect_digest) if expect_digest else None
    if in_ref and flag and in_ref != flag:
        raise TrustError(f"the reference pins sha256:{in_ref} but --expect-digest says sha256:{flag}; "
                         "give one digest")
    if public_key:  # a key file that is not an ed25519 public key is refused before any bundle is read
        _read_key(Path(public_key), private=False)
    return base, Pins(in_ref or flag, Path(public_key) if public_key else None)


def check_pins(root: Path, digest: str, p: Pins) -> None:
    if p.digest is not None and p.digest != digest:
        raise TrustError(f"{root}: bundle digest is sha256:{digest}, but sha256:{p.digest} was expected; "
                         "this is not the bundle you pinned (re-download it, or update the pin if the "
                         "bundle was rebuilt on purpose)")
    if p.public_key is not None:
        verify_signature(root, digest, p.public_key)


def add_trust_args(ap) -> None:
    """The pinning flags of eagle3-run and eagle3-serve (argparse)."""
    ap.add_argument("--expect-digest", metavar="sha256:HEX",
                    help="refuse the bundle unless its digest is this one (also: REF#sha256=HEX)")
    ap.add_argument("--verify-signature", metavar="KEY.pub",
                    help="refuse the bundle unless its manifest.sig is signed by this ed25519 public key")
    ap.add_argument("--trust-remote-code", action="store_true",
                    help="run native-code (aoti, neuron) bundles fetched from a remote without a pin")


# ------------------------------------------------------------------ ed25519 signatures

def _crypto():
    try:
        from cryptography.exceptions import InvalidSignature
        from cryptography.hazmat.primitives import serialization
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError as e:
        raise TrustError("bundle signatures need the `cryptography` package: pip install cryptography") from e
    return serialization, ed25519, InvalidSignature


def _message(digest: str) -> bytes:
    return f"{FORMAT}\nsha256:{digest}".encode()


def generate_key(prefix: Path) -> tuple[Path, Path]:
    """PREFIX.key (PKCS#8 PEM, mode 0600) and PREFIX.pub (PEM); refuses to overwrite either."""
    serialization, ed25519, _ = _crypto()
    key_path, pub_path = Path(f"{prefix}.key"), Path(f"{prefix}.pub")
    for p in (key_path, pub_path):
        if p.exists():
            raise TrustError(f"{p} already exists; choose another prefix or remove it yourself")
    key = ed25519.Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    fd = os.open(key_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    pub_path.write_bytes(key.public_key().public_bytes(serialization.Encoding.PEM,
                                                       serialization.PublicFormat.SubjectPublicKeyInfo))
    return key_path, pub_path


MAX_KEY_BYTES = 64 << 10  # a key file is a few hundred bytes


def _read_key(path: Path, private: bool):
    """The ed25519 key in `path` (PEM or OpenSSH); TrustError naming the file, what it holds and what is expected."""
    _, ed25519, _ = _crypto()
    want = "private" if private else "public"
    expected = (f"expected an ed25519 {want} key (PEM or OpenSSH): "
                + ("sign with the PREFIX.key" if private else "verify with the PREFIX.pub")
                + " that `eagle3-build keygen PREFIX` wrote, or an `ssh-keygen -t ed25519` key")
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_KEY_BYTES + 1)
    except IsADirectoryError as e:
        raise TrustError(f"{path}: a directory, {expected}") from e
    except OSError as e:
        raise TrustError(f"{path}: cannot read the key ({e.strerror or e}); {expected}") from e
    kind = ed25519.Ed25519PrivateKey if private else ed25519.Ed25519PublicKey
    key, what, err = _load_any_key(data)
    if isinstance(key, kind):
        return key
    raise TrustError(f"{path}: {what}, {expected}") from err


def _load_any_key(data: bytes) -> tuple[object | None, str, Exception | None]:
    """(the key, what it is, None) for a PEM or OpenSSH key of any kind; (None, what the bytes are, why the
    loader refused them) otherwise."""
    from cryptography.exceptions import UnsupportedAlgorithm
    from cryptography.hazmat.primitives import serialization as s

    if len(data) > MAX_KEY_BYTES:
        return None, f"a file of more than {MAX_KEY_BYTES} bytes, not a key", None
    text = data.strip()
    if not text:
        return None, "an empty file", None
    if text.startswith(b"-----BEGIN "):
        label = text[11:].split(b"-----", 1)[0].decode("ascii", "replace")
        form = "OpenSSH" if label == "OPENSSH PRIVATE KEY" else "PEM"
        loaders = ((s.load_ssh_private_key, "private"),) if form == "OpenSSH" else (
            (s.load_pem_private_key, "private"), (s.load_pem_public_key, "public"))
        err = None
        for load, half in loaders:
            try:
                key = load(data, None) if half == "private" else load(data)
            except TypeError as e:  # (a private key needing its passphrase)
                return None, f"an encrypted private key ({form}); decrypt it first (ssh-keygen -p)", e
            except (ValueError, UnsupportedAlgorithm) as e:
                err = e
                continue
            return key, f"{_algorithm(key)} {half} key ({form})", None
        return None, f"a PEM block labelled {label[:40]!r} that is not a key this tool reads", err
    first = text.split(None, 1)[0][:40].decode("ascii", "replace")
    if first.startswith(("ssh-", "ecdsa-", "sk-")):
        try:
            key = s.load_ssh_public_key(data)
        except (ValueError, UnsupportedAlgorithm) as e:
            return None, f"an OpenSSH {first} public key that cannot be read", e
        return key, f"{_algorithm(key)} public key (OpenSSH)", None
    return None, "neither a PEM nor an OpenSSH key", None


def _algorithm(key) -> str:
    """'an RSA-2048', 'an EC (secp256r1)', 'an ed25519', ... for a key of either half."""
    from cryptography.hazmat.primitives.asymmetric import dsa, ec, ed448, ed25519, rsa, x448, x25519

    for kinds, name in (((ed25519.Ed25519PrivateKey, ed25519.Ed25519PublicKey), "an ed25519"),
                        ((ed448.Ed448PrivateKey, ed448.Ed448PublicKey), "an Ed448"),
                        ((x25519.X25519PrivateKey, x25519.X25519PublicKey), "an X25519"),
                        ((x448.X448PrivateKey, x448.X448PublicKey), "an X448"),
                        ((dsa.DSAPrivateKey, dsa.DSAPublicKey), "a DSA")):
        if isinstance(key, kinds):
            return name
    if isinstance(key, (rsa.RSAPrivateKey, rsa.RSAPublicKey)):
        return f"an RSA-{key.key_size}"
    if isinstance(key, (ec.EllipticCurvePrivateKey, ec.EllipticCurvePublicKey)):
        return f"an EC ({key.curve.name})"
    return f"a {type(key).__name__}"


def key_id(public_key) -> str:
    serialization, _, _ = _crypto()
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def sign_digest(digest: str, key_path: Path) -> dict:
    key = _read_key(key_path, private=True)
    return {"format": FORMAT, "digest": f"sha256:{digest}", "key_id": key_id(key.public_key()),
            "signature": base64.b64encode(key.sign(_message(digest))).decode()}


def write_signature(root: Path, digest: str, key_path: Path) -> Path:
    path = Path(root) / SIGNATURE
    path.write_text(json.dumps(sign_digest(digest, key_path), indent=2) + "\n")
    return path


def verify_signature(root: Path, digest: str, public_key_path: Path) -> str:
    """-> the signer's key id; raises TrustError unless manifest.sig signs `digest` with this key."""
    _, _, InvalidSignature = _crypto()
    key = _read_key(public_key_path, private=False)
    path = Path(root) / SIGNATURE
    if path.is_symlink() or not path.is_file():
        raise TrustError(f"{root}: no {SIGNATURE}; the bundle is unsigned (sign it with "
                         "`eagle3-build push BUNDLE REMOTE --sign KEY` or `eagle3-build sign BUNDLE --key KEY`)")
    try:
        sig = json.loads(path.read_bytes()[:4096])
        ok_shape = isinstance(sig, dict) and sig.get("format") == FORMAT and isinstance(sig.get("signature"), str)
        raw_sig = base64.b64decode(sig["signature"], validate=True) if ok_shape else b""
    except (ValueError, RecursionError) as e:
        raise TrustError(f"{path}: not a bundle signature file") from e
    if not ok_shape:
        raise TrustError(f"{path}: not a {FORMAT} signature")
    if sig.get("digest") != f"sha256:{digest}":
        raise TrustError(f"{root}: {SIGNATURE} signs another bundle (digest {sig.get('digest')!r}, the manifest's "
                         f"is sha256:{digest}); the bundle was altered after signing")
    try:
        key.verify(raw_sig, _message(digest))
    except InvalidSignature as e:
        raise TrustError(f"{root}: {SIGNATURE} is not a valid signature by {public_key_path} (key id "
                         f"{key_id(key)}, the file names {sig.get('key_id')!r}); refusing the bundle") from e
    return key_id(key)
