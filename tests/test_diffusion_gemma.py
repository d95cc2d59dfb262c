"""DiffusionGemma (diffusion_gemma): parity of both passes with transformers' own implementation
(``DiffusionGemmaForBlockDiffusion``, transformers >= 5.23) on a tiny random checkpoint saved
in the released layout, and the released config on the meta device.

The reference runs as transformers' ``generate`` runs it: the encoder writes a ``DynamicCache``
(prompt, then an extension, as a finished canvas would be), then the decoder reads it with and
without self-conditioning. The tiny config has sliding and full layers (window 4 < the 12
tokens encoded, so sliding layers keep 3 keys), different head dims and KV heads per layer
type, proportional partial RoPE on full layers, and 4 experts top-2; every weight, norm, scale
and both passes' layer scalars are random, so each term of the math is exercised.
"""
import json
import logging

import pytest
import torch

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "DiffusionGemmaForBlockDiffusion"):
    pytest.skip("transformers >= 5.23 defines DiffusionGemma", allow_module_level=True)
from transformers import (DiffusionGemmaConfig as HFConfig, DiffusionGemmaForBlockDiffusion,  # noqa: E402
                          DynamicCache, Gemma4VisionConfig)

from dllm_engine.errors import UserError  # noqa: E402
from dllm_engine.models.diffusion_gemma import (FULL, SLIDING, DiffusionGemma, config_from_hf,  # noqa: E402
                                                load_diffusion_gemma, num_parameters)

TOL = 1e-4
WINDOW = 4
LAYER_TYPES = [SLIDING, SLIDING, FULL, SLIDING, FULL]
TINY_TEXT = dict(
    vocab_size=96, hidden_size=32, intermediate_size=40, num_hidden_layers=len(LAYER_TYPES),
    num_attention_heads=4, num_key_value_heads=2, head_dim=8, global_head_dim=16,
    num_global_key_value_heads=1, sliding_window=WINDOW, layer_types=LAYER_TYPES, num_experts=4,
    top_k_experts=2, moe_intermediate_size=12, max_position_embeddings=128,
    rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                     FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})
TINY_VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                   num_key_value_heads=2, head_dim=8, patch_size=8, pooling_kernel_size=2,
                   position_embedding_size=32)
CANVAS = 6


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter and layer scalar random: matrices N(0, 0.2), vectors (norm weights, router
    scales) and scalars around 1. Tied parameters are one object, so they stay tied."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() == 1:
                p.copy_(0.5 + torch.rand(p.shape, generator=g))
            else:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # the encoder's and the decoder's differ
                b.copy_(0.5 + torch.rand(b.shape, generator=g))


def reference_pair(folder):
    """(transformers' tiny random model, ours loaded from its save_pretrained ``folder``, the folder)."""
    torch.manual_seed(0)
    cfg = HFConfig(text_config=TINY_TEXT, vision_config=Gemma4VisionConfig(**TINY_VISION), canvas_length=CANVAS)
    ref = DiffusionGemmaForBlockDiffusion(cfg).eval()
    randomize(ref)
    ref.save_pretrained(folder)
    return ref, load_diffusion_gemma(folder), folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return reference_pair(tmp_path_factory.mktemp("diffusion_gemma"))


def ids(shape, seed):
    return torch.randint(0, TINY_TEXT["vocab_size"], shape, generator=torch.Generator().manual_seed(seed))


def capped(ref, hidden):
    """transformers' head on encoder hidden states (its encoder returns no logits)."""
    logits = ref.lm_head(hidden).float()
    return torch.tanh(logits / 30.0) * 30.0


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


@torch.no_grad()
def run_reference(ref, chunks, canvas, sc_logits=None, sc_mask=None):
    cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
    hidden = [ref.model.encoder(input_ids=c, cache=cache).last_hidden_state for c in chunks]
    logits = ref(decoder_input_ids=canvas, cache=cache, self_conditioning_logits=sc_logits,
                 self_conditioning_mask=sc_mask).logits
    return hidden, cache, logits


