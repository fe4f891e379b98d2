"""Tensor-parallel sharding without processes: the head / column / vocabulary splits, each parallel layer's
shards recombined (as the collectives would) against the unsharded layer, the meta-device shard transform,
dummy weights drawn as the unsharded model draws them, and the refusals that name the flag."""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass

import pytest
import torch

from conveyor.config import LoadFormat, ModelConfig, Quantization
from conveyor.model.loader import (
    DUMMY_WEIGHT_STD,
    build_empty_model,
    init_dummy_weights,
    load_model,
    read_arch_config,
)
from conveyor.model.parallel_layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    Span,
    TensorParallelGroup,
    VocabParallelEmbedding,
    split_evenly,
)
from conveyor.model.registry import ModelArchConfig
from conveyor.model.tensor_parallel import (
    TensorParallelError,
    check_tensor_parallel,
    head_shard,
    iter_full_dummy_weights,
    shard_model,
    tensor_parallel_quantization,
)

TINY = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 100, "num_hidden_layers": 2,
        "num_attention_heads": 6, "num_key_value_heads": 3, "head_dim": 16, "vocab_size": 301,
        "max_position_embeddings": 256, "tie_word_embeddings": False}


@dataclass(frozen=True)
class LocalGroup(TensorParallelGroup):
    """Collectives as identities: each rank's module returns its own part, which the test recombines."""

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        return x


def test_split_evenly_covers_the_range_with_sizes_one_apart() -> None:
    for total, world in [(9, 2), (1536, 2), (49152, 3), (5, 5), (7, 4)]:
        spans = [split_evenly(total, world, rank) for rank in range(world)]
        assert spans[0].start == 0 and spans[-1].stop == total
        assert all(a.stop == b.start for a, b in zip(spans, spans[1:]))
        assert max(s.size for s in spans) - min(s.size for s in spans) <= 1
        assert spans[0].size == max(s.size for s in spans)  # the first ranks take the extra


def test_head_shard_by_kv_group() -> None:
    # SmolLM2: 9 heads, 3 KV heads over 2 ranks: KV 2 + 1, each with its 3 query heads.
    assert head_shard(9, 3, 2, 0) == head_shard_of((0, 6), (0, 2))
    assert head_shard(9, 3, 2, 1) == head_shard_of((6, 9), (2, 3))
    # Llama-3.1-70B over 2: 32 + 32 query heads, 4 + 4 KV heads.
    assert head_shard(64, 8, 2, 1) == head_shard_of((32, 64), (4, 8))
    # 8 query / 2 KV heads over 4 ranks: each KV head on 2 ranks, which share its 4 query heads.
    assert [head_shard(8, 2, 4, r) for r in range(4)] == [
        head_shard_of((0, 2), (0, 1)), head_shard_of((2, 4), (0, 1)),
        head_shard_of((4, 6), (1, 2)), head_shard_of((6, 8), (1, 2))]


def head_shard_of(q: tuple[int, int], kv: tuple[int, int]):  # noqa: ANN201 - a HeadShard
    from conveyor.model.tensor_parallel import HeadShard

    return HeadShard(Span(*q), Span(*kv))


def test_impossible_splits_name_the_flag() -> None:
    with pytest.raises(TensorParallelError, match="--tensor-parallel-size 10 is more than the model's 9"):
        head_shard(9, 3, 10, 0)
    with pytest.raises(TensorParallelError, match="--tensor-parallel-size 4: the model has 3 KV heads"):
        head_shard(9, 3, 4, 0)
    config = ModelArchConfig.from_hf_config(TINY)
    check_tensor_parallel(config, 6)  # 3 KV heads on 2 ranks each, one query head per rank
    with pytest.raises(TensorParallelError, match="--tensor-parallel-size 5"):
        check_tensor_parallel(config, 5)


def test_gguf_quantization_is_refused_and_auto_dequantizes() -> None:
    with pytest.raises(TensorParallelError, match="--quantization gguf .* --tensor-parallel-size"):
        tensor_parallel_quantization(Quantization.GGUF)
    assert tensor_parallel_quantization(Quantization.AUTO) is Quantization.NONE


@pytest.mark.parametrize("world_size", [2, 3])
def test_parallel_layers_recombine_to_the_full_layer(world_size: int) -> None:
    torch.manual_seed(0)
    x = torch.randn(5, 64)
    q, kv, mlp = torch.randn(48, 64), torch.randn(24, 64), torch.randn(100, 64)
    groups = [LocalGroup(rank, world_size) for rank in range(world_size)]
    # Column: each rank's rows of q and of kv, stacked; together every row once.
    outs = []
    for g in groups:
        layer = ColumnParallelLinear(64, (split_evenly(48, world_size, g.rank), split_evenly(24, world_size, g.rank)),
                                     bias=False)
        layer.load_full("weight", 0, q)
        layer.load_full("weight", 1, kv)
        outs.append(layer(x).split([layer.spans[0].size, layer.spans[1].size], dim=-1))
    torch.testing.assert_close(torch.cat([o[0] for o in outs], -1), x @ q.T)
    torch.testing.assert_close(torch.cat([o[1] for o in outs], -1), x @ kv.T)
    # Row: partial products over the input columns add up to the full product.
    hidden, down = x @ mlp.T, torch.randn(64, 100)  # [5, 100]
    total = torch.zeros(5, 64)
    for g in groups:
        layer = RowParallelLinear(split_evenly(100, world_size, g.rank), 64, bias=False, group=g)
        layer.load_full("weight", None, down)
        total += layer(hidden[:, layer.columns.start:layer.columns.stop].contiguous())
    torch.testing.assert_close(total, hidden @ down.T, rtol=1e-4, atol=1e-4)
    # Vocabulary: each id found on one rank; logits side by side, padding cut.
    table, ids = torch.randn(301, 64), torch.tensor([0, 100, 150, 300, 299])
    embedded, logits = torch.zeros(5, 64), []
    for g in groups:
        layer = VocabParallelEmbedding(301, 64, g)
        layer.load_full("weight", None, table)
        embedded += layer(ids)
        logits.append(layer.project(x))
    torch.testing.assert_close(embedded, table[ids])
    torch.testing.assert_close(torch.cat(logits, -1)[:, :301], x @ table.T, rtol=1e-4, atol=1e-4)


