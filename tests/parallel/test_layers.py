"""TP layers at tp=2 (and tp=1) against dense nn.Embedding / nn.Linear holding the same full weights.

Every check compares the forward output and every gradient (input and parameters) with the dense
layer: a rank's parameter gradient must equal its slice of the dense gradient, and a replicated
parameter's gradient the whole dense gradient. The loss is <u, output> with one fixed `u`, counted
once, so the dense gradient is the reference for the whole group.
"""
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.testing import assert_close

from megalign.parallel.layers import (
    ColumnParallelLinear,
    Embedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    pad_vocab_size,
    tp_sharded_parameters,
)
from megalign.parallel.layout import ParallelLayout
from megalign.parallel.logprob import fused_linear_token_logprob

from .dist_utils import run_distributed

F64 = torch.float64


def _raises(exc_type, text, fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except exc_type as e:
        assert text in str(e), f"{text!r} not in {str(e)!r}"
    else:
        raise AssertionError(f"{fn} accepted bad input; expected {exc_type.__name__}: {text}")


def _layouts():
    """tp=2 on both ranks, then tp=1 (dp=2), so the size-1 early returns are checked too."""
    return [ParallelLayout.build(tp=2), ParallelLayout.build(tp=1)]


def test_pad_vocab_size():
    assert [pad_vocab_size(v, 2) for v in (7, 8, 9)] == [8, 8, 10]
    assert pad_vocab_size(151_936, 8, multiple_of=128) == 152_576
    assert pad_vocab_size(5, 1) == 5


def _check_embedding():
    for layout in _layouts():
        group, tp, r = layout.tp_group, layout.tp, layout.tp_rank
        for vocab, multiple in ((7, 1), (8, 1), (9, 4)):
            torch.manual_seed(vocab)
            dense = nn.Embedding(vocab, 5, dtype=F64)
            ids = torch.tensor([[0, vocab - 1, 3, 3, 1], [2, vocab - 2, 0, 6, 4]])
            u = torch.randn(2, 5, 5, dtype=F64)
            layer = VocabParallelEmbedding.from_full(dense.weight.detach(), group=group, pad_to_multiple_of=multiple)
            padded = pad_vocab_size(vocab, tp, multiple)
            per_rank = padded // tp
            assert layer.padded_num_embeddings == padded and layer.weight.shape == (per_rank, 5)
            assert (layer.vocab_start_index, layer.vocab_end_index) == (r * per_rank, (r + 1) * per_rank)
            assert tp_sharded_parameters(layer) == {layer.weight: 0}

            out = layer(ids)
            ref = dense(ids)
            assert_close(out, ref)
            (out * u).sum().backward()
            (ref * u).sum().backward()
            padded_grad = F.pad(dense.weight.grad, (0, 0, 0, padded - vocab))
            assert_close(layer.weight.grad, padded_grad[r * per_rank : (r + 1) * per_rank])
            # a padded full weight loads the same; padding rows are zero
            layer.load_full_weight(F.pad(dense.weight.detach(), (0, 0, 0, padded - vocab)))
            assert_close(layer(ids), ref)
            full_rows = F.pad(dense.weight.detach(), (0, 0, 0, padded - vocab))
            assert_close(layer.weight, full_rows[r * per_rank : (r + 1) * per_rank])
        _raises(ValueError, "full weight has shape (6, 5), expected (7 or padded 8, 5)",
                VocabParallelEmbedding(7, 5, group=group, pad_to_multiple_of=8 // tp).load_full_weight, torch.zeros(6, 5))


def test_vocab_parallel_embedding_matches_dense():
    run_distributed(_check_embedding)


def _tied_microbatches(vocab, padded, dim, steps, seed):
    """`steps` micro-batches of (ids [2, 5] in [0, vocab), u [2, 5, padded]) and the reference gradient of
    sum_k <u_k, F.embedding(ids_k, W) @ W^T> over a dense fp64 leaf W [padded, dim] (rows past vocab zero)."""
    torch.manual_seed(seed)
    weight = F.pad(torch.randn(vocab, dim, dtype=F64), (0, 0, 0, padded - vocab)).requires_grad_()
    batches = [(torch.randint(0, vocab, (2, 5)), torch.randn(2, 5, padded, dtype=F64)) for _ in range(steps)]
    for ids, u in batches:
        (F.linear(F.embedding(ids, weight), weight) * u).sum().backward()
    return weight, batches


def test_embedding_gradient_matches_dense_embedding():
    """`Embedding` (tp = 1, `embedding_into_grad`) gives the gradient of a plain `F.embedding` in `.grad`: untied,
    tied to a linear head or to the fused head, over several micro-batches; frozen or without grad mode it is
    the plain lookup."""
    vocab, dim = 11, 4
    ref, batches = _tied_microbatches(vocab, vocab, dim, 3, seed=2)
    layer = Embedding(vocab, dim, dtype=F64)
    with torch.no_grad():
        layer.weight.copy_(ref.detach())
    for ids, u in batches:  # tied to a linear head: the head's gradient becomes .grad, the lookup adds into it
        (F.linear(layer(ids), layer.weight) * u).sum().backward()
        assert layer.weight.grad.layout == torch.strided
    assert_close(layer.weight.grad, ref.grad)

    layer.weight.grad = None
    want = ref.detach().clone().requires_grad_()
    for ids, u in batches:  # untied: the first micro-batch creates .grad, the next add into it
        (layer(ids) * u[..., :dim]).sum().backward()
        (F.embedding(ids, want) * u[..., :dim]).sum().backward()
    assert_close(layer.weight.grad, want.grad)

    layer.weight.grad, want.grad = None, None
    for ids, u in batches:  # tied to the fused head (its fp64 accumulator is the head's gradient)
        targets = ids.roll(1, -1)
        fused_linear_token_logprob(layer(ids).tanh(), layer.weight, targets, chunk_size=3).sum().backward()
        fused_linear_token_logprob(F.embedding(ids, want).tanh(), want, targets, chunk_size=3).sum().backward()
    assert_close(layer.weight.grad, want.grad)

    # without grad mode and for a frozen weight: the plain lookup, no graph
    ids = batches[0][0]
    with torch.no_grad():
        assert layer(ids).grad_fn is None
    layer.weight.requires_grad_(False)
    assert layer(ids).grad_fn is None
    assert_close(layer(ids), F.embedding(ids, ref.detach()))


def test_embedding_gradient_only_in_full_backward():
    """The documented cost: `torch.autograd.grad` and `backward(inputs=...)` do not run the lookup's backward
    (autograd has no edge from it to the weight), so they see only the weight's other uses (the tied head) and
    leave `.grad` alone."""
    layer = Embedding(7, 3, dtype=F64)
    ids = torch.tensor([[1, 4, 4]])
    out = layer(ids)
    head_part = out.detach().sum((0, 1)).expand(7, 3)
    (got,) = torch.autograd.grad(F.linear(out, layer.weight).sum(), layer.weight)
    assert_close(got, head_part)
    assert layer.weight.grad is None
    F.linear(layer(ids), layer.weight).sum().backward(inputs=[layer.weight])
    assert_close(layer.weight.grad, head_part)


def _check_tied_embedding():
    """`VocabParallelEmbedding` tied to a `ColumnParallelLinear` head (the LM head's layout), two micro-batches:
    each rank's `.grad` is its rows of the dense tied gradient (padding rows included)."""
    for layout in _layouts():
        group, tp, r = layout.tp_group, layout.tp, layout.tp_rank
        vocab, dim, multiple = 9, 4, 2
        padded = pad_vocab_size(vocab, tp, multiple)
        ref, batches = _tied_microbatches(vocab, padded, dim, 2, seed=3)
        embed = VocabParallelEmbedding.from_full(ref.detach()[:vocab], group=group, pad_to_multiple_of=multiple)
        head = ColumnParallelLinear(dim, padded, group=group, bias=False, dtype=F64)
        head.weight = embed.weight
        per_rank = padded // tp
        for ids, u in batches:
            (head(embed(ids)) * u[..., r * per_rank:(r + 1) * per_rank]).sum().backward()
        assert_close(embed.weight.grad, ref.grad[r * per_rank:(r + 1) * per_rank])


def test_vocab_parallel_tied_embedding_gradient_matches_dense():
    run_distributed(_check_tied_embedding)


def _compare_with_dense(layer, dense, x, u, *, input_sharded, output_sharded):
    """Forward and every gradient of `layer` (a tp module) vs `dense` (the same math unsharded).

    `input_sharded` / `output_sharded`: the layer takes / returns this rank's last-dim slice of the
    dense input / output. Each rank's loss is <u, its output>; summed over ranks (or counted once when
    the output is replicated) that is the dense loss <u, dense(x)>.
    """
    r, tp = dist.get_rank(layer_group(layer)), dist.get_world_size(layer_group(layer))

    def local(t, sharded):
        return t.chunk(tp, dim=-1)[r] if sharded else t

    x_layer, x_dense = _leaf(local(x, input_sharded)), _leaf(x)
    y, y_ref = layer(x_layer), dense(x_dense)
    assert_close(y, local(y_ref.detach(), output_sharded))
    (y * local(u, output_sharded)).sum().backward()
    (y_ref * u).sum().backward()
    assert_close(x_layer.grad, local(x_dense.grad, input_sharded))
    sharded = tp_sharded_parameters(layer)
    dense_params = dict(dense.named_parameters())
    assert dense_params.keys() == dict(layer.named_parameters()).keys()
    for name, p in layer.named_parameters():
        ref = dense_params[name].grad
        assert_close(p.grad, ref.chunk(tp, dim=sharded[p])[r] if p in sharded else ref, msg=name)


def layer_group(module):
    return next(m.group for m in module.modules() if hasattr(m, "group"))


def _leaf(t):
    return t.detach().clone().requires_grad_()


def _check_linears():
    for layout in _layouts():
        group = layout.tp_group
        torch.manual_seed(1)
        x = torch.randn(2, 3, 6, dtype=F64)  # [batch, seq, in]
        u = torch.randn(2, 3, 4, dtype=F64)
        for bias in (True, False):
            dense = nn.Linear(6, 4, bias=bias, dtype=F64)
            full = (dense.weight.detach(), dense.bias.detach() if bias else None)
            for gather_output in (False, True):
                layer = ColumnParallelLinear.from_full(*full, group=group, gather_output=gather_output)
                assert layer.weight.shape == (4 // layout.tp, 6)
                _compare_with_dense(layer, dense, x, u, input_sharded=False, output_sharded=not gather_output)
                dense.zero_grad()
            dense = nn.Linear(6, 4, bias=bias, dtype=F64)
            full = (dense.weight.detach(), dense.bias.detach() if bias else None)
            for input_is_parallel in (True, False):
                layer = RowParallelLinear.from_full(*full, group=group, input_is_parallel=input_is_parallel)
                assert layer.weight.shape == (4, 6 // layout.tp)
                _compare_with_dense(layer, dense, x, u, input_sharded=input_is_parallel, output_sharded=False)
                dense.zero_grad()

        # the Megatron MLP: column (no gather) -> elementwise -> row (parallel input); one all-reduce
        # forward, one backward, and the input gradient is complete only if both are right
        dense = nn.Sequential(nn.Linear(6, 8, dtype=F64), nn.GELU(), nn.Linear(8, 4, dtype=F64))
        mlp = nn.Sequential(
            ColumnParallelLinear.from_full(dense[0].weight.detach(), dense[0].bias.detach(), group=group),
            nn.GELU(),
            RowParallelLinear.from_full(dense[2].weight.detach(), dense[2].bias.detach(), group=group),
        )
        _compare_with_dense(mlp, dense, x, u, input_sharded=False, output_sharded=False)

        # load_full_weight into an existing layer replaces its shard
        layer = ColumnParallelLinear(6, 8, group=group, dtype=F64)
        layer.load_full_weight(dense[0].weight.detach(), dense[0].bias.detach())
        assert_close(layer.weight, dense[0].weight.detach().chunk(layout.tp)[layout.tp_rank])

        _raises(ValueError, "ColumnParallelLinear: full weight has shape (8, 5), expected (8, 6)",
                layer.load_full_weight, torch.zeros(8, 5), torch.zeros(8))
        _raises(ValueError, "ColumnParallelLinear: full bias has shape (4,), expected (8,)",
                layer.load_full_weight, torch.zeros(8, 6), torch.zeros(4))
        _raises(ValueError, "layer has bias=False but a full bias was given",
                RowParallelLinear(6, 4, group=group, bias=False).load_full_weight, torch.zeros(4, 6), torch.zeros(4))
        _raises(ValueError, "layer has bias=True but a full bias was not given",
                RowParallelLinear(6, 4, group=group).load_full_weight, torch.zeros(4, 6))
        if layout.tp == 2:
            _raises(ValueError, "ColumnParallelLinear: out_features=5 is not divisible by the tensor-parallel size 2",
                    ColumnParallelLinear, 6, 5, group=group)
            _raises(ValueError, "RowParallelLinear: in_features=7 is not divisible by the tensor-parallel size 2",
                    RowParallelLinear, 7, 4, group=group)


def test_column_and_row_parallel_linear_match_dense():
    run_distributed(_check_linears)
