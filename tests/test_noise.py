"""Counter-based sampling (decoding/noise.py, rules.sample_tokens): SplitMix64 as specified, uniform
draws, and a row's token fixed by its keys alone: alone or in a batch, in any order, in chunks or
not, over top-k or the whole vocabulary."""
import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.decoding import rules
from dllm_engine.decoding.noise import Noise, mix
from dllm_engine.decoding.rules import confidence, sample_tokens
from fixtures import write_checkpoint

M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """The reference finalizer on Python integers (unsigned 64-bit)."""
    z = (x + 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def as_unsigned(t: torch.Tensor) -> list[int]:
    return [v & M64 for v in t.tolist()]


def keys(n: int, seed: int = 0, positions=None, step: int = 1) -> Noise:
    positions = torch.arange(n) if positions is None else positions
    return Noise(torch.full((n,), seed), positions, torch.full((n,), step))


def test_mix_is_splitmix64():
    values = [0, 1, 2**63 - 1, -1, -(2**63), 123456789123456789, -987654321]
    got = as_unsigned(mix(torch.tensor(values)))
    assert got == [splitmix64(v & M64) for v in values]


def test_uniforms_lie_in_the_open_interval_and_fill_it_evenly():
    u = keys(1000).uniform(0, torch.arange(200))  # 200,000 draws
    assert u.dtype == torch.float32 and bool((u > 0).all() and (u < 1).all())
    deciles = torch.histc(u, bins=10, min=0, max=1) / u.numel()
    assert bool(((deciles - 0.1).abs() < 0.005).all()), deciles
    # another stream, seed, position or step: other numbers
    for other in (keys(1000, seed=1), keys(1000, step=2), keys(1000, positions=torch.arange(1, 1001))):
        assert not torch.equal(other.uniform(0, torch.arange(200)), u)
    assert not torch.equal(keys(1000).uniform(1, torch.arange(200)), u)


def test_a_rows_token_depends_on_its_keys_alone():
    torch.manual_seed(0)
    logits = torch.randn(64, 300) * 2
    noise = Noise(torch.randint(0, 2**62, (64,)), torch.randint(0, 500, (64,)), torch.randint(0, 50, (64,)))
    batch = sample_tokens(logits, 0.8, noise)
    alone = torch.cat([sample_tokens(logits[i:i + 1], 0.8, noise.rows(slice(i, i + 1))) for i in range(64)])
    order = torch.arange(63, -1, -1)
    reversed_ = sample_tokens(logits[order], 0.8, noise.rows(order))
    assert torch.equal(batch, alone) and torch.equal(reversed_, batch[order])
    for top_k, top_p in ((0, 1.0), (20, 1.0), (0, 0.7), (20, 0.7)):
        whole = sample_tokens(logits, 1.3, noise, top_k=top_k, top_p=top_p)
        outside = ~torch.isfinite(rules.keep_top(logits, 1.3, top_k, top_p))
        assert not bool(outside.gather(1, whole[:, None]).any())
        # top-k draws only k columns, keyed by token id: the whole-vocabulary draw over the same
        # allowed set gives the same tokens
        allowed = rules.keep_top(logits, 1.3, top_k, top_p)
        assert torch.equal(sample_tokens(allowed, 1.3, noise), whole)


def test_chunked_draws_equal_one_draw(monkeypatch):
    torch.manual_seed(1)
    logits = torch.randn(37, 50)
    noise = keys(37, seed=9)
    whole = sample_tokens(logits, 1.0, noise)
    monkeypatch.setattr(rules, "CHUNK_ELEMENTS", 120)  # two rows a chunk
    assert torch.equal(sample_tokens(logits, 1.0, noise), whole)


def test_gumbel_max_samples_softmax_of_logits_over_temperature():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]]).repeat(40000, 1)
    for temperature in (0.5, 1.0, 2.0):
        drawn = sample_tokens(logits, temperature, keys(40000, seed=int(temperature * 10)))
        freq = torch.bincount(drawn, minlength=5).float() / drawn.numel()
        want = torch.softmax(logits[0] / temperature, -1)
        assert bool(((freq - want).abs() < 0.01).all()), (temperature, freq, want)


def test_random_remasking_draws_one_keyed_uniform_per_candidate():
    logits = torch.randn(30, 10)
    x0 = logits.argmax(-1)
    a = confidence(logits, x0, "random", keys(30))
    assert a.shape == (30,) and torch.equal(a, confidence(logits, x0, "random", keys(30)))
    assert not torch.equal(a, confidence(logits, x0, "random", keys(30, step=2)))
    with pytest.raises(ValueError, match="one noise key per candidate"):
        confidence(logits, x0, "random", None)


def test_sampled_decoding_uses_no_torch_random_generator(tmp_path, monkeypatch):
    """Every draw is a hash of the request's keys: no ``torch.rand`` (on a CUDA tensor with a CPU
    generator it raises), no generator state."""
    llm = LLM(write_checkpoint(tmp_path / "llada", "llada"))
    params = SamplingParams(method="dual-cache", max_new_tokens=16, block_length=8, temperature=1.0,
                            top_k=20, remasking="random", seed=3)
    want = llm.generate([[42, 13, 14]], params)[0].token_ids

    def refuse(*args, **kwargs):
        raise AssertionError("sampling called torch's generator")

    monkeypatch.setattr(torch, "rand", refuse)
    monkeypatch.setattr(torch, "Generator", refuse)
    assert llm.generate([[42, 13, 14]], params)[0].token_ids == want
    assert llm.generate([[42, 13, 14]], params.replace(seed=4))[0].token_ids != want
