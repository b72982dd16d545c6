"""The evals around a run's steps (loop.py decides when): every rank generates its slice of the fixed items, the
main process writes the per-item records, and every eval after step 0 is paired with step 0's (the change,
strict and answer accuracy, with its interval and the sign test of the items lost and gained;
evaluation/stats.change_from_start), which regression.py tests for a run that makes its model worse. With
eval.samples = K, each periodic eval also draws K samples per item as the rollout does, paired with step 0's
the same way (evaluation/sampled.py). Every eval decodes through the rollout's weights
(rollout/engines.eval_decoding)."""

from __future__ import annotations

import logging
import time

from tqdm.auto import tqdm  # eval's sample completions, written around the bar

from dapo_train.config.schema import Config
from dapo_train.evaluation.generate import EvalStopped, add_model_scores, eval_max_new_tokens, eval_records
from dapo_train.evaluation.sampled import sampled_metrics
from dapo_train.evaluation.stats import change_from_start, change_metrics, summarize_records
from dapo_train.model.loading import compute_dtype
from dapo_train.rollout.engines import eval_decoding, eval_engine
from dapo_train.run.eval_items import FINAL, PERIODIC, SAMPLED, EvalKind, items_path, read_items, write_items
from dapo_train.run.logs import read_metrics
from dapo_train.run.rollouts import excerpt
from dapo_train.run.signals import StopRequested
from dapo_train.task.answers import answer_check
from dapo_train.task.prompts import Prompt
from dapo_train.train import distributed
from dapo_train.train.regression import RegressionWatch, Rule, best_text
from dapo_train.train.session import Run

logger = logging.getLogger(__name__)


def evaluate(run: Run, prompts: list[Prompt], kind: EvalKind = PERIODIC, records: list[dict] | None = None,
             stop: StopRequested | None = None) -> tuple[dict, list[dict]]:
    """Greedy accuracy on `prompts`, each rank generating its slice (or the given `records` of these
    prompts, already generated) and scoring it with the reward models; the main process writes the per-item records
    (eval_items/<kind>_<step>.jsonl) and prints a few sample completions of a periodic eval. Step 0's periodic
    records are kept (run.start_records); every later eval adds its change from them, paired on the items both
    hold (stats.change_from_start), and a periodic one the bound its regression test is held to. A periodic eval
    adds the sampled one with eval.samples (evaluate_sampled). A `stop` requested on any rank before its last
    chunk raises EvalStopped on every rank, nothing written. -> (metrics under the kind's keys, records in item
    order)."""
    cfg = run.cfg
    start = time.perf_counter()
    if records is None:
        records = _generate(run, prompts, kind, stop)
    if distributed.is_main():
        write_items(run.run_dir, kind, run.step, records)
        shown = cfg.eval.print_samples if kind is PERIODIC else 0  # the final eval's items are the subset's and more
        for record in records[:shown]:
            tqdm.write(
                f"  [eval step {run.step}] gold={record['gold']} got={record['extracted']} correct={record['correct']}"
                f"\n    {excerpt(record['completion'])}"
            )
    summary = summarize_records(records, samples=1)
    if kind is PERIODIC and run.step == 0:
        run.start_records = records  # every later eval is paired with these
    elif run.start_records is not None:
        summary.update(change_metrics(change_from_start(run.start_records, records)))
        if kind is PERIODIC and "change_p" in summary:
            summary["regression_bound"] = Rule.of(cfg).bound  # what regression.py holds this eval's tests to
    metrics = {kind.accuracy if key == "accuracy" else f"{kind.prefix}{key}": value
               for key, value in summary.items() if key != "samples"}
    metrics[kind.seconds] = time.perf_counter() - start
    if kind is PERIODIC and cfg.eval.samples:
        metrics.update(evaluate_sampled(run, prompts, stop))
    return metrics, records


