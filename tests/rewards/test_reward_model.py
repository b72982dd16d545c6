"""The reward model (rewards/model.py) against a small sequence classifier with known weights: its
values are those of a plain forward of the base model and the score head at each text's last token,
whatever the batch; chat and plain formats read what they say; long texts lose their first tokens;
normalize; the weights are frozen and load only when the run starts; bad folders and args fail when
the config is read."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch

from dapo_train.config.schema import RewardSpec
from dapo_train.errors import ConfigError
from dapo_train.rewards import REWARDS, build_rewards, score
from dapo_train.rewards.catalogue import reward_lines
from dapo_train.task.locations import TINY_MODEL_DIR

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
QUESTIONS = ["小明有 3 个苹果，又买了 4 个。他有几个？", "一共几元？", "7 × 8 = ?"]
COMPLETIONS = [
    "<think>\n3 + 4 = 7\n</think>\n<answer>\n7\n</answer>", "<answer>\n9\n</answer>", "56",
    "<think>\n一共：7 × 8 = 56\n</think>\n<answer>\n56\n</answer>", "", "<think>\n\n</think>", "x" * 40, "12",
    "<answer>\n3\n</answer>",
]  # 9 completions of different lengths: batches of 7 pad and split them
N = len(COMPLETIONS)


def _classifier(folder, vocab_size: int = 553, num_labels: int = 1, causal: bool = False):
    """A 2-layer Qwen2 sequence classifier (seed 0) with the tiny model's tokenizer, saved in `folder`."""
    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM, Qwen2ForSequenceClassification

    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         num_labels=num_labels,
                         pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id < vocab_size else None)
    torch.manual_seed(0)
    model = (Qwen2ForCausalLM if causal else Qwen2ForSequenceClassification)(config).float().eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_MODEL_DIR / name, folder / name)
    return model, tokenizer


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    folder = tmp_path_factory.mktemp("classifier")
    model, tokenizer = _classifier(folder)
    return folder, model, tokenizer


def _rows(n: int = N) -> dict:
    questions = [QUESTIONS[i % len(QUESTIONS)] for i in range(n)]
    return {"completions": COMPLETIONS[:n], "answers": ["7"] * n,
            "prompts": [f"<|im_start|>system\n你好<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
                        "<|im_start|>assistant\n" for q in questions],
            "questions": questions}


def _scores(folder, weight: float = 1.0, **args):
    reward_set = build_rewards([RewardSpec("reward_model", weight, {"path": str(folder), **args})],
                               max_new_tokens=96).load(torch.device("cpu"))
    rows = _rows()
    return score(reward_set, rows["completions"], rows["answers"], prompts=rows["prompts"],
                 questions=rows["questions"], lengths=[1] * N)


def _plain_forward(model, ids: list[int]) -> float:
    """The score head on the base model's last hidden state of the whole text, alone in its batch: no
    padding and none of the classifier's pooling."""
    with torch.no_grad():
        hidden = model.model(input_ids=torch.tensor([ids])).last_hidden_state[0, -1]  # (hidden,)
        return float(model.score(hidden)[0])


def _chat(question: str, completion: str) -> str:
    """The tiny chat template (chat_template.jinja) written out by hand: a user and an assistant turn."""
    return f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n{completion}<|im_end|>\n"


def _expected(model, tokenizer, texts: list[str], keep: int | None = None) -> list[float]:
    ids = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    return [_plain_forward(model, row if keep is None else row[-keep:]) for row in ids]


def test_values_are_a_plain_forward_of_each_text_and_enter_the_total_with_their_weight(classifier):
    folder, model, tokenizer = classifier
    rows = _rows()
    expected = _expected(model, tokenizer, [_chat(q, c) for q, c in zip(rows["questions"], rows["completions"])])
    scores = _scores(folder, weight=0.5, batch_size=7)
    assert scores.per_reward["reward_model"] == pytest.approx(expected, abs=1e-5)
    assert scores.total == pytest.approx([0.5 * value for value in expected], abs=1e-5)
    assert len({round(v, 4) for v in expected}) == N  # the texts score apart: the test can tell them apart


def test_batch_size_1_and_7_give_the_same_values(classifier):
    folder = classifier[0]
    one, seven = _scores(folder, batch_size=1), _scores(folder, batch_size=7)
    assert one.per_reward["reward_model"] == pytest.approx(seven.per_reward["reward_model"], abs=1e-6)


