"""Tests for trainer.algo.logprobs: chunked == naive, sampler processing, memory bound, HF helper."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from trainer.algo.logprobs import (
    naive_token_logprobs,
    packed_target_mask,
    sequence_logprobs,
    token_logprobs,
)


def make_inputs(seed: int = 0, b: int = 2, t: int = 37, h: int = 16, v: int = 50, dtype=None):
    g = torch.Generator().manual_seed(seed)
    dtype = dtype or torch.float32
    hidden = torch.randn(b, t, h, generator=g, dtype=dtype).requires_grad_()
    weight = (torch.randn(v, h, generator=g, dtype=dtype) / math.sqrt(h) * 3).requires_grad_()
    bias = (0.1 * torch.randn(v, generator=g, dtype=dtype)).requires_grad_()
    targets = torch.randint(0, v, (b, t), generator=g)
    return hidden, weight, bias, targets


def grads_of(out, params, seed: int = 1):
    """Gradients of a random linear functional of (finite) log-probs and entropies."""
    g = torch.Generator().manual_seed(seed)
    lp = out.logprobs
    finite = torch.isfinite(lp)
    w1 = torch.randn(lp.shape, generator=g, dtype=lp.dtype)
    total = torch.where(finite, lp, torch.zeros_like(lp)).mul(w1).sum()
    if out.entropy is not None:
        total = total + out.entropy.mul(torch.randn(lp.shape, generator=g, dtype=lp.dtype)).sum()
    return torch.autograd.grad(total, params)


@pytest.mark.parametrize("chunk_size", [1, 7, 32, 1000])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize(
    "top_k, top_p", [(None, None), (5, None), (None, 0.8), (10, 0.9)], ids=["plain", "k", "p", "kp"]
)
def test_chunked_matches_naive(chunk_size, temperature, top_k, top_p) -> None:
    hidden, weight, bias, targets = make_inputs()
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, return_entropy=True)
    got = token_logprobs(hidden, weight, targets, chunk_size=chunk_size, lm_head_bias=bias, **kw)
    ref = naive_token_logprobs(hidden, weight, targets, lm_head_bias=bias, **kw)
    assert got.logprobs.shape == targets.shape and got.entropy.shape == targets.shape
    # Same -inf pattern (tokens the sampler could not have produced), same finite values.
    assert torch.equal(torch.isinf(got.logprobs), torch.isinf(ref.logprobs))
    finite = torch.isfinite(ref.logprobs)
    torch.testing.assert_close(got.logprobs[finite], ref.logprobs[finite], rtol=0, atol=1e-5)
    torch.testing.assert_close(got.entropy, ref.entropy, rtol=0, atol=1e-5)
    for a, b in zip(
        grads_of(got, [hidden, weight, bias]), grads_of(ref, [hidden, weight, bias]), strict=True
    ):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_chunked_gradcheck_float64() -> None:
    hidden, weight, bias, targets = make_inputs(b=1, t=6, h=4, v=9, dtype=torch.float64)

    def fn(h, w, b):
        out = token_logprobs(
            h, w, targets, temperature=0.7, chunk_size=4, return_entropy=True, lm_head_bias=b
        )
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden, weight, bias))


@settings(max_examples=25, deadline=None)
@given(
    n=st.integers(1, 40),
    v=st.integers(2, 30),
    chunk=st.integers(1, 50),
    top_k=st.one_of(st.none(), st.integers(1, 35)),
    seed=st.integers(0, 2**16),
)
def test_chunked_matches_naive_random_shapes(n, v, chunk, top_k, seed) -> None:
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, 8, generator=g, requires_grad=True)
    weight = torch.randn(v, 8, generator=g, requires_grad=True)
    targets = torch.randint(0, v, (n,), generator=g)
    got = token_logprobs(hidden, weight, targets, top_k=top_k, chunk_size=chunk, temperature=0.9)
    ref = naive_token_logprobs(hidden, weight, targets, top_k=top_k, temperature=0.9)
    assert got.logprobs.shape == (n,)
    assert torch.equal(torch.isinf(got.logprobs), torch.isinf(ref.logprobs))
    finite = torch.isfinite(ref.logprobs)
    torch.testing.assert_close(got.logprobs[finite], ref.logprobs[finite], rtol=0, atol=1e-5)
    for a, b in zip(grads_of(got, [hidden, weight]), grads_of(ref, [hidden, weight]), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk_size", [3, 1000])
@pytest.mark.parametrize("temperature", [0.7, 1.0])
@pytest.mark.parametrize(
    "top_k, top_p", [(None, None), (5, None), (None, 0.8), (10, 0.9)], ids=["plain", "k", "p", "kp"]
)
@pytest.mark.parametrize("entropy", [False, True])
def test_frozen_head_matches_naive(chunk_size, temperature, top_k, top_p, entropy) -> None:
    # A frozen head (LoRA) takes the other backward: hidden-state gradients from expectations
    # saved in forward. Same values, same gradients as plain autograd over full logits.
    hidden, weight, bias, targets = make_inputs()
    weight, bias = weight.detach(), bias.detach()
    targets[0, :3] = -100  # ignored targets: log-prob 0, no gradient
    kw = dict(temperature=temperature, top_k=top_k, top_p=top_p, return_entropy=entropy)
    got = token_logprobs(hidden, weight, targets, chunk_size=chunk_size, lm_head_bias=bias, **kw)
    ref = naive_token_logprobs(hidden, weight, targets, lm_head_bias=bias, **kw)
    assert torch.equal(torch.isinf(got.logprobs), torch.isinf(ref.logprobs))
    finite = torch.isfinite(ref.logprobs)
    torch.testing.assert_close(got.logprobs[finite], ref.logprobs[finite], rtol=0, atol=1e-5)
    if entropy:
        torch.testing.assert_close(got.entropy, ref.entropy, rtol=0, atol=1e-5)
    (a,), (b,) = grads_of(got, [hidden]), grads_of(ref, [hidden])
    assert a.abs().max() > 0
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_frozen_head_gradcheck_float64() -> None:
    hidden, weight, bias, targets = make_inputs(b=1, t=6, h=4, v=9, dtype=torch.float64)
    weight, bias = weight.detach(), bias.detach()

    def fn(h):
        out = token_logprobs(
            h,
            weight,
            targets,
            temperature=0.7,
            chunk_size=4,
            return_entropy=True,
            lm_head_bias=bias,
        )
        return out.logprobs, out.entropy

    assert torch.autograd.gradcheck(fn, (hidden,))


def test_entropy_grad_false_detaches_only_the_entropy() -> None:
    hidden, weight, _, targets = make_inputs()
    for w in (weight, weight.detach()):  # trained and frozen head
        out = token_logprobs(hidden, w, targets, return_entropy=True, entropy_grad=False)
        ref = token_logprobs(hidden, w, targets, return_entropy=True)
        assert not out.entropy.requires_grad and ref.entropy.requires_grad
        torch.testing.assert_close(out.entropy, ref.entropy.detach(), rtol=0, atol=0)
        got = torch.autograd.grad(out.logprobs.sum(), hidden)[0]
        want = torch.autograd.grad(ref.logprobs.sum(), hidden)[0]
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_frozen_head_backward_builds_nothing_of_vocab_size() -> None:
    t, v, h, chunk = 4096, 512, 16, 256
    hidden = torch.randn(t, h, requires_grad=True)
    weight = torch.randn(v, h)  # frozen
    targets = torch.randint(0, v, (t,))
    saved: list[int] = []
    with torch.autograd.graph.saved_tensors_hooks(
        lambda x: saved.append(x.numel()) or x, lambda x: x
    ):
        out = token_logprobs(hidden, weight, targets, chunk_size=chunk, return_entropy=True)
    in_backward = _MaxNumel()
    with in_backward:
        (out.logprobs.sum() + out.entropy.sum()).backward()
    assert hidden.grad is not None and in_backward.ops > 0
    # Saved: the head and (T, H) expectations. Backward works on (T, H), never a logits chunk.
    assert max(saved) <= max(t * h, v * h)
    assert in_backward.max_numel <= t * h < chunk * v


def identity_head(logits: list[list[float]]):
    """hidden = logits and W = I, so the head reproduces the given logits exactly."""
    x = torch.tensor(logits, dtype=torch.float64)
    return x, torch.eye(x.shape[-1], dtype=torch.float64)


def test_top_k_keeps_ties_and_gives_minus_inf_outside() -> None:
    hidden, weight = identity_head([[5.0, 4.0, 4.0, 4.0, 1.0, 0.0]] * 6)
    targets = torch.arange(6)
    out = token_logprobs(hidden, weight, targets, top_k=2)
    # The 2nd-largest value 4.0 is shared by three tokens: all of them stay in.
    kept = torch.log_softmax(torch.tensor([5.0, 4.0, 4.0, 4.0], dtype=torch.float64), -1)
    torch.testing.assert_close(out.logprobs[:4], kept)
    assert torch.all(out.logprobs[4:] == -math.inf)


@pytest.mark.parametrize(
    "top_p, kept",
    [(0.45, [0]), (0.55, [0, 2]), (0.75, [0, 1, 2]), (0.95, [0, 1, 2, 3]), (1.0, [0, 1, 2, 3])],
)
def test_top_p_nucleus_with_ties(top_p: float, kept: list[int]) -> None:
    probs = torch.tensor([0.5, 0.2, 0.2, 0.1], dtype=torch.float64)
    hidden, weight = identity_head([probs.log().tolist()] * 4)
    out = token_logprobs(hidden, weight, torch.arange(4), top_p=top_p, return_entropy=True)
    keep = torch.zeros(4, dtype=torch.bool)
    keep[kept] = True
    # Renormalised over the kept set. By sorted position, as the samplers: at 0.55 the tie at
    # 0.2 is split (here torch.sort puts id 1 first, so it is dropped).
    expected = torch.where(keep, (probs / probs[keep].sum()).log(), -math.inf)
    torch.testing.assert_close(out.logprobs, expected)
    q = probs[keep] / probs[keep].sum()
    torch.testing.assert_close(out.entropy, (-(q * q.log()).sum()).expand(4))


def test_temperature_scales_logits() -> None:
    hidden, weight = identity_head([[2.0, 1.0, 0.0]])
    out = token_logprobs(hidden, weight, torch.tensor([0]), temperature=0.5)
    expected = torch.log_softmax(torch.tensor([4.0, 2.0, 0.0], dtype=torch.float64), -1)[0]
    torch.testing.assert_close(out.logprobs[0], expected)


def test_negative_targets_are_ignored() -> None:
    hidden, weight, bias, targets = make_inputs(t=5)
    targets[0, 2] = -100
    out = token_logprobs(hidden, weight, targets, chunk_size=3)
    assert out.logprobs[0, 2] == 0
    (g_h,) = torch.autograd.grad(out.logprobs.sum(), [hidden])
    assert torch.all(g_h[0, 2] == 0) and torch.any(g_h[0, 1] != 0)


class _MaxNumel(TorchDispatchMode):
    """Records the largest tensor any ATen op produces while active."""

    def __init__(self) -> None:
        super().__init__()
        self.max_numel = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, tuple | list) else (out,):
            if isinstance(o, torch.Tensor):
                self.max_numel = max(self.max_numel, o.numel())
                self.ops += 1
        return out


@pytest.mark.parametrize("fn, bounded", [(token_logprobs, True), (naive_token_logprobs, False)])
def test_chunked_path_never_holds_full_logits(fn, bounded: bool) -> None:
    t, v, h, chunk = 4096, 512, 32, 256
    hidden = torch.randn(t, h, requires_grad=True)
    weight = torch.randn(v, h, requires_grad=True)
    targets = torch.randint(0, v, (t,))
    saved: list[int] = []

    def pack(x: torch.Tensor) -> torch.Tensor:
        saved.append(x.numel())
        return x

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
        out = fn(hidden, weight, targets, chunk_size=chunk, return_entropy=True, top_k=50)
    loss = out.logprobs.sum() + out.entropy.sum()
    in_backward = _MaxNumel()
    with in_backward:
        loss.backward()
    assert saved and in_backward.ops > 0  # the probes saw real work
    assert hidden.grad is not None and weight.grad is not None
    if bounded:
        # Saved for backward: only inputs. Built during backward: at most one chunk of logits.
        assert max(saved) < t * v
        assert max(saved) <= max(t * h, v * h)
        assert in_backward.max_numel <= chunk * v
    else:  # positive control: the probes do catch a full (T, V) tensor
        assert max(saved) >= t * v and in_backward.max_numel >= t * v


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"temperature": 0.0}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"chunk_size": 0}, "chunk_size"),
    ],
)
def test_argument_validation(kwargs, match) -> None:
    hidden, weight, _, targets = make_inputs(t=4)
    with pytest.raises(ValueError, match=match):
        token_logprobs(hidden, weight, targets, **kwargs)


def test_shape_validation() -> None:
    hidden, weight, _, targets = make_inputs(t=4)
    with pytest.raises(ValueError, match="targets shape"):
        token_logprobs(hidden, weight, targets[:, :-1])
    with pytest.raises(ValueError, match="hidden"):
        token_logprobs(hidden[..., :-1], weight, targets)


@pytest.fixture(scope="module")
def tiny_qwen():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.Qwen2Config(
        vocab_size=97,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        intermediate_size=128,
        attn_implementation="eager",
    )
    return transformers.Qwen2ForCausalLM(config).eval()


def full_logits_logprobs(model, input_ids, temperature=1.0, **kw):
    logits = model(input_ids, **kw).logits.float() / temperature
    logp = torch.log_softmax(logits, dim=-1)[:, :-1]
    lp = logp.gather(-1, input_ids[:, 1:, None]).squeeze(-1)
    return lp, -(logp.exp() * logp).sum(-1)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_sequence_logprobs_matches_model_logits(tiny_qwen, temperature, chunk_size) -> None:
    input_ids = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(1))
    out = sequence_logprobs(
        tiny_qwen, input_ids, temperature=temperature, chunk_size=chunk_size, return_entropy=True
    )
    ref_lp, ref_ent = full_logits_logprobs(tiny_qwen, input_ids, temperature)
    # out[:, t] scores input_ids[:, t + 1].
    assert out.logprobs.shape == (3, 19)
    torch.testing.assert_close(out.logprobs, ref_lp, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.entropy, ref_ent, rtol=0, atol=1e-5)
    params = [p for p in tiny_qwen.parameters() if p.requires_grad]
    weights = torch.randn(out.logprobs.shape, generator=torch.Generator().manual_seed(2))
    got = torch.autograd.grad((out.logprobs * weights).sum(), params)
    ref = torch.autograd.grad((ref_lp * weights).sum(), params)
    for a, b in zip(got, ref, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


def test_sequence_logprobs_with_left_padding(tiny_qwen) -> None:
    input_ids = torch.randint(0, 97, (2, 12), generator=torch.Generator().manual_seed(3))
    attention_mask = torch.ones_like(input_ids)
    attention_mask[1, :4] = 0
    out = sequence_logprobs(tiny_qwen, input_ids, attention_mask=attention_mask, chunk_size=4)
    ref, _ = full_logits_logprobs(tiny_qwen, input_ids, attention_mask=attention_mask)
    valid = attention_mask[:, 1:].bool()
    torch.testing.assert_close(out.logprobs[valid], ref[valid], rtol=0, atol=1e-5)


def test_packed_sequences_pass_position_ids(tiny_qwen) -> None:
    masking_utils = pytest.importorskip("transformers.masking_utils")
    if not hasattr(masking_utils, "find_packed_sequence_indices"):
        pytest.skip("this transformers does not isolate packed sequences by position_ids")
    gen = torch.Generator().manual_seed(4)
    a, b = torch.randint(0, 97, (1, 8), generator=gen), torch.randint(0, 97, (1, 11), generator=gen)
    packed = torch.cat([a, b], dim=1)
    position_ids = torch.cat([torch.arange(8), torch.arange(11)])[None]
    out = sequence_logprobs(tiny_qwen, packed, position_ids=position_ids, chunk_size=6).logprobs
    keep = packed_target_mask(position_ids)
    assert keep.shape == out.shape and keep.sum() == out.shape[1] - 1 and not keep[0, 7]
    separate = torch.cat(
        [sequence_logprobs(tiny_qwen, a).logprobs, sequence_logprobs(tiny_qwen, b).logprobs], dim=1
    )
    torch.testing.assert_close(out[keep].reshape(1, -1), separate, rtol=0, atol=1e-5)


def test_sequence_logprobs_rejects_softcapped_heads(tiny_qwen) -> None:
    tiny_qwen.config.final_logit_softcapping = 30.0
    try:
        with pytest.raises(ValueError, match="final_logit_softcapping"):
            sequence_logprobs(tiny_qwen, torch.zeros(1, 4, dtype=torch.long))
    finally:
        tiny_qwen.config.final_logit_softcapping = None


def test_gradient_through_excluded_targets_matches_naive() -> None:
    # A -inf log-prob still depends on the kept logits through the normaliser; the chunked
    # backward must not leak gradient into the dropped target's own logit.
    hidden, weight, bias, targets = make_inputs(t=9)
    got = token_logprobs(hidden, weight, targets, top_k=3, chunk_size=4).logprobs
    ref = naive_token_logprobs(hidden, weight, targets, top_k=3).logprobs
    assert torch.isinf(ref).any()
    upstream = torch.randn(ref.shape, generator=torch.Generator().manual_seed(5))
    for a, b in zip(
        torch.autograd.grad(got, [hidden, weight], upstream),
        torch.autograd.grad(ref, [hidden, weight], upstream),
        strict=True,
    ):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)


# -- precision and the samplers' top-p -------------------------------------------------------


def _tied_logits(seed: int, rows: int = 64, vocab: int = 50) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, vocab, generator=g) * 2
    x[:, 10:20] = x[:, :1]  # a block of ties with each row's token 0, wherever it falls
    x[:, 30:33] = x[:, 40:41]
    return x


@pytest.mark.parametrize("top_p", [0.3, 0.6, 0.9, 0.99])
@pytest.mark.parametrize("top_k", [0, 5, 15])
def test_top_p_keeps_exactly_what_transformers_and_vllm_keep(top_p: float, top_k: int) -> None:
    from transformers.generation.logits_process import TopKLogitsWarper, TopPLogitsWarper

    from trainer.algo.chunked_head import keep_mask as _keep_mask
    from trainer.rollout.hf import process_logits

    logits = _tied_logits(seed=int(top_p * 100) + top_k)
    ours = _keep_mask(logits, top_k or None, top_p)
    scores = logits.clone()
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    scores = TopPLogitsWarper(top_p)(None, scores)
    assert torch.equal(ours, scores > float("-inf"))
    # The generator side's own recomputation uses the same rule.
    assert torch.equal(process_logits(logits, 1.0, top_p, top_k) > float("-inf"), ours)
    # Boundary ties are split by position somewhere in these cases (else the test is moot).
    if top_p == 0.6 and top_k == 0:
        tied = logits[:, 10:20] == logits[:, :1]
        split = (ours[:, 10:20] & tied).any(1) & (~ours[:, 10:20] & tied).any(1)
        assert split.any()


def test_top_p_matches_vllm_sampler() -> None:
    pytest.importorskip("vllm")
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p_pytorch

    from trainer.algo.chunked_head import keep_mask as _keep_mask

    logits = _tied_logits(seed=5)
    # top-p alone. With top-k as well, vLLM keeps its one sort of the raw logits while
    # transformers (and this module) sort the top-k-masked ones again, so the two samplers may
    # order a tie differently there; the learner follows transformers (module docstring).
    for top_k, top_p in [(None, 0.6), (None, 0.9), (None, 0.3)]:
        k = None if top_k is None else torch.full((logits.shape[0],), top_k)
        p = torch.full((logits.shape[0],), top_p)
        theirs = apply_top_k_top_p_pytorch(logits.clone(), k, p, allow_cpu_sync=True)
        assert torch.equal(_keep_mask(logits, top_k, top_p), theirs > float("-inf"))


def test_lm_head_and_softmax_run_in_float32_under_bf16_autocast() -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(2, 24, 64, generator=g).bfloat16().requires_grad_()
    weight = (torch.randn(300, 64, generator=g) * 0.2).requires_grad_()  # float32 master
    targets = torch.randint(0, 300, (2, 24), generator=g)
    kw = dict(temperature=0.7, top_p=0.95, chunk_size=16, return_entropy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = token_logprobs(hidden, weight, targets, **kw)
    assert got.logprobs.dtype == torch.float32
    h32 = hidden.detach().float().requires_grad_()
    w32 = weight.detach().clone().requires_grad_()
    ref = token_logprobs(h32, w32, targets, **kw)  # no autocast: float32 throughout
    torch.testing.assert_close(got.logprobs, ref.logprobs, rtol=0, atol=1e-6)
    # A bf16 head would be visibly off: what the rule prevents.
    bf16_head = torch.log_softmax(
        (hidden.detach() @ weight.detach().bfloat16().t()).float() / 0.7, -1
    )
    full = torch.log_softmax((h32.detach() @ w32.detach().t()) / 0.7, -1)
    assert (bf16_head - full).abs().max() > 1e-3
    # Backward runs at the forward's precision: the same gradients as the float32 reference,
    # the hidden states' in their own dtype.
    loss = (got.logprobs * 0.1 + got.entropy * 0.01).sum()
    ref_loss = (ref.logprobs * 0.1 + ref.entropy * 0.01).sum()
    gh, gw = torch.autograd.grad(loss, [hidden, weight])
    rh, rw = torch.autograd.grad(ref_loss, [h32, w32])
    assert gh.dtype == torch.bfloat16 and gw.dtype == torch.float32
    torch.testing.assert_close(gw, rw, rtol=0, atol=1e-6)
    torch.testing.assert_close(gh, rh.bfloat16(), rtol=0, atol=0)


def test_frozen_head_under_bf16_autocast_matches_float32() -> None:
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 24, 64, generator=g).bfloat16().requires_grad_()
    weight = torch.randn(300, 64, generator=g) * 0.2  # frozen float32 head
    targets = torch.randint(0, 300, (2, 24), generator=g)
    kw = dict(temperature=0.7, top_p=0.95, chunk_size=16, return_entropy=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = token_logprobs(hidden, weight, targets, **kw)
    h32 = hidden.detach().float().requires_grad_()
    ref = naive_token_logprobs(h32, weight, targets, **kw)
    finite = torch.isfinite(ref.logprobs)
    torch.testing.assert_close(got.logprobs[finite], ref.logprobs[finite], rtol=0, atol=1e-5)
    (gh,) = torch.autograd.grad((got.logprobs[finite] * 0.1).sum() + got.entropy.sum(), [hidden])
    (rh,) = torch.autograd.grad((ref.logprobs[finite] * 0.1).sum() + ref.entropy.sum(), [h32])
    assert gh.dtype == torch.bfloat16
    torch.testing.assert_close(gh.float(), rh, rtol=1e-2, atol=1e-3)
