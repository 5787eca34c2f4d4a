import pytest

from engine.block_pool import BlockPool, OutOfBlocksError
from engine.kv_cache import KVCacheManager
from tests.helpers import make_seq


def test_allocate_and_free_return_blocks_in_order():
    pool = BlockPool(4)
    assert pool.allocate(2) == [0, 1]
    assert pool.allocate(1) == [2]
    assert pool.num_free_blocks == 1
    pool.free([0, 1])
    assert pool.num_free_blocks == 3
    assert pool.allocate(3) == [3, 1, 0]  # freed blocks queue behind free ones, tail block first


def test_out_of_blocks_changes_nothing():
    pool = BlockPool(2)
    pool.allocate(1)
    with pytest.raises(OutOfBlocksError):
        pool.allocate(2)
    assert pool.num_free_blocks == 1


def test_shared_block_is_free_only_after_last_holder():
    pool = BlockPool(2)
    [block] = pool.allocate(1)
    pool.share([block])
    assert pool.ref_count(block) == 2
    pool.free([block])
    assert pool.num_free_blocks == 1
    pool.free([block])
    assert pool.num_free_blocks == 2
    with pytest.raises(AssertionError):
        pool.free([block])


def test_kv_manager_grows_block_table_per_block_boundary():
    kv = KVCacheManager(num_blocks=8, block_size=4)
    seq = make_seq(6)
    assert kv.blocks_needed(seq, 6) == 2
    kv.allocate(seq, 6)
    assert seq.block_table == [0, 1]
    seq.num_computed_tokens = 6
    assert kv.blocks_needed(seq, 2) == 0  # tokens 6, 7 fit the second block
    assert kv.blocks_needed(seq, 3) == 1
    kv.allocate(seq, 3)
    assert seq.block_table == [0, 1, 2]
    kv.free(seq)
    assert seq.block_table == [] and seq.num_computed_tokens == 0
    assert kv.num_free_blocks == 8
