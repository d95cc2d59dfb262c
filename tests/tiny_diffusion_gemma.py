"""A tiny random DiffusionGemma checkpoint in the released layout (config.json with
``text_config``, safetensors under the checkpoint's names, generation_config.json, a word-level
tokenizer with a chat template: ``w0`` ... ``w95``), for the tests of the offline API, the server,
the playground, the bench and the replicas."""
import json
from pathlib import Path

from safetensors.torch import save_file
from tokenizers import AddedToken, Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit

from dllm_engine.models.diffusion_gemma import FULL, SLIDING, DiffusionGemma, checkpoint_name, config_from_hf
from dllm_engine.models.loader import named_tensors
from fixtures import randomize_diffusion_gemma

CANVAS, VOCAB, PAD, BOS = 6, 96, 0, 2
EOS = 39  # a token the tiny random model writes often: some answers stop at it, early or late, others not
LAYER_TYPES = [SLIDING, FULL, SLIDING, FULL]
TEXT = dict(model_type="diffusion_gemma_text", vocab_size=VOCAB, hidden_size=32, intermediate_size=40,
            num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=8,
            global_head_dim=16, num_global_key_value_heads=1, sliding_window=4, layer_types=LAYER_TYPES,
            num_experts=4, top_k_experts=2, moe_intermediate_size=12, max_position_embeddings=64,
            pad_token_id=PAD, eos_token_id=EOS,
            rope_parameters={SLIDING: {"rope_type": "default", "rope_theta": 10_000.0},
                             FULL: {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6}})
# low temperatures and no stability wait: rows stop canvases early, at different steps; three canvases
GENERATION = {"max_new_tokens": 3 * CANVAS, "max_denoising_steps": 6, "t_min": 0.05, "t_max": 0.5,
              "stability_threshold": 0, "confidence_threshold": 0.8, "eos_token_id": EOS, "pad_token_id": PAD,
              "sampler_config": {"_cls_name": "EntropyBoundSamplerConfig", "entropy_bound": 1.0}}
WORDS = [{PAD: "<pad>", BOS: "<bos>", EOS: "<eos>"}.get(i, f"w{i}") for i in range(VOCAB)]
SPECIAL = (PAD, BOS, EOS)




def write_checkpoint(out: Path) -> Path:
    """The checkpoint, written to ``out``."""
    hf = {"model_type": "diffusion_gemma", "text_config": TEXT, "canvas_length": CANVAS, "eos_token_id": EOS,
          "torch_dtype": "float32"}
    net = randomize_diffusion_gemma(DiffusionGemma(config_from_hf(hf)))
    save_file({checkpoint_name(n): t.contiguous() for n, t in named_tensors(net).items()}, out / "model.safetensors")
    (out / "config.json").write_text(json.dumps(hf))
    (out / "generation_config.json").write_text(json.dumps(GENERATION))
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="w3"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.add_special_tokens([AddedToken(WORDS[i], special=True) for i in SPECIAL])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<eos>", "pad_token": "<pad>",
        "bos_token": "<bos>", "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}"}))
    return out