def evaluate_sampled(run: Run, prompts: list[Prompt], stop: StopRequested | None = None) -> dict:
    """eval.samples = K completions per item of `prompts` drawn as the rollout draws them (its temperature, top_p
    and top_k), seeded by the run's seed: the same random stream at every eval, so that a change from step 0 is
    the model's and not the draw's, and the training's streams untouched (generate._seeded). The main process
    writes eval_items/sampled_<step>.jsonl; step 0's records are kept (run.start_sampled) and every later eval
    is paired with them. -> metrics under eval/sampled/ (evaluation/sampled.py) and its seconds."""
    start = time.perf_counter()
    records = _generate(run, prompts, SAMPLED, stop, samples=run.cfg.eval.samples)
    if distributed.is_main():
        write_items(run.run_dir, SAMPLED, run.step, records)
    if run.step == 0:
        run.start_sampled = records
    metrics = sampled_metrics(records, run.cfg.eval.samples, run.start_sampled if run.step else None)
    return {**{f"{SAMPLED.prefix}{key}": value for key, value in metrics.items()},
            SAMPLED.seconds: time.perf_counter() - start}


def _generate(run: Run, prompts: list[Prompt], kind: EvalKind, stop: StopRequested | None,
              samples: int = 1) -> list[dict]:
    """Every rank's slice of the eval's records (`samples` per item, consecutive), gathered in item order on
    every rank; EvalStopped on every rank once they have gathered, when a stop ended any rank's slice. Reward
    models score the greedy records only."""
    cfg = run.cfg
    shard, items = prompts[distributed.rank() :: distributed.world_size()], []
    precision = compute_dtype(cfg, run.accelerator.device.type == "cuda")
    with distributed.full_weights(run.accelerator, run.model) as model, \
            eval_decoding(run.engine, model, precision) as decoder:
        if shard:
            try:
                records = eval_records(decoder, run.tokenizer, shard, max_new_tokens=eval_max_new_tokens(cfg),
                                       batch_size=cfg.eval.batch_size, check=answer_check(cfg.data.correctness),
                                       tools=run.tool_turns, progress=_eval_bar(cfg, kind),
                                       engine=eval_engine(run.engine), stop=stop, **_sampling(cfg, samples))
                if samples == 1:
                    add_model_scores(run.reward_set, shard, records)
                items = [records[i : i + samples] for i in range(0, len(records), samples)]
            except EvalStopped:
                items = None
    parts = distributed.gather(items)
    if any(part is None for part in parts):
        raise EvalStopped
    return [record for item in distributed.interleave(parts) for record in item]


def _sampling(cfg: Config, samples: int) -> dict:
    """eval_records' options for `samples` per item: greedy for one, else the rollout's distribution, seeded."""
    if samples == 1:
        return {}
    r = cfg.rollout
    return {"samples": samples, "temperature": r.temperature, "top_p": r.top_p, "top_k": r.top_k, "seed": cfg.seed}


def _eval_bar(cfg: Config, kind: EvalKind) -> str | None:
    """The label of the final eval's bar over its items, on the main process (logging.progress_bar); the
    periodic evals stay quiet: one generate call each at the default eval.batch_size."""
    return "final eval" if kind is FINAL and cfg.logging.progress_bar and distributed.is_main() else None


def resume_start(run: Run) -> None:
    """A resumed run's step-0 records, greedy and sampled (every eval's change is paired on them), and its evals
    against them so far (metrics.jsonl up to the checkpoint), where the run kept them."""
    start, sampled = items_path(run.run_dir, PERIODIC, 0), items_path(run.run_dir, SAMPLED, 0)
    run.start_records = read_items(start) if start.is_file() else None
    run.start_sampled = read_items(sampled) if sampled.is_file() else None
    run.regression = RegressionWatch.from_rows(read_metrics(run.run_dir))


def regression(run: Run, metrics: dict) -> str | None:
    """Step `run.step`'s eval against step 0 (train/regression.py), said once, the first time the run has
    regressed: -> the line when eval.stop_on_regression stops the run here (its exit line says it), else None,
    the line then a warning naming the best checkpoint as the run goes on."""
    line = run.regression.record(run.step, metrics, Rule.of(run.cfg))
    if line is None or run.cfg.eval.stop_on_regression:
        return line
    if distributed.is_main():
        logger.warning("%s; %s; going on (eval.stop_on_regression=false)", line,
                       best_text(run.best, run.cfg.checkpoint.keep_best))
    return None