def run_ours(model, chunks, canvas, sc_logits=None, sc_mask=None):
    cache = model.new_cache()
    hidden = [model.encode(c, cache) for c in chunks]
    return hidden, cache, model.decode(canvas, cache, sc_logits, sc_mask)


# -- parity ---------------------------------------------------------------------------------------
def test_encoder_hidden_logits_and_kv_match_transformers(pair):
    ref, model, _ = pair
    chunks = [ids((2, 7), 1), ids((2, 5), 2)]  # prompt, then an extension (a finished canvas)
    ref_hidden, ref_cache, _ = run_reference(ref, chunks, ids((2, CANVAS), 3))
    hidden, cache, _ = run_ours(model, chunks, ids((2, CANVAS), 3))
    for ours, theirs in zip(hidden, ref_hidden):
        assert max_diff(ours, theirs) < TOL
        logits = model.logits(ours)
        assert logits.std() > 1.0  # not a degenerate model: the comparison means something
        assert max_diff(logits, capped(ref, theirs)) < TOL
    assert cache.length == 12
    for i, layer in enumerate(ref_cache.layers):
        kept = WINDOW - 1 if LAYER_TYPES[i] == SLIDING else 12
        assert cache.keys[i].shape[2] == kept == layer.keys.shape[2]
        assert max_diff(cache.keys[i], layer.keys) < TOL
        assert max_diff(cache.values[i], layer.values) < TOL


def test_decoder_logits_match_transformers_with_and_without_self_conditioning(pair):
    ref, model, _ = pair
    chunks, canvas = [ids((2, 7), 4), ids((2, 5), 5)], ids((2, CANVAS), 6)
    _, _, ref_plain = run_reference(ref, chunks, canvas)
    _, _, plain = run_ours(model, chunks, canvas)
    assert plain.shape == (2, CANVAS, TINY_TEXT["vocab_size"]) and plain.dtype == torch.float32
    assert max_diff(plain, ref_plain) < TOL
    previous = 3.0 * torch.randn(2, CANVAS, TINY_TEXT["vocab_size"], generator=torch.Generator().manual_seed(7))
    _, _, ref_sc = run_reference(ref, chunks, canvas, previous)
    _, _, sc = run_ours(model, chunks, canvas, previous)
    assert max_diff(sc, ref_sc) < TOL
    assert max_diff(sc, plain) > 0.1  # the signal changes the logits
    mask = torch.tensor([True, False])  # row 1: as if no logits were passed
    _, _, ref_masked = run_reference(ref, chunks, canvas, previous, mask)
    _, _, masked = run_ours(model, chunks, canvas, previous, mask)
    assert max_diff(masked, ref_masked) < TOL
    assert max_diff(masked[1], plain[1]) < TOL and max_diff(masked[0], sc[0]) < TOL


def test_decoder_after_a_prompt_shorter_than_the_window(pair):
    """The sliding layers' cache not yet full (2 tokens < window - 1)."""
    ref, model, _ = pair
    chunks, canvas = [ids((1, 2), 8)], ids((1, CANVAS), 9)
    _, _, ref_logits = run_reference(ref, chunks, canvas)
    _, _, logits = run_ours(model, chunks, canvas)
    assert max_diff(logits, ref_logits) < TOL


