"""The places where the sampler and the scorer disagreed outright (issue 23, point 5), one test each:
the checkpoint's generation_config shaping `generate`, dropout in the forwards that feed the ratio,
the shared-prefix layout of an empty completion, an unclamped log-ratio, and a reference model
scored otherwise than the policy."""

import pytest
import torch
from accelerate import Accelerator

from dapo_train.algo import policy_loss
from dapo_train.config.load import load_config
from dapo_train.model.layout import collate
from dapo_train.model.loading import load_policy
from dapo_train.model.scoring import score_tokens
from dapo_train.rollout import Completion
from dapo_train.rollout.decoding import BehaviourRecorder
from dapo_train.rollout.sampling import SamplingSettings
from dapo_train.run.logs import read_metrics
from dapo_train.task.prompts import Prompt
from dapo_train.train import loop
from dapo_train.train.records import Group, StepBatch
from dapo_train.train.update.old_policy import record_old_logprobs
from dapo_train.train.update.passes import Learner, update

from conftest import EOS2_ID, EOS_ID, PROMPTS, make_engine, make_random_model


def _poison(model, greedy: list[Completion]) -> None:
    """generation_config fields of a checkpoint that, were they to reach generate, would change what it
    samples: forbid the greedy first tokens, make every row run to the budget, forbid repeats."""
    config = model.generation_config
    config.suppress_tokens = [int(greedy[0].completion_ids[0])]
    config.bad_words_ids = [[int(greedy[1].completion_ids[0])]]
    config.begin_suppress_tokens = [int(greedy[2].completion_ids[0])]
    config.min_new_tokens = 10
    config.no_repeat_ngram_size = 1
    config.min_p = 0.9
    config.typical_p = 0.2
    config.epsilon_cutoff = 0.1


@pytest.mark.parametrize("kind", ["generate", "static-cache"])
def test_generate_samples_from_the_settings_alone_not_the_checkpoints_generation_config(kind, id_tokenizer,
                                                                                      monkeypatch):
    """The decode loop reads nothing from generation_config but the stop ids: under a checkpoint whose
    generation_config would suppress tokens, force length and forbid repeats, greedy generate yields
    the loop's completions exactly, and sampling builds no logits processor beyond the settings'."""
    model = make_random_model(seed=2)
    greedy = SamplingSettings(max_new_tokens=10, do_sample=False)
    clean = make_engine("loop", model, id_tokenizer).generate(PROMPTS, greedy, group_size=1)
    _poison(model, clean)
    got = make_engine(kind, model, id_tokenizer).generate(PROMPTS, greedy, group_size=1)
    assert [c.completion_ids.tolist() for c in got] == [c.completion_ids.tolist() for c in clean]
    for ours, theirs in zip(got, clean):
        torch.testing.assert_close(ours.behaviour_logprobs, theirs.behaviour_logprobs, atol=1e-4, rtol=0)

    built = []
    real = model._get_logits_processor
    monkeypatch.setattr(model, "_get_logits_processor", lambda *a, **k: built.append(real(*a, **k)) or built[-1])
    torch.manual_seed(0)
    make_engine(kind, model, id_tokenizer).generate(PROMPTS, SamplingSettings(6, temperature=0.9, top_k=8), 2)
    assert built and all(isinstance(processor, BehaviourRecorder) for processor in built[-1]), built[-1]


def _group(prompt_ids: torch.Tensor, seed: int) -> Group:
    g = torch.Generator().manual_seed(seed)
    completions = [Completion(prompt_ids, torch.cat([torch.randint(3, 60, (5 + j,), generator=g),
                                                     torch.tensor([EOS_ID])]), False, "") for j in range(4)]
    return Group(prompt=Prompt("train:0", "q", "1", "p", tuple(prompt_ids.tolist())), completions=completions,
                 rewards=torch.zeros(4), correct=torch.zeros(4, dtype=torch.bool),
                 advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]))


def _approx_kl_at_the_first_update(folder, *overrides: str) -> float:
    """Old log-probs recorded, then one update at the same weights: its ratio is exactly 1 unless the two
    forwards differ."""
    cfg = load_config(None, [f"model.name_or_path={folder}", "train.prompts_per_step=1", "rollout.group_size=4",
                             "train.micro_batch_size=4", "train.updates_per_step=1", *overrides])
    torch.manual_seed(0)
    model = load_policy(cfg, torch.device("cpu"))
    learner = Learner.build(cfg, model, torch.optim.AdamW(model.parameters(), lr=1e-3),
                                    Accelerator(cpu=True), EOS2_ID)
    groups = [_group(torch.tensor([3, 4, 5, 6]), seed=1)]
    record_old_logprobs(model, groups, learner.batching, learner.scorer)
    metrics = update(learner, StepBatch(groups, [1], {}), cfg)
    return metrics["approx_kl"]


