"""Model ids (dllm_engine/hub.py): a fake Hugging Face cache on disk, in the real snapshot layout,
built from the embedded checkpoints and read offline. No test touches the network: HF_HUB_OFFLINE
is on, or huggingface_hub's calls are replaced by ones raising its own exception classes."""
from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import huggingface_hub
import pytest
from huggingface_hub import constants, errors
from huggingface_hub.utils import filter_repo_objects

from dllm_engine import LLM, SamplingParams
from dllm_engine.cli import main
from dllm_engine.hub import ModelNotFoundError, model_name, resolve_model
from dllm_engine.models import read_config

ROOT = Path(__file__).resolve().parent.parent
LLADA, SDAR = ROOT / "checkpoints" / "tiny-llada", ROOT / "checkpoints" / "tiny-sdar"
MAIN = hashlib.sha1(b"tiny-llada").hexdigest()  # commit hashes: 40 hex digits, as the Hub's
OLD = hashlib.sha1(b"tiny-sdar").hexdigest()
BIN = hashlib.sha1(b"bin-only").hexdigest()
CHAT = [{"role": "user", "content": "sort : 9 2 7 4"}]


def add_snapshot(cache: Path, repo_id: str, commit: str, files: dict[str, bytes], refs: tuple[str, ...]) -> Path:
    """``models--org--name/blobs/<sha256>``, ``snapshots/<commit>/<file>`` symlinks to the blobs,
    ``refs/<ref>`` holding the commit (no newline, as huggingface_hub writes it)."""
    repo = cache / f"models--{repo_id.replace('/', '--')}"
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir(exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snapshot / name).symlink_to(os.path.relpath(blob, snapshot))
    (repo / "refs").mkdir(exist_ok=True)
    for ref in refs:
        (repo / "refs" / ref).write_text(commit)
    return snapshot


def folder_files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file() and p.name != "README.md"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    """org/tiny-llada: main = tiny-llada, branch ``sdar`` = tiny-sdar; org/bin-only: a config,
    a tokenizer and pytorch_model.bin."""
    cache = tmp_path_factory.mktemp("hub")
    add_snapshot(cache, "org/tiny-llada", MAIN, folder_files(LLADA), refs=("main",))
    add_snapshot(cache, "org/tiny-llada", OLD, folder_files(SDAR), refs=("sdar",))
    bin_files = {"config.json": (LLADA / "config.json").read_bytes(), "pytorch_model.bin": b"not read"}
    add_snapshot(cache, "org/bin-only", BIN, bin_files, refs=("main",))
    return cache


@pytest.fixture(autouse=True)
def offline(cache, monkeypatch) -> Path:
    """huggingface_hub reads HF_HUB_CACHE / HF_HUB_OFFLINE when imported: set its constants for
    this process, and the environment for the commands a test starts."""
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def snapshot(cache: Path, commit: str, repo: str = "models--org--tiny-llada") -> Path:
    return cache / repo / "snapshots" / commit


def chat_text(llm: LLM) -> str:
    return llm.chat(CHAT, SamplingParams(max_new_tokens=32))[0].text


def test_id_loads_offline_and_generates_as_the_folder(cache):
    by_id, by_folder = LLM("org/tiny-llada"), LLM(LLADA)
    assert by_id.path == snapshot(cache, MAIN) and by_id.name == "org/tiny-llada"
    assert by_folder.name == "tiny-llada"
    text = chat_text(by_id)
    assert text.strip() and text == chat_text(by_folder)


def test_revision_by_branch_and_by_commit(cache):
    assert resolve_model("org/tiny-llada") == snapshot(cache, MAIN)
    assert resolve_model("org/tiny-llada", revision="sdar") == snapshot(cache, OLD)
    assert resolve_model("org/tiny-llada", revision=OLD) == snapshot(cache, OLD)
    assert read_config(resolve_model("org/tiny-llada", revision="sdar"))[0]["model_type"] == "sdar"


