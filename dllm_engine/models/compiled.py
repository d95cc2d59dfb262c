"""``LLM(..., compile=True)`` / ``--compile``: torch.compile of the layer stack's per-token blocks.

Applied to a finished model from outside (no model file changes): every RMSNorm and every dense
SwiGLU MLP of the stack gets a forward that calls one shared compiled function with the
module's weights as arguments; a DiffusionGemma stack's Gemma RMSNorms (q/k norms included) and
its dense GeGLU MLPs likewise (its routed experts stay eager, as MoE layers do). One compilation, with dynamic shapes, serves every layer and
every token count, so a step's changing shapes (a block, a canvas, a shrunk set) do not
recompile it. Attention (SDPA with its masks and row groups), the K/V cache, strategy hooks
and MoE layers stay eager: they read the forward context, which changes every step.

NOT bit-exact: inductor fuses the norm's reduction and the SwiGLU's activation into its own
kernels, whose results differ from the eager ones in the last bits (~1e-6); greedy tokens are
the same unless two candidates are that close. ``tests/test_compile.py`` checks the tokens
against eager on the test fixtures. Off by default: measure before turning it on
(``dllm bench --compile`` runs each spec eager and compiled side by side).
"""
from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..errors import UserError
from .diffusion_gemma import GatedMLP, GemmaRMSNorm, gelu_tanh, gemma_rms_norm
from .layers import MLP, DiffusionLM, MoE, RMSNorm, rms_norm


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """MLP.forward as a function of its weights: down(silu(gate x) * up x)."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def geglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """DiffusionGemma's GatedMLP.forward as a function of its weights: down(gelu_tanh(gate x) * up x)."""
    return F.linear(gelu_tanh(F.linear(x, gate)) * F.linear(x, up), down)


# eager originals
KERNELS: dict[str, Callable[..., Tensor]] = {"rms_norm": rms_norm, "swiglu": swiglu,
                                             "gemma_rms_norm": gemma_rms_norm, "geglu": geglu}

# Process-wide on purpose: one compiled function per kernel serves every layer of every model in
# the process (weights are arguments, shapes dynamic), so a second LLM or a re-``compile_model``
# reuses the compilation instead of paying it again. Filled lazily, never cleared or replaced;
# an entry depends only on its name (dynamo's guards pick the graph per dtype / device), so
# sharing it never changes results.
_compiled_kernels: dict[str, Callable[..., Tensor]] = {}


def kernel(name: str) -> Callable[..., Tensor]:
    """The compiled function ``name`` (compiled once per process, lazily: the first call traces)."""
    if name not in _compiled_kernels:
        # not fullgraph: under a TorchDispatchMode (dllm profile counting syncs) dynamo skips
        # the frame, and the call must then run eager rather than raise
        _compiled_kernels[name] = torch.compile(KERNELS[name], dynamic=True)
    return _compiled_kernels[name]


def on_rows(fn, x: Tensor, *args, **kwargs) -> Tensor:
    """``fn`` over ``x`` seen as [N, d]: one compiled graph for every input rank, and only
    the token count N varies (dynamic shapes specialise a dimension of size 1, which a
    batch of one would otherwise be)."""
    return fn(x.reshape(-1, x.shape[-1]), *args, **kwargs).view(*x.shape[:-1], -1)


def compiled_forward(module: nn.Module):
    """A forward for ``module`` that calls the shared compiled function, or None to keep eager."""
    if isinstance(module, GemmaRMSNorm):  # before RMSNorm: its subclass, scaled in Gemma's order
        return partial(on_rows, kernel("gemma_rms_norm"), weight=module.weight, eps=module.eps)
    if isinstance(module, GatedMLP):
        return lambda x: on_rows(kernel("geglu"), x, module.gate_proj.weight, module.up_proj.weight,
                                 module.down_proj.weight)
    if isinstance(module, RMSNorm):
        return partial(on_rows, kernel("rms_norm"), weight=module.weight, eps=module.eps)
    if isinstance(module, MLP):
        return lambda x: on_rows(kernel("swiglu"), x, module.gate_proj.weight, module.up_proj.weight,
                                 module.down_proj.weight)
    return None


