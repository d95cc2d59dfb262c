"""Tiny random checkpoints in each family's real layout, written by tests."""
from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import torch

from dllm_engine.config import ModelConfig
from dllm_engine.engine.sequence import TokenIds
from dllm_engine.models import DiffusionLM, get_family, save_model

VOCAB = 96  # the project tokenizer's 95 ids (+1), so text prompts work on the fixtures too
IDS = dict(mask_token_id=4, eos_token_id=3, pad_token_id=3, bos_token_id=2)


def left_padded_batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ids [3, 11], valid [3, 11], positions [3, 11]) of a ragged batch for parity tests: row 0
    full, rows 1 and 2 left-padded by 4 and 7; positions count the valid tokens from 0."""
    ids = torch.randint(11, 95, (3, 11), generator=torch.Generator().manual_seed(seed))
    valid = torch.ones(3, 11, dtype=torch.bool)
    valid[1, :4] = False
    valid[2, :7] = False
    return ids, valid, (valid.long().cumsum(1) - 1).clamp(min=0)


def tiny_config(model_type: str, **overrides) -> ModelConfig:
    family = get_family(model_type)
    base = dict(model_type=model_type, vocab_size=VOCAB, hidden_size=32, num_layers=3, num_heads=4,
                num_kv_heads=4 if model_type == "llada" else 2, intermediate_size=48,
                rope_theta=500000.0 if model_type == "llada" else 10000.0,
                rms_norm_eps=1e-5 if model_type == "llada" else 1e-6, **IDS)
    base.update(overrides)
    # round-trip through the family's real config keys, as a loaded checkpoint would be
    return family.config_from_hf(family.config_to_hf(ModelConfig(**base)))


def random_model(model_type: str, seed: int = 0, scale: float = 0.3, **overrides) -> DiffusionLM:
    """Random weights large enough that logits are peaked (greedy decoding is then stable)."""
    cfg = tiny_config(model_type, **overrides)
    if model_type == "sdar":
        cfg.block_size = overrides.get("block_size", 4)
    torch.manual_seed(seed)
    model = DiffusionLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, scale)
            elif name.endswith("weight"):
                p.uniform_(0.8, 1.2)
    model.family = get_family(model_type)
    return model.eval()


def write_checkpoint(folder: Path, model_type: str, seed: int = 0, shard_bytes: int | None = None,
                     tokenizer: bool = True, **overrides) -> Path:
    model = random_model(model_type, seed, **overrides)
    save_model(model, folder, model.family, max_shard_bytes=shard_bytes)
    if tokenizer:
        from dllm_lab.tokenizer import save_tokenizer
        save_tokenizer(folder, "sdar" if model_type == "sdar" else "llada")
    return folder


# -- LLaDA2.0 (llada2_moe): MoE block diffusion ------------------------------------------------
def tiny_llada2_overrides(**overrides) -> dict:
    """A tiny LLaDA2-shaped config: half-width RoPE, 8 experts in 4 groups (top-2 of the best 2
    groups), one shared expert, layer 0 dense."""
    from dllm_engine.config import MoEConfig
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                    num_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    first_k_dense_replace=1)
    return {"rotary_dim": 4, "block_size": 4, "qk_norm": True, "moe": moe, **overrides}


def tiny_llada2_config(**overrides) -> ModelConfig:
    return tiny_config("llada2_moe", **tiny_llada2_overrides(**overrides))


def random_llada2_model(seed: int = 0, expert_bias: float = 0.5, **overrides) -> DiffusionLM:
    """Random LLaDA2 weights; router ``expert_bias`` uniform in [0, expert_bias) (non-negative,
    as the transformers Glm4Moe reference needs)."""
    model = random_model("llada2_moe", seed, **tiny_llada2_overrides(**overrides))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.uniform_(0.0, expert_bias)
    return model


def write_llada2_checkpoint(folder: Path, seed: int = 0, shard_bytes: int | None = None,
                            tokenizer: bool = True, **overrides) -> Path:
    model = random_llada2_model(seed, **overrides)
    save_model(model, folder, model.family, max_shard_bytes=shard_bytes)
    if tokenizer:
        from dllm_lab.tokenizer import save_tokenizer
        save_tokenizer(folder, "sdar")
    return folder


def write_llada2_bench_checkpoint(folder: str | Path) -> Path:
    """A random LLaDA2-shaped MoE of the embedded checkpoints' size (12 layers, d 128, 16 experts,
    top-4 of 2 of 4 groups, block 32): what the README's LLaDA2 speed table was measured on."""
    from dllm_engine.config import MoEConfig
    moe = MoEConfig(num_experts=16, num_experts_per_tok=4, moe_intermediate_size=64,
                    num_shared_experts=1, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                    first_k_dense_replace=1)
    return write_llada2_checkpoint(Path(folder), hidden_size=128, num_layers=12, num_heads=4,
                                   num_kv_heads=2, intermediate_size=384, rotary_dim=16,
                                   block_size=32, moe=moe)


