"""Model ids: ``LLM("org/name")`` and ``--model org/name`` as well as a local folder.

``resolve_model`` gives the folder the loader opens: a local path as it is, else the snapshot of a
Hugging Face Hub repository in huggingface_hub's cache, through ``snapshot_download``: what the
cache holds is not fetched again, missing files are downloaded with huggingface_hub's progress
bars, and ``HF_HUB_OFFLINE=1`` (or no network) answers from the cache alone. Only the files the
engine reads are fetched: never ``*.bin`` weights, never remote code. Every failure is one
``ModelNotFoundError`` line saying what to do (docs/models/hub.md).
"""
from __future__ import annotations

import fnmatch
import re
from pathlib import Path

from .errors import UserError

# What the engine reads from a checkpoint (models/loader.py, tokenizer.py, engine/llm.py)
ENGINE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                "special_tokens_map.json", "vocab.json", "merges.txt", "tokenizer.model",
                "added_tokens.json", "chat_template.jinja", "*.safetensors",
                "model.safetensors.index.json")
# the loader reads a checkpoint's top level only; a repository may keep other copies below it
SKIPPED_FILES = ("*/*",)
BIN_WEIGHTS = "pytorch_model*.bin"  # transformers' PyTorch weight files (not training_args.bin)
MODEL_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # org/name, as the Hub spells ids
LOGIN = "log in with `hf auth login` (`huggingface-cli login` before huggingface_hub 1.0) or set HF_TOKEN"


class ModelNotFoundError(UserError):
    """A model that is neither a local path nor a Hugging Face id the engine can fetch and read."""


def is_model_id(name: str) -> bool:
    """``org/name``: the shape of a Hugging Face model id."""
    return MODEL_ID.fullmatch(name) is not None


def hub_cache_dir(cache_dir: str | Path | None = None) -> Path:
    """The cache huggingface_hub searches: ``cache_dir``, else HF_HUB_CACHE, else $HF_HOME/hub
    (``huggingface_hub.constants`` reads both when it is imported)."""
    from huggingface_hub import constants
    return Path(cache_dir or constants.HF_HUB_CACHE).expanduser()


def model_name(name_or_path: str | Path) -> str:
    """How a model is named to users (the server's default model name): an id as given, a
    local folder by its own name."""
    text = str(name_or_path)
    return text if is_model_id(text) and not Path(text).exists() else Path(text).name


def resolve_model(name_or_path: str | Path, revision: str | None = None,
                  cache_dir: str | Path | None = None) -> Path:
    """The checkpoint folder of ``name_or_path``: an existing local path as it is (``revision``
    does not apply to it), else the snapshot of the Hugging Face id at ``revision`` (default:
    ``main``; a branch, tag or commit hash), fetched into the cache if needed."""
    path = Path(name_or_path)
    if path.exists():
        return path
    if not is_model_id(str(name_or_path)):
        raise ModelNotFoundError(f"model folder {str(name_or_path)!r} does not exist, and it is not a "
                                 f"Hugging Face id (org/name): give a checkpoint folder or an id such "
                                 f"as GSAI-ML/LLaDA-8B-Instruct")
    if path.parent.is_dir():  # checkpoints/nope: a mistyped folder, not an id of org "checkpoints"
        holds = sorted(p.name for p in path.parent.iterdir() if (p / "config.json").is_file())
        raise ModelNotFoundError(f"model folder {str(name_or_path)!r} does not exist"
                                 + (f" ({path.parent}/ holds {', '.join(holds)})" if holds else "")
                                 + f"; a Hugging Face id is not looked up while {str(path.parent)!r} is a "
                                   f"local folder")
    return download_model(str(name_or_path), revision, cache_dir)


