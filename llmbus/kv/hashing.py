"""Prefix identity: a chained hash per full block.

``h_0 = H(model, kv_format, salt)`` (``model``: the checkpoint's identity, ``LoadedModel.model_id``) and ``h_i = H(h_{i-1}, token ids of block i)``. Two blocks
share a hash only if their whole prefix, model, KV format and tenant salt agree, so a hash names
the block's bytes. The salt is derived by the server from the tenant, never taken from a client.
"""

from __future__ import annotations

import hashlib
from array import array

DIGEST_BYTES = 16


def root_hash(model: str, kv_format: str, salt: str = "") -> bytes:
    h = hashlib.blake2b(digest_size=DIGEST_BYTES, person=b"llmbus-root")
    for part in (model, kv_format, salt):
        data = part.encode()
        h.update(len(data).to_bytes(4, "little"))
        h.update(data)
    return h.digest()


def block_hash(parent: bytes, token_ids: list[int] | tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(parent, digest_size=DIGEST_BYTES, person=b"llmbus-block")
    h.update(array("I", token_ids).tobytes())
    return h.digest()


def chain_hashes(root: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """Hashes of every *full* block of ``token_ids``."""
    out: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_hash(parent, token_ids[start : start + block_size])
        out.append(parent)
    return out