def test_a_batch_out_of_memory_is_scored_again_in_halves_and_one_text_that_does_not_fit_ends_the_run(
        classifier, monkeypatch, caplog):
    """A scoring batch of more than 2 texts fails (a fault as a card raises it: faults.py): the 7 are scored 3,
    then 1 at a time (7 // 2 = 3 fails again, 3 // 2 = 1), the same values as batch_size 1, one line each halving;
    a fault at any size leaves one text that does not fit alone: DoesNotFit, one line naming what cuts it."""
    from dapo_train.errors import DoesNotFit
    from dapo_train.faults import REWARD_ROWS

    folder = classifier[0]
    one = _scores(folder, batch_size=1)
    monkeypatch.setenv(REWARD_ROWS, "2")
    with caplog.at_level(logging.WARNING, logger="dapo_train"):
        halved = _scores(folder, batch_size=7)
    assert halved.per_reward["reward_model"] == pytest.approx(one.per_reward["reward_model"], abs=1e-6)
    said = [r.getMessage() for r in caplog.records if "out of memory scoring" in r.getMessage()]
    assert len(said) == 2 and "scored again 3 at a time" in said[0] and "scored again 1 at a time" in said[1]
    monkeypatch.setenv(REWARD_ROWS, "0")
    with pytest.raises(DoesNotFit, match="one text alone .* does not fit the card; what cuts its memory"):
        _scores(folder, batch_size=7)