def download_model(repo_id: str, revision: str | None = None, cache_dir: str | Path | None = None) -> Path:
    """The snapshot folder of ``repo_id`` at ``revision`` in the cache, holding the files the
    engine reads (``ENGINE_FILES``); downloaded with progress bars when online."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HFValidationError
    if not is_model_id(repo_id):
        raise ModelNotFoundError(f"{repo_id!r} is not a Hugging Face model id; ids look like org/name")
    cache = hub_cache_dir(cache_dir)
    try:
        folder = snapshot_download(repo_id, revision=revision, cache_dir=cache,
                                   allow_patterns=list(ENGINE_FILES), ignore_patterns=list(SKIPPED_FILES))
    except (OSError, HFValidationError) as e:  # the Hub's errors are OSErrors (HfHubHTTPError, ...)
        raise hub_error(e, repo_id, revision, cache) from None
    check_weights(repo_id, Path(folder))
    return Path(folder)


def hub_error(error: Exception, repo_id: str, revision: str | None, cache: Path) -> ModelNotFoundError:
    """One line for what went wrong while resolving ``repo_id``, and what to do."""
    from huggingface_hub import errors
    at = f" at revision {revision!r}" if revision else ""
    if isinstance(error, errors.GatedRepoError):
        return ModelNotFoundError(f"{repo_id} is a gated repository: accept its terms at "
                                  f"https://huggingface.co/{repo_id}, then {LOGIN}")
    if isinstance(error, errors.RepositoryNotFoundError):
        return ModelNotFoundError(f"no local folder {repo_id!r} and no model repository {repo_id!r} on the "
                                  f"Hugging Face Hub: check the id (a private repository needs a token: {LOGIN})")
    if isinstance(error, errors.RevisionNotFoundError):
        return ModelNotFoundError(f"{repo_id} has no revision {revision!r}: give one of its branches, "
                                  f"tags or commit hashes")
    if isinstance(error, errors.LocalEntryNotFoundError):
        return ModelNotFoundError(not_cached(error, repo_id, revision, cache))
    if isinstance(error, errors.HFValidationError):
        return ModelNotFoundError(f"{repo_id!r} is not a valid Hugging Face model id: {first_line(error)}")
    return ModelNotFoundError(f"could not fetch {repo_id}{at} from the Hugging Face Hub: {first_line(error)}")


def not_cached(error: Exception, repo_id: str, revision: str | None, cache: Path) -> str:
    """The Hub could not be asked (offline, or unreachable) and the cache lacks the snapshot."""
    from huggingface_hub import constants, errors
    partial = isinstance(error, getattr(errors, "IncompleteSnapshotError", ()))
    what = repo_id + (f" at revision {revision!r}" if revision else "")
    held = "is only partly" if partial else "is not"
    where = f"in the Hugging Face cache {cache} (set by HF_HUB_CACHE, else HF_HOME)"
    if constants.HF_HUB_OFFLINE:
        return (f"{what} {held} {where}, and HF_HUB_OFFLINE=1 forbids downloading it: unset "
                f"HF_HUB_OFFLINE, or fetch it where the Hub is reachable (`dllm download {repo_id}`)")
    return (f"cannot reach the Hugging Face Hub, and {what} {held} {where}: check the network "
            f"(or proxy), or point HF_HUB_CACHE at a cache that holds it")


def first_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def check_weights(repo_id: str, folder: Path) -> None:
    """Refuse a snapshot without safetensors weights; say so when the repository has PyTorch
    ``.bin`` weights only (never downloaded: the engine cannot read them)."""
    if any(folder.glob("*.safetensors")):
        return
    listed = repo_files(repo_id, folder.name)  # snapshots/<commit>
    names = listed or sorted(p.name for p in folder.iterdir())
    bins = fnmatch.filter(names, BIN_WEIGHTS)
    if bins:
        more = f" and {len(bins) - 1} more" if len(bins) > 1 else ""
        raise ModelNotFoundError(
            f"{repo_id} has PyTorch .bin weights only ({bins[0]}{more}); dllm-engine reads safetensors "
            f"only: convert them (the Hub's safetensors/convert Space, or torch.load + "
            f"safetensors.torch.save_file into a local folder: docs/models/hub.md) and pass that")
    if listed:
        raise ModelNotFoundError(f"{repo_id} has no *.safetensors weights at its top level "
                                 f"(dllm-engine reads safetensors only)")
    raise ModelNotFoundError(f"the cached snapshot {folder} of {repo_id} has no *.safetensors weights: "
                             f"fetch them where the Hub is reachable with `dllm download {repo_id}`")


def repo_files(repo_id: str, commit: str) -> list[str]:
    """The repository's file names at ``commit``; [] offline or when the Hub cannot say."""
    from huggingface_hub import constants, list_repo_files
    if constants.HF_HUB_OFFLINE:
        return []
    try:
        return list_repo_files(repo_id, revision=commit)
    except Exception:  # noqa: BLE001 -- only to word the error better; the folder's files stand in
        return []
