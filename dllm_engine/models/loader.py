"""Load and save checkpoints in the family's real layout: ``config.json`` with the family's own
keys, ``model.safetensors`` or shards with ``model.safetensors.index.json``, tensors under the
family's own names. The same code loads a real 8B checkpoint and the embedded tiny ones."""
from __future__ import annotations

import json
import math
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from ..errors import UserError
from .family import Family
from .kernels import torch_at_least
from .layers import DiffusionLM, MoE, Router
from .parallel import Shard, check_shardable, read_slices
from .quantize import check_quantization, quantize_model
from .registry import family_of
from ..config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
AUTO = "auto"  # config.json's torch_dtype (see resolve_dtype)
# other spellings configs use for the same dtypes
DTYPE_ALIASES = {"float": "float32", "fp32": "float32", "bf16": "bfloat16", "half": "float16",
                 "fp16": "float16"}
STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}  # safetensors' names
INDEX_FILE = "model.safetensors.index.json"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise UserError(f"dtype {dtype!r} not supported; use one of {AUTO}, {', '.join(DTYPES)}")
    return DTYPES[dtype]


def resolve_dtype(dtype: str | torch.dtype, hf: dict, folder: Path) -> torch.dtype:
    """``dtype``, where ``"auto"`` is the checkpoint's own: config.json's ``torch_dtype``
    (``dtype`` in transformers 5), else the dtype most of the weights are stored in (a config
    without the key, e.g. LLaDA-8B's, as transformers' ``dtype="auto"`` does), else float32."""
    if isinstance(dtype, torch.dtype) or dtype != AUTO:
        return parse_dtype(dtype)
    declared = hf.get("torch_dtype") or hf.get("dtype")
    if declared is None:
        return stored_dtype(folder) or torch.float32
    name = str(declared).removeprefix("torch.")
    name = DTYPE_ALIASES.get(name, name)
    if name not in DTYPES:
        raise UserError(f"{folder / 'config.json'}: torch_dtype {declared!r} is not supported; "
                        f"pass a dtype ({', '.join(DTYPES)})")
    return DTYPES[name]


def stored_dtype(folder: Path) -> torch.dtype | None:
    """The floating dtype holding most elements of the first weight file (headers only); None
    when there is none or the files cannot be read (loading reports that)."""
    try:
        files = weight_files(folder)
        counts: dict[torch.dtype, int] = {}
        with open_weights(files[0]) as f:
            for name in f.keys():
                tensor_slice = f.get_slice(name)
                dtype = STORED_DTYPES.get(tensor_slice.get_dtype())
                if dtype is not None:
                    counts[dtype] = counts.get(dtype, 0) + math.prod(tensor_slice.get_shape())
    except (OSError, ValueError):
        return None
    return max(counts, key=counts.get) if counts else None


# the oldest torch whose CUDA build has every op the engine uses: nonzero_static on CUDA (2.6;
# SDPA's enable_gqa is 2.5, torch.compile's mark_static_address(guard=False) older)
TORCH_FLOOR = (2, 6)


def check_torch(version: str = torch.__version__) -> None:
    """Refuse a torch older than ``TORCH_FLOOR``, naming what it lacks."""
    if not torch_at_least(TORCH_FLOOR, version):
        raise UserError(f"dllm-engine needs torch >= {TORCH_FLOOR[0]}.{TORCH_FLOOR[1]} (nonzero_static on CUDA, "
                        f"SDPA's enable_gqa); this is torch {version}: pip install 'torch>="
                        f"{TORCH_FLOOR[0]}.{TORCH_FLOOR[1]}'")


