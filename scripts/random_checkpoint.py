"""Random-weight checkpoints shaped like released models, for measuring speed and memory where
the embedded tiny checkpoints are too small to show them (docs/quantization.md).

    python scripts/random_checkpoint.py llada-1b OUT_DIR [--dtype float32]
    python scripts/random_checkpoint.py diffusion-gemma-small OUT_DIR --dtype float32

Writes the family's real layout (config.json, safetensors, the project's tokenizer, so the
embedded tasks' prompts work); the answers are noise, the shapes and the work are real's.
Nothing is downloaded.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "lab")]  # the engine and the lab of this checkout

from dllm_engine.config import ModelConfig, MoEConfig  # noqa: E402
from dllm_engine.models import DiffusionLM, get_family, save_model  # noqa: E402
from dllm_engine.models.diffusion_gemma import FULL, SLIDING, DiffusionGemma, checkpoint_name, config_from_hf  # noqa: E402
from dllm_engine.models.loader import named_tensors, parse_dtype  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from dllm_lab.tokenizer import save_tokenizer  # noqa: E402

IDS = dict(mask_token_id=4, eos_token_id=3, pad_token_id=3, bos_token_id=2)  # the project's llada tokenizer

# name -> config: widths and vocabularies of released models, depth where named
SHAPES = {
    # LLaDA's 8B width halved (LLaDA-8B's vocabulary): about 1.3B parameters
    "llada-1b": ModelConfig(model_type="llada", hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=16,
                            intermediate_size=5632, vocab_size=126464, rope_theta=500000.0, rms_norm_eps=1e-5,
                            **IDS),
    # SDAR-1.7B-Chat (Qwen3-1.7B's stack, tied embeddings, q/k norms), block 4: about 1.7B
    "sdar-1.7b": ModelConfig(model_type="sdar", hidden_size=2048, num_layers=28, num_heads=16, num_kv_heads=8,
                             head_dim=128, intermediate_size=6144, vocab_size=151936, rope_theta=1000000.0,
                             rms_norm_eps=1e-6, qk_norm=True, tie_word_embeddings=True, block_size=4, **IDS),
    # LLaDA2.0-mini's layers (256 experts, top 8, one shared), two of them (one dense, one MoE): about 1.5B
    "llada2-mini-2l": ModelConfig(
        model_type="llada2_moe", hidden_size=2048, num_layers=2, num_heads=16, num_kv_heads=4,
        intermediate_size=5120, vocab_size=157184, rotary_dim=64, rope_theta=600000.0, rms_norm_eps=1e-6,
        qk_norm=True, block_size=32,
        moe=MoEConfig(num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, num_shared_experts=1,
                      n_group=8, topk_group=4, routed_scaling_factor=2.5, first_k_dense_replace=1), **IDS),
}

# DiffusionGemma's layout (config.json with text_config, generation_config.json): the release's
# layer pattern (five sliding layers, then a global one), rope, softcap, q/k norms and dense MLP
# beside routed experts, at a width a CPU runs: 49M parameters (38M of them in 32 experts a layer)
# on the project's 202 words; canvases of 32 (the release: 256), 16 denoising steps (the release: 48)
DIFFUSION_GEMMA_SHAPES = {
    "diffusion-gemma-small": dict(
        model_type="diffusion_gemma", canvas_length=32, eos_token_id=IDS["eos_token_id"], text_config=dict(
            model_type="diffusion_gemma_text", vocab_size=202, hidden_size=512, intermediate_size=512,
            moe_intermediate_size=128, num_hidden_layers=6, num_attention_heads=8, num_key_value_heads=4,
            num_global_key_value_heads=2, head_dim=64, global_head_dim=128, sliding_window=1024,
            layer_types=[SLIDING] * 5 + [FULL], num_experts=32, top_k_experts=4, final_logit_softcapping=30.0,
            max_position_embeddings=8192, pad_token_id=IDS["pad_token_id"], eos_token_id=IDS["eos_token_id"],
            bos_token_id=IDS["bos_token_id"],
            rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                             FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                    "rope_theta": 1_000_000.0}})),
}
DIFFUSION_GEMMA_GENERATION = {"max_new_tokens": 64, "max_denoising_steps": 16}  # the rest: the release's


def random_diffusion_gemma(hf: dict, folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random-weight DiffusionGemma checkpoint of config.json ``hf`` in the released layout:
    matrices N(0, 0.02), norm weights and scales 1."""
    torch.manual_seed(0)
    model = DiffusionGemma(config_from_hf(hf))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.ones_like(p) if p.dim() == 1 else 0.02 * torch.randn_like(p))
    folder.mkdir(parents=True, exist_ok=True)
    save_file({checkpoint_name(n): t.to(dtype).contiguous() for n, t in named_tensors(model).items()},
              folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps({**hf, "torch_dtype": str(dtype).removeprefix("torch.")},
                                                   indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(DIFFUSION_GEMMA_GENERATION, indent=2) + "\n")
    save_tokenizer(folder, "llada")  # the embedded checkpoints' words and chat template
    return folder


def random_checkpoint(config: ModelConfig, folder: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random-weight checkpoint of ``config`` in its family's released layout, in ``dtype``."""
    family = get_family(config.model_type)
    config = family.config_from_hf(family.config_to_hf(config))  # as a loaded checkpoint has it
    torch.manual_seed(0)
    model = DiffusionLM(config).to(dtype)
    model.family = family
    save_model(model, folder, family)
    save_tokenizer(folder, "llada")  # the embedded checkpoints' words (202 ids); special ids as ``IDS``
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("shape", choices=[*SHAPES, *DIFFUSION_GEMMA_SHAPES])
    p.add_argument("out", help="the checkpoint folder to write")
    p.add_argument("--dtype", default="bfloat16", help="float32, bfloat16 (default) or float16")
    args = p.parse_args(argv)
    if args.shape in DIFFUSION_GEMMA_SHAPES:
        folder = random_diffusion_gemma(DIFFUSION_GEMMA_SHAPES[args.shape], Path(args.out), parse_dtype(args.dtype))
    else:
        folder = random_checkpoint(SHAPES[args.shape], Path(args.out), parse_dtype(args.dtype))
    print(f"wrote {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
