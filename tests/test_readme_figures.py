"""The README's demo figures are what the demo prints: one `dapo-train run` exactly as a user runs it (a
fresh folder, no argument: the embedded demo, seed 0, one torch thread), its logged figures against
README.md's marked block (scripts/build/readme_figures.py; about 90 s on 2 cores). The figures are exact
on the kind of machine the block names (torch's kernels and the processor): elsewhere they round
differently after some 30 steps, and the comparison says so and is skipped. That the check catches an
edited figure is shown on hand-written figures, on any machine."""

import re

import pytest
import readme_figures

README = readme_figures.README.read_text(encoding="utf-8")


def test_the_readme_states_what_the_demo_prints(tmp_path):
    stated, here = readme_figures.stated_machine(README), readme_figures.machine()
    assert stated is not None, "the README's block names the machine its figures come from"
    if stated != here:
        pytest.skip(f"the README's demo figures are for {stated}; this is {here}, whose kernels round differently")
    run_dir, _ = readme_figures.run_demo(tmp_path)
    problem = readme_figures.difference(README, readme_figures.read_figures(run_dir))
    assert problem is None, (
        f"{problem}\nREADME.md's demo figures are not this machine's demo; if the code changed them, rewrite "
        "them: python scripts/build/readme_figures.py --write"
    )


# Hand-written figures of a demo run (any values a run could log), and the measured part of the block.
FIGURES = readme_figures.Figures(
    kernels="AVX512 kernels on an AMD EPYC", accuracies=((0, 0.16), (10, 0.23), (20, 0.3), (30, 0.29), (40, 0.26)),
    eval_items=100, final=0.33, final_low=0.2904, final_high=0.3721, final_items=500, warm_start=0.238,
    generated_per_trained=2.0712, forward_per_trained=1.5249, padding=0.0, head_tokens=83311, trained_tokens=83311,
)
MEASURED = readme_figures.Measured(94, 2, "2026-12-05")


def test_an_edited_figure_fails_the_check_and_the_measured_time_does_not():
    """In a README that states FIGURES, every number but the measured time, core count and date, changed in
    its last digit, fails the check, and so does another machine's name; the measured part is the README's
    own, and the machine is read back from the block."""
    readme = readme_figures.rewrite(README, FIGURES, MEASURED)
    assert readme_figures.difference(readme, FIGURES) is None
    assert readme_figures.stated_machine(readme) == FIGURES.kernels
    block = readme_figures.block(readme)
    prose = " ".join(block.split())
    assert "0.23 / 0.30 / 0.29 / 0.26 at steps 10-40" in prose and "0.330 at the end (95% CI 0.290-0.372)" in prose
    assert "2.07 tokens" in prose and "1.52 positions" in prose and "83,311 trained tokens" in prose
    kept = readme_figures.MEASURED.search(block).span()
    numbers = [m for m in re.finditer(r"\d", block) if not kept[0] <= m.start() < kept[1]
               and not block[m.end():m.end() + 1].isdigit()]  # each number's last digit
    assert len(numbers) >= 15, block  # 5 accuracies, the final one and its interval, the work figures
    for number in numbers:
        edited = f"{block[:number.start()]}{(int(number[0]) + 1) % 10}{block[number.end():]}"
        assert readme_figures.difference(readme.replace(block, edited), FIGURES) is not None, edited
    assert readme_figures.difference(readme.replace("AVX512", "AVX2"), FIGURES) is not None
    retimed = readme.replace(block[kept[0]:kept[1]], "999 s with start-up on a 64-core CPU, 2031-01-01")
    assert retimed != readme and readme_figures.difference(retimed, FIGURES) is None
