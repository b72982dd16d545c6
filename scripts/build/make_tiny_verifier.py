"""Build `builtin:tiny-verifier` (dapo_train/assets/tiny-verifier/): an outcome verifier of the tiny
task in the sense of Cobbe et al. 2021, a sequence classifier trained on the tiny policy's own
samples labelled by the task's check, so that the reward model can be shown, tested and studied
offline.

    python scripts/build/make_tiny_verifier.py               # sample, label, train, measure, write the folder
    python scripts/build/make_tiny_verifier.py --out /tmp/v  # the same build elsewhere (compare the bytes)

1. samples: builtin:tiny (the demo's warm start) writes `--samples` completions at T=1 (the demo's
   rollout settings, 96 tokens) for every prompt of builtin:tiny-zh-math's train split, seeded;
   each is labelled correct or not by the numeric check, the one the trainer's accuracy reward uses.
2. split by prompt: every fifth train prompt's completions are held out (the verifier never sees
   those questions); the test split's first 100 prompts get samples of their own for a second
   held-out figure.
3. the model: Qwen2ForSequenceClassification with the tiny model's shape but only its first
   `--layers` decoder layers (a smaller file), initialised from the tiny model's embedding, those
   layers and its final norm; one output (num_labels 1), read at the last token.
4. training: binary cross-entropy on the logit (so sigmoid(logit) estimates P(correct)), AdamW,
   seeded order; the texts are exactly what the `reward_model` reward feeds it (format chat: the
   question as the user turn, the completion as the assistant's; rewards/model.py).
5. measurement on both held-out sets: AUC, accuracy at 0.5 (against always saying "wrong"), mean
   probability of the correct and the wrong; written to build_info.json and printed.

Deterministic: one torch thread, torch.use_deterministic_algorithms, fixed seeds; two builds give
the same bytes (docs/tiny-world.md has the time and the figures).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import shutil
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForSequenceClassification

from dapo_train.config.schema import DataConfig, ModelConfig
from dapo_train.evaluation.generate import eval_records
from dapo_train.model.loading import load_model, load_tokenizer
from dapo_train.rewards.model import Checked, RewardModel, RewardModelSettings
from dapo_train.task.locations import TINY_MODEL_DIR, TINY_VERIFIER_DIR
from dapo_train.task.prompts import load_prompt_splits

SEED = 0
MAX_NEW_TOKENS = 96  # the demo's rollout.max_new_tokens
HELD_OUT_EVERY = 5  # every fifth train prompt's completions are held out
TEST_PROMPTS = 100
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
SETTINGS = RewardModelSettings(path=str(TINY_VERIFIER_DIR), tokenizer_path=None, format="chat", max_tokens=512,
                               batch_size=64, dtype="float32", normalize="none", scale=1.0, shift=0.0)


def sample(model, tokenizer, prompts, samples: int, seed: int) -> list[dict]:
    """`samples` completions per prompt at T=1, graded by the numeric check: eval_records' records."""
    return eval_records(model, tokenizer, prompts, max_new_tokens=MAX_NEW_TOKENS, batch_size=256, samples=samples,
                        temperature=1.0, seed=seed)


def build_classifier(policy, layers: int, pad_token_id: int) -> Qwen2ForSequenceClassification:
    """The tiny model's shape with its first `layers` layers, those weights copied, one output."""
    shape = {k: v for k, v in policy.config.to_dict().items() if k not in ("id2label", "label2id")}
    shape.update(num_hidden_layers=layers, layer_types=shape["layer_types"][:layers], num_labels=1,
                 pad_token_id=pad_token_id, architectures=None)
    torch.manual_seed(SEED)
    classifier = Qwen2ForSequenceClassification(Qwen2Config(**shape)).float()
    kept = {name: tensor for name, tensor in policy.model.state_dict().items()
            if not name.startswith("layers.") or int(name.split(".")[1]) < layers}
    classifier.model.load_state_dict(kept)
    torch.nn.init.normal_(classifier.score.weight, std=0.02)
    return classifier


