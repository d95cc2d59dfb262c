"""Logits parity of each family with the matching `transformers` class."""
import collections

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

from dllm_engine.models import load_model
from fixtures import left_padded_batch, random_model, write_checkpoint

LLADA_TO_LLAMA = {
    "model.transformer.wte": "model.embed_tokens", "attn_norm": "input_layernorm",
    "attn_out": "self_attn.o_proj", "ff_norm": "post_attention_layernorm",
    "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "model.transformer.ln_f": "model.norm",
}


def hf_state(model):
    """Our model's weights under the HF reference class's names."""
    state = {}
    for name, p in model.named_parameters():
        state[name if name.startswith("lm_head") else f"model.{name}"] = p.detach().clone()
    return state


def hf_reference(model):
    cfg = model.config
    common = dict(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size,
                  num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                  num_key_value_heads=cfg.num_kv_heads, intermediate_size=cfg.intermediate_size,
                  rope_theta=cfg.rope_theta, rms_norm_eps=cfg.rms_norm_eps,
                  tie_word_embeddings=False, max_position_embeddings=256,
                  attn_implementation="sdpa")
    if cfg.model_type == "llada":
        ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common, head_dim=cfg.head_dim))
    elif cfg.model_type == "Dream":
        ref = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common))
    else:
        ref = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=cfg.head_dim))
    missing, unexpected = ref.load_state_dict(hf_state(model), strict=False)
    assert not unexpected and all("rotary" in m for m in missing), (missing, unexpected)
    return ref.eval()


def reference_mask(model, valid):
    """4-D bool mask (True = attend) equivalent to the family's pattern, for the HF reference."""
    b, t = valid.shape
    mask = valid[:, None, None, :].expand(b, 1, t, t).clone()
    if model.config.is_block_causal:
        pos = (valid.long().cumsum(1) - 1).clamp(min=0)
        blk = pos // model.config.block_size
        mask &= blk[:, None, None, :] <= blk[:, None, :, None]
    return mask | torch.eye(t, dtype=torch.bool)[None, None]  # pad rows attend to themselves


@pytest.mark.parametrize("model_type", ["llada", "Dream", "sdar"])
def test_logits_match_transformers_with_left_padding(model_type):
    model = random_model(model_type)
    ref = hf_reference(model)
    ids, valid, pos = left_padded_batch()
    with torch.no_grad():
        ours = model(ids, attention_mask=valid.long())
        theirs = ref(input_ids=ids, attention_mask=reference_mask(model, valid), position_ids=pos).logits
    if model.config.logit_shift:
        theirs = torch.cat([theirs[:, :1], theirs[:, :-1]], dim=1)
    compared = valid.clone()
    if model.config.logit_shift:  # the first real token reads a padding output: not a prediction
        compared[:, 1:] &= valid[:, :-1]
    diff = (ours - theirs)[compared].abs().max().item()
    assert diff < 1e-4, diff


def test_llada_tensor_names_are_the_real_ones(tmp_path):
    from safetensors import safe_open
    write_checkpoint(tmp_path, "llada", tokenizer=False)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.metadata() == {"format": "pt"}
    assert "model.transformer.wte.weight" in names
    assert "model.transformer.blocks.0.ff_proj.weight" in names
    assert "model.transformer.ff_out.weight" in names
    assert "model.transformer.ln_f.weight" in names


@pytest.mark.parametrize("model_type", ["llada", "Dream", "sdar"])
def test_sharded_checkpoint_loads_the_same(tmp_path, model_type):
    single = write_checkpoint(tmp_path / "single", model_type, tokenizer=False)
    sharded = write_checkpoint(tmp_path / "sharded", model_type, shard_bytes=20_000, tokenizer=False)
    assert (sharded / "model.safetensors.index.json").is_file()
    assert len(list(sharded.glob("model-*.safetensors"))) > 1
    ids = torch.randint(11, 95, (2, 9))
    with torch.no_grad():
        a = load_model(single)(ids)
        b = load_model(sharded)(ids)
    assert torch.equal(a, b)