def test_left_padded_batch_matches_transformers_on_real_tokens(pair):
    """Padding keys are never attended to, in either pass (transformers' 2-D masks)."""
    ref, model, _ = pair
    prompt, extension, canvas = ids((2, 7), 10), ids((2, 5), 11), ids((2, CANVAS), 12)
    valid = torch.ones(2, 7, dtype=torch.bool)
    valid[1, :3] = False  # row 1 left-padded by 3
    full = torch.cat([valid, torch.ones(2, 5, dtype=torch.bool)], dim=1)
    with torch.no_grad():
        cache = DynamicCache(config=ref.config.get_text_config(decoder=True))
        ref_h = ref.model.encoder(input_ids=prompt, attention_mask=valid, cache=cache).last_hidden_state
        ref.model.encoder(input_ids=extension, attention_mask=full, cache=cache)
        decoder_mask = torch.nn.functional.pad(full, (0, CANVAS), value=True)
        ref_logits = ref(decoder_input_ids=canvas, cache=cache, decoder_attention_mask=decoder_mask).logits
    ours = model.new_cache()
    h = model.encode(prompt, ours, attention_mask=valid)
    model.encode(extension, ours)
    logits = model.decode(canvas, ours)
    assert max_diff(h[valid], ref_h[valid]) < TOL
    assert max_diff(logits, ref_logits) < TOL


# -- self-conditioning memory -----------------------------------------------------------------------
def test_self_conditioning_probabilities_are_made_one_chunk_at_a_time(pair, monkeypatch):
    _, model, _ = pair
    logits = torch.randn(2, CANVAS, TINY_TEXT["vocab_size"], generator=torch.Generator().manual_seed(13))
    weight = model.embed_tokens.weight
    expected = (logits.softmax(-1) @ weight) * TINY_TEXT["hidden_size"] ** 0.5  # plain PyTorch
    rows = []
    softmax = torch.Tensor.softmax

    def spy(self, *args, **kwargs):
        rows.append(self.shape[0] if self.dim() == 2 else self.shape[:-1].numel())
        return softmax(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "softmax", spy)
    monkeypatch.setattr(model, "self_conditioning_chunk", 5)
    soft = model.soft_embeddings(logits)
    monkeypatch.undo()
    assert rows == [5, 5, 2]  # 12 positions (2 rows x 6) in chunks of at most 5
    assert max_diff(soft, expected) < 1e-5


# -- the released layout and config -------------------------------------------------------------------
def test_saved_layout_names_and_vision_notice(pair, caplog):
    ref, _, folder = pair
    from safetensors import safe_open
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.decoder.layers.2.self_attn.v_proj.weight" not in names  # full layers: V = K
    assert "model.decoder.layers.1.self_attn.v_proj.weight" in names
    assert "model.encoder.language_model.layers.0.layer_scalar" in names
    assert any(n.startswith("model.encoder.vision_tower.") for n in names)
    with caplog.at_level(logging.WARNING, logger="dllm_engine.models.diffusion_gemma"):
        load_diffusion_gemma(folder)
    notices = [r.getMessage() for r in caplog.records if "vision-tower" in r.getMessage()]
    assert len(notices) == 1 and "skipping" in notices[0]


def test_a_hub_id_loads_from_the_cache_as_the_folder(pair, tmp_path, monkeypatch):
    """``org/name`` at a revision, from a cache in the Hub's layout (offline): the same weights
    as the folder it was made from."""
    from huggingface_hub import constants
    from test_hub import add_snapshot, folder_files
    _, ours, folder = pair
    commit = "0123456789abcdef0123456789abcdef01234567"
    add_snapshot(tmp_path, "google/tiny-diffusiongemma", commit, folder_files(folder), refs=("main",))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    by_id = load_diffusion_gemma("google/tiny-diffusiongemma", revision="main")
    assert all(torch.equal(a, b) for a, b in zip(by_id.state_dict().values(), ours.state_dict().values()))
    with pytest.raises(UserError, match="does not exist"):
        load_diffusion_gemma(tmp_path / "nope")


