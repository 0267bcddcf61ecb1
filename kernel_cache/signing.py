"""Who vouches for an archive: the user's ed25519 signing key and the keys they trust.

Files, under the user's config dir (``$KERNELIZE_CONFIG_DIR``, else ``$XDG_CONFIG_HOME/torch_kernelize``,
else ``~/.config/torch_kernelize``)::

    signing_key.pem    this user's private key (PKCS#8 PEM, mode 0600), made on first export
    trusted_keys       one public key a line: ``ed25519:<base64> [name]``; '#' starts a comment

Both files, and the folder, count only when they belong to the user (or root) and no one else
can write them, as ssh asks of ``authorized_keys``; otherwise CacheError says what to fix.

A public key is written ``ed25519:<base64 of its 32 raw bytes>``: one token to paste into
``python -m torch_kernelize.cache trust add``. The user's own key is always trusted (whoever can
read it can sign as the user anyway). ``cryptography`` is imported only here, and only when a key
is used: the serving path never needs it.
"""
from __future__ import annotations

import base64
import binascii
import hashlib
import os
import stat
from pathlib import Path
from typing import Any, Mapping

from torch_kernelize.core.errors import CacheError

from .integrity import fsync_dir, write_file_atomic

CONFIG_ENV = "KERNELIZE_CONFIG_DIR"
KEY_FILE = "signing_key.pem"
TRUSTED_FILE = "trusted_keys"
KEY_PREFIX = "ed25519:"
ALGORITHM = "ed25519"
# Signed: this context followed by the archive's MANIFEST.json bytes (no other use of the key can
# produce a signature that passes for an archive's).
CONTEXT = b"torch_kernelize kernel cache archive v1\0"


def config_dir() -> Path:
    """Where the signing key and the trusted keys live."""
    explicit = os.environ.get(CONFIG_ENV)
    if explicit:
        return Path(os.path.expanduser(explicit))
    base = os.environ.get("XDG_CONFIG_HOME") or os.path.join(os.path.expanduser("~"), ".config")
    return Path(base) / "torch_kernelize"


def _ed25519() -> Any:
    try:
        from cryptography.hazmat.primitives.asymmetric import ed25519
    except ImportError:
        raise CacheError("signing and checking kernel cache archives needs the 'cryptography' package: "
                         "pip install 'cryptography>=42'") from None
    return ed25519


def key_id(public_key: str) -> str:
    """A short fingerprint of a public key, for messages and listings."""
    return hashlib.sha256(parse_public_key(public_key)).hexdigest()[:16]


def parse_public_key(text: str) -> bytes:
    """The 32 raw bytes of ``ed25519:<base64>``; CacheError saying what is wrong otherwise."""
    text = text.strip() if isinstance(text, str) else text
    if not isinstance(text, str) or not text.startswith(KEY_PREFIX):
        raise CacheError(f"{text!r} is not a public key: expected {KEY_PREFIX}<base64> "
                         "(as `python -m torch_kernelize.cache trust key` prints it)")
    try:
        raw = base64.b64decode(text[len(KEY_PREFIX):], validate=True)
    except (binascii.Error, ValueError):
        raise CacheError(f"{text!r} is not a public key: its part after {KEY_PREFIX} is not base64") from None
    if len(raw) != 32:
        raise CacheError(f"{text!r} is not a public key: an ed25519 key has 32 bytes, this one {len(raw)}")
    return raw


def _public_text(raw: bytes) -> str:
    return KEY_PREFIX + base64.b64encode(raw).decode()


def _check_owner(path: Path, st: os.stat_result, what: str) -> None:
    """ssh's rule for authorized_keys: what says whom you trust is yours (or root's) and nobody
    else can change it; CacheError otherwise."""
    me = os.geteuid() if hasattr(os, "geteuid") else None
    if me is not None and st.st_uid not in (me, 0):
        raise CacheError(f"{what} {path} belongs to uid {st.st_uid}, not to you (uid {me}) or root, so it cannot "
                         f"say whom you trust; if it is yours: chown {me} {path}")
    if st.st_mode & 0o022:
        raise CacheError(f"{what} {path} can be changed by other users (mode {stat.S_IMODE(st.st_mode):o}), so it "
                         f"cannot say whom you trust; chmod go-w {path}")


def _check_config_dir() -> None:
    """The config folder, where it exists, passes _check_owner (whoever can write it can swap the files)."""
    folder = config_dir()
    try:
        st = os.stat(folder)
    except FileNotFoundError:
        return
    except OSError as e:
        raise CacheError(f"cannot read the config folder {folder}: {e.strerror}") from None
    _check_owner(folder, st, "the config folder")


def _check_private(path: Path, st: os.stat_result) -> None:
    _check_owner(path, st, "the signing key")
    if st.st_mode & 0o077:
        raise CacheError(f"the signing key {path} can be read by other users (mode {stat.S_IMODE(st.st_mode):o}); "
                         f"make it private: chmod 600 {path}")


