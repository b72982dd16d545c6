"""The kept mass under vLLM: a logits processor that records, at every token of the rows that ask for it, the
log of the probability mass top-k / top-p keep (Completion.kept_log_mass), which vLLM's own log-probs do not
give (its processed log-probs are those of the truncated, renormalised distribution).

vLLM applies an argmax-invariant processor to the temperature-scaled float32 logits just before it truncates
them; this one leaves them unchanged and computes log Z = logsumexp(truncated) - logsumexp(all) with vLLM's
own truncation (apply_top_k_top_p), so Z is that of the distribution the token was drawn from. A row asks
through SamplingParams.extra_args[KEY] (its record's name); the value at each position lands in RECORDS,
which the engine (vllm_engine.py) takes after generate: the engine runs in the trainer's process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), so the processor's writes are in the engine's memory. Imports vllm: the
engine imports this module only when it is built.
"""

from __future__ import annotations

import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor
from vllm.v1.sample.logits_processor.builtin import process_dict_updates
from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

KEY = "dapo_train_kept_mass"
RECORDS: dict[str, dict[int, float]] = {}  # record name -> {position in the request's output: log Z}


class KeptMass(LogitsProcessor):
    """Per batch index, the asking row's record name, its output so far (vLLM's live list: its length is
    the position being sampled), and its top-k and top-p."""

    def __init__(self, vllm_config, device: torch.device, is_pin_memory: bool) -> None:
        self.rows: dict[int, tuple[str, list[int], int, float]] = {}

    def is_argmax_invariant(self) -> bool:
        return True  # it changes no logit: applied, as such processors are, after the temperature

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        def asking(params, prompt_ids, output_ids):
            name = (params.extra_args or {}).get(KEY)
            return None if name is None else (name, output_ids, params.top_k, params.top_p)

        process_dict_updates(self.rows, batch_update, asking)

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        """logits (B, V), temperature-scaled: log Z of each asking row, recorded at its position."""
        indices = [index for index in self.rows if index < logits.shape[0]]
        if not indices:
            return logits
        vocab = logits.shape[1]
        rows = logits[indices].float()  # (A, V) a copy
        top_k = torch.tensor([self.rows[i][2] if 0 < self.rows[i][2] < vocab else vocab for i in indices],
                             device=logits.device)
        top_p = torch.tensor([self.rows[i][3] for i in indices], dtype=torch.float32, device=logits.device)
        kept = apply_top_k_top_p(rows.clone(), top_k, top_p)  # (A, V), -inf where cut
        log_kept = (torch.logsumexp(kept, dim=-1) - torch.logsumexp(rows, dim=-1)).tolist()  # (A,)
        for index, value in zip(indices, log_kept):
            name, output, _, _ = self.rows[index]
            RECORDS.setdefault(name, {})[len(output)] = value
        return logits
