"""SDAR-4B-Chat's released small files (tests/data/sdar-4b-chat: config, generation config,
tokenizer, chat template; Apache-2.0, see its SOURCE.md) load with the engine's defaults right:
the trained block size (config.json's ``block_size`` 4) is the default ``block_length``, the
chat template is the release's, and a chat answer stops at ``<|im_end|>`` or ``<|endoftext|>``.

The defaults, template and stop ids are read on the meta device (no weights); a generation runs
on random weights of one layer and reduced width, written in the release's two-shard layout."""
import json
import shutil
import warnings
from pathlib import Path

import pytest
import torch

from dllm_engine import LLM, SamplingParams
from dllm_engine.models import DiffusionLM, get_family, save_model
from dllm_engine.resolve import BlockLengthWarning

RELEASE = Path(__file__).resolve().parent / "data" / "sdar-4b-chat"
END_OF_TEXT, IM_END, MASK = 151643, 151645, 151669
SMALL = dict(num_hidden_layers=1, hidden_size=64, intermediate_size=128, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def meta_llm() -> LLM:
    return LLM(RELEASE, device="meta")


@pytest.fixture(scope="module")
def random_release(tmp_path_factory) -> Path:
    """The release's files with random bf16 weights of one layer (config.json's other keys kept)."""
    folder = tmp_path_factory.mktemp("sdar-4b-chat")
    for f in RELEASE.iterdir():
        shutil.copy(f, folder / f.name)
    hf = {**json.loads((RELEASE / "config.json").read_text()), **SMALL}
    family = get_family("sdar")
    torch.manual_seed(0)
    model = DiffusionLM(family.config_from_hf(hf)).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    save_model(model, folder, family, max_shard_bytes=25 * 2**20)
    (folder / "config.json").write_text(json.dumps(hf, indent=2))  # the release's keys, smaller
    return folder


def test_the_trained_block_size_is_the_default_block_length(meta_llm):
    with warnings.catch_warnings():
        warnings.simplefilter("error", BlockLengthWarning)
        p = meta_llm.resolve()
    assert (p.method, p.block_length, p.steps) == ("block", 4, 4)
    # generation_config.json samples (do_sample true): Qwen3's temperature / top_p / top_k
    assert (p.temperature, p.top_p, p.top_k) == (0.6, 0.95, 20)
    assert p.unmasking == "low_confidence_dynamic" and p.threshold == 0.9 and p.stop_at_eos


def test_another_block_length_runs_with_one_warning_naming_the_trained_size(meta_llm):
    with pytest.warns(BlockLengthWarning, match=r"block_length 32 differs .* trained with \(4,"):
        p = meta_llm.resolve(SamplingParams(block_length=32))
    assert p.block_length == 32


def test_the_release_chat_template_and_stop_ids(meta_llm):
    ids = meta_llm.apply_chat_template([{"role": "user", "content": "What is 7 * 8?"}])
    text = meta_llm.tokenizer.decode(ids)
    assert text == "<|im_start|>user\nWhat is 7 * 8?<|im_end|>\n<|im_start|>assistant\n", text
    assert meta_llm.token_ids.mask_id == MASK
    assert meta_llm.token_ids.stop_ids == {END_OF_TEXT, IM_END}


def test_random_weights_in_the_release_layout_generate_in_blocks_of_four(random_release):
    assert len(list(random_release.glob("model-*.safetensors"))) == 2
    llm = LLM(random_release)
    assert llm.model.config.num_layers == 1 and llm.model.config.block_size == 4
    params = SamplingParams(max_new_tokens=12, temperature=0.0, stop_at_eos=False)
    out = llm.chat([[{"role": "user", "content": "What is 7 * 8?"}]], params)[0]
    assert out.stats.decoded_tokens == 12 and out.stats.nfe >= 3  # three blocks of four
    assert out.stats.nfe <= 12