class CountOps(TorchDispatchMode):
    """The aten ops run inside it, by name."""

    def __enter__(self):
        self.names = collections.Counter()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_packing_live_tokens_changes_no_logit(monkeypatch):
    """Per-token layers run on the packed live tokens of a padded batch, the residual stream
    packed from the embedding to the final norm: same logits as dense."""
    from dllm_engine.models import context
    model = random_model("sdar")
    ids = torch.randint(11, 95, (3, 12))
    valid = torch.ones(3, 12, dtype=torch.bool)
    valid[1, :6] = False
    valid[2, :10] = False  # 16 of 36 tokens are padding: packed
    with torch.no_grad():
        packed = model(ids, attention_mask=valid.long())
        monkeypatch.setattr(context, "PACK_BELOW", 0.0)  # never pack
        dense = model(ids, attention_mask=valid.long())
    assert torch.allclose(packed[valid], dense[valid], atol=1e-5)
    ctx = model.plain_context(ids, valid.long())
    monkeypatch.setattr(context, "PACK_BELOW", 0.75)
    with torch.no_grad(), CountOps() as ops:
        model(ids, attention_mask=valid.long())
    # the residual stays packed: Q/K/V unpacked once a layer, the stream once at the end
    assert ops.names["index_copy"] == model.config.num_layers + 1
    x = torch.randn(3, 12, 5)
    assert ctx.pack(x).shape == (20, 5) and torch.equal(ctx.pack(x), x[valid])
    assert torch.equal(ctx.unpack(ctx.pack(x)), x * valid[..., None])


@pytest.mark.parametrize("model_type", ["llada", "sdar"])
def test_left_padded_short_row_of_a_plain_forward_matches_it_alone(model_type):
    """A plain forward's padding is on the left, so a short row is not a narrow left-packed
    row: its logits must be those of the row alone (it once ran attention on its padding)."""
    model = random_model(model_type)
    ids = torch.randint(11, 95, (2, 12))
    valid = torch.ones(2, 12, dtype=torch.bool)
    valid[1, :10] = False  # 2 live tokens of 12: at most a quarter
    with torch.no_grad():
        batch = model(ids, attention_mask=valid.long())
        alone = model(ids[1:, 10:])
    torch.testing.assert_close(batch[1, 10:], alone[0], rtol=1e-4, atol=1e-4)


def test_ragged_attention_runs_narrow_rows_apart_with_the_same_result():
    from dllm_engine.models.context import row_groups
    from dllm_engine.models.layers import ragged_attention
    torch.manual_seed(0)
    b, h, t, s, d = 4, 2, 96, 20, 8
    q, k, v = torch.randn(b, h, t, d), torch.randn(b, h, s, d), torch.randn(b, h, s, d)
    live = torch.tensor([96, 3, 20, 50])  # rows 1 and 2 are narrow (<= 96 // 4), 76 tokens narrower
    valid = torch.arange(t)[None] < live[:, None]
    mask = (torch.arange(s)[None, None, None] < torch.tensor([20, 9, 12, 15])[:, None, None, None]
            ).expand(b, 1, t, s)
    split = row_groups(live.tolist(), t)
    assert (split.wide.tolist(), split.narrow, split.width) == ([0, 3], 20, 96)
    for m in (mask, None):  # None: every query sees every key
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m)
        got = ragged_attention(q, k, v, m, split)
        assert torch.allclose(got.transpose(1, 2)[valid], want.transpose(1, 2)[valid], atol=1e-6)


def test_row_groups_split_only_when_the_narrow_rows_shed_enough_width():
    """Narrow rows (at most a quarter of the width) run apart from the wide ones' rest only when it makes them
    at least SPLIT_SAVING query tokens narrower: a 300-token canvas beside 32-token blocks
    splits; rows of a few tokens beside a 32-token block do not (the gather costs more)."""
    from dllm_engine.models.context import SPLIT_SAVING, row_groups
    split = row_groups([300, 32, 290, 20], 300)
    assert (split.wide.tolist(), split.narrow, split.width) == ([0, 2], 32, 300)
    assert row_groups([32, 4, 8, 30], 32) is None
    assert row_groups([32, 32], 32) is None and row_groups([4, 8], 32) is None  # no mix
    n = SPLIT_SAVING
    split = row_groups([n + 1, 1], n + 1)
    assert (split.wide.tolist(), split.narrow, split.width) == ([0], 1, n + 1)
    assert row_groups([n, 1], n) is None  # sheds n - 1 tokens


