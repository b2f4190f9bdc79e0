"""The KV block allocator with an automatic prefix cache. Pure Python: no torch, no I/O.

A sequence's blocks are the ids in ``seq.block_table`` (token ``i`` lives in block
``block_table[i // block_size]``); the runner turns them into cache slots with ``llmbus.kv.layout``.
"""

from __future__ import annotations

from collections import OrderedDict, deque

from llmbus.engine.sequence import Sequence
from llmbus.kv.hashing import block_hash, root_hash


class BlockManager:
    """Hands out fixed-size KV blocks to sequences and shares full prefix blocks between them.

    Invariants:

    - A block with ``ref_count > 0`` is never evicted and never handed to another sequence except
      through a prefix hit (which only shares full, hashed blocks).
    - A full block whose tokens are all computed is immutable: once committed its hash names its
      bytes, so any sequence with the same salted prefix may share it.
    - Every block is in exactly one place: held (ref_count > 0), the free list (ref 0, unhashed),
      or the evictable LRU (ref 0, hashed, still findable by hash). ``num_free_blocks`` counts the
      last two.
    - Hashes chain from ``root_hash(model_id, kv_format, seq.cache_salt)``, so tenants with
      different salts never share a block.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_prefix_caching: bool = True,
        model_id: str = "",
        kv_format: str = "model",
    ) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an integer >= 1, got {block_size!r}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.model_id = model_id
        self.kv_format = kv_format
        self._ref = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        # NOTE: oldest first; only ref-0 blocks that are indexed by hash live here.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._index: dict[bytes, int] = {}  # hash -> block id
        self._hash_of: dict[int, bytes] = {}  # block id -> hash, for indexed blocks only
        self._parent_of: dict[int, bytes] = {}  # block id -> its chain parent's hash (committed blocks)
        # Set to a callable(block_id, hash, parent) to hear of every computed block about to be
        # evicted, before anything overwrites it (a write-back to a lower tier). Blocks that came
        # from import_cached (a lower tier already has them) are not reported.
        self.on_evict = None
        # Set to a callable(seq) to hear of every ``free`` (finish, abort, preemption, handoff):
        # state kept per sequence beside its blocks goes with them.
        self.on_free = None
        # Made by ``track_changes``: what the cache indexed and forgot, in order, for whoever drains it.
        self.changes: deque[tuple[bool, bytes, bytes | None]] | None = None

    # --- counters -----------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        """Blocks that an allocation may take: free plus evictable (ref 0, cached)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks currently indexed by hash (held or evictable)."""
        return len(self._index)

    def ref_count(self, block_id: int) -> int:
        if not 0 <= block_id < self.num_blocks:
            raise ValueError(f"block id {block_id} is outside [0, {self.num_blocks})")
        return self._ref[block_id]

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # --- prefix lookup ------------------------------------------------------------------------

    def _root(self, seq: Sequence) -> bytes:
        return root_hash(self.model_id, self.kv_format, seq.cache_salt)

    def _prefix_hits(self, seq: Sequence) -> list[tuple[bytes, int]]:
        """(hash, block id) of the longest cached run of the seq's full blocks, leaving one token;
        none for a seq that wants its prompt's logprobs: it computes every position."""
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None:
            return []
        tokens = seq.all_token_ids
        bs = self.block_size
        hits: list[tuple[bytes, int]] = []
        parent = self._root(seq)
        for start in range(0, len(tokens) - bs + 1, bs):
            parent = block_hash(parent, tokens[start : start + bs])
            block = self._index.get(parent)
            if block is None:
                break
            hits.append((parent, block))
        # NOTE: the last token must be computed so its logits give the next token.
        if hits and len(hits) * bs >= len(tokens):
            hits.pop()
        return hits

    def prefix_lookup(self, seq: Sequence) -> tuple[int, bytes | None]:
        """``cached_prefix_tokens(seq)``, and the hash of the first block of ``seq`` a prefix hit
        could serve (a full block before its last token) that this cache does not hold: the first
        block its prefill would compute. That hash is None when prefix caching is off, ``seq``
        holds blocks or scores its prompt, or every such block is cached. One pass of hashing."""
        if seq.block_table:
            return seq.num_computed_tokens, None
        hits = self._prefix_hits(seq)
        bs, j = self.block_size, len(hits)
        tokens = seq.all_token_ids
        if not self.enable_prefix_caching or seq.params.prompt_logprobs is not None or (j + 1) * bs > len(tokens) - 1:
            return j * bs, None
        return j * bs, block_hash(hits[-1][0] if hits else self._root(seq), tokens[j * bs : (j + 1) * bs])

    def pending_hashes(self, seq: Sequence) -> list[bytes]:
        """Hashes of the full blocks of ``seq``'s tokens it has not committed yet: what its prefill
        adds to the cache as it computes them."""
        bs = self.block_size
        tokens = seq.all_token_ids
        parent = seq.block_hashes[-1] if seq.block_hashes else self._root(seq)
        out: list[bytes] = []
        for i in range(len(seq.block_hashes), len(tokens) // bs):
            parent = block_hash(parent, tokens[i * bs : (i + 1) * bs])
            out.append(parent)
        return out

    def cached_prefix_tokens(self, seq: Sequence) -> int:
        """Tokens ``allocate`` would take from the prefix cache now (no side effects).

        For a seq that already holds blocks, its ``num_computed_tokens``.
        """
        return self.prefix_lookup(seq)[0]

    # --- allocation ---------------------------------------------------------------------------

    def allocate(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Make ``seq.block_table`` cover ``num_computed_tokens + num_new_tokens`` tokens.

        A seq holding no blocks first claims its longest cached prefix (setting
        ``num_computed_tokens`` and ``block_hashes``). All or nothing: returns False, changing
        nothing, when the free and evictable blocks cannot cover the rest.
        """
        if not isinstance(num_new_tokens, int) or num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be an integer >= 0, got {num_new_tokens!r}")
        held = len(seq.block_table)
        if held and seq.num_computed_tokens + num_new_tokens <= held * self.block_size:
            return True  # NOTE: most decode steps: the last block has room
        hits: list[tuple[bytes, int]] = []
        if not held:
            if seq.num_computed_tokens != 0:
                raise ValueError(
                    f"sequence {seq.request_id!r} holds no blocks but has "
                    f"num_computed_tokens={seq.num_computed_tokens}; reset it to 0 first"
                )
            hits = self._prefix_hits(seq)
        computed = seq.num_computed_tokens + len(hits) * self.block_size
        held += len(hits)
        needed = max(0, self.blocks_for(computed + num_new_tokens) - held)
        # Hit blocks that sit in the evictable LRU stop being available once claimed.
        claimed_idle = sum(1 for _, b in hits if self._ref[b] == 0)
        if needed > self.num_free_blocks - claimed_idle:
            return False
        for h, b in hits:
            if self._ref[b] == 0:
                del self._evictable[b]
            self._ref[b] += 1
            seq.block_table.append(b)
            seq.block_hashes.append(h)
        if hits:
            seq.num_computed_tokens = computed
            if seq.num_preemptions == 0:
                # NOTE: usage reports prompt tokens served from cache on first admission only;
                # a recompute after preemption does not change it.
                seq.num_cached_tokens = min(computed, seq.num_prompt_tokens)
        for _ in range(needed):
            seq.block_table.append(self._take_block())
        return True

    def allocate_computed(self, seq: Sequence, num_computed_tokens: int) -> bool:
        """Give a block-less seq fresh blocks for ``num_computed_tokens`` tokens whose KV the
        caller writes itself (a handoff from another worker); sets ``num_computed_tokens``.

        No prefix lookup. The blocks are hashed by the next ``commit``. All or nothing.
        """
        if seq.block_table:
            raise ValueError(f"sequence {seq.request_id!r} already holds blocks")
        # NOTE: at least one token must stay uncomputed: its logits give the next token.
        if not isinstance(num_computed_tokens, int) or not 0 <= num_computed_tokens < seq.num_tokens:
            raise ValueError(
                f"num_computed_tokens must be an integer in [0, {seq.num_tokens - 1}], "
                f"got {num_computed_tokens!r}"
            )
        needed = self.blocks_for(num_computed_tokens)
        if needed > self.num_free_blocks:
            return False
        seq.block_table = [self._take_block() for _ in range(needed)]
        seq.block_hashes = []
        seq.num_computed_tokens = num_computed_tokens
        return True

    def _take_block(self) -> int:
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)  # least recently used
            self._evict(block)
        self._ref[block] = 1
        return block

    def track_changes(self) -> None:
        """From now on, record in ``changes`` every hash the cache indexes ``(True, hash, parent)``
        and forgets ``(False, hash, None)`` (a worker's KV events: which prefixes this cache holds).
        At most 4 entries per block are kept undrained: the oldest go first."""
        self.changes = deque(maxlen=4 * self.num_blocks)

    def _note(self, added: bool, h: bytes, parent: bytes | None) -> None:
        if self.changes is not None:
            self.changes.append((added, h, parent))

    def _evict(self, block: int) -> None:
        h = self._hash_of.pop(block)
        del self._index[h]
        self._note(False, h, None)
        parent = self._parent_of.pop(block, None)
        if parent is not None and self.on_evict is not None:
            self.on_evict(block, h, parent)

    # --- prefix import / export (kvpool's tiers) ----------------------------------------------

    def cached_prefix_blocks(self, hashes: list[bytes]) -> int:
        """How many of ``hashes`` (a chain, from its start) this cache holds consecutively."""
        if not self.enable_prefix_caching:
            return 0
        n = 0
        for h in hashes:
            if h not in self._index:
                break
            n += 1
        return n

    def cached_blocks(self, hashes: list[bytes]) -> list[int]:
        """Block ids of the consecutive run of ``hashes`` held here (from the start of the list)."""
        return [self._index[h] for h in hashes[: self.cached_prefix_blocks(hashes)]]

    def import_cached(self, hashes: list[bytes], protect: list[bytes] = ()) -> list[int]:
        """Give each of ``hashes`` (consecutive blocks of a chain, not held here) a fresh block,
        indexed and idle (ref 0, evictable), so the next ``allocate`` of a sequence with that
        prefix claims them as cache hits. The caller writes their KV right away.

        Returns the block ids, one per hash from the first: fewer than ``hashes`` when blocks run
        out. Blocks indexed under ``protect`` (the chain's earlier blocks) are never evicted for it.
        """
        if not self.enable_prefix_caching:
            return []
        keep = {self._index[h] for h in protect if h in self._index}
        taken: list[int] = []
        parent = protect[-1] if protect else None
        for h in hashes:
            if h in self._index:
                break  # already here: the chain continues from this cache's own copy
            block = self._take_unprotected(keep)
            if block is None:
                break
            taken.append(block)
            keep.add(block)
            self._index[h] = block
            self._hash_of[block] = h
            self._note(True, h, parent)
            parent = h
        # NOTE: the chain's first blocks go in last (most recently used): evicted after its tail.
        for block in reversed(taken):
            self._ref[block] = 0
            self._evictable[block] = None
        return taken

    def _take_unprotected(self, keep: set[int]) -> int | None:
        if self._free:
            block = self._free.popleft()
        else:
            block = next((b for b in self._evictable if b not in keep), None)
            if block is None:
                return None
            del self._evictable[block]
            self._evict(block)
        self._ref[block] = 1
        return block

    # --- commit and free ----------------------------------------------------------------------

    def commit(self, seq: Sequence) -> None:
        """Hash every full, fully computed block of ``seq`` not hashed yet; index new hashes.

        If another block already holds a hash, the index keeps it and this seq's copy stays
        unindexed (it returns to the free list when released).
        """
        bs = self.block_size
        full = min(seq.num_computed_tokens // bs, len(seq.block_table))
        start = len(seq.block_hashes)
        if start >= full:
            return
        tokens = seq.all_token_ids
        parent = seq.block_hashes[-1] if seq.block_hashes else self._root(seq)
        for i in range(start, full):
            prev, parent = parent, block_hash(parent, tokens[i * bs : (i + 1) * bs])
            seq.block_hashes.append(parent)
            block = seq.block_table[i]
            if self.enable_prefix_caching and parent not in self._index and block not in self._hash_of:
                self._index[parent] = block
                self._hash_of[block] = parent
                self._parent_of[block] = prev
                self._note(True, parent, prev)

    def free(self, seq: Sequence) -> None:
        """Release the seq's blocks, last block first; idempotent. Clears its table and hashes."""
        # NOTE: tail-first, so the LRU evicts a sequence's last blocks before its first ones,
        # which keeps the most shareable (earliest) prefix blocks cached longest.
        for block in reversed(seq.block_table):
            self._ref[block] -= 1
            if self._ref[block] == 0:
                if block in self._hash_of:
                    self._evictable[block] = None
                else:
                    self._free.append(block)
        seq.block_table = []
        seq.block_hashes = []
        if self.on_free is not None:
            self.on_free(seq)
