"""Weight-only quantization on load, through torchao (``LLM(..., quantization=...)``,
``--quantization``; docs/quantization.md).

The checkpoint's own weights are read as usual (bf16 / fp32), then every linear layer of the
stack — attention projections, dense MLPs, every MoE expert and shared expert — is replaced in
place by torchao's quantized tensor, and so are experts stored stacked (DiffusionGemma's
``[experts, out, in]`` parameters, named by their module's ``STACKED``; int8 only, one scale per
expert and output row: torchao's int4 layout packs 2-D weights). Left as they are: the
embedding, the LM head (the logits' precision sets the confidences every commit rule reads, and
a tied head is the embedding), norms and MoE routers (fp32 by design). Under tensor parallelism
each rank quantizes the slices it holds: a row-parallel slice gets its own per-row scales, so
tokens can differ from one process in the last bits, as they do for any TP split.

- ``int8``: int8 weights, one scale per output row (per-channel), CPU and CUDA.
- ``int4``: int4 weights in groups of ``INT4_GROUP`` inputs, CUDA with bf16 activations only
  (torchao's tinygemm layout; it has no CPU kernel). A linear whose shape the layout cannot
  take stays in bf16, and ``QuantizeReport`` counts it.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UserError
from .layers import MoE

QUANTIZATIONS = ("int8", "int4")
INT4_GROUP = 128  # inputs per int4 scale (torchao's default)
TORCHAO_FLOOR = "0.18"  # the version whose configs (version 2 tensors) this module uses


@dataclass(frozen=True)
class QuantizeReport:
    method: str
    quantized: int  # linear layers replaced
    kept: int  # linear layers the method's layout cannot take, left in the model's dtype
    stacked: int = 0  # stacked expert weights quantized
    stacked_kept: int = 0  # stacked expert weights the method cannot take (int4), left as they are

    def describe(self) -> str:
        kept = f", {self.kept} kept in the model's dtype (shape)" if self.kept else ""
        stacked = f", {self.stacked} stacked expert weights" if self.stacked else ""
        if self.stacked_kept:
            stacked += f", {self.stacked_kept} stacked expert weights kept in the model's dtype (layout)"
        return f"{self.method}: {self.quantized} linear layers quantized{kept}{stacked}"


def check_quantization(method: str | None, device: torch.device, dtype: torch.dtype | None) -> str | None:
    """``method`` checked against the device and dtype (None: not known yet) before any weight
    is read (None: no quantization); a clear error for what cannot run."""
    if method is None or method == "none":
        return None
    if method not in QUANTIZATIONS:
        raise UserError(f"quantization {method!r} is not supported; use one of {', '.join(QUANTIZATIONS)}")
    if device.type == "meta":
        return method
    if method == "int4" and device.type != "cuda":
        raise UserError(f"quantization int4 runs on CUDA only (torchao's int4 kernels have no {device.type} "
                        f"version); use int8 on {device.type}")
    if method == "int4" and dtype is not None and dtype != torch.bfloat16:
        raise UserError(f"quantization int4 needs dtype bfloat16 (its kernel's activations), not "
                        f"{str(dtype).removeprefix('torch.')}; pass dtype bfloat16")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"quantization {method} runs on cpu or cuda, not {device.type}")
    torchao()  # missing library: say so now, not after loading the weights
    return method


@contextmanager
def quiet_import():
    """torchao's import warns about optional kernels a build lacks (e.g. CUDA ones on a CPU
    wheel); they are not used here."""
    loggers = [logging.getLogger(name) for name in ("torchao", "torch.utils._pytree")]
    levels = [log.level for log in loggers]
    for log in loggers:
        log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for log, level in zip(loggers, levels):
            log.setLevel(level)


def torchao():
    """The torchao module; a UserError saying how to install it when it is missing."""
    try:
        with quiet_import():
            import torchao as lib
            import torchao.quantization  # noqa: F401
    except ImportError:
        raise UserError(f"quantization needs torchao >= {TORCHAO_FLOOR}: pip install 'dllm-engine[quant]' "
                        f"(or pip install torchao)") from None
    return lib


def takes(method: str, linear: nn.Linear) -> bool:
    """Whether ``method``'s layout can hold this linear's weight: int4's tinygemm packs whole
    groups of inputs and output rows in eights."""
    if method == "int4":
        return linear.in_features % INT4_GROUP == 0 and linear.out_features % 8 == 0
    return True


def config(method: str):
    from torchao.quantization import Int4WeightOnlyConfig, Int8WeightOnlyConfig
    # set_inductor_config=False: leave the process's inductor settings as the user has them
    if method == "int8":
        return Int8WeightOnlyConfig(set_inductor_config=False)
    return Int4WeightOnlyConfig(group_size=INT4_GROUP, int4_packing_format="tile_packed_to_4d",
                                set_inductor_config=False)


def linears(model: nn.Module) -> dict[str, nn.Linear]:
    """The linear layers quantization replaces: all but the LM head and a router's projection."""
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.split(".")[-1] != "lm_head" and ".router." not in f".{name}."}