def _load_private(path: Path) -> Any:
    from cryptography.hazmat.primitives import serialization
    ed25519 = _ed25519()
    _check_config_dir()
    with open(path, "rb") as f:  # the checked file is the one read
        _check_private(path, os.fstat(f.fileno()))
        pem = f.read()
    try:
        key = serialization.load_pem_private_key(pem, password=None)
    except (ValueError, TypeError) as e:
        raise CacheError(f"the signing key {path} does not load ({e}); move it away and a new one is made "
                         "on the next export (those who trust the old key must then trust the new one)") from None
    if not isinstance(key, ed25519.Ed25519PrivateKey):
        raise CacheError(f"the signing key {path} is not an ed25519 key")
    return key


def signing_key(create: bool = True) -> Any:
    """This user's private key (an Ed25519PrivateKey), made on first use when ``create``; None when
    there is none and ``create`` is false."""
    path = config_dir() / KEY_FILE
    if path.exists():
        return _load_private(path)
    if not create:
        return None
    from cryptography.hazmat.primitives import serialization
    _check_config_dir()
    key = _ed25519().Ed25519PrivateKey.generate()
    pem = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                            serialization.NoEncryption())
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{KEY_FILE}.tmp-{os.getpid()}-{os.urandom(4).hex()}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(pem)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)  # never over a key another process made meanwhile
        except FileExistsError:
            return _load_private(path)
        fsync_dir(path.parent)
    finally:
        os.unlink(tmp)
    return key


def public_key_of(private_key: Any) -> str:
    from cryptography.hazmat.primitives import serialization
    return _public_text(private_key.public_key().public_bytes(serialization.Encoding.Raw,
                                                              serialization.PublicFormat.Raw))


def own_public_key(create: bool = True) -> str | None:
    key = signing_key(create)
    return None if key is None else public_key_of(key)


def sign(data: bytes) -> dict[str, str]:
    """A signature document for ``data`` by this user's key (made on first use)."""
    key = signing_key(create=True)
    return {"algorithm": ALGORITHM, "public_key": public_key_of(key),
            "signature": base64.b64encode(key.sign(CONTEXT + data)).decode()}


def signature_verifies(data: bytes, doc: Mapping[str, Any]) -> bool:
    """Whether ``doc`` (as sign() wrote it) is a valid signature of ``data`` by the key it names."""
    from cryptography.exceptions import InvalidSignature
    ed25519 = _ed25519()
    if doc.get("algorithm") != ALGORITHM or not isinstance(doc.get("signature"), str):
        return False
    try:
        raw_sig = base64.b64decode(doc["signature"], validate=True)
        public = ed25519.Ed25519PublicKey.from_public_bytes(parse_public_key(doc.get("public_key")))
        public.verify(raw_sig, CONTEXT + data)
    except (CacheError, binascii.Error, ValueError, InvalidSignature):
        return False
    return True


# --- trusted keys ------------------------------------------------------------------------------------

def _trusted_path() -> Path:
    return config_dir() / TRUSTED_FILE


def _read_trusted() -> dict[str, str]:
    path = _trusted_path()
    _check_config_dir()
    try:
        with open(path, "rb") as f:  # the checked file is the one read
            st = os.fstat(f.fileno())
            data = f.read()
    except FileNotFoundError:
        return {}
    except OSError as e:
        raise CacheError(f"cannot read the trusted keys in {path}: {e}") from None
    _check_owner(path, st, "the trusted keys file")
    try:
        text = data.decode()
    except UnicodeDecodeError:
        raise CacheError(f"{path} is not text: one public key a line "
                         "(python -m torch_kernelize.cache trust add)") from None
    keys: dict[str, str] = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        token, _, name = line.partition(" ")
        try:
            parse_public_key(token)
        except CacheError as e:
            raise CacheError(f"{path} line {n}: {e}") from None
        keys[token] = name.strip()
    return keys


def trusted_keys() -> dict[str, str]:
    """{public key: name} of every key whose signed archives import: the trusted file's, and
    this user's own key (when it exists)."""
    keys = _read_trusted()
    own = own_public_key(create=False)
    if own is not None:
        keys.setdefault(own, "your own key")
    return keys


def _write_trusted(keys: Mapping[str, str]) -> None:
    path = _trusted_path()
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    lines = ["# Public keys whose signed kernel cache archives `python -m torch_kernelize.cache import` accepts.",
             "# Edit with `python -m torch_kernelize.cache trust add|remove`."]
    lines += [f"{k} {name}".rstrip() for k, name in keys.items()]
    write_file_atomic(path, ("\n".join(lines) + "\n").encode())
    os.chmod(path, 0o644)


def trust_add(public_key: str, name: str = "") -> bool:
    """Trust ``public_key``; returns False when it was trusted already (its name is updated)."""
    public_key = public_key.strip()
    parse_public_key(public_key)
    if "#" in name or "\n" in name or "\r" in name:
        raise CacheError(f"a key's name is one line without '#', got {name!r}")
    keys = _read_trusted()
    new = public_key not in keys
    keys[public_key] = name.strip()
    _write_trusted(keys)
    return new


def trust_remove(public_key: str) -> bool:
    """Stop trusting ``public_key``; returns False when it was not in the trusted file."""
    public_key = public_key.strip()
    keys = _read_trusted()
    if public_key not in keys:
        return False
    del keys[public_key]
    _write_trusted(keys)
    return True
