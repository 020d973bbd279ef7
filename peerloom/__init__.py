"""peerloom: decentralized training over untrusted peers with a signed, verifiable history."""

__version__ = "0.1.0"