def test_local_folder_is_returned_as_is():
    assert resolve_model(LLADA) == LLADA
    assert resolve_model(str(LLADA), revision="v2") == LLADA  # a revision is for ids only
    assert model_name(LLADA) == "tiny-llada" and model_name("org/tiny-llada") == "org/tiny-llada"


def test_cli_generate_and_revision_by_id(capsys):
    args = ["generate", "--model", "org/tiny-llada", "--prompt", "sort : 9 2 7 4", "--chat", "--threads", "1",
            "--max-new-tokens", "32"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "model: org/tiny-llada" in out and "method: dual-cache" in out
    assert "output: 2 4 7 9" in out
    assert main([*args, "--revision", OLD]) == 0  # the sdar commit: block diffusion's default method
    assert "method: block" in capsys.readouterr().out


@pytest.mark.slow  # subprocesses
def test_download_prints_the_snapshot_folder(cache, tmp_path, capsys):
    """The installed command, as ``$(dllm download ID)`` runs it: the environment chooses the cache."""
    done = subprocess.run([sys.executable, "-m", "dllm_engine.cli", "download", "org/tiny-llada"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [str(snapshot(cache, MAIN))]
    other = tmp_path / "other-cache"
    add_snapshot(other, "org/tiny-llada", OLD, folder_files(SDAR), refs=("v1",))
    assert main(["download", "org/tiny-llada", "--revision", "v1", "--cache-dir", str(other)]) == 0
    assert capsys.readouterr().out.splitlines() == [str(other / "models--org--tiny-llada" / "snapshots" / OLD)]


@pytest.mark.slow  # subprocesses
def test_uncached_id_offline_names_the_cache(cache, tmp_path):
    done = subprocess.run([sys.executable, "-m", "dllm_engine.cli", "download", "org/missing"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.count("\n") == 1 and f"org/missing is not in the Hugging Face cache {cache} " in done.stderr
    assert "HF_HUB_OFFLINE=1" in done.stderr
    with pytest.raises(ModelNotFoundError, match="at revision 'nope' is not in the Hugging Face cache"):
        LLM("org/tiny-llada", revision="nope")  # a ref the cache does not hold


def test_not_a_folder_nor_an_id():
    for name in ("/nonexistent-dllm/model", "no-such-folder", "a/b/c"):
        with pytest.raises(ModelNotFoundError, match="does not exist, and it is not a Hugging Face id"):
            LLM(name)
    with pytest.raises(ModelNotFoundError, match="not a valid Hugging Face model id"):
        resolve_model("org/bad--name")  # the shape of an id, refused by huggingface_hub's validation
    assert issubclass(ModelNotFoundError, ValueError)


def test_a_mistyped_folder_is_named_as_a_folder(tmp_path, monkeypatch):
    """checkpoints/nope has an id's shape, but checkpoints/ is a local folder: the error names
    the folder and what it holds, without asking the Hub."""
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr("dllm_engine.hub.download_model", lambda *a: pytest.fail("asked the Hub"))
    with pytest.raises(ModelNotFoundError, match=r"model folder 'checkpoints/nope' does not exist "
                                                 r"\(checkpoints/ holds tiny-llada, tiny-sdar\)"):
        resolve_model("checkpoints/nope")


def test_bin_only_snapshot():
    with pytest.raises(ModelNotFoundError, match=r"PyTorch \.bin weights only \(pytorch_model\.bin\); "
                                                 r"dllm-engine reads safetensors only: convert them"):
        LLM("org/bin-only")


def http_error(cls: type, message: str) -> Exception:
    """One of huggingface_hub's HTTP errors without a request (it reads the response's headers)."""
    return cls(message, response=SimpleNamespace(headers={}, request=None, status_code=404))


@pytest.mark.parametrize("error,message", [
    (http_error(errors.GatedRepoError, "403 gated"),
     "org/x is a gated repository: accept its terms at https://huggingface.co/org/x, then log in with "
     "`hf auth login` (`huggingface-cli login` before huggingface_hub 1.0) or set HF_TOKEN"),
    (http_error(errors.RepositoryNotFoundError, "404"),
     "no local folder 'org/x' and no model repository 'org/x' on the Hugging Face Hub: check the id"),
    (http_error(errors.RevisionNotFoundError, "404"),
     "org/x has no revision 'v9': give one of its branches, tags or commit hashes"),
    (http_error(errors.HfHubHTTPError, "500 Server Error\nmore lines"),
     "could not fetch org/x at revision 'v9' from the Hugging Face Hub: 500 Server Error"),
])
def test_hub_errors(monkeypatch, error, message):
    def refuse(*args, **kwargs):
        raise error
    monkeypatch.setattr(huggingface_hub, "snapshot_download", refuse)
    with pytest.raises(ModelNotFoundError) as raised:
        LLM("org/x", revision="v9")
    assert str(raised.value).startswith(message) and "\n" not in str(raised.value)


def test_unreachable_hub_names_the_cache(cache, monkeypatch):
    def unreachable(*args, **kwargs):
        raise errors.LocalEntryNotFoundError("An error happened while trying to locate the files on the Hub")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(ModelNotFoundError, match=f"cannot reach the Hugging Face Hub, and org/x is not in "
                                                 f"the Hugging Face cache {cache} "):
        resolve_model("org/x")


def test_fetches_only_what_the_engine_reads(monkeypatch, tmp_path):
    """The patterns given to snapshot_download keep config, tokenizer and safetensors files at the
    top level; a repository that lists .bin weights only is refused online, by its listing (the
    snapshot holds no .bin: it is never fetched)."""
    listing = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
               "chat_template.jinja", "model.safetensors.index.json", "model-00001-of-00002.safetensors",
               "pytorch_model.bin", "training_args.bin", "modeling_llada.py", "configuration_llada.py",
               "original/consolidated.safetensors", "README.md", ".gitattributes"]
    calls, folder = [], tmp_path / "snapshots" / BIN
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")

    def fetch(repo_id, **kwargs):
        calls.append(kwargs)
        return str(folder)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub, "snapshot_download", fetch)
    monkeypatch.setattr(huggingface_hub, "list_repo_files", lambda repo_id, revision: listing[:-3])
    with pytest.raises(ModelNotFoundError, match=r"org/y has PyTorch \.bin weights only \(pytorch_model\.bin\)"):
        resolve_model("org/y")
    kept = filter_repo_objects(listing, allow_patterns=calls[0]["allow_patterns"],
                               ignore_patterns=calls[0]["ignore_patterns"])
    assert sorted(kept) == sorted(listing[:7])


@pytest.mark.parametrize("command", ["generate", "eval", "chain-probe", "frontier-probe", "canvas-probe", "canvas-rows", "bench", "profile", "serve", "download"])
def test_every_model_command_takes_a_revision(command, capsys):
    with pytest.raises(SystemExit):
        main([command, "--help"])
    assert "--revision" in capsys.readouterr().out


@pytest.mark.slow  # over 2 s on 2 busy cores
def test_bench_by_id(tmp_path, capsys):
    """dllm bench reads the config before the weights: the id is resolved once, for both."""
    assert main(["bench", "--model", "org/tiny-llada", "--methods", "dual-cache", "--tasks", "sort", "--limit", "1",
                 "--batch-sizes", "1", "--max-new-tokens", "32", "--out", str(tmp_path / "bench")]) == 0
    assert "model: org/tiny-llada" in capsys.readouterr().out


def test_server_and_lm_eval_name_the_id():
    from fastapi.testclient import TestClient
    from dllm_engine.server.app import create_app
    with TestClient(create_app(LLM("org/tiny-llada"))) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "org/tiny-llada"
    lm_eval = pytest.importorskip("dllm_engine.integrations.lm_eval")
    lm = lm_eval.DllmLM("org/tiny-llada", revision="sdar")
    assert lm.llm.path.name == OLD and lm.llm.model.config.model_type == "sdar"
