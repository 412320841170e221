"""The block manager (chapter 10): tables, reference counts, prefix cache and eviction,
driven by a hypothesis state machine through random admissions, growth, cache
registration, frees and re-admissions (preemption gives blocks back the same way)."""

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from tinyvllm_lib.engine.block_manager import BlockManager
from tinyvllm_lib.kernels.checks import cdiv


def test_bad_sizes_are_refused():
    for bad in (0, 3, 12, -16, 16.0):
        with pytest.raises(ValueError, match="power of two"):
            BlockManager(8, block_size=bad)
    with pytest.raises(ValueError, match="positive integer"):
        BlockManager(0)


def test_reset_prefix_cache_forgets_every_block_only_when_none_is_held():
    manager = BlockManager(16, block_size=4)
    prompt = list(range(12))
    manager.allocate("a", prompt, 12)
    manager.cache_blocks("a", prompt, 12)
    assert not manager.reset_prefix_cache()  # "a" holds its blocks: nothing changes
    assert manager.num_cached_tokens(prompt) == 8
    manager.free("a")
    assert manager.num_cached_free_blocks == 3 and manager.reset_prefix_cache()
    assert manager.num_cached_tokens(prompt) == 0 and manager.num_cached_free_blocks == 0
    assert manager.allocate("b", prompt, 12) == 0 and manager.num_free_blocks == 13


def test_a_shared_prefix_is_found_and_never_the_last_token():
    manager = BlockManager(16, block_size=4)
    prompt = list(range(12))  # exactly three full blocks
    assert manager.allocate("a", prompt, 12) == 0
    manager.cache_blocks("a", prompt, 12)
    # all three blocks are cached, but the last token must be computed: two blocks
    assert manager.num_cached_tokens(prompt) == 8
    assert manager.allocate("b", prompt, 12) == 8
    assert manager.block_tables["b"][:2] == manager.block_tables["a"][:2]
    assert manager.block_tables["b"][2] != manager.block_tables["a"][2]
    # a different token in the first block: no hit at all (the chain starts there)
    assert manager.num_cached_tokens([99] + prompt[1:]) == 0


def test_a_hash_collision_is_not_a_hit(monkeypatch):
    import tinyvllm_lib.engine.block_manager as bm

    manager = BlockManager(8, block_size=2)
    manager.allocate("a", [1, 2, 3], 3)
    manager.cache_blocks("a", [1, 2, 3], 3)
    # every block hashes alike: the stored key must tell them apart
    monkeypatch.setattr(bm, "hash_block", lambda parent, ids: (7, (parent, tuple(ids))))
    manager2 = BlockManager(8, block_size=2)
    manager2.allocate("a", [1, 2, 3], 3)
    manager2.cache_blocks("a", [1, 2, 3], 3)
    assert manager2.num_cached_tokens([1, 2, 5]) == 2
    assert manager2.num_cached_tokens([5, 6, 7]) == 0


def test_eviction_is_least_recently_freed_and_tail_first():
    manager = BlockManager(4, block_size=2)
    manager.allocate("a", [1, 2, 3, 4, 5], 5)  # 3 blocks
    manager.cache_blocks("a", [1, 2, 3, 4, 5], 5)  # 2 full ones cached
    manager.free("a")
    assert (
        manager.num_free_blocks == 4 and manager.num_cached_tokens([1, 2, 3, 4, 5]) == 4
    )
    # a new request of 2 blocks takes the never-used block, then a's partial tail block
    manager.allocate("b", [9, 9, 9], 3)
    assert manager.num_cached_tokens([1, 2, 3, 4, 5]) == 4
    # one more takes a's second full block (freed before its first): the chain breaks there
    manager.append_slots("b", 5)
    assert manager.num_cached_tokens([1, 2, 3, 4, 5]) == 2


class Untouchable:
    """A token sequence that fails when read: cache_blocks must not read it when no block has filled."""

    def __len__(self):
        raise AssertionError("read the tokens")

    def __getitem__(self, s):
        raise AssertionError("read the tokens")


def test_cache_blocks_names_each_block_the_step_it_fills_and_reads_nothing_between():
    block_size = 4
    manager, later = BlockManager(32, block_size), BlockManager(32, block_size)
    tokens = list(range(5))  # a prompt of 5: its first block full after the prefill
    manager.allocate("a", tokens, 5)
    manager.cache_blocks("a", tokens, 5)
    for _ in range(30):  # decode steps, one token each
        manager.cache_blocks("a", Untouchable(), len(tokens))  # nothing new: O(1)
        tokens.append(len(tokens))
        manager.append_slots("a", len(tokens))
        num_full = len(tokens) // block_size
        if len(tokens) % block_size:
            manager.cache_blocks("a", Untouchable(), len(tokens))
        else:  # this token filled a block: it is named now, found by any later request
            manager.cache_blocks("a", tokens, len(tokens))
        assert manager.num_named["a"] == num_full
        assert manager.num_cached_tokens(tokens + [-1]) == num_full * block_size
    # the same as naming everything at once at the end
    later.allocate("a", tokens, len(tokens))
    later.cache_blocks("a", tokens, len(tokens))
    assert {h: manager.block_tables["a"].index(b) for h, b in manager.cached.items()} == {
        h: later.block_tables["a"].index(b) for h, b in later.cached.items()
    }