def stacked_experts(model: nn.Module) -> dict[str, tuple[nn.Module, str]]:
    """Experts stored as one ``[experts, out, in]`` parameter each (a module's ``STACKED``
    names them): full name -> (module, attribute)."""
    return {f"{name}.{attr}" if name else attr: (m, attr) for name, m in model.named_modules()
            for attr in getattr(m, "STACKED", ())}


def quantize_model(model: nn.Module, method: str) -> QuantizeReport:
    """Quantize ``model``'s linear layers and stacked experts in place (see the module
    docstring for which)."""
    lib = torchao()
    found = linears(model)
    chosen = {name for name, m in found.items() if takes(method, m)}
    stacks = stacked_experts(model) if method == "int8" else {}
    with quiet_import(), torch.no_grad():
        lib.quantization.quantize_(model, config(method), filter_fn=lambda m, name: name in chosen)
        if stacks:
            from torchao.quantization import FqnToConfig
            lib.quantization.quantize_(model, FqnToConfig({name: config(method) for name in stacks}),
                                       filter_fn=None)
    for module in model.modules():  # experts kept in stacked tensors drop them: their weights are new
        if isinstance(module, MoE):
            module.unstack()
    return QuantizeReport(method, len(chosen), len(found) - len(chosen), len(stacks),
                          len(stacked_experts(model)) - len(stacks))


def quantize_reversibly(model: nn.Module, method: str):
    """Quantize ``model`` in place and return a function that puts its original weights back
    (``dllm bench --compare-quantization``: one model measured both ways in one run; the
    original weights stay in memory meanwhile)."""
    originals = [(m, "weight") for m in linears(model).values()] + list(stacked_experts(model).values())
    weights = [getattr(m, attr) for m, attr in originals]
    stacks = [(m, m.stacks, m.grouped) for m in model.modules() if isinstance(m, MoE)]  # the weights' storage
    before = getattr(model, "quantization", None)
    model.quantization = quantize_model(model, method)

    def restore() -> None:
        for (m, attr), weight in zip(originals, weights):
            setattr(m, attr, weight)
        for module, stacked, grouped in stacks:  # the original weights are views into them again
            module.stacks, module.grouped = stacked, grouped
        model.quantization = before
    return restore


def storage_bytes(t: torch.Tensor) -> int:
    """Bytes a tensor holds: a quantized weight's inner tensors (values, scales), not its
    logical shape times the original dtype's size."""
    flatten = getattr(t, "__tensor_flatten__", None)
    if flatten is not None and type(t) not in (torch.Tensor, nn.Parameter):
        names, _ = flatten()
        return sum(storage_bytes(getattr(t, n)) for n in names if getattr(t, n) is not None)
    return t.numel() * t.element_size()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers as stored (a tied head counted once)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += storage_bytes(t)
    return total
