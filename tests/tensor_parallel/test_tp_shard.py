"""How heads are dealt to ranks, and which sizes are refused (no process is started for these)."""

from __future__ import annotations

import pytest

from llmserve.errors import ConfigError
from llmserve.plugins.backends.torch.tp_shard import HeadShard, head_shard, split


def shards(heads: int, kv: int, world: int) -> list[HeadShard]:
    return [head_shard(heads, kv, world, r) for r in range(world)]


def test_split_deals_evenly_first_ranks_first():
    assert [split(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [split(4, 2, r) for r in range(2)] == [(0, 2), (2, 4)]


def test_whole_kv_groups_per_rank():
    # SmolLM2's layout: 9 heads in 3 KV groups over 2 ranks -> 2 groups and 1 group.
    assert shards(9, 3, 2) == [HeadShard(0, 6, 0, 2), HeadShard(6, 9, 2, 3)]
    assert shards(9, 3, 3) == [HeadShard(0, 3, 0, 1), HeadShard(3, 6, 1, 2), HeadShard(6, 9, 2, 3)]


def test_fewer_kv_heads_than_ranks_replicates_them():
    # 8 heads in 2 KV heads over 4 ranks: each KV head on two ranks, which split its 4 query heads.
    assert shards(8, 2, 4) == [HeadShard(0, 2, 0, 1), HeadShard(2, 4, 0, 1), HeadShard(4, 6, 1, 2),
                               HeadShard(6, 8, 1, 2)]


@pytest.mark.parametrize("heads, kv, world", [(9, 3, 4), (4, 2, 3), (6, 2, 4)])
def test_sizes_that_cannot_split_are_refused_in_one_line(heads, kv, world):
    with pytest.raises(ConfigError) as err:
        head_shard(heads, kv, world, 0, "model 'x'")
    text = str(err.value)
    assert "\n" not in text and f"--tensor-parallel-size {world}" in text and f"{heads} attention heads" in text
    assert "use one of 1, 2" in text
