"""The replay contract: a step whose commit fails at one row of a forward group leaves every later
row as it was before the step, so replaying those rows alone (as the server does) gives each
sequence exactly the tokens and stats of a run without the failure, for every base decoder and
every strategy."""
import pytest

from dllm_engine import LLM, SamplingParams
from dllm_engine.engine.sequence import Sequence
from dllm_engine.methods import DECODERS, STRATEGIES
from fixtures import write_checkpoint

PROMPTS = [[42, 13, 14, 15, 16, 17, 18], [20, 21, 22], [30, 31, 32, 33, 34], [50, 51, 52, 53]]
FAIL_ROW = 1  # the second sequence to commit in the failing step raises; the rows after it are replayed
# every option a strategy reads, set so that each one acts on the random models: FOCUS evicts
# (one commit a step at threshold 0.9), adaptive length cuts (token 25 is often predicted)
OPTIONS = dict(max_new_tokens=24, block_length=8, threshold=0.9, stop_at_eos=False, stop_token_ids=[25],
               eos_threshold=0.2, min_length=4)


def methods() -> list[str]:
    """Each base decoder alone and each strategy on each base it runs on."""
    out = list(DECODERS)
    out += [f"{base.name}+{name}" for name, spec in STRATEGIES.items() for base in spec.bases]
    return out


@pytest.fixture(scope="module")
def llms(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {mt: LLM(write_checkpoint(root / mt, mt)) for mt in ("llada", "sdar")}


def progress(seq: Sequence) -> tuple[int, int, bool]:
    return seq.block_idx, seq.step, seq.finished


def run(llm: LLM, params: SamplingParams, fail_step: int | None = None) -> dict[int, Sequence]:
    """Decode PROMPTS on the engine, by prompt index. ``fail_step``: at that engine step the
    commit of the ``FAIL_ROW``-th sequence to commit raises once; then, as the server's
    recovery does, that sequence is dropped and every sequence the step did not advance is
    replayed alone."""
    engine = llm.engine
    seqs = {i: llm.make_sequence(p, params) for i, p in enumerate(PROMPTS)}
    for seq in seqs.values():
        engine.add(seq)
    commits, original = [], Sequence.commit

    def flaky(self, *args, **kwargs):
        commits.append(self.seq_id)
        if len(commits) == FAIL_ROW + 1:
            raise RuntimeError("injected commit failure")
        return original(self, *args, **kwargs)

    for step in range(200):
        if not engine.has_work():
            return seqs
        engine.admit()
        before = {s.seq_id: progress(s) for s in engine.running}
        Sequence.commit = flaky if step == fail_step else original
        try:
            engine.step()
        except RuntimeError as e:
            assert "injected" in str(e)
            recover(engine, before)
        finally:
            Sequence.commit = original
    raise AssertionError("the engine did not finish")


def recover(engine, before: dict) -> None:
    """Drop the sequence whose commit raised; replay alone the ones the step did not advance."""
    failed = {s.seq_id for s in engine.running if s.step_error is not None}
    assert len(failed) == 1
    engine.abort(failed)
    for seq in engine.running:
        if progress(seq) == before[seq.seq_id]:
            engine.step_alone(seq)
    engine.release_finished()


def record(seq: Sequence) -> tuple:
    """What a run gives a sequence: tokens, stats, canvas length, the cuts adaptive length made
    and the counts the FOCUS probe gathered."""
    stats, state = seq.stats, seq.strategy_state
    return (seq.output_ids(), stats.nfe, stats.processed_tokens, stats.decoded_tokens, stats.prefill_tokens,
            seq.canvas_len, state.get("adaptive-length", {}).get("cuts"), state.get("focus-probe"))


FAST = {("dual-cache+early-skip", 3), ("block+focus", 3)}  # the fast tier's share of the matrix


@pytest.mark.parametrize("method,fail_step", [
    pytest.param(m, step, marks=() if (m, step) in FAST else pytest.mark.slow)
    for m in methods() for step in (0, 3)])
def test_a_failed_commit_mid_group_replays_exactly(llms, method, fail_step):
    llm = llms["sdar" if method.startswith("block") else "llada"]
    params = SamplingParams(method=method, **OPTIONS)
    clean = run(llm, params)
    failed = run(llm, params, fail_step)
    dropped = [i for i, seq in failed.items() if not seq.finished]
    assert len(dropped) == 1  # the sequence whose own commit raised
    for i in failed.keys() - set(dropped):
        assert record(failed[i]) == record(clean[i]), f"prompt {i}"