def parse_device(device: str | torch.device) -> torch.device:
    """A device this torch build can use: cpu, or cuda[:N] / mps where available (and a torch
    at or above the floor, ``check_torch``)."""
    check_torch()
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise UserError(f"device {str(device)!r} is not a device name; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"device {str(device)!r} is not available: this torch {torch.__version__} "
                        f"build has no CUDA or sees no GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise UserError(f"device {str(device)!r}: only {torch.cuda.device_count()} GPU(s) visible")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise UserError(f"device {str(device)!r} is not available on this machine; use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps", "meta"):  # meta: config and shapes, no weights
        raise UserError(f"device {str(device)!r} is not supported; use cpu or cuda")
    return dev


def read_json(file: Path, what: str = "a JSON object") -> dict:
    """A JSON object from ``file``; a ValueError naming the file if it is not one."""
    try:
        value = json.loads(file.read_text())
    except UnicodeDecodeError:
        raise UserError(f"{file}: not a text file; expected {what}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{file}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(value, dict):
        raise UserError(f"{file}: expected {what}, got a JSON {type(value).__name__}")
    return value


def read_config(path: str | Path) -> tuple[dict, Family, ModelConfig]:
    """The raw config.json, its family and the normalised ModelConfig."""
    folder = Path(path)
    if folder.is_file():
        raise UserError(f"{str(folder)!r} is a file; --model / LLM() take the checkpoint folder "
                        f"that holds config.json and the weights")
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json; is it a Hugging Face checkpoint?")
    hf = read_json(cfg_file, "a JSON object of model settings")
    try:
        family = family_of(hf)
        return hf, family, family.config_from_hf(hf)
    except KeyError as e:
        raise UserError(f"{cfg_file}: missing key {e} (needed by model_type "
                        f"{hf.get('model_type')!r})") from None
    except (TypeError, ValueError) as e:
        raise UserError(f"{cfg_file}: {e}") from None


def read_generation_config(folder: Path) -> dict:
    """generation_config.json as a dict ({} when the checkpoint has none)."""
    file = folder / "generation_config.json"
    return read_json(file) if file.is_file() else {}


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise UserError(f"{index}: no \"weight_map\" object (tensor name -> shard file)")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {str(folder)!r} names missing shards: {missing}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(folder)!r}")
    return files


@contextmanager
def open_weights(file: Path):
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise UserError(f"{file}: not a readable safetensors file ({e}); "
                        f"is it truncated or still downloading?") from None


def named_tensors(model: DiffusionLM) -> dict[str, torch.Tensor]:
    """Parameters and persistent buffers (e.g. a router's ``expert_bias``): what a checkpoint
    stores. named_parameters skips a tied head's duplicate, so it appears once, as the embedding."""
    persistent = model.state_dict(keep_vars=True).keys()
    buffers = {n: b for n, b in model.named_buffers() if n in persistent}
    return {**dict(model.named_parameters()), **buffers}


def expected_names(model: DiffusionLM, family: Family) -> dict[str, str]:
    """checkpoint tensor name -> our parameter name."""
    return {family.checkpoint_name(name): name for name in named_tensors(model)}


def read_bytes(tensor: torch.Tensor, slices) -> int:
    """Bytes of ``tensor`` read from the file (zero padding rows excluded)."""
    if not slices or slices[0][0] != 0:
        return tensor.numel() * tensor.element_size()
    rows = sum(end - start for _, start, end in slices)
    return rows * (tensor.numel() // max(tensor.shape[0], 1)) * tensor.element_size()


def ignored_tensor(name: str, family: Family, cfg: ModelConfig) -> bool:
    """Tensors a checkpoint may hold that the model has no place for and does not need: RoPE's
    ``inv_freq`` (recomputed from rope_theta) and, in a tied model, a stored copy of the head
    (the head is the embedding)."""
    return name.endswith("inv_freq") or (cfg.tie_word_embeddings
                                          and name == family.checkpoint_name("lm_head.weight"))


def check_names(found: set[str], names: dict[str, str], family: Family, folder: Path) -> None:
    missing = sorted(set(names) - found)
    extra = sorted(found - set(names))
    if missing or extra:
        raise UserError(f"checkpoint {str(folder)!r} does not match its config "
                        f"({family.model_type}): missing tensors {missing[:8]}, unexpected tensors {extra[:8]}")


# (checkpoint name, our name, the parts of the tensor this process holds (None: all of it))
LoadItem = tuple[str, str, list | None]


def load_plan(folder: Path, model: DiffusionLM, family: Family) -> dict[Path, list[LoadItem]]:
    """What to read from each weight file into ``model`` (still on the meta device), after
    checking every name and shape against the config from the file headers alone. With a shard,
    only this rank's part of every tensor (``parallel.mark``)."""
    params = named_tensors(model)
    names = expected_names(model, family)
    with ExitStack() as stack:
        files = weight_files(folder)
        handles = {file: stack.enter_context(open_weights(file)) for file in files}
        where = {name: file for file, h in handles.items() for name in h.keys()}
        whole = names
        if model.shard is not None:  # the whole model's names: other ranks' experts are expected too
            with torch.device("meta"):
                whole = expected_names(DiffusionLM(model.config), family)
        found = {n for n in where if not ignored_tensor(n, family, model.config)}
        check_names(found, whole, family, folder)
        plan: dict[Path, list[LoadItem]] = {file: [] for file in files}
        for ckpt, ours in names.items():
            param = params[ours]
            shape = tuple(handles[where[ckpt]].get_slice(ckpt).get_shape())
            full = tuple(getattr(param, "full_shape", param.shape))
            if shape != full:
                raise UserError(f"tensor {ckpt} has shape {shape} but the config implies {full}")
            plan[where[ckpt]].append((ckpt, ours, getattr(param, "load_slices", None)))
    return plan


def read_weights(model: DiffusionLM, plan: dict[Path, list[LoadItem]]) -> int:
    """Copy the planned tensors into ``model``'s (allocated) parameters, one file and one tensor
    at a time, converting to each parameter's dtype as it goes: at most one tensor of the
    checkpoint is in memory besides the model. Returns the bytes read."""
    params = named_tensors(model)
    nbytes = 0
    with torch.no_grad():
        for file, items in plan.items():
            if not items:
                continue
            with open_weights(file) as f:
                for ckpt, ours, slices in items:
                    param = params[ours]
                    if slices is None:
                        tensor = f.get_tensor(ckpt)
                    else:
                        tensor = read_slices(f.get_slice(ckpt), slices, param.shape[0])
                    nbytes += read_bytes(tensor, slices)
                    param.copy_(tensor)
                    del tensor
    return nbytes


def cast_model(model: DiffusionLM, dtype: torch.dtype) -> DiffusionLM:
    """Every parameter and buffer in ``dtype``, except a router's ``expert_bias``, kept in fp32 as
    SGLang does: it only chooses experts, and bf16 rounding would change the choice."""
    model.to(dtype)
    for module in model.modules():
        if isinstance(module, Router) and module.expert_bias is not None:
            module.expert_bias = module.expert_bias.float()
    return model


def load_model(path: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", shard: Shard | None = None,
               quantization: str | None = None) -> DiffusionLM:
    """Build the family's model from a local checkpoint folder. On the ``meta`` device the
    weights are not read: the model has its config and shapes only (an HTTP front that
    tokenizes and validates for replicas elsewhere needs nothing more).

    ``dtype``: float32 / bfloat16 / float16, or ``"auto"``: the checkpoint's (``resolve_dtype``).
    The model is built on the meta device, cast there, allocated once in ``dtype`` on ``device``,
    then filled tensor by tensor: the checkpoint is never held in memory whole, nor the model in
    a wider dtype.

    ``shard``: build and read only this tensor-parallel rank's slices (``model.loaded_bytes``
    says how many bytes of weights it read).

    ``quantization``: ``"int8"`` / ``"int4"``: the linear layers quantized once loaded
    (``models/quantize.py``; ``model.quantization`` reports what was); checked before any
    weight is read."""
    folder = Path(path)
    device = parse_device(device)
    hf, family, cfg = read_config(folder)
    dtype = resolve_dtype(dtype, hf, folder)
    quantization = check_quantization(quantization, device, dtype)
    if shard is not None:
        check_shardable(cfg, shard.size)
    with torch.device("meta"):
        model = DiffusionLM(cfg, shard)
    model.family = family
    model.quantization = None
    if device.type == "meta":
        return cast_model(model, dtype).eval()
    plan = load_plan(folder, model, family)
    cast_model(model, dtype).to_empty(device=device)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    for module in model.modules():  # the experts' weights in stacked tensors, filled in place below
        if isinstance(module, MoE):
            module.stack_experts()
    nbytes = read_weights(model, plan)
    if shard is not None:
        model.loaded_bytes = nbytes
    if quantization is not None:
        model.quantization = quantize_model(model, quantization)
    return model.eval()


def save_model(model: DiffusionLM, path: str | Path, family: Family,
               max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (sharded with an index when max_shard_bytes is set).
    Weights already in ``folder`` are deleted first: the loader would read a stale index or
    stale shards with the new files."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("*.safetensors"), folder / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    hf = family.config_to_hf(model.config)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), None)
    if dtype is not None:  # what the weights are stored in (dtype "auto" loads it back)
        hf["torch_dtype"] = str(dtype).removeprefix("torch.")
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    state = {family.checkpoint_name(n): own_storage(p.detach().contiguous().cpu())
             for n, p in named_tensors(model).items()}
    if max_shard_bytes is None:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    save_shards(state, folder, max_shard_bytes)


def own_storage(t: torch.Tensor) -> torch.Tensor:
    """``t``, copied when it is a view into a larger tensor (a stacked expert's weight,
    ``MoE.stack_experts``): safetensors stores no two tensors that share memory."""
    return t.clone() if t.untyped_storage().nbytes() != t.numel() * t.element_size() else t


def save_shards(state: dict[str, torch.Tensor], folder: Path, max_shard_bytes: int) -> None:
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        weight_map.update({n: fname for n in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
