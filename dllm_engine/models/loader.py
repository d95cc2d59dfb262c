"""Load and save checkpoints in the family's real layout: ``config.json`` with the family's own
keys, ``model.safetensors`` or shards with ``model.safetensors.index.json``, tensors under the
family's own names. The same code loads a real 8B checkpoint and the embedded tiny ones."""
from __future__ import annotations

import json
from contextlib import ExitStack, contextmanager
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from .family import Family
from .layers import DiffusionLM
from .parallel import Shard, check_shardable, read_slices
from .registry import get_family
from ..config import ModelConfig

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
INDEX_FILE = "model.safetensors.index.json"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; use one of {', '.join(DTYPES)}")
    return DTYPES[dtype]


def parse_device(device: str | torch.device) -> torch.device:
    """A device this torch build can use: cpu, or cuda[:N] / mps where available."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {str(device)!r} is not a device name; use cpu, cuda or cuda:N") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {str(device)!r} is not available: this torch {torch.__version__} "
                         f"build has no CUDA or sees no GPU; use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"device {str(device)!r}: only {torch.cuda.device_count()} GPU(s) visible")
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device {str(device)!r} is not available on this machine; use --device cpu")
    if dev.type not in ("cpu", "cuda", "mps", "meta"):  # meta: config and shapes, no weights
        raise ValueError(f"device {str(device)!r} is not supported; use cpu or cuda")
    return dev


def read_json(file: Path, what: str = "a JSON object") -> dict:
    """A JSON object from ``file``; a ValueError naming the file if it is not one."""
    try:
        value = json.loads(file.read_text())
    except UnicodeDecodeError:
        raise ValueError(f"{file}: not a text file; expected {what}") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{file}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{file}: expected {what}, got a JSON {type(value).__name__}")
    return value


def read_config(path: str | Path) -> tuple[dict, Family, ModelConfig]:
    """The raw config.json, its family and the normalised ModelConfig."""
    folder = Path(path)
    if folder.is_file():
        raise ValueError(f"{str(folder)!r} is a file; --model / LLM() take the checkpoint folder "
                         f"that holds config.json and the weights")
    if not folder.is_dir():
        raise FileNotFoundError(f"checkpoint folder {str(folder)!r} does not exist")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise FileNotFoundError(f"{str(folder)!r} has no config.json; is it a Hugging Face checkpoint?")
    hf = read_json(cfg_file, "a JSON object of model settings")
    try:
        family = get_family(hf.get("model_type"))
        return hf, family, family.config_from_hf(hf)
    except KeyError as e:
        raise ValueError(f"{cfg_file}: missing key {e} (needed by model_type "
                         f"{hf.get('model_type')!r})") from None
    except (TypeError, ValueError) as e:
        raise ValueError(f"{cfg_file}: {e}") from None


def read_generation_config(folder: Path) -> dict:
    """generation_config.json as a dict ({} when the checkpoint has none)."""
    file = folder / "generation_config.json"
    return read_json(file) if file.is_file() else {}


def weight_files(folder: Path) -> list[Path]:
    index = folder / INDEX_FILE
    if index.is_file():
        weight_map = read_json(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ValueError(f"{index}: no \"weight_map\" object (tensor name -> shard file)")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise FileNotFoundError(f"{INDEX_FILE} in {str(folder)!r} names missing shards: {missing}")
        return [folder / s for s in shards]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {str(folder)!r}")
    return files


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files(folder):
        with open_weights(file) as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


@contextmanager
def open_weights(file: Path):
    try:
        with safe_open(str(file), framework="pt") as f:
            yield f
    except (SafetensorError, OSError) as e:
        raise ValueError(f"{file}: not a readable safetensors file ({e}); "
                         f"is it truncated or still downloading?") from None


def read_shard(folder: Path, model: DiffusionLM, family: Family) -> tuple[dict[str, torch.Tensor], int]:
    """This rank's part of every tensor (``parallel.mark``), reading only those bytes from the
    memory-mapped files; returns the state dict and the bytes read."""
    names = expected_names(model, family)
    params = named_tensors(model)
    state, nbytes = {}, 0
    with ExitStack() as stack:
        handles = [stack.enter_context(open_weights(f)) for f in weight_files(folder)]
        where = {name: h for h in handles for name in h.keys()}
        with torch.device("meta"):  # the whole model's names: other ranks' experts are expected too
            whole = expected_names(DiffusionLM(model.config), family)
        check_names(set(where), whole, family, folder)
        for ckpt, ours in names.items():
            tensor_slice = where[ckpt].get_slice(ckpt)
            param = params[ours]
            full = tuple(getattr(param, "full_shape", param.shape))
            if tuple(tensor_slice.get_shape()) != full:
                raise ValueError(f"tensor {ckpt} has shape {tuple(tensor_slice.get_shape())} but "
                                 f"the config implies {full}")
            slices = getattr(param, "load_slices", None)
            state[ours] = read_slices(tensor_slice, slices, param.shape[0] if slices else None)
            nbytes += read_bytes(state[ours], slices)
    return state, nbytes


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


def check_names(found: set[str], names: dict[str, str], family: Family, folder: Path) -> None:
    missing = sorted(set(names) - found)
    extra = sorted(found - set(names))
    if missing or extra:
        raise ValueError(f"checkpoint {str(folder)!r} does not match its config "
                         f"({family.model_type}): missing tensors {missing[:8]}, unexpected tensors {extra[:8]}")


def check_tensors(tensors: dict, model: DiffusionLM, family: Family, folder: Path) -> dict:
    names = expected_names(model, family)
    check_names(set(tensors), names, family, folder)
    params = named_tensors(model)
    for ckpt, ours in names.items():
        if tuple(tensors[ckpt].shape) != tuple(params[ours].shape):
            raise ValueError(f"tensor {ckpt} has shape {tuple(tensors[ckpt].shape)} but the config "
                             f"implies {tuple(params[ours].shape)}")
    return {ours: tensors[ckpt] for ckpt, ours in names.items()}


def load_model(path: str | Path, dtype: str | torch.dtype = "float32",
               device: str | torch.device = "cpu", shard: Shard | None = None) -> DiffusionLM:
    """Build the family's model from a local checkpoint folder. On the ``meta`` device the
    weights are not read: the model has its config and shapes only (an HTTP front that
    tokenizes and validates for replicas elsewhere needs nothing more).

    ``shard``: build and read only this tensor-parallel rank's slices (``model.loaded_bytes``
    says how many bytes of weights it read)."""
    folder = Path(path)
    device = parse_device(device)
    dtype = parse_dtype(dtype)
    _, family, cfg = read_config(folder)
    if shard is not None:
        check_shardable(cfg, shard.size)
    with torch.device("meta"):
        model = DiffusionLM(cfg, shard)
    model.family = family
    if device.type == "meta":
        return model.to(dtype).eval()
    if shard is None:
        state = check_tensors(read_tensors(folder), model, family, folder)
    else:
        state, model.loaded_bytes = read_shard(folder, model, family)
    model.to_empty(device=device)
    model.load_state_dict(state, strict=False, assign=False)
    if cfg.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model.to(parse_dtype(dtype)).eval()


def save_model(model: DiffusionLM, path: str | Path, family: Family,
               max_shard_bytes: int | None = None) -> None:
    """Write config.json and safetensors (sharded with an index when max_shard_bytes is set).
    Weights already in ``folder`` are deleted first: the loader would read a stale index or
    stale shards with the new files."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    for stale in [*folder.glob("*.safetensors"), folder / INDEX_FILE]:
        stale.unlink(missing_ok=True)
    (folder / "config.json").write_text(json.dumps(family.config_to_hf(model.config), indent=2) + "\n")
    state = {family.checkpoint_name(n): p.detach().contiguous().cpu()
             for n, p in named_tensors(model).items()}
    if max_shard_bytes is None:
        save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return
    save_shards(state, folder, max_shard_bytes)


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