def test_shard_model_holds_only_the_rank_share() -> None:
    config = ModelArchConfig.from_hf_config(TINY)  # 6 heads / 3 KV heads over 2 ranks: 4 + 2 / 2 + 1
    for rank, (heads, kv_heads, columns) in enumerate([(4, 2, 50), (2, 1, 50)]):
        model = build_empty_model(config, "meta", torch.float32)
        with torch.device("meta"):
            shard_model(model, TensorParallelGroup(rank, 2))
        attn = model.model.layers[0].self_attn
        assert (attn.num_heads, model.num_kv_heads) == (heads, kv_heads)
        assert attn.qkv_proj.weight.shape == ((heads + 2 * kv_heads) * 16, 64)
        assert attn.o_proj.weight.shape == (64, heads * 16)
        assert model.model.layers[0].mlp.down_proj.weight.shape == (64, columns)
        assert model.model.embed_tokens.weight.shape == model.lm_head.weight.shape == (151, 64)


@pytest.mark.parametrize("tied", [False, True])
def test_dummy_weights_drawn_in_full_equal_the_unsharded_draws(tmp_path: pathlib.Path, tied: bool) -> None:
    config = ModelArchConfig.from_hf_config({**TINY, "tie_word_embeddings": tied})
    direct = build_empty_model(config, "cpu", torch.float32)
    init_dummy_weights(direct, seed=7)
    via_hf = build_empty_model(config, "cpu", torch.float32)
    via_hf.load_weights(iter_full_dummy_weights(build_empty_model(config, "meta", torch.float32), "cpu", 7, 0.02))
    for (name, a), (_, b) in zip(direct.named_parameters(), via_hf.named_parameters()):
        assert torch.equal(a, b), name


def test_a_rank_loads_its_rows_of_the_checkpoint(tmp_path: pathlib.Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    model_config = ModelConfig(model=str(tmp_path), load_format=LoadFormat.DUMMY, seed=3)
    assert read_arch_config(model_config).num_attention_heads == 6
    full = load_model(model_config, "cpu", torch.float32).module
    rank1 = load_model(model_config, "cpu", torch.float32, tensor_parallel=TensorParallelGroup(1, 2)).module
    q_full = full.model.layers[1].self_attn.qkv_proj.weight[:96]  # 6 heads x 16
    q_rank1 = rank1.model.layers[1].self_attn.qkv_proj.weight[:32]  # heads 4, 5
    assert torch.equal(q_rank1, q_full[64:96])
    assert torch.equal(rank1.lm_head.weight[:150], full.lm_head.weight[151:301])
    assert torch.equal(rank1.lm_head.weight[150:], torch.zeros(1, 64))  # padding row
    down_full = full.model.layers[0].mlp.down_proj.weight
    assert torch.equal(rank1.model.layers[0].mlp.down_proj.weight, down_full[:, 50:])


@pytest.mark.parametrize("world_size", [2, 3, 6])
def test_ranks_shard_a_safetensors_checkpoint_as_they_shard_dummy_weights(tmp_path: pathlib.Path,
                                                                          world_size: int) -> None:
    """An HF checkpoint of the seeded dummy model: every rank's shard read from the file equals the shard
    sharded from the dummy draws (themselves the full model's rows: the test above). 3 KV heads over 2
    ranks are 2 + 1, over 3 one each, over 6 each replicated on two ranks that share its query heads."""
    from safetensors.torch import save_file

    (tmp_path / "config.json").write_text(json.dumps(TINY))
    config = ModelArchConfig.from_hf_config(TINY)
    reference = build_empty_model(config, "meta", torch.float32)
    tensors = {name: t.clone() for name, t in iter_full_dummy_weights(reference, "cpu", 3, DUMMY_WEIGHT_STD)}
    save_file(tensors, str(tmp_path / "model.safetensors"))
    checkpoint = ModelConfig(model=str(tmp_path), load_format=LoadFormat.SAFETENSORS)
    dummy = ModelConfig(model=str(tmp_path), load_format=LoadFormat.DUMMY, seed=3)
    for rank in range(world_size):
        group = TensorParallelGroup(rank, world_size)
        from_file = load_model(checkpoint, "cpu", torch.float32, tensor_parallel=group).module
        drawn = load_model(dummy, "cpu", torch.float32, tensor_parallel=group).module
        for (name, a), (_, b) in zip(from_file.named_parameters(), drawn.named_parameters(), strict=True):
            assert torch.equal(a, b), (rank, name)
        if world_size == 6:  # rank r holds KV head r // 2 whole, and query head r
            k_full = tensors["model.layers.0.self_attn.k_proj.weight"]  # [3 x 16, 64]
            q_full = tensors["model.layers.0.self_attn.q_proj.weight"]  # [6 x 16, 64]
            qkv = from_file.model.layers[0].self_attn.qkv_proj.weight  # [(1 + 1 + 1) x 16, 64]
            assert torch.equal(qkv[:16], q_full[16 * rank:16 * (rank + 1)])
            assert torch.equal(qkv[16:32], k_full[16 * (rank // 2):16 * (rank // 2 + 1)])
