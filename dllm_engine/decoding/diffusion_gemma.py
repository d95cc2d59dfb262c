"""DiffusionGemma's sampler: the reference sampling loop of transformers'
``DiffusionGemmaForBlockDiffusion.generate`` (>= 5.23, read for its algorithm; this is our own
code), as small batched pieces over [B, C] / [B, C, V] tensors that the engine can call per
forward group, and ``generate`` over ``DiffusionGemma.encode`` / ``decode``.

Uniform-noise block diffusion, not masked diffusion: there is no mask token. A canvas of
``canvas_length`` (C) tokens starts as uniform random tokens; each denoising step, with n
counting down from N = ``max_denoising_steps`` to 1:

1. decode the canvas against the encoder's cache, self-conditioned on the previous step's scaled
   logits (none at a canvas's first step);
2. scale the logits by the temperature t_min + (t_max - t_min) * n / N;
3. draw a token from softmax(scaled) at every position; take the argmax canvas;
4. accept the lowest-entropy positions while the entropies before each one (sorted ascending:
   their sum less the largest) stay within ``entropy_bound`` (EntropyBoundSampler, arXiv
   2505.24857); at least one position is accepted;
5. the next canvas holds the draw where accepted and fresh uniform tokens elsewhere; ``accepted``
   is that map (False: undecided, noise). Nothing is sticky: every step decides every position;
6. a row stops early once its argmax canvas has not changed for ``stability_threshold`` steps and
   its mean entropy is under ``confidence_threshold``; a stopped row keeps its state.

A row keeps the argmax canvas of its last step. Between canvases that canvas is encoded causally
into the cache; a row whose canvas holds an EOS finishes (tokens after its first EOS, and all its
later canvases, become pad), and generation stops once every row has finished, or after
ceil(max_new_tokens / C) canvases.

Memory (V = 262,144 in the release): the decoder's fp32 logits [B, C, V] (256 MiB a row at C =
256) are scaled in place, and the self-conditioning kept for the next step is that tensor in the
embedding dtype (a copy only when that is not fp32). What would make more fp32 [B, C, V] tensors
runs over chunks of canvas positions, at most ``chunk_elements`` values (or one position for all
rows, B x V, if more) at a time: each draw's softmax (in ``Draws.sample``) and the entropy's
normalised logits, probabilities and products. The argmax reads the whole tensor without a copy;
the decoder makes its soft embeddings in chunks too (``DiffusionGemma.soft_embeddings``).

Randomness: every draw goes through a ``Draws`` object (the first canvas, each step's samples,
each step's renoising tokens) with ``DrawKeys`` naming the rows in the call, their canvas and
their step, so a test can give transformers and this code the same draws (in the reference's
order and shapes: every row draws at every step, a stopped row's draws thrown away) and the
engine its own seeded source: ``SeededDraws`` keys every number by (the row's seed, canvas,
step, canvas position, which draw), so a row draws the same whatever runs beside it.

Batch invariance (``generate(batch_invariant=True)``): a left-padded row counts its positions
from its first token, and rows that stopped leave the decoder's forwards (and, finished at EOS
with a pad id, the encoder's too) instead of running and being thrown away; with
``SeededDraws`` a row's tokens are then those it gets alone.
"""
from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

import torch
from torch import Tensor

from ..errors import UserError
from ..models.diffusion_gemma import DiffusionGemma, EncoderCache
from ..models.loader import read_json
from .noise import CANVAS, RENOISE, Noise
from .rules import sample_tokens

log = logging.getLogger(__name__)

SAMPLING_CHUNK_ELEMENTS = 1 << 24  # fp32 values of [*, V] sampling work at once (64 MiB a copy)
SAMPLER_NAME = "EntropyBoundSamplerConfig"  # the one sampler transformers defines
# generation_config.json keys read as they are (sampler_config and eos_token_id are translated)
SCALAR_KEYS = ("max_new_tokens", "max_denoising_steps", "t_min", "t_max", "stability_threshold",
               "confidence_threshold", "pad_token_id")
# generation_config.json keys that do not change how DiffusionGemma samples
METADATA_KEYS = {"transformers_version", "_from_model_config", "_commit_hash", "return_dict_in_generate",
                 "cache_implementation", "cache_config", "disable_compile", "bos_token_id"}


# -- settings -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GenerationSettings:
    """The sampler's settings; the defaults are transformers' (those of the released
    generation_config.json). ``eos_token_ids`` empty: no row finishes at EOS; ``pad_token_id``
    None: tokens after EOS are kept."""
    max_new_tokens: int = 256
    max_denoising_steps: int = 48
    entropy_bound: float = 0.1
    t_min: float = 0.4
    t_max: float = 0.8
    stability_threshold: int = 1
    confidence_threshold: float = 0.005
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "max_denoising_steps"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("stability_threshold", self.stability_threshold, minimum=0)
        for name in ("entropy_bound", "confidence_threshold"):
            check_number(name, getattr(self, name), positive=True)
        for name in ("t_min", "t_max"):
            check_number(name, getattr(self, name), positive=False)
        if self.t_max <= self.t_min:
            raise UserError(f"t_max {self.t_max} must be greater than t_min {self.t_min}: the temperature "
                            f"falls from t_max at the first denoising step to t_min at the last")
        for token in self.eos_token_ids:
            check_int("eos_token_id", token, minimum=0)
        if self.pad_token_id is not None:
            check_int("pad_token_id", self.pad_token_id, minimum=0)

    def num_canvases(self, canvas_length: int) -> int:
        return math.ceil(self.max_new_tokens / canvas_length)

    @classmethod
    def from_generation_config(cls, data: dict, source: str = "generation_config.json",
                               eos_token_ids: tuple[int, ...] = (), pad_token_id: int | None = None
                               ) -> GenerationSettings:
        """Settings from a generation_config.json object; a key that is missing or null takes the
        default (as transformers fills it), EOS and pad ids falling back to the arguments (the
        model config's)."""
        values = {key: data[key] for key in SCALAR_KEYS if data.get(key) is not None}
        sampler = data.get("sampler_config")
        if sampler is not None:
            values["entropy_bound"] = entropy_bound_of(sampler, source)
        eos = data.get("eos_token_id")
        values["eos_token_ids"] = eos_token_ids if eos is None else tuple(eos if isinstance(eos, list) else [eos])
        values.setdefault("pad_token_id", pad_token_id)
        ignored = set(data) - set(SCALAR_KEYS) - METADATA_KEYS - {"sampler_config", "eos_token_id"}
        if ignored:
            log.warning("%s: ignoring %s (not settings of DiffusionGemma's sampler)", source, sorted(ignored))
        try:
            return cls(**values)
        except UserError as e:
            raise UserError(f"{source}: {e}") from None