@pytest.mark.parametrize("expand", [False, True], ids=["in place", "expanded as on CUDA"])
def test_grouped_kv_heads_attend_as_if_repeated(expand, monkeypatch):
    """K/V with fewer heads than Q (GQA 4/2): SDPA reading them in place gives what attention over
    explicitly repeated heads gives, in one call and in row groups; so does the expansion CUDA
    takes with a mask (``grouped_heads``: its fused kernels take no enable_gqa with a mask)."""
    from dllm_engine.models import layers
    from dllm_engine.models.context import row_groups
    if expand:
        monkeypatch.setattr(layers, "EXPAND_GQA_WITH_MASK", frozenset({"cpu"}))
    k_, v_, gqa = layers.grouped_heads(torch.zeros(1, 4, 1, 2), torch.zeros(1, 2, 1, 2), torch.zeros(1, 2, 1, 2),
                                       torch.ones(1, 1, 1, 1, dtype=torch.bool))
    assert (k_.shape[1], gqa) == ((4, {}) if expand else (2, {"enable_gqa": True}))
    torch.manual_seed(1)
    b, t, s, d = 3, 80, 12, 8
    q, k, v = torch.randn(b, 4, t, d), torch.randn(b, 2, s, d), torch.randn(b, 2, s, d)
    mask = (torch.arange(s)[None, None, None] < torch.tensor([12, 5, 9])[:, None, None, None]).expand(b, 1, t, s)
    rk, rv = k[:, [0, 0, 1, 1]], v[:, [0, 0, 1, 1]]  # query heads 0, 1 read K/V head 0; 2, 3 head 1
    want = torch.nn.functional.scaled_dot_product_attention(q, rk, rv, attn_mask=mask)
    assert torch.allclose(layers.ragged_attention(q, k, v, mask, None), want, atol=1e-6)
    live = [80, 2, 70]
    split = row_groups(live, t)
    # every row's first 2 queries (the narrow row's width) in one call; the wide rows' rest
    assert (split.wide.tolist(), split.narrow, split.width) == ([0, 2], 2, 80)
    got = layers.ragged_attention(q, k, v, mask, split)
    valid = torch.arange(t)[None] < torch.tensor(live)[:, None]
    assert torch.allclose(got.transpose(1, 2)[valid], want.transpose(1, 2)[valid], atol=1e-6)


def test_torch_versions_compare_as_numbers_and_an_old_torch_is_refused():
    from dllm_engine.errors import UserError
    from dllm_engine.models.loader import check_torch, torch_at_least
    assert torch_at_least((2, 5), "2.13.0+cpu") and torch_at_least((2, 5), "2.5.0") and torch_at_least((2, 5), "3.0")
    assert not torch_at_least((2, 5), "2.4.1+cu121") and not torch_at_least((2, 5), "1.13.1")
    assert torch_at_least((2, 6), "2.6.0a0+git1234")
    check_torch()  # this one
    with pytest.raises(UserError, match=r"needs torch >= 2\.6 .* this is torch 2\.5\.1"):
        check_torch("2.5.1+cu124")


def test_rotary_table_equals_computing_cos_sin():
    """The cached RoPE table gives each position exactly what ``rope_cos_sin`` computes, grows
    when a step reaches past it, and reads the largest position itself when given no bound."""
    from dllm_engine.models.layers import RotaryTable, rope_cos_sin
    table = RotaryTable(16, 10000.0)
    for shape, bound in (((1, 7), 8), ((3, 33), 100), ((4, 5), None), ((2, 9), 300)):
        positions = torch.randint(0, bound or 50, shape)
        cos, sin = table.lookup(positions, bound)
        want_cos, want_sin = rope_cos_sin(positions, 16, 10000.0)
        assert torch.equal(cos, want_cos) and torch.equal(sin, want_sin)
    assert table.tables[torch.device("cpu")][0].shape == (512, 16)  # 300 -> the next power of two
