"""``dllm serve``: the OpenAI-compatible server, in this process or as Ray Serve replicas."""
from __future__ import annotations

import argparse

from ..errors import UserError
from . import common  # common.load_llm, looked up per call: tests stand in for the model
from .common import (DEFAULT_MODEL, add_model_args, add_sampling_args, non_negative_int, sampling_params,
                     set_threads)


def add_serve(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server with continuous batching")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder or Hugging Face id (default: tiny-llada)")
    p.add_argument("--model", dest="model_option", default=None, help="the same as the positional MODEL")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--max-num-seqs", type=int, default=256, help="sequences in the running batch")
    p.add_argument("--max-queue", type=non_negative_int, default=256, help="waiting sequences before 429")
    p.add_argument("--served-model-name", default=None, help="the model id clients use (default: folder name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="seconds in-flight requests may finish after SIGINT/SIGTERM")
    p.add_argument("--log-level", default="info")
    p.add_argument("--api-key", default=None,
                   help="require `Authorization: Bearer KEY` on /v1/* (default: open)")
    p.add_argument("--max-request-bytes", type=byte_count, default="8MiB", metavar="BYTES",
                   help="a larger request body is refused with 413 before it is read (default 8MiB)")
    add_model_args(p, model=False)
    add_sampling_args(p)  # the defaults of requests that leave an option out
    add_replica_args(p)


def byte_count(text: str) -> int:
    """``--max-request-bytes``: a positive byte count (``8MiB``, ``500000``)."""
    from ..engine.llm import parse_bytes
    try:
        value = parse_bytes(text)
    except (UserError, ValueError):
        value = None
    if value is None or value < 1:
        raise argparse.ArgumentTypeError(f"expected a byte count such as 8MiB or 500000, got {text!r}")
    return value


def replicas(text: str) -> int | str:
    """``--replicas``: a count, or ``auto`` (Ray Serve autoscaling)."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--replicas must be a number or 'auto', got {text!r}") from None


def add_replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("data-parallel replicas on Ray Serve (pip install -e '.[distributed]')")
    g.add_argument("--replicas", type=replicas, default=None, metavar="N|auto",
                   help="serve N copies of the model, each in its own process, behind one endpoint "
                   "(default: one engine in this process, no Ray)")
    g.add_argument("--min-replicas", type=int, default=1, help="--replicas auto: fewest replicas")
    g.add_argument("--max-replicas", type=int, default=4, help="--replicas auto: most replicas")
    g.add_argument("--target-ongoing-requests", type=float, default=16.0,
                   help="--replicas auto: ongoing requests per replica that autoscaling aims at")
    g.add_argument("--threads-per-replica", type=int, default=None,
                   help="torch CPU threads of each replica, of each of its ranks with --tensor-parallel-size "
                        "(default: CPU cores / (replicas x ranks))")
    g.add_argument("--ray-address", default=None,
                   help="join this Ray cluster (e.g. auto, ray://head:10001); default: start a "
                   "local Ray instance for the server's lifetime")


def serve_model(args: argparse.Namespace) -> str:
    """``dllm serve MODEL`` or ``dllm serve --model MODEL`` (vLLM accepts both)."""
    if args.model and args.model_option and args.model != args.model_option:
        raise UserError(f"two models given: {args.model!r} and --model {args.model_option!r}; give one")
    return args.model or args.model_option or str(DEFAULT_MODEL)


def check_listen(host: str, port: int) -> None:
    """Fail before loading anything if the server could not listen on host:port."""
    import socket
    if not 1 <= port <= 65535:
        raise UserError(f"--port {port} is not a TCP port; use 1..65535")
    try:
        socket.create_server((host, port)).close()
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


def run_serve(args: argparse.Namespace) -> None:
    if args.replicas is not None:
        return run_serve_replicated(args)
    if args.ray_address is not None:
        raise UserError("--ray-address needs --replicas N or --replicas auto: the single-process "
                        "server runs no Ray")
    from ..server import run_server
    model = serve_model(args)
    check_listen(args.host, args.port)
    set_threads(args.threads)
    defaults = sampling_params(args)
    llm = common.load_llm(args, model, max_num_seqs=args.max_num_seqs, seed=args.seed)
    common.check_method_family(args, llm)
    resolved = llm.resolve(defaults)  # a default the model cannot run: refuse to start
    print(f"serving {model} at http://{args.host}:{args.port}/v1")
    print(f"default method: {resolved.describe()}")
    print(seed_policy(llm.seeds))
    run_server(llm, args.host, args.port, defaults, args.served_model_name, args.max_queue,
               args.shutdown_timeout, args.log_level, args.api_key, args.max_request_bytes)


def seed_policy(seeds) -> str:
    """The start-up line on seeds, as the server applies them (``server.app.Server.make_request``)."""
    hint = ("; start with --seed N to make them a reproducible stream" if seeds.seed is None
            else " (--seed): the same seeds in the same order every run")
    return f"seed: {seeds.describe()}{hint}; send \"seed\" to reproduce a sampled answer"


def run_serve_replicated(args: argparse.Namespace) -> None:
    import os
    try:
        from ..server.replicated import ReplicaOptions, Scaling, run_replicated
    except ImportError as e:
        raise UserError(f"--replicas needs Ray Serve ({e}): pip install -e '.[distributed]'") from None
    import torch
    from .. import LLM
    from ..engine.canvas_llm import is_canvas_checkpoint
    from ..engine.llm import parse_bytes
    from ..hub import resolve_model
    from ..models.quantize import check_quantization
    model = serve_model(args)
    budget = parse_bytes(args.kv_cache_memory)  # each replica's own (the front's LLM checks it)
    scaling = Scaling(None if args.replicas == "auto" else args.replicas, args.min_replicas,
                      args.max_replicas, args.target_ongoing_requests)
    threads = args.threads_per_replica
    if threads is None:
        threads = max(1, (os.cpu_count() or 1) // (scaling.most * args.tensor_parallel_size))
    replica = ReplicaOptions(model, args.dtype, args.device, args.max_num_seqs, args.max_queue,
                             threads, args.shutdown_timeout, args.keep_freed_memory, args.compile,
                             args.fixed_shapes, args.compile_step, revision=args.revision, seed=args.seed,
                             quantization=args.quantization, max_request_bytes=args.max_request_bytes,
                             prefix_cache=args.prefix_cache, tensor_parallel_size=args.tensor_parallel_size,
                             kv_cache_memory=budget, gpu_memory_utilization=args.gpu_memory_utilization)
    defaults = sampling_params(args)
    # reads no weights (an id is fetched here once); refuses a bad default, shapes that do not
    # split over --tensor-parallel-size, and what a canvas model (DiffusionGemma) does not run
    # (fixed shapes, a compiled step), before any replica starts
    canvas = {"compile": args.compile, "fixed_shapes": args.fixed_shapes, "compile_step": args.compile_step}
    path = resolve_model(model, args.revision)
    front = LLM(model, dtype=args.dtype, device="meta", revision=args.revision, seed=args.seed,
                tensor_parallel_size=args.tensor_parallel_size, kv_cache_memory=budget,
                gpu_memory_utilization=args.gpu_memory_utilization,
                **(canvas if is_canvas_checkpoint(path) else {}))
    common.check_method_family(args, front)
    front.resolve(defaults)
    # a quantization the replicas' device cannot run fails here (the front may have no GPU)
    check_quantization(args.quantization, torch.device(args.device), front.model.embed_tokens.weight.dtype)
    print(seed_policy(front.seeds))
    run_replicated(replica, scaling, defaults, args.served_model_name, args.host, args.port, args.ray_address)