def check_compile(compile: bool, tensor_parallel_size: int, compile_step: bool = False) -> None:
    """Refuse compiling a tensor-parallel model, before anything loads: the compiled MLP calls
    its weights directly and would skip the row-parallel all-reduce, and a compiled step would
    trace the ranks' collectives, which no test covers."""
    for name, on in (("compile", compile), ("compile_step", compile_step)):
        if on and tensor_parallel_size > 1:
            raise UserError(f"{name} is for one process (a compiled layer would skip or trace the "
                            "tensor-parallel all-reduce); drop it or use tensor_parallel_size 1")


STEP_GRAPHS = 64  # compiled step graphs dynamo may keep: one per (rows, tokens, keys) bucket


def compile_step(model: DiffusionLM):
    """``LLM(..., compile_step=True)`` / ``--compile-step``: the whole layer stack
    (``forward_layers``: embedding, every layer with its attention, K/V writes and reads,
    final norm; RoPE's lookup stays outside) compiled without dynamic shapes, for fixed-shape steps only
    (``engine/shapes.py``): one graph per shape bucket, each compiled on its first step (tens
    of seconds on a CPU), then replayed. On CUDA with ``mode="reduce-overhead"``, i.e. captured
    as a CUDA graph; on a CPU inductor's C++ kernels. Not bit-exact (as ``compile_model``).
    MoE layers are captured where their experts run as grouped GEMMs (``MoE.grouped``: torch
    2.9+, unquantized) in bfloat16 (the grouped GEMM's traced form takes no other dtype);
    refused otherwise, since the per-expert chain sizes each matmul by its token count, a host
    read that would send the whole stack back to eager."""
    moe = [m for m in model.modules() if isinstance(m, MoE)]
    if any(not m.grouped or m.stacks[0].dtype != torch.bfloat16 for m in moe):
        raise UserError("compile_step cannot capture these MoE layers: their experts must run as grouped GEMMs "
                        "(torch >= 2.9, unquantized weights) in bfloat16 (pass dtype bfloat16); the per-expert "
                        "chain sizes each matmul by a token count read from the device. Use fixed_shapes "
                        "without compile_step")
    cuda = next(model.parameters()).device.type == "cuda"
    return torch.compile(model.forward_layers, dynamic=False, mode="reduce-overhead" if cuda else None,
                         **step_recompile_limit())


def step_recompile_limit() -> dict[str, int]:
    """Room for one graph per bucket: dynamo keeps a bounded number of graphs per function
    (``recompile_limit``, default 8). Where ``torch.compile`` takes the limit per call (torch
    2.13+) it is set for the step's function alone; older torch has only the process-wide
    setting, which is then raised (never lowered: other compiled code keeps at least its limit;
    a higher limit only keeps more graphs, it never changes a result)."""
    import torch._dynamo
    limit = max(torch._dynamo.config.recompile_limit, STEP_GRAPHS)
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return {"recompile_limit": limit}
    torch._dynamo.config.recompile_limit = limit
    return {}


def compile_model(model: DiffusionLM) -> None:
    """Give the per-token blocks of ``model``'s layers (and its final norm) compiled forwards
    (see the module docstring); ``model`` a masked family's ``DiffusionLM`` or a ``DiffusionGemma``."""
    for layer in model.layers:
        for module in layer.modules():
            if isinstance(module, MLP) and module is not layer.mlp:
                continue  # an expert or shared expert: MoE layers stay eager
            forward = compiled_forward(module)
            if forward is not None:
                module.forward = forward
    model.norm.forward = compiled_forward(model.norm)


def uncompile_model(model: DiffusionLM) -> None:
    """Back to the eager forwards (``compile_model`` only set instance attributes)."""
    for module in model.modules():
        module.__dict__.pop("forward", None)


def is_compiled(model: DiffusionLM) -> bool:
    return any("forward" in m.__dict__ for m in model.modules())