def write_dream_bench_checkpoint(folder: str | Path) -> Path:
    """A random Dream-format model of tiny-llada's size (12 layers, d 128, GQA 4/2): what the
    README's Dream early-skip run was measured on."""
    return write_checkpoint(Path(folder), "Dream", hidden_size=128, num_layers=12, num_heads=4,
                            num_kv_heads=2, intermediate_size=384)


def write_tp_bench_checkpoint(folder: str | Path) -> Path:
    """A random LLaDA-format model large enough that a CPU step is compute bound (d_model 1024,
    8 layers, 16 heads, FFN 2816, vocabulary 96: 103M parameters, 412 MB in fp32): what the README's
    tensor-parallel table was measured on."""
    return write_checkpoint(Path(folder), "llada", hidden_size=1024, num_layers=8, num_heads=16,
                            num_kv_heads=16, intermediate_size=2816)


# -- LLaDA-MoE (llada_moe): full attention, OLMoE-style softmax MoE ----------------------------
def tiny_llada_moe_overrides(**overrides) -> dict:
    """A tiny LLaDA-MoE-shaped config: MHA with per-head q/k RMSNorm, 8 experts top-2 by softmax
    without renormalisation, layer 0 dense (``moe_layer_freq`` [0, 1, 1]; the release has no
    dense layer, the config allows it)."""
    from dllm_engine.config import MoEConfig
    moe = MoEConfig(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=False,
                    first_k_dense_replace=1, score_function="softmax", expert_bias=False,
                    bias_weights=True)
    return {"num_kv_heads": 4, "rope_theta": 50000.0, "rms_norm_eps": 1e-5, "qk_norm": True,
            "moe": moe, **overrides}


def tiny_llada_moe_config(**overrides) -> ModelConfig:
    return tiny_config("llada_moe", **tiny_llada_moe_overrides(**overrides))


def random_llada_moe_model(seed: int = 0, expert_bias: float | None = None, **overrides) -> DiffusionLM:
    """Random LLaDA-MoE weights; ``expert_bias``: give the routers an ``expert_bias`` buffer,
    uniform in [0, expert_bias) (the release has none)."""
    if expert_bias is not None:
        from dataclasses import replace
        overrides["moe"] = replace(tiny_llada_moe_overrides()["moe"], expert_bias=True)
    model = random_model("llada_moe", seed, **tiny_llada_moe_overrides(**overrides))
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("expert_bias"):
                buf.uniform_(0.0, expert_bias)
    return model


def write_llada_moe_checkpoint(folder: Path, seed: int = 0, shard_bytes: int | None = None,
                               tokenizer: bool = True, expert_bias: float | None = None,
                               **overrides) -> Path:
    """A random LLaDA-MoE checkpoint in the released layout (config keys and tensor names)."""
    model = random_llada_moe_model(seed, expert_bias, **overrides)
    save_model(model, folder, model.family, max_shard_bytes=shard_bytes)
    if tokenizer:
        from dllm_lab.tokenizer import save_tokenizer
        save_tokenizer(folder, "llada")
    return folder