def test_loader_refuses_a_checkpoint_missing_a_tensor(pair, tmp_path):
    ref, _, folder = pair
    from safetensors.torch import load_file, save_file
    state = load_file(str(folder / "model.safetensors"))
    del state["model.decoder.layers.3.router.per_expert_scale"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    with pytest.raises(UserError, match="missing tensors.*layers.3.router.per_expert_scale"):
        load_diffusion_gemma(tmp_path)


def released_config() -> dict:
    """config.json as google/diffusiongemma-26B-A4B-it publishes it (notes/diffusion_gemma.md;
    key names of transformers' DiffusionGemmaTextConfig, the released global_* keys)."""
    pattern = [SLIDING] * 5 + [FULL]
    text = dict(
        model_type="diffusion_gemma_text", vocab_size=262_144, hidden_size=2816, intermediate_size=2112,
        moe_intermediate_size=704, num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8,
        num_global_key_value_heads=2, head_dim=256, global_head_dim=512, hidden_activation="gelu_pytorch_tanh",
        rms_norm_eps=1e-6, max_position_embeddings=262_144, sliding_window=1024, layer_types=pattern * 5,
        num_experts=128, top_k_experts=8, final_logit_softcapping=30.0, use_bidirectional_attention="vision",
        attention_bias=False, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2,
        rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                         FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                "rope_theta": 1_000_000.0}})
    return dict(model_type="diffusion_gemma", architectures=["DiffusionGemmaForBlockDiffusion"],
                text_config=text, vision_config={"model_type": "gemma4_vision"}, canvas_length=256,
                eos_token_id=[1, 106, 50], tie_word_embeddings=True, dtype="bfloat16")


def test_released_config_builds_on_meta_with_the_model_cards_shape(tmp_path):
    hf = released_config()
    (tmp_path / "config.json").write_text(json.dumps(hf))
    model = load_diffusion_gemma(tmp_path, dtype="auto", device="meta")
    cfg = model.config
    assert isinstance(model, DiffusionGemma) and model.embed_tokens.weight.dtype == torch.bfloat16
    assert [i for i, s in enumerate(cfg.layers) if s.window is None] == [5, 11, 17, 23, 29]
    assert {(s.head_dim, s.num_kv_heads, s.window) for s in cfg.layers} == {(256, 8, 1024), (512, 2, None)}
    assert cfg.layers[5].rope.rotated_fraction == 0.25 and cfg.layers[5].rope.theta == 1e6
    assert cfg.layers[0].rope.theta == 1e4 and cfg.eos_token_ids == (1, 106, 50) and cfg.canvas_length == 256
    # transformers' own reading of the same dict: the same per-layer shapes and parameter count
    ref_cfg = HFConfig(**{k: v for k, v in hf.items() if k not in ("model_type", "vision_config")})
    plc = ref_cfg.text_config.per_layer_config
    assert all(plc[i].head_dim == s.head_dim and plc[i].num_key_value_heads == s.num_kv_heads
               for i, s in enumerate(cfg.layers))
    with torch.device("meta"):
        ref = DiffusionGemmaForBlockDiffusion(ref_cfg)
    text_params = sum(p.numel() for n, p in ref.named_parameters() if "vision" not in n)
    assert num_parameters(model) == text_params == 25_250_986_752  # + the vision tower: "26B"


def test_text_only_config_and_refused_settings():
    text = released_config()["text_config"]
    assert config_from_hf(text).num_layers == 30  # a diffusion_gemma_text config.json alone
    for change, match in [({"use_bidirectional_attention": "all"}, "bidirectional encoder"),
                          ({"hidden_activation": "silu"}, "hidden_activation"),
                          ({"rope_parameters": {SLIDING: {"rope_type": "yarn", "rope_theta": 1.0},
                                                FULL: {"rope_type": "default", "rope_theta": 1.0}}}, "yarn"),
                          ({"layer_types": [SLIDING] * 3}, "each of the 30 layers")]:
        with pytest.raises(UserError, match=match):
            config_from_hf({**text, **change})
    with pytest.raises(UserError, match="untie"):
        config_from_hf({**released_config(), "tie_word_embeddings": False})
    with pytest.raises(UserError, match="text_config"):
        config_from_hf({"model_type": "diffusion_gemma"})