def train(verifier: RewardModel, records: list[dict], questions: list[str], args) -> list[float]:
    """BCE on the logit over the records, `args.epochs` passes in a seeded order. -> the mean loss per pass."""
    model = verifier.model.train().requires_grad_(True)
    ids, cut = verifier.token_ids(verifier.texts([r["completion"] for r in records], None, questions))
    assert not cut, "a training text is longer than max_tokens"
    labels = torch.tensor([float(r["correct"]) for r in records])
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    order, rng, losses = list(range(len(ids))), random.Random(SEED), []
    pad = verifier.checked.tokenizer.pad_token_id
    for _ in range(args.epochs):
        rng.shuffle(order)
        total = 0.0
        for start in range(0, len(order), args.batch_size):
            rows = order[start : start + args.batch_size]
            width = max(len(ids[i]) for i in rows)
            batch = torch.full((len(rows), width), pad, dtype=torch.long)  # (B, T), right-padded
            for row, index in enumerate(rows):
                batch[row, : len(ids[index])] = torch.tensor(ids[index])
            logits = model(input_ids=batch, attention_mask=(batch != pad).long()).logits[:, 0]  # (B,)
            loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels[rows])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            total += float(loss.detach()) * len(rows)
        losses.append(total / len(order))
        print(f"  pass {len(losses)}: loss {losses[-1]:.4f}", flush=True)
    model.eval().requires_grad_(False)
    return losses


def auc(scores: list[float], labels: list[bool]) -> float:
    """The probability that a random correct completion scores above a random wrong one (ties half)."""
    right = [s for s, y in zip(scores, labels) if y]
    wrong = [s for s, y in zip(scores, labels) if not y]
    wins = sum((r > w) + 0.5 * (r == w) for r in right for w in wrong)
    return wins / (len(right) * len(wrong))


def measure(verifier: RewardModel, records: list[dict], questions: list[str]) -> dict:
    """The verifier on held-out records: AUC, accuracy at 0.5 and its floor, mean P(correct) per label."""
    logits = verifier([r["completion"] for r in records], None, questions=questions)
    labels = [bool(r["correct"]) for r in records]
    probs = torch.sigmoid(torch.tensor(logits)).tolist()
    mean = lambda values: sum(values) / max(1, len(values))  # noqa: E731
    return {
        "completions": len(records),
        "correct_share": mean(labels),
        "auc": auc(logits, labels),
        "accuracy_at_0.5": mean([(p > 0.5) == y for p, y in zip(probs, labels)]),
        "accuracy_always_wrong": 1 - mean(labels),
        "mean_p_of_correct": mean([p for p, y in zip(probs, labels) if y]),
        "mean_p_of_wrong": mean([p for p, y in zip(probs, labels) if not y]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=TINY_VERIFIER_DIR)
    parser.add_argument("--samples", type=int, default=4, help="completions per train prompt")
    parser.add_argument("--layers", type=int, default=2, help="decoder layers kept of the tiny model's 4")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.use_deterministic_algorithms(True)
    started = time.perf_counter()

    policy, tokenizer = load_model(ModelConfig(), torch.device("cpu")), load_tokenizer(ModelConfig())
    splits = load_prompt_splits(DataConfig(), tokenizer, ["train", "test"])
    train_prompts, test_prompts = splits["train"][0], splits["test"][0][:TEST_PROMPTS]
    records = sample(policy, tokenizer, train_prompts, args.samples, SEED)
    tests = sample(policy, tokenizer, test_prompts, args.samples, SEED + 1)
    sampled = time.perf_counter() - started
    print(f"sampled {len(records)} + {len(tests)} completions in {sampled:.0f} s", flush=True)
    per = args.samples
    held = [i for i in range(len(records)) if (i // per) % HELD_OUT_EVERY == 0]
    fit = [i for i in range(len(records)) if (i // per) % HELD_OUT_EVERY != 0]

    classifier = build_classifier(policy, args.layers, tokenizer.pad_token_id)
    verifier = RewardModel(SETTINGS, Checked(str(args.out), tokenizer, "chat", SETTINGS.max_tokens), classifier)
    questions = [r["question"] for r in records]
    losses = train(verifier, [records[i] for i in fit], [questions[i] for i in fit], args)
    info = {
        "recipe": {"samples_per_prompt": per, "layers": args.layers, "epochs": args.epochs,
                   "batch_size": args.batch_size, "lr": args.lr, "seed": SEED, "max_new_tokens": MAX_NEW_TOKENS},
        "parameters": sum(p.numel() for p in classifier.parameters()),
        "training_completions": len(fit),
        "training_correct_share": sum(records[i]["correct"] for i in fit) / len(fit),
        "losses": losses,
        "held_out_train_prompts": measure(verifier, [records[i] for i in held], [questions[i] for i in held]),
        "test_prompts": measure(verifier, tests, [r["question"] for r in tests]),
    }
    args.out.mkdir(parents=True, exist_ok=True)
    classifier.save_pretrained(args.out)
    for name in TOKENIZER_FILES:  # the tiny model's own tokenizer, byte for byte
        shutil.copy(TINY_MODEL_DIR / name, args.out / name)
    info["weights_sha256"] = hashlib.sha256((args.out / "model.safetensors").read_bytes()).hexdigest()
    info["build_seconds"] = round(time.perf_counter() - started, 1)
    (args.out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    print(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