@pytest.fixture
def dropout_checkpoint(tmp_path):
    """A checkpoint whose config asks for attention dropout 0.3."""
    model = make_random_model(seed=4)
    model.config.attention_dropout = 0.3
    model.save_pretrained(tmp_path / "dropout")
    return tmp_path / "dropout"


def test_dropout_is_off_in_the_forwards_that_feed_the_ratio(dropout_checkpoint):
    """attention_dropout 0.3 in the checkpoint: the old-log-prob pass and the update's forward are still
    the same function of the weights, so the first update's ratio is exactly 1."""
    assert _approx_kl_at_the_first_update(dropout_checkpoint) == 0.0


def test_keep_dropout_leaves_the_checkpoints_dropout_in_the_ratio(dropout_checkpoint):
    """model.keep_dropout=true: the two forwards draw different dropout masks, the ratio leaves 1."""
    assert _approx_kl_at_the_first_update(dropout_checkpoint, "model.keep_dropout=true") != 0.0


def test_the_shared_prefix_layout_takes_an_empty_completion(random_model):
    """A plugin engine may return a completion with no token: the shared layout gives the other rows
    the log-probs of one row per completion, and the empty one nothing."""
    prompt = torch.tensor([3, 4, 5])
    completions = [torch.tensor([6, 7, EOS_ID]), torch.tensor([], dtype=torch.long), torch.tensor([8, EOS_ID])]
    shared = collate([prompt] * 3, completions, EOS2_ID, share_prefix=True)
    plain = collate([prompt] * 3, completions, EOS2_ID, share_prefix=False)
    assert shared.shared_prefix and shared.completion_mask[1].sum() == 0
    with torch.no_grad():
        ours, _ = score_tokens(random_model, shared, temperature=1.0, chunk_mib=1.0)
        theirs, _ = score_tokens(random_model, plain, temperature=1.0, chunk_mib=1.0)
    mask = plain.completion_mask.bool()
    torch.testing.assert_close(ours[mask], theirs[mask], atol=1e-5, rtol=0)


def test_the_log_ratio_is_clamped_before_exp():
    """log r = 25 on a token with A = -1: the ratio is clamped at e^20 (as verl does), so that token's
    loss is e^20 and it gets no gradient (beyond the clamp); the other token (r = 1) keeps its own. At
    log r = 100 exp() would overflow to inf: the loss stays finite."""
    logprobs = torch.tensor([[-5.0, -1.0]], requires_grad=True)
    old = torch.tensor([[-30.0, -1.0]])
    loss, metrics = policy_loss(logprobs, old, torch.tensor([-1.0]), torch.ones(1, 2), 0.2, 0.28)
    # Eq. 10 with A = -1: -min(-r, -clip(r)) = max(r, clip(r)) = r, per token; (e^20 + 1) / 2 tokens.
    assert float(loss.detach()) == pytest.approx((torch.e ** 20 + 1.0) / 2, rel=1e-6)
    loss.backward()
    assert logprobs.grad.tolist() == [[0.0, 0.5]]  # d(r / 2)/d logp = r / 2 = 0.5 for the unclamped token
    assert metrics["ratio_mean"] == pytest.approx((torch.e ** 20 + 1.0) / 2, rel=1e-6)
    far, _ = policy_loss(torch.tensor([[70.0]]), torch.tensor([[-30.0]]), torch.tensor([-1.0]), torch.ones(1, 1),
                         0.2, 0.28)
    assert torch.isfinite(far) and float(far) == pytest.approx(torch.e ** 20, rel=1e-6)


@pytest.fixture
def fresh_accelerator_state():
    """accelerate keeps one mixed-precision setting per process: let this test's run choose bf16, and put
    the state back for the tests after it."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def test_the_reference_scores_like_the_policy_under_autocast(tmp_path, fresh_accelerator_state):
    """dapo.beta > 0 without LoRA under bf16 autocast (on CPU here, as on CUDA): at the first update the
    policy IS the reference, so the k3 KL between their forwards must be 0."""
    cfg = load_config(None, [
        "rollout.group_size=4", "rollout.max_new_tokens=24", "train.prompts_per_step=2", "train.micro_batch_size=8",
        "train.updates_per_step=1", "train.max_steps=1", "eval.every_steps=0", "dapo.dynamic_sampling=false",
        "dapo.beta=0.1", "train.mixed_precision=bf16", "rewards=[{name: accuracy}]", "logging.progress_bar=false",
        f"output_dir={tmp_path / 'run'}",
    ])
    rows = read_metrics(loop.train(cfg))
    assert rows[0]["kl"] == 0.0

