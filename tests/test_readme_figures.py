"""The README's demo figures are what the demo prints on this machine: one `dapo-train run` exactly as a
user runs it (a fresh folder, no argument: the embedded demo, seed 0, one torch thread), its logged
figures against README.md's marked block (scripts/build/readme_figures.py; about 90 s on 2 cores)."""

import re

import pytest
import readme_figures

README = readme_figures.README.read_text(encoding="utf-8")


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    run_dir, _ = readme_figures.run_demo(tmp_path_factory.mktemp("clone"))
    return readme_figures.read_figures(run_dir)


def test_the_readme_states_what_the_demo_prints(demo):
    problem = readme_figures.difference(README, demo)
    assert problem is None, (
        f"{problem}\nREADME.md's demo figures are not this machine's demo (torch kernels here: {demo.kernels}); if "
        "the code changed them, rewrite them on the CI machine: python scripts/build/readme_figures.py --write"
    )


def test_an_edited_figure_fails_the_check_and_the_measured_time_does_not(demo):
    """In a README that states this run (its block rewritten), every number but the measured time, core
    count and date, changed in its last digit, fails the check, and so does other kernels' name; the
    measured part is the README's own."""
    said = readme_figures.MEASURED.search(readme_figures.block(README))
    assert said is not None, "the block says how long the demo took, on how many cores, when"
    measured = readme_figures.Measured(int(said[1]), int(said[2]), said[3])
    readme = readme_figures.rewrite(README, demo, measured)
    block = readme_figures.block(readme)
    kept = readme_figures.MEASURED.search(block).span()
    numbers = [m for m in re.finditer(r"\d", block) if not kept[0] <= m.start() < kept[1]
               and not block[m.end():m.end() + 1].isdigit()]  # each number's last digit
    assert len(numbers) >= 15, block  # 5 accuracies, the final one and its interval, the work figures
    for number in numbers:
        edited = f"{block[:number.start()]}{(int(number[0]) + 1) % 10}{block[number.end():]}"
        assert readme_figures.difference(readme.replace(block, edited), demo) is not None, edited
    assert readme_figures.difference(readme.replace(demo.kernels, "NEON"), demo) is not None
    retimed = readme.replace(block[kept[0]:kept[1]], "999 s with start-up on a 64-core CPU, 2031-01-01")
    assert retimed != readme and readme_figures.difference(retimed, demo) is None
