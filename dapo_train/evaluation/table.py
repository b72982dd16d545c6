"""Rows of text cells as an aligned table, the form `dapo-train eval` and `dapo-train compare` print, and the
table `dapo-train eval` prints: one row per evaluated model."""

from __future__ import annotations

from collections.abc import Sequence


def aligned_table(headers: Sequence[str], rows: Sequence[Sequence[str]], left: int = 1) -> list[str]:
    """-> the header line, a rule of dashes, one line per row. Each column is as wide as its widest
    cell and two spaces from the next; the first `left` columns (names) are flush left, the others
    (numbers) flush right, so digits line up."""
    widths = [max(len(cells[i]) for cells in [headers, *rows]) for i in range(len(headers))]

    def line(cells: Sequence[str]) -> str:
        pairs = enumerate(zip(cells, widths))
        return "  ".join(cell.ljust(width) if i < left else cell.rjust(width) for i, (cell, width) in pairs)

    return [line(headers), line(["-" * width for width in widths]), *(line(cells) for cells in rows)]


# --------------------------------------------------------------------------------------------
# The table of `dapo-train eval`.


def _percent(value: float) -> str:
    return f"{100 * value:.1f}%"


# Column header -> how one row's metrics render in it (K = samples per item).
_BASE_COLUMNS = (
    ("items", lambda m, k: str(m["num_items"])),
    ("accuracy", lambda m, k: _percent(m["accuracy"])),
    ("stderr", lambda m, k: f"{100 * m['accuracy_stderr']:.1f}"),
    ("95% CI", lambda m, k: f"[{100 * m['accuracy_ci95_low']:.1f}, {100 * m['accuracy_ci95_high']:.1f}]"),
    ("answer", lambda m, k: _percent(m["answer_accuracy"])),
    ("format gap", lambda m, k: f"{100 * m['format_gap']:+.1f}"),
    ("format", lambda m, k: _percent(m["format_rate"])),
    ("len mean", lambda m, k: f"{m['completion_length_mean']:.1f}"),
    ("len max", lambda m, k: str(m["completion_length_max"])),
    ("truncated", lambda m, k: _percent(m["truncated_rate"])),
)
_SAMPLED_COLUMNS = (
    ("pass@1", lambda m, k: _percent(m["pass@1"])),
    ("pass@K", lambda m, k: _percent(m[f"pass@{k}"])),
    ("maj@K", lambda m, k: _percent(m[f"maj@{k}"])),
)


def format_table(rows: Sequence[tuple[str, dict, Sequence[str]]], samples: int = 1) -> str:
    """One line per evaluated target (label, metrics, the rollout.tools it ran with), columns aligned; the
    tools ('off' without), then stderr and the CI in accuracy points. accuracy is strict (the answer block,
    as the reward grades), answer the gold number wherever a reader takes the final answer to be; the format
    gap (answer - strict, in points) is what the answer's format costs."""
    columns = _BASE_COLUMNS + (_SAMPLED_COLUMNS if samples > 1 else ())
    headers = ["model", "tools"] + [name.replace("K", str(samples)) for name, _ in columns]
    body = [[label, ", ".join(tools) or "off"] + [render(metrics, samples) for _, render in columns]
            for label, metrics, tools in rows]
    notes = ["accuracy: strict, the last <answer> block as the reward grades it; answer: the gold number wherever a "
             "reader takes the final answer to be (the answer block, else the last \\boxed{}, else the last number); "
             "format gap = answer - strict, in points"]
    if any("change" in metrics for _, metrics, _ in rows):
        headers += ["Δ from step 0", "Δ answer"]
        for cells, (_, metrics, _) in zip(body, rows):
            cells += [_change(metrics, "change"), _change(metrics, "answer_change")]
        items = ", ".join(sorted({str(metrics["change_items"]) for _, metrics, _ in rows if "change" in metrics}))
        notes.append(f"Δ from step 0: against the run's own eval before training (eval_items/step_0.jsonl), paired on "
                     f"the {items} items both hold, in points, with the 95% paired bootstrap interval")
    return "\n".join([*aligned_table(headers, body, left=2), *notes])


def _change(metrics: dict, key: str) -> str:
    """'+7.0 [+4.0, +10.0]' (accuracy points), or '-' without it."""
    if key not in metrics:
        return "-"
    return f"{100 * metrics[key]:+.1f} [{100 * metrics[f'{key}_low']:+.1f}, {100 * metrics[f'{key}_high']:+.1f}]"
