"""Identity key files: a 32-byte Ed25519 seed, hex-encoded, created with 0600 permissions.

Key generation uses the operating system's randomness, so it lives here and not in core.
"""

from __future__ import annotations

import os
from pathlib import Path

from peerloom.core.identity import Identity


def generate_identity() -> Identity:
    return Identity(os.urandom(32))


def save_identity(identity: Identity, path: str | Path) -> None:
    """Write the seed to `path` (mode 0600, created exclusively so an existing key is never overwritten)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(identity.seed.hex() + "\n")


def load_identity(path: str | Path) -> Identity:
    """Read a key file. ValueError if it is not 64 hex characters."""
    text = Path(path).read_text().strip()
    try:
        seed = bytes.fromhex(text)
    except ValueError:
        raise ValueError(f"{path}: not a hex-encoded Ed25519 seed") from None
    if len(seed) != 32:
        raise ValueError(f"{path}: an Ed25519 seed is 32 bytes, found {len(seed)}")
    return Identity(seed)


def load_or_create_identity(path: str | Path) -> Identity:
    if Path(path).exists():
        return load_identity(path)
    identity = generate_identity()
    save_identity(identity, path)
    return identity