def test_a_short_pool_changes_nothing():
    manager = BlockManager(3, block_size=4)
    assert manager.allocate("a", list(range(9)), 9) == 0  # 3 blocks
    assert manager.allocate("b", [1], 1) is None
    assert "b" not in manager.block_tables and manager.num_free_blocks == 0
    assert (
        manager.append_slots("a", 13) is False and len(manager.block_tables["a"]) == 3
    )


def test_slot_mapping_goes_through_the_table():
    manager = BlockManager(8, block_size=4)
    manager.allocate("x", list(range(3)), 3)
    manager.allocate("a", list(range(10)), 10)
    table = manager.block_tables["a"]
    slots = manager.slot_mapping("a", 0, 10)
    expected = [table[i // 4] * 4 + i % 4 for i in range(10)]
    np.testing.assert_array_equal(slots, expected)


class BlockManagerMachine(RuleBasedStateMachine):
    """Requests arrive (drawn from a few shared beginnings, so prefixes repeat), are
    admitted when blocks allow, compute tokens and generate more, finish, or are
    preempted back to waiting; after every step the pool's bookkeeping must add up."""

    @initialize(
        num_blocks=st.integers(1, 40),
        block_size=st.sampled_from([1, 2, 4, 8]),
        caching=st.booleans(),
    )
    def setup(self, num_blocks, block_size, caching):
        self.manager = BlockManager(
            num_blocks, block_size, enable_prefix_caching=caching
        )
        self.bases = [
            list(np.random.default_rng(s).integers(0, 5, 40)) for s in range(3)
        ]
        self.waiting: dict[str, list[int]] = {}
        # request id -> (token ids, tokens it holds slots for, tokens computed)
        self.running: dict[str, list] = {}
        self.next_id = 0

    @rule(
        base=st.integers(0, 2),
        shared=st.integers(0, 40),
        tail=st.lists(st.integers(0, 5), max_size=12),
    )
    def arrive(self, base, shared, tail):
        tokens = self.bases[base][:shared] + tail
        if tokens:
            self.waiting[f"r{self.next_id}"] = tokens
            self.next_id += 1

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.waiting)))
        tokens = self.waiting[request_id]
        cached = self.manager.num_cached_tokens(tokens)
        assert cached % self.manager.block_size == 0 and cached < len(tokens)
        # a chunk: at least one token past the cached prefix
        num_tokens = data.draw(st.integers(cached + 1, len(tokens)))
        free_before = self.manager.num_free_blocks
        got = self.manager.allocate(request_id, tokens, num_tokens)
        if got is None:
            assert (
                self.manager.num_free_blocks == free_before
                and request_id not in self.manager.block_tables
            )
            return
        assert got == cached
        del self.waiting[request_id]
        self.running[request_id] = [tokens, num_tokens, cached]
        # the cached blocks hold exactly these tokens
        for i in range(cached // self.manager.block_size):
            key = self.manager.blocks[self.manager.block_tables[request_id][i]].hash_key
            b = self.manager.block_size
            assert key is not None and list(key[1]) == tokens[i * b : (i + 1) * b]

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def compute(self, data):
        """A step computes the tokens it holds slots for; then either more of the prompt
        or one generated token needs a slot."""
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        state = self.running[request_id]
        tokens, held, _ = state
        state[2] = held
        self.manager.cache_blocks(request_id, tokens, held)
        if held == len(tokens):
            tokens.append(data.draw(st.integers(0, 5)))
        want = data.draw(st.integers(held + 1, len(tokens)))
        table_before = list(self.manager.block_tables[request_id])
        if self.manager.append_slots(request_id, want):
            state[1] = want
        else:
            assert self.manager.block_tables[request_id] == table_before

    @precondition(lambda self: self.running)
    @rule(data=st.data(), back_to_waiting=st.booleans())
    def leave(self, data, back_to_waiting):
        """Finish or abort, or be preempted: the blocks go back; a preempted request
        keeps its tokens and is admitted again later."""
        request_id = data.draw(st.sampled_from(sorted(self.running)))
        tokens = self.running.pop(request_id)[0]
        self.manager.free(request_id)
        if back_to_waiting:
            self.waiting[request_id] = tokens

    @invariant()
    def the_books_balance(self):
        m = self.manager
        holders = [0] * m.num_blocks
        for request_id, table in m.block_tables.items():
            assert len(set(table)) == len(table), "a block twice in one table"
            assert len(table) == cdiv(self.running[request_id][1], m.block_size)
            for block_id in table:
                holders[block_id] += 1
        assert [b.ref_count for b in m.blocks] == holders
        assert set(m.free_queue) == {i for i, n in enumerate(holders) if n == 0}
        assert len(m.free_queue) == len(set(m.free_queue))
        assert set(m.block_tables) == set(self.running)
        for block_hash, block_id in m.cached.items():
            assert m.blocks[block_id].block_hash == block_hash
        assert {b.block_id for b in m.blocks if b.block_hash is not None} == set(
            m.cached.values()
        )
        # the count kept as blocks come and go is the one a pass over the free list gives
        cached_free = sum(m.blocks[i].block_hash is not None for i in m.free_queue)
        assert m.num_cached_free_blocks == cached_free
        if not m.enable_prefix_caching:
            assert not m.cached

    def teardown(self):
        # everything left can finish: freeing all gives every block back
        if hasattr(self, "manager"):
            for request_id in list(self.running):
                self.manager.free(request_id)
            assert self.manager.num_free_blocks == self.manager.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None
)