def check_int(name: str, value, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise UserError(f"{name} must be {kind}, got {value!r}")


def check_number(name: str, value, positive: bool) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
            or value < 0 or (positive and value == 0):
        raise UserError(f"{name} must be a number {'> 0' if positive else '>= 0'}, got {value!r}")


def entropy_bound_of(sampler, source: str) -> float:
    if not isinstance(sampler, dict) or sampler.get("_cls_name", SAMPLER_NAME) != SAMPLER_NAME:
        name = sampler.get("_cls_name") if isinstance(sampler, dict) else sampler
        raise UserError(f"{source}: sampler_config {name!r} is not supported; DiffusionGemma samples with "
                        f'{{"_cls_name": "{SAMPLER_NAME}", "entropy_bound": ...}}')
    if "entropy_bound" not in sampler:
        raise UserError(f"{source}: sampler_config needs an \"entropy_bound\" (a number > 0; the release uses 0.1)")
    return sampler["entropy_bound"]


def load_generation_settings(folder: str | Path, eos_token_ids: tuple[int, ...] = (),
                             pad_token_id: int | None = None) -> GenerationSettings:
    """A checkpoint folder's generation_config.json as settings (the defaults without one);
    ``eos_token_ids`` / ``pad_token_id``: the model config's, used where the file names none."""
    file = Path(folder) / "generation_config.json"
    data = read_json(file, "a JSON object of generation settings") if file.is_file() else {}
    return GenerationSettings.from_generation_config(data, str(file), eos_token_ids, pad_token_id)


# -- randomness -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class DrawKeys:
    """Which rows draw, and where each stands: ``rows`` [B] its index among the generation's rows
    (the index of its seed), ``canvas`` [B] the canvas being denoised (0: the first after the
    prompt), ``step`` [B] the denoising steps it has run on that canvas (the step drawing; 0 for
    a new canvas). Draws that ignore the keys read the batch size and device from them."""
    rows: Tensor  # [B] int64
    canvas: Tensor  # [B] int64
    step: Tensor  # [B] int64

    @classmethod
    def at(cls, rows: Tensor, canvas: Tensor | int, step: Tensor | int) -> DrawKeys:
        step = step if isinstance(step, Tensor) else torch.full_like(rows, step)
        canvas = canvas if isinstance(canvas, Tensor) else torch.full_like(rows, canvas)
        return cls(rows, canvas.to(rows.device, torch.int64), step.to(rows.device, torch.int64))

    def __len__(self) -> int:
        return self.rows.shape[0]

    @property
    def device(self) -> torch.device:
        return self.rows.device


class Draws(Protocol):
    """Where the sampler's randomness comes from. Per canvas: ``canvas_tokens`` once, then per
    step ``sample`` over the canvas's positions in order (one or more chunks), then
    ``renoise_tokens`` once; ``keys`` name the rows in the call and their canvas and step."""

    def canvas_tokens(self, keys: DrawKeys, canvas_length: int, vocab_size: int) -> Tensor:
        """[B, C] uniform tokens in [0, vocab_size): a new canvas."""

    def sample(self, scaled_logits: Tensor, positions: slice, keys: DrawKeys) -> Tensor:
        """[B, c]: a token per row and position from softmax(``scaled_logits`` [B, c, V] fp32),
        the logits of the canvas positions ``positions``."""

    def renoise_tokens(self, keys: DrawKeys, canvas_length: int, vocab_size: int) -> Tensor:
        """[B, C] uniform tokens: the noise the undecided positions take."""


class TorchDraws:
    """Draws from torch's generators (``generator``, or torch's default one): uniform tokens by
    ``torch.randint``, samples by ``torch.multinomial`` over each chunk's fp32 softmax. The keys
    are not read: a row's draws depend on the batch around it and the order of the calls."""

    def __init__(self, generator: torch.Generator | None = None) -> None:
        self.generator = generator

    def canvas_tokens(self, keys: DrawKeys, canvas_length: int, vocab_size: int) -> Tensor:
        return torch.randint(0, vocab_size, (len(keys), canvas_length), device=keys.device, generator=self.generator)

    renoise_tokens = canvas_tokens

    def sample(self, scaled_logits: Tensor, positions: slice, keys: DrawKeys) -> Tensor:
        b, c, v = scaled_logits.shape
        probs = scaled_logits.softmax(-1, dtype=torch.float32).reshape(b * c, v)  # the one chunk's copy
        return torch.multinomial(probs, 1, generator=self.generator).view(b, c)


class SeededDraws:
    """Counter-based draws, one seed per row of the generation (``seeds`` [N], integers in
    [0, 2^63)): every random number is the engine's hash (``noise.Noise``) of the row's seed, the
    canvas position (0..C-1, whatever chunk draws it), the denoising step, the canvas index (the
    key's salt) and a stream naming the draw: ``CANVAS`` (a new canvas's tokens), ``TOKENS`` (the
    step's sample: a Gumbel-max over the scaled logits, one uniform per vocabulary id, through
    ``rules.sample_tokens``: exactly a draw from their softmax) or ``RENOISE`` (the step's noise
    tokens). So a row draws the same numbers alone or in any batch, in any order and on any
    device, and whether or not other rows ran."""

    def __init__(self, seeds: Sequence[int] | Tensor) -> None:
        values = seeds.tolist() if isinstance(seeds, Tensor) else list(seeds)
        for seed in values:
            if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
                raise UserError(f"seeds must be integers in [0, 2^63), one per prompt; got {seed!r}")
        if not values:
            raise UserError("SeededDraws needs one seed per prompt; got none")
        self.seeds = torch.tensor(values, dtype=torch.int64)

    def __len__(self) -> int:
        return self.seeds.shape[0]

    def noise(self, keys: DrawKeys, positions: Tensor) -> Noise:
        """The keys of each (row, canvas position) pair, [B * c] row-major."""
        c = positions.shape[0]
        self.seeds = self.seeds.to(keys.device)

        def per_position(t: Tensor) -> Tensor:
            return t.repeat_interleave(c)

        return Noise(per_position(self.seeds[keys.rows]), positions.repeat(len(keys)),
                     per_position(keys.step), per_position(keys.canvas))

    def uniform_tokens(self, keys: DrawKeys, canvas_length: int, vocab_size: int, stream: int) -> Tensor:
        noise = self.noise(keys, torch.arange(canvas_length, device=keys.device))
        column = torch.zeros(1, dtype=torch.int64, device=keys.device)
        return noise.integers(stream, column, vocab_size).view(len(keys), canvas_length)

    def canvas_tokens(self, keys: DrawKeys, canvas_length: int, vocab_size: int) -> Tensor:
        return self.uniform_tokens(keys, canvas_length, vocab_size, CANVAS)

    def renoise_tokens(self, keys: DrawKeys, canvas_length: int, vocab_size: int) -> Tensor:
        return self.uniform_tokens(keys, canvas_length, vocab_size, RENOISE)

    def sample(self, scaled_logits: Tensor, positions: slice, keys: DrawKeys) -> Tensor:
        b, c, v = scaled_logits.shape
        noise = self.noise(keys, torch.arange(positions.start, positions.stop, device=keys.device))
        flat = scaled_logits.reshape(b * c, v)  # the one chunk (a copy unless it is the whole canvas)
        return sample_tokens(flat, 1.0, noise).view(b, c)  # already scaled: temperature 1


# -- the per-step pieces --------------------------------------------------------------------------
def temperatures(settings: GenerationSettings, num_steps: Tensor) -> Tensor:
    """[B] fp32 temperature of each row's next step, ``num_steps`` [B] steps already run on its
    canvas: n = N - num_steps, t_min + (t_max - t_min) * n / N (fp32 arithmetic, as transformers
    computes it)."""
    steps_left = settings.max_denoising_steps - num_steps
    return settings.t_min + (settings.t_max - settings.t_min) * (steps_left / settings.max_denoising_steps)


def scale_logits_(logits: Tensor, temperature: Tensor) -> Tensor:
    """logits [B, C, V] / temperature [B], in place (the decoder's fp32 logits are not needed
    unscaled: no second [B, C, V] fp32 tensor)."""
    return logits.div_(temperature[:, None, None])


def token_entropy(scaled_logits: Tensor) -> Tensor:
    """[..., c] entropy of softmax(``scaled_logits`` [..., c, V]), computed as
    ``torch.distributions.Categorical(logits=...).entropy()`` computes it (the same bits)."""
    log_probs = scaled_logits - scaled_logits.logsumexp(-1, keepdim=True)
    probs = log_probs.softmax(-1)
    log_probs = log_probs.clamp_(min=torch.finfo(log_probs.dtype).min)
    return -(log_probs.mul_(probs)).sum(-1)


def positions_per_chunk(batch: int, vocab_size: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(batch * vocab_size, 1))


def sample_and_entropy(scaled_logits: Tensor, draws: Draws, keys: DrawKeys,
                       chunk_elements: int = SAMPLING_CHUNK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """(sampled [B, C], entropy [B, C] fp32) from scaled logits [B, C, V], over chunks of canvas
    positions: the fp32 copies (the draw's softmax, the entropy's terms) exist for one chunk."""
    b, c, v = scaled_logits.shape
    step = positions_per_chunk(b, v, chunk_elements)
    sampled, entropy = [], []
    for start in range(0, c, step):
        positions = slice(start, min(start + step, c))
        chunk = scaled_logits[:, positions]  # [B, c, V], a view
        sampled.append(draws.sample(chunk, positions, keys))
        entropy.append(token_entropy(chunk))
    return torch.cat(sampled, dim=1), torch.cat(entropy, dim=1)


def accept_by_entropy(entropy: Tensor, entropy_bound: float) -> Tensor:
    """[B, C] bool: per row, the lowest-entropy positions, sorted ascending, accepted while the
    sum of the entropies before each one (the running sum less the largest, itself) is at most
    ``entropy_bound``; the lowest is always accepted."""
    ordered, order = entropy.sort(dim=-1)
    within = ordered.cumsum(dim=-1) - ordered <= entropy_bound
    return torch.zeros_like(within).scatter(-1, order, within)


def renoise(sampled: Tensor, accepted: Tensor, noise: Tensor) -> Tensor:
    """[B, C] the next canvas: the sample where accepted, ``noise`` tokens where undecided."""
    return torch.where(accepted, sampled, noise)


def count_repeats(previous_argmax: Tensor, argmax: Tensor, num_repeats: Tensor) -> Tensor:
    """[B] for how many steps before this one the argmax canvas was the same: one more than
    before if unchanged, else 0 (a canvas's first step compares with nothing: -1 before it)."""
    unchanged = (argmax == previous_argmax).all(dim=-1)
    return torch.where(unchanged, num_repeats + 1, torch.zeros_like(num_repeats))


def stable_and_confident(num_repeats: Tensor, entropy: Tensor, settings: GenerationSettings) -> Tensor:
    """[B] bool: the argmax canvas unchanged for ``stability_threshold`` steps and the mean
    entropy of the positions under ``confidence_threshold``."""
    stable = num_repeats >= settings.stability_threshold
    return stable & (entropy.mean(dim=-1) < settings.confidence_threshold)


# -- a canvas's state -----------------------------------------------------------------------------
@dataclass
class CanvasState:
    """One canvas of each row in its denoising loop."""
    canvas_ids: Tensor  # [B, C] the decoder's next input: accepted tokens, noise where undecided
    accepted: Tensor  # [B, C] bool: positions that hold the last step's accepted draw
    argmax_ids: Tensor  # [B, C] the argmax of the last step's scaled logits: the canvas a row keeps
    self_conditioning: Tensor | None  # [B, C, V] the last step's scaled logits, embedding dtype
    num_repeats: Tensor  # [B] steps the argmax canvas has stayed the same (-1 before the first step)
    num_steps: Tensor  # [B] denoising steps (decoder forwards) run on this canvas
    finished: Tensor  # [B] bool: stopped early (stable and confident)

    # the per-row tensors beside ``self_conditioning`` (which a canvas's first step lacks)
    ROWS = ("canvas_ids", "accepted", "argmax_ids", "num_repeats", "num_steps", "finished")

    def rows(self, index: Tensor) -> CanvasState:
        """The state of some rows (``index`` [b]; a copy)."""
        sc = None if self.self_conditioning is None else self.self_conditioning.index_select(0, index)
        return CanvasState(self_conditioning=sc, **{f: getattr(self, f).index_select(0, index) for f in self.ROWS})


def cat_states(a: CanvasState, b: CanvasState) -> CanvasState:
    """``a``'s rows, then ``b``'s; a side without self-conditioning (a canvas's first step) gets
    zeros there, which the decoder's signal mask drops."""
    sc = None
    if a.self_conditioning is not None or b.self_conditioning is not None:
        like = a.self_conditioning if a.self_conditioning is not None else b.self_conditioning
        sc = torch.cat([x.self_conditioning if x.self_conditioning is not None else
                        like.new_zeros(len(x.num_steps), *like.shape[1:]) for x in (a, b)])
    return CanvasState(self_conditioning=sc, **{f: torch.cat([getattr(a, f), getattr(b, f)]) for f in CanvasState.ROWS})


def set_rows(state: CanvasState, index: Tensor, fresh: CanvasState) -> CanvasState:
    """``state`` with its rows ``index`` replaced by ``fresh`` (new canvases: no
    self-conditioning, whose rows here are zeroed in place for the decoder's signal mask)."""
    for f in CanvasState.ROWS:
        getattr(state, f)[index] = getattr(fresh, f)
    if state.self_conditioning is not None:
        state.self_conditioning.index_fill_(0, index, 0)
    return state


def new_canvas(keys: DrawKeys, canvas_length: int, vocab_size: int, draws: Draws) -> CanvasState:
    """A canvas of uniform random tokens, every position undecided."""
    ids = draws.canvas_tokens(keys, canvas_length, vocab_size)
    rows = torch.zeros(len(keys), dtype=torch.long, device=keys.device)
    return CanvasState(ids, torch.zeros_like(ids, dtype=torch.bool), ids, None, rows - 1, rows,
                       torch.zeros(len(keys), dtype=torch.bool, device=keys.device))


def denoise_step(state: CanvasState, logits: Tensor, settings: GenerationSettings, draws: Draws, keys: DrawKeys,
                 embed_dtype: torch.dtype, chunk_elements: int = SAMPLING_CHUNK_ELEMENTS) -> CanvasState:
    """Every row's next state from the decoder's logits [B, C, V] (fp32, scaled in place) of
    ``state.canvas_ids``, drawing with ``keys`` (the rows' own); ``keep_finished`` then restores
    the rows that had stopped, where they ran."""
    b, c, v = logits.shape
    scaled = scale_logits_(logits, temperatures(settings, state.num_steps))
    sampled, entropy = sample_and_entropy(scaled, draws, keys, chunk_elements)
    argmax_ids = scaled.argmax(dim=-1)
    accepted = accept_by_entropy(entropy, settings.entropy_bound)
    canvas_ids = renoise(sampled, accepted, draws.renoise_tokens(keys, c, v))
    num_repeats = count_repeats(state.argmax_ids, argmax_ids, state.num_repeats)
    finished = state.finished | stable_and_confident(num_repeats, entropy, settings)
    return CanvasState(canvas_ids, accepted, argmax_ids, scaled.to(embed_dtype), num_repeats,
                       state.num_steps + 1, finished)


def keep_finished(before: CanvasState, after: CanvasState) -> CanvasState:
    """``after`` with the rows that had stopped before the step set back to ``before`` (the
    reference runs them and throws the step away; the engine need not run them at all)."""
    done = before.finished
    sc = after.self_conditioning
    if before.self_conditioning is not None:  # else no row has stopped: nothing to keep
        sc = torch.where(done[:, None, None], before.self_conditioning, sc, out=sc)  # in place: no third [B, C, V]

    def keep(old: Tensor, new: Tensor) -> Tensor:
        return torch.where(done.view(-1, *[1] * (new.dim() - 1)), old, new)

    return CanvasState(keep(before.canvas_ids, after.canvas_ids), keep(before.accepted, after.accepted),
                       keep(before.argmax_ids, after.argmax_ids), sc, keep(before.num_repeats, after.num_repeats),
                       keep(before.num_steps, after.num_steps), after.finished | done)


def finish_canvas(canvas_ids: Tensor, finished: Tensor, settings: GenerationSettings) -> tuple[Tensor, Tensor]:
    """(the canvas as kept [B, C], the rows finished [B]): a row finishes at an EOS in its
    canvas; with a pad id, tokens after a row's first EOS and the canvases of rows finished
    before become pad."""
    if not settings.eos_token_ids:
        return canvas_ids, finished
    eos = torch.tensor(settings.eos_token_ids, device=canvas_ids.device)
    is_eos = torch.isin(canvas_ids, eos)
    now = finished | is_eos.any(dim=-1)
    if settings.pad_token_id is None:
        return canvas_ids, now
    after_eos = is_eos.cumsum(dim=-1) - is_eos.long() > 0  # strictly after the first EOS
    return canvas_ids.masked_fill(after_eos | finished[:, None], settings.pad_token_id), now


# -- the loop -------------------------------------------------------------------------------------
@dataclass
class Generation:
    token_ids: Tensor  # [B, canvases * C] the new tokens, pad after a row's first EOS
    # [B, canvases] denoising steps each row ran per canvas: with batch_invariant, exactly the decoder
    # forwards it was in (0 once it has finished); the reference also runs stopped rows, uncounted
    num_steps: Tensor


@dataclass
class LiveRows:
    """The generation's rows that the encoder cache holds: all of them, or (batch-invariant)
    those still generating, in order; ``padding``: each one's left padding, which its positions
    skip (None: the reference's positions, the batch's columns)."""
    index: Tensor  # [n] int64 into the generation's rows
    padding: Tensor | None  # [n] int64

    def positions(self, start: int, num: int) -> Tensor | None:
        """[n, num] RoPE positions of the columns start..start+num (None: the model's own)."""
        if self.padding is None:
            return None
        columns = torch.arange(start, start + num, device=self.padding.device)
        return (columns[None] - self.padding[:, None]).clamp_(min=0)  # a padding column: 0 (never attended to)

    def select(self, keep: Tensor) -> LiveRows:
        return LiveRows(self.index[keep], None if self.padding is None else self.padding[keep])


def denoise_canvas(model: DiffusionGemma, cache: EncoderCache, settings: GenerationSettings, draws: Draws,
                   live: LiveRows, canvas: int, chunk_elements: int = SAMPLING_CHUNK_ELEMENTS) -> tuple[Tensor, Tensor]:
    """One canvas's denoising loop against ``cache`` (the prompt and the canvases before), run as
    the reference runs it: every row in every forward, a stopped row's step thrown away.
    Returns (each row's argmax canvas [n, C], its steps [n])."""
    cfg = model.config
    positions = live.positions(cache.length, cfg.canvas_length)
    state = new_canvas(DrawKeys.at(live.index, canvas, 0), cfg.canvas_length, cfg.vocab_size, draws)
    for _ in range(settings.max_denoising_steps):
        logits = model.decode(state.canvas_ids, cache, state.self_conditioning, positions=positions)
        keys = DrawKeys.at(live.index, canvas, state.num_steps)
        step = denoise_step(state, logits, settings, draws, keys, model.embed_tokens.weight.dtype, chunk_elements)
        state = keep_finished(state, step)
        if bool(state.finished.all()):  # the one host read of a step
            break
    return state.argmax_ids, state.num_steps


def denoise_canvas_dropping(model: DiffusionGemma, cache: EncoderCache, settings: GenerationSettings,
                            draws: Draws, live: LiveRows, canvas: Tensor,
                            chunk_elements: int = SAMPLING_CHUNK_ELEMENTS,
                            observe: Observer | None = None) -> tuple[Tensor, Tensor]:
    """``denoise_canvas`` where a row that stops leaves the batch: the decoder runs the rows
    still denoising only. ``canvas`` [n]: each live row's canvas index (rows that joined later
    are at earlier canvases). Each time rows stop, the others' state and cache rows are gathered
    once (a copy of their self-conditioning, [b, C, V] in the embedding dtype, while the old
    one is freed). ``observe(canvas, rows, state)``: after each step, with the canvas index and
    the generation's index of each row that ran it, and their state after it."""
    cfg = model.config
    positions = live.positions(cache.length, cfg.canvas_length)
    state = new_canvas(DrawKeys.at(live.index, canvas, 0), cfg.canvas_length, cfg.vocab_size, draws)
    argmax_ids, num_steps = state.argmax_ids.clone(), state.num_steps.clone()
    active, active_cache = torch.arange(len(live.index), device=argmax_ids.device), cache  # rows of ``live``
    for _ in range(settings.max_denoising_steps):
        logits = model.decode(state.canvas_ids, active_cache, state.self_conditioning,
                              positions=None if positions is None else positions[active])
        keys = DrawKeys.at(live.index[active], canvas[active], state.num_steps)
        state = denoise_step(state, logits, settings, draws, keys, model.embed_tokens.weight.dtype, chunk_elements)
        if observe is not None:
            observe(canvas[active], live.index[active], state)
        argmax_ids.index_copy_(0, active, state.argmax_ids)
        num_steps.index_copy_(0, active, state.num_steps)
        if not bool(state.finished.any()):  # the one host read of a step
            continue
        going = (~state.finished).nonzero()[:, 0]
        if going.numel() == 0:
            break
        active, state = active[going], state.rows(going)
        active_cache = cache.rows(active)
    return argmax_ids, num_steps


def live_rows(prompt_ids: Tensor, attention_mask: Tensor | None, batch_invariant: bool) -> LiveRows:
    index = torch.arange(prompt_ids.shape[0], device=prompt_ids.device)
    if not batch_invariant:
        return LiveRows(index, None)
    if attention_mask is None:
        return LiveRows(index, torch.zeros_like(index))
    return LiveRows(index, (attention_mask.cumsum(dim=1) == 0).sum(dim=1))  # leading zeros


def check_prompt(prompt_ids: Tensor, attention_mask: Tensor | None, batch_invariant: bool = False) -> None:
    if prompt_ids.dim() != 2 or prompt_ids.shape[1] == 0 or prompt_ids.dtype != torch.long:
        raise UserError(f"prompt_ids must be a [batch, length] tensor of token ids (torch.long, length >= 1), "
                        f"got shape {tuple(prompt_ids.shape)} {prompt_ids.dtype}")
    if attention_mask is not None and attention_mask.shape != prompt_ids.shape:
        raise UserError(f"attention_mask has shape {tuple(attention_mask.shape)}, prompt_ids "
                        f"{tuple(prompt_ids.shape)}: they must match (1 = token, 0 = left padding)")
    if batch_invariant and attention_mask is not None:
        inside = ((attention_mask.cumsum(dim=1) > 0) & (attention_mask == 0)).any(dim=1).nonzero()
        if inside.numel():
            raise UserError(f"attention_mask row {inside[0, 0].item()} has padding after its first token: "
                            f"batch_invariant counts each row's positions from its first token, so pad on the "
                            f"left only")


def check_draws(draws: Draws, batch: int) -> None:
    if isinstance(draws, SeededDraws) and len(draws) != batch:
        raise UserError(f"SeededDraws has {len(draws)} seeds for {batch} prompts: give one seed per prompt")


# what ``generate(..., observe=)`` is called with after each denoising step: (the canvas index of
# each row that ran the step [n], their row indices in the generation [n], their ``CanvasState`` after it)
Observer = Callable[[Tensor, Tensor, "CanvasState"], None]


def left_pad(t: Tensor, width: int) -> Tensor:
    """K or V [B, H, n, D] with zero columns on the left up to ``width`` (itself when as wide)."""
    return t if t.shape[2] == width else torch.nn.functional.pad(t, (0, 0, width - t.shape[2], 0))


def padded_valid(cache: EncoderCache, length: int) -> Tensor:
    """``cache.key_valid`` [B, length]: its columns right-aligned, the added ones padding."""
    k = cache.keys[0]
    v = cache.key_valid if cache.key_valid is not None else torch.ones(k.shape[0], cache.length, dtype=torch.bool,
                                                                      device=k.device)
    return torch.nn.functional.pad(v, (length - cache.length, 0), value=False)


def merge_caches(old: EncoderCache, new: EncoderCache) -> tuple[EncoderCache, int, int]:
    """One cache of ``old``'s rows then ``new``'s, right-aligned (every row's last token in the
    last column; the shorter side's missing columns padding, masked): (the cache, the columns
    added on the left of ``old``'s rows, of ``new``'s)."""
    length = max(old.length, new.length)
    keys, values = [], []
    for ka, va, kb, vb in zip(old.keys, old.values, new.keys, new.values):
        width = max(ka.shape[2], kb.shape[2])
        keys.append(torch.cat([left_pad(ka, width), left_pad(kb, width)]))
        values.append(torch.cat([left_pad(va, width), left_pad(vb, width)]))
    key_valid = torch.cat([padded_valid(old, length), padded_valid(new, length)])
    return EncoderCache(keys, values, length, key_valid), length - old.length, length - new.length


def merge_rows(cache: EncoderCache, index: Tensor, grown: EncoderCache) -> tuple[EncoderCache, int, int]:
    """``cache`` with its rows ``index`` replaced by ``grown`` (the same rows, encoded further),
    rows in their order, right-aligned as ``merge_caches`` aligns them: (the cache, the columns
    added on the left of the other rows, of the grown ones)."""
    length = max(cache.length, grown.length)
    keys, values = [], []
    for ka, va, kb, vb in zip(cache.keys, cache.values, grown.keys, grown.values):
        width = max(ka.shape[2], kb.shape[2])
        k, v = left_pad(ka, width), left_pad(va, width)  # ``cache`` is replaced: written in place
        k[index], v[index] = left_pad(kb, width), left_pad(vb, width)
        keys.append(k)
        values.append(v)
    key_valid = padded_valid(cache, length)
    key_valid[index] = padded_valid(grown, length)
    return EncoderCache(keys, values, length, key_valid), length - cache.length, length - grown.length


@dataclass
class CanvasRow:
    """One row of a ``CanvasBatch``, on the host: the canvases it may run, what it kept of each
    (after ``finish_canvas``) and the denoising steps each took."""
    canvases: int
    token_ids: list[list[int]] = field(default_factory=list)
    num_steps: list[int] = field(default_factory=list)
    finished: bool = False  # an EOS ended it


class CanvasBatch:
    """A batch-invariant sampler run whose rows join and leave as it runs: by canvas
    (``run_canvas``: ``generate(..., batch_invariant=True)`` is one whose rows all join at the
    start) or by denoising step (``run_step``, what the server runs); a run takes one of the two
    throughout. ``add`` queues prompts; each ``run_canvas`` then encodes
    every continuing row's last canvas, encodes the queued prompts in one forward and merges their
    cache rows in (right-aligned: each row's left padding masked, its positions counted from its
    first token), denoises the next canvas of every live row (each at its own canvas index; a
    row that stops leaves the forwards) and returns the rows that left: at EOS (with a pad id;
    else a finished row runs on while another row has not finished, as the batch loop has it), or
    after its own number of canvases (``max_new_tokens``). The rows share ``settings`` but for
    ``max_new_tokens``; each draws by its own key, the generation index ``add`` gives it
    (``draws`` None: ``SeededDraws`` of the seeds ``add`` is given)."""

    def __init__(self, model: DiffusionGemma, settings: GenerationSettings, draws: Draws | None,
                 chunk_elements: int = SAMPLING_CHUNK_ELEMENTS, observe: Observer | None = None) -> None:
        self.model, self.settings, self.draws = model, settings, draws
        self.chunk_elements, self.observe = chunk_elements, observe
        self.rows: list[CanvasRow] = []  # every row added, by generation index
        self.pending: list[tuple[int, list[int]]] = []  # (generation index, prompt ids) waiting for the next canvas
        self.live: LiveRows | None = None
        self.cache: EncoderCache | None = None
        self.last: Tensor | None = None  # [n] the live rows' last kept canvas: encoded before the next
        self.finished: Tensor | None = None  # [n] bool: the live rows that have written EOS
        self.canvas: Tensor | None = None  # [n] int64: the live rows' next canvas index
        # ``run_step``: the live rows' current canvases, each at its own step (None: run_canvas's loop)
        self.state: CanvasState | None = None

    def __len__(self) -> int:
        """Rows live or queued."""
        return (0 if self.live is None else len(self.live.index)) + len(self.pending)

    def add(self, prompts: list[list[int]], max_new_tokens: list[int] | None = None,
            seeds: list[int] | None = None) -> list[int]:
        """Queue ``prompts`` (token ids) to join at the next canvas, each with its own
        ``max_new_tokens`` (default: the settings') and, with ``SeededDraws``, its seed (appended
        to the draws' seeds, which must hold one for each earlier row; without ``seeds`` the draws
        must already hold one for each new row too). Returns their generation indices."""
        canvas = self.model.config.canvas_length
        limits = max_new_tokens or [self.settings.max_new_tokens] * len(prompts)
        first = len(self.rows)
        if seeds is not None:
            if self.draws is None and first == 0:
                self.draws = SeededDraws(seeds)
            elif not isinstance(self.draws, SeededDraws):
                raise UserError("seeds need SeededDraws")
            elif len(self.draws) != first:
                raise UserError(f"the draws hold {len(self.draws)} seeds for {first} rows: give seeds with every add, "
                                f"or none and the draws' own")
            else:
                extra = torch.tensor(seeds, dtype=torch.int64, device=self.draws.seeds.device)
                self.draws.seeds = torch.cat([self.draws.seeds, extra])
        for ids, limit in zip(prompts, limits):
            self.rows.append(CanvasRow(dataclasses.replace(self.settings, max_new_tokens=limit).num_canvases(canvas)))
            self.pending.append((len(self.rows) - 1, list(ids)))
        return list(range(first, len(self.rows)))

    def admit(self) -> None:
        """The queued prompts into the cache, beside the live rows (see the class docstring)."""
        model, device = self.model, self.model.embed_tokens.weight.device
        index = torch.tensor([i for i, _ in self.pending], dtype=torch.int64, device=device)
        width = max(len(ids) for _, ids in self.pending)
        pad = model.config.pad_token_id or 0
        ids = torch.tensor([[pad] * (width - len(p)) + p for _, p in self.pending], device=device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for _, p in self.pending], device=device)
        self.pending = []
        joining = LiveRows(index, live_rows(ids, mask, batch_invariant=True).padding)
        cache = model.new_cache()
        model.encode(ids, cache, attention_mask=mask, positions=joining.positions(0, width))
        finished = torch.zeros(len(index), dtype=torch.bool, device=device)
        canvas = torch.zeros(len(index), dtype=torch.int64, device=device)
        if self.live is None:
            self.live, self.cache, self.finished, self.canvas = joining, cache, finished, canvas
            return
        self.cache, old_shift, new_shift = merge_caches(self.cache, cache)
        self.live = LiveRows(torch.cat([self.live.index, index]),
                             torch.cat([self.live.padding + old_shift, joining.padding + new_shift]))
        self.finished = torch.cat([self.finished, finished])
        self.canvas = torch.cat([self.canvas, canvas])
        self.last = None if self.last is None else torch.cat(
            [self.last, self.last.new_zeros(len(index), self.last.shape[1])])

    def run_canvas(self) -> list[int]:
        """The next canvas of every live row (joining the queued ones first); returns the
        generation indices of the rows that left after it (``rows[i]`` holds their canvases)."""
        model, canvas_length = self.model, self.model.config.canvas_length
        if self.live is not None:  # the continuing rows' last canvas, before any row joins (one forward)
            model.encode(self.last, self.cache, positions=self.live.positions(self.cache.length, canvas_length))
        if self.pending:
            self.admit()
        if self.live is None:
            return []
        ids, num_steps = denoise_canvas_dropping(model, self.cache, self.settings, self.draws, self.live,
                                                 self.canvas, self.chunk_elements, self.observe)
        ids, self.finished = finish_canvas(ids, self.finished, self.settings)
        rows, kept, steps = self.live.index.tolist(), ids.tolist(), num_steps.tolist()  # the canvas's one read back
        finished = self.finished.tolist()
        for i, row_ids, row_steps, f in zip(rows, kept, steps, finished):
            row = self.rows[i]
            row.token_ids.append(row_ids)
            row.num_steps.append(row_steps)
            row.finished = f
        everyone = all(finished)
        leaving = [k for k, i in enumerate(rows) if len(self.rows[i].token_ids) == self.rows[i].canvases
                   or (finished[k] and (self.settings.pad_token_id is not None or everyone))]
        self.last, self.canvas = ids, self.canvas + 1
        if leaving:
            self.drop(leaving)
        return [rows[k] for k in leaving]

    def drop(self, positions: list[int]) -> None:
        """The live rows at ``positions`` (in the live order) leave the batch."""
        out = set(positions)
        going = torch.tensor([k for k in range(len(self.live.index)) if k not in out], dtype=torch.int64,
                             device=self.live.index.device)
        if going.numel() == 0:
            self.live = self.cache = self.last = self.finished = self.canvas = self.state = None
            return
        self.live, self.cache = self.live.select(going), self.cache.rows(going)
        self.trim()
        self.finished, self.canvas = self.finished[going], self.canvas[going]
        self.last = None if self.last is None else self.last[going]
        self.state = None if self.state is None else self.state.rows(going)

    def trim(self) -> None:
        """Drop the cache's columns that are padding in every live row (a long row's that left, or
        a row that grew beside others: ``merge_rows`` widens by a canvas): the rows attend over
        the longest row's columns only. One host read."""
        columns = int(self.live.padding.min())
        if columns:
            self.cache, self.live = self.cache.trim(columns), LiveRows(self.live.index, self.live.padding - columns)

    def run_step(self) -> list[int]:
        """One denoising step of every live row, rows joining and leaving at any step (what the
        server runs; ``run_canvas`` runs a canvas of every row in step): first the rows whose
        canvas stopped at the step before keep it (``finish_canvas``), and those done leave,
        as ``run_canvas`` decides; the others encode it (their cache rows grow alone, merged back
        right-aligned: ``merge_rows``) and start their next canvas. Then the queued prompts join
        (``admit``), and one decoder forward runs every live row, each at its own canvas and step
        (a row at its canvas's first step without self-conditioning: its signal is masked).
        A row's draws are keyed by its own canvas and step, so it gets the tokens ``run_canvas``
        gives it, up to the kernels' rounding. Returns the generation indices of the rows that left."""
        left = self.end_canvases() if self.state is not None else []
        if self.pending:
            joining = len(self.pending)
            self.admit()
            fresh = self.fresh_canvases(torch.arange(len(self.live.index) - joining, len(self.live.index),
                                                     device=self.live.index.device))
            self.state = fresh if self.state is None else cat_states(self.state, fresh)
        if self.live is None:
            return left
        model, state = self.model, self.state
        started = state.num_steps > 0
        signal = None if state.self_conditioning is None else started
        logits = model.decode(state.canvas_ids, self.cache, state.self_conditioning, signal,
                              positions=self.live.positions(self.cache.length, model.config.canvas_length))
        keys = DrawKeys.at(self.live.index, self.canvas, state.num_steps)
        self.state = denoise_step(state, logits, self.settings, self.draws, keys, model.embed_tokens.weight.dtype,
                                  self.chunk_elements)
        if self.observe is not None:
            self.observe(self.canvas, self.live.index, self.state)
        return left

    def fresh_canvases(self, positions: Tensor) -> CanvasState:
        """New canvases for the live rows at ``positions``, at their canvas index."""
        return new_canvas(DrawKeys.at(self.live.index[positions], self.canvas[positions], 0),
                          self.model.config.canvas_length, self.model.config.vocab_size, self.draws)

    def end_canvases(self) -> list[int]:
        """``run_step``'s first part: the rows whose canvas stopped keep it, leave or go on to
        their next canvas; returns the generation indices of those that left."""
        state = self.state
        stopped = (state.finished | (state.num_steps >= self.settings.max_denoising_steps)).nonzero()[:, 0]
        if stopped.numel() == 0:  # the step's host read (with the one below when some stopped)
            return []
        ids, finished = finish_canvas(state.argmax_ids[stopped], self.finished[stopped], self.settings)
        self.finished[stopped] = finished
        positions, kept, steps = stopped.tolist(), ids.tolist(), state.num_steps[stopped].tolist()
        rows, everyone = self.live.index[stopped].tolist(), bool(self.finished.all())
        leaving, going_on = [], []
        for k, i, row_ids, row_steps, f in zip(positions, rows, kept, steps, finished.tolist()):
            row = self.rows[i]
            row.token_ids.append(row_ids)
            row.num_steps.append(row_steps)
            row.finished = f
            done = len(row.token_ids) == row.canvases or (f and (self.settings.pad_token_id is not None or everyone))
            (leaving if done else going_on).append(k)
        if going_on:  # their canvas into the cache, then their next canvas
            on = torch.tensor(going_on, dtype=torch.int64, device=stopped.device)
            grown = self.cache.rows(on)
            sub = self.live.select(on)
            canvas = ids[[positions.index(k) for k in going_on]]
            self.model.encode(canvas, grown, positions=sub.positions(grown.length, self.model.config.canvas_length))
            self.cache, shift, grown_shift = merge_rows(self.cache, on, grown)
            padding = self.live.padding + shift
            padding[on] = sub.padding + grown_shift
            self.live = LiveRows(self.live.index, padding)
            self.trim()
            self.canvas[on] += 1
            self.state = set_rows(self.state, on, self.fresh_canvases(on))
        out = [rows[positions.index(k)] for k in leaving]
        if leaving:
            self.drop(leaving)
        return out

    def leave(self, indices: list[int]) -> None:
        """Rows whose requests went away leave before the next canvas, or step (by generation index)."""
        gone = set(indices)
        self.pending = [(i, ids) for i, ids in self.pending if i not in gone]
        if self.live is not None:
            self.drop([k for k, i in enumerate(self.live.index.tolist()) if i in gone])


@torch.no_grad()
def generate(model: DiffusionGemma, prompt_ids: Tensor, settings: GenerationSettings | None = None,
             draws: Draws | None = None, attention_mask: Tensor | None = None,
             chunk_elements: int = SAMPLING_CHUNK_ELEMENTS, batch_invariant: bool = False,
             observe: Observer | None = None) -> Generation:
    """Sample continuations of ``prompt_ids`` [B, T] (left-padded, ``attention_mask`` 1 = token)
    with a ``DiffusionGemma``: canvas after canvas, each denoised then encoded into the cache.

    ``batch_invariant``: each row's positions count from its first token (the reference counts
    the batch's columns, padding included), and a row leaves the forwards once it stops (early
    stop, for the rest of the canvas; EOS with a pad id, for good: its later canvases are pad).
    With ``SeededDraws`` a row's positions, draws and stops then depend on its prompt and seed
    alone, and its tokens too up to the kernels' rounding, which self-conditioning amplifies
    (docs/models/diffusion-gemma.md#batch-invariance). Off (the default): transformers' layout
    and work.
    ``observe``: called after every denoising step (``Observer``; batch-invariant runs only, where
    each step's rows are exactly those that ran it): what ``record_steps`` traces are made from."""
    check_prompt(prompt_ids, attention_mask, batch_invariant)
    if observe is not None and not batch_invariant:
        raise UserError("observe needs batch_invariant=True: the reference's layout runs stopped rows and "
                        "throws their steps away")
    settings = settings or GenerationSettings()
    draws = draws or TorchDraws()
    batch, canvas_length = prompt_ids.shape[0], model.config.canvas_length
    check_draws(draws, batch)
    if batch_invariant:
        return generate_batch_invariant(model, prompt_ids, settings, draws, attention_mask, chunk_elements, observe)
    live = live_rows(prompt_ids, attention_mask, batch_invariant)
    cache = model.new_cache()
    model.encode(prompt_ids, cache, attention_mask=attention_mask, positions=live.positions(0, prompt_ids.shape[1]))
    finished = torch.zeros(batch, dtype=torch.bool, device=prompt_ids.device)
    canvases, steps = [], []
    for i in range(settings.num_canvases(canvas_length)):
        if i:
            model.encode(canvases[-1], cache, positions=live.positions(cache.length, canvas_length))
        ids, num_steps = denoise_canvas(model, cache, settings, draws, live, i, chunk_elements)
        ids, finished = finish_canvas(ids, finished, settings)
        canvases.append(ids)
        steps.append(num_steps)
        if bool(finished.all()):
            break
    return Generation(torch.cat(canvases, dim=1), torch.stack(steps, dim=1))


def generate_batch_invariant(model: DiffusionGemma, prompt_ids: Tensor, settings: GenerationSettings, draws: Draws,
                             attention_mask: Tensor | None, chunk_elements: int,
                             observe: Observer | None) -> Generation:
    """``generate(..., batch_invariant=True)``: a ``CanvasBatch`` whose rows all join at the start."""
    run = CanvasBatch(model, settings, draws, chunk_elements, observe)
    mask = attention_mask.tolist() if attention_mask is not None else None  # the prompts' one read
    run.add([row if mask is None else [t for t, m in zip(row, mask[i]) if m] for i, row in enumerate(prompt_ids.tolist())])
    while len(run):
        run.run_canvas()
    canvas = model.config.canvas_length
    count = max(len(r.token_ids) for r in run.rows)
    pad = settings.pad_token_id or 0  # a row leaves early only at EOS with a pad id: its later canvases are pad
    ids = [[t for c in r.token_ids for t in c] + [pad] * (canvas * (count - len(r.token_ids))) for r in run.rows]
    steps = [r.num_steps + [0] * (count - len(r.num_steps)) for r in run.rows]
    device = prompt_ids.device
    return Generation(torch.tensor(ids, dtype=torch.long, device=device),
                      torch.tensor(steps, dtype=torch.long, device=device))