def test_the_score_is_read_at_the_last_real_token_when_the_template_ends_with_the_pad_id(classifier, tmp_path):
    """A tokenizer without a pad token pads with its EOS; a chat template that ends the assistant turn with
    that EOS (no newline after it) makes the text's last token the pad id. transformers' pooling (the
    rightmost token that is not the pad id) would read the score one token early; the reward reads it at the
    last attention-mask position, so each text scores as a plain forward of it alone, at batch 1 and 7."""
    folder = tmp_path / "eos-ends"
    shutil.copytree(classifier[0], folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    tokenizer_config["pad_token"] = None  # absent, Qwen2Tokenizer would default it to <|endoftext|>
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    template = (folder / "chat_template.jinja").read_text()
    (folder / "chat_template.jinja").write_text(template.replace("'<|im_end|>\\n'", "'<|im_end|>'"))
    model, tokenizer = classifier[1], classifier[2]
    rows = _rows()
    texts = [f"<|im_start|>user\n{q}<|im_end|><|im_start|>assistant\n{c}<|im_end|>"
             for q, c in zip(rows["questions"], rows["completions"])]
    expected = _expected(model, tokenizer, texts)
    early = [_plain_forward(model, tokenizer(text, add_special_tokens=False)["input_ids"][:-1]) for text in texts]
    assert all(abs(a - b) > 1e-3 for a, b in zip(expected, early))  # one token early scores otherwise
    for batch_size in (1, 7):
        assert _scores(folder, batch_size=batch_size).per_reward["reward_model"] == pytest.approx(expected, abs=1e-5)


def test_an_encoder_classifier_keeps_its_own_pooling(tmp_path):
    """A BERT-style classifier scores its first token's pooled state (no position axis at the head): the reward
    is its own logit of each text alone, not a read at the last token."""
    from transformers import AutoTokenizer, BertConfig, BertForSequenceClassification

    folder = tmp_path / "encoder"
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=553, hidden_size=32, intermediate_size=64,
                                                     num_hidden_layers=2, num_attention_heads=4,
                                                     max_position_embeddings=256, num_labels=1)).eval()
    model.save_pretrained(folder)
    for name in TOKENIZER_FILES:
        shutil.copy(TINY_MODEL_DIR / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(TINY_MODEL_DIR)
    rows = _rows()
    with torch.no_grad():
        expected = [float(model(input_ids=torch.tensor([tokenizer(p + c)["input_ids"]])).logits[0, 0])
                    for p, c in zip(rows["prompts"], rows["completions"])]
    assert _scores(folder, format="plain", batch_size=7).per_reward["reward_model"] == pytest.approx(expected, abs=1e-5)


def test_plain_reads_the_prompt_text_then_the_completion(classifier):
    folder, model, tokenizer = classifier
    rows = _rows()
    expected = _expected(model, tokenizer, [p + c for p, c in zip(rows["prompts"], rows["completions"])])
    plain = _scores(folder, format="plain").per_reward["reward_model"]
    chat = _scores(folder, format="chat").per_reward["reward_model"]
    assert plain == pytest.approx(expected, abs=1e-5)
    assert chat == pytest.approx(_scores(folder).per_reward["reward_model"])  # auto: the tokenizer has a template
    assert all(abs(a - b) > 1e-4 for a, b in zip(plain, chat))


def test_a_long_text_keeps_its_last_tokens_and_the_cut_is_counted(classifier, caplog):
    folder, model, tokenizer = classifier
    rows = _rows()
    texts = [_chat(q, c) for q, c in zip(rows["questions"], rows["completions"])]
    lengths = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in texts]
    keep = sorted(lengths)[N // 2]  # about half the texts are longer
    with caplog.at_level(logging.WARNING, logger="dapo_train.rewards.model"):
        values = _scores(folder, max_tokens=keep, batch_size=4).per_reward["reward_model"]
    assert values == pytest.approx(_expected(model, tokenizer, texts, keep=keep), abs=1e-5)
    cut = sum(length > keep for length in lengths)
    assert 0 < cut < N and f"{cut} of {N} texts were longer than max_tokens {keep}" in caplog.text
    # Not the first tokens: a cut from the right (losing the completion's end) scores otherwise.
    heads = [_plain_forward(model, tokenizer(text, add_special_tokens=False)["input_ids"][:keep]) for text in texts]
    assert all(abs(value - head) > 1e-4 for value, head, n in zip(values, heads, lengths) if n > keep)


def test_sigmoid_of_the_shifted_and_scaled_logit(classifier):
    folder = classifier[0]
    logits = torch.tensor(_scores(folder).per_reward["reward_model"])
    squashed = _scores(folder, normalize="sigmoid", shift=0.1, scale=3.0).per_reward["reward_model"]
    assert squashed == pytest.approx(torch.sigmoid((logits - 0.1) * 3.0).tolist(), abs=1e-6)


def test_tokenizer_path_and_dtype_are_read(classifier, tmp_path):
    """A folder without a tokenizer scores as the one with it once tokenizer_path names one; bfloat16
    weights give values near the float32 ones, not the same."""
    folder = classifier[0]
    bare = tmp_path / "bare"
    shutil.copytree(folder, bare, ignore=shutil.ignore_patterns(*TOKENIZER_FILES))
    with pytest.raises(ConfigError, match="holds no tokenizer"):
        _scores(bare)
    full = _scores(folder).per_reward["reward_model"]
    assert _scores(bare, tokenizer_path=str(folder)).per_reward["reward_model"] == pytest.approx(full, abs=1e-6)
    half = _scores(folder, dtype="bfloat16").per_reward["reward_model"]
    assert half == pytest.approx(full, abs=0.05) and half != pytest.approx(full, abs=1e-6)


def test_the_weights_load_once_when_the_set_is_loaded_and_stay_frozen(classifier, monkeypatch):
    from transformers import AutoModelForSequenceClassification

    loads = []
    original = AutoModelForSequenceClassification.from_pretrained
    monkeypatch.setattr(AutoModelForSequenceClassification, "from_pretrained",
                        lambda *a, **k: loads.append(a[0]) or original(*a, **k))
    reward_set = build_rewards([RewardSpec("reward_model", 1.0, {"path": str(classifier[0])})], max_new_tokens=96)
    assert loads == []  # the config's check reads config.json and the tokenizer only
    loaded = reward_set.load(torch.device("cpu"))
    assert len(loads) == 1 and loaded.load(torch.device("cpu")) is not None and len(loads) == 1  # loaded once
    model = loaded.rewards[0].fn.model
    assert not model.training and not any(p.requires_grad for p in model.parameters())
    rows = _rows(3)
    score(loaded, rows["completions"], rows["answers"], questions=rows["questions"])
    assert loaded.rewards[0].fn.texts_scored == 3 and len(loads) == 1


def test_the_catalogue_lists_the_args_with_their_defaults():
    assert "reward_model" in REWARDS and REWARDS["reward_model"].load is not None
    line = next(line for line in reward_lines() if line.startswith("  reward_model:"))
    assert line.endswith("args: path = required, tokenizer_path = null, format = 'auto', max_tokens = 0, "
                         "batch_size = 16, dtype = 'auto', normalize = 'none', scale = 1.0, shift = 0.0")


def _damage(kind: str):
    """Folder makers for the refusals: each writes a model folder that is wrong in one way."""
    def make(folder):
        if kind == "causal-lm":
            _classifier(folder, causal=True)
        elif kind == "two-labels":
            _classifier(folder, num_labels=2)
        elif kind == "small-vocabulary":
            _classifier(folder, vocab_size=100)
        elif kind == "tokenizer-damaged":
            _classifier(folder)
            (folder / "tokenizer.json").write_text("{not json")
        elif kind == "no-tokenizer":
            _classifier(folder)
            for name in ("tokenizer.json", "tokenizer_config.json"):
                (folder / name).unlink()
        elif kind == "no-chat-template":
            _classifier(folder)
            (folder / "chat_template.jinja").unlink()
        elif kind == "empty":
            pass
    return make


REFUSALS = [  # folder kind, args, what the one line says
    ("empty", {}, r"path .* is not a model folder \(no config.json"),
    ("causal-lm", {}, r"is not a sequence classifier: its config.json names \['Qwen2ForCausalLM'\]"),
    ("two-labels", {}, r"has num_labels 2; a reward model gives one score"),
    ("small-vocabulary", {}, r"the tokenizer has 553 tokens but the model's embedding 100 rows"),
    ("tokenizer-damaged", {}, r"could not load the tokenizer from"),
    ("no-tokenizer", {}, r"holds no tokenizer \(none of tokenizer.json, tokenizer_config.json"),
    ("no-chat-template", {"format": "chat"}, r"format chat: the tokenizer of .* has no chat template"),
    ("good", {"bogus": 1}, r"rewards.0.args.*unexpected keyword argument 'bogus'"),
    ("good", {"normalize": "cube"}, r"normalize: got 'cube'; allowed: none, sigmoid"),
    ("good", {"shift": 1.0}, r"scale and shift act only inside normalize: sigmoid"),
    ("good", {"batch_size": 0}, r"batch_size must be an integer >= 1"),
    ("good", {"max_tokens": 1000}, r"max_tokens 1000 is more than the model's 256 positions"),
    ("good", {"questions": ["q"]}, r"rewards.0.args.*multiple values for keyword argument 'questions'"),
]


@pytest.mark.parametrize("kind, args, message", REFUSALS, ids=[f"{k}-{'-'.join(a) or 'x'}" for k, a, _ in REFUSALS])
def test_a_bad_reward_model_is_one_config_error_when_the_config_is_read(classifier, tmp_path, kind, args, message):
    folder = classifier[0] if kind == "good" else tmp_path / kind
    if kind != "good":
        folder.mkdir()
        _damage(kind)(folder)
    with pytest.raises(ConfigError, match=message) as refusal:
        build_rewards([RewardSpec("reward_model", 1.0, {"path": str(folder), **args})], max_new_tokens=96)
    assert "\n" not in str(refusal.value) and str(refusal.value).startswith("config key 'rewards.0.args': ")


def test_a_missing_path_and_an_unknown_builtin_name_the_reward(tmp_path):
    for path, message in ((tmp_path / "nope", "path: folder not found"),
                          ("builtin:tiny-verifer", "path: no shipped 'builtin:tiny-verifer'")):
        with pytest.raises(ConfigError, match=message):
            build_rewards([RewardSpec("reward_model", 1.0, {"path": str(path)})], max_new_tokens=96)
    with pytest.raises(ConfigError, match="needs path"):
        build_rewards([RewardSpec("reward_model", 1.0, {"path": ""})], max_new_tokens=96)
    config = json.loads((TINY_MODEL_DIR / "config.json").read_text())
    assert config["architectures"] == ["Qwen2ForCausalLM"]  # so builtin:tiny itself is the causal-LM refusal


def test_the_study_rows_are_the_demo_with_their_rewards_and_the_verifier_rows_filter():
    """scripts/studies/reward_models.py's rows laid over the demo: the rule row is the demo itself, the others
    change the rewards and (the verifier row only) dapo.filter_metric, with the demo's eval schedule."""
    from dapo_train.config.load import load_config
    from dapo_train.run.folder import config_differences

    import reward_models
    from ablation import TASKS, row_config

    rows = {name: row_config(TASKS["tiny"], reward_models.ROWS_DIR / f"{name}.yaml", reward_models.SCHEDULE)
            for name in reward_models.ROWS}
    assert sorted(p.stem for p in reward_models.ROWS_DIR.glob("*.yaml")) == sorted(rows)
    skip = ("run_name", "output_dir", "eval.print_samples")
    assert config_differences(load_config(str(TASKS["tiny"]), []), rows["rule"], skip=skip) == []
    changed = {name: sorted({key.partition(".")[0] if key.startswith("rewards.") else key
                             for key, _, _ in config_differences(rows["rule"], cfg, skip=skip)})
               for name, cfg in rows.items()}
    assert changed == {"rule": [], "verifier": ["dapo.filter_metric", "rewards"], "both": ["rewards"]}
    assert [r.name for r in rows["both"].rewards] == ["accuracy", "reward_model", "overlong"]
    assert (rows["both"].eval.every_steps, rows["both"].eval.num_items, rows["both"].eval.final_full) == (10, 100, True)