def commit_script(rng, words: list[str], right: float, wrong: tuple[str, ...]) -> list[list[tuple[int, str]]]:
    """A decoding of ``words`` for ``ScriptedLLM``: slots committed one to three a step in a random
    order, each with its word with probability ``right``, else with one of ``wrong``."""
    order = rng.sample(range(len(words)), len(words))
    steps, k = [], 0
    while k < len(order):
        take = order[k:k + rng.randint(1, 3)]
        k += len(take)
        steps.append([(i, words[i] if rng.random() < right else rng.choice(wrong)) for i in take])
    return steps


class ScriptedLLM:
    """Stands in for an LLM whose decoder commits each answer's words in a given order, some
    replaced by wrong ones: ``chat`` returns outputs with the step records of that order (a step's
    entries are (slot, word) at confidence 1, or (slot, word, confidence)). Its
    vocabulary grows as words are asked for: ``<end>`` (the end of turn), ``<eos>``, ``<mask>``."""
    PROMPT = [7, 7, 7]  # three prompt tokens

    def __init__(self, scripts: list[list[list[tuple[int, str]]]], max_new_tokens: int):
        self.scripts, self.max_new_tokens = scripts, max_new_tokens
        llm = self

        class Vocab(dict):  # every word has an id, given when first asked for
            def __missing__(self, word: str) -> int:
                return llm.id_of(word)

        self.ids = Vocab({"<end>": 0, "<eos>": 1, "<mask>": 2})
        self.token_ids = TokenIds(mask_id=2, eos_id=1, stop_ids=frozenset({0, 1}))
        self.tokenizer = type("Tokenizer", (), {"get_vocab": lambda _: self.ids})()

    def id_of(self, word: str) -> int:
        if word not in self.ids:
            self.ids[word] = len(self.ids) + 10
        return self.ids[word]

    def token_text(self, token_id: int) -> str:
        return next(w for w, i in self.ids.items() if i == token_id)

    def resolve(self, params):
        return params.replace(max_new_tokens=self.max_new_tokens)

    def commit(self, slot: int, word: str, confidence: float = 1.0):
        """A script's (slot, word[, confidence]) as the engine records it."""
        from dllm_engine.engine.trace import Commit
        return Commit(len(self.PROMPT) + slot, self.id_of(word), confidence)

    def chat(self, conversations, params):
        from dllm_engine.engine.trace import StepRecord
        from dllm_engine.engine.llm import RequestOutput
        assert params.record_steps
        outs = []
        for script in self.scripts[:len(conversations)]:
            p = len(self.PROMPT)
            records = [StepRecord(step=k, block=0, block_start=p, block_end=p + self.max_new_tokens,
                                  block_step=k, canvas_len=p + self.max_new_tokens, processed_tokens=0.0,
                                  seconds=0.0, committed=[self.commit(*entry) for entry in step])
                       for k, step in enumerate(script)]
            outs.append(RequestOutput(prompt_token_ids=list(self.PROMPT), token_ids=[], text="", stats=None,
                                      finish_reason="stop", steps=records))
        self.scripts = self.scripts[len(conversations):]
        return outs


def randomize_diffusion_gemma(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight of a ``DiffusionGemma`` random: matrices N(0, 0.2), vectors (norm weights,
    router scales) and the layer scalars around 1, so each term of its math is exercised."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.copy_(0.5 + torch.rand(p.shape, generator=g) if p.dim() == 1 else 0.2 * torch.randn(p.shape, generator=g))
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):  # the encoder's and the decoder's differ
                b.copy_(0.5 + torch.rand(b.shape, generator=g))
    return model.eval()


@contextmanager
def serving(llm, model_name: str = "tiny", **kwargs):
    """``server.create_app(llm)`` under uvicorn in a background thread on a free port; yields the
    base URL and the app, and stops the server after."""
    import socket
    import threading
    import time

    import uvicorn

    from dllm_engine.server import create_app
    app = create_app(llm, model_name=model_name, **kwargs)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", app
    finally:
        server.should_exit = True
        thread.join(30)
